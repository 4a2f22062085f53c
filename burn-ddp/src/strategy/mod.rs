//! [`DdpStrategy`]: data-parallel training as a drop-in strategy for burn-train's `Learner`.
//!
//! One worker thread per device, each with its own replica (a clone of the learner: model,
//! optimizer, LR scheduler) and its own shard of the training set. Each step every replica runs
//! forward and backward on its batch, the gradients are averaged across replicas by the
//! [`Reducer`](crate::mechanism::Reducer), and every replica applies the same optimizer step, so the replicas
//! stay bit-identical. Rank 0 alone drives burn-train's events (progress, metrics), writes
//! checkpoints and decides early stopping; the other ranks send it their outputs (training and
//! their shard of validation), so the metrics cover the global batch and the whole validation set.
//!
//! The rooms: this file is what the user builds and how a run is set up; [`worker`] the ranks'
//! threads, roles and failures; [`epoch`] the training loop; [`policy`] the step decisions
//! (join, accumulation, non-finite gradients); [`validation`]; [`resume`] the checkpoints a run
//! starts from.

mod checkpointing;
mod epoch;
mod events;
mod metrics_file;
mod policy;
mod rank;
mod resume;
mod sharded;
mod startup;
mod validation;
mod wire;
mod worker;

use std::sync::mpsc;
use std::sync::{Arc, Mutex};

use burn::tensor::Device;
use burn::train::{
    Learner, LearningComponentsTypes, LearningResult, SupervisedLearningStrategy,
    SupervisedTraining, SupervisedTrainingEventProcessor, TrainLoader, TrainingBackend,
    TrainingComponents, TrainingModel, TrainingStrategy, ValidLoader,
};

