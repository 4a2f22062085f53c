//! Checkpoints that survive a crash mid-write and name the run and the records they belong to.
//!
//! Rank 0 alone writes them, in [`DdpConfig::with_checkpoint_dir`](crate::DdpConfig::with_checkpoint_dir)
//! (burn-train's `<artifact dir>/checkpoint`):
//!
//! - **Epoch checkpoints** are burn-train's: its checkpointers write the model, optimizer and LR
//!   scheduler records (`model-<epoch>.bpk`, `optim-<epoch>.bpk`, `scheduler-<epoch>.bpk`) when
//!   its checkpointing strategy says so. Give burn-train burn-ddp's
//!   ([`DdpConfig::checkpointers`](crate::DdpConfig::checkpointers), [`RecordCheckpointer`]):
//!   they write each record atomically (temporary name, sync, rename: the old file or the
//!   complete new one, never half written) and note its SHA-256, which rank 0 puts in the
//!   epoch's state file, `ddp-state-<epoch>.json`, with the run id, the world size and the
//!   step counters.
//! - **Step checkpoints** are burn-ddp's own, in the middle of an epoch (after a stop signal, or
//!   every [`DdpConfig::with_checkpoint_every`](crate::DdpConfig::with_checkpoint_every)
//!   optimizer steps): the same three records (`ddp-model-<run tag>-<n>.bpk`, ...) and
//!   `ddp-step-<run tag>-<n>.json`, saying how far the epoch got.
//!
//! A state file is written after its records are on disk and holds their SHA-256 (and, when the
//! job has a token, an HMAC-SHA-256 under the job's checkpoint key): a resume takes a checkpoint
//! only when the files there are the ones written for it.
//!
//! All of it is built from one value, the run's [`Checkpoints`]: the directory, the run id and
//! its tag in file names, the key, and the ledger burn-ddp's checkpointers note their writes in.

mod epoch;
mod file;
mod records;
mod resume;
mod state;
mod step;

use std::path::{Path, PathBuf};
use std::time::Duration;

use burn_ddp_comm::auth::{CheckpointKey, JobIdentity};

pub use burn_ddp_comm::signals::PREEMPTED_EXIT_CODE;
pub(crate) use epoch::{EpochCheckpoint, quietly, write_epoch_checkpoint};
pub use records::RecordCheckpointer;
pub(crate) use records::{Ledger, Mark, RecordFile};
pub(crate) use resume::{Resume, Resuming, prepare};
pub(crate) use state::{EpochState, FORMAT, SignedState, StepState};
pub(crate) use step::{Records, StepCheckpointer};

use crate::error::{DdpError, Result};

/// The records of a checkpoint, in burn-train's order and with its names: model, optimizer, LR
/// scheduler.
pub(crate) const RECORDS: [&str; 3] = ["model", "optim", "scheduler"];

/// A run id as a part of file names: its letters, digits, `.` and `_` (others become `_`, at most
/// 40), then `-` and 8 hexadecimal digits of its SHA-256, so two run ids never share a tag.
pub(crate) fn run_tag(run_id: &str) -> String {
    let safe: String = run_id
        .chars()
        .map(|c| match c {
            'a'..='z' | 'A'..='Z' | '0'..='9' | '.' | '_' => c,
            _ => '_',
        })
        .take(40)
        .collect();
    let digest = file::sha256_hex(run_id.as_bytes());
    format!("{safe}-{}", &digest[..8])
}

/// Where a run stood when it wrote a checkpoint: what its state file records besides the
/// records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Progress {
    /// The epoch finished (epoch checkpoint) or in progress (step checkpoint), from 1.
    pub epoch: usize,
    /// Batches of that epoch every rank had trained on (0 for an epoch checkpoint).
    pub batches: usize,
    /// Number of ranks of the job.
    pub world_size: usize,
    /// Optimizer steps taken since the start of the run (skipped steps excluded).
    pub optimizer_steps: u64,
    /// Gradient synchronisations since the start of the run (they number step checkpoints).
    pub synchronisations: u64,
}

