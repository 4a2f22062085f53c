//! The training loop of one rank: epochs of steps, each step agreed with the other ranks,
//! reduced, applied; the end of every epoch (every rank validates its shard, rank 0 writes its
//! checkpoint, the others wait for it); and the stops (an interrupt, a stop signal, with a
//! checkpoint of the step reached). The checkpoints themselves: `checkpointing.rs`.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use burn::data::dataloader::{DataLoaderIterator, Progress};
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::Device;
use burn::train::{Interrupter, Learner, LearnerEvent, LearnerModel, TrainLoader, TrainStep};

use super::events::{Events, Meta};
use super::metrics_file::StepTimes;
use super::policy::{Agreement, OnNonFinite, StepPolicy, StopVote, end_of_data};
use super::rank::{Comm, ModelOutput, Role, ValidOutput};
use super::sharded::{RecordReader, Sharded};
use super::shards::Cut;
use super::startup::Startup;
use super::validation::ValidShard;
use crate::checkpoint::Resume;
use crate::config::DdpConfig;
use crate::ddp::DistributedDataParallel;
use crate::error::{DdpError, Result};
use crate::lockstep::Position;
use crate::metrics::{RankReport, TrainingReport};
use crate::monitor::SyncWatch;
use crate::reducer::ReduceOutcome;
use burn_ddp_comm::group::Counts;
use burn_ddp_comm::group::ProcessGroup;

/// The rank as the parts of its training see it ([`Comm`]), borrowing only the trainer's fields
/// it names (so the role and the events can be borrowed beside it).
macro_rules! comm {
    ($trainer:expr) => {
        Comm {
            rank: $trainer.rank,
            group: &$trainer.group,
            device: &$trainer.device,
            timeout: $trainer.config.timeout(),
        }
    };
}

mod batch;
mod end;

/// How the replicas' buffers (BatchNorm's running statistics) are kept alike after every step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Buffers {
    /// One replica: nothing to keep alike.
    Alone,
    /// Thread replicas: clones of one module, which share Burn's `RunningState` (it averages
    /// their updates); the updates are folded on rank 0's thread, complete before any replica
    /// reads them ([`DistributedDataParallel::settle_shared_buffers`]).
    Shared,
    /// Replicas in separate processes: averaged or broadcast by collectives, as
    /// [`BufferSync`] says.
    Separate,
}

impl Buffers {
    /// The kind for `world_size` replicas that are threads of one process or not.
    pub fn of(world_size: usize, threads: bool) -> Self {
        match (world_size > 1, threads) {
            (false, _) => Buffers::Alone,
            (true, true) => Buffers::Shared,
            (true, false) => Buffers::Separate,
        }
    }
}

/// The input of a training step.
type TrainingModelInput<M> = <M as TrainStep>::Input;

/// Everything one rank needs, moved into its thread.
pub(super) struct Trainer<M: LearnerModel> {
    pub rank: usize,
    pub group: Arc<dyn ProcessGroup>,
    pub device: Device,
    pub learner: Learner<M>,
    pub dataloader: TrainLoader<M>,
    pub role: Role<M>,
    pub config: DdpConfig,
    pub interrupter: Interrupter,
    pub grad_accumulation: usize,
    pub epochs: std::ops::RangeInclusive<usize>,
    pub report: Arc<Mutex<TrainingReport>>,
    /// How the replicas' buffers (BatchNorm statistics) are kept alike after every step.
    pub buffers: Buffers,
    /// Where the run starts: batches of the first epoch to skip, counters so far.
    pub resume: Resume,
    /// What rank 0 hands burn-train as events of training.
    pub events: Events<M>,
    /// This process's loaders as the ranks compare them at start-up (the other fields are
    /// filled in by the rank).
    pub loaders: Startup,
    /// The run its checkpoints belong to.
    pub run_id: String,
    /// This rank's whole batches of the validation loader (sharded validation); `None`: rank 0
    /// validates alone.
    pub valid_shard: Option<ValidShard<M>>,
    /// How this rank's training loader was cut from burn-train's: whether it records what each
    /// step holds on its thread (the sampler's `Drawn`), and whether its progress is one
    /// device's already (a dealt loader) or this rank's share.
    pub cut: Cut,
    /// The optimizer, with [`DdpConfig::with_optimizer_sharding`].
    pub sharded: Option<Sharded>,
    /// burn-train writes epoch checkpoints (it was given checkpointers): with sharding, every
    /// rank joins rank 0's checkpoint with its share of the optimizer state.
    pub epoch_checkpoints: bool,
    /// Reads the learner's optimizer record (for sharding, and the report's optimizer state).
    pub records: RecordReader<M>,
}

