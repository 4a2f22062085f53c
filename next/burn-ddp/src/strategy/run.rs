//! How a run is set up and finished: the loaders checked and cut into shards, the resume, the
//! validation mode, one [`Trainer`] per rank of this process (rank 0 with burn-train's
//! components), and the reports filed at the end. What the user builds is in `mod.rs`.

use std::sync::Arc;
use std::sync::mpsc;

use burn::tensor::Device;
use burn::train::{
    Learner, LearnerModel, SupervisedTrainingEventProcessor, TrainLoader, TrainingComponents,
    ValidLoader,
};

use super::dealer::Dealer;
use super::epoch::{Buffers, Trainer};
use super::events::Events;
use super::metrics_file::MetricsFile;
use super::rank::{Leader, Part, Role};
use super::sharded::RecordReader;
use super::shards::{Cut, train_loaders};
use super::validation::ValidShard;
use super::worker::run_all;
use super::{DdpStrategy, lock, rank, startup};
use crate::checkpoint::{Checkpoints, Resume, Resuming, StepCheckpointer};
use crate::config::{UnevenInputs, Validation};
use crate::error::{DdpError, Result};
use crate::metrics::TrainingReport;
use burn_ddp_comm::group::{ProcessGroup, ThreadGroup};

/// Rank 0's model and event processor, and the error that stopped training, if any.
type RunOutcome<M> = (M, SupervisedTrainingEventProcessor<M>, Option<DdpError>);

/// What the strategy checked and cut before any rank starts: the ranks this process runs (with
/// their groups), their training loaders and how they were cut, and the loaders as the ranks
/// compare them.
struct Prepared<M: LearnerModel> {
    local: Vec<(usize, Arc<dyn ProcessGroup>)>,
    shards: Vec<TrainLoader<M>>,
    /// How the training loaders were cut.
    cut: Cut,
    loaders: startup::Startup,
}

/// Why rank 0 validates alone although validation is sharded: one device's validation batches
/// cannot reach every rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Alone {
    /// Processes, and a validation output type burn-ddp cannot send between them.
    NotSendable,
    /// Thread replicas on several devices: a batch is built on one device.
    SeveralDevices,
    /// Thread replicas on a backend whose tensors belong to the thread that made them (wgpu,
    /// CUDA: Burn 0.21's fusion loses track of a handle another thread uses).
    ThreadHandles,
    /// Processes, and a validation loader other than a `DistributedDataLoader`: each process
    /// builds one device's batches from its own copy, and such a loader's order may differ
    /// between them (Burn's workers hand batches out as they finish them).
    OrderBetweenProcesses,
}

impl Alone {
    /// Why sharded validation of `world_size > 1` replicas falls back to rank 0, if it does:
    /// threads of this process or not, on `devices`, with a codec for the output type or not,
    /// with a validation `DistributedDataLoader` (`valid_loader != 0`) or not.
    fn of(threads: bool, devices: &[Device], sendable: bool, valid_loader: u64) -> Option<Self> {
        if threads {
            if !devices.windows(2).all(|pair| pair[0] == pair[1]) {
                Some(Alone::SeveralDevices)
            } else if !devices
                .first()
                .is_some_and(crate::replica::shares_plain_values)
            {
                Some(Alone::ThreadHandles)
            } else {
                None
            }
        } else if !sendable {
            Some(Alone::NotSendable)
        } else if valid_loader == 0 {
            Some(Alone::OrderBetweenProcesses)
        } else {
            None
        }
    }

    /// The start-up warning: why, and what shards validation there.
    fn warning(self, output_type: &str) -> String {
        let (why, instead) = match self {
            Alone::NotSendable => (
                format!(
                    "the validation output type ({output_type}) is not one burn-ddp can send \
                     between processes"
                ),
                "an output type of burn_ddp::outputs::DistributedOutput (Burn's classification \
                 and regression outputs are)",
            ),
            Alone::SeveralDevices => (
                "thread replicas on several devices cannot validate one device's batches".into(),
                "one process per device (burn-ddp run)",
            ),
            Alone::ThreadHandles => (
                "thread replicas on this backend cannot use a batch another thread built".into(),
                "one process per device (burn-ddp run)",
            ),
            Alone::OrderBetweenProcesses => (
                "the validation loader is not a DistributedDataLoader, whose order every \
                 process can rebuild"
                    .into(),
                "a DistributedDataLoader of world size 1 for validation \
                 (DistributedSampler::new(len, 1).without_shuffle())",
            ),
        };
        format!(
            "{why}: rank 0 validates the whole set alone, as one device does, while the others \
             wait; to share it out, use {instead}"
        )
    }
}