/// One run's checkpoints in one directory (see the [module docs](self)).
#[derive(Debug, Clone)]
pub(crate) struct Checkpoints {
    dir: PathBuf,
    run_id: String,
    tag: String,
    key: Option<CheckpointKey>,
    ledger: Ledger,
}

impl Checkpoints {
    /// The checkpoints in `dir` of the job `identity` names (its run id, and its checkpoint key
    /// when it has a secret), whose writes burn-ddp's checkpointers note in `ledger`.
    pub fn new(dir: &Path, identity: &JobIdentity, ledger: Ledger) -> Self {
        Self::of(dir, identity.run_id(), identity.checkpoint_key(), ledger)
    }

    /// The checkpoints in `dir` of run `run_id`, signed with `key` (the job's, when it has a
    /// secret), whose writes burn-ddp's checkpointers note in `ledger`.
    pub fn of(dir: &Path, run_id: &str, key: Option<CheckpointKey>, ledger: Ledger) -> Self {
        Self {
            dir: dir.to_path_buf(),
            run_id: run_id.to_string(),
            tag: run_tag(run_id),
            key,
            ledger,
        }
    }

    /// The checkpoint directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The run these checkpoints belong to.
    pub fn run_id(&self) -> &str {
        &self.run_id
    }

    /// The key that signs the state files, when the job has a secret.
    pub fn key(&self) -> Option<&CheckpointKey> {
        self.key.as_ref()
    }

    /// The ledger the checkpointers note their writes in.
    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    /// The checkpointers of epoch checkpoints for burn-train (model, optimizer, LR scheduler,
    /// burn-train's names), noting their writes in the ledger.
    pub fn epoch_checkpointers(dir: &Path, ledger: &Ledger) -> [RecordCheckpointer; 3] {
        RECORDS.map(|record| RecordCheckpointer::new(dir, record, ledger.clone()))
    }

    /// The checkpointers of this run's step checkpoints: `ddp-model-<run tag>`, ...
    pub fn step_checkpointers(&self) -> [RecordCheckpointer; 3] {
        RECORDS.map(|record| {
            RecordCheckpointer::new(
                &self.dir,
                &format!("ddp-{record}-{}", self.tag),
                self.ledger.clone(),
            )
        })
    }

    /// The state file of this run's step checkpoint `number`.
    pub fn step_state_path(&self, number: u64) -> PathBuf {
        StepState::path(&self.dir, &self.tag, number)
    }

    /// The state file of the epoch checkpoint of `epoch` (whichever run wrote it).
    pub fn epoch_state_path(&self, epoch: usize) -> PathBuf {
        EpochState::path(&self.dir, epoch)
    }

    /// Waits until the records `checkpointers` write for checkpoint `number` after `since` are all
    /// on disk, and returns them with their hashes.
    ///
    /// # Errors
    /// [`DdpError::Checkpoint`] naming the file that could not be written, or saying that they
    /// were not all written within `timeout`.
    pub fn written(
        &self,
        checkpointers: &[RecordCheckpointer; 3],
        number: usize,
        since: Mark,
        timeout: Duration,
    ) -> Result<Vec<RecordFile>> {
        self.wait_written(checkpointers, number, since, timeout)?
            .ok_or_else(|| Self::not_written(checkpointers, number, timeout))
    }

    /// [`written`](Self::written), `None` when `timeout` passes first.
    ///
    /// # Errors
    /// [`DdpError::Checkpoint`] naming the file that could not be written.
    pub fn wait_written(
        &self,
        checkpointers: &[RecordCheckpointer; 3],
        number: usize,
        since: Mark,
        timeout: Duration,
    ) -> Result<Option<Vec<RecordFile>>> {
        let keys = checkpointers.each_ref().map(RecordCheckpointer::key);
        let keys = keys.each_ref().map(String::as_str);
        self.ledger
            .wait_for(&keys, number, since, timeout)
            .map_err(|why| DdpError::Checkpoint {
                path: checkpointers[0].path(number).display().to_string(),
                detail: format!("cannot write checkpoint {number}: {why}"),
            })
    }

