//! The run driver: one function that trains with burn-train's `Learner` on a single device
//! (plain Burn, the reference: `ExecutionStrategy::SingleDevice`) or with `DdpStrategy`, and what
//! a run may be given (a counting scheduler, an interrupter, checkpoints).

use std::sync::Arc;

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::{DataLoader, DataLoaderBuilder};
use burn::data::dataset::InMemDataset;
use burn::optim::lr_scheduler::module_lr_scheduler::ModuleLrScheduler;
use burn::optim::lr_scheduler::{LrScheduler, LrSchedulerRecord};
use burn::optim::{LearningRate, ModuleOptimizer};
use burn::train::logger::InMemoryMetricLogger;
use burn::train::{
    ClassificationOutput, ExecutionStrategy, InferenceStep, Learner, LearnerModel,
    SupervisedTraining, TrainStep,
};
use burn_ddp::config::UnevenInputs;
use burn_ddp::metrics::TrainingReport;
use burn_ddp::{
    DdpConfig, DdpError, DdpStrategy, DdpTraining, DistributedDataLoader, DistributedSampler,
    ProcessGroup,
};

use crate::data::{ItemBatcher, Permuted, device, synthetic_dataset, synthetic_images};
use crate::models::{ExampleCnn, INTERRUPT, deterministic_mlp};
use crate::renderers::{Recording, SilentRenderer};
use crate::values::float_tensors;

/// The validation loader of a [`Run`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ValidKind {
    /// A `DistributedDataLoader` of world size 1 without shuffling.
    Distributed,
    /// A `DistributedDataLoader` of world size 1 shuffled by epoch (its order follows
    /// burn-train's epoch under `DdpStrategy`).
    Shuffled,
    /// Burn's own `DataLoaderBuilder` loader (what the README tells a Burn user to keep).
    Plain,
    /// Burn's own loader built as Burn's guide builds its test loader, shuffled
    /// (`DataLoaderBuilder::new(batcher).batch_size(b).shuffle(VALID_SEED)`): one device draws a
    /// new order every epoch from the copy it makes.
    BurnShuffled,
}

/// The training loader of a [`Run`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TrainKind {
    /// A `DistributedDataLoader` built for the run's world size (one device: Burn's loader over
    /// the sampler's order).
    Distributed,
    /// Burn's own `DataLoaderBuilder` loader, shuffled by `Run::seed` when `Run::shuffle`, of the
    /// per-replica batch (one device: the global batch), as a Burn program builds it.
    Burn,
}

/// The seed of [`ValidKind::BurnShuffled`] loaders.
pub const VALID_SEED: u64 = 42;

/// The run id of the runs with checkpoints (their state files name it).
pub const CHECKPOINT_RUN_ID: &str = "burn-ddp-tests-run";