use crate::config::{DdpConfig, UnevenInputs, Validation};
use crate::error::{DdpError, Result};
use crate::group::{ProcessGroup, ThreadGroup};
use crate::metrics::TrainingReport;
use epoch::Trainer;
use events::Events;
use metrics_file::MetricsFile;
use rank::{Leader, Part, Role};
use resume::StepCheckpoints;
use sharded::{RecordReader, Sharded};
use validation::{ValidShard, ValidationPlan};
use worker::{run_all, split_train_loader};

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
/// - the LR scheduler steps once per batch, before its forward pass, as burn-train's own loop
///   steps it (with `grads_accumulation(k)`, once per micro-batch);
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
    /// Started again by a launcher after a failure (`burn-ddp run --max-restarts`): resume from
    /// the run's newest complete checkpoint when a checkpoint directory is set.
    restarted: bool,
    /// The run its checkpoints belong to ([`DdpConfig::with_run_id`] overrides it).
    run_id: String,
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
            restarted: self.restarted,
            run_id: self.run_id.clone(),
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
            restarted: false,
            run_id: crate::auth::run_id_from_env().unwrap_or_else(crate::auth::local_run_id),
        }
    }

    /// Threads or processes, whichever the environment says: the one call that makes a
    /// single-device training data-parallel in either mode.
    ///
    /// - No launcher variables (`RANK`/`WORLD_SIZE`, Slurm's, Open MPI's; see
    ///   [`Topology::from_env`](crate::mechanism::Topology::from_env)): one replica per device of
    ///   `devices`, each a thread of this process, as [`new`](Self::new).
    /// - Started by `burn-ddp run` (or with its torchrun-style variables set otherwise), `srun` or
    ///   `mpirun`: one replica in this process, on
    ///   `devices[local_rank]`, or on `devices[0]` when it is the only one (a scheduler that
    ///   leaves one GPU visible per task with `CUDA_VISIBLE_DEVICES`) or every entry is the same
    ///   device (a CPU repeated for threads); the [`TcpGroup`] is built
    ///   and connected here (the rendezvous waits for every rank, up to
    ///   [`TcpGroupOptions::default`]'s timeout), as [`with_process_group`](Self::with_process_group).
    /// - With the `mpi` feature, under an MPI launcher (`mpirun`, `srun --mpi=pmix`; see
    ///   `burn_ddp::group::launched_by_mpi`): the same, with an `MpiGroup` on `MPI_COMM_WORLD`
    ///   instead (rank, world size and local rank from MPI; no `MASTER_ADDR`, no store; the
    ///   rendezvous timeout of `options` does not apply: MPI's start-up is the launcher's).
    /// - A restart by the launcher (`burn-ddp run --max-restarts`, `BURN_DDP_RESTART_COUNT` above
    ///   0) resumes from the newest complete checkpoint when
    ///   [`DdpConfig::with_checkpoint_dir`] is set, as if [`DdpConfig::with_resume`] were on.
    ///
    /// Pass every device of this machine you would train on (on CPU, the one device repeated
    /// for the number of threads: `vec![Default::default(); 2]`); under a launcher the
    /// process's [`crate::rank`], [`crate::world_size`] and [`crate::is_main_process`] answer
    /// from then on.
    ///
    /// ```no_run
    /// # use burn::backend::{Autodiff, Flex};
    /// # use burn::train::{SupervisedTraining, LearningComponentsTypes};
    /// # fn doc<LC: LearningComponentsTypes<Backend = Autodiff<Flex>> + Send + 'static>(training: SupervisedTraining<LC>) -> Result<SupervisedTraining<LC>, burn_ddp::DdpError> {
    /// use burn_ddp::DdpStrategy;
    /// // Two threads here; one process each under `burn-ddp run --nproc-per-node 2`.
    /// let strategy = DdpStrategy::from_env(vec![Default::default(); 2])?;
    /// Ok(training.with_training_strategy(strategy.into()))
    /// # }
    /// ```
    ///
    /// # Errors
    /// [`DdpError::InvalidConfig`] when `devices` is empty or a launcher variable is malformed;
    /// the rendezvous's errors (timeout naming the ranks that did not arrive, an address peers
    /// cannot use).
    /// [`DdpError::InvalidConfig`] also when the local rank has no device of its own
    /// (`local_rank >= devices.len()` among several different devices).
    ///
    /// [`TcpGroup`]: crate::group::TcpGroup
    /// [`TcpGroupOptions::default`]: crate::group::TcpGroupOptions
    pub fn from_env(devices: Vec<Device<TrainingBackend<LC>>>) -> Result<Self> {
        Self::from_env_with(devices, &crate::group::TcpGroupOptions::default())
    }

    /// [`from_env`](Self::from_env) with the process group's connection options (the
    /// rendezvous timeout).
    ///
    /// # Errors
    /// As [`from_env`](Self::from_env).
    pub fn from_env_with(
        devices: Vec<Device<TrainingBackend<LC>>>,
        options: &crate::group::TcpGroupOptions,
    ) -> Result<Self> {
        if devices.is_empty() {
            return Err(DdpError::InvalidConfig(
                "DdpStrategy::from_env needs at least one device, got none".into(),
            ));
        }
        #[cfg(feature = "mpi")]
        if crate::group::launched_by_mpi() {
            // Rank, world size and local rank from MPI itself: no MASTER_ADDR, no store.
            let group = crate::group::MpiGroup::world()?;
            let device = match local_device(&devices, group.rank(), group.local_rank()) {
                Ok(device) => device,
                Err(err) => {
                    // Dropping the group would wait in MPI_Finalize for peers that wait for us.
                    group.abort(&err.to_string());
                    return Err(err);
                }
            };
            crate::context::set_process(group.rank(), group.world_size());
            return Ok(Self::with_process_group(device, Arc::new(group)));
        }
        let Some(topology) = crate::topology::Topology::from_env()? else {
            // `burn_ddp::world_size()` answers the replica count from here on (to build a
            // DistributedDataLoader for it before training starts).
            crate::context::set_process(0, devices.len());
            return Ok(Self::new(devices));
        };
        let device = local_device(&devices, topology.rank, topology.local_rank)?;
        let group = crate::group::TcpGroup::connect(&topology, options)?;
        crate::context::set_process(topology.rank, topology.world_size);
        let job = group.rendezvous().map(|r| r.job.clone());
        if let Some(job) = &job
            && job.secret() == crate::auth::Secret::None
            && topology.rank == 0
        {
            crate::log::warn_console(&format!(
                "no job token ({}): the rendezvous store at {} accepts any process that reaches \
                 its port; set it to the same secret on every process of the job (burn-ddp run \
                 makes one by itself)",
                crate::auth::JOB_TOKEN_VAR,
                crate::store::host_port(&topology.master_addr, topology.master_port)
            ));
        }
        let mut strategy = Self::with_process_group(device, Arc::new(group));
        strategy.restarted = topology.restart_count > 0;
        if let Some(job) = job {
            strategy.run_id = job.run_id().to_string();
        }
        Ok(strategy)
    }

    /// Whether this process runs one replica of a multi-process job (as opposed to every
    /// replica, as threads).
    pub fn is_multi_process(&self) -> bool {
        self.process_group.is_some()
    }

    /// One replica on `device` in this process, as rank `group.rank()` of a multi-process job
    /// (one process per device, started by `burn-ddp run`, srun or mpirun). Every
    /// process of the job runs the same training with its own strategy; global rank 0 emits
    /// burn-train's events (joined from every rank's outputs) and writes checkpoints; every rank
    /// validates its shard of the validation set.
    ///
    /// ```no_run
    /// # use burn::backend::{Autodiff, Flex};
    /// # use burn::train::{SupervisedTraining, LearningComponentsTypes};
    /// # fn doc<LC: LearningComponentsTypes<Backend = Autodiff<Flex>> + Send + 'static>(training: SupervisedTraining<LC>) -> Result<SupervisedTraining<LC>, burn_ddp::DdpError> {
    /// use std::sync::Arc;
    /// use burn_ddp::group::TcpGroupOptions;
    /// use burn_ddp::{DdpStrategy, group::TcpGroup};
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

