//! Shared fixtures of burn-ddp's integration tests: small models, a synthetic classification
//! dataset, a silent renderer, and one function that trains with burn-train's `Learner` either on
//! a single device (plain Burn, the reference) or with `DdpStrategy`.

use std::sync::Arc;

use burn::backend::{Autodiff, NdArray};
use burn::data::dataloader::DataLoader;
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::InMemDataset;
use burn::module::{AutodiffModule, Module, ModuleVisitor, Param};
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{BatchNorm, BatchNormConfig, Linear, LinearConfig, PaddingConfig2d, Relu};
use burn::optim::Optimizer;
use burn::optim::lr_scheduler::LrScheduler;
use burn::prelude::*;
use burn::record::{FullPrecisionSettings, NamedMpkFileRecorder};
use burn::tensor::backend::AutodiffBackend;
use burn::train::checkpoint::KeepLastNCheckpoints;
use burn::train::logger::InMemoryMetricLogger;
use burn::train::metric::MetricDefinition;
use burn::train::renderer::{
    EvaluationName, EvaluationProgress, MetricState, MetricsRenderer, MetricsRendererEvaluation,
    MetricsRendererTraining, ProgressType, TrainingProgress,
};
use burn::train::{
    ClassificationOutput, ExecutionStrategy, InferenceStep, Interrupter, Learner,
    SupervisedTraining, TrainOutput, TrainStep,
};
use burn_ddp::checkpoint::AtomicRecorder;
use burn_ddp::config::UnevenInputs;
use burn_ddp::metrics::TrainingReport;
use burn_ddp::{
    DdpConfig, DdpError, DdpStrategy, DdpTraining, DistributedDataLoader, DistributedSampler,
    ProcessGroup,
};

/// The test backend: CPU, one thread per replica.
pub type TestBackend = Autodiff<NdArray>;
/// Features per sample.
pub const FEATURES: usize = 16;
/// Classes.
pub const CLASSES: usize = 4;

/// One sample: 16 features and a class in `0..4`.
#[derive(Clone, Debug)]
pub struct Item {
    /// Input features.
    pub features: [f32; FEATURES],
    /// Class index.
    pub label: usize,
}

/// A batch: inputs `[batch, 16]`, targets `[batch]`.
#[derive(Clone, Debug)]
pub struct Batch<B: Backend> {
    /// Inputs.
    pub inputs: Tensor<B, 2>,
    /// Class indices.
    pub targets: Tensor<B, 1, Int>,
}

/// Builds batches on the requested device.
#[derive(Clone, Default)]
pub struct ItemBatcher;

impl<B: Backend> Batcher<B, Item, Batch<B>> for ItemBatcher {
    fn batch(&self, items: Vec<Item>, device: &B::Device) -> Batch<B> {
        let n = items.len();
        let features: Vec<f32> = items.iter().flat_map(|i| i.features).collect();
        let labels: Vec<i64> = items.iter().map(|i| i.label as i64).collect();
        Batch {
            inputs: Tensor::from_data(TensorData::new(features, [n, FEATURES]), device),
            targets: Tensor::from_data(TensorData::new(labels, [n]), device),
        }
    }
}

/// A deterministic, learnable dataset of `len` samples (the class is the argmax of a fixed linear
/// map of the features).
pub fn synthetic_dataset(len: usize, seed: u64) -> Vec<Item> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut next = move || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((state >> 33) as f64 / (1u64 << 31) as f64) as f32 * 2.0 - 1.0
    };
    (0..len)
        .map(|_| {
            let mut features = [0f32; FEATURES];
            features.iter_mut().for_each(|f| *f = next());
            let score = |c: usize| -> f32 {
                features
                    .iter()
                    .enumerate()
                    .map(|(i, f)| f * (((i * 7 + c * 3) % 5) as f32 - 2.0))
                    .sum()
            };
            let label = (0..CLASSES)
                .max_by(|&a, &b| score(a).total_cmp(&score(b)))
                .unwrap_or(0);
            Item { features, label }
        })
        .collect()
}

/// A two-layer perceptron (no buffers): 16 → 32 → 4.
#[derive(Module, Debug)]
pub struct Mlp<B: Backend> {
    fc1: Linear<B>,
    fc2: Linear<B>,
    activation: Relu,
}

impl<B: Backend> Mlp<B> {
    /// A new MLP on `device`.
    pub fn new(device: &B::Device) -> Self {
        Self {
            fc1: LinearConfig::new(FEATURES, 32).init(device),
            fc2: LinearConfig::new(32, CLASSES).init(device),
            activation: Relu::new(),
        }
    }

