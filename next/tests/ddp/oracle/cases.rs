//! The harness's configurations: the dimensions, a fixed core that covers every value of every
//! dimension at least once, and random cases drawn from a printed seed.

use burn_ddp_tests::ValidKind;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Model {
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
    /// A CNN with `SyncBatchNorm` (batch statistics over every rank's samples); on one device,
    /// Burn's `BatchNorm`.
    SyncBn,
    /// The MLP whose `optimize` freezes its first layer after the second step.
    FreezesAfterStep,
    /// An MLP and a frozen teacher copy that `optimize` moves towards it after every step.
    Teacher,
    /// A CNN with Burn's plain `BatchNorm` (per-replica batch statistics): not one device's.
    PlainBn,
    /// The MLP with dropout (the backend's random draws): not one device's.
    Dropout,
}

impl Model {
    /// Whether burn-ddp's result must equal one device's (otherwise the run must complete, the
    /// replicas stay alike and the loss fall).
    pub(super) fn exact(self) -> bool {
        !matches!(self, Model::PlainBn | Model::Dropout)
    }

    /// Whether the model keeps state outside its record (a step count), so a resumed run
    /// cannot continue it.
    fn counts_steps(self) -> bool {
        matches!(
            self,
            Model::Frozen | Model::Unfrozen | Model::FreezesAfterStep
        )
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Opt {
    SgdMomentum,
    Adam,
    AdamW,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Scheduler {
    Constant,
    StepDecay,
    WarmupCosine,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Transport {
    /// Thread ranks on one device: tensors shared by reference (the default).
    Threads,
    /// Thread ranks with `DdpConfig::with_shared_memory_reduction(false)`: host buckets.
    ThreadBuckets,
    Tcp,
}

/// Clipping by the global norm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Clip {
    Off,
    /// burn-ddp's `DdpConfig::with_clip_grad_norm` (one device: the model's `optimize` clips,
    /// `Harnessed`).
    Setting,
    /// The user clips, on both sides: in the model's `optimize` under burn-train (Burn 0.22's
    /// `ModuleOptimizer` is one concrete type, so an optimizer wrapper cannot be written; under
    /// optimizer sharding `optimize` sees its rank's gradients only, so not drawn with it), in
    /// the loop between the synchronisation and the step in a custom loop.
    Wrapper,
}

/// What trains the model on the burn-ddp side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Driver {
    /// burn-train's `SupervisedTraining` with `DdpStrategy` (plain Burn: `SingleDevice`).
    Learner,
    /// A training loop the user writes with `DistributedDataParallel` over a
    /// `DistributedDataLoader` of each rank's shard (plain Burn: the same loop on one device over
    /// Burn's loader): compared by the trained parameters, every rank's.
    CustomLoop,
}

impl Model {
    /// Whether a custom-loop case can train it: the loop unfreezes a layer itself, but calls no
    /// model's `optimize` (a hook of burn-train's loop).
    pub(super) fn in_custom_loop(self) -> bool {
        matches!(
            self,
            Model::Plain
                | Model::Frozen
                | Model::Unfrozen
                | Model::Tied
                | Model::PartlyUnused
                | Model::SyncBn
        )
    }
}

/// Whether burn-ddp's side is stopped and resumed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Resume {
    No,
    /// Stopped mid-epoch after a step checkpoint, resumed on as many ranks, into a model
    /// initialised otherwise.
    MidEpoch,
    /// Stopped after epoch 1, resumed on `world` ranks with the sharding setting flipped, into a
    /// model initialised otherwise.
    AfterEpoch {
        world: usize,
    },
}

/// One configuration.
#[derive(Debug, Clone, Copy)]
pub(super) struct Case {
    pub world: usize,
    pub transport: Transport,
    pub model: Model,
    pub opt: Opt,
    pub sched: Scheduler,
    pub accumulation: Option<usize>,
    pub clip: Clip,
    /// Optimizer-state sharding (ZeRO-1) on the burn-ddp side.
    pub shard: bool,
    /// Where the optimizer state is sharded (`shard`, or the resumed leg of an
    /// `Resume::AfterEpoch` case without `shard`): the gradients reduce-scattered by owner too
    /// (ZeRO-2, `DdpConfig::with_gradient_sharding`); not with `Clip::Wrapper` (a user's
    /// clipping needs every gradient).
    pub shard_grads: bool,
    /// Training samples (any number: the last step may be short, or leave ranks without one).
    pub samples: usize,
    /// Samples per step over all ranks.
    pub global_batch: usize,
    /// Ranks may run out of data at different steps (uneven shards, `UnevenInputs::Join`).
    pub join: bool,
    pub shuffle: bool,
    pub valid: ValidKind,
    /// burn-ddp validates on rank 0 alone (`Validation::Rank0`) instead of sharding.
    pub valid_rank0: bool,
    pub valid_samples: usize,
    pub valid_batch: usize,
    pub epochs: usize,
    pub early_stopping: bool,
    /// A learning rate large enough that the validation loss goes up at some epoch (for early
    /// stopping).
    pub high_lr: bool,
    /// Train this many epochs instead (the schedule still spans `epochs`): the reference of an
    /// early-stopping case, trained as far as its losses say.
    pub stop_after: Option<usize>,
    /// burn-ddp's bucket caps (first and others), in bytes; `None`: the defaults.
    pub bucket_cap: Option<usize>,
    /// burn-ddp's consistency check off: it synchronises the ranks at every step, which can hide
    /// a race (thread ranks are then compared through rank 0's results only).
    pub unchecked: bool,
    /// The training loader is Burn's own (`DataLoaderBuilder`, shuffled by the seed when
    /// `shuffle`), not a `DistributedDataLoader`: thread ranks only (processes slice it), no
    /// resume (a fresh copy of a Burn loader restarts its generator, on one device too).
    pub train_burn: bool,
    pub resume: Resume,
    /// Both sides stopped by burn-train's interrupter during this micro-batch (counted from 1
    /// over the run, by each rank): plain Burn interrupted at the same batch is the reference.
    pub interrupt_at: Option<usize>,
    pub driver: Driver,
}

impl Case {
    /// Micro-batches per epoch (the last one may be short).
    pub(super) fn batches(&self) -> usize {
        self.samples.div_ceil(self.global_batch)
    }

