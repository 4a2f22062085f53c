//! Validation at the end of an epoch, as one device runs it: every batch of the validation loader
//! is one item for burn-train, in the loader's order, so every metric, whatever it averages over
//! (burn-train's `LossMetric` counts a batch once, whatever its size), equals single-device
//! validation.
//!
//! **Sharded** (the default): the loader's batches are cut into `world_size` contiguous runs of
//! whole batches ([`ValidationPlan`]); each rank validates its run, and rank 0 reports every batch
//! as its own item in the loader's order: its own batches as it computes them, then the other
//! ranks' (threads: through the channel as they come; processes: one gather of the encoded
//! outputs at the end). **On rank 0 alone**: [`Validation::Rank0`](crate::config::Validation), or
//! in process mode an output type burn-ddp cannot send
//! ([`DistributedOutput`](crate::outputs::DistributedOutput)); the other ranks wait at the
//! end-of-epoch collective.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::mpsc::RecvTimeoutError;
use std::time::Instant;

use burn::data::dataloader::{DataLoader, Progress};
use burn::module::AutodiffModule;
use burn::tensor::backend::Backend;
use burn::train::{
    EventProcessorTraining, InferenceStep, Interrupter, Learner, LearnerEvent,
    LearningComponentsTypes, TrainingItem, ValidLoader,
};

use super::report::{InnerBackend, Part, ValidOutput, insert_train};
use super::wire::{bad_words, decode_entry, encode_entry, gather_words};
use super::worker::{Leader, ModelOutput, Role, Worker};
use crate::outputs::Codec;
use crate::partition::chunk_range;
use crate::{DdpError, Result};

/// How long rank 0 waits for the thread ranks' validation outputs before it looks at the group
/// again (an abort by a rank that failed).
const POLL: std::time::Duration = std::time::Duration::from_millis(100);

/// How the validation loader's batches fall: `items` items in batches of `batch_size` (the last
/// one possibly smaller), the loader's own batching read off its first batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct ValidationPlan {
    /// Items of the whole validation set.
    pub items: usize,
    /// Items per batch (every batch but the last).
    pub batch_size: usize,
}

impl ValidationPlan {
    /// The plan of `loader`: its item count, and its batch size read from the progress after
    /// its first batch (one batch is built, from a slice, so the loader's own state is left
    /// alone).
    pub fn of<B: Backend, O>(loader: &dyn DataLoader<B, O>) -> Self {
        let items = loader.num_items();
        let batch_size = if items == 0 {
            1
        } else {
            let probe = loader.slice(0, items);
            let mut iterator = probe.iter();
            match iterator.next() {
                Some(_) => iterator.progress().items_processed.clamp(1, items),
                None => items,
            }
        };
        Self { items, batch_size }
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

    /// burn-train's progress after batch `batch` (global index).
    fn progress_after(&self, batch: usize) -> Progress {
        Progress::new(((batch + 1) * self.batch_size).min(self.items), self.items)
    }
}

/// One rank's run of whole validation batches.
pub(super) struct ValidShard<LC: LearningComponentsTypes> {
    /// The rank's batches, as a slice of the validation loader on the rank's device.
    pub loader: ValidLoader<LC>,
    /// The global index of its first batch.
    pub first_batch: usize,
    pub plan: ValidationPlan,
    /// How outputs travel between processes (process mode; threads pass them as they are).
    pub codec: Option<Codec<ValidOutput<LC>, InnerBackend<LC>>>,
}

impl<LC: LearningComponentsTypes> Clone for ValidShard<LC> {
    fn clone(&self) -> Self {
        Self {
            loader: self.loader.clone(),
            first_batch: self.first_batch,
            plan: self.plan,
            codec: self.codec,
        }
    }
}

/// Rank 0's items of one validation pass, reported in the loader's order: a batch is held
/// until every batch before it is reported.
struct InOrder<LC: LearningComponentsTypes> {
    next: usize,
    waiting: BTreeMap<usize, ValidOutput<LC>>,
}

impl<LC: LearningComponentsTypes> InOrder<LC> {
    fn new() -> Self {
        Self {
            next: 0,
            waiting: BTreeMap::new(),
        }
    }

    /// Files batch `batch`'s output and reports every batch that is now next in order.
    fn put(
        &mut self,
        leader: &mut Leader<LC>,
        plan: &ValidationPlan,
        progress_global: &Progress,
        batch: usize,
        output: ValidOutput<LC>,
    ) {
        self.waiting.insert(batch, output);
        while let Some(output) = self.waiting.remove(&self.next) {
            report(leader, plan, progress_global, self.next, output);
            self.next += 1;
        }
    }

