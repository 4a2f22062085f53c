//! burn-ddp's step checkpoints: the three burn-train records of a step in full precision, written
//! atomically by rank 0 in the middle of an epoch (on a stop signal, or every
//! [`DdpConfig::with_checkpoint_every`](crate::DdpConfig::with_checkpoint_every) optimizer steps)
//! with a [`StepState`] saying how far the epoch got; and the wait for burn-train's own epoch
//! checkpoints to be on disk. Which checkpoint a run starts from is `resume.rs`'s.

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

use crate::checkpoint::{AtomicRecorder, StepState};
use crate::error::{DdpError, Result};
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

/// burn-ddp's step checkpoints of one run in one directory (see the [module docs](self)): rank 0
/// writes them, every rank can load them. Their files carry the run's tag
/// ([`run_tag`](crate::checkpoint::run_tag)): other runs' in the directory are never touched.
pub(super) struct StepCheckpoints<LC: LearningComponentsTypes> {
    dir: PathBuf,
    /// The run whose checkpoints these are (`None`: one written before files carried it).
    run_id: Option<String>,
    /// Signs the state files when the job has a token.
    key: Option<burn_ddp_comm::auth::CheckpointKey>,
    checkpointer: LearningCheckpointer<LC>,
    /// Where the background writers report a failed write.
    failures: Interrupter,
}

impl<LC: LearningComponentsTypes> StepCheckpoints<LC> {
    /// The step checkpoints of run `run_id` in `dir` (full-precision MessagePack, written
    /// atomically), signed with `key` when given.
    pub fn new(dir: &Path, run_id: &str, key: Option<burn_ddp_comm::auth::CheckpointKey>) -> Self {
        Self::with_prefixes(dir, Some(run_id), key, StepState::prefixes_of(Some(run_id)))
    }

    /// For loading the checkpoint `state` describes (whichever run wrote it).
    pub(super) fn loading(dir: &Path, state: &StepState) -> Self {
        Self::with_prefixes(dir, state.run_id.as_deref(), None, state.prefixes())
    }

    fn with_prefixes(
        dir: &Path,
        run_id: Option<&str>,
        key: Option<burn_ddp_comm::auth::CheckpointKey>,
        [model, optim, scheduler]: [String; 3],
    ) -> Self {
        let recorder = AtomicRecorder::new(NamedMpkFileRecorder::<FullPrecisionSettings>::new());
        let failures = Interrupter::new();
        let checkpointer = LearningCheckpointer::new(
            AsyncCheckpointer::new(FileCheckpointer::new(recorder.clone(), dir, &model))
                .with_interrupter(failures.clone()),
            AsyncCheckpointer::new(FileCheckpointer::new(recorder.clone(), dir, &optim))
                .with_interrupter(failures.clone()),
            AsyncCheckpointer::new(FileCheckpointer::new(recorder, dir, &scheduler))
                .with_interrupter(failures.clone()),
            Box::new(SaveEach),
        );
        Self {
            dir: dir.to_path_buf(),
            run_id: run_id.map(str::to_string),
            key,
            checkpointer,
            failures,
        }
    }

    /// Writes `learner` as step checkpoint `state.number`, reads it back (which waits for the
    /// background writes and checks them), then writes `state` with the records' SHA-256 (and
    /// signed, with a key), and removes this run's step checkpoints older than the one before.
    /// Returns the state's path.
    ///
    /// # Errors
    /// [`DdpError::Checkpoint`] naming the file that could not be written, read back, hashed or
    /// deleted.
    pub fn save(
        &mut self,
        learner: &Learner<LC>,
        state: &StepState,
        store: &EventStoreClient,
        device: &Device<TrainingBackend<LC>>,
    ) -> Result<PathBuf> {
        let number = state.number as usize;
        let names = StepState::prefixes_of(self.run_id.as_deref())
            .map(|prefix| format!("{prefix}-{number}.mpk"));
        let records = self.dir.join(&names[0]);
        // burn-train's checkpointer reads the record on its own thread: the step must have run.
        // Rank 0 alone writes step checkpoints.
        crate::replica::sync_device::<TrainingBackend<LC>>(
            0,
            device,
            "the optimizer step before the step checkpoint",
        )?;
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
        let mut state = state.clone();
        state.records = names
            .into_iter()
            .map(|name| {
                let path = self.dir.join(&name);
                crate::checkpoint::file_sha256(&path)
                    .map(|sha256| crate::checkpoint::RecordFile { name, sha256 })
                    .map_err(|e| DdpError::Checkpoint {
                        path: path.display().to_string(),
                        detail: format!("the step checkpoint cannot be read back: {e}"),
                    })
            })
            .collect::<Result<_>>()?;
        if let Some(key) = &self.key {
            state.sign(key);
        }
        state.write(&self.dir)?;
        for older in StepState::list(&self.dir)
            .into_iter()
            .flatten()
            .filter(|s| s.run_id == self.run_id && s.number < state.number)
            .skip(1)
        {
            older.remove(&self.dir)?;
        }
        Ok(state.file_in(&self.dir))
    }

    /// The key that signs the run's state files, when the job has a token.
    pub fn key(&self) -> Option<&burn_ddp_comm::auth::CheckpointKey> {
        self.key.as_ref()
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
    result.map_err(|payload| crate::error::panic_message(payload.as_ref()))
}
