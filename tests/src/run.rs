//! The run driver: one function that trains with burn-train's `Learner` on a single device (plain Burn, the reference) or with `DdpStrategy`, and what a run may be given (optimizers, schedulers, recorders).

use std::sync::Arc;

use crate::data::TestInner;
use burn::data::dataloader::DataLoader;
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::InMemDataset;
use burn::module::AutodiffModule;
use burn::optim::Optimizer;
use burn::optim::lr_scheduler::LrScheduler;
use burn::prelude::*;
use burn::record::{FullPrecisionSettings, NamedMpkFileRecorder};

use crate::data::{Batch, ItemBatcher, TestBackend, device, synthetic_dataset, synthetic_images};
use crate::models::{ExampleCnn, INTERRUPT, deterministic_mlp};
use crate::renderers::{Recording, SilentRenderer};
use crate::values::float_tensors;
use burn::train::checkpoint::KeepLastNCheckpoints;
use burn::train::logger::InMemoryMetricLogger;
use burn::train::{
    ClassificationOutput, ExecutionStrategy, InferenceStep, Learner, SupervisedTraining, TrainStep,
};
use burn_ddp::checkpoint::AtomicRecorder;
use burn_ddp::config::UnevenInputs;
use burn_ddp::metrics::TrainingReport;
use burn_ddp::{
    DdpConfig, DdpError, DdpStrategy, DdpTraining, DistributedDataLoader, DistributedSampler,
    ProcessGroup,
};

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
    /// With the [`Interrupting`] model: rank 1 calls the interrupter during its N-th batch.
    pub interrupt_after: Option<usize>,
    /// Receives burn-train's interrupter of the training (for a scheduler or a hook of the test's
    /// own that stops it).
    pub interrupter: Option<Arc<std::sync::Mutex<Option<burn::train::Interrupter>>>>,
    /// A process group: this process is one rank of a multi-process job (`replicas` is ignored).
    pub group: Option<Arc<dyn ProcessGroup>>,
    /// burn-train's artifact directory: checkpoints go to `<dir>/checkpoint` (atomic, full
    /// precision) and the DDP state next to them.
    pub artifacts: Option<std::path::PathBuf>,
    /// Resume after the checkpoint of this epoch (burn-train's `checkpoint`; the loader follows
    /// burn-train's epoch by itself).
    pub resume_after: Option<usize>,
    /// Every checkpoint file takes this long to write (a slow disk).
    pub slow_checkpoints: Option<std::time::Duration>,
    /// Every checkpoint write fails (a full disk).
    pub failing_checkpoints: bool,
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
            slow_checkpoints: None,
            failing_checkpoints: false,
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
}

/// The trained model's float tensors and, for `DdpStrategy` runs, its report.
pub type Trained = (Vec<Vec<f32>>, Option<TrainingReport>);