impl<LC: LearningComponentsTypes + Send + 'static> From<DdpStrategy<LC>> for TrainingStrategy<LC>
where
    rank::ModelOutput<LC>: 'static,
    rank::ValidOutput<LC>: 'static,
{
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

impl<LC: LearningComponentsTypes + Send + 'static> DdpTraining<LC> for SupervisedTraining<LC>
where
    rank::ModelOutput<LC>: 'static,
    rank::ValidOutput<LC>: 'static,
{
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

pub(super) fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl<LC: LearningComponentsTypes + Send + 'static> SupervisedLearningStrategy<LC>
    for DdpStrategy<LC>
where
    rank::ModelOutput<LC>: 'static,
    rank::ValidOutput<LC>: 'static,
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
                match &err {
                    DdpError::Preempted { .. } => tracing::warn!("burn-ddp: {err}"),
                    _ => tracing::error!("burn-ddp: training failed: {err}"),
                }
                *lock(&self.error) = Some(err);
                (model, processor)
            }
            Ok((_, _, Some(err))) | Err(err) => {
                *lock(&self.error) = Some(err.clone());
                if let DdpError::Preempted { .. } = err {
                    // The process was asked to end, and the checkpoint is written: end it, with
                    // the documented exit code (`launch_ddp` returns the error instead).
                    crate::log::to_stderr(&format!("burn-ddp: {err}\n"));
                    std::process::exit(crate::signals::PREEMPTED_EXIT_CODE);
                }
                tracing::error!("burn-ddp: training failed: {err}");
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

/// What the strategy checked and cut before any rank starts: the ranks this process runs (with
/// their groups), their training shards, and the loaders as the ranks compare them.
struct Prepared<LC: LearningComponentsTypes> {
    local: Vec<(usize, Arc<dyn ProcessGroup>)>,
    shards: Vec<TrainLoader<LC>>,
    loaders: startup::Startup,
}

/// How validation is run: sharded by whole batches (the plan), between processes only when the
/// validation output type can travel (the codec); `None`: rank 0 validates alone.
struct ValidationMode<LC: LearningComponentsTypes> {
    plan: Option<ValidationPlan>,
    codec: Option<crate::outputs::Codec<rank::ValidOutput<LC>, rank::InnerBackend<LC>>>,
}

/// What every rank of this process starts from.
struct Start<LC: LearningComponentsTypes> {
    learner: Learner<LC>,
    resume: resume::Resume,
    loaders: startup::Startup,
    run_id: String,
    interrupter: burn::train::Interrupter,
    grad_accumulation: usize,
    epochs: std::ops::RangeInclusive<usize>,
}

impl<LC: LearningComponentsTypes + Send + 'static> DdpStrategy<LC>
where
    rank::ModelOutput<LC>: 'static,
    rank::ValidOutput<LC>: 'static,
{
    /// One training run: checks and shards, the resume, the ranks built and run, their reports.
    fn run(
        &self,
        components: TrainingComponents<LC>,
        learner: Learner<LC>,
        dataloader_train: TrainLoader<LC>,
        dataloader_valid: ValidLoader<LC>,
        starting_epoch: usize,
    ) -> Result<RunOutcome<LC>> {
        let world_size = self.world_size();
        // Stop signals are recorded (not fatal) while the run lasts, so every rank can stop at
        // the same step and rank 0 can write a checkpoint of it.
        let _signals = self.config.stop_on_signal().then(crate::signals::arm);
        let accumulation = components.grad_accumulation.unwrap_or(1);
        let prepared = self.prepare(&dataloader_train, &dataloader_valid, accumulation);
        let Prepared {
            local,
            shards,
            loaders,
        } = match prepared {
            Ok(prepared) => prepared,
            // Nothing started: hand burn-train its components back with the error, and tell the
            // other processes at once (they would wait for this one until their timeout).
            Err(err) => {
                self.abort_peers(&err);
                return Ok((learner.model(), components.event_processor, Some(err)));
            }
        };
        let first_rank = local.first().map_or(0, |(rank, _)| *rank);
        // Outside the rank threads, a thread-mode process is the main process (rank 0 drives
        // burn-train's events); a multi-process run is its group's rank.
        crate::context::set_process(first_rank, world_size);
        let run_id = self.config.run_id().unwrap_or(&self.run_id).to_string();
        let resumed = resume::prepare(
            &self.config,
            &learner,
            components.checkpointer.as_ref(),
            starting_epoch,
            &self.devices[0],
            &resume::Resuming {
                run_id: &run_id,
                restarted: self.restarted,
                rank: first_rank,
                world_size,
            },
        );
        let (learner, resume) = match resumed {
            Ok((loaded, resume)) => (loaded.unwrap_or(learner), resume),
            Err(err) => {
                self.abort_peers(&err);
                return Ok((learner.model(), components.event_processor, Some(err)));
            }
        };
        *lock(&self.report) = TrainingReport {
            world_size,
            epochs: Vec::new(),
            ranks: Vec::new(),
        };
        self.announce(first_rank, shards[0].num_items());
        let validation = self.validation_mode(&dataloader_valid, first_rank);
        let start = Start {
            learner,
            loaders: startup::Startup {
                valid_batch: validation.plan.map_or(0, |p| p.batch_size as u64),
                ..loaders
            },
            run_id,
            interrupter: components.interrupter.clone(),
            grad_accumulation: accumulation.max(1),
            epochs: resume.starting_epoch..=components.num_epochs,
            resume,
        };
        let trainers = self.trainers(
            local,
            shards,
            components,
            &dataloader_valid,
            &validation,
            start,
        );
        let (ranks, leader_parts, error) = run_all(trainers, self.config.timeout());
        self.finish(ranks, first_rank);
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

    /// The checks before anything starts (the configuration, join with accumulation, the
    /// loaders), the ranks this process runs and their training shards.
    fn prepare(
        &self,
        dataloader_train: &TrainLoader<LC>,
        dataloader_valid: &ValidLoader<LC>,
        accumulation: usize,
    ) -> Result<Prepared<LC>> {
        let world_size = self.world_size();
        let join = self.config.uneven_inputs() == UnevenInputs::Join;
        self.config.validate()?;
        if join && accumulation > 1 {
            return Err(DdpError::InvalidConfig(
                "UnevenInputs::Join cannot be combined with grads_accumulation".into(),
            ));
        }
        // The ranks this process runs, with their groups.
        let local: Vec<(usize, Arc<dyn ProcessGroup>)> = match &self.process_group {
            Some(group) => vec![(group.rank(), group.clone())],
            None if world_size == 0 => {
                return Err(DdpError::InvalidConfig(
                    "DdpStrategy needs at least one device, got none".into(),
                ));
            }
            None => ThreadGroup::new_group(world_size)?
                .into_iter()
                .enumerate()
                .map(|(rank, g)| (rank, Arc::new(g) as Arc<dyn ProcessGroup>))
                .collect(),
        };
        // A DistributedDataLoader built for another world size, or one that pads the validation
        // set, is refused before anything starts.
        let train_loader = crate::sampler::check_loader(
            &**dataloader_train,
            crate::sampler::Purpose::Training { world_size, join },
        )?;
        crate::sampler::check_loader(&**dataloader_valid, crate::sampler::Purpose::Validation)?;
        let ranks: Vec<usize> = local.iter().map(|(rank, _)| *rank).collect();
        let shards =
            split_train_loader::<LC>(dataloader_train, &ranks, world_size, &self.devices, join)?;
        let loaders = startup::Startup {
            epochs: (0, 0),
            resumed_batches: 0,
            counters: (0, 0),
            settings: 0,
            train_items: dataloader_train.num_items() as u64,
            train_loader,
            valid_items: dataloader_valid.num_items() as u64,
            valid_batch: 0,
        };
        Ok(Prepared {
            local,
            shards,
            loaders,
        })
    }

    /// The start-up line: replicas, mode, items per rank and the settings (on the console on
    /// rank 0).
    fn announce(&self, first_rank: usize, items_per_rank: usize) {
        let mode = match &self.process_group {
            None => "threads".to_string(),
            Some(group) => format!("processes ({})", group.backend()),
        };
        let start = format!(
            "{} replica(s) as {mode}, {items_per_rank} training items per rank, {}",
            self.world_size(),
            self.config
        );
        if first_rank == 0 {
            crate::log::info_console(&start);
        } else {
            tracing::info!("burn-ddp: {start}");
        }
    }

    /// How validation runs, and on rank 0 the warnings about output types burn-ddp cannot join
    /// or send.
    fn validation_mode(
        &self,
        dataloader_valid: &ValidLoader<LC>,
        first_rank: usize,
    ) -> ValidationMode<LC> {
        let world_size = self.world_size();
        let threads = self.process_group.is_none();
        let codec = crate::outputs::codec::<rank::ValidOutput<LC>, rank::InnerBackend<LC>>();
        let sharded = world_size > 1
            && self.config.validation() == Validation::Sharded
            && (threads || codec.is_some());
        if world_size > 1 && first_rank == 0 {
            let probe = Events::<LC>::new(threads, self.config.metrics_every(), world_size);
            if !probe.joins_training() {
                crate::log::warn_console(&format!(
                    "the training output type ({}) is not one burn-ddp can join \
                     (burn_ddp::outputs::DistributedOutput): {}",
                    std::any::type_name::<rank::ModelOutput<LC>>(),
                    if threads {
                        "every replica's item is reported on its own (one renderer line per \
                         replica and step)"
                    } else {
                        "the training metrics cover rank 0's samples only"
                    }
                ));
            }
            if self.config.validation() == Validation::Sharded && !sharded {
                crate::log::warn_console(&format!(
                    "the validation output type ({}) is not one burn-ddp can send between \
                     processes: rank 0 validates the whole set alone",
                    std::any::type_name::<rank::ValidOutput<LC>>()
                ));
            }
        }
        ValidationMode {
            plan: sharded.then(|| ValidationPlan::of(&**dataloader_valid)),
            codec,
        }
    }

    /// One trainer per rank of this process: rank 0 takes burn-train's components (the leader),
    /// the other ranks send it their items (threads) or hand this process's event processor
    /// back unused (processes).
    fn trainers(
        &self,
        local: Vec<(usize, Arc<dyn ProcessGroup>)>,
        shards: Vec<TrainLoader<LC>>,
        components: TrainingComponents<LC>,
        dataloader_valid: &ValidLoader<LC>,
        validation: &ValidationMode<LC>,
        start: Start<LC>,
    ) -> Vec<Trainer<LC>> {
        let world_size = self.world_size();
        let threads = self.process_group.is_none();
        let (sender, receiver) = mpsc::channel::<Part<LC>>();
        let mut receiver = Some(receiver);
        let mut processor = Some(components.event_processor);
        // Every rank's optimizer-record reader needs burn-train's store (unused).
        let event_store = components.event_store.clone();
        let epoch_checkpoints = components.checkpointer.is_some();
        let mut leader_parts = Some((
            components.checkpointer,
            components.early_stopping,
            components.event_store,
        ));
        local
            .into_iter()
            .zip(shards)
            .zip(self.devices.iter().cloned())
            .map(|(((rank, group), dataloader), device)| {
                let role = match (rank, processor.take(), leader_parts.take()) {
                    (
                        0,
                        Some(event_processor),
                        Some((checkpointer, early_stopping, event_store)),
                    ) => Role::Leader(Box::new(Leader {
                        event_processor,
                        dataloader_valid: dataloader_valid.to_device(&device),
                        checkpointer,
                        step_checkpoints: self.config.checkpoint_dir().map(StepCheckpoints::new),
                        early_stopping,
                        event_store,
                        items: receiver.take().unwrap_or_else(|| mpsc::channel().1),
                        metrics_file: self.config.metrics_file().map(MetricsFile::new),
                    })),
                    (_, Some(event_processor), _) => Role::Silent(Box::new(event_processor)),
                    _ => Role::Follower(sender.clone()),
                };
                let valid_shard = validation.plan.map(|plan| {
                    let batches = plan.batches_of(rank, world_size);
                    let items = plan.items_of(batches.clone());
                    ValidShard {
                        loader: dataloader_valid
                            .slice(items.start, items.end)
                            .to_device(&device),
                        plan,
                        codec: validation.codec,
                    }
                });
                Trainer {
                    rank,
                    group,
                    device,
                    learner: start.learner.clone(),
                    dataloader,
                    role,
                    config: self.config.clone(),
                    interrupter: start.interrupter.clone(),
                    grad_accumulation: start.grad_accumulation,
                    epochs: start.epochs.clone(),
                    report: self.report.clone(),
                    average_buffers: !threads && world_size > 1,
                    resume: start.resume.clone(),
                    events: Events::new(threads, self.config.metrics_every(), world_size),
                    loaders: start.loaders,
                    run_id: start.run_id.clone(),
                    valid_shard,
                    sharded: self
                        .config
                        .optimizer_sharding()
                        .then(|| Sharded::new(epoch_checkpoints)),
                    records: RecordReader::new(event_store.clone()),
                }
            })
            .collect()
    }

    /// Files every rank's report, and on rank 0 prints the summary.
    fn finish(&self, ranks: Vec<crate::metrics::RankReport>, first_rank: usize) {
        {
            // Rank 0 of a multi-process run may hold every process's reports already (gathered
            // after the last epoch); otherwise this process's own.
            let mut report = lock(&self.report);
            if report.ranks.len() <= ranks.len() {
                report.ranks = ranks;
            }
        }
        if self.config.summary() && first_rank == 0 {
            // The one-line switch gets the figures too, not only `launch_ddp` with a kept clone.
            let report = lock(&self.report).clone();
            if !report.epochs.is_empty() {
                crate::log::to_stderr(&report.to_string());
            }
        }
        if let (Some(path), 0) = (self.config.metrics_file(), first_rank) {
            MetricsFile::new(path).ranks(&lock(&self.report));
        }
    }
}

impl<LC: LearningComponentsTypes> DdpStrategy<LC> {
    /// A multi-process run that fails before its workers start aborts its process group, so the
    /// other processes fail at once instead of waiting for this one until their timeout.
    fn abort_peers(&self, err: &DdpError) {
        if let Some(group) = &self.process_group {
            group.abort(&err.to_string());
        }
    }
}

/// The device of the process with `local_rank` among `devices`: its own entry, or the only one
/// (a scheduler that leaves one GPU visible per task), or the one repeated (a CPU).
fn local_device<D: PartialEq + Clone>(devices: &[D], rank: usize, local_rank: usize) -> Result<D> {
    match devices.get(local_rank) {
        Some(device) => Ok(device.clone()),
        // One device, or one device repeated (CPU threads): every process uses it.
        None if devices.iter().all(|d| d == &devices[0]) => Ok(devices[0].clone()),
        None => Err(DdpError::InvalidConfig(format!(
            "rank {rank} has local rank {local_rank} but {} devices were given: run one process \
             per device (--nproc-per-node at most {}), or leave one device visible per process",
            devices.len(),
            devices.len()
        ))),
    }
}