    /// Reports what is left (batches after a gap: a rank stopped early by the interrupter).
    fn finish(self, leader: &mut Leader<LC>, plan: &ValidationPlan, progress_global: &Progress) {
        for (batch, output) in self.waiting {
            report(leader, plan, progress_global, batch, output);
        }
    }
}

/// Batch `batch` of the validation set as burn-train's item.
fn report<LC: LearningComponentsTypes>(
    leader: &mut Leader<LC>,
    plan: &ValidationPlan,
    progress_global: &Progress,
    batch: usize,
    output: ValidOutput<LC>,
) {
    let item = TrainingItem::new(
        output,
        plan.progress_after(batch),
        progress_global.clone(),
        Some(batch + 1),
        None,
    );
    leader
        .event_processor
        .process_valid(LearnerEvent::ProcessedItem(item));
}

impl<LC: LearningComponentsTypes + Send + 'static> Worker<LC>
where
    ModelOutput<LC>: 'static,
    ValidOutput<LC>: 'static,
{
    /// Validation at the end of an epoch (see the [module docs](self)), ending with burn-train's
    /// `EndEpoch` validation event on rank 0.
    ///
    /// # Errors
    /// The collectives' errors (process mode); a thread rank whose batches do not arrive within
    /// the timeout ([`DdpError::Unresponsive`]).
    pub(super) fn validate_epoch(&mut self, progress_global: &Progress) -> Result<()> {
        let epoch = progress_global.items_processed;
        let Some(shard) = self.valid_shard.clone() else {
            if let Role::Leader(leader) = &mut self.role {
                validate_alone::<LC>(&self.learner, leader, progress_global, &self.interrupter);
            }
            return Ok(());
        };
        let model = self.learner.model().valid();
        let mut in_order = InOrder::<LC>::new();
        // Process mode: this rank's outputs, sent to rank 0 at the end.
        let mut kept: Vec<(usize, ValidOutput<LC>)> = Vec::new();
        for (step, item) in shard.loader.iter().enumerate() {
            let output = InferenceStep::step(&model, item);
            let batch = shard.first_batch + step;
            match &mut self.role {
                Role::Follower(sender) => {
                    let _ = sender.send(Part::Valid { batch, output });
                }
                Role::Leader(leader) => {
                    in_order.put(leader, &shard.plan, progress_global, batch, output)
                }
                Role::Silent(_) => kept.push((batch, output)),
            }
            if self.interrupter.should_stop() {
                break;
            }
        }
        if self.reports.threads {
            self.collect_threads(&shard, &mut in_order, progress_global)?;
        } else {
            self.collect_processes(&shard, &mut in_order, kept, progress_global)?;
        }
        if let Role::Leader(leader) = &mut self.role {
            in_order.finish(leader, &shard.plan, progress_global);
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
        progress_global: &Progress,
    ) -> Result<()> {
        let world_size = self.group.world_size();
        let rank = self.rank;
        let timeout = self.config.timeout();
        let Role::Leader(leader) = &mut self.role else {
            if let Role::Follower(sender) = &self.role {
                let _ = sender.send(Part::ValidDone { rank });
            }
            return Ok(());
        };
        let deadline = Instant::now() + timeout;
        let mut done = std::collections::BTreeSet::from([rank]);
        while done.len() < world_size {
            // A rank that failed while validating aborted the group: stop waiting for it.
            if let Some(cause) = self.group.aborted() {
                return Err(DdpError::Aborted {
                    rank,
                    op: crate::group::Collective::Barrier,
                    seq: 0,
                    cause: format!("while rank 0 collected the validation outputs: {cause}"),
                });
            }
            let next =
                match self.reports.stash.pop_front() {
                    Some(part) => Ok(part),
                    // In slices, so an abort is seen within a tenth of a second.
                    None => match leader
                        .items
                        .recv_timeout(POLL.min(deadline - Instant::now().min(deadline)))
                    {
                        Ok(part) => Ok(part),
                        Err(RecvTimeoutError::Timeout) if Instant::now() < deadline => continue,
                        Err(_) => Err(timeout
                            .saturating_sub(deadline.saturating_duration_since(Instant::now()))),
                    },
                };
            match next {
                Ok(Part::Valid { batch, output }) => {
                    in_order.put(leader, &shard.plan, progress_global, batch, output)
                }
                Ok(Part::ValidDone { rank }) => {
                    done.insert(rank);
                }
                Ok(Part::Train { rank, step, output }) => {
                    insert_train(&mut self.reports, world_size, rank, step, output)
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
        progress_global: &Progress,
    ) -> Result<()> {
        let Some(codec) = shard.codec else {
            // The strategy shards validation between processes only with a codec.
            return Err(DdpError::InvalidConfig(
                "sharded validation between processes needs an output type burn-ddp can send"
                    .into(),
            ));
        };
        let rank = self.rank;
        let mut words = Vec::new();
        for (batch, output) in &kept {
            encode_entry(&mut words, *batch, Some(output), codec.encode);
        }
        let all = gather_words(self.group.as_ref(), words, self.config.timeout())?;
        let Role::Leader(leader) = &mut self.role else {
            return Ok(());
        };
        let device = self.device.clone();
        for (from, words) in all.iter().enumerate().filter(|(r, _)| *r != rank) {
            let mut rest = words.as_slice();
            while !rest.is_empty() {
                let (batch, output) = decode_entry(&mut rest, codec.decode, &device)
                    .map_err(|detail| bad_words(rank, from, detail))?;
                if let Some(output) = output {
                    in_order.put(leader, &shard.plan, progress_global, batch, output);
                }
            }
        }
        Ok(())
    }
}

/// Rank 0's validation pass over the whole validation set, as burn-train's single-device loop.
fn validate_alone<LC: LearningComponentsTypes>(
    learner: &Learner<LC>,
    leader: &mut Leader<LC>,
    progress_global: &Progress,
    interrupter: &Interrupter,
) {
    let epoch = progress_global.items_processed;
    let model = learner.model().valid();
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
        assert_eq!(plan.progress_after(2).items_processed, 10);
        assert_eq!(plan.progress_after(0).items_processed, 4);
    }
}