/// Trains `model` with `optimizer` and `scheduler` on the synthetic dataset, with plain Burn or
/// `DdpStrategy`, and returns the trained model's float tensors. The training loader is a
/// `DistributedDataLoader` built for the run's world size, so every run sees the same samples per
/// optimizer step.
pub fn run_training<M, O, S>(
    model: M,
    optimizer: O,
    scheduler: S,
    run: &Run,
) -> Result<Trained, DdpError>
where
    M: TrainStep<Input = Batch<TestBackend>, Output = ClassificationOutput<TestBackend>>
        + AutodiffModule<TestBackend>
        + core::fmt::Display
        + 'static,
    M::InnerModule:
        InferenceStep<Input = Batch<TestInner>, Output = ClassificationOutput<TestInner>>,
    O: Optimizer<M, TestBackend> + 'static,
    S: LrScheduler + 'static,
{
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

/// [`run_training`] on any dataset: `train` and `valid` items, batched by `batcher`.
pub fn run_training_on<M, O, S, I, Bt>(
    model: M,
    optimizer: O,
    scheduler: S,
    train: Vec<I>,
    valid: Vec<I>,
    batcher: Bt,
    run: &Run,
) -> Result<Trained, DdpError>
where
    M: TrainStep<Output = ClassificationOutput<TestBackend>>
        + AutodiffModule<TestBackend>
        + core::fmt::Display
        + 'static,
    M::InnerModule: InferenceStep<Output = ClassificationOutput<TestInner>>,
    <M::InnerModule as InferenceStep>::Input: Clone + core::fmt::Debug,
    <M as TrainStep>::Input: Clone + core::fmt::Debug,
    O: Optimizer<M, TestBackend> + 'static,
    S: LrScheduler + 'static,
    I: Send + Sync + Clone + core::fmt::Debug + 'static,
    Bt: Batcher<TestBackend, I, <M as TrainStep>::Input>
        + Batcher<TestInner, I, <M::InnerModule as InferenceStep>::Input>
        + Clone
        + 'static,
{
    // Not `Copy` on every backend (wgpu's): the loaders take their own.
    let strategy_device = device();
    let world_size = match (&run.group, run.from_env) {
        (Some(group), _) => group.world_size(),
        // Under a launcher, the job's (from the environment, as user code would ask).
        (None, Some(_)) if burn_ddp::comm::topology::Topology::from_env()?.is_some() => {
            burn_ddp::world_size()
        }
        _ => run.replicas.unwrap_or(1).max(1),
    };
    let samples = train.len();
    let mut sampler = DistributedSampler::new(samples, world_size)?.with_seed(run.seed);
    if !run.shuffle {
        sampler = sampler.without_shuffle();
    }
    if run.config.uneven_inputs() == UnevenInputs::Join || run.uneven_shards {
        sampler = sampler.with_uneven_shards();
    }
    if run.padded {
        sampler = sampler.with_duplicate_padding();
    }
    let one_device = run.group.is_none() && run.replicas.is_none() && run.from_env.is_none();
    // A resumed run continues from burn-train's epoch `resume_after + 1`: sampler epoch
    // `resume_after`.
    let first_epoch = run.resume_after.unwrap_or(0) as u64;
    let train_loader: Arc<dyn DataLoader<TestBackend, <M as TrainStep>::Input>> =
        if run.train == TrainKind::Burn {
            // The same loader on both sides, but for its batch: the ranks' together is one device's.
            let batch = if one_device {
                run.global_batch
            } else {
                run.global_batch / world_size
            };
            let builder =
                burn::data::dataloader::DataLoaderBuilder::new(batcher.clone()).batch_size(batch);
            let builder = if run.shuffle {
                builder.shuffle(run.seed)
            } else {
                builder
            };
            builder.build(InMemDataset::new(train))
        } else if one_device {
            // The reference: Burn's own loader over the sampler's order, nothing of burn-ddp's.
            burn::data::dataloader::DataLoaderBuilder::new(batcher.clone())
                .batch_size(run.global_batch)
                .build(crate::data::Permuted::new(
                    train,
                    run.seed,
                    run.shuffle,
                    first_epoch,
                ))
        } else {
            Arc::new(
                DistributedDataLoader::new(
                    Arc::new(InMemDataset::new(train)),
                    batcher.clone(),
                    sampler,
                    run.global_batch / world_size,
                    device(),
                )?
                .with_num_workers(run.loader_workers),
                // No `with_epoch` for resumed runs: under `DdpStrategy` the loader follows
                // burn-train's epoch, which `checkpoint(epoch)` sets.
            )
        };
    let valid_loader: Arc<dyn DataLoader<TestInner, <M::InnerModule as InferenceStep>::Input>> =
        match run.valid {
            // The same Burn loader on both sides: one device's order is the one to match.
            ValidKind::BurnShuffled => burn::data::dataloader::DataLoaderBuilder::new(batcher)
                .batch_size(run.valid_batch)
                .shuffle(VALID_SEED)
                .build(InMemDataset::new(valid)),
            // The reference: Burn's own loader (a world-size-1 sampler's order: seed 0).
            _ if one_device => burn::data::dataloader::DataLoaderBuilder::new(batcher)
                .batch_size(run.valid_batch)
                .build(crate::data::Permuted::new(
                    valid,
                    0,
                    run.valid == ValidKind::Shuffled,
                    first_epoch,
                )),
            ValidKind::Distributed => Arc::new(DistributedDataLoader::new(
                Arc::new(InMemDataset::new(valid.clone())),
                batcher,
                DistributedSampler::new(valid.len(), 1)?.without_shuffle(),
                run.valid_batch,
                device(),
            )?),
            ValidKind::Shuffled => Arc::new(DistributedDataLoader::new(
                Arc::new(InMemDataset::new(valid.clone())),
                batcher,
                DistributedSampler::new(valid.len(), 1)?,
                run.valid_batch,
                device(),
            )?),
            ValidKind::Plain => burn::data::dataloader::DataLoaderBuilder::new(batcher)
                .batch_size(run.valid_batch)
                .build(InMemDataset::new(valid)),
        };

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
            training.renderer(recording.clone())
        }
        None => training.renderer(SilentRenderer),
    };
    if run.early_stopping {
        use burn::train::metric::store::{Aggregate, Direction, Split};
        let strategy = burn::train::MetricEarlyStoppingStrategy::new(
            &burn::train::metric::LossMetric::<TestBackend>::new(),
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
        let recorder = SlowRecorder {
            inner: AtomicRecorder::new(NamedMpkFileRecorder::<FullPrecisionSettings>::new()),
            delay: run.slow_checkpoints.unwrap_or_default(),
            fail: run.failing_checkpoints,
        };
        training = training
            .with_file_checkpointer(recorder)
            .with_checkpointing_strategy(KeepLastNCheckpoints::new(2));
        config = config.with_checkpoint_dir(directory.join("checkpoint"));
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
        (Some(group), _) => DdpStrategy::with_process_group(strategy_device, group.clone()),
        (None, replicas) if run.from_env.is_some() => DdpStrategy::from_env_with(
            vec![strategy_device; replicas.unwrap_or(1)],
            &burn_ddp::group::TcpGroupOptions {
                connect_timeout: run.from_env.unwrap_or_default(),
                job: None,
            },
        )?,
        (None, Some(n)) => DdpStrategy::new(vec![strategy_device; n]),
        (None, None) => {
            let result = training
                .with_training_strategy(ExecutionStrategy::SingleDevice(strategy_device).into())
                .launch(learner);
            return Ok((float_tensors(&result.model), None));
        }
    };
    let strategy = strategy.with_config(config);
    let handle = strategy.clone();
    let result = training.launch_ddp(learner, strategy)?;
    Ok((float_tensors(&result.model), Some(handle.report())))
}

