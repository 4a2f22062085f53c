//! The ranks of a [`DdpStrategy`](super::DdpStrategy) run: who each one is (its role), its
//! thread and lifecycle (set-up, start-up checks, training, failure), and how the strategy
//! collects their results, naming the root cause when several fail.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::mpsc;
use std::time::Instant;

use burn::train::{LearnerModel, SupervisedTrainingEventProcessor};

use super::epoch::{Buffers, Trainer};
use super::rank::{ModelOutput, Role, ValidOutput};
use super::startup::Startup;
use crate::ddp::DistributedDataParallel;
use burn_ddp_comm::CommError;

use super::lock;
use crate::error::{DdpError, Result};
use crate::metrics::RankReport;
use burn_ddp_comm::group::{CountingGroup, Counts};

/// What a rank's thread gives back: its counters and, on rank 0, burn-train's components.
pub(super) struct Finished<M: LearnerModel> {
    pub result: Result<()>,
    pub report: RankReport,
    pub leader: Option<(M, SupervisedTrainingEventProcessor<M>)>,
}

/// Trains this rank to the end (or its failure), catching panics.
pub(super) fn run<M: LearnerModel + Send + 'static>(mut trainer: Trainer<M>) -> Finished<M>
where
    ModelOutput<M>: 'static,
    ValidOutput<M>: 'static,
{
    // `burn_ddp::rank()` in user code on this thread (a train step, a metric) answers this rank.
    let _rank = crate::context::enter_rank(trainer.rank, trainer.group.world_size());
    let mut report = RankReport {
        rank: trainer.rank,
        ..RankReport::default()
    };
    let mut model_out = None;
    let result = std::panic::catch_unwind(AssertUnwindSafe(|| {
        train(&mut trainer, &mut report, &mut model_out)
    }));
    let result = match result {
        Ok(result) => result,
        // SyncBatchNorm's collectives raise their errors as panics carrying the error.
        Err(payload) => match payload.downcast::<DdpError>() {
            Ok(err) => Err(*err),
            Err(payload) => Err(DdpError::WorkerPanicked {
                rank: trainer.rank,
                message: crate::error::panic_message(payload.as_ref()),
            }),
        },
    };
    match &result {
        // Every rank stopped at the same step: nothing to abort.
        Err(err @ DdpError::Preempted { .. }) => {
            tracing::warn!("burn-ddp: rank {}: {err}", trainer.rank);
        }
        Err(err) => {
            tracing::error!("burn-ddp: rank {} failed: {err}", trainer.rank);
            // Peers must not wait for this rank: fail their collectives at once.
            trainer.group.abort(&err.to_string());
        }
        Ok(()) => {}
    }
    let model = || model_out.unwrap_or_else(|| trainer.learner.model());
    let leader = match trainer.role {
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

fn train<M: LearnerModel + Send + 'static>(
    trainer: &mut Trainer<M>,
    report: &mut RankReport,
    model_out: &mut Option<M>,
) -> Result<()>
where
    ModelOutput<M>: 'static,
    ValidOutput<M>: 'static,
{
    // CUDA replicas reduce with NCCL, in GPU memory (the host group bootstraps it).
    trainer.group = super::device_group::group_for_device(
        trainer.group.clone(),
        &trainer.device,
        trainer.config.timeout(),
    )?;
    // Every collective of this rank from here on is counted, with its bytes
    // (RankReport::step_collectives, step_bus_bytes).
    let collectives = Arc::new(Counts::default());
    trainer.group = Arc::new(CountingGroup::new(
        trainer.group.clone(),
        collectives.clone(),
    ));
    // SyncBatchNorm layers synchronise with this rank's group.
    let _current =
        crate::sync_bn::enter_process_group(trainer.group.clone(), trainer.config.timeout());
    trainer.learner.fork(&trainer.device);
    if trainer.resume.resumed() && trainer.buffers == Buffers::Shared {
        // The checkpoint was loaded once, on the main thread, for every replica of the process
        // (a single replica, as a process of its own, trains on that thread: nothing shared).
        super::owned::own_learner(
            &mut trainer.learner,
            &mut trainer.records,
            trainer.rank,
            trainer.config.timeout(),
        )?;
    }
    if trainer.buffers == Buffers::Shared {
        // Thread replicas share BatchNorm's running statistics (Burn's `RunningState`), which
        // the resume above writes and the layout's buffer probe below marks and restores: no
        // rank probes before every rank has loaded (a probe that saw another rank's load as its
        // own marker overwritten took a buffer for a frozen weight, and its restore could undo
        // a load).
        trainer.group.barrier(trainer.config.timeout())?;
    }
    // Check the replicas and start from rank 0's parameters and buffers.
    let (mut ddp, model) = DistributedDataParallel::for_replica(
        trainer.group.clone(),
        trainer.learner.model(),
        &trainer.device,
        trainer.config.clone(),
    )?;
    trainer.learner.load_model(model.into_record());
    if trainer.buffers == Buffers::Shared {
        // Every replica wrote the start-up values into the buffers the threads share.
        ddp.settle_shared_buffers(&trainer.learner.model())?;
    }
    if let Some(shards) = ddp.optimizer_shards() {
        trainer.sharded = Some(super::sharded::Sharded::start(
            shards.clone(),
            trainer.resume.resumed(),
            &mut trainer.records,
            &mut trainer.learner,
            trainer.config.timeout(),
        )?);
    }
    // Processes resuming from different checkpoints would train different steps, and
    // different settings or data would diverge or call different collectives.
    Startup {
        epochs: (*trainer.epochs.start() as u64, *trainer.epochs.end() as u64),
        resumed_batches: trainer.resume.batches as u64,
        counters: (
            trainer.resume.synchronisations,
            trainer.resume.optimizer_steps,
        ),
        settings: trainer.config.semantics_fingerprint()
            ^ trainer.grad_accumulation as u64
            ^ sharded_checkpoints(trainer),
        ..trainer.loaders
    }
    .compare(
        trainer.group.as_ref(),
        trainer.config.timeout(),
        &trainer.config,
    )?;
    let result = trainer.train_epochs(&mut ddp, report, &collectives);
    // Counters also on failure: they tell how far the rank got.
    report.comm = ddp.comm_stats().clone();
    report.peak_memory = crate::monitor::peak_resident_bytes();
    // A device's memory is not reported on Burn 0.22 yet (CubeCL 0.11's client reports it
    // otherwise than 0.10's): `None`, as on the CPU.
    report.device_memory = None;
    result?;
    if trainer.sharded.is_some() {
        // This rank's share (reading it copies it to the host: only where it tells something).
        report.optimizer_state = trainer
            .records
            .state_bytes(&trainer.learner, trainer.config.timeout());
    }
    if !trainer.events.threads && trainer.group.world_size() > 1 {
        gather_reports(trainer, report);
    }
    // The trained model leaves this thread: the work behind its tensors must have run (see
    // `handoff.rs`), or the caller reads parameters the last steps have not written yet.
    crate::replica::sync_device(trainer.rank, &trainer.device, "the last optimizer step")?;
    *model_out = Some(trainer.learner.model());
    Ok(())
}

/// Under optimizer sharding every rank joins rank 0's checkpoints (it sends its share of the
/// optimizer state), so whether checkpoints are written (burn-train's file checkpointer, a
/// checkpoint directory) must be the same on every rank: a word for the start-up comparison.
fn sharded_checkpoints<M: LearnerModel>(trainer: &Trainer<M>) -> u64 {
    if !trainer.config.optimizer_sharding() {
        return 0;
    }
    let flags = 1
        + u64::from(trainer.epoch_checkpoints)
        + 2 * u64::from(trainer.config.checkpoint_dir().is_some());
    flags.wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// Process mode: every process's report goes to rank 0's summary (one all-gather after the
/// last epoch). Training is done, so a failure here is a warning, not the run's error.
fn gather_reports<M: LearnerModel>(trainer: &Trainer<M>, report: &RankReport) {
    let words = report.to_words();
    match trainer
        .group
        .all_gather(&words, trainer.config.timeout())
        .map(|all| {
            all.chunks(RankReport::WORDS)
                .filter_map(RankReport::from_words)
                .collect::<Vec<_>>()
        }) {
        Ok(ranks) if trainer.rank == 0 => lock(&trainer.report).ranks = ranks,
        Ok(_) => {}
        Err(err) => tracing::warn!(
            "burn-ddp: rank {}: the other processes' reports could not be gathered for the \
             summary (training itself completed; the process group is aborted now and cannot \
             be used again): {err}",
            trainer.rank
        ),
    }
}

/// Every rank's report, rank 0's model and event processor, and the root cause of a failure.
pub(super) type Collected<M> = (
    Vec<RankReport>,
    Option<(M, SupervisedTrainingEventProcessor<M>)>,
    Option<DdpError>,
);

/// Runs `workers` (one thread each; a single one on the calling thread) and collects what they
/// give back: every rank's report, rank 0's model and event processor, and the root cause when
/// ranks failed. Returns `None` for rank 0's parts when its thread could not start or is stuck.
pub(super) fn run_all<M: LearnerModel + Send + 'static>(
    workers: Vec<Trainer<M>>,
    grace: std::time::Duration,
) -> Collected<M>
where
    ModelOutput<M>: 'static,
    ValidOutput<M>: 'static,
{
    // Plain (not scoped) threads: if a rank is stuck in user code after another failed,
    // `fit` must still return the error instead of joining it forever.
    let (done_tx, done_rx) = mpsc::channel::<(usize, Finished<M>)>();
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
            let _ = done_tx.send((rank, run(worker)));
            continue;
        }
        let done_tx = done_tx.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("burn-ddp-rank-{rank}"))
            .spawn(move || {
                let _ = done_tx.send((rank, run(worker)));
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

/// The error to report when several ranks failed: a panic or a local error first, then a
/// timeout, then a peer that left, then an abort (which only repeats an earlier failure); a stop
/// by signal only when nothing else went wrong. Between errors of one kind, the lowest rank's
/// (rank 0 writes checkpoints and names their files).
fn root_cause(errors: Vec<(usize, DdpError)>) -> Option<DdpError> {
    let weight = |e: &DdpError| match e {
        DdpError::WorkerPanicked { .. } => 0,
        DdpError::Preempted { .. } => 5,
        DdpError::Comm(CommError::Aborted { .. }) => 4,
        DdpError::Comm(CommError::PeerLeft { .. }) => 3,
        DdpError::Comm(CommError::Timeout { .. })
        | DdpError::Unresponsive { .. }
        | DdpError::LoaderStalled { .. } => 2,
        _ => 1,
    };
    errors
        .into_iter()
        .min_by_key(|(rank, e)| (weight(e), *rank))
        .map(|(_, e)| e)
}