    /// The error of records not all written within `timeout`.
    pub fn not_written(
        checkpointers: &[RecordCheckpointer; 3],
        number: usize,
        timeout: Duration,
    ) -> DdpError {
        let records = checkpointers.each_ref().map(RecordCheckpointer::record);
        DdpError::Checkpoint {
            path: checkpointers[0].path(number).display().to_string(),
            detail: format!(
                "the records of checkpoint {number} ({}) were not all written within {timeout:?}",
                records.join(", ")
            ),
        }
    }

    /// The ledger keys of burn-train's epoch records in this directory (model, optimizer, LR
    /// scheduler).
    pub fn epoch_keys(&self) -> [String; 3] {
        Self::epoch_checkpointers(&self.dir, &self.ledger)
            .each_ref()
            .map(RecordCheckpointer::key)
    }

    /// The state of an epoch checkpoint at `progress`, naming `records` (those written for it now;
    /// none when burn-train's checkpointing strategy saved none), signed when the job has a key,
    /// written to [`epoch_state_path`](Self::epoch_state_path).
    ///
    /// # Errors
    /// [`DdpError::Checkpoint`] naming the file.
    pub fn write_epoch_state(
        &self,
        progress: Progress,
        records: Vec<RecordFile>,
    ) -> Result<EpochState> {
        let mut state = EpochState {
            format: FORMAT,
            epoch: progress.epoch,
            world_size: progress.world_size,
            optimizer_steps: progress.optimizer_steps,
            synchronisations: progress.synchronisations,
            next_sampler_epoch: progress.epoch as u64,
            run_id: self.run_id.clone(),
            records,
            mac: None,
        };
        if let Some(key) = &self.key {
            state.sign(key);
        }
        state.write_to(&self.epoch_state_path(progress.epoch))?;
        Ok(state)
    }

    /// The state of step checkpoint `progress.synchronisations` of this run, naming `records`,
    /// signed when the job has a key, written to [`step_state_path`](Self::step_state_path); then
    /// this run's step checkpoints older than the one before it are removed (the last two
    /// stay), and those numbered above it (an abandoned timeline's, after a resume from an
    /// earlier point).
    ///
    /// # Errors
    /// [`DdpError::Checkpoint`] naming the file that could not be written or removed.
    pub fn write_step_state(
        &self,
        progress: Progress,
        records: Vec<RecordFile>,
    ) -> Result<StepState> {
        let mut state = StepState {
            format: FORMAT,
            number: progress.synchronisations,
            epoch: progress.epoch,
            batches: progress.batches,
            world_size: progress.world_size,
            optimizer_steps: progress.optimizer_steps,
            run_id: self.run_id.clone(),
            records,
            mac: None,
        };
        if let Some(key) = &self.key {
            state.sign(key);
        }
        state.write_to(&self.step_state_path(state.number))?;
        // This run's other step checkpoints: older than the one before this go; newer-numbered
        // ones are an abandoned timeline's (numbers only grow along one), and go too, lest a
        // resume take them.
        let mut own: Vec<u64> = StepState::list(&self.dir)
            .into_iter()
            .flatten()
            .filter(|s| s.run_id == self.run_id && s.number != state.number)
            .map(|s| s.number)
            .collect();
        own.sort_unstable_by(|a, b| b.cmp(a));
        let previous = own.iter().copied().find(|&n| n < state.number);
        for number in own {
            if number > state.number || Some(number) != previous {
                self.remove_step(number)?;
            }
        }
        Ok(state)
    }

