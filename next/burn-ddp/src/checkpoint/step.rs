//! A Learner's records in and out of checkpoints: rank 0 writes a step checkpoint of its
//! `Learner` (burn-train alone reads the optimizer's record, through a `LearningCheckpointer`
//! whose checkpointers are burn-ddp's), and any rank loads a checkpoint's three records into its
//! `Learner`, each file checked against its state's SHA-256 as it is read.

use std::path::Path;
use std::time::Duration;

use burn::store::ModuleRecord;
use burn::tensor::Bytes;
use burn::train::checkpoint::{
    AsyncCheckpointer, Checkpoint, CheckpointingAction, CheckpointingStrategy,
};
use burn::train::metric::store::EventStoreClient;
use burn::train::{Interrupter, Learner, LearnerModel, LearningCheckpointer};
use burn_ddp_comm::auth::CheckpointKey;

use super::file::sha256_hex;
use super::records::{RecordCheckpointer, RecordFile};
use super::state::{SignedState, StepState};
use super::{Checkpoints, Progress};
use crate::error::Result;

/// Saves every checkpoint it is asked for (which step checkpoints stay is
/// [`Checkpoints::write_step_state`]'s).
struct SaveEach;

impl CheckpointingStrategy for SaveEach {
    fn checkpointing(&mut self, _: usize, _: &EventStoreClient) -> Vec<CheckpointingAction> {
        vec![CheckpointingAction::Save]
    }
}

/// Rank 0's writer of its run's step checkpoints.
pub(crate) struct StepCheckpointer<M: LearnerModel> {
    checkpoints: Checkpoints,
    records: [RecordCheckpointer; 3],
    learning: LearningCheckpointer<M>,
    /// Set when a save's records were not written in time: burn-train's checkpointer thread may
    /// still be busy, and a next save would wait for it unbounded.
    stuck: Option<String>,
}

impl<M: LearnerModel> StepCheckpointer<M> {
    /// The writer of `checkpoints`' step checkpoints.
    pub fn new(checkpoints: &Checkpoints) -> Self {
        let records = checkpoints.step_checkpointers();
        let [model, optim, scheduler] = records.clone();
        // burn-train's checkpointer thread panics on a failed write without an interrupter (and
        // then every later message to it): the ledger reports the failure, the interrupter only
        // keeps the thread alive.
        let quiet = Interrupter::new;
        Self {
            checkpoints: checkpoints.clone(),
            records,
            learning: LearningCheckpointer::new(
                AsyncCheckpointer::new(model).with_interrupter(quiet()),
                AsyncCheckpointer::new(optim).with_interrupter(quiet()),
                AsyncCheckpointer::new(scheduler).with_interrupter(quiet()),
                Box::new(SaveEach),
            ),
            stuck: None,
        }
    }

    /// Writes `learner` as the step checkpoint of `progress` (numbered by its synchronisations),
    /// waits up to `timeout` until its three records are on disk, then writes its state with their
    /// SHA-256 (signed when the job has a key) and removes this run's step checkpoints older than
    /// the one before. `store` is burn-train's event store (its checkpointer takes one). On an
    /// asynchronous backend the learner's last step must have run on the device first.
    ///
    /// # Errors
    /// [`DdpError::Checkpoint`](crate::DdpError::Checkpoint) naming the file that could not be
    /// written or removed, or the records not written within `timeout` (then every later save
    /// too: the writer may still be busy).
    pub fn save(
        &mut self,
        learner: &Learner<M>,
        progress: Progress,
        store: &EventStoreClient,
        timeout: Duration,
    ) -> Result<StepState> {
        let number = usize::try_from(progress.synchronisations).unwrap_or(usize::MAX);
        if let Some(why) = &self.stuck {
            return Err(crate::DdpError::Checkpoint {
                path: self.records[0].path(number).display().to_string(),
                detail: format!(
                    "no step checkpoint is written after an earlier one stalled: {why}"
                ),
            });
        }
        let since = self.checkpoints.ledger().mark();
        self.learning.checkpoint(learner, number, store);
        let written = self
            .checkpoints
            .wait_written(&self.records, number, since, timeout)?;
        let Some(files) = written else {
            let err = Checkpoints::not_written(&self.records, number, timeout);
            self.stuck = Some(err.to_string());
            return Err(err);
        };
        self.checkpoints.write_step_state(progress, files)
    }
}

/// The three records of a checkpoint, read and checked, not yet applied.
pub(crate) struct Records {
    model: ModuleRecord,
    optim: burn::optim::OptimizerRecord,
    scheduler: burn::optim::lr_scheduler::LrSchedulerRecord,
}

