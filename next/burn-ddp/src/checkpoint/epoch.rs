//! Rank 0's checkpoint at the end of an epoch: burn-train's, through the `LearningCheckpointer`
//! it hands the strategy (its checkpointing strategy decides whether this epoch is saved and
//! which older ones go), then burn-ddp's state file, bound to the records written now.

use std::cell::Cell;
use std::panic::AssertUnwindSafe;
use std::sync::Once;
use std::time::Duration;

use burn::train::metric::store::EventStoreClient;
use burn::train::{Learner, LearnerModel, LearningCheckpointer};

use super::state::{EpochState, SignedState};
use super::{Checkpoints, Progress};
use crate::error::Result;

/// What the end of an epoch left in the checkpoint directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum EpochCheckpoint {
    /// burn-train saved the epoch through burn-ddp's checkpointers: the state names its records
    /// and their SHA-256.
    Bound(EpochState),
    /// burn-train's checkpointers are not burn-ddp's, and the epoch reads back (saved now, or an
    /// older file of the same name: they cannot be told apart): the state names no records.
    Unbound(EpochState),
    /// burn-train's checkpointing strategy did not save this epoch (burn-ddp's checkpointers
    /// wrote nothing, whatever older file of its name is there), or nothing of it reads back: no
    /// state is written, and an earlier attempt's state of this run for the epoch is removed, so
    /// no older record is taken for this attempt's epoch.
    NotSaved,
}

/// Checkpoints the end of epoch `progress.epoch` (see the [module docs](self)): burn-train's
/// checkpointer writes (and deletes) as its strategy says, on background threads; reading the
/// epoch back waits for them, since a read is queued behind the writes. Then the ledger says
/// which records burn-ddp's checkpointers wrote now, the states of epochs whose records were
/// deleted are removed, and the epoch's state is written (signed when the job has a key). On an
/// asynchronous backend the learner's last step must have run on the device first.
///
/// # Errors
/// [`DdpError::Checkpoint`](crate::DdpError::Checkpoint) naming the record file burn-ddp's
/// checkpointer could not write, or a state file that could not be written or removed.
pub(crate) fn write_epoch_checkpoint<M: LearnerModel>(
    checkpoints: &Checkpoints,
    checkpointer: &mut LearningCheckpointer<M>,
    learner: &Learner<M>,
    progress: Progress,
    store: &EventStoreClient,
) -> Result<EpochCheckpoint> {
    let epoch = progress.epoch;
    let since = checkpoints.ledger().mark();
    checkpointer.checkpoint(learner, epoch, store);
    // The learner read back is dropped at once (a second copy of the model and optimizer
    // state on the device otherwise).
    let read_back = quietly(|| drop(checkpointer.load_checkpoint(learner.clone(), epoch)));
    checkpoints.forget_deleted_epochs(since)?;
    let keys = checkpoints.epoch_keys();
    let keys = keys.each_ref().map(String::as_str);
    let written = checkpoints
        .ledger()
        .wait_for(&keys, epoch, since, Duration::ZERO);
    let records = match written {
        Ok(Some(records)) => Some(records),
        Ok(None) => None,
        Err(why) => {
            return Err(crate::DdpError::Checkpoint {
                path: checkpoints
                    .dir()
                    .join(format!("model-{epoch}.bpk"))
                    .display()
                    .to_string(),
                detail: format!(
                    "burn-train could not write the checkpoint of epoch {epoch}: {why}"
                ),
            });
        }
    };
    // burn-ddp's checkpointers note the read-back: then what they did not write now was not
    // saved now.
    let ours = checkpoints.ledger().was_read(keys[0], epoch, since);
    match (records, read_back) {
        (Some(records), _) => Ok(EpochCheckpoint::Bound(
            checkpoints.write_epoch_state(progress, records)?,
        )),
        (None, Ok(_)) if !ours => Ok(EpochCheckpoint::Unbound(
            checkpoints.write_epoch_state(progress, Vec::new())?,
        )),
        (None, read_back) => {
            if let Err(why) = read_back {
                tracing::debug!(
                    "burn-ddp: no checkpoint of epoch {epoch} (burn-train's checkpointing \
                     strategy did not save it): {why}"
                );
            }
            forget_own_state(checkpoints, epoch)?;
            Ok(EpochCheckpoint::NotSaved)
        }
    }
}

