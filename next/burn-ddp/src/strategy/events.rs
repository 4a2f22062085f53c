//! The events rank 0 hands burn-train: what its renderer, metric loggers and metrics see of
//! training, **one item per step**, the replicas' outputs of that step joined into the output of the global batch
//! ([`DistributedOutput`](crate::outputs::DistributedOutput)), with a monotone iteration number,
//! in thread and in process mode alike. (Validation reports one item per batch: `validation.rs`.)
//!
//! How the outputs reach rank 0: ranks that are threads of one process send them through a
//! channel as they are produced; ranks that are processes keep them and send them together every
//! [`DdpConfig::with_metrics_every`](crate::DdpConfig::with_metrics_every) steps and at the end of
//! the epoch (`wire.rs`: two all-gathers, the lengths, then the encoded outputs), so a step stays
//! one collective. Without a codec for the output type (not one of burn-train's outputs), threads
//! report every replica's item on its own and processes only rank 0's.

use std::collections::BTreeMap;
use std::sync::mpsc::RecvTimeoutError;
use std::time::Instant;

use burn::data::dataloader::Progress;
use burn::lr_scheduler::module_lr_scheduler::ModuleLearningRate;
use burn::tensor::Device;
use burn::train::{LearnerEvent, LearnerModel, TrainingItem};

use super::handoff::Handoff;
use super::metrics_file::StepTimes;
use super::rank::{Comm, Leader, ModelOutput, Part, Role, ValidOutput};
use super::wire::{bad_words, decode_entry, encode_entry, gather_words};
use crate::error::{DdpError, Result};
use crate::outputs::{Codec, codec};

/// What rank 0 knows of a training step besides the outputs: its own progress, learning rate
/// and times.
pub(super) struct Meta {
    /// This rank's progress in the epoch, over all ranks' samples.
    pub progress: Progress,
    /// The learning rate of the step.
    pub lr: Option<ModuleLearningRate>,
    /// This rank's times in the step (for the metrics file).
    pub times: StepTimes,
}

/// Per step, per rank: `None` while the rank's part has not arrived, then its output (`None`: no
/// batch).
type Slots<T> = BTreeMap<usize, Vec<Option<Option<T>>>>;

/// One rank's training events on their way to burn-train (see the [module docs](self)).
pub(super) struct Events<M: LearnerModel> {
    /// The job's ranks are threads of this process.
    pub threads: bool,
    /// Process mode: steps between two sends of the outputs to rank 0.
    pub metrics_every: usize,
    train_codec: Option<Codec<ModelOutput<M>>>,
    train: Slots<ModelOutput<M>>,
    meta: BTreeMap<usize, Meta>,
    /// The next step rank 0 hands burn-train.
    next: usize,
    /// Steps this rank reported this epoch.
    steps: usize,
    /// Ranks of the job.
    world_size: usize,
    /// Validation parts that arrived while rank 0 was still collecting training parts (a rank
    /// that finished its steps validates at once).
    pub stash: std::collections::VecDeque<Part<M>>,
    /// Rank 0's latest epoch progress (for other ranks' items reported on their own).
    last_progress: Option<Progress>,
}

impl<M: LearnerModel> Events<M>
where
    ModelOutput<M>: 'static,
    ValidOutput<M>: 'static,
{
    /// The reporting of a job whose ranks are threads of one process (`threads`) or processes.
    pub fn new(threads: bool, metrics_every: usize, world_size: usize) -> Self {
        Self {
            threads,
            metrics_every: metrics_every.max(1),
            train_codec: codec::<ModelOutput<M>>(),
            train: BTreeMap::new(),
            meta: BTreeMap::new(),
            next: 0,
            steps: 0,
            world_size,
            stash: std::collections::VecDeque::new(),
            last_progress: None,
        }
    }

    /// Whether training items can be joined (the training output type has a codec).
    pub fn joins_training(&self) -> bool {
        self.train_codec.is_some()
    }
}

