//! A rank's optimizer under [`DdpConfig::with_optimizer_sharding`](crate::DdpConfig::with_optimizer_sharding)
//! when burn-train's `Learner` holds it: the step of this rank's own parameters and the
//! all-gather of every rank's ([`sharded_step`](crate::sharding::sharded_step) around
//! `Learner::optimizer_step`), this rank's share of a resumed optimizer state, and the whole
//! state on rank 0 for a checkpoint (see [`crate::sharding`]).
//!
//! Burn 0.22's `Learner` keeps its optimizer private and has no way to set its model: only a
//! `LearningCheckpointer` reads the optimizer's record ([`RecordReader`] is one whose
//! checkpointers hand the record over in memory), and the gathered parameters of a step come
//! back through `Learner::load_model`, a copy through host memory of the whole model every
//! step (the custom loop, [`DistributedDataParallel`](crate::DistributedDataParallel), holds
//! its optimizer and copies nothing).

use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use burn::optim::{GradientsParams, OptimizerRecord};
use burn::train::checkpoint::{
    AsyncCheckpointer, Checkpoint, Checkpointer, CheckpointerError, CheckpointingAction,
    CheckpointingStrategy,
};
use burn::train::metric::store::EventStoreClient;
use burn::train::{Learner, LearnerModel, LearningCheckpointer};

use crate::error::{DdpError, Result};
use crate::sharding::OptimizerShards;
use crate::sharding::state::{Keys, gather_record, optimizer_state_bytes, own_record};
use burn_ddp_comm::group::ProcessGroup;

/// A checkpointer that hands each record it is given to a channel with its number (or drops
/// it).
struct ToMemory<R> {
    sender: Mutex<Option<Sender<(usize, R)>>>,
}

impl<R: Checkpoint> Checkpointer<R> for ToMemory<R> {
    fn save(&self, number: usize, record: R) -> std::result::Result<(), CheckpointerError> {
        let sender = self
            .sender
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(sender) = &*sender {
            // The reader may be gone (the trainer ended): nothing to keep then.
            let _ = sender.send((number, record));
        }
        Ok(())
    }

    fn delete(&self, _: usize) -> std::result::Result<(), CheckpointerError> {
        Ok(())
    }

    fn restore(&self, _: usize) -> std::result::Result<R, CheckpointerError> {
        Err(CheckpointerError::Unknown(
            "burn-ddp's in-memory record reader restores nothing".into(),
        ))
    }
}

fn to_memory<R>(sender: Option<Sender<(usize, R)>>) -> ToMemory<R> {
    ToMemory {
        sender: Mutex::new(sender),
    }
}

/// Saves whenever asked.
struct Always;

impl CheckpointingStrategy for Always {
    fn checkpointing(&mut self, _: usize, _: &EventStoreClient) -> Vec<CheckpointingAction> {
        vec![CheckpointingAction::Save]
    }
}

/// Optimizer records with the numbers of the reads they answer.
type Numbered = Receiver<(usize, OptimizerRecord)>;

/// Reads a `Learner`'s optimizer record (its checkpointer threads start at the first read).
pub(super) struct RecordReader<M: LearnerModel> {
    checkpointer: Option<(LearningCheckpointer<M>, Numbered)>,
    /// The number of the next read (a record that comes after its read timed out is told
    /// apart by its number).
    next: usize,
    /// burn-train's store (its checkpointing strategies take one; [`Always`] ignores it).
    store: Arc<EventStoreClient>,
}

impl<M: LearnerModel> RecordReader<M> {
    /// A reader; `store` is burn-train's event store (every rank's process has one).
    pub fn new(store: Arc<EventStoreClient>) -> Self {
        Self {
            checkpointer: None,
            next: 0,
            store,
        }
    }