    /// Whether the leg that reports runs ZeRO-2: the optimizer state sharded (a resumed leg
    /// after an epoch flips it) and the gradients reduce-scattered.
    pub(super) fn reporting_zero2(&self) -> bool {
        let shard = match self.resume {
            Resume::AfterEpoch { .. } => !self.shard,
            _ => self.shard,
        };
        shard && self.shard_grads
    }

    /// The world size of the leg that reports.
    pub(super) fn reporting_world(&self) -> usize {
        match self.resume {
            Resume::AfterEpoch { world } => world,
            _ => self.world,
        }
    }
}

/// A case with the defaults of the core set.
pub(super) fn base() -> Case {
    Case {
        world: 2,
        transport: Transport::Threads,
        model: Model::Plain,
        opt: Opt::Adam,
        sched: Scheduler::Constant,
        accumulation: None,
        clip: Clip::Off,
        shard: false,
        shard_grads: false,
        samples: 48,
        global_batch: 16,
        join: false,
        shuffle: true,
        valid: ValidKind::Plain,
        valid_rank0: false,
        valid_samples: 10,
        valid_batch: 4,
        epochs: 2,
        early_stopping: false,
        high_lr: false,
        stop_after: None,
        bucket_cap: None,
        unchecked: false,
        train_burn: false,
        resume: Resume::No,
        interrupt_at: None,
        driver: Driver::Learner,
    }
}

/// The fixed core: every value of every dimension at least once.
pub(super) fn core() -> Vec<Case> {
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
            clip: Clip::Setting,
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
        // Burn's shuffled validation loader (as Burn's guide builds its test loader), sharded
        // over 3 threads and 2 processes, and on rank 0 alone: one device's batches each epoch.
        Case {
            world: 3,
            global_batch: 12,
            valid: ValidKind::BurnShuffled,
            valid_samples: 11,
            valid_batch: 3,
            ..b
        },
        Case {
            transport: Transport::Tcp,
            valid: ValidKind::BurnShuffled,
            ..b
        },
        Case {
            valid: ValidKind::BurnShuffled,
            valid_rank0: true,
            ..b
        },
        // Burn's shuffled training loader over 3 thread ranks: 100 samples in batches of 8, the
        // last step one batch of 4 (two ranks without one); and with micro-batches.
        Case {
            world: 3,
            train_burn: true,
            samples: 100,
            global_batch: 24,
            ..b
        },
        Case {
            train_burn: true,
            accumulation: Some(2),
            samples: 90,
            global_batch: 16,
            opt: Opt::SgdMomentum,
            ..b
        },
        // Four micro-batches per step over 3 thread ranks, without the consistency check's
        // per-step synchronisation.
        Case {
            world: 3,
            accumulation: Some(4),
            samples: 96,
            global_batch: 6,
            unchecked: true,
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
            valid_samples: 24,
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
        // Thread ranks through host buckets (shared tensors turned off): sharded, clipped,
        // accumulating.
        Case {
            transport: Transport::ThreadBuckets,
            shard: true,
            clip: Clip::Setting,
            accumulation: Some(2),
            world: 3,
            samples: 54,
            global_batch: 18,
            ..b
        },
        // The gradients reduce-scattered too (ZeRO-2): thread ranks through host buckets with
        // clipping, a short last step and a frozen layer (3 ranks: the owners' blocks too uneven,
        // so all-reduced, the fallback); TCP with SyncBatchNorm and a layer unfrozen later (2
        // ranks: reduce-scattered); 2 thread ranks through host buckets with clipping and a
        // short last step, reduce-scattered.
        Case {
            transport: Transport::ThreadBuckets,
            shard: true,
            shard_grads: true,
            clip: Clip::Setting,
            model: Model::Frozen,
            world: 3,
            samples: 50,
            global_batch: 12,
            ..b
        },
        Case {
            transport: Transport::Tcp,
            shard: true,
            shard_grads: true,
            model: Model::Unfrozen,
            opt: Opt::AdamW,
            accumulation: Some(2),
            ..b
        },
        Case {
            transport: Transport::ThreadBuckets,
            shard: true,
            shard_grads: true,
            clip: Clip::Setting,
            samples: 50,
            ..b
        },
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
            clip: Clip::Setting,
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
        // A dataset the global batch does not divide: the last step short (86 = 7 x 12 + 2:
        // one rank without a sample), with accumulation and sharding, on threads and TCP; fewer
        // samples than ranks; SyncBatchNorm with a short last step (23 = 5 x 4 + 3: 2 + 1).
        Case {
            samples: 86,
            global_batch: 12,
            world: 3,
            accumulation: Some(2),
            shard: true,
            opt: Opt::AdamW,
            ..b
        },
        Case {
            samples: 37,
            global_batch: 9,
            world: 3,
            transport: Transport::Tcp,
            ..b
        },
        Case {
            samples: 3,
            global_batch: 8,
            world: 4,
            epochs: 3,
            ..b
        },
        Case {
            model: Model::SyncBn,
            samples: 23,
            global_batch: 4,
            opt: Opt::SgdMomentum,
            ..b
        },
        // What a model's `optimize` does around the step, sharded: a layer frozen after it, a
        // teacher moved towards the student; a user's clipping by the global norm in
        // `optimize`, through host buckets and over TCP (not sharded: under sharding `optimize`
        // sees its rank's gradients only, docs/limits.md).
        Case {
            model: Model::FreezesAfterStep,
            shard: true,
            ..b
        },
        // (Not sharded: under optimizer sharding Burn 0.22's Learner runs `optimize` before the
        // other ranks' parameters arrive, and the teacher is refused, docs/limits.md.)
        Case {
            model: Model::Teacher,
            world: 4,
            samples: 64,
            ..b
        },
        Case {
            clip: Clip::Wrapper,
            transport: Transport::ThreadBuckets,
            opt: Opt::SgdMomentum,
            ..b
        },
        Case {
            clip: Clip::Wrapper,
            transport: Transport::Tcp,
            ..b
        },
        // Not one device's by design: they must run, stay alike on every rank, and learn.
        Case {
            model: Model::PlainBn,
            epochs: 3,
            ..b
        },
        Case {
            model: Model::Dropout,
            epochs: 3,
            transport: Transport::Tcp,
            ..b
        },
        // Many buckets (caps of 256 bytes), one rank, many thread ranks.
        Case {
            bucket_cap: Some(256),
            model: Model::Tied,
            shard: true,
            ..b
        },
        Case {
            world: 1,
            samples: 40,
            ..b
        },
        Case {
            world: 6,
            samples: 100,
            global_batch: 18,
            ..b
        },
        Case {
            world: 8,
            samples: 70,
            global_batch: 16,
            shard: true,
            ..b
        },
        // Stopped and resumed into a model initialised otherwise: mid-epoch on as many ranks
        // (sharded), after an epoch on another world size (sharded there, not here; and the
        // other way round, over TCP).
        Case {
            resume: Resume::MidEpoch,
            shard: true,
            samples: 80,
            ..b
        },
        Case {
            resume: Resume::AfterEpoch { world: 4 },
            epochs: 3,
            samples: 64,
            ..b
        },
        Case {
            resume: Resume::AfterEpoch { world: 2 },
            world: 3,
            global_batch: 12,
            samples: 52,
            shard: true,
            transport: Transport::Tcp,
            model: Model::SyncBn,
            ..b
        },
        // One replica with SyncBatchNorm stopped mid-epoch: the step checkpoint holds the
        // running statistics of the last forward pass (Burn's `RunningState` keeps an update
        // per thread until it is next read).
        Case {
            resume: Resume::MidEpoch,
            world: 1,
            model: Model::SyncBn,
            samples: 30,
            global_batch: 5,
            ..b
        },
        // ZeRO-2 stopped and resumed (2 ranks: the owners' blocks even enough to
        // reduce-scatter): mid-epoch through host buckets with a short last step, and after an
        // epoch on 4 TCP ranks unsharded, resumed on 2 with the gradients reduce-scattered.
        Case {
            resume: Resume::MidEpoch,
            transport: Transport::ThreadBuckets,
            shard: true,
            shard_grads: true,
            samples: 58,
            ..b
        },
        Case {
            resume: Resume::AfterEpoch { world: 2 },
            transport: Transport::Tcp,
            world: 4,
            shard_grads: true,
            samples: 48,
            epochs: 3,
            ..b
        },
        // Interrupted inside an accumulation window (micro-batch 5 of windows of 2: plain Burn
        // takes no step for it), at a window's last micro-batch (the step is taken, then
        // training stops), over TCP, and without accumulation in the second epoch.
        Case {
            accumulation: Some(2),
            interrupt_at: Some(5),
            samples: 96,
            ..b
        },
        Case {
            accumulation: Some(3),
            interrupt_at: Some(6),
            world: 3,
            global_batch: 12,
            samples: 96,
            shard: true,
            ..b
        },
        Case {
            accumulation: Some(2),
            interrupt_at: Some(3),
            transport: Transport::Tcp,
            samples: 96,
            ..b
        },
        Case {
            interrupt_at: Some(5),
            samples: 48,
            ..b
        },
        // Custom loops: the MLP on 2 thread ranks; a shared weight sharded (ZeRO-2) through host
        // buckets with a short last step and clipping; SyncBatchNorm over TCP; a layer unfrozen
        // by the loop with micro-batches; a partly unused layer on 4 ranks with a user's
        // clipping optimizer.
        Case {
            driver: Driver::CustomLoop,
            ..b
        },
        Case {
            driver: Driver::CustomLoop,
            model: Model::Tied,
            transport: Transport::ThreadBuckets,
            shard: true,
            shard_grads: true,
            clip: Clip::Setting,
            samples: 50,
            ..b
        },
        Case {
            driver: Driver::CustomLoop,
            model: Model::SyncBn,
            transport: Transport::Tcp,
            opt: Opt::SgdMomentum,
            ..b
        },
        Case {
            driver: Driver::CustomLoop,
            model: Model::Unfrozen,
            accumulation: Some(2),
            opt: Opt::AdamW,
            sched: Scheduler::WarmupCosine,
            samples: 80,
            ..b
        },
        Case {
            driver: Driver::CustomLoop,
            model: Model::PartlyUnused,
            clip: Clip::Wrapper,
            world: 4,
            samples: 64,
            unchecked: true,
            ..b
        },
        // ZeRO-1 alone in a loop that clips by the global norm between the synchronisation and
        // the step (every reduced gradient is there), through host buckets and shared tensors.
        Case {
            driver: Driver::CustomLoop,
            shard: true,
            clip: Clip::Wrapper,
            transport: Transport::ThreadBuckets,
            samples: 50,
            ..b
        },
        Case {
            driver: Driver::CustomLoop,
            shard: true,
            clip: Clip::Wrapper,
            world: 3,
            global_batch: 12,
            samples: 48,
            ..b
        },
    ]
}

/// A small deterministic generator (the tail's seed is printed).
pub(super) struct Rng(pub u64);

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
pub(super) fn random(rng: &mut Rng) -> Case {
    let transport = match rng.below(6) {
        0 | 1 => Transport::Tcp,
        2 => Transport::ThreadBuckets,
        _ => Transport::Threads,
    };
    // Threads: 1 to 8 ranks; TCP: 2 to 4.
    let world = match transport {
        Transport::Threads | Transport::ThreadBuckets => 1 + rng.below(8),
        Transport::Tcp => 2 + rng.below(3),
    };
    let per_rank = 2 + rng.below(5);
    let model = [
        Model::Plain,
        Model::Frozen,
        Model::Unfrozen,
        Model::Tied,
        Model::PartlyUnused,
        Model::SyncBn,
        Model::FreezesAfterStep,
        Model::Teacher,
        Model::PlainBn,
        Model::Dropout,
    ][rng.below(10)];
    // Join mode refuses SyncBatchNorm.
    let join = rng.below(5) == 0 && model != Model::SyncBn;
    let steps = 2 + rng.below(4);
    // A last step of any size (none, short, fewer samples than ranks), but SyncBatchNorm needs
    // a sample on every rank in every step.
    let rest = match (rng.below(3), model) {
        (0, _) => 0,
        (_, Model::SyncBn) => world + rng.below(world * per_rank - world),
        _ => 1 + rng.below(world * per_rank - 1),
    };
    let samples = world * per_rank * steps + rest;
    let mut case = Case {
        world,
        transport,
        model,
        opt: [Opt::SgdMomentum, Opt::Adam, Opt::AdamW][rng.below(3)],
        sched: [
            Scheduler::Constant,
            Scheduler::StepDecay,
            Scheduler::WarmupCosine,
        ][rng.below(3)],
        // Join refuses gradient accumulation.
        accumulation: (!join && rng.below(3) == 0).then(|| 2 + rng.below(3)),
        clip: [Clip::Off, Clip::Off, Clip::Setting, Clip::Wrapper][rng.below(4)],
        shard: rng.below(3) == 0,
        shard_grads: false,
        samples,
        global_batch: world * per_rank,
        join,
        shuffle: rng.below(4) != 0,
        valid: [
            ValidKind::Plain,
            ValidKind::Distributed,
            ValidKind::BurnShuffled,
        ][rng.below(3)],
        valid_rank0: rng.below(4) == 0,
        valid_samples: 5 + rng.below(12),
        valid_batch: 1 + rng.below(5),
        epochs: 1 + rng.below(3),
        early_stopping: false,
        high_lr: false,
        stop_after: None,
        bucket_cap: (rng.below(4) == 0).then_some(256),
        unchecked: rng.below(4) == 0,
        train_burn: transport != Transport::Tcp && !join && rng.below(3) == 0,
        resume: Resume::No,
        interrupt_at: None,
        driver: Driver::Learner,
    };
    if !model.exact() {
        // Enough samples, epochs and a learning rate to learn (one device's loss falls too):
        // four optimizer steps per epoch.
        case.samples = case
            .samples
            .max(4 * case.global_batch * case.accumulation.unwrap_or(1));
        case.epochs = 4;
        case.opt = Opt::Adam;
        case.sched = Scheduler::Constant;
        case.clip = Clip::Off;
    }
    if let Some(micro_batches) = case.accumulation {
        // At least one optimizer step per epoch (its state is what sharding splits).
        case.samples = case.samples.max(micro_batches * case.global_batch);
    }
    // Resumed runs: Adam (whose state the harness's optimizer checkpoints), a model without
    // step counts of its own, no join mode.
    // A run stopped mid-epoch needs an optimizer step's boundary before the epoch's end (a stop
    // is taken there): more batches than one accumulation window.
    let batches = case.samples.div_ceil(case.global_batch);
    let mid_epoch_stops = batches > case.accumulation.unwrap_or(1);
    if rng.below(5) == 0 && !join && model.exact() && !model.counts_steps() {
        case.opt = Opt::Adam;
        case.resume = if case.epochs >= 2 && rng.below(2) == 0 {
            let other = match transport {
                Transport::Threads | Transport::ThreadBuckets => 1 + rng.below(8),
                Transport::Tcp => 2 + rng.below(3),
            };
            // The per-rank batch must divide the global batch on the other world size too.
            let other = if case.global_batch.is_multiple_of(other) {
                other
            } else {
                world
            };
            if model == Model::SyncBn && rest != 0 && rest < other {
                // SyncBatchNorm needs a sample on every rank of the other world size too.
                if mid_epoch_stops {
                    Resume::MidEpoch
                } else {
                    Resume::No
                }
            } else {
                Resume::AfterEpoch { world: other }
            }
        } else if mid_epoch_stops {
            Resume::MidEpoch
        } else {
            Resume::No
        };
    }
    if model == Model::Teacher {
        // Under optimizer sharding Burn 0.22's Learner runs `optimize` before the other ranks'
        // parameters arrive: a teacher moved towards the student there is refused (it would see
        // a partly updated student, docs/limits.md). Not drawn sharded, nor resumed with the
        // sharding flipped.
        case.shard = false;
        if matches!(case.resume, Resume::AfterEpoch { .. }) {
            case.resume = Resume::No;
        }
    }
    // ZeRO-2 wherever the optimizer state is sharded (the resumed leg of a run resumed after an
    // epoch flips the sharding).
    let sharded_somewhere = case.shard || matches!(case.resume, Resume::AfterEpoch { .. });
    case.shard_grads = sharded_somewhere && case.clip != Clip::Wrapper && rng.below(2) == 0;
    if case.resume != Resume::No || model == Model::SyncBn {
        // Resumed runs restart a Burn loader's generator; SyncBatchNorm needs every rank a
        // batch in the last step, which Burn's loader dealt to the ranks need not leave.
        case.train_burn = false;
    }
    let plain = case.resume == Resume::No && model.exact();
    // SyncBatchNorm's statistics keep the micro-batches burn-ddp still runs after an interrupt
    // inside an accumulation window (docs/semantics.md): not drawn together.
    let interruptible = !(model == Model::SyncBn && case.accumulation.is_some());
    if plain && !join && interruptible && case.batches() * case.epochs >= 2 && rng.below(5) == 0 {
        // Interrupted at any micro-batch from the second on (inside an accumulation window, at
        // its last micro-batch, at an epoch's last step), both sides.
        case.interrupt_at = Some(2 + rng.below(case.batches() * case.epochs - 1));
    } else if plain && rng.below(6) == 0 {
        // Early stopping on the validation loss, at times with a learning rate that makes it go
        // up: with SGD (Adam's update turns the rounding of a sum in another order into steps of
        // the learning rate's size, which the metrics' 1e-4 cannot absorb at this rate).
        case.early_stopping = true;
        case.high_lr = rng.below(2) == 0;
        if case.high_lr {
            case.opt = Opt::SgdMomentum;
        }
        case.epochs = 3 + rng.below(3);
    } else if plain && !join && model.in_custom_loop() && rng.below(5) == 0 {
        // (Its clipping between the synchronisation and the step sees every gradient under
        // ZeRO-1, as a user's loop does.)
        case.driver = Driver::CustomLoop;
        // The loop clips between the synchronisation and the step: every gradient is there but
        // under ZeRO-2.
        if case.shard_grads && case.clip == Clip::Wrapper {
            case.clip = Clip::Setting;
        }
        case.train_burn = false;
    }
    if case.driver == Driver::Learner && case.clip == Clip::Wrapper && sharded_somewhere {
        // Under sharding the model's `optimize` sees its rank's gradients only (Burn 0.22's
        // Learner steps them inside it): clip with burn-ddp's setting there.
        case.clip = Clip::Setting;
    }
    case
}
