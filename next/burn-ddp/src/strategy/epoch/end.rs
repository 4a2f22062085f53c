//! The end of an epoch (the outputs still on their way, validation, rank 0's checkpoint and
//! early stopping, the all-gather that carries every rank's votes), and the buffers kept alike
//! after a step.

use burn::train::{LearnerEvent, LearnerModel};

use super::super::lock;
use super::super::rank::{Comm, ModelOutput, Role, ValidOutput};
use super::super::sharded::Sharded;
use super::super::validation::Validating;
use super::{Buffers, Counters, Trained, Trainer};
use crate::config::BufferSync;
use crate::ddp::DistributedDataParallel;
use crate::error::{DdpError, Result};
use crate::metrics::EpochReport;

impl<M: LearnerModel + Send + 'static> Trainer<M>
where
    ModelOutput<M>: 'static,
    ValidOutput<M>: 'static,
{
    /// The end of an epoch: rank 0 reports the steps still on their way, every rank validates,
    /// rank 0 checkpoints and decides early stopping, and every rank meets in one all-gather
    /// (the barrier after the checkpoint, carrying the stop votes, the stop signals, the samples
    /// each rank trained on and whether rank 0's checkpoint failed). Returns whether training
    /// goes on.
    pub(super) fn end_epoch(
        &mut self,
        epoch: usize,
        trained: Trained,
        counters: &Counters,
    ) -> Result<bool> {
        let interrupted = trained.stop.is_some();
        let progress_global = &trained.progress_global;
        self.events
            .finish(&mut self.role, &comm!(self), progress_global)?;
        // burn-train 0.22's order: the training split ends; an interrupted epoch ends the run
        // there; else validation's split, the epoch's end, and the checkpoint.
        if let Role::Leader(leader) = &mut self.role {
            leader.train_event(LearnerEvent::EndSplit(epoch));
            if !interrupted {
                leader.valid_event(LearnerEvent::StartSplit {
                    epoch_number: epoch,
                    total_items: self.loaders.valid_items as usize,
                });
            }
        }
        // Without a shard, only rank 0 validates (alone); the others have nothing to do.
        let validates = self.valid_shard.is_some() || matches!(self.role, Role::Leader(_));
        if !interrupted && validates {
            let model = self.learner.model().valid();
            Validating {
                comm: comm!(self),
                role: &mut self.role,
                events: &mut self.events,
                interrupter: &self.interrupter,
                progress_global,
            }
            .run(self.valid_shard.as_ref(), model)?;
        }
        if let (Role::Leader(leader), false) = (&mut self.role, interrupted) {
            leader.train_event(LearnerEvent::EndEpoch(epoch));
        }
        // Rank 0: checkpoints and early stopping, on the epoch's own metrics.
        let mut stop_requested = interrupted;
        let mut written = Ok(());
        let epoch_checkpoints = self.sharded.is_some() && self.epoch_checkpoints;
        let own_state = match !interrupted && epoch_checkpoints {
            true => self.whole_optimizer_state()?,
            false => None,
        };
        if matches!(self.role, Role::Leader(_)) && !interrupted {
            written = self.write_epoch_checkpoint(epoch, counters);
            Sharded::put_back(&mut self.learner, own_state);
            if written.is_ok()
                && let Role::Leader(leader) = &mut self.role
                && let Some(early_stopping) = &mut leader.early_stopping
                && early_stopping.should_stop(epoch, &leader.event_store)
            {
                tracing::info!("burn-ddp: early stopping after epoch {epoch}");
                stop_requested = true;
            }
        }
        let votes = self.group.all_gather(
            &[
                u64::from(stop_requested || self.interrupter.should_stop()),
                self.signal().map_or(0, |s| s as u64),
                trained.local_samples,
                u64::from(written.is_err()),
            ],
            self.config.epoch_end_timeout(),
        )?;
        if votes.chunks(4).any(|v| v[3] != 0) {
            // Every rank fails, and the launcher does not take the job for done.
            return Err(written.err().unwrap_or_else(|| DdpError::Checkpoint {
                path: self
                    .config
                    .checkpoint_dir()
                    .map(|d| d.join(format!("model-{epoch}")).display().to_string())
                    .unwrap_or_default(),
                detail: format!(
                    "rank 0 could not write the checkpoint of epoch {epoch} (see rank 0's error)"
                ),
            }));
        }
        if let Role::Leader(_) = &self.role {
            lock(&self.report).epochs.push(EpochReport {
                epoch,
                samples: votes.chunks(4).map(|v| v[2]).sum(),
                steps: trained.steps,
                train_time: trained.train_time,
            });
        }
        let signalled: Vec<(usize, i32)> = votes
            .chunks(4)
            .enumerate()
            .filter(|(_, v)| v[1] != 0)
            .map(|(r, v)| (r, v[1] as i32))
            .collect();
        let stopping = votes.chunks(4).any(|v| v[0] != 0);
        if !signalled.is_empty() && epoch < *self.epochs.end() && !interrupted && !stopping {
            // The epoch is complete: the next run starts with the next one.
            return Err(self.stop_for_signal(epoch + 1, 0, counters, signalled));
        }
        // Early stopping (or the interrupter) ends the run here anyway: it finishes normally
        // even if a stop signal came in too, as after the last epoch.
        Ok(!stopping)
    }

    /// Keeps buffers identical across replicas ([`Buffers`]).
    pub(super) fn sync_buffers(&mut self, ddp: &DistributedDataParallel) -> Result<()> {
        let model = match (self.buffers, self.config.buffer_sync()) {
            (Buffers::Alone, _) | (Buffers::Separate, BufferSync::None) => return Ok(()),
            (Buffers::Shared, _) => return ddp.settle_shared_buffers(&self.learner.model()),
            (Buffers::Separate, BufferSync::Average) => {
                ddp.average_buffers(self.learner.model())?
            }
            (Buffers::Separate, BufferSync::Broadcast) => ddp.sync_buffers(self.learner.model())?,
        };
        self.learner.load_model(model.into_record());
        Ok(())
    }
}
