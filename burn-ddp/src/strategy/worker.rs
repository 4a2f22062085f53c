//! The ranks of a [`DdpStrategy`](super::DdpStrategy) run: who each one is (its role), its
//! thread and lifecycle (set-up, start-up checks, training, failure), and how the strategy
//! collects their results, naming the root cause when several fail.

use std::panic::AssertUnwindSafe;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use burn::module::Module;
use burn::tensor::Device;
use burn::train::metric::store::EventStoreClient;
use burn::train::{
    CloneEarlyStoppingStrategy, Interrupter, Learner, LearningCheckpointer,
    LearningComponentsTypes, SupervisedTrainingEventProcessor, TrainLoader, TrainStep,
    TrainingBackend, TrainingModel, ValidLoader,
};

use super::report::{Part, Reports, ValidOutput};
use super::resume::{Resume, StepCheckpoints};
use super::startup::Startup;
use super::validation::ValidShard;
use crate::ddp::DistributedDataParallel;
use crate::group::ProcessGroup;
use crate::group::counting::CountingGroup;
use crate::metrics::{RankReport, TrainingReport};
use crate::{DdpConfig, DdpError, Result};
use std::sync::atomic::AtomicU64;

pub(super) type ModelOutput<LC> = <TrainingModel<LC> as TrainStep>::Output;

/// What rank 0 holds besides its replica: burn-train's components and the other ranks' items.
pub(super) struct Leader<LC: LearningComponentsTypes> {
    pub event_processor: SupervisedTrainingEventProcessor<LC>,
    pub dataloader_valid: ValidLoader<LC>,
    pub checkpointer: Option<LearningCheckpointer<LC>>,
    /// burn-ddp's step checkpoints (with a checkpoint directory).
    pub step_checkpoints: Option<StepCheckpoints<LC>>,
    pub early_stopping: Option<Box<dyn CloneEarlyStoppingStrategy>>,
    pub event_store: Arc<EventStoreClient>,
    /// The outputs of the ranks that are threads of this process.
    pub items: Receiver<Part<LC>>,
}

impl<LC: LearningComponentsTypes> Leader<LC> {
    /// Returns once burn-train's event processor has handled every event sent to it so far (so
    /// the event store holds the epoch's metrics that early stopping and the checkpointing
    /// strategy ask for). The processor runs on its own thread behind a channel of capacity one,
    /// and handles a validation `Start` as a no-op: once the second of two `Start`s is accepted,
    /// the first was taken, so every event before it was handled. Bounded as any event burn-train
    /// sends itself: by the time the renderer and metric loggers take for the events before.
    pub fn wait_for_events(&mut self) {
        use burn::train::{EventProcessorTraining, LearnerEvent};
        self.event_processor.process_valid(LearnerEvent::Start);
        self.event_processor.process_valid(LearnerEvent::Start);
    }
}

/// Where a rank's training items go.
pub(super) enum Role<LC: LearningComponentsTypes> {
    /// Global rank 0.
    Leader(Box<Leader<LC>>),
    /// Another rank in the same process: its items go to rank 0.
    Follower(Sender<Part<LC>>),
    /// Another rank in its own process: emits nothing, but hands this process's event processor
    /// back to burn-train.
    Silent(Box<SupervisedTrainingEventProcessor<LC>>),
}

/// Everything one rank needs, moved into its thread.
pub(super) struct Worker<LC: LearningComponentsTypes> {
    pub rank: usize,
    pub group: Arc<dyn ProcessGroup>,
    pub device: Device<TrainingBackend<LC>>,
    pub learner: Learner<LC>,
    pub dataloader: TrainLoader<LC>,
    pub role: Role<LC>,
    pub config: DdpConfig,
    pub interrupter: Interrupter,
    pub grad_accumulation: usize,
    pub epochs: std::ops::RangeInclusive<usize>,
    pub report: Arc<Mutex<TrainingReport>>,
    /// Average buffers (BatchNorm statistics) across ranks after every step: replicas in other
    /// processes do not share Burn's `RunningState`.
    pub average_buffers: bool,
    /// Where the run starts: batches of the first epoch to skip, counters so far.
    pub resume: Resume,
    /// What rank 0 reports to burn-train of training.
    pub reports: Reports<LC>,
    /// This process's loaders as the ranks compare them at start-up (the other fields are
    /// filled in by the rank).
    pub loaders: Startup,
    /// The run its checkpoints belong to.
    pub run_id: String,
    /// This rank's whole batches of the validation loader (sharded validation); `None`: rank 0
    /// validates alone.
    pub valid_shard: Option<ValidShard<LC>>,
}

/// What a rank's thread gives back: its counters and, on rank 0, burn-train's components.
pub(super) struct Finished<LC: LearningComponentsTypes> {
    pub result: Result<()>,
    pub report: RankReport,
    pub leader: Option<(TrainingModel<LC>, SupervisedTrainingEventProcessor<LC>)>,
}