/// Why an epoch's loop ended before its data.
enum Stop {
    /// burn-train's `Interrupter` (a user's or a callback's stop): no checkpoint.
    Interrupted,
    /// A stop signal reached these ranks: checkpoint the step, then stop.
    Signal(Vec<(usize, i32)>),
}

/// The run's counters, carried across epochs (and restored by a resume).
pub(super) struct Counters {
    /// Optimizer steps taken (skipped steps excluded).
    pub optimizer_steps: u64,
    /// Gradient synchronisations (skipped steps included): the consistency check's cadence, and
    /// the numbers of step checkpoints.
    pub synchronisations: u64,
}

/// The run's state across epochs.
struct Run {
    policy: StepPolicy,
    counters: Counters,
    /// Which tensors are buffers (BatchNorm statistics): a skipped step restores them.
    buffers: Vec<bool>,
    /// This rank's synchronisation times and spikes.
    watch: SyncWatch,
}

/// One epoch's training in progress: where the loop is and what it has done.
struct EpochState<M: LearnerModel> {
    epoch: usize,
    progress_global: Progress,
    accumulator: GradientsAccumulator<M>,
    /// The buffers before this step's forward passes (a skipped step puts them back).
    buffer_snapshot: Option<Vec<f32>>,
    /// Optimizer steps taken this epoch.
    steps: u64,
    /// Batches of the epoch so far (a resumed run starts past the ones it trained).
    step: usize,
    stop: Option<Stop>,
    /// burn-train's `Interrupter` asked to stop after a micro-batch of the accumulation window in
    /// progress that was not its last: the window's reduction carries it, and no rank steps.
    interrupted_in_window: bool,
    /// This rank's samples; the epoch's total comes with the end-of-epoch all-gather.
    local_samples: u64,
}

/// What an epoch's steps leave for its end.
struct Trained {
    steps: u64,
    step: usize,
    stop: Option<Stop>,
    local_samples: u64,
    train_time: std::time::Duration,
    progress_global: Progress,
}

/// How a step of the loop ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Next {
    /// On to the next batch.
    Batch,
    /// Every rank is out of data (or, in join mode, nobody has a batch): the epoch's steps end.
    EndOfData,
}

/// This rank's input to a step (`None`: it has no batch left).
type Input<M> = Option<TrainingModelInput<M>>;

/// One batch of a rank: what the loader gave and what training it produced.
struct Batch<M: LearnerModel> {
    /// This rank's samples in it (0: none left, or none in this step).
    samples: usize,
    /// What a `DistributedDataLoader` says of the step (outside join mode): its samples over
    /// all ranks, this rank's share of them.
    drawn: Option<crate::sampler::Drawn>,
    /// The rank has no batch left (outside join mode).
    out_of_data: bool,
    /// What the ranks agreed on before the step (join mode).
    agreement: Option<Agreement>,
    /// The step's output, for rank 0's events (`None`: no batch).
    item: Option<ModelOutput<M>>,
}

impl<M: LearnerModel> Batch<M> {
    /// The factor of this rank's gradients in the step's average: its share of the step's
    /// samples (1 but in a short last step of a `DistributedDataLoader`).
    fn weight(&self) -> f32 {
        self.drawn.map_or(1.0, |d| d.weight())
    }
}