/// How to train in [`run_training`].
#[derive(Clone)]
pub struct Run {
    /// `None`: plain Burn on one device (the reference). `Some(n)`: `DdpStrategy` with `n`
    /// replicas.
    pub replicas: Option<usize>,
    /// Samples per optimizer step over all replicas (divided between them).
    pub global_batch: usize,
    /// Training samples.
    pub samples: usize,
    /// Epochs.
    pub epochs: usize,
    /// `grads_accumulation` (None: off).
    pub grad_accumulation: Option<usize>,
    /// Seed of the dataset order.
    pub seed: u64,
    /// burn-ddp configuration.
    pub config: DdpConfig,
    /// With the [`Interrupting`](crate::models::Interrupting) model: rank 1 calls the
    /// interrupter during its N-th batch.
    pub interrupt_after: Option<usize>,
    /// Receives burn-train's interrupter of the training (for a scheduler or a hook of the test's
    /// own that stops it).
    pub interrupter: Option<Arc<std::sync::Mutex<Option<burn::train::Interrupter>>>>,
    /// A process group: this process is one rank of a multi-process job (`replicas` is ignored).
    pub group: Option<Arc<dyn ProcessGroup>>,
    /// burn-train's artifact directory: checkpoints go to `<dir>/checkpoint` (burn-ddp's
    /// checkpointers, run id [`CHECKPOINT_RUN_ID`]) with the DDP state next to them.
    pub artifacts: Option<std::path::PathBuf>,
    /// Resume after the checkpoint of this epoch (burn-train's `checkpoint`; the loader follows
    /// burn-train's epoch by itself).
    pub resume_after: Option<usize>,
    /// Records what burn-train's renderer sees (with accuracy and loss metrics); `None`: silent.
    pub recording: Option<Recording>,
    /// Validation items (default: `samples`, at most 64).
    pub valid_samples: Option<usize>,
    /// Batch size of the validation loader (default 32).
    pub valid_batch: usize,
    /// Prefetch workers of the training `DistributedDataLoader` (default 0).
    pub loader_workers: usize,
    /// Build the strategy with `DdpStrategy::from_env_with` (threads or this process's rank, as
    /// the environment says), with this rendezvous timeout; `replicas` is the thread count.
    pub from_env: Option<std::time::Duration>,
    /// Build the training sampler with uneven shards (the default; join mode does it anyway).
    pub uneven_shards: bool,
    /// Build the training sampler with PyTorch's padding (samples repeated).
    pub padded: bool,
    /// Shuffle the training sampler each epoch (default; seeded by `seed`).
    pub shuffle: bool,
    /// The validation loader's kind (default: a `DistributedDataLoader`).
    pub valid: ValidKind,
    /// The training loader's kind (default: a `DistributedDataLoader`).
    pub train: TrainKind,
    /// Early stopping on the validation loss (epoch mean; no improvement since 1 epoch).
    pub early_stopping: bool,
    /// With a recording: top-2 accuracy, precision, recall and F1 besides accuracy and loss.
    pub all_metrics: bool,
}

impl Run {
    /// One epoch of `samples` samples with `global_batch` per step.
    pub fn new(replicas: Option<usize>, global_batch: usize, samples: usize) -> Self {
        Self {
            replicas,
            global_batch,
            samples,
            epochs: 1,
            grad_accumulation: None,
            seed: 7,
            config: DdpConfig::default(),
            interrupt_after: None,
            interrupter: None,
            group: None,
            artifacts: None,
            resume_after: None,
            recording: None,
            valid_samples: None,
            valid_batch: 32,
            loader_workers: 0,
            from_env: None,
            uneven_shards: false,
            padded: false,
            shuffle: true,
            valid: ValidKind::Distributed,
            train: TrainKind::Distributed,
            early_stopping: false,
            all_metrics: false,
        }
    }

    /// Whether this run is plain Burn on one device (no group, no replicas, not from the
    /// environment).
    pub fn one_device(&self) -> bool {
        self.group.is_none() && self.replicas.is_none() && self.from_env.is_none()
    }
}

/// The trained model's float tensors and, for `DdpStrategy` runs, its report.
pub type Trained = (Vec<Vec<f32>>, Option<TrainingReport>);

/// A model the run driver trains: burn-train's, classifying batches of type `In` in training
/// and validation alike.
pub trait Classifier<In>:
    LearnerModel
    + TrainStep<Input = In, Output = ClassificationOutput>
    + InferenceStep<Input = In, Output = ClassificationOutput>
    + Send
{
}

impl<In, M> Classifier<In> for M where
    M: LearnerModel
        + TrainStep<Input = In, Output = ClassificationOutput>
        + InferenceStep<Input = In, Output = ClassificationOutput>
        + Send
{
}

