//! A rank's checkpoints: rank 0's at the end of an epoch (burn-train's and burn-ddp's state
//! file, `crate::checkpoint`), the periodic step checkpoints and the one after a stop signal,
//! which every rank waits for, and, with optimizer-state sharding, every rank's share of the
//! optimizer state joined into rank 0's learner before it writes. The training loop that calls
//! them is in `epoch/`.

use std::path::PathBuf;

use burn::optim::OptimizerRecord;
use burn::train::LearnerModel;

use super::epoch::{Counters, Trainer};
use super::rank::Role;
use super::sharded::Sharded;
use crate::checkpoint::{EpochCheckpoint, Progress};
use crate::error::{DdpError, Result};

impl<M: LearnerModel> Trainer<M> {
    /// With sharding, before rank 0 writes a checkpoint: every rank's optimizer state joined into
    /// rank 0's learner; returns what rank 0 puts back after writing. Every rank calls it.
    pub(super) fn whole_optimizer_state(&mut self) -> Result<Option<OptimizerRecord>> {
        match &self.sharded {
            Some(sharded) => sharded.whole_on_rank_0(
                &mut self.records,
                &mut self.learner,
                self.group.as_ref(),
                self.config.timeout(),
            ),
            None => Ok(None),
        }
    }

    /// Where the run stands after `batches` batches of `epoch` (0: its end).
    fn progress(&self, epoch: usize, batches: usize, counters: &Counters) -> Progress {
        Progress {
            epoch,
            batches,
            world_size: self.group.world_size(),
            optimizer_steps: counters.optimizer_steps,
            synchronisations: counters.synchronisations,
        }
    }

    /// Rank 0's checkpoint at the end of `epoch`, as burn-train 0.22's loop takes it: after
    /// burn-train's event processor has handled the epoch's events (`flush`: the checkpointing
    /// strategy and early stopping read its store), not when a stop came during validation;
    /// burn-train's checkpointer saves as its strategy says, and with a checkpoint directory
    /// burn-ddp's state of the epoch names the records written now
    /// ([`write_epoch_checkpoint`](crate::checkpoint::write_epoch_checkpoint)).
    ///
    /// # Errors
    /// [`DdpError::Checkpoint`] naming the file: burn-train could not write (or delete) a
    /// checkpoint (its checkpointer failed the interrupter; the stop is taken back: it was no
    /// user's), or burn-ddp's state could not be written.
    pub(super) fn write_epoch_checkpoint(
        &mut self,
        epoch: usize,
        counters: &Counters,
    ) -> Result<()> {
        let progress = self.progress(epoch, 0, counters);
        let Role::Leader(leader) = &mut self.role else {
            return Ok(());
        };
        // burn-train 0.22 flushes its processor only for a checkpointer or early stopping.
        if leader.checkpointer.is_some() || leader.early_stopping.is_some() {
            leader.wait_for_events();
        }
        if self.interrupter.should_stop() {
            return Ok(());
        }
        let Some(checkpointer) = &mut leader.checkpointer else {
            return Ok(());
        };
        // burn-train's checkpointer reads the records on its own threads: on an asynchronous
        // runtime the epoch's last optimizer step must have run first.
        crate::replica::sync_device(
            self.rank,
            &self.device,
            "the optimizer step before the epoch checkpoint",
        )?;
        // burn-train's own checkpointers report a failed write by failing the interrupter (from
        // their threads); a user's plain stop is no error.
        let failed_before = self.interrupter.error().is_some();
        let written = match &leader.checkpoints {
            Some((checkpoints, _)) => crate::checkpoint::write_epoch_checkpoint(
                checkpoints,
                checkpointer,
                &self.learner,
                progress,
                &leader.event_store,
            ),
            None => {
                checkpointer.checkpoint(&self.learner, epoch, &leader.event_store);
                Ok(EpochCheckpoint::NotSaved)
            }
        };
        if let (false, Some(error)) = (failed_before, self.interrupter.error()) {
            // burn-train's checkpointer failed the interrupter (a write or a delete).
            let why = error.to_string();
            self.interrupter.reset();
            return Err(DdpError::Checkpoint {
                path: self
                    .config
                    .checkpoint_dir()
                    .map(|d| d.join(format!("model-{epoch}.bpk")).display().to_string())
                    .unwrap_or_else(|| format!("burn-train's checkpoint of epoch {epoch}")),
                detail: format!(
                    "burn-train could not write (or delete) the checkpoint of epoch {epoch}: \
                     {why}"
                ),
            });
        }
        written.map(|_| ())
    }