impl<M: LearnerModel + Send + 'static> Trainer<M>
where
    ModelOutput<M>: 'static,
    ValidOutput<M>: 'static,
{
    /// Trains the epochs of `self.epochs`.
    pub(super) fn train_epochs(
        &mut self,
        ddp: &mut DistributedDataParallel,
        report: &mut RankReport,
        collectives: &Counts,
    ) -> Result<()> {
        let mut run = Run {
            policy: StepPolicy::new(&self.config, self.grad_accumulation)?,
            counters: Counters {
                optimizer_steps: self.resume.optimizer_steps,
                synchronisations: self.resume.synchronisations,
            },
            // BatchNorm statistics are updated in the forward pass: a skipped step must undo
            // that. Only buffers: frozen weights do not change.
            buffers: ddp.replica_layout().buffer_mask(),
            watch: SyncWatch::new(self.config.spike_factor()),
        };
        report.sync = run.watch.times();
        for epoch in self.epochs.clone() {
            // burn-train's epoch k is sampler epoch k - 1, for the training loader and for the
            // validation loader at the epoch's end: a resumed run gets the orders the
            // uninterrupted run would have had, without the user telling the loaders.
            let _epoch = crate::sampler::enter_epoch(epoch as u64 - 1);
            let trained = self.train_epoch(epoch, &mut run, ddp, report, collectives)?;
            if let Some(Stop::Signal(signalled)) = trained.stop {
                return Err(self.stop_for_signal(epoch, trained.step, &run.counters, signalled));
            }
            if !self.end_epoch(epoch, trained, &run.counters)? {
                break;
            }
        }
        Ok(())
    }

    /// The steps of `epoch`, until the data ends or a stop.
    fn train_epoch(
        &mut self,
        epoch: usize,
        run: &mut Run,
        ddp: &mut DistributedDataParallel,
        report: &mut RankReport,
        collectives: &Counts,
    ) -> Result<Trained> {
        let started = Instant::now();
        run.policy.start_epoch();
        let dataloader = self.dataloader.clone();
        let mut iterator = dataloader.iter();
        // A run resumed from a step checkpoint skips the batches that were trained.
        let skip = if epoch == *self.epochs.start() {
            self.resume.batches
        } else {
            0
        };
        for _ in 0..skip {
            if iterator.next().is_none() {
                break;
            }
        }
        let mut state = EpochState {
            epoch,
            progress_global: Progress::new(epoch, *self.epochs.end(), Some("epochs".into())),
            accumulator: GradientsAccumulator::new(),
            buffer_snapshot: None,
            steps: 0,
            step: skip,
            stop: None,
            interrupted_in_window: false,
            local_samples: 0,
        };
        self.events.start(skip);
        if let Role::Leader(leader) = &mut self.role {
            leader.train_event(LearnerEvent::StartSplit {
                epoch_number: epoch,
                total_items: self.loaders.train_items as usize,
            });
        }
        let collectives_before = collectives.collectives.load(Ordering::Relaxed);
        let bytes_before = collectives.bus_bytes.load(Ordering::Relaxed);
        let ended = loop {
            match self.step(&mut state, &mut *iterator, run, ddp, report) {
                Ok(next) if matches!(next, Next::EndOfData) || state.stop.is_some() => break Ok(()),
                Ok(_) => {}
                Err(err) => break Err(err),
            }
        };
        // Also when a step failed: the report tells how far the rank got.
        report.step_collectives +=
            collectives.collectives.load(Ordering::Relaxed) - collectives_before;
        report.step_bus_bytes += collectives.bus_bytes.load(Ordering::Relaxed) - bytes_before;
        report.train_time += started.elapsed();
        report.sync = run.watch.times();
        ended?;
        if !run.policy.at_step_boundary() {
            // An epoch ended inside a window (an interrupt: its micro-batches go unstepped),
            // whose forward passes moved each rank's BatchNorm statistics by its own samples (one
            // device has one set): every rank is here with as many of them.
            self.sync_buffers(ddp)?;
        }
        Ok(Trained {
            steps: state.steps,
            step: state.step,
            stop: state.stop,
            local_samples: state.local_samples,
            train_time: started.elapsed(),
            progress_global: state.progress_global,
        })
    }

    /// One step of the loop: the next batch, its forward and backward passes, and (at an
    /// optimizer step's boundary) the reduction and the update; then the step's report.
    fn step(
        &mut self,
        state: &mut EpochState<M>,
        iterator: &mut dyn DataLoaderIterator<TrainingModelInput<M>>,
        run: &mut Run,
        ddp: &mut DistributedDataParallel,
        report: &mut RankReport,
    ) -> Result<Next> {
        let started = Instant::now();
        let (compute_before, optimizer_before) = (report.compute, report.optimizer);
        let Some((mut batch, input)) = self.next_batch(state, iterator, run, report)? else {
            return Ok(Next::EndOfData);
        };
        if run.policy.may_skip() && run.policy.at_step_boundary() && run.buffers.contains(&true) {
            // Taken before this step's forward passes touch BatchNorm statistics.
            state.buffer_snapshot = Some(crate::replica::snapshot_selected(
                &self.learner.model(),
                &run.buffers,
            ));
        }
        let grads = self.forward(input, &mut batch, run, report)?;
        let ready = if batch.out_of_data {
            // A rank out of data joins the step that tells every rank so, without gradients.
            Some(None)
        } else if run.policy.accumulates() {
            // burn-train 0.22 steps a window when it is full or at the epoch's last batch. Every
            // rank must decide alike: where the sampler says how many steps the epoch has (its
            // shards may end a batch apart), from that; else from this rank's loader, whose
            // batches end together on every rank (one device's dealt, or equal slices).
            let last_of_epoch = match batch.drawn {
                Some(drawn) => state.step as u64 + 1 >= drawn.steps,
                None => iterator.progress().is_completed(),
            };
            let complete = run.policy.micro_batch_done(last_of_epoch);
            if let Some(mut grads) = grads {
                // Each micro-batch weighed by this rank's share of its samples before the sum.
                let model = self.learner.model();
                if batch.weight() != 1.0 {
                    crate::reducer::scale_gradients(&model, &mut grads, batch.weight());
                }
                state.accumulator.accumulate(&model, grads);
            }
            complete.then(|| Some(state.accumulator.grads()))
        } else {
            Some(grads)
        };
        // burn-train's loop checks its interrupter after every micro-batch and stops there,
        // without the window's optimizer step: the window's reduction tells every rank.
        if ready.is_none() && self.interrupter.should_stop() {
            state.interrupted_in_window = true;
        }
        if ready.is_none() && self.buffers == Buffers::Shared {
            // Inside an accumulation window: the next forward pass reads the statistics this one
            // updated on every thread.
            ddp.settle_shared_buffers(&self.learner.model())?;
        }
        if let Some(grads) = ready
            && self.synchronise(state, &batch, grads, run, ddp, report)? == Next::EndOfData
        {
            return Ok(Next::EndOfData);
        }
        // Every rank reports every step (join mode: `None` without a batch), so rank 0 can
        // report one item per step covering the global batch.
        // burn-train's progress: one device's (a dealt loader reports it; a DistributedDataLoader
        // says what the steps drawn hold over all ranks), or this rank's share times the ranks
        // (equal slices of another loader).
        let local = iterator.progress();
        // In join mode the step is not drawn (the ranks agree on it instead), but what the
        // sampler drew still says the epoch's progress over all ranks.
        let drawn = batch.drawn.or_else(|| {
            (self.cut == Cut::Sampler)
                .then(crate::sampler::drawn_on_this_thread)
                .flatten()
        });
        let progress = match (self.cut, drawn) {
            (Cut::Dealt, _) => local,
            (_, Some(drawn)) => {
                let (done, whole) = drawn.global_progress();
                Progress::new(done as usize, whole as usize, local.unit.clone())
            }
            _ => {
                let ranks = self.group.world_size();
                Progress::new(
                    local.items_processed * ranks,
                    local.items_total * ranks,
                    local.unit.clone(),
                )
            }
        };
        let meta = Meta {
            progress,
            lr: Some(self.learner.lr_current()),
            times: StepTimes {
                wall: started.elapsed(),
                compute: report.compute.saturating_sub(compute_before),
                optimizer: report.optimizer.saturating_sub(optimizer_before),
            },
        };
        self.events.train(
            &mut self.role,
            &comm!(self),
            state.step,
            batch.item,
            meta,
            &state.progress_global,
        )?;
        state.step += 1;
        Ok(Next::Batch)
    }

    /// The gradient reduction of an optimizer step (carrying the stop votes and this rank's
    /// position) and what follows it: the update or a skipped step, the buffers, the checks,
    /// the checkpoint due, the stops voted.
    fn synchronise(
        &mut self,
        state: &mut EpochState<M>,
        batch: &Batch<M>,
        grads: Option<GradientsParams>,
        run: &mut Run,
        ddp: &mut DistributedDataParallel,
        report: &mut RankReport,
    ) -> Result<Next> {
        let samples = batch.samples as u64;
        let mut options = run.policy.reduce_options(
            samples,
            batch.agreement.as_ref().map_or(0, Agreement::total),
        );
        if !run.policy.join() && !run.policy.accumulates() {
            // Accumulated micro-batches were weighed one by one.
            options.weight = batch.weight();
        }
        if ddp.config().gradient_sharding()
            && let Some(shards) = ddp.optimizer_shards()
        {
            // ZeRO stage 2: this rank receives (and `optimize` sees) its own gradients only.
            options.keep = Some(shards.own());
        }
        if batch.agreement.is_none() {
            // Read after this step's forward and backward passes: an interrupt raised during
            // them stops training after this step.
            let inside = std::mem::take(&mut state.interrupted_in_window);
            options.words = StopVote {
                interrupt: !inside && self.interrupter.should_stop(),
                signal: self.signal().is_some(),
                out_of_data: batch.out_of_data,
                interrupted_inside: inside,
            }
            .words();
        }
        // Where this rank is: the same on every rank, or the step fails.
        let position = Position {
            epoch: state.epoch as u64,
            batches: state.step as u64 + 1,
            // The step's samples over all ranks, as a DistributedDataLoader outside join mode
            // says (each rank's own may differ by one in the last step; a Burn loader with
            // workers hands out its short batches in any order).
            samples: batch.drawn.map_or(0, |d| d.global_samples),
            lr_bits: self.learner.lr_current().base().to_bits(),
            probe: 0,
        };
        let started = Instant::now();
        let (outcome, in_step) = ddp.sync_at(&self.learner.model(), grads, options, position)?;
        let took = started.elapsed();
        let votes = StopVote::from_reduced(&outcome.words);
        if votes.out_of_data {
            // Some rank is out of data: every rank is here, and compares batch counts (one small
            // all-gather, once per epoch when all is well).
            let started = Instant::now();
            let words = self.group.all_gather(
                &[u64::from(batch.out_of_data), state.step as u64],
                self.config.timeout(),
            )?;
            report.coordination += started.elapsed();
            end_of_data(&words, self.rank, state.epoch, state.step)?;
            // Every rank ran out after as many batches: not a synchronisation.
            ddp.uncount_step();
            if votes.interrupted() {
                // As burn-train's loop after an epoch whose steps were interrupted: no
                // validation, no checkpoint.
                state.stop = Some(Stop::Interrupted);
            }
            return Ok(Next::EndOfData);
        }
        in_step?;
        run.watch
            .observe(self.rank, run.counters.synchronisations, took);
        run.counters.synchronisations += 1;
        if votes.skips_window_step() {
            // Interrupted inside the window: burn-train stops before its optimizer step.
            self.sync_buffers(ddp)?;
            state.stop = Some(Stop::Interrupted);
            return Ok(Next::Batch);
        }
        let stepped = self.apply(state, outcome, run, report)?;
        self.sync_buffers(ddp)?;
        let every = self.config.consistency_check_every();
        if every > 0 && run.counters.synchronisations.is_multiple_of(every) {
            ddp.check_consistency(&self.learner.model(), run.counters.optimizer_steps)?;
        }
        self.after_votes(state, votes, stepped, &run.counters)?;
        Ok(Next::Batch)
    }

    /// The optimizer step on the averaged gradients, or the step skipped (non-finite
    /// gradients: counted, the buffers put back) or failed ([`NonFinite::Error`]). Returns
    /// whether the optimizer stepped.
    fn apply(
        &mut self,
        state: &mut EpochState<M>,
        outcome: ReduceOutcome,
        run: &mut Run,
        report: &mut RankReport,
    ) -> Result<bool> {
        // As burn-train 0.22's loop: the scheduler steps once per optimizer step, right before
        // it (a skipped step spends its learning rate, as PyTorch's `GradScaler` does).
        self.learner.lr_step();
        if !outcome.non_finite {
            let started = Instant::now();
            match &mut self.sharded {
                Some(sharded) => sharded.step(
                    &mut self.learner,
                    outcome.grads,
                    self.group.as_ref(),
                    self.config.timeout(),
                )?,
                None => self.learner.optimizer_step(outcome.grads),
            }
            report.optimizer += started.elapsed();
            state.steps += 1;
            run.counters.optimizer_steps += 1;
            return Ok(true);
        }
        if run.policy.on_non_finite() == OnNonFinite::Fail {
            let flags = self.group.all_gather(
                &[u64::from(outcome.local_non_finite)],
                self.config.timeout(),
            )?;
            return Err(DdpError::NonFinite {
                rank: self.rank,
                epoch: state.epoch,
                step: state.steps + report.skipped_steps,
                ranks: (0..self.group.world_size())
                    .filter(|&r| flags[r] != 0)
                    .collect(),
            });
        }
        report.skipped_steps += 1;
        // The forward passes updated BatchNorm statistics with the bad batch.
        if let Some(snapshot) = &state.buffer_snapshot {
            let model = self.learner.model();
            // Fold the pending updates first, so they cannot land afterwards.
            let _ = model.valid();
            let model = crate::replica::restore_selected(model, snapshot, &run.buffers);
            self.learner.load_model(model.into_record());
        }
        burn_ddp_comm::log::warn_console(&format!(
            "rank {}: skipped step {} of epoch {}: the gradients are not finite",
            self.rank, state.step, state.epoch
        ));
        Ok(false)
    }

    /// After a synchronisation: the periodic step checkpoint when due, and the stop the ranks
    /// voted for (an interrupt, or a stop signal: then who was signalled, and with what).
    fn after_votes(
        &mut self,
        state: &mut EpochState<M>,
        votes: StopVote,
        stepped: bool,
        counters: &Counters,
    ) -> Result<()> {
        let every = self.config.checkpoint_every();
        let checkpoint_due = every > 0 && stepped && counters.optimizer_steps.is_multiple_of(every);
        if votes.interrupted() {
            // The step is trained: its due checkpoint is written before stopping.
            if checkpoint_due {
                self.step_checkpoint_meeting(state.epoch, state.step + 1, counters)?;
            }
            state.stop = Some(Stop::Interrupted);
        } else if votes.signal {
            // Rare: one all-gather to name who was signalled, and with what.
            let all = self.group.all_gather(
                &[self.signal().map_or(0, |s| s as u64)],
                self.config.timeout(),
            )?;
            state.stop = Some(Stop::Signal(
                all.iter()
                    .enumerate()
                    .filter(|(_, s)| **s != 0)
                    .map(|(r, s)| (r, *s as i32))
                    .collect(),
            ));
        } else if checkpoint_due {
            self.step_checkpoint_meeting(state.epoch, state.step + 1, counters)?;
        }
        Ok(())
    }

    /// One small all-gather per step: how many samples each rank's batch has (0: none left),
    /// whether it was interrupted and whether it received a stop signal. Every rank gets the same
    /// answer, so all stop at the same step.
    fn agree(&self, samples: usize) -> Result<Agreement> {
        let words = Agreement::words(samples, self.interrupter.should_stop(), self.signal());
        let all = self.group.all_gather(&words, self.config.timeout())?;
        Ok(Agreement::from_words(&all))
    }

    /// The stop signal this process received, when the configuration honours them.
    fn signal(&self) -> Option<i32> {
        if self.config.stop_on_signal() {
            burn_ddp_comm::signals::received()
        } else {
            None
        }
    }
}

/// The epoch's last step leaves a rank without a sample (`drawn`: fewer samples than ranks, or
/// fewer batches than ranks for a loader dealt as one device reads it): that rank cannot run
/// SyncBatchNorm's forward pass, whose collectives every rank joins.
fn without_sample_under_sync_bn(drawn: &crate::sampler::Drawn) -> DdpError {
    let (what, fix) = if drawn.last_step_without_batch > 0 {
        (
            format!(
                "{} batch(es) for {} ranks",
                drawn.world_size - drawn.last_step_without_batch,
                drawn.world_size
            ),
            "give the training loader a number of items that fills the last step's batches on \
             every rank, or use a DistributedDataLoader built with \
             DistributedSampler::with_drop_last(true)",
        )
    } else {
        (
            format!(
                "{} sample(s), fewer than the ranks",
                drawn.last_step_samples
            ),
            "build the training sampler with DistributedSampler::with_drop_last(true), or \
             choose a batch size or dataset size that leaves every rank a sample in the last step",
        )
    };
    DdpError::InvalidConfig(format!(
        "the epoch's last step has {what}, and SyncBatchNorm needs a sample on every rank for \
         its forward pass: {fix}"
    ))
}
