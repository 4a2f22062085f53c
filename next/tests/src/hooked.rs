//! One wrapper for the models that act at a chosen step: [`Hooked`] calls a hook before each of
//! its inner model's training and validation steps (to panic, interrupt, record or look at the
//! disk on one rank at one step), so a test writes a function, not a model.

use std::cell::Cell;

use burn::module::Module;
use burn::train::{InferenceStep, TrainOutput, TrainStep};

/// Which step a [`Hooked`] model is about to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepKind {
    /// A training step (forward and backward).
    Train,
    /// A validation step.
    Valid,
}

/// What a hook is told before a step.
#[derive(Debug)]
pub struct StepCall<'a> {
    /// The step about to run.
    pub kind: StepKind,
    /// The calling thread's name: `burn-ddp-rank-R` for thread ranks and the TCP test ranks.
    pub thread: &'a str,
    /// Steps of this kind this thread ran, this one included (1-based).
    pub count: usize,
}

impl StepCall<'_> {
    /// Whether the step runs on rank `rank`'s thread.
    pub fn on_rank(&self, rank: usize) -> bool {
        self.thread
            .strip_prefix("burn-ddp-rank-")
            .and_then(|r| r.parse::<usize>().ok())
            == Some(rank)
    }

    /// Whether it is training step `count` of this thread on rank `rank`.
    pub fn train_step_on(&self, count: usize, rank: usize) -> bool {
        self.kind == StepKind::Train && self.count == count && self.on_rank(rank)
    }
}

/// A hook: a plain function, so that the wrapper stays a Burn module (`Clone`, `Debug`, `Send`);
/// it keeps its state in statics of the test.
pub type Hook = fn(&StepCall<'_>);

thread_local! {
    /// Per thread: training and validation steps of hooked models so far.
    static COUNTS: Cell<[usize; 2]> = const { Cell::new([0, 0]) };
}

/// `inner`, with `hook` called before each of its training and validation steps.
#[derive(Module, Debug)]
pub struct Hooked<M> {
    /// The model that trains.
    pub inner: M,
    #[module(skip)]
    hook: Hook,
}

impl<M> Hooked<M> {
    /// `inner` with `hook`.
    pub fn new(inner: M, hook: Hook) -> Self {
        Self { inner, hook }
    }

    fn call(&self, kind: StepKind) {
        let count = COUNTS.with(|counts| {
            let mut now = counts.get();
            now[kind as usize] += 1;
            counts.set(now);
            now[kind as usize]
        });
        let thread = std::thread::current();
        (self.hook)(&StepCall {
            kind,
            thread: thread.name().unwrap_or_default(),
            count,
        });
    }
}

impl<M: TrainStep> TrainStep for Hooked<M> {
    type Input = M::Input;
    type Output = M::Output;

    fn step(&self, item: M::Input) -> TrainOutput<M::Output> {
        self.call(StepKind::Train);
        TrainStep::step(&self.inner, item)
    }
}

impl<M: InferenceStep> InferenceStep for Hooked<M> {
    type Input = M::Input;
    type Output = M::Output;

    fn step(&self, item: M::Input) -> M::Output {
        self.call(StepKind::Valid);
        InferenceStep::step(&self.inner, item)
    }
}
