//! [`DdpStrategy`]: data-parallel training as a drop-in strategy for burn-train's `Learner`.
//!
//! One worker thread per device, each with its own replica (a clone of the learner: model,
//! optimizer, LR scheduler) and its own shard of the training set. Each step every replica runs
//! forward and backward on its batch, the gradients are averaged across replicas by the
//! [`Reducer`](crate::Reducer), and every replica applies the same optimizer step, so the replicas
//! stay bit-identical. Rank 0 alone drives burn-train's events (progress, metrics), runs
//! validation, writes checkpoints and decides early stopping; the other ranks forward their
//! training items to it, so the metrics cover the global batch.

use std::panic::AssertUnwindSafe;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use burn::data::dataloader::Progress;
use burn::module::{AutodiffModule, Module};
use burn::optim::GradientsAccumulator;
use burn::tensor::Device;
use burn::train::metric::store::EventStoreClient;
use burn::train::{
    CloneEarlyStoppingStrategy, EventProcessorTraining, InferenceStep, Interrupter, Learner,
    LearnerEvent, LearningCheckpointer, LearningComponentsTypes, LearningResult,
    SupervisedLearningStrategy, SupervisedTraining, SupervisedTrainingEventProcessor, TrainLoader,
    TrainStep, TrainingBackend, TrainingComponents, TrainingItem, TrainingModel, TrainingStrategy,
    ValidLoader,
};

use crate::checkpoint::DdpState;
use crate::ddp::DistributedDataParallel;
use crate::group::ReduceOp;
use crate::group::{ProcessGroup, ThreadGroup};
use crate::metrics::{EpochReport, RankReport, TrainingReport};
use crate::reducer::ReduceOptions;
use crate::{BufferSync, NonFinite, UnevenInputs};
use crate::{DdpConfig, DdpError, Result};

type ModelOutput<LC> = <TrainingModel<LC> as TrainStep>::Output;
type InferenceModel<LC> = <LC as LearningComponentsTypes>::InferenceModel;

/// What happens when training fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OnError {
    /// Panic with the error's message: burn-train's `SupervisedLearningStrategy::fit` returns no
    /// `Result`, so a panic is the only way `SupervisedTraining::launch` can report a failure.
    Panic,
    /// Record the error and return the model as it is; [`DdpTraining::launch_ddp`] turns the
    /// record into an `Err`.
    Record,
}

/// Data-parallel training across devices, as a burn-train strategy.
///
/// Switching an existing `SupervisedTraining` to it takes one line:
///
/// ```no_run
/// # use burn::backend::{Autodiff, Flex};
/// # use burn::train::{SupervisedTraining, LearningComponentsTypes};
/// # fn doc<LC: LearningComponentsTypes<Backend = Autodiff<Flex>> + Send + 'static>(training: SupervisedTraining<LC>) -> SupervisedTraining<LC> {
/// use burn_ddp::DdpStrategy;
/// let devices = vec![Default::default(); 2]; // two replicas (CPU: two threads)
/// training.with_training_strategy(DdpStrategy::new(devices).into())
/// # }
/// ```
///
/// The training set is split into `world_size` equal contiguous shards with
/// `DataLoader::slice` (a remainder of fewer than `world_size` items is dropped, so every rank has
/// the same number of batches). For PyTorch's `DistributedSampler` semantics (a new global shuffle
/// every epoch, strided shards, the same samples per step as single-device training), give
/// `SupervisedTraining` a [`DistributedDataLoader`](crate::DistributedDataLoader) built for the
/// same world size. The loader's batch size is the **per-rank** batch.
///
/// Semantics worth knowing:
/// - the LR scheduler steps once per optimizer step (with `grads_accumulation(k)`, once every `k`
///   batches; burn-train's single-device loop steps it every batch);
/// - with `grads_accumulation(k)` gradients are synchronised once per optimizer step, on the sum
///   of the `k` micro-batches; micro-batches left over at the end of an epoch are dropped, as
///   burn-train does;
/// - buffers (BatchNorm running statistics): replicas that are threads of one process share
///   Burn's `RunningState`, which averages the replicas' updates;
/// - a failure (a rank's error, a timeout, a panic in the model) stops every rank;
///   `SupervisedTraining::launch` then panics with the error, [`DdpTraining::launch_ddp`]
///   returns it.
pub struct DdpStrategy<LC: LearningComponentsTypes> {
    devices: Vec<Device<TrainingBackend<LC>>>,
    /// `Some`: one replica in this process, rank `group.rank()` of a multi-process job.
    process_group: Option<Arc<dyn ProcessGroup>>,
    config: DdpConfig,
    on_error: OnError,
    report: Arc<Mutex<TrainingReport>>,
    error: Arc<Mutex<Option<DdpError>>>,
}