/// Trains `model` with `optimizer` and `scheduler` on the synthetic dataset, with plain Burn or
/// `DdpStrategy`, and returns the trained model's float tensors. The training loader is a
/// `DistributedDataLoader` built for the run's world size, so every run sees the same samples per
/// optimizer step.
///
/// # Errors
/// The strategy's error (`launch_ddp`), or burn-train's error of the run as
/// [`DdpError::InvalidConfig`] naming it.
pub fn run_training<M: Classifier<crate::data::Batch>>(
    model: M,
    optimizer: ModuleOptimizer,
    scheduler: impl Into<ModuleLrScheduler>,
    run: &Run,
) -> Result<Trained, DdpError> {
    run_training_on(
        model,
        optimizer,
        scheduler,
        synthetic_dataset(run.samples, 99),
        synthetic_dataset(run.valid_samples.unwrap_or(run.samples.min(64)), 5),
        ItemBatcher,
        run,
    )
}

/// The world size a run trains with: its group's, the launcher's (a run from the environment
/// under one), or its replicas (one device: 1).
fn world_size_of(run: &Run) -> Result<usize, DdpError> {
    Ok(match (&run.group, run.from_env) {
        (Some(group), _) => group.world_size(),
        // Under a launcher, the job's (from the environment, as user code would ask).
        (None, Some(_)) if burn_ddp::comm::topology::Topology::from_env()?.is_some() => {
            burn_ddp::world_size()
        }
        _ => run.replicas.unwrap_or(1).max(1),
    })
}

