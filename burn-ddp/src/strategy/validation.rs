//! Validation at the end of an epoch, as one device runs it: every batch of the validation loader
//! is one item for burn-train, in the loader's order, so every metric, whatever it averages over
//! (burn-train's `LossMetric` counts a batch once, whatever its size), equals single-device
//! validation.
//!
//! **Sharded** (the default): the loader's batches are cut into `world_size` contiguous runs of
//! whole batches ([`ValidationPlan`]); each rank validates its run, and rank 0 reports every batch
//! as its own item in the loader's order: its own batches as it computes them, then rank 1's, and
//! so on, each rank's in the order its loader gave them (threads: through the channel as they
//! come; processes: one gather of the encoded outputs at the end). **On rank 0 alone**:
//! [`Validation::Rank0`](crate::config::Validation), or in process mode an output type burn-ddp
//! cannot send ([`DistributedOutput`](crate::outputs::DistributedOutput)); the other ranks wait at
//! the end-of-epoch collective.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::mpsc::RecvTimeoutError;
use std::time::Instant;

use burn::data::dataloader::{DataLoader, Progress};
use burn::tensor::backend::Backend;
use burn::train::{
    EventProcessorTraining, InferenceStep, Interrupter, LearnerEvent, LearningComponentsTypes,
    TrainingItem, ValidLoader,
};

use super::events::{Events, insert_train};
use super::handoff::Handoff;
use super::rank::{Comm, InnerBackend, Leader, ModelOutput, Part, Role, ValidOutput};
use super::wire::{bad_words, decode_entry, encode_entry, gather_words};
use crate::error::{DdpError, Result};
use crate::outputs::Codec;
use burn_ddp_comm::group::chunk_range;

/// How long rank 0 waits for the thread ranks' validation outputs before it looks at the group
/// again (an abort by a rank that failed).
const POLL: std::time::Duration = std::time::Duration::from_millis(100);

/// Batches read to learn the loader's batch size (a Burn loader with workers may hand a worker's
/// short last batch out first).
const PROBED_BATCHES: usize = 3;

/// How the validation loader's batches fall: `items` items in batches of `batch_size` (the last
/// one possibly smaller).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct ValidationPlan {
    /// Items of the whole validation set.
    pub items: usize,
    /// Items per batch (every batch but the last).
    pub batch_size: usize,
}

impl ValidationPlan {
    /// The plan of `loader`: its item count, and its batch size, the largest of its first batches
    /// (read from a slice, so the loader's own state is left alone).
    pub fn of<B: Backend, O>(loader: &dyn DataLoader<B, O>) -> Self {
        let items = loader.num_items();
        let mut batch_size = 0;
        if items > 0 {
            let probe = loader.slice(0, items);
            let mut iterator = probe.iter();
            let mut before = 0;
            for _ in 0..PROBED_BATCHES {
                if iterator.next().is_none() {
                    break;
                }
                let after = iterator.progress().items_processed;
                batch_size = batch_size.max(after.saturating_sub(before));
                before = after;
            }
        }
        Self {
            items,
            batch_size: batch_size.clamp(1, items.max(1)),
        }
    }

    /// Batches of the whole set.
    pub fn batches(&self) -> usize {
        self.items.div_ceil(self.batch_size)
    }

    /// The batches (global indices) `rank` validates: contiguous runs whose sizes differ by at
    /// most one batch, the larger first.
    pub fn batches_of(&self, rank: usize, world_size: usize) -> Range<usize> {
        chunk_range(self.batches(), world_size, rank)
    }

    /// The items of the batches `batches`.
    pub fn items_of(&self, batches: Range<usize>) -> Range<usize> {
        let end = (batches.end * self.batch_size).min(self.items);
        (batches.start * self.batch_size).min(end)..end
    }
}

/// One rank's run of whole validation batches.
pub(super) struct ValidShard<LC: LearningComponentsTypes> {
    /// The rank's batches, as a slice of the validation loader on the rank's device.
    pub loader: ValidLoader<LC>,
    pub plan: ValidationPlan,
    /// How outputs travel between processes (process mode; threads pass them as they are).
    pub codec: Option<Codec<ValidOutput<LC>, InnerBackend<LC>>>,
}

impl<LC: LearningComponentsTypes> Clone for ValidShard<LC> {
    fn clone(&self) -> Self {
        Self {
            loader: self.loader.clone(),
            plan: self.plan,
            codec: self.codec,
        }
    }
}

/// Rank 0's items of one validation pass, reported in the loader's order: rank 0's batches, then
/// rank 1's, ... (their runs are consecutive in the loader), each rank's in the order its loader
/// gave them. A batch is held until every batch before it is reported.
struct InOrder<LC: LearningComponentsTypes> {
    /// The next (rank, step of that rank) to report.
    next: (usize, usize),
    /// How many batches each rank validated, once it said so.
    counts: Vec<Option<usize>>,
    waiting: BTreeMap<(usize, usize), ValidOutput<LC>>,
    /// Batches reported so far.
    reported: usize,
}