impl<LC: LearningComponentsTypes> Clone for DdpStrategy<LC> {
    fn clone(&self) -> Self {
        Self {
            devices: self.devices.clone(),
            process_group: self.process_group.clone(),
            config: self.config.clone(),
            on_error: self.on_error,
            report: self.report.clone(),
            error: self.error.clone(),
        }
    }
}

impl<LC: LearningComponentsTypes> DdpStrategy<LC> {
    /// One replica per device; rank `r` runs on `devices[r]`. On CPU backends, repeat the one
    /// device: each replica is a thread.
    pub fn new(devices: Vec<Device<TrainingBackend<LC>>>) -> Self {
        Self {
            devices,
            process_group: None,
            config: DdpConfig::default(),
            on_error: OnError::Panic,
            report: Arc::default(),
            error: Arc::default(),
        }
    }

    /// One replica on `device` in this process, as rank `group.rank()` of a multi-process job
    /// (one process per device, started by `burn-ddp run`, torchrun, srun or mpirun). Every
    /// process of the job runs the same training with its own strategy; global rank 0 emits
    /// burn-train's events, validates and writes checkpoints, the other ranks stay silent.
    ///
    /// ```no_run
    /// # use burn::backend::{Autodiff, Flex};
    /// # use burn::train::{SupervisedTraining, LearningComponentsTypes};
    /// # fn doc<LC: LearningComponentsTypes<Backend = Autodiff<Flex>> + Send + 'static>(training: SupervisedTraining<LC>) -> Result<SupervisedTraining<LC>, burn_ddp::DdpError> {
    /// use std::sync::Arc;
    /// use burn_ddp::{DdpStrategy, TcpGroup, TcpGroupOptions};
    /// // RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT come from the launcher.
    /// let group = Arc::new(TcpGroup::from_env(&TcpGroupOptions::default())?);
    /// let strategy = DdpStrategy::with_process_group(Default::default(), group);
    /// Ok(training.with_training_strategy(strategy.into()))
    /// # }
    /// ```
    pub fn with_process_group(
        device: Device<TrainingBackend<LC>>,
        group: Arc<dyn ProcessGroup>,
    ) -> Self {
        Self {
            process_group: Some(group),
            ..Self::new(vec![device])
        }
    }

    /// Replaces the configuration (timeouts, bucket caps).
    pub fn with_config(mut self, config: DdpConfig) -> Self {
        self.config = config;
        self
    }

