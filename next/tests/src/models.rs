//! The models the tests train: MLPs, CNNs with BatchNorm and SyncBatchNorm, the example's CNN
//! with deterministic parameters, and models that act at a chosen step or optimizer step.

use burn::module::{Module, ModuleMapper, Param};
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{
    BatchNorm, BatchNormConfig, Dropout, DropoutConfig, Linear, LinearConfig, PaddingConfig2d, Relu,
};
use burn::optim::lr_scheduler::module_lr_scheduler::ModuleLearningRate;
use burn::optim::{GradientsParams, ModuleOptimizer};
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn::train::{ClassificationOutput, InferenceStep, Interrupter, TrainOutput, TrainStep};

use crate::data::{Batch, CLASSES, FEATURES, device};
use crate::hooked::{Hooked, StepKind};
use crate::values::{float_tensors, materialized, with_values};

/// A two-layer perceptron (no buffers): 16 → 32 → 4.
#[derive(Module, Debug)]
pub struct Mlp {
    fc1: Linear,
    fc2: Linear,
    activation: Relu,
}

impl Mlp {
    /// A new MLP on `device`.
    pub fn new(device: &Device) -> Self {
        Self {
            fc1: LinearConfig::new(FEATURES, 32).init(device),
            fc2: LinearConfig::new(32, CLASSES).init(device),
            activation: Relu::new(),
        }
    }

    /// The logits of `inputs` (`[batch, FEATURES]` → `[batch, CLASSES]`).
    pub fn forward(&self, inputs: Tensor<2>) -> Tensor<2> {
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
        Self {
            fc1: self.fc1.set_require_grad(true),
            ..self
        }
    }
}

/// The same MLP with one more layer (a replica that differs).
#[derive(Module, Debug)]
pub struct DeeperMlp {
    fc1: Linear,
    fc2: Linear,
    extra: Linear,
}

impl DeeperMlp {
    /// A new deeper MLP on `device`.
    pub fn new(device: &Device) -> Self {
        Self {
            fc1: LinearConfig::new(FEATURES, 32).init(device),
            fc2: LinearConfig::new(32, CLASSES).init(device),
            extra: LinearConfig::new(CLASSES, CLASSES).init(device),
        }
    }
}

/// A small CNN with BatchNorm (buffers): the 16 features as a 1×4×4 image.
#[derive(Module, Debug)]
pub struct BnCnn {
    conv: Conv2d,
    norm: BatchNorm,
    fc: Linear,
    activation: Relu,
}

impl BnCnn {
    /// A new CNN on `device`.
    pub fn new(device: &Device) -> Self {
        Self {
            conv: Conv2dConfig::new([1, 4], [3, 3])
                .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
                .init(device),
            norm: BatchNormConfig::new(4).init(device),
            fc: LinearConfig::new(4 * FEATURES, CLASSES).init(device),
            activation: Relu::new(),
        }
    }

    fn forward(&self, inputs: Tensor<2>) -> Tensor<2> {
        let [n, _] = inputs.dims();
        let x = inputs.reshape([n, 1, 4, 4]);
        let x = self
            .activation
            .forward(self.norm.forward(self.conv.forward(x)));
        self.fc.forward(x.reshape([n, 4 * FEATURES]))
    }
}

/// The [`BnCnn`] with burn-ddp's `SyncBatchNorm` instead of `BatchNorm`.
#[derive(Module, Debug)]
pub struct SyncBnCnn {
    conv: Conv2d,
    norm: burn_ddp::SyncBatchNorm,
    fc: Linear,
    activation: Relu,
}

impl SyncBnCnn {
    /// A new CNN on `device`.
    pub fn new(device: &Device) -> Self {
        Self {
            conv: Conv2dConfig::new([1, 4], [3, 3])
                .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
                .init(device),
            norm: burn_ddp::SyncBatchNormConfig::new(4).init(device),
            fc: LinearConfig::new(4 * FEATURES, CLASSES).init(device),
            activation: Relu::new(),
        }
    }

    fn forward(&self, inputs: Tensor<2>) -> Tensor<2> {
        let [n, _] = inputs.dims();
        let x = inputs.reshape([n, 1, 4, 4]);
        let x = self
            .activation
            .forward(self.norm.forward(self.conv.forward(x)));
        self.fc.forward(x.reshape([n, 4 * FEATURES]))
    }
}