impl<LC: LearningComponentsTypes + Send + 'static> Worker<LC>
where
    ModelOutput<LC>: 'static,
    ValidOutput<LC>: 'static,
{
    /// Trains this rank to the end (or its failure), catching panics.
    pub fn run(mut self) -> Finished<LC> {
        // `burn_ddp::rank()` in user code on this thread (a train step, a metric) answers this rank.
        let _rank = crate::context::enter_rank(self.rank, self.group.world_size());
        let mut report = RankReport {
            rank: self.rank,
            ..RankReport::default()
        };
        let mut model_out = None;
        let result =
            std::panic::catch_unwind(AssertUnwindSafe(|| self.train(&mut report, &mut model_out)));
        let result = match result {
            Ok(result) => result,
            // SyncBatchNorm's collectives raise their errors as panics carrying the error.
            Err(payload) => match payload.downcast::<DdpError>() {
                Ok(err) => Err(*err),
                Err(payload) => Err(DdpError::WorkerPanicked {
                    rank: self.rank,
                    message: panic_message(payload.as_ref()),
                }),
            },
        };
        match &result {
            // Every rank stopped at the same step: nothing to abort.
            Err(err @ DdpError::Preempted { .. }) => {
                tracing::warn!("burn-ddp: rank {}: {err}", self.rank);
            }
            Err(err) => {
                tracing::error!("burn-ddp: rank {} failed: {err}", self.rank);
                // Peers must not wait for this rank: fail their collectives at once.
                self.group.abort(&err.to_string());
            }
            Ok(()) => {}
        }
        let model = || model_out.unwrap_or_else(|| self.learner.model());
        let leader = match self.role {
            Role::Leader(leader) => Some((model(), leader.event_processor)),
            Role::Silent(processor) => Some((model(), *processor)),
            Role::Follower(_) => None,
        };
        Finished {
            result,
            report,
            leader,
        }
    }

    fn train(
        &mut self,
        report: &mut RankReport,
        model_out: &mut Option<TrainingModel<LC>>,
    ) -> Result<()> {
        // CUDA replicas reduce with NCCL, in GPU memory (the host group bootstraps it).
        self.group = crate::nccl::group_for_device(self.group.clone(), &self.device, &self.config)?;
        // Every collective of this rank from here on is counted (RankReport::collectives).
        let collectives = Arc::new(AtomicU64::new(0));
        self.group = Arc::new(CountingGroup::new(self.group.clone(), collectives.clone()));
        // SyncBatchNorm layers synchronise with this rank's group.
        let _current =
            crate::sync_bn::enter_process_group(self.group.clone(), self.config.timeout());
        self.learner.fork(&self.device);
        // Check the replicas and start from rank 0's parameters and buffers.
        let (mut ddp, model) = DistributedDataParallel::<TrainingBackend<LC>>::for_replica(
            self.group.clone(),
            self.learner.model(),
            &self.device,
            self.config.clone(),
        )?;
        self.learner.load_model(model.into_record());
        // Processes resuming from different checkpoints would train different steps, and
        // different settings or data would diverge or call different collectives.
        Startup {
            epochs: (*self.epochs.start() as u64, *self.epochs.end() as u64),
            resumed_batches: self.resume.batches as u64,
            counters: (self.resume.synchronisations, self.resume.optimizer_steps),
            settings: self.config.semantics_fingerprint() ^ self.grad_accumulation as u64,
            ..self.loaders
        }
        .compare(self.group.as_ref(), self.config.timeout(), &self.config)?;
        let result = self.train_epochs(&mut ddp, report, &collectives);
        // Counters also on failure: they tell how far the rank got.
        report.comm = ddp.comm_stats().clone();
        result?;
        *model_out = Some(self.learner.model());
        Ok(())
    }
}

/// Every rank's report, rank 0's model and event processor, and the root cause of a failure.
pub(super) type Collected<LC> = (
    Vec<RankReport>,
    Option<(TrainingModel<LC>, SupervisedTrainingEventProcessor<LC>)>,
    Option<DdpError>,
);

