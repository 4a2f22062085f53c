//! [`DdpStrategy`]: data-parallel training as a drop-in strategy for burn-train 0.22's
//! `Learner` (stage 4 of the port; the root crate's `strategy/` on burn-train 0.22's API: a
//! strategy without a type parameter, `SupervisedLearningStrategy<M>` for every `LearnerModel`,
//! its epoch loop following burn-train 0.22's: the learning rate steps once per optimizer step,
//! an epoch's short last accumulation window is stepped, rank 0 hands burn-train the split and
//! epoch events in 0.22's order and flushes them before the checkpoint). Tested so far against
//! burn-train's own single-device strategy in one case (two thread replicas, one device's
//! batches dealt); the harness, processes, the launcher and the rest of the root's tests follow.
//!
//! The rooms: this file is what the user builds; [`run`] how a run is set up and finished;
//! [`worker`] the ranks' threads, roles and failures; [`epoch`] the training loop; [`policy`]
//! the step decisions (join, accumulation, non-finite gradients); [`validation`]; [`events`]
//! rank 0's training events; [`checkpointing`] a rank's checkpoints (the files are
//! `crate::checkpoint`'s); [`sharded`] the Learner's sharded optimizer; [`shards`], [`dealer`]
//! and [`dealt_loader`] the ranks' batches; [`startup`], [`wire`], [`handoff`],
//! [`device_group`], [`metrics_file`], [`owned`] and [`rank`] what they share.

mod checkpointing;
mod dealer;
mod dealt_loader;
mod device_group;
mod epoch;
mod events;
mod handoff;
mod metrics_file;
mod owned;
mod policy;
mod rank;
mod run;
mod sharded;
mod shards;
mod startup;
mod validation;
mod wire;
mod worker;

use std::sync::{Arc, Mutex};

use burn::tensor::Device;
use burn::train::{
    Learner, LearnerModel, LearningResult, SupervisedLearningStrategy, SupervisedTraining,
    SupervisedTrainingEventProcessor, TrainLoader, TrainingComponents, TrainingStrategy,
    ValidLoader,
};

use crate::config::DdpConfig;
use crate::error::{DdpError, Result};
use crate::metrics::TrainingReport;
use burn_ddp_comm::group::ProcessGroup;

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
/// # use burn::train::{LearnerModel, SupervisedTraining};
/// # fn doc<M: LearnerModel + Send>(training: SupervisedTraining<M>) -> SupervisedTraining<M> {
/// use burn::tensor::Device;
/// use burn_ddp::DdpStrategy;
/// // Two replicas (on a CPU device: two threads), with autodiff as burn-train trains.
/// let devices = vec![Device::flex().autodiff(); 2];
/// training.with_training_strategy(DdpStrategy::new(devices).into())
/// # }
/// ```
///
/// The ranks' batches: with a [`DistributedDataLoader`](crate::DistributedDataLoader) built for
/// the same world size (PyTorch's `DistributedSampler` semantics: a new global shuffle every
/// epoch, strided shards, the same samples per step as single-device training), each rank its
/// shard, the loader's batch size being the **per-rank** batch; with another loader, thread
/// replicas on one CPU device are dealt one device's batches (rank `r` takes batches `r, r + N,
/// ...`), and otherwise (processes, several devices, GPU backends) the set is cut into
/// `world_size` equal contiguous slices (a remainder of fewer than `world_size` items is dropped),
/// with a warning.
///
/// Semantics worth knowing (burn-train 0.22's own loop):
/// - the LR scheduler steps once per optimizer step, right before it;
/// - with `grads_accumulation(k)` gradients are synchronised once per optimizer step, on the sum
///   of the `k` micro-batches; an epoch's short last window is stepped too;
/// - buffers (BatchNorm running statistics): replicas that are threads of one process share
///   Burn's `RunningState`, which averages the replicas' updates;
/// - a failure (a rank's error, a timeout, a panic in the model) stops every rank;
///   `SupervisedTraining::launch` then panics with the error, [`DdpTraining::launch_ddp`]
///   returns it.
pub struct DdpStrategy {
    devices: Vec<Device>,
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

impl Clone for DdpStrategy {
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

impl DdpStrategy {
    /// One replica per device; rank `r` runs on `devices[r]`. On CPU backends, repeat the one
    /// device: each replica is a thread.
    pub fn new(devices: Vec<Device>) -> Self {
        Self {
            devices,
            process_group: None,
            config: DdpConfig::default(),
            on_error: OnError::Panic,
            report: Arc::default(),
            error: Arc::default(),
            restarted: false,
            run_id: burn_ddp_comm::auth::run_id_from_env()
                .unwrap_or_else(burn_ddp_comm::auth::local_run_id),
        }
    }

