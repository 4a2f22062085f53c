//! The differential harness: every configuration runs twice, with plain Burn on one device
//! (`ExecutionStrategy::SingleDevice`: the reference, never burn-ddp) and with `DdpStrategy` on
//! N ranks (threads or TCP ranks, each with its own `SupervisedTraining`), and everything a user
//! can observe is compared:
//! - the trained parameters and buffers (max relative difference ≤ 1e-5 with SGD, 1e-3 with Adam
//!   and AdamW: see [`parameter_tolerance`]), every rank's bit for bit alike (TCP ranks return
//!   theirs; thread ranks are compared every step by the consistency check);
//! - every item burn-train's renderer receives, training and validation, with loss, accuracy,
//!   top-2 accuracy, precision, recall and F1 (AUROC needs two classes: not on this 4-class
//!   task), item by item (iteration, epoch, count, value within 1e-4 relative);
//! - the epochs trained (early stopping on the validation loss must stop where the recorded
//!   epoch losses say, on both sides).
//!
//! Configurations are generated: a fixed core that covers every value of every dimension at
//! least once, then a random tail whose seed is printed (set `BURN_DDP_ORACLE_SEED` to replay it
//! and `BURN_DDP_ORACLE_CASES` for a longer sweep).
//!
//! What it does not cover, by design: plain Burn *training* loaders (each rank trains on a
//! contiguous slice, so the steps see other samples than one device's: exactness needs
//! `DistributedDataLoader`), plain `BatchNorm` (per-replica statistics, as PyTorch DDP without
//! `SyncBatchNorm`), dropout (the backend's random state).

use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::lr_scheduler::LrScheduler;
use burn::optim::lr_scheduler::composed::ComposedLrSchedulerConfig;
use burn::optim::lr_scheduler::cosine::CosineAnnealingLrSchedulerConfig;
use burn::optim::lr_scheduler::linear::LinearLrSchedulerConfig;
use burn::optim::lr_scheduler::step::StepLrSchedulerConfig;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{AdamConfig, AdamWConfig, GradientsParams, Optimizer, SgdConfig};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn::train::{ClassificationOutput, InferenceStep, TrainOutput, TrainStep};
use burn_ddp::{DdpConfig, ShardedOptimizer};
use burn_ddp::config::UnevenInputs;
use burn_ddp_tests::{
    Batch, BnCnn, CLASSES, FEATURES, Mlp, Recording, Run, SplitSeen, SyncBnCnn, TestBackend,
    ValidKind, deterministic, device, float_tensors, max_relative_difference, over_tcp,
    run_training, with_values,
};

