//! The models the tests train: MLPs, CNNs with BatchNorm and SyncBatchNorm, the example's CNN with deterministic parameters, and models that act at a chosen step.

use burn::module::AutodiffModule;
use burn::module::{Module, Param};
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{
    BatchNorm, BatchNormConfig, Dropout, DropoutConfig, Linear, LinearConfig, PaddingConfig2d, Relu,
};
use burn::optim::{GradientsParams, Optimizer};

use crate::data::{Batch, CLASSES, FEATURES, TestBackend, device};
use crate::hooked::{Hooked, StepKind};
use crate::values::{float_tensors, materialized, with_values};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn::train::{ClassificationOutput, InferenceStep, Interrupter, TrainOutput, TrainStep};

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

    /// The logits of `inputs` (`[batch, FEATURES]` → `[batch, CLASSES]`).
    pub fn forward(&self, inputs: Tensor<B, 2>) -> Tensor<B, 2> {
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

/// The MLP whose `optimize` freezes its first layer after its second optimizer step.
#[derive(Module, Debug)]
pub struct FreezesAfterTwoSteps<B: Backend> {
    inner: Mlp<B>,
    #[module(skip)]
    steps: usize,
}

impl<B: Backend> FreezesAfterTwoSteps<B> {
    /// A new model on `device`.
    pub fn new(device: &B::Device) -> Self {
        Self {
            inner: Mlp::new(device),
            steps: 0,
        }
    }
}

impl<B: AutodiffBackend> TrainStep for FreezesAfterTwoSteps<B> {
    type Input = Batch<B>;
    type Output = ClassificationOutput<B>;

    fn step(&self, batch: Batch<B>) -> TrainOutput<ClassificationOutput<B>> {
        // The inner model's parameters are this model's: its gradients are this model's.
        TrainStep::step(&self.inner, batch)
    }

    fn optimize<B2, O>(self, optim: &mut O, lr: f64, grads: GradientsParams) -> Self
    where
        B2: AutodiffBackend,
        O: Optimizer<Self, B2>,
        Self: AutodiffModule<B2>,
    {
        let mut model = optim.step(lr, self, grads);
        model.steps += 1;
        if model.steps == 2 {
            model.inner = model.inner.with_first_frozen();
        }
        model
    }
}

impl<B: Backend> InferenceStep for FreezesAfterTwoSteps<B> {
    type Input = Batch<B>;
    type Output = ClassificationOutput<B>;

    fn step(&self, batch: Batch<B>) -> ClassificationOutput<B> {
        InferenceStep::step(&self.inner, batch)
    }
}

/// An MLP with a frozen teacher copy that `optimize` moves halfway to the student after every
/// optimizer step (an exponential moving average, as in self-distillation).
#[derive(Module, Debug)]
pub struct WithTeacher<B: Backend> {
    student: Mlp<B>,
    teacher: Mlp<B>,
}

impl<B: Backend> WithTeacher<B> {
    /// A new model on `device`: a student and a frozen teacher.
    pub fn new(device: &B::Device) -> Self {
        Self {
            student: Mlp::new(device),
            teacher: Mlp::new(device).no_grad(),
        }
    }
}

impl<B: AutodiffBackend> TrainStep for WithTeacher<B> {
    type Input = Batch<B>;
    type Output = ClassificationOutput<B>;

    fn step(&self, batch: Batch<B>) -> TrainOutput<ClassificationOutput<B>> {
        // The student's parameters are this model's: its gradients are this model's.
        TrainStep::step(&self.student, batch)
    }

    fn optimize<B2, O>(self, optim: &mut O, lr: f64, grads: GradientsParams) -> Self
    where
        B2: AutodiffBackend,
        O: Optimizer<Self, B2>,
        Self: AutodiffModule<B2>,
    {
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

impl<B: Backend> InferenceStep for WithTeacher<B> {
    type Input = Batch<B>;
    type Output = ClassificationOutput<B>;

    fn step(&self, batch: Batch<B>) -> ClassificationOutput<B> {
        InferenceStep::step(&self.student, batch)
    }
}

/// The [`Mlp`] with dropout (p = 0.1) between its layers: training draws from the backend's
/// random generator, so two runs never match bit for bit.
#[derive(Module, Debug)]
pub struct DropoutMlp<B: Backend> {
    fc1: Linear<B>,
    dropout: Dropout,
    fc2: Linear<B>,
    activation: Relu,
}

impl<B: Backend> DropoutMlp<B> {
    /// A new model on `device`.
    pub fn new(device: &B::Device) -> Self {
        Self {
            fc1: LinearConfig::new(FEATURES, 32).init(device),
            dropout: DropoutConfig::new(0.1).init(),
            fc2: LinearConfig::new(32, CLASSES).init(device),
            activation: Relu::new(),
        }
    }

    fn forward(&self, inputs: Tensor<B, 2>) -> Tensor<B, 2> {
        let x = self.activation.forward(self.fc1.forward(inputs));
        self.fc2.forward(self.dropout.forward(x))
    }
}

classifier_steps!(DropoutMlp);

/// Where [`interrupting`] models find the training's interrupter and after how many batches to use it.
pub(crate) static INTERRUPT: std::sync::Mutex<Option<(Interrupter, usize)>> =
    std::sync::Mutex::new(None);

/// An MLP whose rank-1 replica asks burn-train to stop (its `Interrupter`) during its N-th batch
/// (N from [`Run::interrupt_after`](crate::run::Run::interrupt_after)), as a user pressing Ctrl-C
/// or a callback would.
pub type Interrupting<B> = Hooked<B, Mlp<B>>;

/// A new [`Interrupting`] model on `device`.
pub fn interrupting<B: Backend>(device: &B::Device) -> Interrupting<B> {
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