    fn forward(&self, inputs: Tensor<B, 2>) -> Tensor<B, 2> {
        self.fc2
            .forward(self.activation.forward(self.fc1.forward(inputs)))
    }

    /// The MLP with its first layer frozen (`Module::no_grad`).
    pub fn with_first_frozen(self) -> Self {
        Self {
            fc1: self.fc1.no_grad(),
            ..self
        }
    }

    /// The MLP with its first layer trainable again.
    pub fn unfreeze_first(self) -> Self {
        struct Trainable;
        impl<B: Backend> burn::module::ModuleMapper<B> for Trainable {
            fn map_float<const D: usize>(
                &mut self,
                param: Param<Tensor<B, D>>,
            ) -> Param<Tensor<B, D>> {
                param.set_require_grad(true)
            }
        }
        Self {
            fc1: self.fc1.map(&mut Trainable),
            ..self
        }
    }
}

/// The same MLP with one more layer (a replica that differs).
#[derive(Module, Debug)]
pub struct DeeperMlp<B: Backend> {
    fc1: Linear<B>,
    fc2: Linear<B>,
    extra: Linear<B>,
}

impl<B: Backend> DeeperMlp<B> {
    /// A new deeper MLP on `device`.
    pub fn new(device: &B::Device) -> Self {
        Self {
            fc1: LinearConfig::new(FEATURES, 32).init(device),
            fc2: LinearConfig::new(32, CLASSES).init(device),
            extra: LinearConfig::new(CLASSES, CLASSES).init(device),
        }
    }
}

/// A small CNN with BatchNorm (buffers): the 16 features as a 1×4×4 image.
#[derive(Module, Debug)]
pub struct BnCnn<B: Backend> {
    conv: Conv2d<B>,
    norm: BatchNorm<B>,
    fc: Linear<B>,
    activation: Relu,
}

impl<B: Backend> BnCnn<B> {
    /// A new CNN on `device`.
    pub fn new(device: &B::Device) -> Self {
        Self {
            conv: Conv2dConfig::new([1, 4], [3, 3])
                .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
                .init(device),
            norm: BatchNormConfig::new(4).init(device),
            fc: LinearConfig::new(4 * FEATURES, CLASSES).init(device),
            activation: Relu::new(),
        }
    }

    fn forward(&self, inputs: Tensor<B, 2>) -> Tensor<B, 2> {
        let [n, _] = inputs.dims();
        let x = inputs.reshape([n, 1, 4, 4]);
        let x = self
            .activation
            .forward(self.norm.forward(self.conv.forward(x)));
        self.fc.forward(x.reshape([n, 4 * FEATURES]))
    }
}

fn classify<B: Backend>(
    logits: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
) -> ClassificationOutput<B> {
    let loss = CrossEntropyLossConfig::new()
        .init(&logits.device())
        .forward(logits.clone(), targets.clone());
    ClassificationOutput::new(loss, logits, targets)
}

macro_rules! classifier_steps {
    ($model:ident) => {
        classifier_steps!($model, Backend, AutodiffBackend);
    };
    ($model:ident, $inference:path, $training:path) => {
        impl<B: $training> TrainStep for $model<B> {
            type Input = Batch<B>;
            type Output = ClassificationOutput<B>;

            fn step(&self, batch: Batch<B>) -> TrainOutput<ClassificationOutput<B>> {
                let item = classify(self.forward(batch.inputs), batch.targets);
                TrainOutput::new(self, item.loss.backward(), item)
            }
        }

        impl<B: $inference> InferenceStep for $model<B> {
            type Input = Batch<B>;
            type Output = ClassificationOutput<B>;

            fn step(&self, batch: Batch<B>) -> ClassificationOutput<B> {
                classify(self.forward(batch.inputs), batch.targets)
            }
        }
    };
}

/// An autodiff backend whose inner backend also synchronises batch statistics.
pub trait SyncAutodiff:
    AutodiffBackend<InnerBackend: burn_ddp::SyncBatchNormBackend> + burn_ddp::SyncBatchNormBackend
{
}

impl<B> SyncAutodiff for B where
    B: AutodiffBackend<InnerBackend: burn_ddp::SyncBatchNormBackend>
        + burn_ddp::SyncBatchNormBackend
{
}

classifier_steps!(Mlp);
classifier_steps!(BnCnn);
classifier_steps!(SyncBnCnn, burn_ddp::SyncBatchNormBackend, SyncAutodiff);