// ----------------------------------------------------------------------------------------------
// The dimensions.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Model {
    /// The MLP.
    Plain,
    /// Its first layer frozen from the start.
    Frozen,
    /// Its first layer frozen, unfrozen after the second optimizer step.
    Unfrozen,
    /// A second layer that reads the first layer's weight (one `Param` in two places).
    Tied,
    /// A layer used only for batches that hold class-0 samples: unused on some steps and ranks.
    PartlyUnused,
    /// A CNN with `SyncBatchNorm` (batch statistics over every rank's samples).
    SyncBn,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Opt {
    SgdMomentum,
    Adam,
    AdamW,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scheduler {
    Constant,
    StepDecay,
    WarmupCosine,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Transport {
    Threads,
    Tcp,
}

/// One configuration.
#[derive(Debug, Clone, Copy)]
struct Case {
    world: usize,
    transport: Transport,
    model: Model,
    opt: Opt,
    sched: Scheduler,
    accumulation: Option<usize>,
    clip: bool,
    /// Optimizer-state sharding (ZeRO-1) on the burn-ddp side.
    shard: bool,
    /// Training samples (any number: the last step may be short, or leave ranks without one).
    samples: usize,
    /// Samples per step over all ranks.
    global_batch: usize,
    /// Ranks may run out of data at different steps (uneven shards, `UnevenInputs::Join`).
    join: bool,
    shuffle: bool,
    valid: ValidKind,
    valid_samples: usize,
    valid_batch: usize,
    epochs: usize,
    early_stopping: bool,
    /// A learning rate large enough that the validation loss goes up at some epoch (for early
    /// stopping).
    high_lr: bool,
    /// Train this many epochs instead (the schedule still spans `epochs`): the reference of an
    /// early-stopping case, trained as far as its losses say.
    stop_after: Option<usize>,
}

// ----------------------------------------------------------------------------------------------
// Models of the dimensions that the helpers do not have.

/// The MLP with a layer frozen (from the start, or until the second optimizer step).
#[derive(Module, Debug)]
struct Freezing<B: Backend> {
    inner: Mlp<B>,
    #[module(skip)]
    unfreeze_after: Option<usize>,
}

thread_local! {
    /// Optimizer steps taken on this thread (fresh threads run every training of the harness).
    static STEPS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

impl<B: AutodiffBackend> TrainStep for Freezing<B> {
    type Input = Batch<B>;
    type Output = ClassificationOutput<B>;

    fn step(&self, batch: Batch<B>) -> TrainOutput<ClassificationOutput<B>> {
        TrainStep::step(&self.inner, batch)
    }

    fn optimize<B2, O>(self, optim: &mut O, lr: f64, grads: GradientsParams) -> Self
    where
        B2: AutodiffBackend,
        O: Optimizer<Self, B2>,
        Self: burn::module::AutodiffModule<B2>,
    {
        let model = optim.step(lr, self, grads);
        let steps = STEPS.with(|s| {
            s.set(s.get() + 1);
            s.get()
        });
        if model.unfreeze_after == Some(steps) {
            Freezing {
                inner: model.inner.unfreeze_first(),
                unfreeze_after: None,
            }
        } else {
            model
        }
    }
}

impl<B: Backend> InferenceStep for Freezing<B> {
    type Input = Batch<B>;
    type Output = ClassificationOutput<B>;

    fn step(&self, batch: Batch<B>) -> ClassificationOutput<B> {
        InferenceStep::step(&self.inner, batch)
    }
}

/// An MLP whose second layer reads the first layer's weight, and whose `aux` layer is added to
/// the logits of class-0 samples only, and skipped when a batch has none (`aux`: present in
/// `PartlyUnused`; the tie: in `Tied`).
#[derive(Module, Debug)]
struct Special<B: Backend> {
    first: Linear<B>,
    second: Linear<B>,
    head: Linear<B>,
    aux: Linear<B>,
    activation: Relu,
    #[module(skip)]
    use_aux: bool,
}

impl<B: Backend> Special<B> {
    fn new(device: &B::Device, tied: bool, use_aux: bool) -> Self {
        let first: Linear<B> = LinearConfig::new(FEATURES, FEATURES).init(device);
        let _ = first.weight.val();
        let mut second = LinearConfig::new(FEATURES, FEATURES)
            .with_bias(false)
            .init(device);
        if tied {
            second.weight = first.weight.clone();
        }
        Self {
            first,
            second,
            head: LinearConfig::new(FEATURES, CLASSES).init(device),
            aux: LinearConfig::new(FEATURES, CLASSES).init(device),
            activation: Relu::new(),
            use_aux,
        }
    }

    fn output(&self, batch: Batch<B>) -> ClassificationOutput<B> {
        let x = self
            .activation
            .forward(self.first.forward(batch.inputs.clone()));
        let x = self.activation.forward(self.second.forward(x));
        let mut logits = self.head.forward(x);
        if self.use_aux {
            let targets: Vec<i64> = batch
                .targets
                .clone()
                .into_data()
                .convert::<i64>()
                .to_vec()
                .unwrap_or_default();
            if targets.contains(&0) {
                let mask: Vec<f32> = targets
                    .iter()
                    .map(|&t| f32::from(u8::from(t == 0)))
                    .collect();
                let n = mask.len();
                let mask = Tensor::<B, 1>::from_data(TensorData::new(mask, [n]), &logits.device())
                    .reshape([n, 1]);
                logits = logits + self.aux.forward(batch.inputs) * mask;
            }
        }
        let loss = CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits.clone(), batch.targets.clone());
        ClassificationOutput::new(loss, logits, batch.targets)
    }
}

impl<B: AutodiffBackend> TrainStep for Special<B> {
    type Input = Batch<B>;
    type Output = ClassificationOutput<B>;

    fn step(&self, batch: Batch<B>) -> TrainOutput<ClassificationOutput<B>> {
        let item = self.output(batch);
        TrainOutput::new(self, item.loss.backward(), item)
    }
}

impl<B: Backend> InferenceStep for Special<B> {
    type Input = Batch<B>;
    type Output = ClassificationOutput<B>;

    fn step(&self, batch: Batch<B>) -> ClassificationOutput<B> {
        self.output(batch)
    }
}

// ----------------------------------------------------------------------------------------------
// Running a case.

/// What one side of a comparison observed.
#[derive(Debug)]
struct Observed {
    /// Rank 0's (or the one device's) trained tensors.
    tensors: Vec<Vec<f32>>,
    /// Every other rank's, when they are separate (TCP ranks).
    others: Vec<Vec<Vec<f32>>>,
    train: SplitSeen,
    valid: SplitSeen,
}

/// The learning rate of the case's optimizer.
fn lr(case: &Case) -> f64 {
    match (case.opt, case.high_lr) {
        (_, true) => 0.3,
        (Opt::SgdMomentum, false) => 0.05,
        (Opt::Adam | Opt::AdamW, false) => 0.01,
    }
}

/// Runs `case` with the training strategy `replicas` (`None`: plain Burn on one device) on a
/// fresh thread (models keep step counts in thread-locals) and returns what it observed.
fn observe(case: &Case, replicas: Option<usize>) -> Observed {
    let case = *case;
    std::thread::scope(|s| {
        s.spawn(move || match (replicas, case.transport) {
            (Some(world), Transport::Tcp) => {
                let results = over_tcp(world, |_, group| {
                    let mut run = run_of(&case, None);
                    run.group = Some(group);
                    if case.clip {
                        run.config = run.config.clone().with_clip_grad_norm(CLIP);
                    }
                    run.config = run.config.clone().with_optimizer_sharding(case.shard);
                    train(&case, &run)
                });
                let mut sides = results.into_iter().map(|r| r.unwrap());
                let mut first = sides.next().unwrap();
                first.others = sides.map(|o| o.tensors).collect();
                first
            }
            (replicas, _) => train(&case, &run_of(&case, replicas)),
        })
        .join()
        .unwrap()
    })
}

fn run_of(case: &Case, replicas: Option<usize>) -> Run {
    let mut run = Run::new(replicas, case.global_batch, case.samples);
    run.epochs = case.stop_after.unwrap_or(case.epochs);
    run.grad_accumulation = case.accumulation;
    run.shuffle = case.shuffle;
    run.valid = case.valid;
    run.valid_samples = Some(case.valid_samples);
    run.valid_batch = case.valid_batch;
    run.early_stopping = case.early_stopping;
    run.recording = Some(Recording::default());
    run.all_metrics = true;
    let mut config = DdpConfig::default();
    if case.join {
        config = config.with_uneven_inputs(UnevenInputs::Join);
    }
    if case.clip && replicas.is_some() {
        // burn-ddp's setting; plain Burn clips in its optimizer (`Optim`). TCP ranks add it
        // with their group.
        config = config.with_clip_grad_norm(CLIP);
    }
    if replicas.is_some() {
        // Thread ranks return rank 0's model only: every rank is compared every step.
        config = config
            .with_consistency_check_every(1)
            .with_optimizer_sharding(case.shard);
    }
    run.config = config;
    run
}

/// Global-norm clipping threshold of the clipping cases.
const CLIP: f32 = 0.05;

/// Trains the case's model with its optimizer and scheduler under `run`. Plain Burn (no strategy,
/// no group) clips by the global norm in the optimizer (`Optim`), burn-ddp by its setting.
fn train(case: &Case, run: &Run) -> Observed {
    let ddp = run.replicas.is_some() || run.group.is_some();
    let clip = (case.clip && !ddp).then_some(CLIP);
    let scheduler = Sched::build(case);
    let recording = run.recording.clone().unwrap_or_default();
    let lr = scheduler;
    fn optim<M: burn::module::AutodiffModule<TestBackend>>(
        case: &Case,
        ddp: bool,
        clip: Option<f32>,
    ) -> Optim<M> {
        match ddp && case.shard {
            true => Optim::sharded(case.opt),
            false => Optim::new(case.opt, clip),
        }
    }
    let (tensors, _) = match case.model {
        Model::Plain => run_training(
            deterministic(Mlp::new(&device()), 41),
            optim(case, ddp, clip),
            lr,
            run,
        ),
        Model::Frozen | Model::Unfrozen => run_training(
            deterministic(
                Freezing {
                    inner: Mlp::new(&device()).with_first_frozen(),
                    unfreeze_after: (case.model == Model::Unfrozen).then_some(2),
                },
                41,
            ),
            optim(case, ddp, clip),
            lr,
            run,
        ),
        Model::Tied | Model::PartlyUnused => run_training(
            deterministic(
                Special::new(
                    &device(),
                    case.model == Model::Tied,
                    case.model == Model::PartlyUnused,
                ),
                41,
            ),
            optim(case, ddp, clip),
            lr,
            run,
        ),
        // burn-ddp's SyncBatchNorm against Burn's own BatchNorm on one device, from the same
        // values.
        Model::SyncBn if ddp => run_training(
            deterministic(SyncBnCnn::new(&device()), 41),
            optim(case, ddp, clip),
            lr,
            run,
        ),
        Model::SyncBn => run_training(
            with_values(
                BnCnn::new(&device()),
                &float_tensors(&deterministic(SyncBnCnn::new(&device()), 41)),
            ),
            optim(case, ddp, clip),
            lr,
            run,
        ),
    }
    .unwrap_or_else(|err| {
        panic!(
            "{case:?} ({}): {err}",
            if ddp { "burn-ddp" } else { "one device" }
        )
    });
    let (train, valid) = recording.seen();
    Observed {
        tensors,
        others: Vec::new(),
        train,
        valid,
    }
}

// ----------------------------------------------------------------------------------------------
// One optimizer type and one scheduler type for every case (fewer instantiations of the
// training code to compile); both delegate to Burn's own.

/// Burn's SGD with momentum, Adam or AdamW, with global-norm clipping for the reference (plain
/// Burn has none: its optimizers clip each parameter on its own), or wrapped in burn-ddp's
/// `ShardedOptimizer` for the sharded cases. Its state is not checkpointed (the harness does not
/// resume).
#[derive(Clone)]
enum Optim<M: burn::module::AutodiffModule<TestBackend>> {
    Sharded(Sharded<M>),
    Sgd(
        burn::optim::adaptor::OptimizerAdaptor<
            burn::optim::Sgd<burn::backend::NdArray>,
            M,
            TestBackend,
        >,
        Option<f32>,
    ),
    Adam(
        burn::optim::adaptor::OptimizerAdaptor<burn::optim::Adam, M, TestBackend>,
        Option<f32>,
    ),
    AdamW(
        burn::optim::adaptor::OptimizerAdaptor<burn::optim::AdamW, M, TestBackend>,
        Option<f32>,
    ),
}

/// Burn's optimizers in burn-ddp's `ShardedOptimizer`.
#[derive(Clone)]
enum Sharded<M: burn::module::AutodiffModule<TestBackend>> {
    Sgd(ShardedOptimizer<burn::optim::Sgd<burn::backend::NdArray>, M, TestBackend>),
    Adam(ShardedOptimizer<burn::optim::Adam, M, TestBackend>),
    AdamW(ShardedOptimizer<burn::optim::AdamW, M, TestBackend>),
}

impl<M: burn::module::AutodiffModule<TestBackend>> Optim<M> {
    /// `kind` for burn-ddp with the optimizer state sharded.
    fn sharded(kind: Opt) -> Self {
        Optim::Sharded(match Self::new(kind, None) {
            Optim::Sgd(o, _) => Sharded::Sgd(ShardedOptimizer::new(o)),
            Optim::Adam(o, _) => Sharded::Adam(ShardedOptimizer::new(o)),
            Optim::AdamW(o, _) => Sharded::AdamW(ShardedOptimizer::new(o)),
            Optim::Sharded(s) => s,
        })
    }

    fn new(kind: Opt, clip: Option<f32>) -> Self {
        match kind {
            Opt::SgdMomentum => Optim::Sgd(
                SgdConfig::new()
                    .with_momentum(Some(MomentumConfig::new().with_momentum(0.9)))
                    .init(),
                clip,
            ),
            Opt::Adam => Optim::Adam(AdamConfig::new().init(), clip),
            Opt::AdamW => Optim::AdamW(AdamWConfig::new().with_weight_decay(0.05).init(), clip),
        }
    }

    fn clip(&self) -> Option<f32> {
        match self {
            Optim::Sgd(_, c) | Optim::Adam(_, c) | Optim::AdamW(_, c) => *c,
            Optim::Sharded(_) => None,
        }
    }
}

impl<M: burn::module::AutodiffModule<TestBackend>> Optimizer<M, TestBackend> for Optim<M> {
    type Record = ();

    fn step(&mut self, lr: f64, module: M, grads: GradientsParams) -> M {
        let grads = match self.clip() {
            Some(max_norm) => burn_ddp_tests::clip_global_norm(&module, grads, max_norm),
            None => grads,
        };
        match self {
            Optim::Sgd(o, _) => o.step(lr, module, grads),
            Optim::Adam(o, _) => o.step(lr, module, grads),
            Optim::AdamW(o, _) => o.step(lr, module, grads),
            Optim::Sharded(Sharded::Sgd(o)) => o.step(lr, module, grads),
            Optim::Sharded(Sharded::Adam(o)) => o.step(lr, module, grads),
            Optim::Sharded(Sharded::AdamW(o)) => o.step(lr, module, grads),
        }
    }

    fn step_multi(&mut self, lr: f64, module: M, grads: burn::optim::MultiGradientsParams) -> M {
        match self {
            Optim::Sgd(o, _) => o.step_multi(lr, module, grads),
            Optim::Adam(o, _) => o.step_multi(lr, module, grads),
            Optim::AdamW(o, _) => o.step_multi(lr, module, grads),
            Optim::Sharded(Sharded::Sgd(o)) => o.step_multi(lr, module, grads),
            Optim::Sharded(Sharded::Adam(o)) => o.step_multi(lr, module, grads),
            Optim::Sharded(Sharded::AdamW(o)) => o.step_multi(lr, module, grads),
        }
    }

    fn to_record(&self) -> Self::Record {}

    fn load_record(self, _record: Self::Record) -> Self {
        self
    }
}

/// A constant learning rate, Burn's step decay, or Burn's linear warm-up times cosine annealing.
#[derive(Clone)]
enum Sched {
    Constant(f64),
    Step(burn::optim::lr_scheduler::step::StepLrScheduler),
    WarmupCosine(burn::optim::lr_scheduler::composed::ComposedLrScheduler),
}

impl Sched {
    fn build(case: &Case) -> Self {
        let lr = lr(case);
        let steps_per_epoch =
            case.samples.div_ceil(case.global_batch) / case.accumulation.unwrap_or(1);
        let total = (steps_per_epoch * case.epochs).max(2);
        match case.sched {
            Scheduler::Constant => Sched::Constant(lr),
            Scheduler::StepDecay => Sched::Step(
                StepLrSchedulerConfig::new(lr, (total / 3).max(1))
                    .with_gamma(0.5)
                    .init()
                    .unwrap(),
            ),
            Scheduler::WarmupCosine => Sched::WarmupCosine(
                ComposedLrSchedulerConfig::new()
                    .linear(LinearLrSchedulerConfig::new(0.1, 1.0, (total / 4).max(1)))
                    .cosine(CosineAnnealingLrSchedulerConfig::new(lr, total))
                    .init()
                    .unwrap(),
            ),
        }
    }
}

impl LrScheduler for Sched {
    type Record<B: Backend> = ();

    fn step(&mut self) -> f64 {
        match self {
            Sched::Constant(lr) => *lr,
            Sched::Step(s) => s.step(),
            Sched::WarmupCosine(s) => s.step(),
        }
    }

    fn to_record<B: Backend>(&self) -> Self::Record<B> {}

    fn load_record<B: Backend>(self, _record: Self::Record<B>) -> Self {
        self
    }
}

// ----------------------------------------------------------------------------------------------
// The comparison.

/// Relative tolerance of metric values (sums in other orders).
const METRIC_TOLERANCE: f64 = 1e-4;

fn close(a: f64, b: f64) -> bool {
    (a.is_nan() && b.is_nan()) || (a - b).abs() <= METRIC_TOLERANCE * b.abs().max(1e-3)
}

/// The epoch early stopping on the validation loss (`NoImprovementSince { n_epochs: 1 }`, epoch
/// means) must stop after, from the epoch losses `valid` recorded, or `epochs` if none.
fn expected_stop(valid: &SplitSeen, epochs: usize) -> usize {
    let mut best = (f64::MAX, 0);
    for epoch in 1..=epochs {
        let Some(loss) = valid.epoch_mean("Loss", epoch) else {
            return epoch;
        };
        if loss < best.0 {
            best = (loss, epoch);
        } else if epoch - best.1 >= 1 {
            return epoch;
        }
    }
    epochs
}

/// Compares the items of one split, over the epochs both sides trained.
fn compare_split(
    what: &str,
    one: &SplitSeen,
    ddp: &SplitSeen,
    epochs: usize,
) -> Result<(), String> {
    let keep = |s: &SplitSeen| -> Vec<burn_ddp_tests::SeenItem> {
        s.items
            .iter()
            .filter(|i| i.epoch <= epochs)
            .cloned()
            .collect()
    };
    let (one, ddp) = (keep(one), keep(ddp));
    if one.len() != ddp.len() {
        return Err(format!(
            "{what}: {} items on one device, {} with burn-ddp",
            one.len(),
            ddp.len()
        ));
    }
    for (index, (a, b)) in one.iter().zip(&ddp).enumerate() {
        if (a.epoch, a.iteration) != (b.epoch, b.iteration) {
            return Err(format!(
                "{what} item {index}: epoch {} iteration {:?} on one device, epoch {} iteration {:?} with burn-ddp",
                a.epoch, a.iteration, b.epoch, b.iteration
            ));
        }
        if a.metrics.len() != b.metrics.len() {
            return Err(format!(
                "{what} item {index}: metrics {:?} vs {:?}",
                a.metrics, b.metrics
            ));
        }
        for ((name, va, na), (other, vb, nb)) in a.metrics.iter().zip(&b.metrics) {
            if name != other || na != nb || !close(*vb, *va) {
                return Err(format!(
                    "{what} item {index} (epoch {}, iteration {:?}): {name} {va} (count {na}) on one device, {other} {vb} (count {nb}) with burn-ddp",
                    a.epoch, a.iteration
                ));
            }
        }
    }
    Ok(())
}

/// How far the trained parameters may be from one device's (max relative difference).
///
/// SGD: 1e-5, the rounding of sums taken in another order (the all-reduce's, SyncBatchNorm's).
/// Adam and AdamW: 1e-3. Their update `m / (sqrt(v) + eps)` turns the rounding of a gradient
/// near zero into a step of the learning rate's size: measured on a case that failed 1e-5,
/// burn-ddp with one replica equals plain Burn bit for bit, and three replicas differ from it by
/// 1e-4 after a few steps, from the three-way average's rounding alone. A wrong reduction (a
/// rank's gradients lost, a wrong divisor, a stale bucket) is off by far more, and every metric
/// of every item is held to 1e-4 whatever the optimizer.
fn parameter_tolerance(case: &Case) -> f32 {
    match case.opt {
        Opt::SgdMomentum => 1e-5,
        Opt::Adam | Opt::AdamW => 1e-3,
    }
}

/// Runs `case` both ways and returns the first difference (a failed run is one).
fn differential(case: &Case) -> Result<(), String> {
    let run = |case: &Case, replicas| {
        std::panic::catch_unwind(|| observe(case, replicas)).map_err(|payload| {
            payload
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default()
        })
    };
    // The reference of an early-stopping case: plain Burn without early stopping over every
    // epoch, whose recorded losses say where to stop, then trained that far. (burn-train's own
    // loop can decide before the epoch's loss reached its store: it is no reference for that.)
    let one = if case.early_stopping {
        let unstopped = Case {
            early_stopping: false,
            ..*case
        };
        let stop = expected_stop(&run(&unstopped, None)?.valid, case.epochs);
        run(
            &Case {
                stop_after: Some(stop),
                ..unstopped
            },
            None,
        )?
    } else {
        run(case, None)?
    };
    let ddp = run(case, Some(case.world))?;
    let epochs_of = |o: &Observed| o.train.items.iter().map(|i| i.epoch).max().unwrap_or(0);
    let (one_epochs, ddp_epochs) = (epochs_of(&one), epochs_of(&ddp));
    if case.early_stopping {
        // burn-ddp decides on its own recorded losses, and they must say what one device's say.
        let expected = expected_stop(&ddp.valid, case.epochs);
        if ddp_epochs != expected {
            return Err(format!(
                "burn-ddp trained {ddp_epochs} epochs, its recorded validation losses say {expected} (epoch means {:?})",
                (1..=ddp_epochs)
                    .map(|e| ddp.valid.epoch_mean("Loss", e))
                    .collect::<Vec<_>>()
            ));
        }
    }
    if one_epochs != ddp_epochs {
        return Err(format!(
            "{one_epochs} epochs on one device, {ddp_epochs} with burn-ddp"
        ));
    }
    compare_split("training", &one.train, &ddp.train, one_epochs)?;
    compare_split("validation", &one.valid, &ddp.valid, one_epochs)?;
    {
        let diff = max_relative_difference(&ddp.tensors, &one.tensors);
        let tolerance = parameter_tolerance(case);
        if diff > tolerance {
            return Err(format!(
                "parameters {diff} away from one device's (relative; tolerance {tolerance})"
            ));
        }
    }
    for (rank, tensors) in ddp.others.iter().enumerate() {
        if tensors != &ddp.tensors {
            return Err(format!("rank {} differs from rank 0", rank + 1));
        }
    }
    Ok(())
}

// ----------------------------------------------------------------------------------------------
// The configurations.

/// A case with the defaults of the core set.
fn base() -> Case {
    Case {
        world: 2,
        transport: Transport::Threads,
        model: Model::Plain,
        opt: Opt::Adam,
        sched: Scheduler::Constant,
        accumulation: None,
        clip: false,
        shard: false,
        samples: 48,
        global_batch: 16,
        join: false,
        shuffle: true,
        valid: ValidKind::Plain,
        valid_samples: 10,
        valid_batch: 4,
        epochs: 2,
        early_stopping: false,
        high_lr: false,
        stop_after: None,
    }
}

/// The fixed core: every value of every dimension at least once.
fn core() -> Vec<Case> {
    let b = base();
    vec![
        b,
        Case {
            model: Model::Frozen,
            opt: Opt::SgdMomentum,
            ..b
        },
        Case {
            model: Model::Unfrozen,
            opt: Opt::AdamW,
            world: 3,
            samples: 54,
            global_batch: 18,
            ..b
        },
        Case {
            model: Model::Tied,
            sched: Scheduler::StepDecay,
            ..b
        },
        Case {
            model: Model::PartlyUnused,
            world: 4,
            samples: 64,
            ..b
        },
        Case {
            model: Model::SyncBn,
            opt: Opt::SgdMomentum,
            transport: Transport::Tcp,
            ..b
        },
        Case {
            sched: Scheduler::WarmupCosine,
            accumulation: Some(2),
            epochs: 2,
            ..b
        },
        Case {
            clip: true,
            opt: Opt::SgdMomentum,
            world: 3,
            samples: 48,
            global_batch: 12,
            ..b
        },
        Case {
            transport: Transport::Tcp,
            world: 3,
            samples: 48,
            global_batch: 12,
            valid_samples: 11,
            valid_batch: 3,
            ..b
        },
        // A last batch smaller than the others (shards of 25, batches of 8).
        Case {
            samples: 50,
            global_batch: 16,
            shuffle: false,
            valid: ValidKind::Distributed,
            ..b
        },
        // Uneven shards and a dataset smaller than the world size, in join mode.
        Case {
            join: true,
            samples: 3,
            global_batch: 4,
            world: 4,
            ..b
        },
        Case {
            join: true,
            samples: 37,
            global_batch: 8,
            transport: Transport::Tcp,
            ..b
        },
        Case {
            early_stopping: true,
            high_lr: true,
            epochs: 6,
            opt: Opt::SgdMomentum,
            samples: 32,
            ..b
        },
        Case {
            early_stopping: true,
            high_lr: true,
            epochs: 6,
            world: 3,
            samples: 48,
            global_batch: 12,
            transport: Transport::Tcp,
            ..b
        },
        // Optimizer-state sharding: Adam, SGD with momentum and a frozen layer, AdamW with
        // weight decay on a layer unfrozen later and 3 ranks, a shared weight, clipping with a
        // step schedule, accumulation with warm-up and cosine, TCP with SyncBatchNorm.
        Case { shard: true, ..b },
        Case {
            shard: true,
            model: Model::Frozen,
            opt: Opt::SgdMomentum,
            ..b
        },
        Case {
            shard: true,
            model: Model::Unfrozen,
            opt: Opt::AdamW,
            world: 3,
            samples: 54,
            global_batch: 18,
            ..b
        },
        Case {
            shard: true,
            model: Model::Tied,
            world: 4,
            samples: 64,
            ..b
        },
        Case {
            shard: true,
            clip: true,
            opt: Opt::SgdMomentum,
            sched: Scheduler::StepDecay,
            world: 3,
            global_batch: 12,
            ..b
        },
        Case {
            shard: true,
            sched: Scheduler::WarmupCosine,
            accumulation: Some(2),
            opt: Opt::AdamW,
            ..b
        },
        Case {
            shard: true,
            model: Model::SyncBn,
            opt: Opt::SgdMomentum,
            transport: Transport::Tcp,
            ..b
        },
    ]
}

/// A small deterministic generator (the tail's seed is printed).
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 33) % n as u64) as usize
    }
}