    /// Threads or processes, whichever the environment says: the one call that makes a
    /// single-device training data-parallel in either mode.
    ///
    /// - No launcher variables (`RANK`/`WORLD_SIZE`, Slurm's, Open MPI's; see
    ///   [`Topology::from_env`](crate::comm::topology::Topology::from_env)): one replica per device of
    ///   `devices`, each a thread of this process, as [`new`](Self::new).
    /// - Started by `burn-ddp run` (or with its torchrun-style variables set otherwise), `srun` or
    ///   `mpirun`: one replica in this process, on
    ///   `devices[local_rank]`, or on `devices[0]` when it is the only one (a scheduler that
    ///   leaves one GPU visible per task with `CUDA_VISIBLE_DEVICES`) or every entry is the same
    ///   device (a CPU repeated for threads); the [`TcpGroup`] is built
    ///   and connected here (the rendezvous waits for every rank, up to
    ///   [`TcpGroupOptions::default`]'s timeout), as [`with_process_group`](Self::with_process_group).
    /// - With the `mpi` feature, under an MPI launcher (`mpirun`, `srun --mpi=pmix`; see
    ///   `burn_ddp::comm::group::launched_by_mpi`): the same, with an `MpiGroup` on `MPI_COMM_WORLD`
    ///   instead (rank, world size and local rank from MPI; no `MASTER_ADDR`, no store; the
    ///   rendezvous timeout of `options` does not apply: MPI's start-up is the launcher's).
    /// - A restart by the launcher (`burn-ddp run --max-restarts`, `BURN_DDP_RESTART_COUNT` above
    ///   0) resumes from the newest complete checkpoint when
    ///   [`DdpConfig::with_checkpoint_dir`] is set, as if [`DdpConfig::with_resume`] were on.
    ///
    /// Pass every device of this machine you would train on (on CPU, the one device repeated
    /// for the number of threads: `vec![Device::flex().autodiff(); 2]`); under a launcher the
    /// process's [`crate::rank`], [`crate::world_size`] and [`crate::is_main_process`] answer
    /// from then on.
    ///
    /// ```no_run
    /// # use burn::train::{LearnerModel, SupervisedTraining};
    /// # fn doc<M: LearnerModel + Send>(training: SupervisedTraining<M>) -> Result<SupervisedTraining<M>, burn_ddp::DdpError> {
    /// use burn::tensor::Device;
    /// use burn_ddp::DdpStrategy;
    /// // Two threads here; one process each under `burn-ddp run --nproc-per-node 2`.
    /// let strategy = DdpStrategy::from_env(vec![Device::flex().autodiff(); 2])?;
    /// Ok(training.with_training_strategy(strategy.into()))
    /// # }
    /// ```
    ///
    /// # Errors
    /// [`DdpError::InvalidConfig`] when `devices` is empty;
    /// [`DdpError::Comm`] when a launcher variable is malformed (`CommError::Topology`,
    /// `CommError::InvalidConfig` for a job token or run id), and the rendezvous's errors (timeout naming the ranks that did not arrive, an address peers
    /// cannot use).
    /// [`DdpError::InvalidConfig`] also when the local rank has no device of its own
    /// (`local_rank >= devices.len()` among several different devices).
    ///
    /// [`TcpGroup`]: burn_ddp_comm::group::TcpGroup
    /// [`TcpGroupOptions::default`]: burn_ddp_comm::group::TcpGroupOptions
    pub fn from_env(devices: Vec<Device>) -> Result<Self> {
        Self::from_env_with(devices, &burn_ddp_comm::group::TcpGroupOptions::default())
    }