/// The [`BnCnn`] with burn-ddp's `SyncBatchNorm` instead of `BatchNorm`.
#[derive(Module, Debug)]
pub struct SyncBnCnn<B: Backend> {
    conv: Conv2d<B>,
    norm: burn_ddp::SyncBatchNorm<B>,
    fc: Linear<B>,
    activation: Relu,
}

impl<B: Backend> SyncBnCnn<B> {
    /// A new CNN on `device`.
    pub fn new(device: &B::Device) -> Self {
        Self {
            conv: Conv2dConfig::new([1, 4], [3, 3])
                .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
                .init(device),
            norm: burn_ddp::SyncBatchNormConfig::new(4).init(device),
            fc: LinearConfig::new(4 * FEATURES, CLASSES).init(device),
            activation: Relu::new(),
        }
    }
}

impl<B: burn_ddp::SyncBatchNormBackend> SyncBnCnn<B> {
    fn forward(&self, inputs: Tensor<B, 2>) -> Tensor<B, 2> {
        let [n, _] = inputs.dims();
        let x = inputs.reshape([n, 1, 4, 4]);
        let x = self
            .activation
            .forward(self.norm.forward(self.conv.forward(x)));
        self.fc.forward(x.reshape([n, 4 * FEATURES]))
    }
}

/// Where [`Interrupting`] finds the training's interrupter and after how many batches to use it.
static INTERRUPT: std::sync::Mutex<Option<(Interrupter, usize)>> = std::sync::Mutex::new(None);

thread_local! {
    static BATCHES: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// An MLP whose rank-1 replica asks burn-train to stop (its `Interrupter`) during its N-th batch
/// (N from [`Run::interrupt_after`]), as a user pressing Ctrl-C or a callback would.
#[derive(Module, Debug)]
pub struct Interrupting<B: Backend> {
    inner: Mlp<B>,
}

impl<B: Backend> Interrupting<B> {
    /// A new model on `device`.
    pub fn new(device: &B::Device) -> Self {
        Self {
            inner: Mlp::new(device),
        }
    }
}

impl<B: AutodiffBackend> TrainStep for Interrupting<B> {
    type Input = Batch<B>;
    type Output = ClassificationOutput<B>;

    fn step(&self, batch: Batch<B>) -> TrainOutput<ClassificationOutput<B>> {
        let batches = BATCHES.with(|b| {
            b.set(b.get() + 1);
            b.get()
        });
        if std::thread::current().name() == Some("burn-ddp-rank-1")
            && let Ok(slot) = INTERRUPT.lock()
            && let Some((interrupter, after)) = slot.as_ref()
            && batches == *after
        {
            interrupter.stop(Some("interrupted by the test"));
        }
        TrainStep::step(&self.inner, batch)
    }
}

impl<B: Backend> InferenceStep for Interrupting<B> {
    type Input = Batch<B>;
    type Output = ClassificationOutput<B>;

    fn step(&self, batch: Batch<B>) -> ClassificationOutput<B> {
        InferenceStep::step(&self.inner, batch)
    }
}

/// A renderer that shows nothing (tests read results, not progress).
pub struct SilentRenderer;

impl MetricsRendererTraining for SilentRenderer {
    fn update_train(&mut self, _state: MetricState) {}
    fn update_valid(&mut self, _state: MetricState) {}
    fn render_train(&mut self, _item: TrainingProgress, _progress: Vec<ProgressType>) {}
    fn render_valid(&mut self, _item: TrainingProgress, _progress: Vec<ProgressType>) {}
}

impl MetricsRendererEvaluation for SilentRenderer {
    fn update_test(&mut self, _name: EvaluationName, _state: MetricState) {}
    fn render_test(&mut self, _item: EvaluationProgress, _progress: Vec<ProgressType>) {}
}

impl MetricsRenderer for SilentRenderer {
    fn manual_close(&mut self) {}
    fn register_metric(&mut self, _definition: MetricDefinition) {}
}

/// Every float tensor of a module, flattened, in registration order.
pub fn float_tensors<B: Backend, M: Module<B>>(module: &M) -> Vec<Vec<f32>> {
    struct Collect(Vec<Vec<f32>>);
    impl<B: Backend> ModuleVisitor<B> for Collect {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let data = param.val().into_data().convert::<f32>();
            self.0.push(data.to_vec::<f32>().unwrap_or_default());
        }
    }
    let mut collect = Collect(Vec::new());
    module.visit(&mut collect);
    collect.0
}