/// `torch.nn.utils.clip_grad_norm_` on `grads` (the gradients of `module`'s parameters, each
/// `ParamId` once): what plain Burn, whose optimizers clip each parameter on its own, is given as
/// the reference of burn-ddp's `DdpConfig::with_clip_grad_norm`.
pub fn clip_global_norm<M: burn::module::AutodiffModule<TestBackend>>(
    module: &M,
    mut grads: burn::optim::GradientsParams,
    max_norm: f32,
) -> burn::optim::GradientsParams {
    use burn::module::{ModuleVisitor, Param, ParamId};
    type Inner = TestInner;
    #[derive(Default)]
    struct Ids(Vec<(ParamId, usize)>);
    impl<B: Backend> ModuleVisitor<B> for Ids {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if !self.0.iter().any(|(id, _)| *id == param.id) {
                self.0.push((param.id, D));
            }
        }
    }
    let mut ids = Ids::default();
    module.visit(&mut ids);
    fn squares<const D: usize>(grads: &burn::optim::GradientsParams, id: ParamId) -> f64 {
        grads.get::<Inner, D>(id).map_or(0.0, |g| {
            g.into_data()
                .convert::<f64>()
                .to_vec::<f64>()
                .unwrap_or_default()
                .iter()
                .map(|v| v * v)
                .sum()
        })
    }
    fn scale<const D: usize>(grads: &mut burn::optim::GradientsParams, id: ParamId, by: f32) {
        if let Some(g) = grads.remove::<Inner, D>(id) {
            grads.register::<Inner, D>(id, g.mul_scalar(by));
        }
    }
    let total: f64 = ids
        .0
        .iter()
        .map(|&(id, d)| match d {
            1 => squares::<1>(&grads, id),
            2 => squares::<2>(&grads, id),
            4 => squares::<4>(&grads, id),
            _ => 0.0,
        })
        .sum();
    let coefficient = max_norm as f64 / (total.sqrt() + 1e-6);
    if coefficient < 1.0 {
        for &(id, d) in &ids.0 {
            match d {
                1 => scale::<1>(&mut grads, id, coefficient as f32),
                2 => scale::<2>(&mut grads, id, coefficient as f32),
                4 => scale::<4>(&mut grads, id, coefficient as f32),
                _ => {}
            }
        }
    }
    grads
}