/// Where rank 0 sends validation items (burn-train's events), and what it needs to number them.
struct Sink<'a, LC: LearningComponentsTypes> {
    leader: &'a mut Leader<LC>,
    plan: ValidationPlan,
    progress_global: &'a Progress,
}

impl<LC: LearningComponentsTypes> InOrder<LC> {
    fn new(world_size: usize) -> Self {
        Self {
            next: (0, 0),
            counts: vec![None; world_size],
            waiting: BTreeMap::new(),
            reported: 0,
        }
    }

    /// Files `rank`'s output of its step `step`, and reports what is now next in order.
    fn put(&mut self, to: &mut Sink<'_, LC>, at: (usize, usize), output: ValidOutput<LC>) {
        self.waiting.insert(at, output);
        self.advance(to);
    }

    /// `rank` validated `steps` batches.
    fn done(&mut self, to: &mut Sink<'_, LC>, rank: usize, steps: usize) {
        if let Some(count) = self.counts.get_mut(rank) {
            *count = Some(steps);
        }
        self.advance(to);
    }

    fn advance(&mut self, to: &mut Sink<'_, LC>) {
        loop {
            if let Some(output) = self.waiting.remove(&self.next) {
                self.report(to, self.next, output);
                self.next.1 += 1;
            } else if self.counts.get(self.next.0).copied().flatten() == Some(self.next.1)
                && self.next.0 + 1 < self.counts.len()
            {
                self.next = (self.next.0 + 1, 0);
            } else {
                return;
            }
        }
    }

    /// Sends what is left (after a gap: a rank stopped early by the interrupter).
    fn finish(mut self, to: &mut Sink<'_, LC>) {
        for (at, output) in std::mem::take(&mut self.waiting) {
            self.report(to, at, output);
        }
    }

    /// `rank`'s batch `step` as burn-train's item, numbered in one device's order.
    fn report(
        &mut self,
        to: &mut Sink<'_, LC>,
        (rank, step): (usize, usize),
        output: ValidOutput<LC>,
    ) {
        self.reported += 1;
        let plan = to.plan;
        let items = plan.items_of(plan.batches_of(rank, self.counts.len()));
        let done = (items.start + (step + 1) * plan.batch_size).min(items.end);
        let item = TrainingItem::new(
            output,
            Progress::new(done, plan.items),
            to.progress_global.clone(),
            Some(self.reported),
            None,
        );
        to.leader
            .event_processor
            .process_valid(LearnerEvent::ProcessedItem(item));
    }
}

/// What an epoch's validation borrows from its rank.
pub(super) struct Validating<'a, LC: LearningComponentsTypes> {
    pub comm: Comm<'a, LC>,
    pub role: &'a mut Role<LC>,
    pub events: &'a mut Events<LC>,
    pub interrupter: &'a Interrupter,
    pub progress_global: &'a Progress,
}

