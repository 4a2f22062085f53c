//! Failures are errors that name the rank, never hangs.

use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::{DataLoader, DataLoaderIterator, Progress};
use burn::data::dataset::DatasetError;
use burn::tensor::Device;

use burn::optim::SgdConfig;

use burn::train::logger::InMemoryMetricLogger;
use burn::train::{Learner, SupervisedTraining, TrainStep};
use burn_ddp::comm::CommError;
use burn_ddp::config::Validation;
use burn_ddp::{
    DdpConfig, DdpError, DdpStrategy, DdpTraining, DistributedDataParallel, ProcessGroup,
    group::ThreadGroup,
};
use burn_ddp_tests::{
    Batch, DeeperMlp, Hooked, ItemBatcher, Mlp, Run, SilentRenderer, StepKind, device,
    materialized, over_tcp, run_training, synthetic_dataset,
};

#[test]
fn replicas_that_differ_fail_on_every_rank_before_the_first_all_reduce() {
    let groups = ThreadGroup::new_group(2).unwrap();
    let results: Vec<Result<(), DdpError>> = std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .map(|group| {
                s.spawn(move || {
                    let rank = group.rank();
                    let group: Arc<dyn ProcessGroup> = Arc::new(group);
                    let config = DdpConfig::default().with_timeout(Duration::from_secs(10));
                    if rank == 0 {
                        let model = Mlp::new(&device());
                        DistributedDataParallel::new(group, model, &device(), config).map(|_| ())
                    } else {
                        let model = DeeperMlp::new(&device());
                        DistributedDataParallel::new(group, model, &device(), config).map(|_| ())
                    }
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (rank, result) in results.into_iter().enumerate() {
        match result {
            Err(DdpError::ReplicaMismatch { rank: r, detail }) => {
                assert_eq!(r, rank);
                assert!(detail.contains("tensor #4"), "{detail}");
                assert!(detail.contains("rank 0 has no such tensor"), "{detail}");
                assert!(
                    detail.contains("rank 1 has a parameter of shape"),
                    "{detail}"
                );
                if rank == 1 {
                    assert!(detail.contains("`extra.weight`"), "{detail}");
                }
            }
            other => panic!("rank {rank}: expected ReplicaMismatch, got {other:?}"),
        }
    }
}

#[test]
fn a_rank_that_never_calls_the_all_reduce_is_named_within_the_timeout() {
    let timeout = Duration::from_secs(2);
    let groups = ThreadGroup::new_group(2).unwrap();
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let done_rx = std::sync::Mutex::new(done_rx);
    let results: Vec<Option<(Result<(), DdpError>, Duration)>> = std::thread::scope(|s| {
        let done_rx = &done_rx;
        let handles: Vec<_> = groups
            .into_iter()
            .map(|group| {
                let done_tx = done_tx.clone();
                s.spawn(move || {
                    let rank = group.rank();
                    let group: Arc<dyn ProcessGroup> = Arc::new(group);
                    let config = DdpConfig::default().with_timeout(timeout);
                    let model = Mlp::new(&device());
                    let (mut ddp, model) =
                        DistributedDataParallel::new(group, model, &device(), config).unwrap();
                    if rank == 1 {
                        // Alive but stuck: never calls the all-reduce; bounded wait for rank 0.
                        if let Ok(rx) = done_rx.lock() {
                            let _ = rx.recv_timeout(Duration::from_secs(20));
                        }
                        return None;
                    }
                    let data = synthetic_dataset(8, 1);
                    let batch: Batch = ItemBatcher.batch(data, &device());
                    let output = TrainStep::step(&model, batch);
                    let started = Instant::now();
                    let result = ddp.sync_gradients(&model, output.grads).map(|_| ());
                    let elapsed = started.elapsed();
                    let _ = done_tx.send(());
                    Some((result, elapsed))
                })
            })
            .collect();
        drop(done_tx);
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let (result, elapsed) = results[0].clone().expect("rank 0 reports");
    // The timeout, with generous room for a loaded 2-core machine (not a speed test).
    assert!(
        elapsed >= timeout && elapsed < timeout + Duration::from_secs(15),
        "rank 0 waited {elapsed:?} for a {timeout:?} timeout"
    );
    match result {
        Err(DdpError::Comm(CommError::Timeout {
            rank: 0,
            missing,
            op,
            ..
        })) => {
            assert_eq!(missing, vec![1]);
            // Thread replicas on one device exchange their gradient tensors by reference.
            assert_eq!(op.name(), "all_gather_shared");
        }
        other => panic!("expected a timeout naming rank 1, got {other:?}"),
    }
}

/// An MLP whose third training step panics on rank 1.
fn panicky() -> Hooked<Mlp> {
    Hooked::new(Mlp::new(&device()), |call| {
        if call.train_step_on(3, 1) {
            panic!("boom in the model at step {}", call.count);
        }
    })
}

#[test]
fn a_panicking_replica_stops_every_rank_and_is_named() {
    let started = Instant::now();
    let model = materialized(panicky());
    let mut run = Run::new(Some(2), 16, 20 * 16);
    // The backstop timeout is long: the failure must be reported at once, not by a timeout.
    run.config = DdpConfig::default().with_timeout(Duration::from_secs(120));
    let err = run_training(model, SgdConfig::new().init(), 0.05, &run).unwrap_err();
    match err {
        DdpError::WorkerPanicked { rank, message } => {
            assert_eq!(rank, 1);
            assert!(message.contains("boom in the model at step 3"), "{message}");
        }
        other => panic!("expected WorkerPanicked on rank 1, got {other}"),
    }
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "took {:?}",
        started.elapsed()
    );
}

/// A loader whose slices have different numbers of batches: 3 for the slice at 0, 2 elsewhere.
struct UnevenLoader {
    batches: usize,
}

struct UnevenIter {
    left: usize,
    total: usize,
}

impl Iterator for UnevenIter {
    type Item = Result<Batch, DatasetError>;
    fn next(&mut self) -> Option<Self::Item> {
        if self.left == 0 {
            return None;
        }
        self.left -= 1;
        Some(Ok(
            ItemBatcher.batch(synthetic_dataset(4, self.left as u64), &device())
        ))
    }
}

impl DataLoaderIterator<Batch> for UnevenIter {
    fn progress(&self) -> Progress {
        Progress::new((self.total - self.left) * 4, self.total * 4, None)
    }
}

impl DataLoader<Batch> for UnevenLoader {
    fn iter<'a>(&'a self) -> Box<dyn DataLoaderIterator<Batch> + 'a> {
        Box::new(UnevenIter {
            left: self.batches,
            total: self.batches,
        })
    }
    fn num_items(&self) -> usize {
        self.batches * 4 * 2
    }
    fn to_device(&self, _device: &Device) -> Arc<dyn DataLoader<Batch>> {
        Arc::new(UnevenLoader {
            batches: self.batches,
        })
    }
    fn slice(&self, start: usize, _end: usize) -> Arc<dyn DataLoader<Batch>> {
        Arc::new(UnevenLoader {
            batches: if start == 0 { 3 } else { 2 },
        })
    }
}

/// A training over [`UnevenLoader`] in `dir`, for a process of a multi-process job (between
/// processes a loader burn-ddp did not build is sliced: one device's batches cannot reach the
/// other processes in one order; thread ranks read it as one device does and cannot be uneven).
/// A macro: the training's components type is Burn's to name.
macro_rules! uneven_training {
    ($dir:expr) => {
        SupervisedTraining::new(
            std::env::temp_dir().join($dir),
            Arc::new(UnevenLoader { batches: 3 }),
            valid_loader(),
        )
        .renderer(Box::new(SilentRenderer))
        .with_metric_logger(InMemoryMetricLogger::new())
        .with_application_logger(None)
    };
}

#[test]
fn uneven_batches_are_an_error_naming_the_ranks_not_a_hang() {
    let model = materialized(Mlp::new(&device()));
    let results = over_tcp(2, |rank, group| {
        let learner = Learner::new(model.clone(), SgdConfig::new().init(), 0.05);
        let training = uneven_training!(format!("burn-ddp-tests-uneven-{rank}"));
        let strategy = DdpStrategy::with_process_group(device(), group);
        training.launch_ddp(learner, strategy).map(|_| ())
    });
    for (rank, result) in results.into_iter().enumerate() {
        match result.and_then(|trained| trained) {
            Err(DdpError::UnevenData {
                rank: named,
                step,
                exhausted,
                remaining,
                ..
            }) => {
                assert_eq!(named, rank);
                assert_eq!(step, 2, "ranks agree for steps 0 and 1");
                assert_eq!(exhausted, vec![1]);
                assert_eq!(remaining, vec![0]);
            }
            Err(other) => panic!("rank {rank}: expected UnevenData, got {other}"),
            Ok(()) => panic!("rank {rank}: uneven data must fail"),
        }
    }
}

#[test]
fn no_devices_and_bad_configuration_are_errors() {
    let model = materialized(Mlp::new(&device()));
    let mut run = Run::new(Some(2), 16, 64);
    run.config = DdpConfig::default().with_bucket_cap_bytes(0);
    let err = run_training(model.clone(), SgdConfig::new().init(), 0.05, &run).unwrap_err();
    assert!(
        matches!(err, DdpError::InvalidConfig(ref m) if m.contains("bucket_cap_bytes")),
        "{err}"
    );
    // No devices at all.
    let run = Run::new(Some(0), 16, 64);
    let err = run_training(model, SgdConfig::new().init(), 0.05, &run).unwrap_err();
    assert!(
        matches!(err, DdpError::InvalidConfig(ref m) if m.contains("at least one device")),
        "{err}"
    );
}

#[test]
fn plain_launch_panics_with_the_error_message() {
    // burn-train's `launch` has no Result: the failure surfaces as a panic carrying the error.
    let model = materialized(Mlp::new(&device()));
    let messages = over_tcp(2, |rank, group| {
        let learner = Learner::new(model.clone(), SgdConfig::new().init(), 0.05);
        let training = uneven_training!(format!("burn-ddp-tests-plain-launch-{rank}"))
            .with_training_strategy(DdpStrategy::with_process_group(device(), group).into());
        let payload = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            training.launch(learner);
        }))
        .expect_err("uneven data must fail");
        payload
            .downcast_ref::<String>()
            .cloned()
            .unwrap_or_default()
    });
    for message in messages {
        let message = message.unwrap();
        assert!(
            message.starts_with("burn-ddp: training failed: uneven data"),
            "{message}"
        );
    }
}