    /// A periodic step checkpoint: rank 0 writes it while the others wait for it (under the
    /// end-of-epoch timeout, as for the checkpoint after a stop signal), and all learn whether it
    /// was written.
    ///
    /// # Errors
    /// [`DdpError::Checkpoint`] on every rank when rank 0 could not write it; the all-gather's
    /// errors.
    pub(super) fn step_checkpoint_meeting(
        &mut self,
        epoch: usize,
        batches: usize,
        counters: &Counters,
    ) -> Result<()> {
        self.agreed_step_checkpoint(
            epoch,
            batches,
            counters,
            &format!("the step checkpoint at batch {batches} of epoch {epoch}"),
        )
    }

    /// Rank 0 writes the step checkpoint of `batches` trained batches of `epoch` while the others
    /// wait for it (under the end-of-epoch timeout), and every rank learns whether it was
    /// written; `what` names it in the error of the ranks whose own part went well.
    fn agreed_step_checkpoint(
        &mut self,
        epoch: usize,
        batches: usize,
        counters: &Counters,
        what: &str,
    ) -> Result<()> {
        let written = self.write_step_checkpoint(epoch, batches, counters);
        let all = self.group.all_gather(
            &[u64::from(written.is_ok())],
            self.config.epoch_end_timeout(),
        )?;
        written?;
        if all.first() == Some(&0) {
            return Err(DdpError::Checkpoint {
                path: self
                    .config
                    .checkpoint_dir()
                    .map(|d| d.display().to_string())
                    .unwrap_or_default(),
                detail: format!("rank 0 could not write {what} (see rank 0's error)"),
            });
        }
        Ok(())
    }

    /// Rank 0 writes a step checkpoint of `batches` trained batches of `epoch` (when a checkpoint
    /// directory is set); the other ranks do nothing but, with sharding, send their share of
    /// the optimizer state. Returns the state file's path.
    fn write_step_checkpoint(
        &mut self,
        epoch: usize,
        batches: usize,
        counters: &Counters,
    ) -> Result<Option<PathBuf>> {
        if self.config.checkpoint_dir().is_none() {
            return Ok(None);
        }
        let progress = self.progress(epoch, batches, counters);
        let own_state = self.whole_optimizer_state()?;
        let Role::Leader(leader) = &mut self.role else {
            return Ok(None);
        };
        let Some((checkpoints, writer)) = &mut leader.checkpoints else {
            return Ok(None);
        };
        // Burn's `RunningState` (BatchNorm's and SyncBatchNorm's statistics) keeps a forward
        // pass's update per thread until it is next read, and a record reads the value as it
        // was: `valid` folds the updates in first, or a step checkpoint would hold the
        // statistics of the step before (buffers synchronised between the ranks are folded
        // already; one replica's are not).
        drop(self.learner.model().valid());
        // burn-train's checkpointer reads the records on its own threads: the step must have
        // run. Rank 0 alone writes step checkpoints.
        crate::replica::sync_device(
            0,
            &self.device,
            "the optimizer step before the step checkpoint",
        )?;
        let written = writer.save(
            &self.learner,
            progress,
            &leader.event_store,
            self.config.epoch_end_timeout(),
        );
        Sharded::put_back(&mut self.learner, own_state);
        let state = written?;
        tracing::info!(
            "burn-ddp: rank 0 wrote step checkpoint {} (batch {batches} of epoch {epoch})",
            state.number
        );
        Ok(Some(checkpoints.step_state_path(state.number)))
    }

    /// The end of a run stopped by a signal at `batches` trained batches of `epoch`: rank 0
    /// checkpoints that step, every rank waits until it is written (so no process exits, and no
    /// launcher stops the others, before the checkpoint is on disk), and all return the same
    /// [`DdpError::Preempted`].
    pub(super) fn stop_for_signal(
        &mut self,
        epoch: usize,
        batches: usize,
        counters: &Counters,
        signalled: Vec<(usize, i32)>,
    ) -> DdpError {
        if let Err(err) = self.agreed_step_checkpoint(
            epoch,
            batches,
            counters,
            "the checkpoint of the step where a stop signal stopped training",
        ) {
            return err;
        }
        let checkpoint = match &self.role {
            Role::Leader(leader) => leader.checkpoints.as_ref().map(|(checkpoints, _)| {
                checkpoints
                    .step_state_path(counters.synchronisations)
                    .display()
                    .to_string()
            }),
            // The other ranks name the same file (the run's tag is the same everywhere).
            _ => self.config.checkpoint_dir().map(|dir| {
                crate::checkpoint::StepState::path(
                    dir,
                    &crate::checkpoint::run_tag(&self.run_id),
                    counters.synchronisations,
                )
                .display()
                .to_string()
            }),
        };
        DdpError::Preempted {
            rank: self.rank,
            epoch,
            batches,
            signalled,
            checkpoint,
        }
    }
}