impl<M: LearnerModel> Events<M>
where
    ModelOutput<M>: 'static,
    ValidOutput<M>: 'static,
{
    /// A new epoch's reporting, from step `first` (the batches a resumed run skips).
    pub(super) fn start(&mut self, first: usize) {
        let events = self;
        events.stash.clear();
        events.train.clear();
        events.meta.clear();
        events.next = first;
        events.steps = first;
    }

    /// Sends this rank's output of training step `step` (0-based within the epoch; `None`: no
    /// batch), with its progress (over all ranks) and learning rate.
    ///
    /// # Errors
    /// Process mode, every `metrics_every` steps: the all-gathers' errors.
    pub(super) fn train(
        &mut self,
        role: &mut Role<M>,
        comm: &Comm<'_>,
        step: usize,
        output: Option<ModelOutput<M>>,
        meta: Meta,
        progress_global: &Progress,
    ) -> Result<()> {
        self.steps = step + 1;
        let Meta {
            progress,
            lr,
            times,
        } = meta;
        let world_size = comm.group.world_size();
        let rank = comm.rank;
        let joined = self.train_codec.is_some();
        match role {
            Role::Follower(sender) => {
                // Read here, where it was made (see `handoff.rs`). Rank 0 only stops listening
                // when training ends; a failed send means it is gone, which the next collective
                // reports.
                let output = output
                    .map(|o| Handoff::of(o, self.train_codec))
                    .transpose()
                    .map_err(|detail| unreadable_output(rank, step, detail))?;
                let _ = sender.send(Part::Train { rank, step, output });
                return Ok(());
            }
            Role::Leader(leader) if !joined => {
                // No codec: every replica's item on its own (threads), or rank 0's (processes).
                self.last_progress = Some(progress.clone());
                if let Some(file) = &mut leader.metrics_file {
                    // Without a codec neither the global batch nor the loss is known here.
                    file.step(
                        progress_global.items_processed,
                        step + 1,
                        None,
                        lr.as_ref().map(ModuleLearningRate::base),
                        None,
                        times,
                    );
                }
                if let Some(output) = output {
                    let item = TrainingItem::new(output, progress, Some(step + 1), lr);
                    leader.train_event(LearnerEvent::ProcessedItem(item));
                }
                drain_unjoined(leader, self);
                return Ok(());
            }
            Role::Silent(_) if !joined => return Ok(()),
            Role::Leader(_) => {
                self.meta.insert(
                    step,
                    Meta {
                        progress,
                        lr,
                        times,
                    },
                );
            }
            Role::Silent(_) => {}
        }
        let slots = self
            .train
            .entry(step)
            .or_insert_with(|| (0..world_size).map(|_| None).collect());
        slots[rank] = Some(output);
        if self.threads {
            if let Role::Leader(leader) = role {
                drain_parts(leader, self, None, comm.device)?;
                emit_ready(leader, self, progress_global, comm.device);
            }
            Ok(())
        } else if (step + 1).is_multiple_of(self.metrics_every) {
            self.gather(role, comm, progress_global)
        } else {
            Ok(())
        }
    }

    /// The end of an epoch's training steps: rank 0 reports every step the ranks trained
    /// (waiting for the parts of threads still on their way; gathering those of processes).
    ///
    /// # Errors
    /// Process mode: the all-gathers' errors; thread mode: a rank whose part does not arrive
    /// within the timeout ([`DdpError::Unresponsive`]).
    pub(super) fn finish(
        &mut self,
        role: &mut Role<M>,
        comm: &Comm<'_>,
        progress_global: &Progress,
    ) -> Result<()> {
        if self.train_codec.is_none() {
            if let Role::Leader(leader) = role {
                drain_unjoined(leader, self);
            }
            return Ok(());
        }
        if !self.threads {
            return self.gather(role, comm, progress_global);
        }
        let steps = self.steps;
        let Role::Leader(leader) = role else {
            return Ok(());
        };
        let deadline = Instant::now() + comm.timeout;
        loop {
            emit_ready(leader, self, progress_global, comm.device);
            if self.next >= steps {
                return Ok(());
            }
            drain_parts(leader, self, Some(deadline), comm.device)?;
        }
    }

    /// Process mode: sends this rank's pending training outputs to rank 0 (every rank calls it
    /// at the same steps), which reports the steps now complete.
    fn gather(
        &mut self,
        role: &mut Role<M>,
        comm: &Comm<'_>,
        progress_global: &Progress,
    ) -> Result<()> {
        let Some(codec) = self.train_codec else {
            return Ok(());
        };
        let rank = comm.rank;
        let leader = matches!(role, Role::Leader(_));
        // Rank 0 keeps its own outputs; the others send theirs.
        let mine: Vec<(usize, Option<ModelOutput<M>>)> = if leader {
            Vec::new()
        } else {
            std::mem::take(&mut self.train)
                .into_iter()
                .map(|(step, mut slots)| (step, slots[rank].take().flatten()))
                .collect()
        };
        let mut words = Vec::new();
        for (step, output) in &mine {
            encode_entry(&mut words, *step, output.as_ref(), codec.encode)
                .map_err(|detail| unreadable_output(rank, *step, detail))?;
        }
        let all = gather_words(comm.group.as_ref(), words, comm.timeout)?;
        let Role::Leader(leader) = role else {
            return Ok(());
        };
        for (from, words) in all.iter().enumerate().filter(|(r, _)| *r != rank) {
            let mut rest = words.as_slice();
            while !rest.is_empty() {
                let (step, output) = decode_entry(&mut rest, codec.decode, comm.device)
                    .map_err(|detail| bad_words(rank, from, detail))?;
                let world_size = all.len();
                let slots = self
                    .train
                    .entry(step)
                    .or_insert_with(|| (0..world_size).map(|_| None).collect());
                slots[from] = Some(output);
            }
        }
        emit_ready(leader, self, progress_global, comm.device);
        Ok(())
    }
}