fn valid_loader() -> Arc<dyn DataLoader<Batch>> {
    burn::data::dataloader::DataLoaderBuilder::new(ItemBatcher)
        .batch_size(4)
        .build(burn::data::dataset::InMemDataset::new(synthetic_dataset(
            8, 2,
        )))
}

/// An MLP whose validation panics on ranks 0 and 1 (thread names; rank 0 runs validation alone
/// in `Rank0` mode, and fails there).
fn fails_validation() -> Hooked<Mlp> {
    Hooked::new(Mlp::new(&device()), |call| {
        if call.kind == StepKind::Valid && (call.on_rank(0) || call.on_rank(1)) {
            panic!("validation failed on {}", call.thread);
        }
    })
}

#[test]
fn a_failure_in_rank_0_validation_releases_the_waiting_ranks() {
    let started = Instant::now();
    let model = materialized(fails_validation());
    let mut run = Run::new(Some(3), 12, 4 * 12);
    // The others wait in the end-of-epoch all-gather; the abort must free them long before this.
    run.config = DdpConfig::default()
        .with_epoch_end_timeout(Duration::from_secs(600))
        .with_validation(Validation::Rank0);
    let err = run_training(model, SgdConfig::new().init(), 0.05, &run).unwrap_err();
    match err {
        DdpError::WorkerPanicked { rank, message } => {
            assert_eq!(rank, 0);
            assert!(message.contains("validation failed"), "{message}");
        }
        other => panic!("expected WorkerPanicked on rank 0, got {other}"),
    }
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "took {:?}",
        started.elapsed()
    );
}

