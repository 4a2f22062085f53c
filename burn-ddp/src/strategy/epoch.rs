//! The training loop of one rank: epochs of steps, each step agreed with the other ranks,
//! reduced, applied; the end of every epoch (every rank validates its shard, rank 0 writes its
//! checkpoint and waits until it is on disk, the others wait for it); and the stops (an interrupt, a stop signal, with
//! a checkpoint of the step reached).

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use burn::data::dataloader::Progress;
use burn::module::{AutodiffModule, Module};
use burn::optim::GradientsAccumulator;
use burn::train::{
    EventProcessorTraining, LearnerEvent, LearningComponentsTypes, TrainingBackend, TrainingModel,
};

use super::lock;
use super::policy::{Agreement, OnNonFinite, StepPolicy, StopVote, end_of_data};
use super::report::ValidOutput;
use super::resume::wait_for_epoch_checkpoint;
use super::worker::{ModelOutput, Role, Worker};
use crate::checkpoint::{DdpState, StepState};
use crate::ddp::DistributedDataParallel;
use crate::lockstep::Position;
use crate::metrics::{EpochReport, RankReport};
use crate::{BufferSync, DdpError, Result};

/// Why an epoch's loop ended before its data.
enum Stop {
    /// burn-train's `Interrupter` (a user's or a callback's stop): no checkpoint.
    Interrupted,
    /// A stop signal reached these ranks: checkpoint the step, then stop.
    Signal(Vec<(usize, i32)>),
}

/// The run's counters, carried across epochs (and restored by a resume).
struct Counters {
    /// Optimizer steps taken (skipped steps excluded).
    optimizer_steps: u64,
    /// Gradient synchronisations (skipped steps included): the consistency check's cadence, and
    /// the numbers of step checkpoints.
    synchronisations: u64,
}

