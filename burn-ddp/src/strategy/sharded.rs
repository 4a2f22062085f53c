//! A rank's optimizer under [`DdpConfig::with_optimizer_sharding`](crate::DdpConfig::with_optimizer_sharding):
//! the step of its own parameters and the all-gather of every rank's, its share of a resumed
//! optimizer state, and the whole state on rank 0 for a checkpoint (see [`crate::sharding`]).
//!
//! burn-train's `Learner` keeps its optimizer private: only a `LearningCheckpointer` reads its
//! record. [`RecordReader`] is one whose checkpointers write to memory.

use std::sync::Arc;
use std::sync::mpsc::{self, Receiver, Sender};
use std::time::Duration;

use burn::optim::GradientsParams;
use burn::record::Record;
use burn::tensor::Device;
use burn::tensor::backend::Backend;
use burn::train::checkpoint::{
    AsyncCheckpointer, Checkpointer, CheckpointerError, CheckpointingAction, CheckpointingStrategy,
};
use burn::train::metric::store::EventStoreClient;
use burn::train::{
    Learner, LearnerOptimizerRecord, LearningCheckpointer, LearningComponentsTypes, TrainingBackend,
};

use crate::error::{DdpError, Result};
use crate::sharding::OptimizerShards;
use crate::sharding::state::{
    Keys, checked_record, gather_record, optimizer_state_bytes, own_record,
};
use burn_ddp_comm::group::ProcessGroup;

/// A checkpointer that hands each record it is given to a channel (or drops it).
struct ToMemory<R> {
    sender: std::sync::Mutex<Option<Sender<R>>>,
}

impl<R: Record<B> + 'static, B: Backend> Checkpointer<R, B> for ToMemory<R> {
    fn save(&self, _epoch: usize, record: R) -> std::result::Result<(), CheckpointerError> {
        if let Some(sender) = &*crate::strategy::lock(&self.sender) {
            // The reader may be gone (the trainer ended): nothing to keep then.
            let _ = sender.send(record);
        }
        Ok(())
    }

    fn delete(&self, _epoch: usize) -> std::result::Result<(), CheckpointerError> {
        Ok(())
    }

    fn restore(
        &self,
        _epoch: usize,
        _device: &B::Device,
    ) -> std::result::Result<R, CheckpointerError> {
        Err(CheckpointerError::Unknown(
            "burn-ddp's in-memory record reader restores nothing".into(),
        ))
    }
}

fn to_memory<R>(sender: Option<Sender<R>>) -> ToMemory<R> {
    ToMemory {
        sender: std::sync::Mutex::new(sender),
    }
}

/// Saves whenever asked.
struct Always;

impl CheckpointingStrategy for Always {
    fn checkpointing(&mut self, _: usize, _: &EventStoreClient) -> Vec<CheckpointingAction> {
        vec![CheckpointingAction::Save]
    }
}

/// Reads a `Learner`'s optimizer record (its checkpointer threads start at the first read).
pub(super) struct RecordReader<LC: LearningComponentsTypes> {
    checkpointer: Option<(
        LearningCheckpointer<LC>,
        Receiver<LearnerOptimizerRecord<LC>>,
    )>,
    /// burn-train's store (its checkpointing strategies take one; [`Always`] ignores it).
    store: Arc<EventStoreClient>,
}

impl<LC: LearningComponentsTypes> RecordReader<LC> {
    /// A reader; `store` is burn-train's event store (every rank's process has one).
    pub fn new(store: Arc<EventStoreClient>) -> Self {
        Self {
            checkpointer: None,
            store,
        }
    }

    /// `learner`'s optimizer record now.
    ///
    /// # Errors
    /// [`DdpError::Checkpoint`] when burn-train's checkpointer does not hand it over within
    /// `timeout`.
    pub fn read(
        &mut self,
        learner: &Learner<LC>,
        timeout: Duration,
    ) -> Result<LearnerOptimizerRecord<LC>> {
        let (checkpointer, records) = self.checkpointer.get_or_insert_with(|| {
            let (sender, records) = mpsc::channel();
            let checkpointer = LearningCheckpointer::new(
                AsyncCheckpointer::new(to_memory(None)),
                AsyncCheckpointer::new(to_memory(Some(sender))),
                AsyncCheckpointer::new(to_memory(None)),
                Box::new(Always),
            );
            (checkpointer, records)
        });
        checkpointer.checkpoint(learner, 0, &self.store);
        records
            .recv_timeout(timeout)
            .map_err(|e| DdpError::Checkpoint {
                path: String::new(),
                detail: format!(
                    "cannot read the optimizer's record from burn-train's learner: {e}"
                ),
            })
    }

    /// Bytes of `learner`'s optimizer state ([`RankReport::optimizer_state`]); `None` when the
    /// record cannot be read or is not kept per parameter. Copies the state to host memory.
    ///
    /// [`RankReport::optimizer_state`]: crate::metrics::RankReport::optimizer_state
    pub fn state_bytes(&mut self, learner: &Learner<LC>, timeout: Duration) -> Option<u64> {
        let record = self.read(learner, timeout).ok()?;
        optimizer_state_bytes::<TrainingBackend<LC>, _>(record).ok()
    }
}