/// An optimizer that clips the gradients by their global norm ([`clip_global_norm`]) before
/// `O`'s step: plain Burn with PyTorch's clipping, the reference of burn-ddp's.
#[derive(Clone)]
pub struct GlobalNormClipped<O> {
    /// The optimizer.
    pub inner: O,
    /// The largest global 2-norm.
    pub max_norm: f32,
}

impl<M, O> Optimizer<M, TestBackend> for GlobalNormClipped<O>
where
    M: AutodiffModule<TestBackend>,
    O: Optimizer<M, TestBackend>,
{
    type Record = O::Record;

    fn step(&mut self, lr: f64, module: M, grads: burn::optim::GradientsParams) -> M {
        let grads = clip_global_norm(&module, grads, self.max_norm);
        self.inner.step(lr, module, grads)
    }

    fn step_multi(&mut self, lr: f64, module: M, grads: burn::optim::MultiGradientsParams) -> M {
        self.inner.step_multi(lr, module, grads)
    }

    fn to_record(&self) -> Self::Record {
        self.inner.to_record()
    }

    fn load_record(mut self, record: Self::Record) -> Self {
        self.inner = self.inner.load_record(record);
        self
    }
}

/// A file recorder that waits `delay` before every write (a slow disk), then writes with `inner`,
/// or fails every write when `fail` (a full disk).
#[derive(Debug, Clone, Default)]
pub struct SlowRecorder<R> {
    inner: R,
    delay: std::time::Duration,
    fail: bool,
}

impl<B: burn::tensor::backend::Backend, R: burn::record::FileRecorder<B>> burn::record::Recorder<B>
    for SlowRecorder<R>
{
    type Settings = R::Settings;
    type RecordArgs = std::path::PathBuf;
    type RecordOutput = ();
    type LoadArgs = std::path::PathBuf;

    fn save_item<I: serde::Serialize>(
        &self,
        item: I,
        file: std::path::PathBuf,
    ) -> Result<(), burn::record::RecorderError> {
        std::thread::sleep(self.delay);
        if self.fail {
            return Err(burn::record::RecorderError::Unknown(format!(
                "cannot write {}: no space left on device (the test's full disk)",
                file.display()
            )));
        }
        self.inner.save_item(item, file)
    }

    fn load_item<I: serde::de::DeserializeOwned>(
        &self,
        file: &mut std::path::PathBuf,
    ) -> Result<I, burn::record::RecorderError> {
        self.inner.load_item(file)
    }
}

impl<B: burn::tensor::backend::Backend, R: burn::record::FileRecorder<B>>
    burn::record::FileRecorder<B> for SlowRecorder<R>
{
    fn file_extension() -> &'static str {
        R::file_extension()
    }
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
    type Record<B: Backend> = ();

    fn step(&mut self) -> f64 {
        self.steps.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.lr
    }

    fn to_record<B: Backend>(&self) -> Self::Record<B> {}

    fn load_record<B: Backend>(self, _record: Self::Record<B>) -> Self {
        self
    }
}

/// Trains the example CNN for `steps` steps (per-rank batch `per_rank_batch`) as one rank of
/// `group` (or, without a group, with `replicas` threads), Adam, 1 epoch, seed 11. Returns the
/// trained model's float tensors.
pub fn train_example_cnn(
    group: Option<Arc<dyn ProcessGroup>>,
    replicas: usize,
    steps: usize,
    per_rank_batch: usize,
    config: DdpConfig,
) -> Result<Trained, DdpError> {
    train_example_cnn_for(group, replicas, steps, per_rank_batch, config, 1, None)
}

