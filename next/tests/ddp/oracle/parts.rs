//! The harness's own pieces: models of the dimensions the helpers do not have, the wrapper every
//! case's model trains in (a stop at a chosen micro-batch, and a user's clipping in `optimize`),
//! the case's optimizer (Burn's own `ModuleOptimizer`) and one scheduler type for every case,
//! delegating to Burn's own.

use std::sync::{Arc, Mutex};

use burn::module::{Module, ModuleDisplay};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::lr_scheduler::composed::ComposedLrSchedulerConfig;
use burn::optim::lr_scheduler::cosine::CosineAnnealingLrSchedulerConfig;
use burn::optim::lr_scheduler::linear::LinearLrSchedulerConfig;
use burn::optim::lr_scheduler::module_lr_scheduler::{ModuleLearningRate, ModuleLrScheduler};
use burn::optim::lr_scheduler::step::StepLrSchedulerConfig;
use burn::optim::lr_scheduler::{LrScheduler, LrSchedulerRecord};
use burn::optim::momentum::MomentumConfig;
use burn::optim::{
    AdamConfig, AdamWConfig, GradientsParams, LearningRate, ModuleOptimizer, SgdConfig,
};
use burn::tensor::{Device, Tensor, TensorData};
use burn::train::{ClassificationOutput, InferenceStep, Interrupter, TrainOutput, TrainStep};
use burn_ddp_tests::{Batch, CLASSES, FEATURES, Mlp, StopOrder, clip_global_norm};

use super::cases::{Case, Opt, Scheduler};

/// The MLP with a layer frozen (from the start, or until the second optimizer step).
#[derive(Module, Debug)]
pub(super) struct Freezing {
    pub(super) inner: Mlp,
    #[module(skip)]
    pub(super) unfreeze_after: Option<usize>,
}