    /// [`from_env`](Self::from_env) with the process group's connection options (the
    /// rendezvous timeout).
    ///
    /// # Errors
    /// As [`from_env`](Self::from_env).
    pub fn from_env_with(
        devices: Vec<Device>,
        options: &burn_ddp_comm::group::TcpGroupOptions,
    ) -> Result<Self> {
        if devices.is_empty() {
            return Err(DdpError::InvalidConfig(
                "DdpStrategy::from_env needs at least one device, got none".into(),
            ));
        }
        #[cfg(feature = "mpi")]
        if burn_ddp_comm::group::launched_by_mpi() {
            // Rank, world size and local rank from MPI itself: no MASTER_ADDR, no store.
            let group = burn_ddp_comm::group::MpiGroup::world()?;
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
        let Some(topology) = burn_ddp_comm::topology::Topology::from_env()? else {
            // `burn_ddp::world_size()` answers the replica count from here on (to build a
            // DistributedDataLoader for it before training starts).
            crate::context::set_process(0, devices.len());
            return Ok(Self::new(devices));
        };
        let device = local_device(&devices, topology.rank, topology.local_rank)?;
        let group = burn_ddp_comm::group::TcpGroup::connect(&topology, options)?;
        crate::context::set_process(topology.rank, topology.world_size);
        // Without a job token, `TcpGroup::connect` warned on every rank before the group formed.
        let job = group.rendezvous().map(|r| r.job.clone());
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
    /// # use burn::train::{LearnerModel, SupervisedTraining};
    /// # fn doc<M: LearnerModel + Send>(training: SupervisedTraining<M>) -> Result<SupervisedTraining<M>, burn_ddp::DdpError> {
    /// use std::sync::Arc;
    /// use burn::tensor::Device;
    /// use burn_ddp::comm::group::{TcpGroup, TcpGroupOptions};
    /// use burn_ddp::DdpStrategy;
    /// // RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT come from the launcher.
    /// let group = Arc::new(TcpGroup::from_env(&TcpGroupOptions::default())?);
    /// let strategy = DdpStrategy::with_process_group(Device::flex().autodiff(), group);
    /// Ok(training.with_training_strategy(strategy.into()))
    /// # }
    /// ```
    pub fn with_process_group(device: Device, group: Arc<dyn ProcessGroup>) -> Self {
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

impl<M: LearnerModel + Send + 'static> From<DdpStrategy> for TrainingStrategy<M>
where
    rank::ModelOutput<M>: 'static,
    rank::ValidOutput<M>: 'static,
{
    fn from(strategy: DdpStrategy) -> Self {
        TrainingStrategy::Custom(Arc::new(strategy))
    }
}

/// Launching a `SupervisedTraining` with a [`DdpStrategy`] and getting failures as values.
pub trait DdpTraining<M: LearnerModel> {
    /// Runs the training with `strategy`, like `SupervisedTraining::launch`, but returns a
    /// failure (timeout, dead rank, uneven data, replicas that differ, ...) as `Err` instead of
    /// panicking.
    ///
    /// # Errors
    /// The [`DdpError`] that ended training: the root cause when several ranks failed.
    fn launch_ddp(self, learner: Learner<M>, strategy: DdpStrategy) -> Result<LearningResult<M>>;
}

impl<M: LearnerModel + Send + 'static> DdpTraining<M> for SupervisedTraining<M>
where
    rank::ModelOutput<M>: 'static,
    rank::ValidOutput<M>: 'static,
{
    fn launch_ddp(
        self,
        learner: Learner<M>,
        mut strategy: DdpStrategy,
    ) -> Result<LearningResult<M>> {
        strategy.on_error = OnError::Record;
        let handle = strategy.clone();
        let result = self.with_training_strategy(strategy.into()).launch(learner);
        match handle.take_error() {
            Some(err) => Err(err),
            None => Ok(result),
        }
    }
}

impl<M: LearnerModel + Send + 'static> SupervisedLearningStrategy<M> for DdpStrategy
where
    rank::ModelOutput<M>: 'static,
    rank::ValidOutput<M>: 'static,
{
    fn fit(
        &self,
        training_components: TrainingComponents<M>,
        learner: Learner<M>,
        dataloader_train: TrainLoader<M>,
        dataloader_valid: ValidLoader<M>,
        starting_epoch: usize,
    ) -> (M, SupervisedTrainingEventProcessor<M>) {
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
                    burn_ddp_comm::log::to_stderr(&format!("burn-ddp: {err}\n"));
                    std::process::exit(burn_ddp_comm::signals::PREEMPTED_EXIT_CODE);
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

/// `mutex`'s guard, also after a thread panicked holding it (the values it guards are counters
/// and reports, whole after any panic).
pub(super) fn lock<T>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::{Batch, Regressor, distributed_loader, item_loader};
    use burn::data::dataloader::DataLoader;
    use burn::optim::AdamConfig;

    /// The model after burn-train's `launch` of a learner from `start` on `train` (validation: 8
    /// items in batches of 4), configured by `configure` (`with_training_strategy` for burn-ddp,
    /// nothing for burn-train's own single-device strategy), and the run's error.
    fn trained(
        start: &Regressor,
        dir: &std::path::Path,
        train: Arc<dyn DataLoader<Batch>>,
        configure: impl FnOnce(SupervisedTraining<Regressor>) -> SupervisedTraining<Regressor>,
    ) -> (Vec<f32>, Option<String>) {
        let learner = Learner::new(start.clone(), AdamConfig::new().init(), 1e-2);
        let training =
            SupervisedTraining::new(dir, train, item_loader(8, 4)).with_application_logger(None);
        let result = configure(training).launch(learner);
        (result.model.values(), result.error.map(|e| e.to_string()))
    }

    fn close(a: &[f32], b: &[f32]) -> bool {
        a.len() == b.len()
            && a.iter()
                .zip(b)
                .all(|(x, y)| (x - y).abs() <= 1e-5 * (1.0 + y.abs()))
    }

    /// A model, its parameters made (Burn initialises them lazily, per clone).
    fn start() -> (Regressor, Vec<f32>) {
        let model = Regressor::new(&crate::replica::tests::test_device());
        let values = model.values();
        (model, values)
    }

    fn threads(world_size: usize) -> DdpStrategy {
        DdpStrategy::new(vec![crate::replica::tests::test_device(); world_size])
    }

    #[test]
    fn two_thread_replicas_train_as_burn_trains_single_device_on_the_global_batch() {
        let (start, initial) = start();
        let dir = tempfile::tempdir().unwrap();
        // Plain burn-train on one device, batches of 8; burn-ddp on 2 thread replicas with
        // batches of 4 each: one device's batches of 4 dealt to the ranks, 8 items a step.
        let (plain, error) = trained(&start, dir.path(), item_loader(24, 8), |t| t.num_epochs(2));
        assert_eq!(error, None);
        assert_ne!(plain, initial, "plain burn-train trained");
        let (ddp, error) = trained(&start, dir.path(), item_loader(24, 4), |t| {
            t.num_epochs(2).with_training_strategy(threads(2).into())
        });
        assert_eq!(error, None);
        assert!(
            close(&ddp, &plain),
            "burn-ddp's model differs from plain burn-train's:\n{ddp:?}\n{plain:?}"
        );
    }

    #[test]
    fn accumulation_with_a_short_last_window_is_burn_trains() {
        let (start, _) = start();
        let dir = tempfile::tempdir().unwrap();
        // 3 global steps of 8 an epoch, windows of 2: the epoch's last window is one step, which
        // burn-train 0.22 steps.
        let (plain, error) = trained(&start, dir.path(), item_loader(24, 8), |t| {
            t.num_epochs(2).grads_accumulation(2)
        });
        assert_eq!(error, None);
        let (ddp, error) = trained(&start, dir.path(), item_loader(24, 4), |t| {
            t.num_epochs(2)
                .grads_accumulation(2)
                .with_training_strategy(threads(2).into())
        });
        assert_eq!(error, None);
        assert!(close(&ddp, &plain), "\n{ddp:?}\n{plain:?}");
        // Without the short window's step the models differ: the case tells.
        let (dropped, _) = trained(&start, dir.path(), item_loader(16, 8), |t| {
            t.num_epochs(2).grads_accumulation(2)
        });
        assert!(!close(&dropped, &plain));
    }

    #[test]
    fn a_distributed_loader_and_zero_1_train_as_one_device() {
        let (start, _) = start();
        let device = crate::replica::tests::test_device();
        let dir = tempfile::tempdir().unwrap();
        let (plain, error) = trained(&start, dir.path(), item_loader(24, 8), |t| t.num_epochs(2));
        assert_eq!(error, None);
        for sharding in [false, true] {
            let strategy =
                threads(2).with_config(DdpConfig::default().with_optimizer_sharding(sharding));
            let (ddp, error) = trained(
                &start,
                dir.path(),
                distributed_loader(24, 4, 2, &device),
                |t| t.num_epochs(2).with_training_strategy(strategy.into()),
            );
            assert_eq!(error, None, "sharding {sharding}");
            assert!(
                close(&ddp, &plain),
                "sharding {sharding}:\n{ddp:?}\n{plain:?}"
            );
        }
    }

    #[test]
    fn a_run_resumed_after_its_first_epoch_ends_as_the_uninterrupted_run() {
        let (start, _) = start();
        let dir = tempfile::tempdir().unwrap();
        let checkpoint_dir = dir.path().join("checkpoint");
        let config = || {
            DdpConfig::default()
                .with_checkpoint_dir(&checkpoint_dir)
                .with_run_id("resumed-run")
        };
        let run = |epochs: usize, config: DdpConfig, artifacts: &std::path::Path| {
            let [model, optim, scheduler] = config.checkpointers().unwrap();
            trained(&start, artifacts, item_loader(24, 4), move |t| {
                t.num_epochs(epochs)
                    .with_custom_checkpointers(model, optim, scheduler)
                    .with_training_strategy(threads(2).with_config(config).into())
            })
        };
        let elsewhere = tempfile::tempdir().unwrap();
        let uninterrupted_config = DdpConfig::default()
            .with_checkpoint_dir(elsewhere.path().join("checkpoint"))
            .with_run_id("uninterrupted");
        let (uninterrupted, error) = run(2, uninterrupted_config, elsewhere.path());
        assert_eq!(error, None);
        let (after_one, error) = run(1, config(), dir.path());
        assert_eq!(error, None);
        assert!(checkpoint_dir.join("ddp-state-1.json").exists());
        let (resumed, error) = run(2, config().with_resume(true), dir.path());
        assert_eq!(error, None);
        assert_ne!(after_one, uninterrupted);
        assert_eq!(resumed, uninterrupted, "resumed bit for bit");
    }

    #[test]
    fn two_ranks_over_loopback_tcp_train_as_one_device() {
        use burn_ddp_comm::group::loopback_groups;
        let (start, _) = start();
        let device = crate::replica::tests::test_device();
        let dir = tempfile::tempdir().unwrap();
        let (plain, error) = trained(&start, dir.path(), item_loader(24, 8), |t| t.num_epochs(2));
        assert_eq!(error, None);
        // Each rank as a process would run it (its own SupervisedTraining and strategy), here on
        // a thread each, meeting over loopback TCP.
        let (_store, groups) = loopback_groups(2, std::time::Duration::from_secs(30));
        let ranks: Vec<(Vec<f32>, Option<String>)> = std::thread::scope(|s| {
            let handles: Vec<_> = groups
                .into_iter()
                .map(|group| {
                    let (start, device) = (&start, device.clone());
                    s.spawn(move || {
                        let artifacts = tempfile::tempdir().unwrap();
                        let strategy = DdpStrategy::with_process_group(
                            device.clone(),
                            Arc::new(group) as Arc<dyn ProcessGroup>,
                        );
                        trained(
                            start,
                            artifacts.path(),
                            distributed_loader(24, 4, 2, &device),
                            |t| t.num_epochs(2).with_training_strategy(strategy.into()),
                        )
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (rank, (model, error)) in ranks.iter().enumerate() {
            assert_eq!(error, &None, "rank {rank}");
            assert!(close(model, &plain), "rank {rank}:\n{model:?}\n{plain:?}");
        }
        assert_eq!(ranks[0].0, ranks[1].0, "the replicas are bit-identical");
    }

    #[test]
    fn validation_with_burns_shuffled_loader_is_one_devices_batch_for_batch() {
        use crate::fixtures::shuffled_loader;
        use burn::train::metric::LossMetric;
        // Learning rate 0: only validation can differ. 10 validation items in shuffled batches
        // of 4 (a short last batch), the case of the issue that made 0.21 shard validation as
        // one device does.
        let (start, _) = start();
        let losses = |strategy: Option<DdpStrategy>| {
            let dir = tempfile::tempdir().unwrap();
            let learner = Learner::new(start.clone(), AdamConfig::new().init(), 0.0);
            let mut training =
                SupervisedTraining::new(dir.path(), item_loader(16, 4), shuffled_loader(10, 4, 7))
                    .num_epochs(2)
                    .metrics((LossMetric::new(),))
                    .with_application_logger(None);
            if let Some(strategy) = strategy {
                training = training.with_training_strategy(strategy.into());
            }
            let result = training.launch(learner);
            assert!(result.error.is_none(), "{:?}", result.error);
            (1..=2)
                .map(|epoch| {
                    let path = dir.path().join(format!("valid/epoch-{epoch}/Loss.log"));
                    std::fs::read_to_string(&path)
                        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
                })
                .collect::<Vec<_>>()
        };
        let plain = losses(None);
        // Three batches and the epoch's value.
        assert_eq!(plain[0].lines().count(), 4, "{plain:?}");
        assert_ne!(plain[0], plain[1], "each epoch shuffles anew");
        // Sharded (thread replicas on one CPU device deal one device's batches), and on rank 0.
        for validation in [
            crate::config::Validation::Sharded,
            crate::config::Validation::Rank0,
        ] {
            let strategy = threads(2).with_config(DdpConfig::default().with_validation(validation));
            assert_eq!(losses(Some(strategy)), plain, "{validation:?}");
        }
    }

    #[test]
    fn a_run_resumed_from_a_step_checkpoint_continues_mid_epoch_as_the_uninterrupted_run() {
        let (start, _) = start();
        let run = |dir: &std::path::Path, config: DdpConfig| {
            let config = config
                .with_checkpoint_dir(dir.join("checkpoint"))
                .with_run_id("step-run");
            let [model, optim, scheduler] = config.checkpointers().unwrap();
            trained(&start, dir, item_loader(24, 4), move |t| {
                t.num_epochs(2)
                    .with_custom_checkpointers(model, optim, scheduler)
                    .with_training_strategy(threads(2).with_config(config).into())
            })
        };
        let dir = tempfile::tempdir().unwrap();
        // 3 steps an epoch; a step checkpoint every 4 optimizer steps: after batch 1 of epoch 2.
        let (uninterrupted, error) = run(dir.path(), DdpConfig::default().with_checkpoint_every(4));
        assert_eq!(error, None);
        let checkpoint = dir.path().join("checkpoint");
        let step = crate::checkpoint::StepState::list(&checkpoint);
        assert_eq!(step.len(), 1, "{step:?}");
        let state = step[0].as_ref().unwrap();
        assert_eq!((state.epoch, state.batches, state.number), (2, 1, 4));
        // As if the machine was lost after it: epoch 2's checkpoint is not there; nor epoch
        // 1's, so only the step checkpoint can give the run back (resuming from the start would
        // fail: with_resume asks for a checkpoint).
        for epoch in [1, 2] {
            for record in ["ddp-state", "model", "optim", "scheduler"] {
                let ext = if record == "ddp-state" { "json" } else { "bpk" };
                std::fs::remove_file(checkpoint.join(format!("{record}-{epoch}.{ext}"))).unwrap();
            }
        }
        let (resumed, error) = run(dir.path(), DdpConfig::default().with_resume(true));
        assert_eq!(error, None);
        assert_eq!(resumed, uninterrupted, "resumed mid-epoch bit for bit");
    }

    /// Stops training after epoch `.0`.
    #[derive(Clone)]
    struct StopAfter(usize);

    impl burn::train::EarlyStoppingStrategy for StopAfter {
        fn should_stop(
            &mut self,
            epoch: usize,
            _: &burn::train::metric::store::EventStoreClient,
        ) -> bool {
            epoch >= self.0
        }
    }

    #[test]
    fn early_stopping_ends_the_run_where_burn_trains_ends() {
        let (start, _) = start();
        let dir = tempfile::tempdir().unwrap();
        let (plain, _) = trained(&start, dir.path(), item_loader(24, 8), |t| {
            t.num_epochs(3).early_stopping(StopAfter(2))
        });
        let (two, _) = trained(&start, dir.path(), item_loader(24, 8), |t| t.num_epochs(2));
        let (three, _) = trained(&start, dir.path(), item_loader(24, 8), |t| t.num_epochs(3));
        assert_eq!(plain, two, "burn-train stopped after epoch 2");
        assert_ne!(plain, three);
        let (ddp, error) = trained(&start, dir.path(), item_loader(24, 4), |t| {
            t.num_epochs(3)
                .early_stopping(StopAfter(2))
                .with_training_strategy(threads(2).into())
        });
        assert_eq!(error, None);
        assert!(close(&ddp, &plain), "\n{ddp:?}\n{plain:?}");
        assert!(!close(&ddp, &three));
    }

    #[test]
    fn the_learning_rate_steps_once_per_optimizer_step_as_burn_trains() {
        use burn::lr_scheduler::exponential::ExponentialLrSchedulerConfig;
        let (start, _) = start();
        // A learning rate halved at every scheduler step, windows of 2 micro-batches: stepped
        // per micro-batch it would decay twice as fast.
        let run = |train: Arc<dyn DataLoader<Batch>>, strategy: Option<DdpStrategy>| {
            let dir = tempfile::tempdir().unwrap();
            let scheduler = ExponentialLrSchedulerConfig::new(1e-2, 0.5).init().unwrap();
            let learner = Learner::new(start.clone(), AdamConfig::new().init(), scheduler);
            let mut training = SupervisedTraining::new(dir.path(), train, item_loader(8, 4))
                .num_epochs(2)
                .grads_accumulation(2)
                .with_application_logger(None);
            if let Some(strategy) = strategy {
                training = training.with_training_strategy(strategy.into());
            }
            let result = training.launch(learner);
            assert!(result.error.is_none(), "{:?}", result.error);
            result.model.values()
        };
        let plain = run(item_loader(32, 8), None);
        let ddp = run(item_loader(32, 4), Some(threads(2)));
        assert!(close(&ddp, &plain), "\n{ddp:?}\n{plain:?}");
    }

    #[test]
    fn accumulation_over_shards_that_end_a_batch_apart_steps_alike_on_every_rank() {
        use crate::fixtures::distributed_loader_of;
        let (start, _) = start();
        let device = crate::replica::tests::test_device();
        let dir = tempfile::tempdir().unwrap();
        // 5 items on 2 ranks, 2 a rank: rank 0 takes items 0, 2, 4 (two batches), rank 1 items
        // 1, 3 (one): the epoch's second step has rank 0's item 4 alone, as one device's batches
        // of 4 are [0, 1, 2, 3] and [4]. One window of 2: the epoch's last batch closes it on both
        // ranks, though rank 1's loader is done after its first.
        let (plain, error) = trained(&start, dir.path(), item_loader(5, 4), |t| {
            t.num_epochs(2).grads_accumulation(2)
        });
        assert_eq!(error, None);
        let sampler = crate::DistributedSampler::new(5, 2)
            .unwrap()
            .without_shuffle()
            .with_uneven_shards();
        let (ddp, error) = trained(
            &start,
            dir.path(),
            distributed_loader_of(sampler, 2, &device),
            |t| {
                t.num_epochs(2)
                    .grads_accumulation(2)
                    .with_training_strategy(threads(2).into())
            },
        );
        assert_eq!(error, None);
        assert!(close(&ddp, &plain), "\n{ddp:?}\n{plain:?}");
    }
}