/// Largest difference between two sets of tensors, relative to each tensor's largest magnitude:
/// `max over tensors of max_i |a_i - b_i| / max_i |b_i|`. A value that is not finite on either
/// side makes it infinite (`f32::max` would drop a NaN, and two runs that both ended in NaN
/// would compare as equal).
pub fn max_relative_difference(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len(), "different number of tensors");
    let differences = a.iter().zip(b).map(|(x, y)| {
        assert_eq!(x.len(), y.len(), "tensors of different sizes");
        if x.iter().chain(y).any(|v| !v.is_finite()) {
            return f32::INFINITY;
        }
        let scale = y
            .iter()
            .fold(0f32, |m, v| m.max(v.abs()))
            .max(f32::MIN_POSITIVE);
        x.iter().zip(y).fold(0f32, |m, (p, q)| m.max((p - q).abs())) / scale
    });
    differences.fold(0f32, f32::max)
}

/// The validation loader of a [`Run`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ValidKind {
    /// A `DistributedDataLoader` of world size 1 without shuffling.
    Distributed,
    /// Burn's own `DataLoaderBuilder` loader (what the README tells a Burn user to keep).
    Plain,
}

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
    /// Build the training sampler with uneven shards (join mode does it anyway).
    pub uneven_shards: bool,
    /// Shuffle the training sampler each epoch (default; seeded by `seed`).
    pub shuffle: bool,
    /// The validation loader's kind (default: a `DistributedDataLoader`).
    pub valid: ValidKind,
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
            shuffle: true,
            valid: ValidKind::Distributed,
            early_stopping: false,
            all_metrics: false,
        }
    }
}

/// One item a [`Recording`] renderer saw: its epoch, iteration and numeric metric updates.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SeenItem {
    /// burn-train's epoch (from 1).
    pub epoch: usize,
    /// The item's iteration number.
    pub iteration: Option<usize>,
    /// Metric name, the item's value, its count, in the order burn-train sent them.
    pub metrics: Vec<(String, f64, usize)>,
}

/// What a [`Recording`] renderer saw of one split (training or validation).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SplitSeen {
    /// The iteration number of every rendered item, in order.
    pub iterations: Vec<Option<usize>>,
    /// Every numeric metric update: metric name, the item's value, its count (samples).
    pub updates: Vec<(String, f64, usize)>,
    /// Every rendered item with its updates.
    pub items: Vec<SeenItem>,
    /// Updates not yet rendered (they come before their item's render).
    pending: Vec<(String, f64, usize)>,
}

impl SplitSeen {
    /// A metric's value over everything seen, weighted by each item's count, as burn-train's
    /// epoch ("running") value is.
    pub fn weighted(&self, name: &str) -> f64 {
        let (sum, count) = self
            .updates
            .iter()
            .filter(|(n, _, _)| n == name)
            .fold((0.0, 0usize), |(s, c), (_, v, n)| {
                (s + v * *n as f64, c + n)
            });
        sum / count.max(1) as f64
    }

    /// A metric's epoch value (the mean over the epoch's items, weighted by their counts, as
    /// burn-train's event store aggregates it), if the epoch has items.
    pub fn epoch_mean(&self, name: &str, epoch: usize) -> Option<f64> {
        let (sum, count) = self
            .items
            .iter()
            .filter(|i| i.epoch == epoch)
            .flat_map(|i| i.metrics.iter().filter(|(n, _, _)| n == name))
            .fold((0.0, 0usize), |(s, c), (_, v, n)| {
                (s + v * *n as f64, c + n)
            });
        (count > 0).then(|| sum / count as f64)
    }

    fn render(&mut self, item: &TrainingProgress) {
        self.iterations.push(item.iteration);
        self.items.push(SeenItem {
            epoch: item.global_progress.items_processed,
            iteration: item.iteration,
            metrics: std::mem::take(&mut self.pending),
        });
    }

    /// The item values of a metric, in order.
    pub fn values(&self, name: &str) -> Vec<f64> {
        self.updates
            .iter()
            .filter(|(n, _, _)| n == name)
            .map(|(_, v, _)| *v)
            .collect()
    }
}

/// A renderer that records what burn-train shows (shared by its clones).
#[derive(Clone, Default)]
pub struct Recording {
    seen: Arc<std::sync::Mutex<(SplitSeen, SplitSeen)>>,
    names: Arc<std::sync::Mutex<std::collections::HashMap<String, String>>>,
}

impl Recording {
    /// What was seen so far: (training, validation).
    pub fn seen(&self) -> (SplitSeen, SplitSeen) {
        self.seen.lock().map(|s| s.clone()).unwrap_or_default()
    }