thread_local! {
    /// Optimizer steps taken on this thread (fresh threads run every training of the harness).
    static STEPS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

impl TrainStep for Freezing {
    type Input = Batch;
    type Output = ClassificationOutput;

    fn step(&self, batch: Batch) -> TrainOutput<ClassificationOutput> {
        TrainStep::step(&self.inner, batch)
    }

    fn optimize(
        self,
        optim: &mut ModuleOptimizer,
        lr: ModuleLearningRate,
        grads: GradientsParams,
    ) -> Self {
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

impl InferenceStep for Freezing {
    type Input = Batch;
    type Output = ClassificationOutput;

    fn step(&self, batch: Batch) -> ClassificationOutput {
        InferenceStep::step(&self.inner, batch)
    }
}

/// An MLP whose second layer reads the first layer's weight, and whose `aux` layer is added to
/// the logits of class-0 samples only, and skipped when a batch has none (`aux`: present in
/// `PartlyUnused`; the tie: in `Tied`).
#[derive(Module, Debug)]
pub(super) struct Special {
    first: Linear,
    second: Linear,
    head: Linear,
    aux: Linear,
    activation: Relu,
    #[module(skip)]
    use_aux: bool,
}

impl Special {
    pub(super) fn new(device: &Device, tied: bool, use_aux: bool) -> Self {
        let first: Linear = LinearConfig::new(FEATURES, FEATURES).init(device);
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

    fn output(&self, batch: Batch) -> ClassificationOutput {
        let x = self
            .activation
            .forward(self.first.forward(batch.inputs.clone()));
        let x = self.activation.forward(self.second.forward(x));
        let mut logits = self.head.forward(x);
        if self.use_aux {
            let targets: Vec<i64> = batch.targets.clone().into_data().iter::<i64>().collect();
            if targets.contains(&0) {
                let mask: Vec<f32> = targets
                    .iter()
                    .map(|&t| f32::from(u8::from(t == 0)))
                    .collect();
                let n = mask.len();
                let mask = Tensor::<1>::from_data(TensorData::new(mask, [n]), &logits.device())
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

impl TrainStep for Special {
    type Input = Batch;
    type Output = ClassificationOutput;

    fn step(&self, batch: Batch) -> TrainOutput<ClassificationOutput> {
        let item = self.output(batch);
        TrainOutput::new(self, item.loss.backward(), item)
    }
}

impl InferenceStep for Special {
    type Input = Batch;
    type Output = ClassificationOutput;

    fn step(&self, batch: Batch) -> ClassificationOutput {
        self.output(batch)
    }
}

// ----------------------------------------------------------------------------------------------
// The wrapper every case's model trains in.

/// Where a training's interrupter arrives.
pub(super) type Slot = Arc<Mutex<Option<Interrupter>>>;

/// What a [`Harnessed`] model does besides its inner model's steps: stop the training during a
/// micro-batch (each thread counts its own, so every rank stops at the same step, as one device
/// does at that batch) and clip the gradients by their global norm in `optimize`.
#[derive(Clone, Debug)]
pub(super) struct Harness {
    /// The stop: the training's interrupter and the micro-batch, counted by each thread.
    stop: Option<StopOrder>,
    /// Clip the gradients to this global 2-norm before the step (PyTorch's `clip_grad_norm_`).
    clip: Option<f32>,
}

/// `inner` as the harness trains it: stopped during a chosen micro-batch, its gradients clipped
/// by their global norm in `optimize` (a user's clipping in Burn 0.22, where an optimizer
/// wrapper cannot be written), then `inner`'s own `optimize`.
#[derive(Module, Debug)]
pub(super) struct Harnessed<M> {
    inner: M,
    #[module(skip)]
    harness: Harness,
}

impl<M> Harnessed<M> {
    /// `inner`, stopped during micro-batch `stop.1` through the interrupter `stop.0` receives,
    /// clipped to the global norm `clip`.
    pub(super) fn new(inner: M, stop: Option<(Slot, usize)>, clip: Option<f32>) -> Self {
        Self {
            inner,
            harness: Harness {
                stop: stop.map(|(slot, at)| StopOrder::new(slot, at)),
                clip,
            },
        }
    }
}

impl<M: TrainStep + Module + ModuleDisplay> TrainStep for Harnessed<M> {
    type Input = M::Input;
    type Output = M::Output;

    fn step(&self, item: M::Input) -> TrainOutput<M::Output> {
        if let Some(stop) = &self.harness.stop {
            stop.before_train_step("the harness stops the run here");
        }
        TrainStep::step(&self.inner, item)
    }

    fn optimize(
        self,
        optim: &mut ModuleOptimizer,
        lr: ModuleLearningRate,
        grads: GradientsParams,
    ) -> Self {
        let grads = match self.harness.clip {
            Some(max_norm) => clip_global_norm(&self.inner, grads, max_norm),
            None => grads,
        };
        Self {
            inner: self.inner.optimize(optim, lr, grads),
            harness: self.harness,
        }
    }
}

impl<M: InferenceStep> InferenceStep for Harnessed<M> {
    type Input = M::Input;
    type Output = M::Output;

    fn step(&self, item: M::Input) -> M::Output {
        InferenceStep::step(&self.inner, item)
    }
}

// ----------------------------------------------------------------------------------------------
// The optimizer and the scheduler.

/// Burn's SGD with momentum, Adam or AdamW, as Burn 0.22 builds them (`ModuleOptimizer`).
pub(super) fn optim(kind: Opt) -> ModuleOptimizer {
    match kind {
        Opt::SgdMomentum => SgdConfig::new()
            .with_momentum(Some(MomentumConfig::new().with_momentum(0.9)))
            .init(),
        Opt::Adam => AdamConfig::new().init(),
        Opt::AdamW => AdamWConfig::new().with_weight_decay(0.05).init(),
    }
}

/// A constant learning rate, Burn's step decay, or Burn's linear warm-up times cosine annealing,
/// with its steps counted (its record: a resumed run steps a fresh one as far).
#[derive(Clone)]
pub(super) struct Sched {
    kind: SchedKind,
    case: Case,
    /// Steps taken.
    taken: u64,
}

#[derive(Clone)]
enum SchedKind {
    Constant(f64),
    /// Burn's step decay or warm-up and cosine (Burn 0.22 builds them as a `ModuleLrScheduler`).
    Burn(ModuleLrScheduler),
}

impl Sched {
    /// The case's scheduler, over the case's optimizer steps (burn-train 0.22 steps it once per
    /// optimizer step; an epoch's short last accumulation window is a step).
    pub(super) fn build(case: &Case) -> Self {
        let lr = lr(case);
        let steps_per_epoch = case.batches().div_ceil(case.accumulation.unwrap_or(1));
        let total = (steps_per_epoch * case.epochs).max(2);
        let kind = match case.sched {
            Scheduler::Constant => SchedKind::Constant(lr),
            Scheduler::StepDecay => SchedKind::Burn(
                StepLrSchedulerConfig::new(lr, (total / 3).max(1))
                    .with_gamma(0.5)
                    .init()
                    .unwrap(),
            ),
            Scheduler::WarmupCosine => SchedKind::Burn(
                ComposedLrSchedulerConfig::new()
                    .linear(LinearLrSchedulerConfig::new(0.1, 1.0, (total / 4).max(1)))
                    .cosine(CosineAnnealingLrSchedulerConfig::new(lr, total))
                    .init()
                    .unwrap(),
            ),
        };
        Self {
            kind,
            case: *case,
            taken: 0,
        }
    }
}

impl LrScheduler for Sched {
    fn step(&mut self) -> LearningRate {
        self.taken += 1;
        match &mut self.kind {
            SchedKind::Constant(lr) => *lr,
            SchedKind::Burn(s) => s.step().base(),
        }
    }

    fn to_record(&self) -> LrSchedulerRecord {
        LrSchedulerRecord::new().with_scalar("taken", self.taken)
    }

    fn load_record(&mut self, record: LrSchedulerRecord) {
        let mut fresh = Sched::build(&self.case);
        for _ in 0..record.scalar::<u64>("taken").unwrap_or(0) {
            fresh.step();
        }
        *self = fresh;
    }
}

/// The learning rate of the case's optimizer.
pub(super) fn lr(case: &Case) -> f64 {
    match (case.opt, case.high_lr) {
        (_, true) => 0.3,
        (Opt::SgdMomentum, false) => 0.05,
        (Opt::Adam | Opt::AdamW, false) => 0.01,
    }
}