/// The [`Mlp`] with dropout (p = 0.1) between its layers: training draws from the backend's
/// random generator, so two runs never match bit for bit.
#[derive(Module, Debug)]
pub struct DropoutMlp {
    fc1: Linear,
    dropout: Dropout,
    fc2: Linear,
    activation: Relu,
}

impl DropoutMlp {
    /// A new model on `device`.
    pub fn new(device: &Device) -> Self {
        Self {
            fc1: LinearConfig::new(FEATURES, 32).init(device),
            dropout: DropoutConfig::new(0.1).init(),
            fc2: LinearConfig::new(32, CLASSES).init(device),
            activation: Relu::new(),
        }
    }

    fn forward(&self, inputs: Tensor<2>) -> Tensor<2> {
        let x = self.activation.forward(self.fc1.forward(inputs));
        self.fc2.forward(self.dropout.forward(x))
    }
}

/// The cross-entropy of `logits` `[batch, CLASSES]` against `targets` `[batch]`, as burn-train's
/// classification output.
fn classify(logits: Tensor<2>, targets: Tensor<1, Int>) -> ClassificationOutput {
    let loss = CrossEntropyLossConfig::new()
        .init(&logits.device())
        .forward(logits.clone(), targets.clone());
    ClassificationOutput::new(loss, logits, targets)
}

/// burn-train's training and inference steps of a classifier with a `forward(Tensor<2>)`.
macro_rules! classifier_steps {
    ($($model:ident),*) => {$(
        impl TrainStep for $model {
            type Input = Batch;
            type Output = ClassificationOutput;

            fn step(&self, batch: Batch) -> TrainOutput<ClassificationOutput> {
                let item = classify(self.forward(batch.inputs), batch.targets);
                TrainOutput::new(self, item.loss.backward(), item)
            }
        }

        impl InferenceStep for $model {
            type Input = Batch;
            type Output = ClassificationOutput;

            fn step(&self, batch: Batch) -> ClassificationOutput {
                classify(self.forward(batch.inputs), batch.targets)
            }
        }
    )*};
}

classifier_steps!(Mlp, BnCnn, SyncBnCnn, DropoutMlp);

/// The MLP whose `optimize` freezes its first layer after its second optimizer step.
#[derive(Module, Debug)]
pub struct FreezesAfterTwoSteps {
    inner: Mlp,
    #[module(skip)]
    steps: usize,
}

impl FreezesAfterTwoSteps {
    /// A new model on `device`.
    pub fn new(device: &Device) -> Self {
        Self {
            inner: Mlp::new(device),
            steps: 0,
        }
    }
}

impl TrainStep for FreezesAfterTwoSteps {
    type Input = Batch;
    type Output = ClassificationOutput;

    fn step(&self, batch: Batch) -> TrainOutput<ClassificationOutput> {
        // The inner model's parameters are this model's: its gradients are this model's.
        TrainStep::step(&self.inner, batch)
    }

    fn optimize(
        self,
        optim: &mut ModuleOptimizer,
        lr: ModuleLearningRate,
        grads: GradientsParams,
    ) -> Self {
        let mut model = optim.step(lr, self, grads);
        model.steps += 1;
        if model.steps == 2 {
            model.inner = model.inner.with_first_frozen();
        }
        model
    }
}

impl InferenceStep for FreezesAfterTwoSteps {
    type Input = Batch;
    type Output = ClassificationOutput;

    fn step(&self, batch: Batch) -> ClassificationOutput {
        InferenceStep::step(&self.inner, batch)
    }
}

/// An MLP with a frozen teacher copy that `optimize` moves halfway to the student after every
/// optimizer step (an exponential moving average, as in self-distillation).
#[derive(Module, Debug)]
pub struct WithTeacher {
    student: Mlp,
    teacher: Mlp,
}

impl WithTeacher {
    /// A new model on `device`: a student and a frozen teacher.
    pub fn new(device: &Device) -> Self {
        Self {
            student: Mlp::new(device),
            teacher: Mlp::new(device).no_grad(),
        }
    }
}

impl TrainStep for WithTeacher {
    type Input = Batch;
    type Output = ClassificationOutput;

