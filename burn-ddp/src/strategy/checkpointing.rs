//! A rank's checkpoints: rank 0's at the end of an epoch (burn-train's and burn-ddp's state
//! file), the periodic step checkpoints and the one after a stop signal, which every rank waits
//! for, and, with optimizer-state sharding, every rank's share of the optimizer state joined into
//! rank 0's learner before it writes. The training loop that calls them is in `epoch.rs`.

use std::path::PathBuf;

use burn::train::{LearnerOptimizerRecord, LearningComponentsTypes, TrainingBackend};

use super::epoch::{Counters, Trainer};
use super::rank::Role;
use super::sharded::Sharded;
use super::step_checkpoints::wait_for_epoch_checkpoint;
use crate::checkpoint::{DdpState, StepState};
use crate::error::{DdpError, Result};

impl<LC: LearningComponentsTypes> Trainer<LC> {
    /// With sharding, before rank 0 writes a checkpoint: every rank's optimizer state joined into
    /// rank 0's learner; returns what rank 0 puts back after writing. Every rank calls it.
    pub(super) fn whole_optimizer_state(&mut self) -> Result<Option<LearnerOptimizerRecord<LC>>> {
        match &self.sharded {
            Some(sharded) => sharded.whole_on_rank_0(
                &mut self.records,
                &mut self.learner,
                self.group.as_ref(),
                &self.device,
                self.config.timeout(),
            ),
            None => Ok(None),
        }
    }

    /// Rank 0's checkpoint at the end of `epoch`: burn-train's (as its checkpointing strategy
    /// says, waiting until the files are on disk, which burn-train writes in the background) and
    /// burn-ddp's state file, carrying the run id. Waits first until burn-train's event processor
    /// has handled the epoch's events (the checkpointing strategy and early stopping read its
    /// store).
    ///
    /// # Errors
    /// [`DdpError::Checkpoint`] naming the file: burn-train could not write or delete a
    /// checkpoint (it stops the interrupter then; the stop is taken back: it was no user's), or
    /// the state file cannot be written.
    pub(super) fn write_epoch_checkpoint(
        &mut self,
        epoch: usize,
        counters: &Counters,
    ) -> Result<()> {
        let Role::Leader(leader) = &mut self.role else {
            return Ok(());
        };
        leader.wait_for_events();
        if let Some(checkpointer) = &mut leader.checkpointer {
            let stopped_before = self.interrupter.should_stop();
            // burn-train's checkpointer reads the record on its own thread: on an asynchronous
            // runtime the epoch's last optimizer step must have run first (on wgpu with fusion
            // it would read values of before it, or fail).
            crate::replica::sync_device::<TrainingBackend<LC>>(
                self.rank,
                &self.device,
                "the optimizer step before the epoch checkpoint",
            )?;
            checkpointer.checkpoint(&self.learner, epoch, &leader.event_store);
            let read_back =
                wait_for_epoch_checkpoint(checkpointer, &self.learner, &self.device, epoch);
            if !stopped_before && self.interrupter.should_stop() {
                let why = self.interrupter.get_message().unwrap_or_default();
                self.interrupter.reset();
                return Err(DdpError::Checkpoint {
                    path: self
                        .config
                        .checkpoint_dir()
                        .map(|d| d.join(format!("model-{epoch}")).display().to_string())
                        .unwrap_or_else(|| format!("burn-train's checkpoint of epoch {epoch}")),
                    detail: format!(
                        "burn-train could not write (or delete) the checkpoint of epoch {epoch}: \
                         {why}"
                    ),
                });
            }
            if let Err(why) = read_back {
                tracing::debug!(
                    "burn-ddp: no complete checkpoint of epoch {epoch} (the checkpointing \
                     strategy may have skipped it): {why}"
                );
            }
        }
        if let Some(dir) = self.config.checkpoint_dir() {
            let mut state = DdpState {
                epoch,
                world_size: self.group.world_size(),
                optimizer_steps: counters.optimizer_steps,
                next_sampler_epoch: epoch as u64,
                synchronisations: counters.synchronisations,
                run_id: Some(self.run_id.clone()),
                mac: None,
            };
            if let Some(key) = leader.step_checkpoints.as_ref().and_then(|c| c.key()) {
                state.sign(key);
            }
            state.write(dir)?;
        }
        Ok(())
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
    /// directory is set); the other ranks do nothing. Returns the state file's path.
    fn write_step_checkpoint(
        &mut self,
        epoch: usize,
        batches: usize,
        counters: &Counters,
    ) -> Result<Option<PathBuf>> {
        if self.config.checkpoint_dir().is_none() {
            return Ok(None);
        }
        let own_state = self.whole_optimizer_state()?;
        let Role::Leader(leader) = &mut self.role else {
            return Ok(None);
        };
        let Some(checkpoints) = &mut leader.step_checkpoints else {
            return Ok(None);
        };
        let state = StepState {
            number: counters.synchronisations,
            epoch,
            batches,
            world_size: self.group.world_size(),
            optimizer_steps: counters.optimizer_steps,
            run_id: Some(self.run_id.clone()),
            records: Vec::new(),
            mac: None,
        };
        let path = checkpoints.save(&self.learner, &state, &leader.event_store, &self.device);
        Sharded::put_back(&mut self.learner, own_state);
        let path = path?;
        tracing::info!(
            "burn-ddp: rank 0 wrote step checkpoint {} (batch {batches} of epoch {epoch})",
            state.number
        );
        Ok(Some(path))
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
        let checkpoint = self.config.checkpoint_dir().map(|dir| {
            StepState::path_of(dir, &self.run_id, counters.synchronisations)
                .display()
                .to_string()
        });
        DdpError::Preempted {
            rank: self.rank,
            epoch,
            batches,
            signalled,
            checkpoint,
        }
    }
}