impl Records {
    /// Reads the records `state` names from `dir`, each checked against the state's SHA-256 as
    /// its bytes are read (a file swapped after a check is never loaded), after the state's
    /// format and (with `key`) signature.
    ///
    /// # Errors
    /// Why the checkpoint cannot be taken, as a message naming the file.
    pub fn read(
        dir: &Path,
        state: &impl SignedState,
        key: Option<&CheckpointKey>,
    ) -> std::result::Result<Records, String> {
        state.check_signature(key)?;
        let [model, optim, scheduler] = match state.records() {
            [model, optim, scheduler] => [model, optim, scheduler],
            other => {
                return Err(format!(
                    "its state names {} record files, not a model's, an optimizer's and an LR \
                     scheduler's",
                    other.len()
                ));
            }
        };
        Ok(Records {
            model: read_checked(dir, model)?,
            optim: read_checked(dir, optim)?,
            scheduler: read_checked(dir, scheduler)?,
        })
    }

    /// Loads the records into `learner`: its model, its optimizer's state and its LR scheduler.
    pub fn load_into<M: LearnerModel>(self, learner: &mut Learner<M>) {
        learner.load_model(self.model);
        learner.load_optim(self.optim);
        learner.load_scheduler(self.scheduler);
    }
}

/// Reads `record`'s file in `dir` once, checks its SHA-256 and parses it.
fn read_checked<R: Checkpoint>(dir: &Path, record: &RecordFile) -> std::result::Result<R, String> {
    let path = record.path_in(dir)?;
    let bytes = std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    record.check(&path, &sha256_hex(&bytes))?;
    R::checkpoint_from_bytes(Bytes::from_bytes_vec(bytes)).map_err(|e| {
        format!(
            "{}: not a burnpack record of this kind: {e}",
            path.display()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::{FORMAT, Ledger};
    use burn::module::Module;
    use burn::nn::LinearConfig;
    use burn::train::checkpoint::Checkpointer;
    use burn_ddp_comm::auth::JobIdentity;

    #[test]
    fn records_are_read_only_when_every_file_is_the_one_its_state_names() {
        let dir = tempfile::tempdir().unwrap();
        let identity = JobIdentity::new("run-a", Some(b"token")).unwrap();
        let checkpoints = Checkpoints::new(dir.path(), &identity, Ledger::default());
        let [model, _, _] = checkpoints.step_checkpointers();
        let layer = LinearConfig::new(2, 3).init(&Default::default());
        Checkpointer::<ModuleRecord>::save(&model, 4, layer.into_record()).unwrap();
        let model_file = RecordFile {
            name: model.file_name(4),
            sha256: crate::checkpoint::file::file_sha256(&model.path(4)).unwrap(),
        };
        let mut state = StepState {
            format: FORMAT,
            number: 4,
            epoch: 1,
            batches: 4,
            world_size: 2,
            optimizer_steps: 4,
            run_id: "run-a".into(),
            records: vec![model_file.clone()],
            mac: None,
        };
        state.sign(checkpoints.key().unwrap());
        // Not three records.
        let why = Records::read(dir.path(), &state, checkpoints.key())
            .err()
            .unwrap();
        assert!(why.contains("1 record files"), "{why}");
        // The optimizer's file is no burnpack record (its hash matches): an error naming it, not
        // a panic. (Burn reads a module's burnpack as an optimizer record: the kinds are not told
        // apart by their bytes, the state's names and hashes bind each file to its place.)
        let optim_name = "ddp-optim-not-a-record-4.bpk";
        std::fs::write(dir.path().join(optim_name), b"not burnpack").unwrap();
        let optim_file = RecordFile {
            name: optim_name.into(),
            sha256: sha256_hex(b"not burnpack"),
        };
        state.records = vec![model_file.clone(), optim_file, model_file];
        state.sign(checkpoints.key().unwrap());
        let why = Records::read(dir.path(), &state, checkpoints.key())
            .err()
            .unwrap();
        assert!(why.contains(optim_name), "{why}");
        // Another job's key, or a swapped file, is refused before anything is parsed.
        let other = JobIdentity::new("run-a", Some(b"other"))
            .unwrap()
            .checkpoint_key();
        assert!(Records::read(dir.path(), &state, other.as_ref()).is_err());
        std::fs::write(model.path(4), b"swapped").unwrap();
        let why = Records::read(dir.path(), &state, checkpoints.key())
            .err()
            .unwrap();
        assert!(why.contains("not the file it was written with"), "{why}");
    }

    #[test]
    fn a_step_checkpoint_of_a_learner_restores_its_model_optimizer_and_scheduler() {
        use crate::fixtures::{Regressor, inside_burn_train, train_step};
        use burn::optim::AdamConfig;

        let dir = tempfile::tempdir().unwrap();
        let identity = JobIdentity::new("run-a", Some(b"token")).unwrap();
        let checkpoints =
            Checkpoints::new(&dir.path().join("checkpoint"), &identity, Ledger::default());
        let device = crate::replica::tests::test_device();
        let learner = |device: &burn::tensor::Device| {
            Learner::new(Regressor::new(device), AdamConfig::new().init(), 1e-2)
        };
        let (sender, receiver) = std::sync::mpsc::channel();
        let (probe_device, probe_checkpoints) = (device.clone(), checkpoints.clone());
        inside_burn_train(dir.path(), learner(&device), move |trained, store| {
            let (device, checkpoints) = (probe_device, probe_checkpoints);
            for step in 0..2 {
                train_step(trained, step, &device);
            }
            let progress = Progress {
                epoch: 1,
                batches: 2,
                world_size: 1,
                optimizer_steps: 2,
                synchronisations: 2,
            };
            let state = StepCheckpointer::new(&checkpoints)
                .save(trained, progress, store, Duration::from_secs(60))
                .unwrap();
            let records = || Records::read(checkpoints.dir(), &state, checkpoints.key()).unwrap();
            // Resumed from the checkpoint: a new learner given its three records.
            let mut resumed = learner(&device);
            records().load_into(&mut resumed);
            // The control: the checkpoint's model alone, a new optimizer (Adam's moments at 0).
            let mut model_only = learner(&device);
            model_only.load_model(records().model);
            let at_checkpoint = trained.model().values();
            for learner in [&mut *trained, &mut resumed, &mut model_only] {
                train_step(learner, 2, &device);
            }
            sender
                .send((
                    at_checkpoint,
                    [&*trained, &resumed, &model_only].map(|l| l.model().values()),
                    state,
                ))
                .unwrap();
        });
        let (at_checkpoint, [trained, resumed, model_only], state) =
            receiver.recv_timeout(Duration::from_secs(60)).unwrap();
        assert_eq!(
            resumed, trained,
            "resumed, the next step is the uninterrupted one's"
        );
        assert_ne!(
            model_only, trained,
            "the optimizer's state is part of the checkpoint"
        );
        assert_ne!(at_checkpoint, trained);
        assert_eq!(state.records.len(), 3);
        assert_eq!(state.verify(checkpoints.dir(), checkpoints.key()), Ok(()));
        assert!(checkpoints.step_state_path(2).exists());
    }

    #[test]
    fn a_step_checkpoint_that_cannot_be_written_is_an_error_each_time_not_a_panic() {
        use crate::fixtures::{Regressor, inside_burn_train};
        use burn::optim::AdamConfig;

        let dir = tempfile::tempdir().unwrap();
        // A file where the checkpoint directory should be: every write fails.
        let blocked = dir.path().join("checkpoint");
        std::fs::write(&blocked, b"a file").unwrap();
        let identity = JobIdentity::new("run-a", None).unwrap();
        let checkpoints = Checkpoints::new(&blocked, &identity, Ledger::default());
        let device = crate::replica::tests::test_device();
        let learner = Learner::new(Regressor::new(&device), AdamConfig::new().init(), 1e-2);
        let (sender, receiver) = std::sync::mpsc::channel();
        inside_burn_train(dir.path(), learner, move |learner, store| {
            let mut writer = StepCheckpointer::new(&checkpoints);
            let errors: Vec<String> = (1..=2)
                .map(|number| {
                    let progress = Progress {
                        epoch: 1,
                        batches: number,
                        world_size: 1,
                        optimizer_steps: number as u64,
                        synchronisations: number as u64,
                    };
                    writer
                        .save(learner, progress, store, Duration::from_secs(30))
                        .unwrap_err()
                        .to_string()
                })
                .collect();
            // Dropping the writer ends burn-train's checkpointer threads, which must be alive.
            drop(writer);
            sender.send(errors).unwrap();
        });
        let errors = receiver.recv_timeout(Duration::from_secs(60)).unwrap();
        for error in &errors {
            assert!(error.contains("cannot write checkpoint"), "{error}");
        }
    }
}