impl<LC: LearningComponentsTypes> Validating<'_, LC>
where
    ModelOutput<LC>: 'static,
    ValidOutput<LC>: 'static,
{
    /// Validation at the end of an epoch (see the [module docs](self)) of `model` over this
    /// rank's `shard` (`None`: rank 0 validates the whole set alone), ending with burn-train's
    /// `EndEpoch` validation event on rank 0.
    ///
    /// # Errors
    /// The collectives' errors (process mode); a thread rank whose batches do not arrive within
    /// the timeout ([`DdpError::Unresponsive`]), or that failed (the group is aborted).
    pub(super) fn run(
        mut self,
        shard: Option<&ValidShard<LC>>,
        model: LC::InferenceModel,
    ) -> Result<()> {
        let progress_global = self.progress_global;
        let epoch = progress_global.items_processed;
        let Some(shard) = shard else {
            if let Role::Leader(leader) = self.role {
                validate_alone::<LC>(model, leader, progress_global, self.interrupter);
            }
            return Ok(());
        };
        let rank = self.comm.rank;
        let mut in_order = InOrder::<LC>::new(self.comm.group.world_size());
        // Process mode: this rank's outputs, sent to rank 0 at the end.
        let mut kept: Vec<(usize, ValidOutput<LC>)> = Vec::new();
        let mut steps = 0;
        for (step, item) in shard.loader.iter().enumerate() {
            let output = InferenceStep::step(&model, item);
            steps = step + 1;
            match &mut *self.role {
                Role::Follower(sender) => {
                    // Read here, where it was made; without a codec, complete before rank 0's
                    // thread reads it (see `handoff.rs`).
                    if shard.codec.is_none() {
                        crate::replica::sync_device::<burn::train::TrainingBackend<LC>>(
                            rank,
                            self.comm.device,
                            "a validation batch",
                        )?;
                    }
                    let output = Handoff::of(output, shard.codec);
                    let _ = sender.send(Part::Valid { rank, step, output });
                }
                Role::Leader(leader) => in_order.put(
                    &mut Sink {
                        leader,
                        plan: shard.plan,
                        progress_global,
                    },
                    (rank, step),
                    output,
                ),
                Role::Silent(_) => kept.push((step, output)),
            }
            if self.interrupter.should_stop() {
                break;
            }
        }
        if self.events.threads {
            self.collect_threads(shard, &mut in_order, steps)?;
        } else {
            self.collect_processes(shard, &mut in_order, kept)?;
        }
        if let Role::Leader(leader) = self.role {
            in_order.finish(&mut Sink {
                leader,
                plan: shard.plan,
                progress_global,
            });
            leader
                .event_processor
                .process_valid(LearnerEvent::EndEpoch(epoch));
        }
        Ok(())
    }

    /// Thread mode: the followers say they are done; rank 0 reports their batches as they come.
    fn collect_threads(
        &mut self,
        shard: &ValidShard<LC>,
        in_order: &mut InOrder<LC>,
        steps: usize,
    ) -> Result<()> {
        let progress_global = self.progress_global;
        let world_size = self.comm.group.world_size();
        let rank = self.comm.rank;
        let timeout = self.comm.timeout;
        let Role::Leader(leader) = &mut *self.role else {
            if let Role::Follower(sender) = &*self.role {
                let _ = sender.send(Part::ValidDone { rank, steps });
            }
            return Ok(());
        };
        let mut to = Sink {
            leader,
            plan: shard.plan,
            progress_global,
        };
        in_order.done(&mut to, rank, steps);
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
                Ok(Part::Valid { rank, step, output }) => {
                    let output = output
                        .take(shard.codec, self.comm.device)
                        .map_err(|detail| bad_words(0, rank, detail))?;
                    in_order.put(&mut to, (rank, step), output)
                }
                Ok(Part::ValidDone { rank, steps }) => {
                    in_order.done(&mut to, rank, steps);
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

    /// Process mode: every rank sends its outputs to rank 0 in one gather.
    fn collect_processes(
        &mut self,
        shard: &ValidShard<LC>,
        in_order: &mut InOrder<LC>,
        kept: Vec<(usize, ValidOutput<LC>)>,
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
        for (step, output) in &kept {
            encode_entry(&mut words, *step, Some(output), codec.encode);
        }
        let all = gather_words(self.comm.group.as_ref(), words, self.comm.timeout)?;
        let Role::Leader(leader) = &mut *self.role else {
            return Ok(());
        };
        let device = self.comm.device.clone();
        let mut to = Sink {
            leader,
            plan: shard.plan,
            progress_global,
        };
        for (from, words) in all.iter().enumerate() {
            if from == rank {
                // Rank 0's own batches were reported as they were computed.
                in_order.done(&mut to, rank, kept.len().max(in_order.next.1));
                continue;
            }
            let mut rest = words.as_slice();
            let mut steps = 0;
            while !rest.is_empty() {
                let (step, output) = decode_entry(&mut rest, codec.decode, &device)
                    .map_err(|detail| bad_words(rank, from, detail))?;
                if let Some(output) = output {
                    in_order.put(&mut to, (from, step), output);
                }
                steps += 1;
            }
            in_order.done(&mut to, from, steps);
        }
        Ok(())
    }
}

/// Rank 0's validation pass over the whole validation set, as burn-train's single-device loop.
fn validate_alone<LC: LearningComponentsTypes>(
    model: LC::InferenceModel,
    leader: &mut Leader<LC>,
    progress_global: &Progress,
    interrupter: &Interrupter,
) {
    let epoch = progress_global.items_processed;
    let mut iterator = leader.dataloader_valid.iter();
    let mut iteration = 0;
    while let Some(item) = iterator.next() {
        iteration += 1;
        let progress = iterator.progress();
        let output = InferenceStep::step(&model, item);
        let item = TrainingItem::new(
            output,
            progress,
            progress_global.clone(),
            Some(iteration),
            None,
        );
        leader
            .event_processor
            .process_valid(LearnerEvent::ProcessedItem(item));
        if interrupter.should_stop() {
            break;
        }
    }
    leader
        .event_processor
        .process_valid(LearnerEvent::EndEpoch(epoch));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_take_whole_batches_in_order_and_cover_the_set_once() {
        let plan = ValidationPlan {
            items: 10,
            batch_size: 4,
        };
        assert_eq!(plan.batches(), 3);
        // 3 batches [0,4) [4,8) [8,10) over 2 ranks: 2 and 1; over 4 ranks: one rank has none.
        assert_eq!(plan.items_of(plan.batches_of(0, 2)), 0..8);
        assert_eq!(plan.items_of(plan.batches_of(1, 2)), 8..10);
        let four: Vec<Range<usize>> = (0..4)
            .map(|r| plan.items_of(plan.batches_of(r, 4)))
            .collect();
        assert_eq!(four, vec![0..4, 4..8, 8..10, 10..10]);
    }
}
