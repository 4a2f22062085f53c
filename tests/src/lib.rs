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
use burn::tensor::backend::AutodiffBackend;
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
use burn_ddp::metrics::TrainingReport;
use burn_ddp::{
    DdpConfig, DdpError, DdpStrategy, DdpTraining, DistributedDataLoader, DistributedSampler,
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
        impl<B: AutodiffBackend> TrainStep for $model<B> {
            type Input = Batch<B>;
            type Output = ClassificationOutput<B>;

            fn step(&self, batch: Batch<B>) -> TrainOutput<ClassificationOutput<B>> {
                let item = classify(self.forward(batch.inputs), batch.targets);
                TrainOutput::new(self, item.loss.backward(), item)
            }
        }

        impl<B: Backend> InferenceStep for $model<B> {
            type Input = Batch<B>;
            type Output = ClassificationOutput<B>;

            fn step(&self, batch: Batch<B>) -> ClassificationOutput<B> {
                classify(self.forward(batch.inputs), batch.targets)
            }
        }
    };
}

classifier_steps!(Mlp);
classifier_steps!(BnCnn);

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
/// `max over tensors of max_i |a_i - b_i| / max_i |b_i|`.
pub fn max_relative_difference(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len(), "different number of tensors");
    a.iter()
        .zip(b)
        .map(|(x, y)| {
            assert_eq!(x.len(), y.len(), "tensors of different sizes");
            let scale = y
                .iter()
                .fold(0f32, |m, v| m.max(v.abs()))
                .max(f32::MIN_POSITIVE);
            x.iter().zip(y).fold(0f32, |m, (p, q)| m.max((p - q).abs())) / scale
        })
        .fold(0f32, f32::max)
}

/// How to train in [`run_training`].
#[derive(Clone, Debug)]
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
    let device = burn::tensor::Device::<TestBackend>::default();
    let world_size = run.replicas.unwrap_or(1).max(1);
    let items = Arc::new(InMemDataset::new(synthetic_dataset(run.samples, 99)));
    let sampler = DistributedSampler::new(run.samples, world_size)?.with_seed(run.seed);
    let train: Arc<dyn DataLoader<TestBackend, Batch<TestBackend>>> =
        Arc::new(DistributedDataLoader::new(
            items.clone(),
            ItemBatcher,
            sampler,
            run.global_batch / world_size,
            device,
        )?);
    let valid_sampler = DistributedSampler::new(run.samples.min(64), 1)?.without_shuffle();
    let valid_items = Arc::new(InMemDataset::new(synthetic_dataset(run.samples.min(64), 5)));
    let valid: Arc<dyn DataLoader<NdArray, Batch<NdArray>>> = Arc::new(DistributedDataLoader::new(
        valid_items,
        ItemBatcher,
        valid_sampler,
        32,
        device,
    )?);

    let learner = Learner::new(model, optimizer, scheduler);
    let directory = std::env::temp_dir().join(format!(
        "burn-ddp-tests-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    let mut training = SupervisedTraining::new(directory, train, valid)
        .num_epochs(run.epochs)
        .renderer(SilentRenderer)
        .with_metric_logger(InMemoryMetricLogger::new())
        .with_application_logger(None);
    if let Some(k) = run.grad_accumulation {
        training = training.grads_accumulation(k);
    }
    if let Some(n) = run.interrupt_after
        && let Ok(mut slot) = INTERRUPT.lock()
    {
        *slot = Some((training.interrupter(), n));
    }
    match run.replicas {
        None => {
            let result = training
                .with_training_strategy(ExecutionStrategy::SingleDevice(device).into())
                .launch(learner);
            Ok((float_tensors(&result.model), None))
        }
        Some(n) => {
            let strategy = DdpStrategy::new(vec![device; n]).with_config(run.config.clone());
            let handle = strategy.clone();
            let result = training.launch_ddp(learner, strategy)?;
            Ok((float_tensors(&result.model), Some(handle.report())))
        }
    }
}

/// A freshly initialised model whose lazily created parameters are materialised, so clones share
/// the same values (Burn initialises parameters lazily, per clone).
pub fn materialized<M: Module<TestBackend>>(model: M) -> M {
    let _ = burn_ddp::value_fingerprint(&model);
    model
}

/// The default device of the test backend.
pub fn device() -> burn::tensor::Device<TestBackend> {
    Default::default()
}