#[test]
fn a_failure_in_one_rank_s_validation_shard_is_named_and_releases_the_others() {
    let started = Instant::now();
    let model = materialized(fails_validation());
    let mut run = Run::new(Some(3), 12, 4 * 12);
    run.config = DdpConfig::default().with_epoch_end_timeout(Duration::from_secs(600));
    let err = run_training(model, SgdConfig::new().init(), 0.05, &run).unwrap_err();
    match err {
        // Rank 0 and rank 1 fail in their shards; rank 2's shard validates.
        DdpError::WorkerPanicked { rank, message } => {
            assert!(rank <= 1, "rank {rank}: {message}");
            assert!(message.contains("validation failed"), "{message}");
        }
        other => panic!("expected WorkerPanicked, got {other}"),
    }
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "took {:?}",
        started.elapsed()
    );
}

/// The MLP, whose validation step panics on rank 1's thread (thread ranks and TCP test ranks
/// are named `burn-ddp-rank-R`).
fn fails_validating_on_rank_1() -> Hooked<Mlp> {
    Hooked::new(Mlp::new(&device()), |call| {
        if call.kind == StepKind::Valid && call.on_rank(1) {
            panic!("rank 1 fails while validating");
        }
    })
}

#[test]
fn a_rank_that_fails_alone_while_validating_stops_every_rank_at_once_naming_it() {
    let model = materialized(fails_validating_on_rank_1());
    let config = DdpConfig::default()
        .with_timeout(Duration::from_secs(60))
        .with_epoch_end_timeout(Duration::from_secs(60));
    // Threads (3 ranks: rank 2 finishes its validation normally while rank 1 fails).
    let started = Instant::now();
    let mut run = Run::new(Some(3), 12, 4 * 12);
    run.config = config.clone();
    match run_training(model.clone(), SgdConfig::new().init(), 0.1, &run) {
        Err(DdpError::WorkerPanicked { rank, message }) => {
            assert_eq!(rank, 1, "{message}");
            assert!(message.contains("fails while validating"), "{message}");
        }
        other => panic!("expected rank 1's panic, got {:?}", other.map(|_| ())),
    }
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "{:?}",
        started.elapsed()
    );
    // TCP ranks: rank 1 fails, and the others learn it from the group, not from a timeout.
    let started = Instant::now();
    let results = burn_ddp_tests::over_tcp(3, |_, group| {
        let mut run = Run::new(None, 12, 4 * 12);
        run.group = Some(group);
        run.config = config.clone();
        run_training(model.clone(), SgdConfig::new().init(), 0.1, &run).map(|_| ())
    });
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "{:?}",
        started.elapsed()
    );
    for (rank, result) in results.into_iter().enumerate() {
        match (rank, result.unwrap()) {
            (1, Err(DdpError::WorkerPanicked { rank: 1, .. })) => {}
            (0 | 2, Err(err)) => assert!(
                err.to_string().contains("rank 1"),
                "rank {rank}: the error names rank 1: {err}"
            ),
            (rank, other) => panic!("rank {rank}: {:?}", other),
        }
    }
}