/// A random case.
fn random(rng: &mut Rng) -> Case {
    let world = 2 + rng.below(3);
    let per_rank = 2 + rng.below(6);
    let model = [
        Model::Plain,
        Model::Frozen,
        Model::Unfrozen,
        Model::Tied,
        Model::PartlyUnused,
        Model::SyncBn,
    ][rng.below(6)];
    // Join mode refuses SyncBatchNorm.
    let join = rng.below(4) == 0 && model != Model::SyncBn;
    let steps = 2 + rng.below(4);
    // A last step of any size (none, short, fewer samples than ranks), but SyncBatchNorm needs
    // a sample on every rank in every step.
    let rest = match (rng.below(3), model) {
        (0, _) => 0,
        (_, Model::SyncBn) => world + rng.below(world * per_rank - world),
        _ => 1 + rng.below(world * per_rank - 1),
    };
    let samples = world * per_rank * steps + rest;
    Case {
        world,
        transport: if rng.below(3) == 0 {
            Transport::Tcp
        } else {
            Transport::Threads
        },
        model,
        opt: [Opt::SgdMomentum, Opt::Adam, Opt::AdamW][rng.below(3)],
        sched: [
            Scheduler::Constant,
            Scheduler::StepDecay,
            Scheduler::WarmupCosine,
        ][rng.below(3)],
        // Join refuses gradient accumulation and SyncBatchNorm.
        accumulation: (!join && rng.below(3) == 0).then_some(2),
        clip: rng.below(3) == 0,
        shard: rng.below(3) == 0,
        samples,
        global_batch: world * per_rank,
        join,
        shuffle: rng.below(4) != 0,
        valid: if rng.below(2) == 0 {
            ValidKind::Plain
        } else {
            ValidKind::Distributed
        },
        valid_samples: 5 + rng.below(12),
        valid_batch: 1 + rng.below(5),
        epochs: 1 + rng.below(3),
        early_stopping: false,
        high_lr: false,
        stop_after: None,
    }
}

#[test]
fn burn_ddp_trains_and_reports_as_plain_burn_on_one_device() {
    let seed = std::env::var("BURN_DDP_ORACLE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        });
    let tail: usize = std::env::var("BURN_DDP_ORACLE_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(24);
    let mut rng = Rng(seed);
    let cases: Vec<(String, Case)> = core()
        .into_iter()
        .enumerate()
        .map(|(i, c)| (format!("core case {i}"), c))
        .chain((0..tail).map(|i| (format!("random case {i} of seed {seed}"), random(&mut rng))))
        .collect();
    let mut failures = Vec::new();
    for (name, case) in &cases {
        if let Err(difference) = differential(case) {
            failures.push(format!("{name}: {case:?}\n  {difference}"));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} configurations differ from plain Burn on one device (replay the random ones with \
         BURN_DDP_ORACLE_SEED={seed}):\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}