impl<LC: LearningComponentsTypes + Send + 'static> Worker<LC>
where
    ModelOutput<LC>: 'static,
    ValidOutput<LC>: 'static,
{
    /// Trains the epochs of `self.epochs`.
    pub(super) fn train_epochs(
        &mut self,
        ddp: &mut DistributedDataParallel<TrainingBackend<LC>>,
        report: &mut RankReport,
        collectives: &AtomicU64,
    ) -> Result<()> {
        let world_size = self.group.world_size();
        let mut policy = StepPolicy::new(&self.config, self.grad_accumulation)?;
        let mut counters = Counters {
            optimizer_steps: self.resume.optimizer_steps,
            synchronisations: self.resume.synchronisations,
        };
        // BatchNorm statistics are updated in the forward pass: a skipped step must undo that.
        // Only buffers: frozen weights do not change.
        let buffers = ddp.replica_layout().buffer_mask();
        let has_buffers = buffers.contains(&true);
        let first_epoch = *self.epochs.start();

        for epoch in self.epochs.clone() {
            let epoch_start = Instant::now();
            policy.start_epoch();
            let progress_global = Progress::new(epoch, *self.epochs.end());
            let dataloader = self.dataloader.clone();
            // burn-train's epoch k is sampler epoch k - 1: a resumed run gets the order the
            // uninterrupted run would have had, without the user telling the loader.
            let _epoch = crate::sampler::enter_epoch(epoch as u64 - 1);
            let mut iterator = dataloader.iter();
            // A run resumed from a step checkpoint skips the batches that were trained.
            let skip = if epoch == first_epoch {
                self.resume.batches
            } else {
                0
            };
            for _ in 0..skip {
                if iterator.next().is_none() {
                    break;
                }
            }
            let mut accumulator = GradientsAccumulator::<TrainingModel<LC>>::new();
            let mut buffer_snapshot: Option<Vec<f32>> = None;
            let mut steps = 0u64;
            let mut step = skip;
            let mut stop = None;
            self.start_reports(skip);
            let collectives_before = collectives.load(Ordering::Relaxed);
            // Local counts; the epoch's totals come with the end-of-epoch all-gather.
            let mut local_samples = 0u64;
            loop {
                let before = iterator.progress().items_processed;
                let item = iterator.next();
                let samples = match &item {
                    Some(_) => iterator
                        .progress()
                        .items_processed
                        .saturating_sub(before)
                        .max(1),
                    None => 0,
                };
                local_samples += samples as u64;
                // Join mode: every step starts with an agreement on who still has a batch (the
                // weights of the reduction depend on it). Otherwise every rank has a batch until
                // all run out together, and the stop votes ride in the gradient all-reduce: one
                // collective per step. A rank out of data takes part in one more reduction,
                // without gradients and saying so: every rank issues the same collectives (even
                // NCCL, which cannot tell calls apart, learns of uneven data), unless the others
                // are inside an accumulation window or SyncBatchNorm's forward pass, where the
                // reduction meets another collective (Mismatch on the CPU groups).
                let out_of_data = !policy.join() && item.is_none();
                let agreement = if policy.join() {
                    let started = Instant::now();
                    let agreement = self.agree(samples)?;
                    report.coordination += started.elapsed();
                    if agreement.interrupted {
                        stop = Some(Stop::Interrupted);
                        break;
                    }
                    // A stop signal is taken at an optimizer step's boundary, on every rank
                    // alike.
                    if !agreement.signalled.is_empty() && policy.at_step_boundary() {
                        stop = Some(Stop::Signal(agreement.signalled));
                        break;
                    }
                    if agreement.samples.iter().all(|&s| s == 0) {
                        break;
                    }
                    Some(agreement)
                } else {
                    None
                };
                if has_buffers && policy.may_skip() && policy.at_step_boundary() {
                    // Taken before this step's forward passes touch BatchNorm statistics.
                    buffer_snapshot = Some(crate::replica::snapshot_selected(
                        &self.learner.model(),
                        &buffers,
                    ));
                }
                if !out_of_data {
                    // As burn-train's own loop: the scheduler steps once per batch (micro-batch
                    // with gradient accumulation), before the batch's forward pass; in join mode
                    // also on a rank without a batch, since the step goes on.
                    self.learner.lr_step();
                }
                let output = item.map(|item| {
                    let started = Instant::now();
                    let output = self.learner.train_step(item);
                    report.compute += started.elapsed();
                    report.batches += 1;
                    output
                });
                if policy.join() && crate::sync_bn::used_on_this_thread() {
                    return Err(DdpError::InvalidConfig(
                        "SyncBatchNorm cannot be combined with UnevenInputs::Join: a rank without \
                         a batch skips its forward pass and its SyncBatchNorm collectives"
                            .into(),
                    ));
                }
                let (grads, item) = match output {
                    Some(output) => (Some(output.grads), Some(output.item)),
                    // Join mode: this rank ran out of batches and contributes zeros.
                    None => (None, None),
                };
                let ready = if out_of_data {
                    // Micro-batches left over are dropped, as burn-train does.
                    Some(None)
                } else if policy.accumulates() {
                    let complete = policy.micro_batch_done();
                    if let Some(grads) = grads {
                        accumulator.accumulate(&self.learner.model(), grads);
                    }
                    complete.then(|| Some(accumulator.grads()))
                } else {
                    Some(grads)
                };
                if let Some(grads) = ready {
                    let mut options = match &agreement {
                        Some(agreement) => policy.reduce_options(samples as u64, agreement.total()),
                        None => policy.reduce_options(samples as u64, 0),
                    };
                    if agreement.is_none() {
                        // Read after this step's forward and backward passes: an interrupt
                        // raised during them stops training after this step.
                        options.words = StopVote {
                            interrupt: self.interrupter.should_stop(),
                            signal: self.signal().is_some(),
                            out_of_data,
                        }
                        .words();
                    }
                    // Where this rank is: the same on every rank, or the step fails.
                    let position = Position {
                        epoch: epoch as u64,
                        batches: step as u64 + 1,
                        // Compared with a DistributedDataLoader outside join mode only: join
                        // mode weights ranks by their samples, which may differ, and a Burn
                        // loader with workers hands out its short batches in any order.
                        samples: if policy.join() || self.loaders.train_loader == 0 {
                            0
                        } else {
                            samples as u64
                        },
                        lr_bits: self.learner.lr_current().to_bits(),
                        probe: 0,
                    };
                    let (outcome, in_step) =
                        ddp.sync_at(&self.learner.model(), grads, options, position)?;
                    let votes = StopVote::from_reduced(&outcome.words);
                    if votes.out_of_data {
                        // Some rank is out of data: every rank is here, and compares batch
                        // counts (one small all-gather, once per epoch when all is well).
                        let started = Instant::now();
                        let words = self.group.all_gather(
                            &[u64::from(out_of_data), step as u64],
                            self.config.timeout(),
                        )?;
                        report.coordination += started.elapsed();
                        end_of_data(&words, self.rank, epoch, step)?;
                        // Every rank ran out after as many batches: not a synchronisation.
                        ddp.uncount_step();
                        break;
                    }
                    in_step?;
                    counters.synchronisations += 1;
                    if outcome.non_finite {
                        if policy.on_non_finite() == OnNonFinite::Fail {
                            let flags = self.group.all_gather(
                                &[u64::from(outcome.local_non_finite)],
                                self.config.timeout(),
                            )?;
                            return Err(DdpError::NonFinite {
                                rank: self.rank,
                                epoch,
                                step: steps + report.skipped_steps,
                                ranks: (0..world_size).filter(|&r| flags[r] != 0).collect(),
                            });
                        }
                        report.skipped_steps += 1;
                        // The forward passes updated BatchNorm statistics with the bad batch.
                        if let Some(snapshot) = &buffer_snapshot {
                            let model = self.learner.model();
                            // Fold the pending updates first, so they cannot land afterwards.
                            let _ = model.valid();
                            let model = crate::replica::restore_selected(model, snapshot, &buffers);
                            self.learner.load_model(model.into_record());
                        }
                        tracing::warn!(
                            "burn-ddp: rank {}: skipped step {step} of epoch {epoch}: the gradients \
                             are not finite",
                            self.rank
                        );
                    } else {
                        let started = Instant::now();
                        self.learner.optimizer_step(outcome.grads);
                        report.optimizer += started.elapsed();
                        steps += 1;
                        counters.optimizer_steps += 1;
                    }
                    self.sync_buffers(ddp)?;
                    let every = self.config.consistency_check_every();
                    if every > 0 && counters.synchronisations.is_multiple_of(every) {
                        ddp.check_consistency(&self.learner.model(), counters.optimizer_steps)?;
                    }
                    let every = self.config.checkpoint_every();
                    let checkpoint_due = every > 0
                        && !outcome.non_finite
                        && counters.optimizer_steps.is_multiple_of(every);
                    if votes.interrupt {
                        // The step is trained: its due checkpoint is written before stopping.
                        if checkpoint_due {
                            self.step_checkpoint_meeting(epoch, step + 1, &counters)?;
                        }
                        stop = Some(Stop::Interrupted);
                    } else if votes.signal {
                        // Rare: one all-gather to name who was signalled, and with what.
                        let all = self.group.all_gather(
                            &[self.signal().map_or(0, |s| s as u64)],
                            self.config.timeout(),
                        )?;
                        stop = Some(Stop::Signal(
                            all.iter()
                                .enumerate()
                                .filter(|(_, s)| **s != 0)
                                .map(|(r, s)| (r, *s as i32))
                                .collect(),
                        ));
                    } else if checkpoint_due {
                        self.step_checkpoint_meeting(epoch, step + 1, &counters)?;
                    }
                }
                // Every rank reports every step (join mode: `None` without a batch), so rank 0
                // can report one item per step covering the global batch.
                let local = iterator.progress();
                self.report_train(
                    step,
                    item,
                    Progress::new(
                        local.items_processed * world_size,
                        local.items_total * world_size,
                    ),
                    &progress_global,
                )?;
                step += 1;
                if stop.is_some() {
                    // After the step that carried the vote (its batch is trained and counted).
                    break;
                }
            }
            let train_time = epoch_start.elapsed();
            report.step_collectives += collectives.load(Ordering::Relaxed) - collectives_before;
            drop(iterator);
            if let Some(Stop::Signal(signalled)) = stop {
                return Err(self.stop_for_signal(epoch, step, &counters, signalled));
            }
            let interrupted = stop.is_some();

            let mut stop_requested = interrupted;
            // Rank 0 reports the steps still on their way (process mode: a gather), then every
            // rank validates its shard (or rank 0 the whole set).
            self.finish_train_reports(&progress_global)?;
            if let Role::Leader(leader) = &mut self.role {
                leader
                    .event_processor
                    .process_train(LearnerEvent::EndEpoch(epoch));
            }
            if !interrupted {
                self.validate_epoch(&progress_global)?;
            }
            // Rank 0: checkpoints and early stopping, on the epoch's own metrics.
            let mut written = Ok(());
            if matches!(self.role, Role::Leader(_)) && !interrupted {
                written = self.write_epoch_checkpoint(epoch, &counters);
                if written.is_ok()
                    && let Role::Leader(leader) = &mut self.role
                    && let Some(early_stopping) = &mut leader.early_stopping
                    && early_stopping.should_stop(epoch, &leader.event_store)
                {
                    tracing::info!("burn-ddp: early stopping after epoch {epoch}");
                    stop_requested = true;
                }
            }
            // Everyone waits here while rank 0 writes checkpoints: the barrier after the
            // checkpoint. It also carries the stop votes, stop signals, the samples each rank
            // trained on, and whether rank 0's checkpoint failed.
            let votes = self.group.all_gather(
                &[
                    u64::from(stop_requested || self.interrupter.should_stop()),
                    self.signal().map_or(0, |s| s as u64),
                    local_samples,
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
                        "rank 0 could not write the checkpoint of epoch {epoch} (see rank 0's \
                         error)"
                    ),
                }));
            }
            if let Role::Leader(_) = &self.role {
                lock(&self.report).epochs.push(EpochReport {
                    epoch,
                    samples: votes.chunks(4).map(|v| v[2]).sum(),
                    steps,
                    train_time,
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
                return Err(self.stop_for_signal(epoch + 1, 0, &counters, signalled));
            }
            if stopping {
                // Early stopping (or the interrupter) ends the run here anyway: it finishes
                // normally even if a stop signal came in too, as after the last epoch.
                break;
            }
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
            crate::signals::received()
        } else {
            None
        }
    }

    /// Keeps buffers identical across replicas in separate processes (threads share Burn's
    /// `RunningState`, which averages).
    fn sync_buffers(&mut self, ddp: &DistributedDataParallel<TrainingBackend<LC>>) -> Result<()> {
        if !self.average_buffers {
            return Ok(());
        }
        let model = match self.config.buffer_sync() {
            BufferSync::Average => ddp.average_buffers(self.learner.model())?,
            BufferSync::Broadcast => ddp.sync_buffers(self.learner.model())?,
            BufferSync::None => return Ok(()),
        };
        self.learner.load_model(model.into_record());
        Ok(())
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
    fn write_epoch_checkpoint(&mut self, epoch: usize, counters: &Counters) -> Result<()> {
        let Role::Leader(leader) = &mut self.role else {
            return Ok(());
        };
        leader.wait_for_events();
        if let Some(checkpointer) = &mut leader.checkpointer {
            let stopped_before = self.interrupter.should_stop();
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
            DdpState {
                epoch,
                world_size: self.group.world_size(),
                optimizer_steps: counters.optimizer_steps,
                next_sampler_epoch: epoch as u64,
                synchronisations: counters.synchronisations,
                run_id: Some(self.run_id.clone()),
            }
            .write(dir)?;
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
    fn step_checkpoint_meeting(
        &mut self,
        epoch: usize,
        batches: usize,
        counters: &Counters,
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
                detail: format!(
                    "rank 0 could not write the step checkpoint at batch {batches} of epoch \
                     {epoch} (see rank 0's error)"
                ),
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
        };
        let path = checkpoints.save(&self.learner, &state, &leader.event_store, &self.device)?;
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
    fn stop_for_signal(
        &mut self,
        epoch: usize,
        batches: usize,
        counters: &Counters,
        signalled: Vec<(usize, i32)>,
    ) -> DdpError {
        let written = self.write_step_checkpoint(epoch, batches, counters);
        let ok = u64::from(written.is_ok());
        let all = match self
            .group
            .all_gather(&[ok], self.config.epoch_end_timeout())
        {
            Ok(all) => all,
            Err(err) => return err,
        };
        if let Err(err) = written {
            return err;
        }
        if all.first() == Some(&0) {
            return DdpError::Checkpoint {
                path: self
                    .config
                    .checkpoint_dir()
                    .map(|d| d.display().to_string())
                    .unwrap_or_default(),
                detail: "rank 0 could not write the checkpoint of the step where a stop signal \
                         stopped training (see rank 0's error)"
                    .into(),
            };
        }
        let checkpoint = self.config.checkpoint_dir().map(|dir| {
            StepState::path(dir, counters.synchronisations)
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