/// Removes this run's state of `epoch` when there is one (an earlier attempt's: its records,
/// still matching their hashes, are not this attempt's epoch); another run's stays.
///
/// # Errors
/// [`DdpError::Checkpoint`](crate::DdpError::Checkpoint) naming a state that exists but cannot
/// be removed.
fn forget_own_state(checkpoints: &Checkpoints, epoch: usize) -> Result<()> {
    let path = checkpoints.epoch_state_path(epoch);
    let ours = matches!(
        EpochState::read_from(&path),
        Ok(Some(state)) if state.run_id == checkpoints.run_id()
    );
    if ours {
        super::file::remove_checkpoint_file(
            &path,
            &format!("an earlier attempt's state of epoch {epoch}"),
        )?;
    }
    Ok(())
}

thread_local! {
    static QUIET: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f`, turning a panic into `Err(message)` without printing it: burn-train's checkpoint
/// loading panics on a file it cannot read, which here is an answer, not a crash. Other threads'
/// panics are printed as before (the panic hook is wrapped once per process). It needs unwinding:
/// built with `panic = "abort"`, such a panic ends the process (an epoch burn-train did not save,
/// a resume of an epoch written by burn-train's own checkpointers).
pub(crate) fn quietly<T>(f: impl FnOnce() -> T) -> std::result::Result<T, String> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DdpConfig;
    use crate::checkpoint::SignedState;
    use crate::fixtures::{Regressor, inside_burn_train_with, train_step};
    use burn::optim::AdamConfig;
    use burn::train::SupervisedTraining;
    use burn::train::checkpoint::{
        CheckpointingAction, CheckpointingStrategy, KeepLastNCheckpoints,
    };
    use burn_ddp_comm::auth::JobIdentity;

    fn progress(epoch: usize) -> Progress {
        Progress {
            epoch,
            batches: 0,
            world_size: 1,
            optimizer_steps: epoch as u64,
            synchronisations: epoch as u64,
        }
    }

    /// Epochs 1 to `epochs` of a learner under burn-train configured by `configure`, each
    /// checkpointed as rank 0 does: what each epoch's checkpoint left.
    fn epochs(
        dir: &std::path::Path,
        checkpoints: &Checkpoints,
        epochs: usize,
        configure: impl FnOnce(SupervisedTraining<Regressor>) -> SupervisedTraining<Regressor>,
    ) -> Vec<EpochCheckpoint> {
        let device = crate::replica::tests::test_device();
        let learner = Learner::new(Regressor::new(&device), AdamConfig::new().init(), 1e-2);
        let (sender, receiver) = std::sync::mpsc::channel();
        let checkpoints = checkpoints.clone();
        inside_burn_train_with(dir, learner, configure, move |learner, components| {
            let mut checkpointer = components.checkpointer.take().expect("a checkpointer");
            let left: Vec<EpochCheckpoint> = (1..=epochs)
                .map(|epoch| {
                    train_step(learner, epoch, &device);
                    write_epoch_checkpoint(
                        &checkpoints,
                        &mut checkpointer,
                        learner,
                        progress(epoch),
                        &components.event_store,
                    )
                    .unwrap()
                })
                .collect();
            sender.send(left).unwrap();
        });
        receiver.recv_timeout(Duration::from_secs(60)).unwrap()
    }

    fn run(dir: &std::path::Path, config: &DdpConfig) -> Checkpoints {
        let identity = JobIdentity::new("run-a", Some(b"token")).unwrap();
        Checkpoints::new(dir, &identity, config.ledger().clone())
    }

    #[test]
    fn an_epoch_saved_through_burn_ddps_checkpointers_binds_its_records_and_forgets_deleted_ones() {
        let dir = tempfile::tempdir().unwrap();
        let config = DdpConfig::default().with_checkpoint_dir(dir.path().join("checkpoint"));
        let checkpoints = run(&dir.path().join("checkpoint"), &config);
        let [model, optim, scheduler] = config.checkpointers().unwrap();
        let left = epochs(dir.path(), &checkpoints, 2, |training| {
            training
                .with_custom_checkpointers(model, optim, scheduler)
                .with_checkpointing_strategy(KeepLastNCheckpoints::new(1))
        });
        let EpochCheckpoint::Bound(state) = &left[1] else {
            panic!("epoch 2 is bound: {left:?}");
        };
        assert_eq!(
            state
                .records
                .iter()
                .map(|r| r.name.as_str())
                .collect::<Vec<_>>(),
            vec!["model-2.bpk", "optim-2.bpk", "scheduler-2.bpk"]
        );
        assert_eq!(state.verify(checkpoints.dir(), checkpoints.key()), Ok(()));
        // burn-train kept the last one: epoch 1's records went, and its state with them.
        assert!(!checkpoints.dir().join("model-1.bpk").exists());
        assert!(!checkpoints.epoch_state_path(1).exists());
        let read = EpochState::read_from(&checkpoints.epoch_state_path(2)).unwrap();
        assert_eq!(read.as_ref(), Some(state));
    }

    /// Never saves.
    struct Never;

    impl CheckpointingStrategy for Never {
        fn checkpointing(&mut self, _: usize, _: &EventStoreClient) -> Vec<CheckpointingAction> {
            Vec::new()
        }
    }

    #[test]
    fn an_epoch_burn_train_does_not_save_writes_no_state_even_over_an_older_file() {
        let dir = tempfile::tempdir().unwrap();
        let config = DdpConfig::default().with_checkpoint_dir(dir.path().join("checkpoint"));
        let checkpoints = run(&dir.path().join("checkpoint"), &config);
        // An earlier attempt's epoch 1 is there.
        let [model, optim, scheduler] = config.checkpointers().unwrap();
        let earlier = epochs(dir.path(), &checkpoints, 1, |training| {
            training.with_custom_checkpointers(model, optim, scheduler)
        });
        assert!(
            matches!(earlier[0], EpochCheckpoint::Bound(_)),
            "{earlier:?}"
        );
        assert!(checkpoints.epoch_state_path(1).exists());
        let [model, optim, scheduler] = config.checkpointers().unwrap();
        let left = epochs(dir.path(), &checkpoints, 1, |training| {
            training
                .with_custom_checkpointers(model, optim, scheduler)
                .with_checkpointing_strategy(Never)
        });
        // The earlier model-1.bpk is there and reads back, and so was the earlier attempt's
        // state, but burn-ddp's checkpointers wrote nothing now: no state claims it for this
        // epoch any more.
        assert!(checkpoints.dir().join("model-1.bpk").exists());
        assert_eq!(left, vec![EpochCheckpoint::NotSaved]);
        assert!(!checkpoints.epoch_state_path(1).exists());
        // With no file at all, the same.
        let empty = tempfile::tempdir().unwrap();
        let config = DdpConfig::default().with_checkpoint_dir(empty.path().join("checkpoint"));
        let checkpoints = run(&empty.path().join("checkpoint"), &config);
        let [model, optim, scheduler] = config.checkpointers().unwrap();
        let left = epochs(empty.path(), &checkpoints, 1, |training| {
            training
                .with_custom_checkpointers(model, optim, scheduler)
                .with_checkpointing_strategy(Never)
        });
        assert_eq!(left, vec![EpochCheckpoint::NotSaved]);
        assert!(!checkpoints.epoch_state_path(1).exists());
    }

    #[test]
    fn burn_trains_own_checkpointers_leave_an_unbound_state() {
        let dir = tempfile::tempdir().unwrap();
        let config = DdpConfig::default().with_checkpoint_dir(dir.path().join("checkpoint"));
        let checkpoints = run(&dir.path().join("checkpoint"), &config);
        let left = epochs(dir.path(), &checkpoints, 1, |training| {
            training.with_default_checkpointers()
        });
        let EpochCheckpoint::Unbound(state) = &left[0] else {
            panic!("burn-train's FileCheckpointer is not burn-ddp's: {left:?}");
        };
        assert!(state.records.is_empty());
        assert!(checkpoints.dir().join("model-1.bpk").exists());
    }

    #[test]
    fn quietly_turns_a_panic_into_its_message() {
        assert_eq!(quietly(|| 3), Ok(3));
        let why = quietly(|| -> u8 { panic!("cannot load") }).unwrap_err();
        assert!(why.contains("cannot load"), "{why}");
    }
}