    /// `learner`'s optimizer record now (burn-train's learner hands over the model's and the
    /// scheduler's too: a copy of the model through host memory, dropped).
    ///
    /// # Errors
    /// [`DdpError::Checkpoint`] when burn-train's checkpointer does not hand it over within
    /// `timeout`.
    pub fn read(&mut self, learner: &Learner<M>, timeout: Duration) -> Result<OptimizerRecord> {
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
        let number = self.next;
        self.next += 1;
        checkpointer.checkpoint(learner, number, &self.store);
        let deadline = std::time::Instant::now().checked_add(timeout);
        loop {
            let left = deadline.map_or(Duration::MAX, |d| {
                d.saturating_duration_since(std::time::Instant::now())
            });
            match records.recv_timeout(left) {
                Ok((n, record)) if n == number => return Ok(record),
                // A record of an earlier read that timed out: not this one.
                Ok(_) => {}
                Err(e) => {
                    return Err(DdpError::Checkpoint {
                        path: "<the learner's optimizer record, in memory>".into(),
                        detail: format!(
                            "cannot read the optimizer's record from burn-train's learner \
                             within {timeout:?}: {e}"
                        ),
                    });
                }
            }
        }
    }

    /// Bytes of `learner`'s optimizer state ([`RankReport::optimizer_state`]); `None` when the
    /// record cannot be read. Copies the state to host memory.
    ///
    /// [`RankReport::optimizer_state`]: crate::metrics::RankReport::optimizer_state
    pub fn state_bytes(&mut self, learner: &Learner<M>, timeout: Duration) -> Option<u64> {
        let record = self.read(learner, timeout).ok()?;
        optimizer_state_bytes(record).ok()
    }
}

/// A rank's sharded optimizer in a `Learner`.
pub(super) struct Sharded {
    shards: OptimizerShards,
    /// The model's `optimize` is still to be watched (the first step): under sharding it must
    /// change no tensor but this rank's stepped ones.
    watch_optimize: std::sync::atomic::AtomicBool,
}

impl Sharded {
    /// This rank's optimizer under `shards`; after a resume (`resumed`), it keeps only this
    /// rank's share of the whole optimizer state the checkpoint loaded into `learner`.
    ///
    /// # Errors
    /// [`DdpError::Checkpoint`] when the learner's optimizer record cannot be read or split.
    pub fn start<M: LearnerModel>(
        shards: OptimizerShards,
        resumed: bool,
        reader: &mut RecordReader<M>,
        learner: &mut Learner<M>,
        timeout: Duration,
    ) -> Result<Self> {
        if resumed {
            let record = reader.read(learner, timeout)?;
            let keys = Keys::of(&learner.model());
            learner.load_optim(own_record(&shards, &keys, record)?);
        }
        Ok(Self {
            shards,
            watch_optimize: std::sync::atomic::AtomicBool::new(true),
        })
    }

    /// Who owns what.
    pub fn shards(&self) -> &OptimizerShards {
        &self.shards
    }

