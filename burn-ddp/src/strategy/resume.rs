//! Where a run starts, and the checkpoints it can start from.
//!
//! Two kinds of checkpoints live in [`DdpConfig::with_checkpoint_dir`]:
//! - burn-train's epoch checkpoints (`model-<epoch>`, `optim-<epoch>`, `scheduler-<epoch>`, with
//!   the user's recorder), written by rank 0 at the end of every epoch; the end-of-epoch barrier
//!   waits until they are on disk and readable ([`wait_for_epoch_checkpoint`]);
//! - burn-ddp's step checkpoints ([`StepCheckpoints`]), written by rank 0 in the middle of an
//!   epoch when the job is asked to stop by a signal, or every
//!   [`DdpConfig::with_checkpoint_every`] optimizer steps: the same three records in full
//!   precision plus a [`StepState`] saying how far the epoch got.
//!
//! With [`DdpConfig::with_resume`] a run starts from the newest of them that loads (a truncated or
//! unreadable one is passed over, with a warning that names it and why), mid-epoch for a step
//! checkpoint: the batches already trained are skipped, so the run continues exactly as the
//! uninterrupted one would have.

use std::cell::Cell;
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::sync::Once;

use burn::record::{FullPrecisionSettings, NamedMpkFileRecorder};
use burn::tensor::Device;
use burn::train::checkpoint::{
    AsyncCheckpointer, CheckpointingAction, CheckpointingStrategy, FileCheckpointer,
};
use burn::train::metric::store::EventStoreClient;
use burn::train::{
    Interrupter, Learner, LearningCheckpointer, LearningComponentsTypes, TrainingBackend,
};

use crate::checkpoint::{AtomicRecorder, DdpState, StepState, epoch_checkpoints};
use crate::{DdpConfig, DdpError, Result};

/// Where a run starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Resume {
    /// The first epoch to train (burn-train counts from 1).
    pub starting_epoch: usize,
    /// Batches of `starting_epoch` already trained (from a step checkpoint), skipped.
    pub batches: usize,
    /// Optimizer steps of the run so far.
    pub optimizer_steps: u64,
    /// Gradient synchronisations of the run so far (they number the step checkpoints).
    pub synchronisations: u64,
}

/// A checkpoint a run could start from.
enum Candidate {
    Epoch(usize),
    Step(StepState),
}

impl Candidate {
    /// Completed epochs and batches of the next one.
    fn progress(&self) -> (usize, usize) {
        match self {
            Candidate::Epoch(epoch) => (*epoch, 0),
            Candidate::Step(state) => (state.epoch.saturating_sub(1), state.batches),
        }
    }

    fn describe(&self, dir: &Path) -> String {
        match self {
            Candidate::Epoch(epoch) => format!(
                "the checkpoint of epoch {epoch} ({}/model-{epoch})",
                dir.display()
            ),
            Candidate::Step(state) => format!(
                "step checkpoint {} (batch {} of epoch {}, {})",
                state.number,
                state.batches,
                state.epoch,
                StepState::path(dir, state.number).display()
            ),
        }
    }
}

