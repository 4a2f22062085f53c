//! Validation at the end of an epoch, as one device runs it: every batch of one device's pass
//! over the validation loader is one item for burn-train, in that pass's order, with one
//! device's progress, so every metric, whatever it averages over (burn-train's `LossMetric`
//! counts a batch once, whatever its size; precision and recall depend on which items meet in a
//! batch), equals single-device validation.
//!
//! **Sharded** (the default): each process reads the loader as one device reads it (one copy,
//! one pass per epoch: [`Dealer`]), rank `r` validates the pass's batches `r, r + N, ...`, and
//! rank 0 reports every batch as its own item in the pass's order (threads: through the channel
//! as they come; processes: one gather of the encoded outputs at the end). **On rank 0 alone**:
//! [`Validation::Rank0`](crate::config::Validation), or where one device's batches cannot reach
//! every rank (`run.rs`'s `Alone`); the other ranks wait at the end-of-epoch collective.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::mpsc::RecvTimeoutError;
use std::time::Instant;

use burn::data::dataloader::Progress;
use burn::train::{InferenceStep, Interrupter, LearnerEvent, LearnerModel, TrainingItem};

use super::dealer::Dealer;
use super::events::{Events, insert_train};
use super::handoff::Handoff;
use super::rank::{Comm, Leader, ModelOutput, Part, Role, ValidInput, ValidOutput};
use super::wire::{bad_words, decode_entry, encode_entry, gather_words};
use crate::error::{DdpError, Result};
use crate::outputs::Codec;

/// How long rank 0 waits for the thread ranks' validation outputs before it looks at the group
/// again (an abort by a rank that failed).
const POLL: std::time::Duration = std::time::Duration::from_millis(100);

/// A rank's share of sharded validation: this process's pass over the validation loader.
pub(super) struct ValidShard<M: LearnerModel> {
    /// One device's passes over the validation loader, dealt to this process's ranks.
    pub dealer: Arc<Dealer<ValidInput<M>>>,
    /// How outputs travel between processes (process mode; threads pass them as they are).
    pub codec: Option<Codec<ValidOutput<M>>>,
}

impl<M: LearnerModel> Clone for ValidShard<M> {
    fn clone(&self) -> Self {
        Self {
            dealer: self.dealer.clone(),
            codec: self.codec,
        }
    }
}

/// Rank 0's items of one validation pass, reported in one device's order: batch `i` of the pass
/// once every batch before it is reported.
struct InOrder<M: LearnerModel> {
    /// The position of the next batch to report.
    next: usize,
    /// Batches that came before their turn, with one device's progress after each.
    waiting: BTreeMap<usize, (Progress, ValidOutput<M>)>,
    /// Batches reported so far.
    reported: usize,
}

/// Where rank 0 sends validation items (burn-train's events), and the epoch's progress.
struct Sink<'a, M: LearnerModel> {
    leader: &'a mut Leader<M>,
    progress_global: &'a Progress,
}

impl<M: LearnerModel> InOrder<M> {
    fn new() -> Self {
        Self {
            next: 0,
            waiting: BTreeMap::new(),
            reported: 0,
        }
    }

    /// Files batch `index`'s output (one device's `progress` after it) and reports what is now
    /// next in order.
    fn put(
        &mut self,
        to: &mut Sink<'_, M>,
        index: usize,
        progress: Progress,
        output: ValidOutput<M>,
    ) {
        self.waiting.insert(index, (progress, output));
        while let Some((progress, output)) = self.waiting.remove(&self.next) {
            self.report(to, progress, output);
            self.next += 1;
        }
    }

    /// Sends what is left, in order (after a gap: a rank stopped early by the interrupter).
    fn finish(mut self, to: &mut Sink<'_, M>) {
        for (_, (progress, output)) in std::mem::take(&mut self.waiting) {
            self.report(to, progress, output);
        }
    }

    /// One batch as burn-train's item, numbered in one device's order.
    fn report(&mut self, to: &mut Sink<'_, M>, progress: Progress, output: ValidOutput<M>) {
        self.reported += 1;
        let item = TrainingItem::new(output, progress, Some(self.reported), None);
        to.leader.valid_event(LearnerEvent::ProcessedItem(item));
    }
}

/// What an epoch's validation borrows from its rank.
pub(super) struct Validating<'a, M: LearnerModel> {
    pub comm: Comm<'a>,
    pub role: &'a mut Role<M>,
    pub events: &'a mut Events<M>,
    pub interrupter: &'a Interrupter,
    pub progress_global: &'a Progress,
}