/// [`run_training`] on any dataset: `train` and `valid` items, batched by `batcher`.
///
/// # Errors
/// As [`run_training`].
pub fn run_training_on<M, In, I, Bt>(
    model: M,
    optimizer: ModuleOptimizer,
    scheduler: impl Into<ModuleLrScheduler>,
    train: Vec<I>,
    valid: Vec<I>,
    batcher: Bt,
    run: &Run,
) -> Result<Trained, DdpError>
where
    M: Classifier<In>,
    In: Clone + core::fmt::Debug + Send + Sync + 'static,
    I: Send + Sync + Clone + core::fmt::Debug + 'static,
    Bt: Batcher<I, In> + Clone + 'static,
{
    let world_size = world_size_of(run)?;
    let one_device = run.one_device();
    let train_loader = train_loader(train, batcher.clone(), run, world_size)?;
    let valid_loader = valid_loader(valid, batcher, run)?;

    let learner = Learner::new(model, optimizer, scheduler);
    let directory = run.artifacts.clone().unwrap_or_else(|| {
        std::env::temp_dir().join(format!(
            "burn-ddp-tests-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ))
    });
    let mut config = run.config.clone();
    let mut training = SupervisedTraining::new(&directory, train_loader, valid_loader)
        .num_epochs(run.epochs)
        .with_metric_logger(InMemoryMetricLogger::new())
        .with_application_logger(None);
    training = match &run.recording {
        Some(recording) => {
            use burn::train::metric::{
                AccuracyMetric, ClassReduction, FBetaScoreMetric, LossMetric, PrecisionMetric,
                RecallMetric, TopKAccuracyMetric,
            };
            let training = training.metrics((AccuracyMetric::new(), LossMetric::new()));
            let training = if run.all_metrics {
                training.metrics((
                    TopKAccuracyMetric::new(2),
                    PrecisionMetric::multiclass(1, ClassReduction::Macro),
                    RecallMetric::multiclass(1, ClassReduction::Micro),
                    FBetaScoreMetric::multiclass(1.0, 1, ClassReduction::Macro),
                ))
            } else {
                training
            };
            training.renderer(Box::new(recording.clone()))
        }
        None => training.renderer(Box::new(SilentRenderer)),
    };
    if run.early_stopping {
        use burn::train::metric::store::{Aggregate, Direction, Split};
        let strategy = burn::train::MetricEarlyStoppingStrategy::new(
            &burn::train::metric::LossMetric::new(),
            Aggregate::Mean,
            Direction::Lowest,
            Split::Valid,
            burn::train::StoppingCondition::NoImprovementSince { n_epochs: 1 },
        );
        training = training.early_stopping(strategy);
    }
    if let Some(k) = run.grad_accumulation {
        training = training.grads_accumulation(k);
    }
    if run.artifacts.is_some() {
        config = config
            .with_checkpoint_dir(directory.join("checkpoint"))
            .with_run_id(CHECKPOINT_RUN_ID);
        let [model, optim, scheduler] = config.checkpointers()?;
        training = training
            .with_custom_checkpointers(model, optim, scheduler)
            .with_checkpointing_strategy(burn::train::checkpoint::KeepLastNCheckpoints::new(2));
    }
    if let Some(epoch) = run.resume_after {
        training = training.checkpoint(epoch);
    }
    if let Some(n) = run.interrupt_after
        && let Ok(mut slot) = INTERRUPT.lock()
    {
        *slot = Some((training.interrupter(), n));
    }
    if let Some(slot) = &run.interrupter
        && let Ok(mut slot) = slot.lock()
    {
        *slot = Some(training.interrupter());
    }
    let strategy = match (&run.group, run.replicas) {
        (Some(group), _) => DdpStrategy::with_process_group(device(), group.clone()),
        (None, replicas) if run.from_env.is_some() => DdpStrategy::from_env_with(
            vec![device(); replicas.unwrap_or(1)],
            &burn_ddp::group::TcpGroupOptions {
                connect_timeout: run.from_env.unwrap_or_default(),
                job: None,
            },
        )?,
        (None, Some(n)) => DdpStrategy::new(vec![device(); n]),
        (None, None) => {
            debug_assert!(one_device);
            let result = training
                .with_training_strategy(ExecutionStrategy::SingleDevice(device()).into())
                .launch(learner);
            if let Some(error) = result.error {
                return Err(DdpError::InvalidConfig(format!(
                    "plain Burn's training failed: {error}"
                )));
            }
            return Ok((float_tensors(&result.model), None));
        }
    };
    let strategy = strategy.with_config(config);
    let handle = strategy.clone();
    let result = training.launch_ddp(learner, strategy)?;
    if let Some(error) = result.error {
        return Err(DdpError::InvalidConfig(format!(
            "burn-train's run under DdpStrategy failed: {error}"
        )));
    }
    Ok((float_tensors(&result.model), Some(handle.report())))
}

/// The training loader of `run`: Burn's own when [`TrainKind::Burn`] (the global batch on one
/// device, the per-rank batch under burn-ddp), else a `DistributedDataLoader` for `world_size`
/// ranks, or for one device Burn's loader over the sampler's order (nothing of burn-ddp's).
fn train_loader<In, I, Bt>(
    train: Vec<I>,
    batcher: Bt,
    run: &Run,
    world_size: usize,
) -> Result<Arc<dyn DataLoader<In>>, DdpError>
where
    In: Clone + core::fmt::Debug + Send + 'static,
    I: Send + Sync + Clone + core::fmt::Debug + 'static,
    Bt: Batcher<I, In> + Clone + 'static,
{
    if run.train == TrainKind::Burn {
        // The same loader on both sides, but for its batch: the ranks' together is one device's.
        let batch = if run.one_device() {
            run.global_batch
        } else {
            run.global_batch / world_size
        };
        let builder = DataLoaderBuilder::new(batcher).batch_size(batch);
        let builder = if run.shuffle {
            builder.shuffle(run.seed)
        } else {
            builder
        };
        return Ok(builder.build(InMemDataset::new(train)));
    }
    if run.one_device() {
        // A resumed run continues from burn-train's epoch `resume_after + 1`: sampler epoch
        // `resume_after`.
        let first_epoch = run.resume_after.unwrap_or(0) as u64;
        return Ok(DataLoaderBuilder::new(batcher)
            .batch_size(run.global_batch)
            .build(Permuted::new(train, run.seed, run.shuffle, first_epoch)));
    }
    let mut sampler = DistributedSampler::new(train.len(), world_size)?.with_seed(run.seed);
    if !run.shuffle {
        sampler = sampler.without_shuffle();
    }
    if run.config.uneven_inputs() == UnevenInputs::Join || run.uneven_shards {
        sampler = sampler.with_uneven_shards();
    }
    if run.padded {
        sampler = sampler.with_duplicate_padding();
    }
    // No `with_epoch` for resumed runs: under `DdpStrategy` the loader follows burn-train's
    // epoch, which `checkpoint(epoch)` sets.
    Ok(Arc::new(
        DistributedDataLoader::new(
            Arc::new(InMemDataset::new(train)),
            batcher,
            sampler,
            run.global_batch / world_size,
            device(),
        )?
        .with_num_workers(run.loader_workers),
    ))
}

/// The validation loader of `run` (its [`ValidKind`]; one device: Burn's own loader over a
/// world-size-1 sampler's order).
fn valid_loader<In, I, Bt>(
    valid: Vec<I>,
    batcher: Bt,
    run: &Run,
) -> Result<Arc<dyn DataLoader<In>>, DdpError>
where
    In: Clone + core::fmt::Debug + Send + 'static,
    I: Send + Sync + Clone + core::fmt::Debug + 'static,
    Bt: Batcher<I, In> + Clone + 'static,
{
    let first_epoch = run.resume_after.unwrap_or(0) as u64;
    let plain = || DataLoaderBuilder::new(batcher.clone()).batch_size(run.valid_batch);
    let distributed = |sampler: DistributedSampler| -> Result<Arc<dyn DataLoader<In>>, DdpError> {
        Ok(Arc::new(DistributedDataLoader::new(
            Arc::new(InMemDataset::new(valid.clone())),
            batcher.clone(),
            sampler,
            run.valid_batch,
            device().inner(),
        )?))
    };
    Ok(match run.valid {
        // The same Burn loader on both sides: one device's order is the one to match.
        ValidKind::BurnShuffled => plain()
            .shuffle(VALID_SEED)
            .build(InMemDataset::new(valid.clone())),
        // The reference: Burn's own loader (a world-size-1 sampler's order: seed 0).
        _ if run.one_device() => plain().build(Permuted::new(
            valid.clone(),
            0,
            run.valid == ValidKind::Shuffled,
            first_epoch,
        )),
        ValidKind::Distributed => {
            distributed(DistributedSampler::new(valid.len(), 1)?.without_shuffle())?
        }
        ValidKind::Shuffled => distributed(DistributedSampler::new(valid.len(), 1)?)?,
        ValidKind::Plain => plain().build(InMemDataset::new(valid.clone())),
    })
}

/// A constant learning rate that counts its scheduler steps: its clones (one per replica) add to
/// one shared count, so a run of N replicas and S optimizer steps counts N * S.
#[derive(Clone, Debug)]
pub struct CountingScheduler {
    /// The learning rate.
    pub lr: f64,
    /// Steps taken by this scheduler and its clones.
    pub steps: Arc<std::sync::atomic::AtomicUsize>,
}

impl CountingScheduler {
    /// A scheduler of constant `lr`, with its count.
    pub fn new(lr: f64) -> Self {
        Self {
            lr,
            steps: Arc::default(),
        }
    }

    /// Steps counted so far.
    pub fn count(&self) -> usize {
        self.steps.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl LrScheduler for CountingScheduler {
    fn step(&mut self) -> LearningRate {
        self.steps.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.lr
    }

    fn to_record(&self) -> LrSchedulerRecord {
        LrSchedulerRecord::default()
    }

    fn load_record(&mut self, _record: LrSchedulerRecord) {}
}

/// Trains the example CNN for `steps` steps (per-rank batch `per_rank_batch`) as one rank of
/// `group` (or, without a group, with `replicas` threads), Adam, 1 epoch, seed 11. Returns the
/// trained model's float tensors.
///
/// # Errors
/// As [`run_training`].
pub fn train_example_cnn(
    group: Option<Arc<dyn ProcessGroup>>,
    replicas: usize,
    steps: usize,
    per_rank_batch: usize,
    config: DdpConfig,
) -> Result<Trained, DdpError> {
    let world_size = group.as_ref().map_or(replicas, |g| g.world_size());
    let global_batch = per_rank_batch * world_size;
    let mut run = Run::new(Some(replicas), global_batch, steps * global_batch);
    run.group = group;
    run.config = config;
    run.seed = 11;
    run_training_on(
        ExampleCnn::deterministic(&device(), 11),
        burn::optim::AdamConfig::new().init(),
        1e-3,
        synthetic_images(steps * global_batch, 3),
        synthetic_images(8, 4),
        fashion_mnist::data::FashionBatcher,
        &run,
    )
}

/// [`deterministic_mlp`] trained with SGD (learning rate 0.1) for `steps` steps of
/// `per_rank_batch` samples per rank on the [`synthetic_dataset`], as one rank of `group`.
///
/// # Errors
/// As [`run_training`].
pub fn train_mlp(
    group: Arc<dyn ProcessGroup>,
    steps: usize,
    per_rank_batch: usize,
    config: DdpConfig,
) -> Result<Trained, DdpError> {
    let global_batch = per_rank_batch * group.world_size();
    let mut run = Run::new(Some(1), global_batch, steps * global_batch);
    run.group = Some(group);
    run.config = config;
    run_training(
        deterministic_mlp(),
        burn::optim::SgdConfig::new().init(),
        0.1,
        &run,
    )
}

/// `torch.nn.utils.clip_grad_norm_` on `grads` (the gradients of `module`'s parameters, each
/// `ParamId` once): multiplied by `max_norm / (norm + 1e-6)` when that is below 1, `norm` the
/// 2-norm of all of them together. Written here without burn-ddp: the reference of
/// `DdpConfig::with_clip_grad_norm` (Burn's own `GradientClipping` clips each tensor alone).
pub fn clip_global_norm<M: burn::module::Module>(
    module: &M,
    mut grads: burn::optim::GradientsParams,
    max_norm: f32,
) -> burn::optim::GradientsParams {
    use burn::module::{ModuleVisitor, Param, ParamId};
    use burn::tensor::Tensor;
    #[derive(Default)]
    struct Ids(Vec<(ParamId, usize)>);
    impl ModuleVisitor for Ids {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if !self.0.iter().any(|(id, _)| *id == param.id) {
                self.0.push((param.id, D));
            }
        }
    }
    fn squares<const D: usize>(grads: &burn::optim::GradientsParams, id: ParamId) -> f64 {
        grads
            .get::<D>(id)
            .map_or(0.0, |g| g.into_data().iter::<f64>().map(|v| v * v).sum())
    }
    fn scale<const D: usize>(grads: &mut burn::optim::GradientsParams, id: ParamId, by: f32) {
        if let Some(g) = grads.remove::<D>(id) {
            grads.register::<D>(id, g.mul_scalar(by));
        }
    }
    let mut ids = Ids::default();
    module.visit(&mut ids);
    let total: f64 = ids
        .0
        .iter()
        .map(|&(id, d)| match d {
            1 => squares::<1>(&grads, id),
            2 => squares::<2>(&grads, id),
            4 => squares::<4>(&grads, id),
            _ => panic!("clip_global_norm: a parameter of rank {d}"),
        })
        .sum();
    let coefficient = max_norm as f64 / (total.sqrt() + 1e-6);
    if coefficient < 1.0 {
        for &(id, d) in &ids.0 {
            match d {
                1 => scale::<1>(&mut grads, id, coefficient as f32),
                2 => scale::<2>(&mut grads, id, coefficient as f32),
                4 => scale::<4>(&mut grads, id, coefficient as f32),
                _ => panic!("clip_global_norm: a parameter of rank {d}"),
            }
        }
    }
    grads
}