/// Loads the newest complete checkpoint of `config`'s checkpoint directory into `learner` when
/// `config` asks to resume; otherwise the run starts where burn-train says (`starting_epoch`,
/// after its own `SupervisedTraining::checkpoint`).
///
/// # Errors
/// [`DdpError::Checkpoint`] when the newest usable checkpoint is a step checkpoint of a job with
/// another world size (the batches of a partly trained epoch do not carry over).
pub(super) fn prepare<LC: LearningComponentsTypes>(
    config: &DdpConfig,
    learner: &Learner<LC>,
    epochs: Option<&LearningCheckpointer<LC>>,
    starting_epoch: usize,
    device: &Device<TrainingBackend<LC>>,
    rank: usize,
    world_size: usize,
) -> Result<(Option<Learner<LC>>, Resume)> {
    let mut resume = Resume {
        starting_epoch,
        batches: 0,
        optimizer_steps: 0,
        synchronisations: 0,
    };
    let Some(dir) = config.checkpoint_dir() else {
        return Ok((None, resume));
    };
    let mut loaded_learner = None;
    if config.resume() {
        let mut candidates: Vec<Candidate> = Vec::new();
        let mut skipped: Vec<String> = Vec::new();
        for found in StepState::list(dir) {
            match found {
                Ok(state) => candidates.push(Candidate::Step(state)),
                Err((path, why)) => skipped.push(format!("{}: {why}", path.display())),
            }
        }
        if epochs.is_some() {
            candidates.extend(epoch_checkpoints(dir).into_iter().map(Candidate::Epoch));
        }
        // Newest first; only what is newer than where burn-train already starts.
        candidates.sort_by_key(|c| std::cmp::Reverse(c.progress()));
        candidates.retain(|c| c.progress() > (starting_epoch.saturating_sub(1), 0));
        for candidate in candidates {
            let loaded = match &candidate {
                Candidate::Epoch(epoch) => epochs
                    .ok_or_else(|| "no file checkpointer".to_string())
                    .and_then(|c| quietly(|| c.load_checkpoint(learner.clone(), device, *epoch))),
                Candidate::Step(state) => {
                    StepCheckpoints::<LC>::new(dir).load(learner.clone(), device, state.number)
                }
            };
            if let (Ok(_), Candidate::Step(state)) = (&loaded, &candidate)
                && state.world_size != world_size
                && state.batches > 0
            {
                // Only a checkpoint that would be used is refused: a truncated one is passed
                // over like any other, and one at an epoch's first batch re-shards.
                return Err(DdpError::Checkpoint {
                    path: StepState::path(dir, state.number).display().to_string(),
                    detail: format!(
                        "the newest checkpoint was taken at batch {} of epoch {} by a job of \
                         world size {}, this job has {world_size}: the batches of a partly \
                         trained epoch do not carry over to another world size; resume with {} \
                         ranks, or remove ddp-step-*.json to resume from the last epoch \
                         checkpoint",
                        state.batches, state.epoch, state.world_size, state.world_size
                    ),
                });
            }
            match loaded {
                Ok(loaded) => {
                    loaded_learner = Some(loaded);
                    resume = match &candidate {
                        Candidate::Epoch(epoch) => Resume {
                            starting_epoch: epoch + 1,
                            ..resume
                        },
                        Candidate::Step(state) => Resume {
                            starting_epoch: state.epoch,
                            batches: state.batches,
                            optimizer_steps: state.optimizer_steps,
                            synchronisations: state.number,
                        },
                    };
                    for skip in skipped.drain(..) {
                        tracing::warn!("burn-ddp: rank {rank}: not resuming from {skip}");
                    }
                    if rank == 0 {
                        crate::log::info_console(&format!(
                            "resuming from {}",
                            candidate.describe(dir)
                        ));
                    }
                    break;
                }
                Err(why) => skipped.push(format!(
                    "{}: it cannot be loaded ({})",
                    candidate.describe(dir),
                    // Burn's messages run on with advice about old formats.
                    why.lines()
                        .next()
                        .unwrap_or_default()
                        .split("\\n")
                        .next()
                        .unwrap_or_default()
                )),
            }
        }
        for skip in &skipped {
            tracing::warn!("burn-ddp: rank {rank}: not resuming from {skip}");
        }
    }
    if resume.batches == 0 && resume.starting_epoch > 1 {
        // An epoch boundary: the model and optimizer carry over to any world size, and
        // `DistributedSampler` gives the same global order of samples (re-sharding).
        let finished = resume.starting_epoch - 1;
        match DdpState::read(dir, finished) {
            Ok(Some(state)) => {
                resume.optimizer_steps = state.optimizer_steps;
                resume.synchronisations = resume.synchronisations.max(state.synchronisations);
                if state.world_size != world_size && rank == 0 {
                    crate::log::warn_console(&format!(
                        "resuming after epoch {finished}, written by a job of world size {}, \
                         with world size {world_size}: the data is re-sharded (with \
                         DistributedSampler every step still sees the same samples if the global \
                         batch is the same, i.e. the per-rank batch times the world size)",
                        state.world_size
                    ));
                }
            }
            Ok(None) => {}
            Err(e) => tracing::warn!("burn-ddp: rank {rank}: {e}"),
        }
    }
    Ok((loaded_learner, resume))
}

/// Waits until `epoch`'s burn-train checkpoint is on disk: burn-train writes checkpoints on
/// background threads, and a load is queued behind the writes, so reading it back waits for them
/// (and checks that it loads). Returns why it cannot be read, e.g. when the checkpointing strategy
/// did not save this epoch.
pub(super) fn wait_for_epoch_checkpoint<LC: LearningComponentsTypes>(
    checkpointer: &LearningCheckpointer<LC>,
    learner: &Learner<LC>,
    device: &Device<TrainingBackend<LC>>,
    epoch: usize,
) -> std::result::Result<(), String> {
    quietly(|| checkpointer.load_checkpoint(learner.clone(), device, epoch)).map(|_| ())
}