/// No codec (thread mode): the other ranks' items, each on its own, as they arrived, with rank
/// 0's latest progress; validation parts of ranks already done training are kept for
/// validation (`validation.rs`).
fn drain_unjoined<M: LearnerModel>(leader: &mut Leader<M>, events: &mut Events<M>) {
    while let Ok(part) = leader.items.try_recv() {
        let (step, output) = match part {
            Part::Train { step, output, .. } => (step, output),
            other => {
                events.stash.push_back(other);
                continue;
            }
        };
        // No codec: the output itself crossed (its producer's device synchronised).
        if let Some(Handoff::Output(output)) = output {
            let item = TrainingItem::new(
                output,
                events
                    .last_progress
                    .clone()
                    .unwrap_or_else(|| Progress::new(0, 0, None)),
                Some(step + 1),
                None,
            );
            leader.train_event(LearnerEvent::ProcessedItem(item));
        }
    }
}

/// Files a training part another rank's thread handed over under its step and rank, on rank
/// 0's `device`.
///
/// # Errors
/// [`DdpError::Bucket`] when its words cannot be decoded.
/// A training output this rank cannot read from its device (to send it to rank 0).
fn unreadable_output(rank: usize, step: usize, detail: String) -> DdpError {
    DdpError::Bucket {
        rank,
        bucket: 0,
        detail: format!(
            "the output of training step {} cannot be read for the metrics: {detail}",
            step + 1
        ),
    }
}

pub(super) fn insert_train<M: LearnerModel>(
    events: &mut Events<M>,
    rank: usize,
    step: usize,
    output: Option<Handoff<ModelOutput<M>>>,
    device: &Device,
) -> Result<()>
where
    ModelOutput<M>: 'static,
{
    let output = output
        .map(|o| o.take(events.train_codec, device))
        .transpose()
        .map_err(|detail| bad_words(0, rank, detail))?;
    let world_size = events.world_size;
    let slots = events
        .train
        .entry(step)
        .or_insert_with(|| (0..world_size).map(|_| None).collect());
    if let Some(slot) = slots.get_mut(rank) {
        *slot = Some(output);
    }
    Ok(())
}

/// The next part from the ranks that are threads, waiting until `deadline`; `Err(waited)` when
/// none came (or every sender is gone).
fn recv_until<M: LearnerModel>(
    leader: &mut Leader<M>,
    deadline: Instant,
) -> std::result::Result<Part<M>, std::time::Duration> {
    let started = Instant::now();
    match leader
        .items
        .recv_timeout(deadline.saturating_duration_since(Instant::now()))
    {
        Ok(part) => Ok(part),
        Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => Err(started.elapsed()),
    }
}

/// Files the parts that arrived (thread mode); with a `deadline`, waits for at least one.
fn drain_parts<M: LearnerModel>(
    leader: &mut Leader<M>,
    events: &mut Events<M>,
    deadline: Option<Instant>,
    device: &Device,
) -> Result<()>
where
    ModelOutput<M>: 'static,
{
    if let Some(deadline) = deadline {
        match recv_until(leader, deadline) {
            Ok(Part::Train { rank, step, output }) => {
                insert_train(events, rank, step, output, device)?
            }
            Ok(other) => events.stash.push_back(other),
            Err(waited) => {
                // The first rank whose part of the next step is missing.
                let missing = events
                    .train
                    .get(&events.next)
                    .and_then(|slots| slots.iter().position(Option::is_none))
                    .unwrap_or(0);
                return Err(DdpError::Unresponsive {
                    rank: missing,
                    waited,
                });
            }
        }
    }
    while let Ok(part) = leader.items.try_recv() {
        match part {
            Part::Train { rank, step, output } => insert_train(events, rank, step, output, device)?,
            other => events.stash.push_back(other),
        }
    }
    Ok(())
}

/// Rank 0 reports the steps whose parts are all there, in order: one joined item each.
fn emit_ready<M: LearnerModel>(
    leader: &mut Leader<M>,
    events: &mut Events<M>,
    progress_global: &Progress,
    device: &Device,
) where
    ModelOutput<M>: 'static,
{
    let Some(codec) = events.train_codec else {
        return;
    };
    while let Some(slots) = events.train.get(&events.next) {
        if slots.iter().any(Option::is_none) {
            return;
        }
        let step = events.next;
        events.next += 1;
        let slots = events.train.remove(&step).unwrap_or_default();
        let meta = events.meta.remove(&step);
        let parts: Vec<ModelOutput<M>> = slots.into_iter().flatten().flatten().collect();
        let (Some(meta), false) = (meta, parts.is_empty()) else {
            continue;
        };
        let output = (codec.join)(parts, device);
        if let Some(file) = &mut leader.metrics_file {
            file.step(
                progress_global.items_processed,
                step + 1,
                Some((codec.samples)(&output)),
                meta.lr.as_ref().map(ModuleLearningRate::base),
                (codec.loss)(&output),
                meta.times,
            );
        }
        let item = TrainingItem::new(output, meta.progress, Some(step + 1), meta.lr);
        leader.train_event(LearnerEvent::ProcessedItem(item));
    }
}