/// A rank's sharded optimizer.
pub(super) struct Sharded {
    /// Who owns what (set by [`start`](Self::start), from the replica's layout).
    shards: Option<OptimizerShards>,
    /// Whether burn-train writes epoch checkpoints (they need the whole optimizer state).
    pub epoch_checkpoints: bool,
    /// A `ShardedOptimizer` stepped in this run.
    stepped: bool,
}

impl Sharded {
    /// A sharded optimizer, started by [`start`](Self::start).
    pub fn new(epoch_checkpoints: bool) -> Self {
        Self {
            shards: None,
            epoch_checkpoints,
            stepped: false,
        }
    }

    /// Starts with `shards`; after a resume (`resumed`), keeps only this rank's share of the
    /// whole optimizer state the checkpoint loaded.
    ///
    /// # Errors
    /// [`DdpError::InvalidConfig`] when the optimizer's record is not kept per parameter.
    pub fn start<LC: LearningComponentsTypes>(
        &mut self,
        shards: OptimizerShards,
        resumed: bool,
        reader: &mut RecordReader<LC>,
        learner: &mut Learner<LC>,
        device: &Device<TrainingBackend<LC>>,
        timeout: Duration,
    ) -> Result<()> {
        let optimizer = std::any::type_name::<LC::Optimizer>();
        let shards = self.shards.insert(shards);
        let record = reader.read(learner, timeout)?;
        let keys = Keys::of(&learner.model());
        // A record that is not kept per parameter (a wrapper's own fields around the map) could
        // not be split or joined: refused now, not at the first checkpoint.
        let record = checked_record(record, &keys, optimizer, device)?;
        if resumed {
            learner.load_optim(own_record(shards, &keys, record, device)?);
        }
        Ok(())
    }

    fn shards(&self) -> Result<&OptimizerShards> {
        self.shards.as_ref().ok_or_else(|| {
            DdpError::InvalidConfig("the sharded optimizer is used before its start".into())
        })
    }

    /// The optimizer step on the averaged `grads` (whole, so a model's `optimize` sees every
    /// gradient, unless [`DdpConfig::with_gradient_sharding`](crate::DdpConfig::with_gradient_sharding)
    /// left this rank its own only), in which the learner's [`ShardedOptimizer`](crate::ShardedOptimizer) steps
    /// this rank's parameters and all-gathers every rank's.
    ///
    /// # Errors
    /// The all-gather's; [`DdpError::InvalidConfig`] when the learner's first optimizer step ran
    /// no `ShardedOptimizer` (every parameter was stepped on every rank: nothing was sharded).
    pub fn step<LC: LearningComponentsTypes>(
        &mut self,
        learner: &mut Learner<LC>,
        grads: GradientsParams,
        group: &Arc<dyn ProcessGroup>,
        timeout: Duration,
    ) -> Result<()> {
        let shards = self.shards()?.clone();
        let ran =
            crate::sharding::optimizer::sharded_step(&shards, group.clone(), timeout, || {
                learner.optimizer_step(grads)
            })?;
        if !ran && !self.stepped {
            let err =
                crate::sharding::optimizer::not_sharded(std::any::type_name::<LC::Optimizer>());
            group.abort(&err.to_string());
            return Err(err);
        }
        self.stepped = true;
        Ok(())
    }

    /// Before rank 0 writes a checkpoint: every rank's optimizer state joined into rank 0's
    /// learner. Returns rank 0's own record, to put back with [`put_back`](Self::put_back) once
    /// the checkpoint is written (`None` on the other ranks). Every rank must call it.
    ///
    /// # Errors
    /// As [`gather_record`].
    pub fn whole_on_rank_0<LC: LearningComponentsTypes>(
        &self,
        reader: &mut RecordReader<LC>,
        learner: &mut Learner<LC>,
        group: &dyn ProcessGroup,
        device: &Device<TrainingBackend<LC>>,
        timeout: Duration,
    ) -> Result<Option<LearnerOptimizerRecord<LC>>> {
        let own = reader.read(learner, timeout)?;
        // Records are not `Clone`: rank 0 reads its own a second time, to put back.
        let kept = match group.rank() {
            0 => Some(reader.read(learner, timeout)?),
            _ => None,
        };
        let keys = Keys::of(&learner.model());
        if let Some(whole) = gather_record(self.shards()?, &keys, own, group, timeout, device)? {
            learner.load_optim(whole);
        }
        Ok(kept)
    }

    /// Puts rank 0's own optimizer state back after a checkpoint.
    pub fn put_back<LC: LearningComponentsTypes>(
        learner: &mut Learner<LC>,
        own: Option<LearnerOptimizerRecord<LC>>,
    ) {
        if let Some(own) = own {
            learner.load_optim(own);
        }
    }
}