    /// Number of replicas in the whole job.
    pub fn world_size(&self) -> usize {
        match &self.process_group {
            Some(group) => group.world_size(),
            None => self.devices.len(),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &DdpConfig {
        &self.config
    }

    /// Throughput and per-rank timing of the last run (shared by clones of this strategy, so keep
    /// a clone to read it after `launch`).
    pub fn report(&self) -> TrainingReport {
        lock(&self.report).clone()
    }

    /// The error that ended the last run, if any (shared by clones of this strategy).
    pub fn take_error(&self) -> Option<DdpError> {
        lock(&self.error).take()
    }
}

impl<LC: LearningComponentsTypes + Send + 'static> From<DdpStrategy<LC>> for TrainingStrategy<LC> {
    fn from(strategy: DdpStrategy<LC>) -> Self {
        TrainingStrategy::Custom(Arc::new(strategy))
    }
}

/// Launching a `SupervisedTraining` with a [`DdpStrategy`] and getting failures as values.
pub trait DdpTraining<LC: LearningComponentsTypes> {
    /// Runs the training with `strategy`, like `SupervisedTraining::launch`, but returns a
    /// failure (timeout, dead rank, uneven data, replicas that differ, ...) as `Err` instead of
    /// panicking.
    ///
    /// # Errors
    /// The [`DdpError`] that ended training: the root cause when several ranks failed.
    fn launch_ddp(
        self,
        learner: Learner<LC>,
        strategy: DdpStrategy<LC>,
    ) -> Result<LearningResult<InferenceModel<LC>>>;
}

impl<LC: LearningComponentsTypes + Send + 'static> DdpTraining<LC> for SupervisedTraining<LC> {
    fn launch_ddp(
        self,
        learner: Learner<LC>,
        mut strategy: DdpStrategy<LC>,
    ) -> Result<LearningResult<InferenceModel<LC>>> {
        strategy.on_error = OnError::Record;
        let handle = strategy.clone();
        let result = self.with_training_strategy(strategy.into()).launch(learner);
        match handle.take_error() {
            Some(err) => Err(err),
            None => Ok(result),
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// What rank 0 holds besides its replica: burn-train's components and the other ranks' items.
struct Leader<LC: LearningComponentsTypes> {
    event_processor: SupervisedTrainingEventProcessor<LC>,
    dataloader_valid: ValidLoader<LC>,
    checkpointer: Option<LearningCheckpointer<LC>>,
    early_stopping: Option<Box<dyn CloneEarlyStoppingStrategy>>,
    event_store: Arc<EventStoreClient>,
    items: Receiver<TrainingItem<ModelOutput<LC>>>,
}

/// Where a rank's training items go.
enum Role<LC: LearningComponentsTypes> {
    /// Global rank 0.
    Leader(Box<Leader<LC>>),
    /// Another rank in the same process: its items go to rank 0.
    Follower(Sender<TrainingItem<ModelOutput<LC>>>),
    /// Another rank in its own process: emits nothing, but hands this process's event processor
    /// back to burn-train.
    Silent(Box<SupervisedTrainingEventProcessor<LC>>),
}

/// Everything one rank needs, moved into its thread.
struct Worker<LC: LearningComponentsTypes> {
    rank: usize,
    group: Arc<dyn ProcessGroup>,
    device: Device<TrainingBackend<LC>>,
    learner: Learner<LC>,
    dataloader: TrainLoader<LC>,
    role: Role<LC>,
    config: DdpConfig,
    interrupter: Interrupter,
    grad_accumulation: usize,
    epochs: std::ops::RangeInclusive<usize>,
    report: Arc<Mutex<TrainingReport>>,
    /// Average buffers (BatchNorm statistics) across ranks after every step: replicas in other
    /// processes do not share Burn's `RunningState`.
    average_buffers: bool,
    /// Optimizer steps of the run this one resumes (from its DDP state file).
    steps_before: u64,
}

/// What a rank's thread gives back: its counters and, on rank 0, burn-train's components.
struct Finished<LC: LearningComponentsTypes> {
    result: Result<()>,
    report: RankReport,
    leader: Option<(TrainingModel<LC>, SupervisedTrainingEventProcessor<LC>)>,
}

impl<LC: LearningComponentsTypes + Send + 'static> SupervisedLearningStrategy<LC>
    for DdpStrategy<LC>
{
    fn fit(
        &self,
        training_components: TrainingComponents<LC>,
        learner: Learner<LC>,
        dataloader_train: TrainLoader<LC>,
        dataloader_valid: ValidLoader<LC>,
        starting_epoch: usize,
    ) -> (TrainingModel<LC>, SupervisedTrainingEventProcessor<LC>) {
        *lock(&self.error) = None;
        let outcome = self.run(
            training_components,
            learner,
            dataloader_train,
            dataloader_valid,
            starting_epoch,
        );
        match outcome {
            Ok((model, processor, None)) => (model, processor),
            Ok((model, processor, Some(err))) if self.on_error == OnError::Record => {
                tracing::error!("burn-ddp: training failed: {err}");
                *lock(&self.error) = Some(err);
                (model, processor)
            }
            Ok((_, _, Some(err))) | Err(err) => {
                tracing::error!("burn-ddp: training failed: {err}");
                *lock(&self.error) = Some(err.clone());
                // burn-train's `fit` cannot return an error and rank 0's event processor is
                // gone or must not be used, so the failure ends in a panic that carries the
                // error; `DdpTraining::launch_ddp` returns it as a value instead.
                panic!("burn-ddp: training failed: {err}");
            }
        }
    }
}

/// Rank 0's model and event processor, and the error that stopped training, if any.
type RunOutcome<LC> = (
    TrainingModel<LC>,
    SupervisedTrainingEventProcessor<LC>,
    Option<DdpError>,
);

impl<LC: LearningComponentsTypes + Send + 'static> DdpStrategy<LC> {
    fn run(
        &self,
        components: TrainingComponents<LC>,
        learner: Learner<LC>,
        dataloader_train: TrainLoader<LC>,
        dataloader_valid: ValidLoader<LC>,
        starting_epoch: usize,
    ) -> Result<RunOutcome<LC>> {
        let world_size = self.world_size();
        // The ranks this process runs, with their groups and devices.
        let local: Result<Vec<(usize, Arc<dyn ProcessGroup>)>> = match &self.process_group {
            Some(group) => Ok(vec![(group.rank(), group.clone())]),
            None if world_size == 0 => Err(DdpError::InvalidConfig(
                "DdpStrategy needs at least one device, got none".into(),
            )),
            None => ThreadGroup::new_group(world_size).map(|groups| {
                groups
                    .into_iter()
                    .enumerate()
                    .map(|(rank, g)| (rank, Arc::new(g) as Arc<dyn ProcessGroup>))
                    .collect()
            }),
        };
        let join = self.config.uneven_inputs() == UnevenInputs::Join;
        let accumulation = components.grad_accumulation.unwrap_or(1);
        let prepared = self.config.validate().and_then(|()| {
            if join && accumulation > 1 {
                return Err(DdpError::InvalidConfig(
                    "UnevenInputs::Join cannot be combined with grads_accumulation".into(),
                ));
            }
            let local = local?;
            let ranks: Vec<usize> = local.iter().map(|(rank, _)| *rank).collect();
            let shards = split_train_loader::<LC>(
                &dataloader_train,
                &ranks,
                world_size,
                &self.devices,
                self.config.uneven_inputs() == UnevenInputs::Join,
            )?;
            Ok((local, shards))
        });
        let (local, shards) = match prepared {
            Ok(prepared) => prepared,
            // Nothing started: hand burn-train its components back with the error.
            Err(err) => return Ok((learner.model(), components.event_processor, Some(err))),
        };
        *lock(&self.report) = TrainingReport {
            world_size,
            epochs: Vec::new(),
            ranks: Vec::new(),
        };
        let threads = self.process_group.is_none();
        tracing::info!(
            "burn-ddp: {world_size} replica(s) as {}, {} training items per rank, {}",
            if threads { "threads" } else { "processes" },
            shards[0].num_items(),
            self.config
        );

        let (sender, receiver) = mpsc::channel();
        let mut receiver = Some(receiver);
        let mut processor = Some(components.event_processor);
        let mut validation = Some((
            components.checkpointer,
            components.early_stopping,
            components.event_store,
        ));
        let workers: Vec<Worker<LC>> = local
            .into_iter()
            .zip(shards)
            .zip(self.devices.iter().cloned())
            .map(|(((rank, group), dataloader), device)| {
                let role = match (rank, processor.take(), validation.take()) {
                    (
                        0,
                        Some(event_processor),
                        Some((checkpointer, early_stopping, event_store)),
                    ) => Role::Leader(Box::new(Leader {
                        event_processor,
                        dataloader_valid: dataloader_valid.to_device(&device),
                        checkpointer,
                        early_stopping,
                        event_store,
                        items: receiver.take().unwrap_or_else(|| mpsc::channel().1),
                    })),
                    (_, Some(event_processor), _) => Role::Silent(Box::new(event_processor)),
                    _ => Role::Follower(sender.clone()),
                };
                Worker {
                    rank,
                    group,
                    device,
                    learner: learner.clone(),
                    dataloader,
                    role,
                    config: self.config.clone(),
                    interrupter: components.interrupter.clone(),
                    grad_accumulation: components.grad_accumulation.unwrap_or(1).max(1),
                    epochs: starting_epoch..=components.num_epochs,
                    report: self.report.clone(),
                    average_buffers: !threads && world_size > 1,
                    steps_before: 0,
                }
            })
            .collect();
        drop(sender);
        drop(learner);

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
                Err(e) => errors.push(DdpError::WorkerPanicked {
                    rank,
                    message: format!("could not start the rank's thread: {e}"),
                }),
            }
        }
        drop(done_tx);

        let grace = self.config.timeout();
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
                errors.push(err);
                deadline.get_or_insert_with(|| Instant::now() + grace);
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
            errors.push(err);
        }
        lock(&self.report).ranks = ranks.into_values().collect();
        let error = root_cause(errors);
        match leader_parts {
            Some((model, processor)) => Ok((model, processor, error)),
            // Rank 0's thread could not be started or is stuck: burn-train's event processor is
            // with it, so `fit` has nothing to return and must panic, even under `launch_ddp`.
            None => Err(error.unwrap_or_else(|| DdpError::WorkerPanicked {
                rank: 0,
                message: "rank 0 ended without returning its model".into(),
            })),
        }
    }
}