    fn update(&self, valid: bool, state: MetricState) {
        if let MetricState::Numeric(entry, numeric) = state {
            let id = format!("{:?}", entry.metric_id);
            let name = self
                .names
                .lock()
                .ok()
                .and_then(|n| n.get(&id).cloned())
                .unwrap_or(id);
            let (value, count) = match numeric {
                burn::train::metric::NumericEntry::Value(v) => (v, 1),
                burn::train::metric::NumericEntry::Aggregated {
                    aggregated_value,
                    count,
                } => (aggregated_value, count),
            };
            if let Ok(mut seen) = self.seen.lock() {
                let split = if valid { &mut seen.1 } else { &mut seen.0 };
                split.updates.push((name.clone(), value, count));
                split.pending.push((name, value, count));
            }
        }
    }
}

impl MetricsRendererTraining for Recording {
    fn update_train(&mut self, state: MetricState) {
        self.update(false, state);
    }
    fn update_valid(&mut self, state: MetricState) {
        self.update(true, state);
    }
    fn render_train(&mut self, item: TrainingProgress, _progress: Vec<ProgressType>) {
        if let Ok(mut seen) = self.seen.lock() {
            seen.0.render(&item);
        }
    }
    fn render_valid(&mut self, item: TrainingProgress, _progress: Vec<ProgressType>) {
        if let Ok(mut seen) = self.seen.lock() {
            seen.1.render(&item);
        }
    }
}

impl MetricsRendererEvaluation for Recording {
    fn update_test(&mut self, _name: EvaluationName, _state: MetricState) {}
    fn render_test(&mut self, _item: EvaluationProgress, _progress: Vec<ProgressType>) {}
}