    /// The optimizer step on the averaged `grads`: the learner's optimizer steps this rank's own
    /// parameters (burn-train's `Learner::optimizer_step`, so a model's own `optimize` runs),
    /// every rank's stepped parameters are all-gathered, and the learner's model becomes the
    /// whole, bit-identical model (through `Learner::load_model`). Every rank must call it once
    /// per synchronisation.
    ///
    /// At the first step the tensors the model's `optimize` may change are watched: those some
    /// rank steps (the others' are overwritten by their owners' values) and the buffers. `optimize` runs here before the other ranks' parameters arrive
    /// (Burn 0.22's optimizer is one concrete type, which burn-ddp cannot step inside), so a
    /// value it computes from the updated model (an EMA teacher) would differ between the ranks.
    ///
    /// # Errors
    /// The all-gathers' (the process group is then aborted, the learner's model is this rank's
    /// step alone); [`DdpError::InvalidConfig`] naming the tensor when the model's `optimize`
    /// changed one no rank steps (every rank runs the same `optimize` on the same tensors, so
    /// every rank refuses at the same step).
    pub fn step<M: LearnerModel>(
        &self,
        learner: &mut Learner<M>,
        grads: GradientsParams,
        group: &dyn ProcessGroup,
        timeout: Duration,
    ) -> Result<()> {
        use std::sync::atomic::Ordering;
        let watch = self.watch_optimize.swap(false, Ordering::Relaxed);
        let mut changed = None;
        let whole = crate::sharding::sharded_step(
            &self.shards,
            learner.model(),
            grads,
            group,
            timeout,
            |_, own, stepped| {
                let before = watch.then(|| crate::replica::tensor_fingerprints(&learner.model()));
                learner.optimizer_step(own);
                let model = learner.model();
                if let Some(before) = before {
                    // A tensor no rank steps (a frozen weight) changed: the gather below leaves
                    // each rank's own value. (One another rank steps is overwritten by its
                    // owner's; a buffer is the forward pass's.) Every rank agreed on `stepped`.
                    let owners = self.shards.owners();
                    let after = crate::replica::tensor_fingerprints(&model);
                    changed = (0..after.len())
                        .find(|&i| {
                            owners.get(i).is_some_and(Option::is_some)
                                && !stepped.get(i).copied().unwrap_or(true)
                                && before.get(i) != after.get(i)
                        })
                        .map(|i| {
                            crate::replica::ReplicaLayout::scan(&model)
                                .tensors()
                                .get(i)
                                .map_or_else(|| format!("tensor #{i}"), |t| t.path.clone())
                        });
                }
                model
            },
        )?;
        learner.load_model(whole.into_record());
        match changed {
            None => Ok(()),
            Some(path) => Err(DdpError::InvalidConfig(format!(
                "rank {}: the model's `optimize` changed `{path}`, a tensor no rank steps, at \
                 the first optimizer step: under DdpConfig::with_optimizer_sharding \
                 burn-train 0.22's Learner runs `optimize` on this rank's share of the \
                 gradients, before the other ranks' updated parameters arrive, so what it \
                 computes from the updated model (an EMA teacher, say) would differ between the \
                 ranks; turn sharding off for this model, or step it in a training loop of your \
                 own (DistributedDataParallel::optimizer_step returns the whole model)",
                group.rank()
            ))),
        }
    }

    /// Before rank 0 writes a checkpoint: every rank's optimizer state joined into rank 0's
    /// learner. Returns rank 0's own record, to put back with [`put_back`](Self::put_back) once
    /// the checkpoint is written (`None` on the other ranks). Every rank must call it.
    ///
    /// # Errors
    /// As [`gather_record`]; a record that cannot be read.
    pub fn whole_on_rank_0<M: LearnerModel>(
        &self,
        reader: &mut RecordReader<M>,
        learner: &mut Learner<M>,
        group: &dyn ProcessGroup,
        timeout: Duration,
    ) -> Result<Option<OptimizerRecord>> {
        let own = reader.read(learner, timeout)?;
        // Records are not `Clone`: rank 0 reads its own a second time, to put back.
        let kept = match group.rank() {
            0 => Some(reader.read(learner, timeout)?),
            _ => None,
        };
        let keys = Keys::of(&learner.model());
        if let Some(whole) = gather_record(&self.shards, &keys, own, group, timeout)? {
            learner.load_optim(whole);
        }
        Ok(kept)
    }