    /// Removes this run's step checkpoint `number`: its state file first (an interrupted removal
    /// never leaves a state without its records), then its records, at the names this run's
    /// checkpointers give them (never names read from a state file). Missing files are fine.
    ///
    /// # Errors
    /// [`DdpError::Checkpoint`] naming a file that exists but cannot be removed.
    fn remove_step(&self, number: u64) -> Result<()> {
        let index = usize::try_from(number).unwrap_or(usize::MAX);
        let records = self.step_checkpointers().map(|c| c.path(index));
        for path in std::iter::once(self.step_state_path(number)).chain(records) {
            file::remove_checkpoint_file(&path, "the older step checkpoint")?;
        }
        Ok(())
    }

    /// Removes the state files of the epochs whose model record burn-train's checkpointing
    /// strategy deleted after `since` (through burn-ddp's checkpointers): a state never outlives
    /// its records. Missing files are fine.
    ///
    /// # Errors
    /// [`DdpError::Checkpoint`] naming a state file that exists but cannot be removed.
    pub fn forget_deleted_epochs(&self, since: Mark) -> Result<()> {
        let [model, _, _] = self.epoch_keys();
        for epoch in self.ledger.deleted_since(&model, since) {
            file::remove_checkpoint_file(
                &self.epoch_state_path(epoch),
                "the state of a deleted checkpoint",
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::module::Module;
    use burn::nn::LinearConfig;
    use burn::store::ModuleRecord;
    use burn::train::checkpoint::Checkpointer;

    fn identity(run_id: &str, token: Option<&[u8]>) -> JobIdentity {
        JobIdentity::new(run_id, token).unwrap()
    }

    fn record() -> ModuleRecord {
        LinearConfig::new(2, 2)
            .init(&Default::default())
            .into_record()
    }

    fn progress(synchronisations: u64) -> Progress {
        Progress {
            epoch: 1,
            batches: synchronisations as usize,
            world_size: 2,
            optimizer_steps: synchronisations,
            synchronisations,
        }
    }

    #[test]
    fn run_tags_are_file_name_safe_and_tell_run_ids_apart() {
        assert_ne!(run_tag("run/a"), run_tag("run_a"));
        assert!(
            run_tag("job 7: ../../etc")
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "._-".contains(c))
        );
        assert!(run_tag(&"x".repeat(128)).len() <= 49);
    }

    #[test]
    fn a_step_checkpoint_names_its_records_and_keeps_the_last_two_of_its_run() {
        let dir = tempfile::tempdir().unwrap();
        let run = Checkpoints::new(
            dir.path(),
            &identity("run-a", Some(b"token a")),
            Ledger::default(),
        );
        let other = Checkpoints::new(dir.path(), &identity("run-b", None), Ledger::default());
        let write = |checkpoints: &Checkpoints, number: u64| {
            let checkpointers = checkpoints.step_checkpointers();
            let mark = checkpoints.ledger().mark();
            for checkpointer in &checkpointers {
                Checkpointer::<ModuleRecord>::save(checkpointer, number as usize, record())
                    .unwrap();
            }
            let files = checkpoints
                .written(
                    &checkpointers,
                    number as usize,
                    mark,
                    Duration::from_secs(5),
                )
                .unwrap();
            checkpoints
                .write_step_state(progress(number), files)
                .unwrap()
        };
        let theirs = write(&other, 5);
        for number in [10, 20, 30] {
            write(&run, number);
        }
        let left: Vec<(String, u64)> = StepState::list(dir.path())
            .into_iter()
            .map(|s| s.unwrap())
            .map(|s| (s.run_id, s.number))
            .collect();
        assert_eq!(
            left,
            vec![
                ("run-a".to_string(), 30),
                ("run-a".to_string(), 20),
                ("run-b".to_string(), 5)
            ]
        );
        assert!(
            !run.step_checkpointers()[0].path(10).exists(),
            "its records went too"
        );
        assert!(
            dir.path().join(&theirs.records[0].name).exists(),
            "another run's stay"
        );
        // Every state is signed under its run's key and binds its own records.
        let newest = StepState::read_from(&run.step_state_path(30))
            .unwrap()
            .unwrap();
        assert_eq!(newest.verify(dir.path(), run.key()), Ok(()));
        assert_eq!(newest.records.len(), 3);
        assert!(
            newest.records[0]
                .name
                .starts_with(&format!("ddp-model-{}", run_tag("run-a")))
        );
        assert_eq!(theirs.verify(dir.path(), None), Ok(()));
        assert!(
            theirs.verify(dir.path(), run.key()).is_err(),
            "not this job's"
        );
    }

    #[test]
    fn pruning_removes_an_abandoned_timeline_and_only_this_runs_own_files() {
        let dir = tempfile::tempdir().unwrap();
        let run = Checkpoints::new(dir.path(), &identity("run-a", None), Ledger::default());
        let write = |number: u64| {
            let checkpointers = run.step_checkpointers();
            let mark = run.ledger().mark();
            for checkpointer in &checkpointers {
                Checkpointer::<ModuleRecord>::save(checkpointer, number as usize, record())
                    .unwrap();
            }
            let files = run
                .written(
                    &checkpointers,
                    number as usize,
                    mark,
                    Duration::from_secs(5),
                )
                .unwrap();
            run.write_step_state(progress(number), files).unwrap()
        };
        for number in [10, 20] {
            write(number);
        }
        // A state of this run naming a file outside its names: pruning never removes it.
        let bystander = dir.path().join("precious.txt");
        std::fs::write(&bystander, b"not a checkpoint").unwrap();
        let mut crafted = StepState::read_from(&run.step_state_path(20))
            .unwrap()
            .unwrap();
        crafted.number = 6;
        crafted.records[0].name = "precious.txt".into();
        crafted.write_to(&run.step_state_path(6)).unwrap();
        // Resumed from 10, the run writes 11: 20 is another timeline's, 6 older than the one
        // before.
        write(11);
        let left: Vec<u64> = StepState::list(dir.path())
            .into_iter()
            .map(|s| s.unwrap().number)
            .collect();
        assert_eq!(left, vec![11, 10]);
        assert!(bystander.exists(), "only this run's own names are removed");
        assert!(!run.step_checkpointers()[0].path(20).exists());
    }

    #[test]
    fn records_not_all_written_in_time_are_an_error_naming_them() {
        let dir = tempfile::tempdir().unwrap();
        let run = Checkpoints::new(dir.path(), &identity("run-a", None), Ledger::default());
        let checkpointers = run.step_checkpointers();
        let mark = run.ledger().mark();
        Checkpointer::<ModuleRecord>::save(&checkpointers[0], 1, record()).unwrap();
        let err = run
            .written(&checkpointers, 1, mark, Duration::from_millis(20))
            .unwrap_err();
        assert!(err.to_string().contains("not all written"), "{err}");
    }

    #[test]
    fn an_epoch_state_outlives_neither_its_records_nor_burn_trains_deletion() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = Ledger::default();
        let run = Checkpoints::new(dir.path(), &identity("run-a", None), ledger.clone());
        let checkpointers = Checkpoints::epoch_checkpointers(dir.path(), &ledger);
        let mark = ledger.mark();
        for checkpointer in &checkpointers {
            Checkpointer::<ModuleRecord>::save(checkpointer, 1, record()).unwrap();
        }
        let files = run
            .written(&checkpointers, 1, mark, Duration::from_secs(5))
            .unwrap();
        assert_eq!(
            files.iter().map(|f| f.name.as_str()).collect::<Vec<_>>(),
            vec!["model-1.bpk", "optim-1.bpk", "scheduler-1.bpk"]
        );
        let state = run
            .write_epoch_state(
                Progress {
                    batches: 0,
                    ..progress(4)
                },
                files,
            )
            .unwrap();
        assert_eq!(state.verify(dir.path(), None), Ok(()));
        let mark = ledger.mark();
        for checkpointer in &checkpointers {
            Checkpointer::<ModuleRecord>::delete(checkpointer, 1).unwrap();
        }
        run.forget_deleted_epochs(mark).unwrap();
        assert!(!run.epoch_state_path(1).exists());
    }
}