impl MetricsRenderer for Recording {
    fn manual_close(&mut self) {}
    fn register_metric(&mut self, definition: MetricDefinition) {
        if let Ok(mut names) = self.names.lock() {
            names.insert(format!("{:?}", definition.metric_id), definition.name);
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
    M::InnerModule: InferenceStep<Input = Batch<NdArray>, Output = ClassificationOutput<NdArray>>,
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
    M::InnerModule: InferenceStep<Output = ClassificationOutput<NdArray>>,
    <M::InnerModule as InferenceStep>::Input: Clone + core::fmt::Debug,
    <M as TrainStep>::Input: Clone + core::fmt::Debug,
    O: Optimizer<M, TestBackend> + 'static,
    S: LrScheduler + 'static,
    I: Send + Sync + Clone + core::fmt::Debug + 'static,
    Bt: Batcher<TestBackend, I, <M as TrainStep>::Input>
        + Batcher<NdArray, I, <M::InnerModule as InferenceStep>::Input>
        + Clone
        + 'static,
{
    let device = burn::tensor::Device::<TestBackend>::default();
    let world_size = match (&run.group, run.from_env) {
        (Some(group), _) => group.world_size(),
        // Under a launcher, the job's (from the environment, as user code would ask).
        (None, Some(_)) if burn_ddp::mechanism::Topology::from_env()?.is_some() => {
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
    let one_device = run.group.is_none() && run.replicas.is_none() && run.from_env.is_none();
    let train_loader: Arc<dyn DataLoader<TestBackend, <M as TrainStep>::Input>> =
        if one_device && !run.shuffle {
            // The reference in the dataset's order: Burn's own loader, nothing of burn-ddp's.
            burn::data::dataloader::DataLoaderBuilder::new(batcher.clone())
                .batch_size(run.global_batch)
                .build(InMemDataset::new(train))
        } else {
            Arc::new(
                DistributedDataLoader::new(
                    Arc::new(InMemDataset::new(train)),
                    batcher.clone(),
                    sampler,
                    run.global_batch / world_size,
                    device,
                )?
                .with_num_workers(run.loader_workers),
                // No `with_epoch` for resumed runs: under `DdpStrategy` the loader follows
                // burn-train's epoch, which `checkpoint(epoch)` sets.
            )
        };
    let valid_loader: Arc<dyn DataLoader<NdArray, <M::InnerModule as InferenceStep>::Input>> =
        match run.valid {
            ValidKind::Distributed => Arc::new(DistributedDataLoader::new(
                Arc::new(InMemDataset::new(valid.clone())),
                batcher,
                DistributedSampler::new(valid.len(), 1)?.without_shuffle(),
                run.valid_batch,
                device,
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
    let strategy = match (&run.group, run.replicas) {
        (Some(group), _) => DdpStrategy::with_process_group(device, group.clone()),
        (None, replicas) if run.from_env.is_some() => DdpStrategy::from_env_with(
            vec![device; replicas.unwrap_or(1)],
            &burn_ddp::group::TcpGroupOptions {
                connect_timeout: run.from_env.unwrap_or_default(),
                job: None,
            },
        )?,
        (None, Some(n)) => DdpStrategy::new(vec![device; n]),
        (None, None) => {
            let result = training
                .with_training_strategy(ExecutionStrategy::SingleDevice(device).into())
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
    type Inner = burn::backend::NdArray;
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

/// `model` with its float tensors (registration order) set to `values`, shapes checked: the same
/// starting point for two models of the same layout (e.g. `BatchNorm` and `SyncBatchNorm`).
pub fn with_values<B: Backend, M: Module<B>>(model: M, values: &[Vec<f32>]) -> M {
    struct Set<'a> {
        values: &'a [Vec<f32>],
        next: usize,
    }
    impl<B: Backend> burn::module::ModuleMapper<B> for Set<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let (id, tensor, mapper) = param.consume();
            let shape = tensor.shape();
            let values = self.values[self.next].clone();
            self.next += 1;
            assert_eq!(
                values.len(),
                shape.num_elements(),
                "tensor #{}",
                self.next - 1
            );
            let value = Tensor::<B, D>::from_data(TensorData::new(values, shape), &tensor.device());
            let value = if tensor.is_require_grad() {
                value.require_grad()
            } else {
                value
            };
            Param::from_mapped_value(id, value, mapper)
        }
    }
    let mut set = Set { values, next: 0 };
    let model = model.map(&mut set);
    assert_eq!(set.next, values.len(), "number of tensors");
    model
}

/// `model` with every parameter and frozen weight set to values that depend only on `seed` and
/// the tensor's place (buffers, e.g. BatchNorm's statistics, keep their initial values): two
/// models of one type built anywhere start alike, without sharing a random generator. Places with
/// one `ParamId` get one tensor (a shared weight stays shared).
pub fn deterministic<M: Module<TestBackend>>(model: M, seed: u64) -> M {
    use std::any::Any;
    use std::collections::HashMap;
    struct Fill {
        seed: u64,
        buffers: Vec<bool>,
        index: usize,
        by_id: HashMap<burn::module::ParamId, Box<dyn Any>>,
    }
    impl burn::module::ModuleMapper<TestBackend> for Fill {
        fn map_float<const D: usize>(
            &mut self,
            param: Param<Tensor<TestBackend, D>>,
        ) -> Param<Tensor<TestBackend, D>> {
            let index = self.index;
            self.index += 1;
            if self.buffers.get(index).copied().unwrap_or(false) {
                return param;
            }
            let (id, tensor, mapper) = param.consume();
            if let Some(shared) = self
                .by_id
                .get(&id)
                .and_then(|t| t.downcast_ref::<Tensor<TestBackend, D>>())
            {
                return Param::from_mapped_value(id, shared.clone(), mapper);
            }
            let shape = tensor.shape();
            let n = shape.num_elements();
            let fan = (n as f32).sqrt().max(1.0);
            let values: Vec<f32> = (0..n)
                .map(|j| {
                    let x = (self.seed ^ ((index as u64) << 40) ^ j as u64)
                        .wrapping_mul(0x9E37_79B9_7F4A_7C15);
                    ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0 / fan
                })
                .collect();
            let mut value = Tensor::from_data(TensorData::new(values, shape), &tensor.device());
            if tensor.is_require_grad() {
                value = value.require_grad();
            }
            self.by_id.insert(id, Box::new(value.clone()));
            Param::from_mapped_value(id, value, mapper)
        }
    }
    let buffers = burn_ddp::mechanism::ReplicaLayout::of(&model).buffer_mask();
    model.map(&mut Fill {
        seed,
        buffers,
        index: 0,
        by_id: HashMap::new(),
    })
}

/// A freshly initialised model whose lazily created parameters are materialised, so clones share
/// the same values (Burn initialises parameters lazily, per clone).
pub fn materialized<M: Module<TestBackend>>(model: M) -> M {
    let _ = burn_ddp::mechanism::value_fingerprint(&model);
    model
}

/// A copy of `model` that shares nothing with it: clones of a Burn module share their
/// `RunningState` (BatchNorm statistics), so two trainings from clones would update the same
/// statistics.
pub fn copy_of<M: AutodiffModule<TestBackend>>(model: &M) -> M {
    M::from_inner(model.valid())
}

/// The default device of the test backend.
pub fn device() -> burn::tensor::Device<TestBackend> {
    Default::default()
}

/// The Fashion-MNIST example's CNN behind a per-batch hook (for the multi-process tests: slow
/// steps, injected failures, "I am here" files).
#[derive(Module, Debug)]
pub struct ExampleCnn<B: Backend> {
    inner: fashion_mnist::model::Cnn<B>,
}

/// Called by [`ExampleCnn`] with the number of batches this thread trained so far (1-based).
pub type StepHook = Box<dyn Fn(usize) + Send + Sync>;

/// The hook of [`ExampleCnn`] in this process, set once (by the test worker program).
pub static STEP_HOOK: std::sync::OnceLock<StepHook> = std::sync::OnceLock::new();

thread_local! {
    static CNN_BATCHES: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

impl<B: Backend> ExampleCnn<B> {
    /// The example's CNN on `device`, with deterministic parameters: every value is a function of
    /// `seed` and its position, so separate processes build bit-identical models without sharing
    /// a random generator.
    pub fn deterministic(device: &B::Device, seed: u64) -> Self {
        struct Fill(u64, usize);
        impl<B: Backend> burn::module::ModuleMapper<B> for Fill {
            fn map_float<const D: usize>(
                &mut self,
                param: Param<Tensor<B, D>>,
            ) -> Param<Tensor<B, D>> {
                let (id, tensor, mapper) = param.consume();
                let shape = tensor.shape();
                let n = shape.num_elements();
                let fan = (n as f32).sqrt().max(1.0);
                let values: Vec<f32> = (0..n)
                    .map(|i| {
                        let x = (self.0 ^ ((self.1 as u64) << 32) ^ i as u64)
                            .wrapping_mul(0x9E37_79B9_7F4A_7C15);
                        ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) / fan
                    })
                    .collect();
                self.1 += 1;
                let value =
                    Tensor::<B, D>::from_data(TensorData::new(values, shape), &tensor.device());
                let value = if tensor.is_require_grad() {
                    value.require_grad()
                } else {
                    value
                };
                Param::from_mapped_value(id, value, mapper)
            }
        }
        let model = fashion_mnist::model::Cnn::new(device).map(&mut Fill(seed, 0));
        Self { inner: model }
    }
}

impl<B: AutodiffBackend> TrainStep for ExampleCnn<B> {
    type Input = fashion_mnist::data::FashionBatch<B>;
    type Output = ClassificationOutput<B>;

    fn step(&self, batch: Self::Input) -> TrainOutput<ClassificationOutput<B>> {
        let batches = CNN_BATCHES.with(|b| {
            b.set(b.get() + 1);
            b.get()
        });
        if let Some(hook) = STEP_HOOK.get() {
            hook(batches);
        }
        TrainStep::step(&self.inner, batch)
    }
}

impl<B: Backend> InferenceStep for ExampleCnn<B> {
    type Input = fashion_mnist::data::FashionBatch<B>;
    type Output = ClassificationOutput<B>;

    fn step(&self, batch: Self::Input) -> ClassificationOutput<B> {
        InferenceStep::step(&self.inner, batch)
    }
}

/// `len` synthetic Fashion-MNIST-shaped images (deterministic pixels and labels).
pub fn synthetic_images(len: usize, seed: u64) -> Vec<fashion_mnist::data::FashionItem> {
    (0..len)
        .map(|i| {
            let base = (seed as usize).wrapping_mul(131).wrapping_add(i * 7919);
            fashion_mnist::data::FashionItem {
                pixels: (0..fashion_mnist::data::PIXELS)
                    .map(|p| ((base + p * 31) % 256) as u8)
                    .collect(),
                label: ((base / 7) % 10) as u8,
            }
        })
        .collect()
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
    let world_size = match burn_ddp::mechanism::Topology::from_env()? {
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

/// The [`Mlp`] with fixed values, the same in every process (value `j` of tensor `t` from
/// `(t, j)`): a model without buffers, for multi-process runs compared with one device.
pub fn deterministic_mlp() -> Mlp<TestBackend> {
    let model = materialized(Mlp::new(&device()));
    let values: Vec<Vec<f32>> = float_tensors(&model)
        .iter()
        .enumerate()
        .map(|(t, v)| {
            (0..v.len())
                .map(|j| ((t * 7919 + j * 104_729) % 1000) as f32 / 2000.0 - 0.25)
                .collect()
        })
        .collect();
    with_values(model, &values)
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

/// Removes the variables of a surrounding job (a CI runner inside Slurm or MPI: Slurm's, Open
/// MPI's, PMIx's and Hydra's, torchrun's, burn-ddp's) from `command`, so the worker sees only the
/// job the test describes.
pub fn clean_env(command: &mut std::process::Command) -> &mut std::process::Command {
    for (key, _) in std::env::vars_os() {
        let key = key.to_string_lossy();
        let job = [
            "SLURM_",
            "OMPI_",
            "PMIX_",
            "PMI_",
            "BURN_DDP_",
            "TORCHELASTIC_",
            "MASTER_",
        ]
        .iter()
        .any(|prefix| key.starts_with(prefix))
            || ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"].contains(&key.as_ref());
        if job {
            command.env_remove(key.as_ref());
        }
    }
    command
}

/// The job identity of the tests' multi-process jobs (run id and token, as a user sets them by
/// hand for Slurm or mpirun).
pub fn test_job() -> burn_ddp::mechanism::auth::JobIdentity {
    burn_ddp::mechanism::auth::JobIdentity::new(TEST_RUN_ID, Some(TEST_TOKEN.as_bytes()))
        .expect("a valid identity")
}

/// The run id of [`test_job`].
pub const TEST_RUN_ID: &str = "burn-ddp-tests";
/// The token of [`test_job`].
pub const TEST_TOKEN: &str = "burn-ddp tests token";

/// Gives a worker process started by hand (not by the launcher) the tests' job identity.
pub fn with_test_job(command: &mut std::process::Command) -> &mut std::process::Command {
    command
        .env(burn_ddp::mechanism::auth::RUN_ID_VAR, TEST_RUN_ID)
        .env(burn_ddp::mechanism::auth::JOB_TOKEN_VAR, TEST_TOKEN)
}

/// Rank `rank`'s `i`-th input in the collective tests (exact in `f32`, different per rank).
pub fn collective_input(rank: usize, i: usize) -> f32 {
    ((rank * 31 + i * 7) % 97) as f32 * 0.37 - 11.0
}

/// Writes tensors as `u64` length then little-endian `f32` values, tensor after tensor.
pub fn write_tensors(path: &std::path::Path, tensors: &[Vec<f32>]) -> std::io::Result<()> {
    let mut bytes = Vec::new();
    for t in tensors {
        bytes.extend_from_slice(&(t.len() as u64).to_le_bytes());
        for v in t {
            bytes.extend_from_slice(&v.to_le_bytes());
        }
    }
    std::fs::write(path, bytes)
}

/// Reads what [`write_tensors`] wrote.
pub fn read_tensors(path: &std::path::Path) -> std::io::Result<Vec<Vec<f32>>> {
    let bytes = std::fs::read(path)?;
    let mut out = Vec::new();
    let mut at = 0;
    while at + 8 <= bytes.len() {
        let mut len = [0u8; 8];
        len.copy_from_slice(&bytes[at..at + 8]);
        let len = u64::from_le_bytes(len) as usize;
        at += 8;
        let end = at + 4 * len;
        if end > bytes.len() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "truncated",
            ));
        }
        out.push(
            bytes[at..end]
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        );
        at = end;
    }
    Ok(out)
}

/// Runs `f(rank, group)` for every rank of a `world_size` job whose ranks are threads of this
/// test connected by `TcpGroup`s over loopback (process mode without processes: each rank has
/// its own `SupervisedTraining`), with the store served by the test on a port the system
/// picked. The threads are named like burn-ddp's rank threads.
pub fn over_tcp<T: Send>(
    world_size: usize,
    f: impl Fn(usize, Arc<dyn ProcessGroup>) -> T + Sync,
) -> Vec<Result<T, DdpError>> {
    use burn_ddp::group::TcpGroup;
    use burn_ddp::group::TcpGroupOptions;
    use burn_ddp::mechanism::topology::{Topology, TopologySource};
    let store = burn_ddp::mechanism::store::StoreServer::bind(
        "127.0.0.1:0".parse().expect("an address"),
        &test_job(),
    )
    .expect("a store on loopback");
    let port = store.local_addr().port();
    let f = &f;
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..world_size)
            .map(|rank| {
                std::thread::Builder::new()
                    .name(format!("burn-ddp-rank-{rank}"))
                    .spawn_scoped(s, move || -> Result<T, DdpError> {
                        let topology = Topology {
                            rank,
                            world_size,
                            local_rank: rank,
                            local_world_size: world_size,
                            master_addr: "127.0.0.1".into(),
                            master_port: port,
                            agent_store: true,
                            restart_count: 0,
                            source: TopologySource::Torchrun,
                        };
                        let options = TcpGroupOptions {
                            connect_timeout: std::time::Duration::from_secs(30),
                            job: Some(test_job()),
                        };
                        let group: Arc<dyn ProcessGroup> =
                            Arc::new(TcpGroup::connect(&topology, &options)?);
                        Ok(f(rank, group))
                    })
                    .expect("a rank thread")
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a rank thread that does not panic"))
            .collect()
    })
}
