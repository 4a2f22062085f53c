//! The harness's own pieces: models of the dimensions the helpers do not have, one optimizer type
//! and one scheduler type for every case (fewer instantiations of the training code to compile),
//! both delegating to Burn's own.

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
use burn_ddp::ShardedOptimizer;
use burn_ddp_tests::{Batch, CLASSES, FEATURES, Mlp, TestBackend};

use super::cases::{Case, Opt, Scheduler};

/// The MLP with a layer frozen (from the start, or until the second optimizer step).
#[derive(Module, Debug)]
pub(super) struct Freezing<B: Backend> {
    pub(super) inner: Mlp<B>,
    #[module(skip)]
    pub(super) unfreeze_after: Option<usize>,
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
pub(super) struct Special<B: Backend> {
    first: Linear<B>,
    second: Linear<B>,
    head: Linear<B>,
    aux: Linear<B>,
    activation: Relu,
    #[module(skip)]
    use_aux: bool,
}

impl<B: Backend> Special<B> {
    pub(super) fn new(device: &B::Device, tied: bool, use_aux: bool) -> Self {
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
// One optimizer and one scheduler type.

/// Burn's SGD with momentum, Adam or AdamW, with global-norm clipping for the reference (plain
/// Burn has none: its optimizers clip each parameter on its own), or wrapped in burn-ddp's
/// `ShardedOptimizer` for the sharded cases. Its state is not checkpointed (the harness does not
/// resume).
#[derive(Clone)]
pub(super) enum Optim<M: burn::module::AutodiffModule<TestBackend>> {
    /// Clipped by the global norm first when given (a user's wrapper around the sharded
    /// optimizer).
    Sharded(Sharded<M>, Option<f32>),
    Sgd(
        burn::optim::adaptor::OptimizerAdaptor<
            burn::optim::Sgd<burn_ddp_tests::TestInner>,
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
pub(super) enum Sharded<M: burn::module::AutodiffModule<TestBackend>> {
    Sgd(ShardedOptimizer<burn::optim::Sgd<burn_ddp_tests::TestInner>, M, TestBackend>),
    Adam(ShardedOptimizer<burn::optim::Adam, M, TestBackend>),
    AdamW(ShardedOptimizer<burn::optim::AdamW, M, TestBackend>),
}

impl<M: burn::module::AutodiffModule<TestBackend>> Optim<M> {
    /// `kind` for burn-ddp with the optimizer state sharded, clipped by the global norm first
    /// (outside the sharded optimizer) when `clip` is given.
    pub(super) fn sharded(kind: Opt, clip: Option<f32>) -> Self {
        let sharded = match Self::new(kind, None) {
            Optim::Sgd(o, _) => Sharded::Sgd(ShardedOptimizer::new(o)),
            Optim::Adam(o, _) => Sharded::Adam(ShardedOptimizer::new(o)),
            Optim::AdamW(o, _) => Sharded::AdamW(ShardedOptimizer::new(o)),
            Optim::Sharded(s, _) => s,
        };
        Optim::Sharded(sharded, clip)
    }

    /// `kind`, clipped by the global norm first when `clip` is given.
    pub(super) fn new(kind: Opt, clip: Option<f32>) -> Self {
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
            Optim::Sgd(_, c) | Optim::Adam(_, c) | Optim::AdamW(_, c) | Optim::Sharded(_, c) => *c,
        }
    }
}

impl<M: burn::module::AutodiffModule<TestBackend>> Optimizer<M, TestBackend> for Optim<M> {
    /// Adam's state (the resumed cases train with Adam); the others' are not checkpointed.
    type Record = AdamRecord<M>;

    fn step(&mut self, lr: f64, module: M, grads: GradientsParams) -> M {
        let grads = match self.clip() {
            Some(max_norm) => burn_ddp_tests::clip_global_norm(&module, grads, max_norm),
            None => grads,
        };
        match self {
            Optim::Sgd(o, _) => o.step(lr, module, grads),
            Optim::Adam(o, _) => o.step(lr, module, grads),
            Optim::AdamW(o, _) => o.step(lr, module, grads),
            Optim::Sharded(Sharded::Sgd(o), _) => o.step(lr, module, grads),
            Optim::Sharded(Sharded::Adam(o), _) => o.step(lr, module, grads),
            Optim::Sharded(Sharded::AdamW(o), _) => o.step(lr, module, grads),
        }
    }

    fn step_multi(&mut self, lr: f64, module: M, grads: burn::optim::MultiGradientsParams) -> M {
        match self {
            Optim::Sgd(o, _) => o.step_multi(lr, module, grads),
            Optim::Adam(o, _) => o.step_multi(lr, module, grads),
            Optim::AdamW(o, _) => o.step_multi(lr, module, grads),
            Optim::Sharded(Sharded::Sgd(o), _) => o.step_multi(lr, module, grads),
            Optim::Sharded(Sharded::Adam(o), _) => o.step_multi(lr, module, grads),
            Optim::Sharded(Sharded::AdamW(o), _) => o.step_multi(lr, module, grads),
        }
    }

    fn to_record(&self) -> Self::Record {
        match self {
            Optim::Adam(o, _) => o.to_record(),
            Optim::Sharded(Sharded::Adam(o), _) => o.to_record(),
            _ => Default::default(),
        }
    }

    fn load_record(self, record: Self::Record) -> Self {
        match self {
            Optim::Adam(o, c) => Optim::Adam(o.load_record(record), c),
            Optim::Sharded(Sharded::Adam(o), c) => {
                Optim::Sharded(Sharded::Adam(o.load_record(record)), c)
            }
            other => other,
        }
    }
}

/// The record of Burn's Adam.
type AdamRecord<M> =
    <burn::optim::adaptor::OptimizerAdaptor<burn::optim::Adam, M, TestBackend> as Optimizer<
        M,
        TestBackend,
    >>::Record;

/// A constant learning rate, Burn's step decay, or Burn's linear warm-up times cosine annealing,
/// with its steps counted (its record: a resumed run steps a fresh one as far), and, for a run to
/// be stopped, burn-train's interrupter called at a chosen step.
#[derive(Clone)]
pub(super) struct Sched {
    kind: SchedKind,
    case: Case,
    /// Steps taken.
    taken: usize,
    /// Stop the training at this step (every replica's clone counts its own).
    interrupt: Option<(Slot, usize)>,
}

/// Where a training's interrupter arrives.
pub(super) type Slot = std::sync::Arc<std::sync::Mutex<Option<burn::train::Interrupter>>>;

#[derive(Clone)]
enum SchedKind {
    Constant(f64),
    Step(burn::optim::lr_scheduler::step::StepLrScheduler),
    WarmupCosine(burn::optim::lr_scheduler::composed::ComposedLrScheduler),
}

impl Sched {
    /// The case's scheduler; it stops the training at step `at` when `interrupt` is given.
    pub(super) fn build(case: &Case, interrupt: Option<(Slot, usize)>) -> Self {
        let lr = lr(case);
        let steps_per_epoch =
            case.samples.div_ceil(case.global_batch) / case.accumulation.unwrap_or(1);
        let total = (steps_per_epoch * case.epochs).max(2);
        let kind = match case.sched {
            Scheduler::Constant => SchedKind::Constant(lr),
            Scheduler::StepDecay => SchedKind::Step(
                StepLrSchedulerConfig::new(lr, (total / 3).max(1))
                    .with_gamma(0.5)
                    .init()
                    .unwrap(),
            ),
            Scheduler::WarmupCosine => SchedKind::WarmupCosine(
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
            interrupt,
        }
    }
}

impl LrScheduler for Sched {
    type Record<B: Backend> = usize;

    fn step(&mut self) -> f64 {
        self.taken += 1;
        if let Some((slot, at)) = &self.interrupt
            && self.taken == *at
            && let Ok(slot) = slot.lock()
            && let Some(interrupter) = slot.as_ref()
        {
            interrupter.stop(Some("the harness stops the run here, to resume it"));
        }
        match &mut self.kind {
            SchedKind::Constant(lr) => *lr,
            SchedKind::Step(s) => s.step(),
            SchedKind::WarmupCosine(s) => s.step(),
        }
    }

    fn to_record<B: Backend>(&self) -> Self::Record<B> {
        self.taken
    }

    fn load_record<B: Backend>(self, taken: Self::Record<B>) -> Self {
        let mut fresh = Sched::build(&self.case, None);
        for _ in 0..taken {
            fresh.step();
        }
        fresh
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