impl<M: LearnerModel> Validating<'_, M>
where
    ModelOutput<M>: 'static,
    ValidOutput<M>: 'static,
{
    /// Validation at the end of an epoch (see the [module docs](self)) of `model` over this
    /// rank's `shard` (`None`: rank 0 validates the whole set alone), ending with burn-train's
    /// `EndSplit` validation event on rank 0 (burn-train 0.22's end of a validation pass).
    ///
    /// # Errors
    /// The collectives' errors (process mode); a thread rank whose batches or whose peers'
    /// outputs do not arrive within the timeout ([`DdpError::LoaderStalled`],
    /// [`DdpError::Unresponsive`]), or that failed (the group is aborted).
    pub(super) fn run(mut self, shard: Option<&ValidShard<M>>, model: M) -> Result<()> {
        let progress_global = self.progress_global;
        let epoch = progress_global.items_processed;
        let Some(shard) = shard else {
            if let Role::Leader(leader) = self.role {
                validate_alone::<M>(model, leader, progress_global, self.interrupter);
            }
            return Ok(());
        };
        let rank = self.comm.rank;
        let mut in_order = InOrder::<M>::new();
        // Process mode: this rank's outputs, sent to rank 0 at the end.
        let mut kept: Vec<(usize, Progress, ValidOutput<M>)> = Vec::new();
        let mut batches = shard.dealer.take(rank);
        let group = self.comm.group.clone();
        let give_up = move || group.aborted();
        loop {
            let item = match batches.next_within(&give_up, self.comm.timeout) {
                Ok(Some(item)) => item,
                Ok(None) => break,
                Err(stall) => return Err(stall.into_error(rank, "validation")),
            };
            let (index, progress) = (batches.index().unwrap_or_default(), batches.progress());
            let output = InferenceStep::step(&model, item);
            match &mut *self.role {
                Role::Follower(sender) => {
                    // Read here, where it was made; without a codec, complete before rank 0's
                    // thread reads it (see `handoff.rs`).
                    if shard.codec.is_none() {
                        crate::replica::sync_device(rank, self.comm.device, "a validation batch")?;
                    }
                    let output =
                        Handoff::of(output, shard.codec).map_err(|detail| DdpError::Bucket {
                            rank,
                            bucket: 0,
                            detail: format!(
                                "the output of validation batch {} cannot be read for the \
                                 metrics: {detail}",
                                index + 1
                            ),
                        })?;
                    let _ = sender.send(Part::Valid {
                        index,
                        progress,
                        output,
                    });
                }
                Role::Leader(leader) => in_order.put(
                    &mut Sink {
                        leader,
                        progress_global,
                    },
                    index,
                    progress,
                    output,
                ),
                Role::Silent(_) => kept.push((index, progress, output)),
            }
            if self.interrupter.should_stop() {
                break;
            }
        }
        // The rest of this rank's share is not read: the pass goes on for the others.
        drop(batches);
        if self.events.threads {
            self.collect_threads(shard, &mut in_order)?;
        } else {
            self.collect_processes(shard, &mut in_order, kept)?;
        }
        if let Role::Leader(leader) = self.role {
            in_order.finish(&mut Sink {
                leader,
                progress_global,
            });
            leader.valid_event(LearnerEvent::EndSplit(epoch));
        }
        Ok(())
    }

    /// Thread mode: the followers say they are done; rank 0 reports their batches as they come.
    fn collect_threads(&mut self, shard: &ValidShard<M>, in_order: &mut InOrder<M>) -> Result<()> {
        let progress_global = self.progress_global;
        let world_size = self.comm.group.world_size();
        let rank = self.comm.rank;
        let timeout = self.comm.timeout;
        let Role::Leader(leader) = &mut *self.role else {
            if let Role::Follower(sender) = &*self.role {
                let _ = sender.send(Part::ValidDone { rank });
            }
            return Ok(());
        };
        let mut to = Sink {
            leader,
            progress_global,
        };
        let deadline = Instant::now() + timeout;
        let mut done = std::collections::BTreeSet::from([rank]);
        while done.len() < world_size {
            // A rank that failed while validating aborted the group: stop waiting for it.
            if let Some(cause) = self.comm.group.aborted() {
                return Err(burn_ddp_comm::CommError::Aborted {
                    rank,
                    op: burn_ddp_comm::group::Collective::Barrier,
                    seq: 0,
                    cause: format!("while rank 0 collected the validation outputs: {cause}"),
                }
                .into());
            }
            let next = match self.events.stash.pop_front() {
                Some(part) => Ok(part),
                // In slices, so an abort is seen within a tenth of a second.
                None => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    match to.leader.items.recv_timeout(POLL.min(left)) {
                        Ok(part) => Ok(part),
                        Err(RecvTimeoutError::Timeout) if !left.is_zero() => continue,
                        Err(_) => Err(timeout.saturating_sub(left)),
                    }
                }
            };
            match next {
                Ok(Part::Valid {
                    index,
                    progress,
                    output,
                }) => {
                    let output = output
                        .take(shard.codec, self.comm.device)
                        .map_err(|detail| bad_words(0, index % world_size, detail))?;
                    in_order.put(&mut to, index, progress, output)
                }
                Ok(Part::ValidDone { rank }) => {
                    done.insert(rank);
                }
                Ok(Part::Train { rank, step, output }) => {
                    insert_train(self.events, rank, step, output, self.comm.device)?
                }
                Err(waited) => {
                    return Err(DdpError::Unresponsive {
                        rank: (0..world_size).find(|r| !done.contains(r)).unwrap_or(0),
                        waited,
                    });
                }
            }
        }
        Ok(())
    }

    /// Process mode: every rank sends its outputs to rank 0 in one gather, each behind one
    /// device's progress after it (`[items processed, entry...]`).
    fn collect_processes(
        &mut self,
        shard: &ValidShard<M>,
        in_order: &mut InOrder<M>,
        kept: Vec<(usize, Progress, ValidOutput<M>)>,
    ) -> Result<()> {
        let progress_global = self.progress_global;
        let Some(codec) = shard.codec else {
            // The strategy shards validation between processes only with a codec.
            return Err(DdpError::InvalidConfig(
                "sharded validation between processes needs an output type burn-ddp can send"
                    .into(),
            ));
        };
        let rank = self.comm.rank;
        let mut words = Vec::new();
        for (index, progress, output) in &kept {
            words.push(progress.items_processed as u64);
            encode_entry(&mut words, *index, Some(output), codec.encode).map_err(|detail| {
                DdpError::Bucket {
                    rank,
                    bucket: 0,
                    detail: format!(
                        "the output of validation batch {} cannot be read for the metrics: \
                         {detail}",
                        index + 1
                    ),
                }
            })?;
        }
        let all = gather_words(self.comm.group.as_ref(), words, self.comm.timeout)?;
        let Role::Leader(leader) = &mut *self.role else {
            return Ok(());
        };
        let device = self.comm.device.clone();
        let items_total = shard.dealer.num_items();
        let mut to = Sink {
            leader,
            progress_global,
        };
        for (from, words) in all.iter().enumerate() {
            // Rank 0's own batches were reported as they were computed.
            if from == rank {
                continue;
            }
            let mut rest = words.as_slice();
            while let [processed, after @ ..] = rest {
                rest = after;
                let (index, output) = decode_entry(&mut rest, codec.decode, &device)
                    .map_err(|detail| bad_words(rank, from, detail))?;
                if let Some(output) = output {
                    let progress = Progress::new(*processed as usize, items_total, None);
                    in_order.put(&mut to, index, progress, output);
                }
            }
        }
        Ok(())
    }
}

/// Rank 0's validation pass over the whole validation set, as burn-train 0.22's single-device
/// loop (over rank 0's one copy of the loader): a batch that cannot be read fails the
/// interrupter and ends the pass there, as it does in burn-train.
fn validate_alone<M: LearnerModel>(
    model: M,
    leader: &mut Leader<M>,
    progress_global: &Progress,
    interrupter: &Interrupter,
) {
    let epoch = progress_global.items_processed;
    if let Some(loader) = &leader.dataloader_valid {
        let loader = loader.clone();
        let mut iterator = loader.iter();
        let mut iteration = 0;
        while let Some(item) = iterator.next() {
            let item = match item {
                Ok(item) => item,
                Err(err) => {
                    interrupter.fail(err);
                    break;
                }
            };
            iteration += 1;
            let progress = iterator.progress();
            let output = InferenceStep::step(&model, item);
            let item = TrainingItem::new(output, progress, Some(iteration), None);
            leader.valid_event(LearnerEvent::ProcessedItem(item));
            if interrupter.should_stop() {
                break;
            }
        }
    }
    leader.valid_event(LearnerEvent::EndSplit(epoch));
}