    fn step(&self, batch: Batch) -> TrainOutput<ClassificationOutput> {
        // The student's parameters are this model's: its gradients are this model's.
        TrainStep::step(&self.student, batch)
    }

    fn optimize(
        self,
        optim: &mut ModuleOptimizer,
        lr: ModuleLearningRate,
        grads: GradientsParams,
    ) -> Self {
        let model = optim.step(lr, self, grads);
        let student = float_tensors(&model.student);
        let mixed: Vec<Vec<f32>> = float_tensors(&model.teacher)
            .iter()
            .zip(&student)
            .map(|(t, s)| t.iter().zip(s).map(|(t, s)| 0.5 * t + 0.5 * s).collect())
            .collect();
        WithTeacher {
            teacher: with_values(model.teacher, &mixed),
            student: model.student,
        }
    }
}

impl InferenceStep for WithTeacher {
    type Input = Batch;
    type Output = ClassificationOutput;

    fn step(&self, batch: Batch) -> ClassificationOutput {
        InferenceStep::step(&self.student, batch)
    }
}

/// Where [`interrupting`] models find the training's interrupter and after how many batches to use it.
pub(crate) static INTERRUPT: std::sync::Mutex<Option<(Interrupter, usize)>> =
    std::sync::Mutex::new(None);

/// An MLP whose rank-1 replica asks burn-train to stop (its `Interrupter`) during its N-th batch
/// (N from [`Run::interrupt_after`](crate::run::Run::interrupt_after)), as a user pressing Ctrl-C
/// or a callback would.
pub type Interrupting = Hooked<Mlp>;

/// A new [`Interrupting`] model on `device`.
pub fn interrupting(device: &Device) -> Interrupting {
    Hooked::new(Mlp::new(device), |call| {
        if call.kind == StepKind::Train
            && call.on_rank(1)
            && let Ok(slot) = INTERRUPT.lock()
            && let Some((interrupter, after)) = slot.as_ref()
            && call.count == *after
        {
            interrupter.stop(Some("interrupted by the test"));
        }
    })
}

/// The Fashion-MNIST example's CNN behind a per-batch hook (for the multi-process tests: slow
/// steps, injected failures, "I am here" files).
#[derive(Module, Debug)]
pub struct ExampleCnn {
    inner: fashion_mnist::model::Cnn,
}

/// Called by [`ExampleCnn`] with the number of batches this thread trained so far (1-based).
pub type StepHook = Box<dyn Fn(usize) + Send + Sync>;

/// The hook of [`ExampleCnn`] in this process, set once (by the test worker program).
pub static STEP_HOOK: std::sync::OnceLock<StepHook> = std::sync::OnceLock::new();