/// Runs `workers` (one thread each; a single one on the calling thread) and collects what they
/// give back: every rank's report, rank 0's model and event processor, and the root cause when
/// ranks failed. Returns `None` for rank 0's parts when its thread could not start or is stuck.
pub(super) fn run_all<LC: LearningComponentsTypes + Send + 'static>(
    workers: Vec<Worker<LC>>,
    grace: std::time::Duration,
) -> Collected<LC>
where
    ModelOutput<LC>: 'static,
    ValidOutput<LC>: 'static,
{
    // Plain (not scoped) threads: if a rank is stuck in user code after another failed,
    // `fit` must still return the error instead of joining it forever.
    let (done_tx, done_rx) = mpsc::channel::<(usize, Finished<LC>)>();
    let mut errors = Vec::new();
    let mut running = std::collections::BTreeSet::new();
    // One replica in this process (world size 1, or one rank of a multi-process job): it
    // trains on the calling thread, as plain Burn does. A spawned thread gets its own glibc
    // malloc arena, whose heap trimming costs about 10% on models with large tensors
    // (measured with `cargo xtask bench`, MLP 5.8M on Flex).
    let inline = workers.len() == 1;
    for worker in workers {
        let rank = worker.rank;
        if inline {
            running.insert(rank);
            let _ = done_tx.send((rank, worker.run()));
            continue;
        }
        let done_tx = done_tx.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("burn-ddp-rank-{rank}"))
            .spawn(move || {
                let _ = done_tx.send((rank, worker.run()));
            });
        match spawned {
            Ok(_) => {
                running.insert(rank);
            }
            // The worker was dropped with the closure: its peers see it leave at once.
            Err(e) => errors.push((
                rank,
                DdpError::WorkerPanicked {
                    rank,
                    message: format!("could not start the rank's thread: {e}"),
                },
            )),
        }
    }
    drop(done_tx);

    let mut deadline = (!errors.is_empty()).then(|| Instant::now() + grace);
    let mut leader_parts = None;
    let mut ranks: std::collections::BTreeMap<usize, RankReport> = running
        .iter()
        .map(|&rank| {
            (
                rank,
                RankReport {
                    rank,
                    ..RankReport::default()
                },
            )
        })
        .collect();
    while !running.is_empty() {
        let received = match deadline {
            None => done_rx.recv().ok(),
            Some(deadline) => done_rx
                .recv_timeout(deadline.saturating_duration_since(Instant::now()))
                .ok(),
        };
        let Some((rank, finished)) = received else {
            break;
        };
        running.remove(&rank);
        if let Err(err) = finished.result {
            if !matches!(err, DdpError::Preempted { .. }) {
                deadline.get_or_insert_with(|| Instant::now() + grace);
            }
            errors.push((rank, err));
        }
        ranks.insert(rank, finished.report);
        if finished.leader.is_some() {
            leader_parts = finished.leader;
        }
    }
    for &rank in &running {
        let err = DdpError::Unresponsive {
            rank,
            waited: grace,
        };
        tracing::error!("burn-ddp: {err}");
        errors.push((rank, err));
    }
    (
        ranks.into_values().collect(),
        leader_parts,
        root_cause(errors),
    )
}

/// The training shards of `ranks` (global ranks run by this process, on `devices`): the loader is
/// cut into `world_size` equal contiguous slices (a remainder of fewer than `world_size` items is
/// dropped so every rank has as many batches) and rank `r` takes slice `r`. With `join`, nothing
/// is dropped: the slices are `chunk_range(items, world_size, r)`, differing by at most one item.
pub(super) fn split_train_loader<LC: LearningComponentsTypes>(
    loader: &TrainLoader<LC>,
    ranks: &[usize],
    world_size: usize,
    devices: &[Device<TrainingBackend<LC>>],
    join: bool,
) -> Result<Vec<TrainLoader<LC>>> {
    let items = loader.num_items();
    let per_rank = items / world_size;
    // In join mode a rank may have no sample at all: it joins every step with zero gradients.
    if per_rank == 0 && !join {
        return Err(DdpError::InvalidConfig(format!(
            "the training set has {items} items, fewer than the {world_size} replicas"
        )));
    }
    if !join && !items.is_multiple_of(world_size) && ranks.contains(&0) {
        // It changes what is trained: on the console, not only in burn-train's log file.
        crate::log::warn_console(&format!(
            "{items} training items do not divide between {world_size} replicas; the last {} \
             are not used (use DistributedDataLoader to pad instead)",
            items % world_size
        ));
    }
    Ok(ranks
        .iter()
        .zip(devices)
        .map(|(&rank, device)| {
            if world_size == 1 {
                loader.to_device(device)
            } else if join {
                let range = crate::partition::chunk_range(items, world_size, rank);
                loader.slice(range.start, range.end).to_device(device)
            } else {
                loader
                    .slice(rank * per_rank, (rank + 1) * per_rank)
                    .to_device(device)
            }
        })
        .collect())
}

/// The error to report when several ranks failed: a panic or a local error first, then a
/// timeout, then a peer that left, then an abort (which only repeats an earlier failure); a stop
/// by signal only when nothing else went wrong. Between errors of one kind, the lowest rank's
/// (rank 0 writes checkpoints and names their files).
fn root_cause(errors: Vec<(usize, DdpError)>) -> Option<DdpError> {
    let weight = |e: &DdpError| match e {
        DdpError::WorkerPanicked { .. } => 0,
        DdpError::Preempted { .. } => 5,
        DdpError::Aborted { .. } => 4,
        DdpError::PeerLeft { .. } => 3,
        DdpError::Timeout { .. } | DdpError::Unresponsive { .. } => 2,
        _ => 1,
    };
    errors
        .into_iter()
        .min_by_key(|(rank, e)| (weight(e), *rank))
        .map(|(_, e)| e)
}

/// The message of a panic's payload.
pub(super) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".into()
    }
}