/// What every rank of this process starts from.
struct Start<M: LearnerModel> {
    learner: Learner<M>,
    resume: Resume,
    loaders: startup::Startup,
    run_id: String,
    /// The run's checkpoints (with a checkpoint directory).
    checkpoints: Option<Checkpoints>,
    interrupter: burn::train::Interrupter,
    grad_accumulation: usize,
    epochs: std::ops::RangeInclusive<usize>,
}

impl DdpStrategy {
    /// One training run: checks and shards, the resume, the ranks built and run, their reports.
    pub(super) fn run<M: LearnerModel + Send + 'static>(
        &self,
        components: TrainingComponents<M>,
        learner: Learner<M>,
        dataloader_train: TrainLoader<M>,
        dataloader_valid: ValidLoader<M>,
        starting_epoch: usize,
    ) -> Result<RunOutcome<M>> {
        let world_size = self.world_size();
        // Stop signals are recorded (not fatal) while the run lasts, so every rank can stop at
        // the same step and rank 0 can write a checkpoint of it.
        let _signals = self
            .config
            .stop_on_signal()
            .then(burn_ddp_comm::signals::arm);
        let accumulation = components.grad_accumulation.unwrap_or(1);
        let prepared = self.prepare::<M>(&dataloader_train, &dataloader_valid, accumulation);
        let Prepared {
            local,
            shards,
            cut,
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
        let identity = burn_ddp_comm::auth::JobIdentity::from_env(&run_id).ok();
        let key = identity.as_ref().and_then(|job| job.checkpoint_key());
        let checkpoints = self
            .config
            .checkpoint_dir()
            .map(|dir| Checkpoints::of(dir, &run_id, key.clone(), self.config.ledger().clone()));
        let resumed = crate::checkpoint::prepare(
            &self.config,
            &learner,
            components.checkpointer.as_ref(),
            starting_epoch,
            &Resuming {
                run_id: &run_id,
                key: key.as_ref(),
                restarted: self.restarted,
                rank: first_rank,
                world_size,
            },
        );
        // A checkpoint loaded here is read by every replica's thread (each copies it): the
        // loading must have run.
        let resumed = resumed.and_then(|(loaded, resume)| {
            if loaded.is_some() {
                crate::replica::sync_device(
                    first_rank,
                    &self.devices[0],
                    "loading the checkpoint",
                )?;
            }
            Ok((loaded, resume))
        });
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
        let ranks: Vec<usize> = local.iter().map(|(rank, _)| *rank).collect();
        let valid_shard = self.valid_shard::<M>(&dataloader_valid, &ranks, loaders.valid_loader);
        let start = Start {
            learner,
            loaders,
            run_id,
            checkpoints,
            interrupter: components.interrupter.clone(),
            grad_accumulation: accumulation.max(1),
            epochs: resume.starting_epoch..=components.num_epochs,
            resume,
        };
        let trainers = self.trainers::<M>(
            local,
            (shards, cut),
            components,
            &dataloader_valid,
            valid_shard,
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
    fn prepare<M: LearnerModel + Send + 'static>(
        &self,
        dataloader_train: &TrainLoader<M>,
        dataloader_valid: &ValidLoader<M>,
        accumulation: usize,
    ) -> Result<Prepared<M>> {
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
        // set, is refused before anything starts. (Nothing but `num_items` is called on the
        // loaders before their one copy: a Burn loader's `slice` and `to_device` advance its
        // shuffling generator.)
        let train_loader = crate::sampler::check_loader(
            &**dataloader_train,
            crate::sampler::Purpose::Training { world_size },
        )?;
        let valid_loader =
            crate::sampler::check_loader(&**dataloader_valid, crate::sampler::Purpose::Validation)?;
        let ranks: Vec<usize> = local.iter().map(|(rank, _)| *rank).collect();
        let devices = &self.devices[..ranks.len().min(self.devices.len())];
        let distributed = train_loader != 0;
        let cut = Cut::of(
            distributed,
            join,
            world_size,
            self.process_group.is_none(),
            devices,
        );
        let shards = train_loaders::<M>(
            dataloader_train,
            (cut, distributed),
            &local,
            world_size,
            devices,
            self.config.timeout(),
        )?;
        let loaders = startup::Startup {
            epochs: (0, 0),
            resumed_batches: 0,
            counters: (0, 0),
            settings: 0,
            train_items: dataloader_train.num_items() as u64,
            train_loader,
            valid_items: dataloader_valid.num_items() as u64,
            // Compared where validation is to be shared out (processes that would not all shard
            // it would meet in other collectives); with `Validation::Rank0` only rank 0's counts.
            valid_loader: match self.config.validation() {
                Validation::Sharded => valid_loader,
                Validation::Rank0 => 0,
            },
        };
        Ok(Prepared {
            local,
            shards,
            cut,
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
            burn_ddp_comm::log::info_console(&start);
        } else {
            tracing::info!("burn-ddp: {start}");
        }
    }

    /// Sharded validation's pass over the validation loader, dealt to this process's `ranks`
    /// (`None`: rank 0 validates alone, with a warning at start-up on rank 0 where validation
    /// was to be sharded); and on rank 0 the warning about a training output type burn-ddp
    /// cannot join. `valid_loader`: the validation `DistributedDataLoader`'s fingerprint (0:
    /// another loader).
    fn valid_shard<M: LearnerModel + Send + 'static>(
        &self,
        dataloader_valid: &ValidLoader<M>,
        ranks: &[usize],
        valid_loader: u64,
    ) -> Option<ValidShard<M>> {
        let world_size = self.world_size();
        let threads = self.process_group.is_none();
        let first_rank = ranks.first().copied().unwrap_or(0);
        let codec = crate::outputs::codec::<rank::ValidOutput<M>>();
        if world_size > 1 && first_rank == 0 {
            let probe = Events::<M>::new(threads, self.config.metrics_every(), world_size);
            if !probe.joins_training() {
                burn_ddp_comm::log::warn_console(&format!(
                    "the training output type ({}) is not one burn-ddp can join \
                     (burn_ddp::outputs::DistributedOutput): {}",
                    std::any::type_name::<rank::ModelOutput<M>>(),
                    if threads {
                        "every replica's item is reported on its own (one renderer line per \
                         replica and step)"
                    } else {
                        "the training metrics cover rank 0's samples only"
                    }
                ));
            }
        }
        if world_size == 1 || self.config.validation() != Validation::Sharded {
            return None;
        }
        let devices = &self.devices[..ranks.len().min(self.devices.len())];
        let alone = Alone::of(threads, devices, codec.is_some(), valid_loader);
        if let Some(alone) = alone {
            if first_rank == 0 {
                burn_ddp_comm::log::warn_console(
                    &alone.warning(std::any::type_name::<rank::ValidOutput<M>>()),
                );
            }
            return None;
        }
        // Validation runs without autodiff, on the inner device, as burn-train's loop runs it.
        let device = devices[0].clone().inner();
        Some(ValidShard {
            dealer: Dealer::new(dataloader_valid, &device, world_size, ranks.to_vec()),
            codec,
        })
    }

    /// One trainer per rank of this process: rank 0 takes burn-train's components (the leader),
    /// the other ranks send it their items (threads) or hand this process's event processor
    /// back unused (processes).
    fn trainers<M: LearnerModel + Send + 'static>(
        &self,
        local: Vec<(usize, Arc<dyn ProcessGroup>)>,
        (shards, cut): (Vec<TrainLoader<M>>, Cut),
        components: TrainingComponents<M>,
        dataloader_valid: &ValidLoader<M>,
        valid_shard: Option<ValidShard<M>>,
        start: Start<M>,
    ) -> Vec<Trainer<M>> {
        let world_size = self.world_size();
        let threads = self.process_group.is_none();
        let (sender, receiver) = mpsc::channel::<Part<M>>();
        let mut receiver = Some(receiver);
        let mut processor = Some(components.event_processor);
        // Every rank's optimizer-record reader needs burn-train's store (unused).
        let event_store = components.event_store.clone();
        let epoch_checkpoints = components.checkpointer.is_some();
        let interrupter = components.interrupter.clone();
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
                        interrupter: interrupter.clone(),
                        // Rank 0's one copy, as one device makes its own (without autodiff).
                        dataloader_valid: valid_shard
                            .is_none()
                            .then(|| dataloader_valid.to_device(&device.clone().inner())),
                        checkpointer,
                        checkpoints: start
                            .checkpoints
                            .as_ref()
                            .map(|c| (c.clone(), StepCheckpointer::new(c))),
                        early_stopping,
                        event_store,
                        items: receiver.take().unwrap_or_else(|| mpsc::channel().1),
                        metrics_file: self.config.metrics_file().map(MetricsFile::new),
                    })),
                    (_, Some(event_processor), _) => Role::Silent(Box::new(event_processor)),
                    _ => Role::Follower(sender.clone()),
                };
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
                    buffers: Buffers::of(world_size, threads),
                    resume: start.resume,
                    events: Events::new(threads, self.config.metrics_every(), world_size),
                    loaders: start.loaders,
                    run_id: start.run_id.clone(),
                    valid_shard: valid_shard.clone(),
                    cut,
                    sharded: None,
                    epoch_checkpoints,
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
                burn_ddp_comm::log::to_stderr(&report.to_string());
            }
        }
        if let (Some(path), 0) = (self.config.metrics_file(), first_rank) {
            MetricsFile::new(path).ranks(&lock(&self.report));
        }
    }
}

impl DdpStrategy {
    /// A multi-process run that fails before its workers start aborts its process group, so the
    /// other processes fail at once instead of waiting for this one until their timeout.
    fn abort_peers(&self, err: &DdpError) {
        if let Some(group) = &self.process_group {
            group.abort(&err.to_string());
        }
    }
}