thread_local! {
    static CNN_BATCHES: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

impl ExampleCnn {
    /// The example's CNN on `device`, with deterministic parameters: every value is a function of
    /// `seed` and its position, so separate processes build bit-identical models without sharing
    /// a random generator.
    pub fn deterministic(device: &Device, seed: u64) -> Self {
        struct Fill(u64, usize);
        impl ModuleMapper for Fill {
            fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
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
                let value = Tensor::<D>::from_data(
                    TensorData::new(values, shape).convert_dtype(tensor.dtype()),
                    &tensor.device(),
                );
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

impl TrainStep for ExampleCnn {
    type Input = fashion_mnist::data::FashionBatch;
    type Output = ClassificationOutput;

    fn step(&self, batch: Self::Input) -> TrainOutput<ClassificationOutput> {
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

impl InferenceStep for ExampleCnn {
    type Input = fashion_mnist::data::FashionBatch;
    type Output = ClassificationOutput;

    fn step(&self, batch: Self::Input) -> ClassificationOutput {
        InferenceStep::step(&self.inner, batch)
    }
}

/// The [`Mlp`] with fixed values, the same in every process (value `j` of tensor `t` from
/// `(t, j)`): a model without buffers, for multi-process runs compared with one device.
pub fn deterministic_mlp() -> Mlp {
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

/// Where a [`StopsAtBatch`] model stops: the training's interrupter (set by the run,
/// [`Run::interrupter`](crate::run::Run::interrupter)), the batch, and each thread's count of
/// training batches so far (shared by the model's clones, one count per rank thread).
#[derive(Clone)]
pub struct StopOrder {
    /// burn-train's interrupter of the run, once it is built.
    pub slot: std::sync::Arc<std::sync::Mutex<Option<Interrupter>>>,
    /// The 1-based training batch, counted by each thread, during which to stop.
    pub at: usize,
    counts:
        std::sync::Arc<std::sync::Mutex<std::collections::HashMap<std::thread::ThreadId, usize>>>,
}

impl StopOrder {
    /// A stop during batch `at` (`usize::MAX`: never) through the interrupter `slot` receives.
    pub fn new(slot: std::sync::Arc<std::sync::Mutex<Option<Interrupter>>>, at: usize) -> Self {
        Self {
            slot,
            at,
            counts: Default::default(),
        }
    }

    /// Counts a training batch of the calling thread and, at the `at`-th, asks burn-train to
    /// stop with `reason`.
    pub fn before_train_step(&self, reason: &str) {
        let count = {
            let mut counts = self.counts.lock().unwrap_or_else(|e| e.into_inner());
            let count = counts.entry(std::thread::current().id()).or_default();
            *count += 1;
            *count
        };
        if count == self.at
            && let Some(interrupter) = self.slot.lock().unwrap_or_else(|e| e.into_inner()).as_ref()
        {
            interrupter.stop(Some(reason));
        }
    }
}

impl core::fmt::Debug for StopOrder {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "StopOrder(at batch {})", self.at)
    }
}

/// The [`Mlp`] asking burn-train to stop (its `Interrupter`) during its `at`-th training batch on
/// every thread that trains it (one device: the one; burn-ddp: every rank at the same step), as
/// a user's callback would. A run needs its interrupter: `run.interrupter = Some(model.slot())`.
#[derive(Module, Debug)]
pub struct StopsAtBatch {
    inner: Mlp,
    #[module(skip)]
    order: StopOrder,
}

impl StopsAtBatch {
    /// `inner`, stopping during batch `at` (`usize::MAX`: never).
    pub fn new(inner: Mlp, at: usize) -> Self {
        Self {
            inner,
            order: StopOrder::new(Default::default(), at),
        }
    }

    /// Where the run puts its interrupter.
    pub fn slot(&self) -> std::sync::Arc<std::sync::Mutex<Option<Interrupter>>> {
        self.order.slot.clone()
    }
}

impl TrainStep for StopsAtBatch {
    type Input = Batch;
    type Output = ClassificationOutput;

    fn step(&self, batch: Batch) -> TrainOutput<ClassificationOutput> {
        self.order.before_train_step("the test stops here");
        TrainStep::step(&self.inner, batch)
    }
}

impl InferenceStep for StopsAtBatch {
    type Input = Batch;
    type Output = ClassificationOutput;

    fn step(&self, batch: Batch) -> ClassificationOutput {
        InferenceStep::step(&self.inner, batch)
    }
}

/// `inner` whose optimizer step first clips the gradients by their global norm
/// ([`clip_global_norm`](crate::run::clip_global_norm)): plain Burn with PyTorch's clipping, the
/// reference of burn-ddp's `DdpConfig::with_clip_grad_norm`.
#[derive(Module, Debug)]
pub struct GlobalNormClipped<M> {
    /// The model that trains.
    pub inner: M,
    #[module(skip)]
    max_norm: f32,
}

impl<M> GlobalNormClipped<M> {
    /// `inner`, its gradients clipped to the global 2-norm `max_norm` before every step.
    pub fn new(inner: M, max_norm: f32) -> Self {
        Self { inner, max_norm }
    }
}

impl<M: TrainStep + Module + burn::module::ModuleDisplay> TrainStep for GlobalNormClipped<M> {
    type Input = M::Input;
    type Output = M::Output;

    fn step(&self, item: M::Input) -> TrainOutput<M::Output> {
        TrainStep::step(&self.inner, item)
    }

    fn optimize(
        self,
        optim: &mut ModuleOptimizer,
        lr: ModuleLearningRate,
        grads: GradientsParams,
    ) -> Self {
        let grads = crate::run::clip_global_norm(&self, grads, self.max_norm);
        optim.step(lr, self, grads)
    }
}

impl<M: InferenceStep> InferenceStep for GlobalNormClipped<M> {
    type Input = M::Input;
    type Output = M::Output;

    fn step(&self, item: M::Input) -> M::Output {
        InferenceStep::step(&self.inner, item)
    }
}