/// Saves every checkpoint it is asked for (deletions are [`StepCheckpoints`]'s).
struct SaveEach;

impl CheckpointingStrategy for SaveEach {
    fn checkpointing(&mut self, _: usize, _: &EventStoreClient) -> Vec<CheckpointingAction> {
        vec![CheckpointingAction::Save]
    }
}

/// burn-ddp's step checkpoints in one directory (see the [module docs](self)): rank 0 writes
/// them, every rank can load them.
pub(super) struct StepCheckpoints<LC: LearningComponentsTypes> {
    dir: PathBuf,
    checkpointer: LearningCheckpointer<LC>,
    /// Where the background writers report a failed write.
    failures: Interrupter,
}

impl<LC: LearningComponentsTypes> StepCheckpoints<LC> {
    /// The step checkpoints of `dir` (full-precision MessagePack, written atomically).
    pub fn new(dir: &Path) -> Self {
        let recorder = AtomicRecorder::new(NamedMpkFileRecorder::<FullPrecisionSettings>::new());
        let failures = Interrupter::new();
        let [model, optim, scheduler] = StepState::RECORDS;
        let checkpointer = LearningCheckpointer::new(
            AsyncCheckpointer::new(FileCheckpointer::new(recorder.clone(), dir, model))
                .with_interrupter(failures.clone()),
            AsyncCheckpointer::new(FileCheckpointer::new(recorder.clone(), dir, optim))
                .with_interrupter(failures.clone()),
            AsyncCheckpointer::new(FileCheckpointer::new(recorder, dir, scheduler))
                .with_interrupter(failures.clone()),
            Box::new(SaveEach),
        );
        Self {
            dir: dir.to_path_buf(),
            checkpointer,
            failures,
        }
    }

    /// Writes `learner` as step checkpoint `state.number`, reads it back (which waits for the
    /// background writes and checks them), then writes `state`, and removes the step
    /// checkpoints older than the one before. Returns the state's path.
    ///
    /// # Errors
    /// [`DdpError::Checkpoint`] naming the file that could not be written or read back.
    pub fn save(
        &mut self,
        learner: &Learner<LC>,
        state: &StepState,
        store: &EventStoreClient,
        device: &Device<TrainingBackend<LC>>,
    ) -> Result<PathBuf> {
        let number = state.number as usize;
        let records = self
            .dir
            .join(format!("{}-{number}.mpk", StepState::RECORDS[0]));
        self.checkpointer.checkpoint(learner, number, store);
        let read_back = quietly(|| {
            self.checkpointer
                .load_checkpoint(learner.clone(), device, number)
        });
        if let Some(failure) = self.failures.get_message() {
            self.failures.reset();
            return Err(DdpError::Checkpoint {
                path: records.display().to_string(),
                detail: format!("cannot write the step checkpoint: {failure}"),
            });
        }
        read_back.map_err(|why| DdpError::Checkpoint {
            path: records.display().to_string(),
            detail: format!("the step checkpoint was written but cannot be read back: {why}"),
        })?;
        state.write(&self.dir)?;
        for older in StepState::list(&self.dir)
            .into_iter()
            .flatten()
            .filter(|s| s.number < state.number)
            .skip(1)
        {
            StepState::remove(&self.dir, older.number);
        }
        Ok(StepState::path(&self.dir, state.number))
    }

    /// `learner` with step checkpoint `number` loaded, or why it cannot be.
    pub fn load(
        &self,
        learner: Learner<LC>,
        device: &Device<TrainingBackend<LC>>,
        number: u64,
    ) -> std::result::Result<Learner<LC>, String> {
        quietly(|| {
            self.checkpointer
                .load_checkpoint(learner, device, number as usize)
        })
    }
}

thread_local! {
    static QUIET: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f`, turning a panic into `Err(message)` without printing it: burn-train's checkpoint
/// loading panics on a file it cannot read, which here is an answer, not a crash. Other threads'
/// panics are printed as before (the panic hook is wrapped once per process).
pub(super) fn quietly<T>(f: impl FnOnce() -> T) -> std::result::Result<T, String> {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !QUIET.with(Cell::get) {
                previous(info);
            }
        }));
    });
    let was = QUIET.with(|q| q.replace(true));
    let result = std::panic::catch_unwind(AssertUnwindSafe(f));
    QUIET.with(|q| q.set(was));
    result.map_err(|payload| super::worker::panic_message(payload.as_ref()))
}