/// [`train_example_cnn`] over `epochs` epochs of `steps` steps, with checkpoints in
/// `artifacts/checkpoint` when given.
pub fn train_example_cnn_for(
    group: Option<Arc<dyn ProcessGroup>>,
    replicas: usize,
    steps: usize,
    per_rank_batch: usize,
    config: DdpConfig,
    epochs: usize,
    artifacts: Option<std::path::PathBuf>,
) -> Result<Trained, DdpError> {
    let world_size = group.as_ref().map_or(replicas, |g| g.world_size());
    train_example_cnn_run(
        group,
        replicas,
        world_size,
        steps,
        per_rank_batch,
        config,
        epochs,
        artifacts,
        None,
        11,
    )
}

/// [`train_example_cnn_for`] with the strategy built by `DdpStrategy::from_env_with` (rendezvous
/// timeout `timeout`): threads without launcher variables, this process's rank under one; the
/// CNN's initial values from `init_seed`.
#[allow(clippy::too_many_arguments)]
pub fn train_example_cnn_from_env(
    replicas: usize,
    steps: usize,
    per_rank_batch: usize,
    config: DdpConfig,
    epochs: usize,
    artifacts: Option<std::path::PathBuf>,
    timeout: std::time::Duration,
    init_seed: u64,
) -> Result<Trained, DdpError> {
    // The job's world size, from the environment as user code asks it (threads: `replicas`).
    let world_size = match burn_ddp::comm::topology::Topology::from_env()? {
        Some(_) => burn_ddp::world_size(),
        None => replicas,
    };
    train_example_cnn_run(
        None,
        replicas,
        world_size,
        steps,
        per_rank_batch,
        config,
        epochs,
        artifacts,
        Some(timeout),
        init_seed,
    )
}

#[allow(clippy::too_many_arguments)]
fn train_example_cnn_run(
    group: Option<Arc<dyn ProcessGroup>>,
    replicas: usize,
    world_size: usize,
    steps: usize,
    per_rank_batch: usize,
    config: DdpConfig,
    epochs: usize,
    artifacts: Option<std::path::PathBuf>,
    from_env: Option<std::time::Duration>,
    init_seed: u64,
) -> Result<Trained, DdpError> {
    let global_batch = per_rank_batch * world_size;
    let mut run = Run::new(Some(replicas), global_batch, steps * global_batch);
    run.from_env = from_env;
    run.group = group;
    run.config = config;
    run.seed = 11;
    run.epochs = epochs;
    run.artifacts = artifacts;
    run_training_on(
        ExampleCnn::<TestBackend>::deterministic(&device(), init_seed),
        burn::optim::AdamConfig::new().init(),
        1e-3,
        synthetic_images(steps * global_batch, 3),
        synthetic_images(8, 4),
        fashion_mnist::data::FashionBatcher,
        &run,
    )
}

/// [`deterministic_mlp`] trained with SGD (learning rate 0.1) for `steps` steps of
/// `per_rank_batch` samples per rank on the [`synthetic_dataset`], as one rank of the job the
/// environment describes (`DdpStrategy::from_env_with`, rendezvous timeout `timeout`), or
/// with `group` when given.
pub fn train_mlp(
    group: Option<Arc<dyn ProcessGroup>>,
    steps: usize,
    per_rank_batch: usize,
    config: DdpConfig,
    timeout: std::time::Duration,
) -> Result<Trained, DdpError> {
    let world_size = match &group {
        Some(group) => group.world_size(),
        None => burn_ddp::world_size(),
    };
    let global_batch = per_rank_batch * world_size;
    let mut run = Run::new(Some(1), global_batch, steps * global_batch);
    if group.is_none() {
        run.from_env = Some(timeout);
    }
    run.group = group;
    run.config = config;
    run_training(
        deterministic_mlp(),
        burn::optim::SgdConfig::new().init(),
        0.1,
        &run,
    )
}