    /// Puts rank 0's own optimizer state back after a checkpoint.
    pub fn put_back<M: LearnerModel>(learner: &mut Learner<M>, own: Option<OptimizerRecord>) {
        if let Some(own) = own {
            learner.load_optim(own);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::{Regressor, batch, inside_burn_train_with};
    use crate::replica::ReplicaLayout;
    use burn::module::Module;
    use burn::optim::AdamConfig;
    use burn_ddp_comm::group::ThreadGroup;

    const WORLD: usize = 2;

    /// A rank's model after its sharded steps, rank 0's model after one more step with the
    /// whole state, and the bytes of its optimizer state: its own, with the whole state joined,
    /// put back.
    type RankEnd = (Vec<f32>, Vec<f32>, [u64; 3]);
    const TIMEOUT: Duration = Duration::from_secs(60);

    fn learner(model: &Regressor) -> Learner<Regressor> {
        Learner::new(model.clone(), AdamConfig::new().init(), 1e-2)
    }

    /// Plain burn-train: `steps` optimizer steps of one learner on the whole batches.
    fn plain(learner: &mut Learner<Regressor>, steps: std::ops::Range<usize>) {
        let device = learner.model().devices()[0].clone();
        for step in steps {
            learner.lr_step();
            let output = learner.train_step(batch(step, 4, &device));
            learner.optimizer_step(output.grads);
        }
    }

    #[test]
    fn sharded_learners_step_as_one_learner_and_join_its_optimizer_state_on_rank_0() {
        let dir = tempfile::tempdir().unwrap();
        let device = crate::replica::tests::test_device();
        let model = Regressor::new(&device);
        // Burn initialises a parameter lazily, per clone: make its values before cloning.
        let _ = model.values();
        let (sender, receiver) = mpsc::channel();
        let start = model.clone();
        inside_burn_train_with(
            dir.path(),
            learner(&model),
            |t| t,
            move |_, components| {
                let store = components.event_store.clone();
                let layout = ReplicaLayout::of(&start);
                let groups = ThreadGroup::new_group(WORLD).unwrap();
                let ranks: Vec<_> = std::thread::scope(|s| {
                    let handles: Vec<_> = groups
                        .into_iter()
                        .enumerate()
                        .map(|(rank, group)| {
                            let (store, layout, start) = (store.clone(), &layout, &start);
                            s.spawn(move || {
                                let mut reader = RecordReader::new(store);
                                let mut learner = learner(start);
                                let shards = OptimizerShards::new(layout, rank, WORLD);
                                let sharded = Sharded::start(
                                    shards,
                                    false,
                                    &mut reader,
                                    &mut learner,
                                    TIMEOUT,
                                )
                                .unwrap();
                                let device = learner.model().devices()[0].clone();
                                // Every rank steps on the whole batch's gradients (what the
                                // reducer's average would give): the step alone is tested here.
                                for step in 0..3 {
                                    learner.lr_step();
                                    let output = learner.train_step(batch(step, 4, &device));
                                    sharded
                                        .step(&mut learner, output.grads, &group, TIMEOUT)
                                        .unwrap();
                                }
                                let own_bytes = reader.state_bytes(&learner, TIMEOUT).unwrap();
                                let own = sharded
                                    .whole_on_rank_0(&mut reader, &mut learner, &group, TIMEOUT)
                                    .unwrap();
                                let whole_bytes = reader.state_bytes(&learner, TIMEOUT).unwrap();
                                // Rank 0's learner holds the whole state now: one more step as
                                // plain burn-train takes it.
                                let mut with_whole = learner.clone();
                                plain(&mut with_whole, 3..4);
                                Sharded::put_back(&mut learner, own);
                                let put_back = reader.state_bytes(&learner, TIMEOUT).unwrap();
                                (
                                    learner.model().values(),
                                    with_whole.model().values(),
                                    [own_bytes, whole_bytes, put_back],
                                )
                            })
                        })
                        .collect();
                    handles.into_iter().map(|h| h.join().unwrap()).collect()
                });
                // Plain burn-train: one learner on the whole batches.
                let mut reference = learner(&start);
                plain(&mut reference, 0..3);
                let at_3 = reference.model().values();
                let plain_bytes = RecordReader::new(store)
                    .state_bytes(&reference, TIMEOUT)
                    .unwrap();
                plain(&mut reference, 3..4);
                sender
                    .send((ranks, at_3, plain_bytes, reference.model().values()))
                    .unwrap();
            },
        );
        let (ranks, at_3, plain_bytes, at_4): (Vec<RankEnd>, _, _, _) =
            receiver.recv_timeout(TIMEOUT).unwrap();
        for (rank, (values, _, _)) in ranks.iter().enumerate() {
            assert_eq!(values, &at_3, "rank {rank} after 3 sharded steps");
        }
        let (_, rank0_next, [own, whole, put_back]) = &ranks[0];
        assert_eq!(rank0_next, &at_4, "rank 0 held the whole state");
        assert_eq!(*whole, plain_bytes);
        assert!(
            *own < plain_bytes,
            "rank 0 kept its share only: {own} of {plain_bytes}"
        );
        assert_eq!(put_back, own);
        let (_, _, [own_1, whole_1, _]) = &ranks[1];
        assert_eq!(own + own_1, plain_bytes, "the shares make the whole");
        assert_eq!(whole_1, own_1, "the other ranks keep their share");
    }
}