/// The training shards of `ranks` (global ranks run by this process, on `devices`): the loader is
/// cut into `world_size` equal contiguous slices (a remainder of fewer than `world_size` items is
/// dropped so every rank has as many batches) and rank `r` takes slice `r`. With `join`, nothing
/// is dropped: the slices are `chunk_range(items, world_size, r)`, differing by at most one item.
fn split_train_loader<LC: LearningComponentsTypes>(
    loader: &TrainLoader<LC>,
    ranks: &[usize],
    world_size: usize,
    devices: &[Device<TrainingBackend<LC>>],
    join: bool,
) -> Result<Vec<TrainLoader<LC>>> {
    let items = loader.num_items();
    let per_rank = items / world_size;
    if per_rank == 0 {
        return Err(DdpError::InvalidConfig(format!(
            "the training set has {items} items, fewer than the {world_size} replicas"
        )));
    }
    if !join && !items.is_multiple_of(world_size) {
        tracing::warn!(
            "burn-ddp: {items} training items do not divide between {world_size} replicas; the \
             last {} are not used (use DistributedDataLoader to pad instead)",
            items % world_size
        );
    }
    Ok(ranks
        .iter()
        .zip(devices)
        .map(|(&rank, device)| {
            if world_size == 1 {
                loader.to_device(device)
            } else if join {
                let range = crate::group::chunk_range(items, world_size, rank);
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
/// timeout, then a peer that left, then an abort (which only repeats an earlier failure).
fn root_cause(errors: Vec<DdpError>) -> Option<DdpError> {
    let weight = |e: &DdpError| match e {
        DdpError::WorkerPanicked { .. } => 0,
        DdpError::Aborted { .. } => 4,
        DdpError::PeerLeft { .. } => 3,
        DdpError::Timeout { .. } | DdpError::Unresponsive { .. } => 2,
        _ => 1,
    };
    errors.into_iter().min_by_key(weight)
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".into()
    }
}

/// Per-step agreement: each rank's batch size (0 when it has none left), and whether anyone
/// asked to stop.
struct Agreement {
    samples: Vec<u64>,
    stop: bool,
}

impl<LC: LearningComponentsTypes + Send + 'static> Worker<LC> {
    fn run(mut self) -> Finished<LC> {
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
        if let Err(err) = &result {
            tracing::error!("burn-ddp: rank {} failed: {err}", self.rank);
            // Peers must not wait for this rank: fail their collectives at once.
            self.group.abort(&err.to_string());
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
        // SyncBatchNorm layers synchronise with this rank's group.
        let _current =
            crate::sync_bn::enter_process_group(self.group.clone(), self.config.timeout());
        self.learner.fork(&self.device);
        // Check the replicas and start from rank 0's parameters and buffers.
        let (mut ddp, model) = DistributedDataParallel::<TrainingBackend<LC>>::new(
            self.group.clone(),
            self.learner.model(),
            &self.device,
            self.config.clone(),
        )?;
        self.learner.load_model(model.into_record());
        // Processes resuming from different checkpoints would train different epochs, and
        // different settings would diverge or call different collectives.
        let mine = [
            *self.epochs.start() as u64,
            *self.epochs.end() as u64,
            self.config.semantics_fingerprint() ^ self.grad_accumulation as u64,
        ];
        let all = self.group.all_gather(&mine, self.config.timeout())?;
        if let Some((other, theirs)) = all
            .chunks(3)
            .enumerate()
            .find(|(_, theirs)| *theirs != mine)
        {
            let detail = if theirs[..2] != mine[..2] {
                format!(
                    "rank {} trains epochs {}..={} but rank {other} trains {}..={} (resumed from \
                     different checkpoints?)",
                    self.rank, mine[0], mine[1], theirs[0], theirs[1]
                )
            } else {
                format!(
                    "rank {} and rank {other} have different DdpConfig training settings (clipping, \
                     non-finite policy, uneven inputs, buffer sync, bucket caps) or gradient \
                     accumulation; here: {}",
                    self.rank, self.config
                )
            };
            return Err(DdpError::ReplicaMismatch {
                rank: self.rank,
                detail,
            });
        }
        self.check_resumed_state()?;
        let result = self.train_epochs(&mut ddp, report);
        // Counters also on failure: they tell how far the rank got.
        report.comm = ddp.comm_stats().clone();
        result?;
        *model_out = Some(self.learner.model());
        Ok(())
    }

    fn train_epochs(
        &mut self,
        ddp: &mut DistributedDataParallel<TrainingBackend<LC>>,
        report: &mut RankReport,
    ) -> Result<()> {
        let world_size = self.group.world_size();
        let join = self.config.uneven_inputs() == UnevenInputs::Join;
        if join && self.grad_accumulation > 1 {
            return Err(DdpError::InvalidConfig(
                "UnevenInputs::Join cannot be combined with grads_accumulation".into(),
            ));
        }
        let policy = self.config.non_finite();
        // Optimizer steps taken and attempted (skipped ones included), over all epochs.
        let mut total_steps = 0u64;
        let mut attempted = 0u64;
        // BatchNorm statistics are updated in the forward pass: a skipped step must undo that.
        // Only buffers: frozen weights do not change.
        let buffers = ddp.replica_layout().buffer_mask();
        let has_buffers = buffers.contains(&true);

        for epoch in self.epochs.clone() {
            let epoch_start = Instant::now();
            let progress_global = Progress::new(epoch, *self.epochs.end());
            let dataloader = self.dataloader.clone();
            // burn-train's epoch k is sampler epoch k - 1: a resumed run gets the order the
            // uninterrupted run would have had, without the user telling the loader.
            let _epoch = crate::sampler::enter_epoch(epoch as u64 - 1);
            let mut iterator = dataloader.iter();
            let mut accumulator = GradientsAccumulator::<TrainingModel<LC>>::new();
            let mut micro_batches = 0usize;
            let mut buffer_snapshot: Option<Vec<f32>> = None;
            let mut steps = 0u64;
            let mut stop = false;
            let mut step = 0usize;
            let mut epoch_samples = 0u64;
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
                let started = Instant::now();
                let agreement = self.agree(samples)?;
                report.coordination += started.elapsed();
                if agreement.stop {
                    stop = true;
                    break;
                }
                let with_batch: Vec<usize> = (0..world_size)
                    .filter(|&r| agreement.samples[r] > 0)
                    .collect();
                epoch_samples += agreement.samples.iter().sum::<u64>();
                if with_batch.is_empty() {
                    break;
                }
                if with_batch.len() != world_size && !join {
                    let exhausted = (0..world_size)
                        .filter(|r| !with_batch.contains(r))
                        .collect();
                    return Err(DdpError::UnevenData {
                        rank: self.rank,
                        epoch,
                        step,
                        exhausted,
                        remaining: with_batch,
                    });
                }
                if has_buffers && policy == NonFinite::SkipStep && micro_batches == 0 {
                    // Taken before this step's forward passes touch BatchNorm statistics.
                    buffer_snapshot = Some(crate::replica::snapshot_selected(
                        &self.learner.model(),
                        &buffers,
                    ));
                }
                let output = item.map(|item| {
                    let started = Instant::now();
                    let output = self.learner.train_step(item);
                    report.compute += started.elapsed();
                    report.batches += 1;
                    output
                });
                if join && crate::sync_bn::used_on_this_thread() {
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
                micro_batches += 1;
                let ready = if self.grad_accumulation > 1 {
                    if let Some(grads) = grads {
                        accumulator.accumulate(&self.learner.model(), grads);
                    }
                    (micro_batches >= self.grad_accumulation).then(|| Some(accumulator.grads()))
                } else {
                    Some(grads)
                };
                if let Some(grads) = ready {
                    micro_batches = 0;
                    let total: u64 = agreement.samples.iter().sum();
                    let options = ReduceOptions {
                        // Join: weight each rank by its share of the step's real samples, then
                        // sum; the result is the mean over all of the step's samples.
                        weight: if join {
                            samples as f32 / total.max(1) as f32
                        } else {
                            1.0
                        },
                        op: if join { ReduceOp::Sum } else { ReduceOp::Avg },
                        clip_norm: self.config.clip_grad_norm(),
                        check_finite: policy != NonFinite::Ignore,
                    };
                    let outcome =
                        ddp.sync_gradients_with(&self.learner.model(), grads, &options)?;
                    if outcome.non_finite {
                        if policy == NonFinite::Error {
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
                        self.learner.lr_step();
                        self.learner.optimizer_step(outcome.grads);
                        report.optimizer += started.elapsed();
                        steps += 1;
                        total_steps += 1;
                    }
                    self.sync_buffers(ddp)?;
                    attempted += 1;
                    let every = self.config.consistency_check_every();
                    if every > 0 && attempted.is_multiple_of(every) {
                        ddp.check_consistency(&self.learner.model(), total_steps)?;
                    }
                }
                step += 1;

                let Some(item) = item else {
                    continue;
                };
                let local = iterator.progress();
                let item = TrainingItem::new(
                    item,
                    Progress::new(
                        local.items_processed * world_size,
                        local.items_total * world_size,
                    ),
                    progress_global.clone(),
                    Some(step),
                    Some(self.learner.lr_current()),
                );
                match &mut self.role {
                    Role::Leader(leader) => {
                        leader
                            .event_processor
                            .process_train(LearnerEvent::ProcessedItem(item));
                        forward_pending(leader);
                    }
                    Role::Follower(sender) => {
                        // Rank 0 only stops listening when training ends; a failed send means
                        // it is gone, which the next collective reports.
                        let _ = sender.send(item);
                    }
                    // Rank 0, in another process, reports its own items.
                    Role::Silent(_) => {}
                }
            }
            let train_time = epoch_start.elapsed();
            drop(iterator);
            let samples = epoch_samples;

            let mut stop_requested = stop;
            if let Role::Leader(leader) = &mut self.role {
                forward_pending(leader);
                leader
                    .event_processor
                    .process_train(LearnerEvent::EndEpoch(epoch));
                lock(&self.report).epochs.push(EpochReport {
                    epoch,
                    samples,
                    steps,
                    train_time,
                });
                if !stop {
                    validate::<LC>(&self.learner, leader, &progress_global, &self.interrupter);
                    if let Some(checkpointer) = &mut leader.checkpointer {
                        checkpointer.checkpoint(&self.learner, epoch, &leader.event_store);
                    }
                    if let Some(dir) = self.config.checkpoint_dir() {
                        DdpState {
                            epoch,
                            world_size,
                            optimizer_steps: self.steps_before + total_steps,
                            next_sampler_epoch: epoch as u64,
                        }
                        .write(dir)?;
                    }
                    if let Some(early_stopping) = &mut leader.early_stopping
                        && early_stopping.should_stop(epoch, &leader.event_store)
                    {
                        tracing::info!("burn-ddp: early stopping after epoch {epoch}");
                        stop_requested = true;
                    }
                }
            }
            // Everyone waits here while rank 0 validates and writes checkpoints: the barrier
            // after the checkpoint.
            let votes = self.group.all_gather(
                &[u64::from(stop_requested || self.interrupter.should_stop())],
                self.config.epoch_end_timeout(),
            )?;
            if votes.iter().any(|&v| v != 0) {
                break;
            }
        }
        Ok(())
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

    /// Before the first step of a resumed run: the DDP state of the epoch it resumes after must
    /// come from a job of the same world size.
    fn check_resumed_state(&mut self) -> Result<()> {
        let (Some(dir), first) = (self.config.checkpoint_dir(), *self.epochs.start()) else {
            return Ok(());
        };
        if first <= 1 {
            return Ok(());
        }
        match DdpState::read(dir, first - 1)? {
            Some(state) if state.world_size != self.group.world_size() => {
                Err(DdpError::Checkpoint {
                    path: DdpState::path(dir, first - 1).display().to_string(),
                    detail: format!(
                        "written by a job of world size {}, this job has {}: resume with the same \
                     world size (the per-rank batch and the data shards depend on it)",
                        state.world_size,
                        self.group.world_size()
                    ),
                })
            }
            Some(state) => {
                self.steps_before = state.optimizer_steps;
                Ok(())
            }
            None => {
                tracing::warn!(
                    "burn-ddp: resuming after epoch {} without {}",
                    first - 1,
                    DdpState::path(dir, first - 1).display()
                );
                Ok(())
            }
        }
    }

    /// One small all-gather per step: how many samples each rank's batch has (0: none left) and
    /// whether it was interrupted. Every rank gets the same answer, so all stop at the same step.
    fn agree(&self, samples: usize) -> Result<Agreement> {
        let flags = [samples as u64, u64::from(self.interrupter.should_stop())];
        let all = self.group.all_gather(&flags, self.config.timeout())?;
        Ok(Agreement {
            samples: all.chunks(2).map(|f| f[0]).collect(),
            stop: all.chunks(2).any(|f| f[1] != 0),
        })
    }
}

/// Hands the items other ranks sent so far to burn-train's event processor.
fn forward_pending<LC: LearningComponentsTypes>(leader: &mut Leader<LC>) {
    while let Ok(item) = leader.items.try_recv() {
        leader
            .event_processor
            .process_train(LearnerEvent::ProcessedItem(item));
    }
}

/// Rank 0's validation pass over the whole validation set, as burn-train's single-device loop.
fn validate<LC: LearningComponentsTypes>(
    learner: &Learner<LC>,
    leader: &mut Leader<LC>,
    progress_global: &Progress,
    interrupter: &Interrupter,
) {
    let epoch = progress_global.items_processed;
    let model = learner.model().valid();
    let mut iterator = leader.dataloader_valid.iter();
    let mut iteration = 0;
    while let Some(item) = iterator.next() {
        iteration += 1;
        let progress = iterator.progress();
        let output = InferenceStep::step(&model, item);
        let item = TrainingItem::new(
            output,
            progress,
            progress_global.clone(),
            Some(iteration),
            None,
        );
        leader
            .event_processor
            .process_valid(LearnerEvent::ProcessedItem(item));
        if interrupter.should_stop() {
            break;
        }
    }
    leader
        .event_processor
        .process_valid(LearnerEvent::EndEpoch(epoch));
}
