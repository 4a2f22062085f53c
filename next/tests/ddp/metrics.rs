//! What burn-train's renderer and metrics see under `DdpStrategy`: one item per step covering the
//! global batch, with one device's progress, and validation sharded across the ranks with metrics equal
//! to single-device validation on the whole set; in thread and in process mode.

use std::collections::BTreeMap;
use std::sync::Mutex;

use burn::optim::SgdConfig;

use burn_ddp::config::Validation;
use burn_ddp_tests::{
    Hooked, Mlp, Recording, Run, SplitSeen, StepKind, TrainKind, ValidKind, device, materialized,
    over_tcp, run_training,
};

/// Validation batches per thread name (rank threads are named `burn-ddp-rank-R`).
static VALIDATED: Mutex<BTreeMap<String, usize>> = Mutex::new(BTreeMap::new());

/// What `burn_ddp::rank()` and `world_size()` answered in train steps, per thread name.
static TRAINED_BY: Mutex<BTreeMap<String, std::collections::BTreeSet<(usize, usize)>>> =
    Mutex::new(BTreeMap::new());

/// The tests of this module one at a time (their rank threads have the same names).
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// The MLP, recording what `rank()` and `world_size()` answer in its training steps and
/// counting its validation batches, per thread.
type Counting = Hooked<Mlp>;

fn counting() -> Counting {
    Hooked::new(Mlp::new(&device()), |call| {
        let thread = call.thread.to_string();
        match call.kind {
            StepKind::Train => {
                if let Ok(mut seen) = TRAINED_BY.lock() {
                    seen.entry(thread)
                        .or_default()
                        .insert((burn_ddp::rank(), burn_ddp::world_size()));
                }
            }
            StepKind::Valid => {
                if let Ok(mut counts) = VALIDATED.lock() {
                    *counts.entry(thread).or_default() += 1;
                }
            }
        }
    })
}

/// Trains (or, with `lr` 0, only validates) the MLP and returns what rank 0's renderer saw:
/// on one device (`ranks` 0), on `ranks` threads, or on `ranks` TCP "processes".
fn seen(
    model: &Counting,
    ranks: usize,
    tcp: bool,
    mut run: Run,
    lr: f64,
) -> (SplitSeen, SplitSeen) {
    let model = model.clone();
    if tcp {
        let recordings = over_tcp(ranks, |_, group| {
            let mut run = Run {
                group: Some(group),
                recording: Some(Recording::default()),
                ..run.clone()
            };
            run.replicas = None;
            let recording = run.recording.clone().unwrap();
            run_training(model.clone(), SgdConfig::new().init(), lr, &run).unwrap();
            recording.seen()
        });
        return recordings.into_iter().next().unwrap().unwrap();
    }
    run.replicas = (ranks > 0).then_some(ranks);
    let recording = Recording::default();
    run.recording = Some(recording.clone());
    run_training(model, SgdConfig::new().init(), lr, &run).unwrap();
    recording.seen()
}

/// An item's metrics: name, value, count.
type Metrics = Vec<(String, f64, usize)>;

/// Every validation item's epoch and metrics, in the order rank 0 reported them.
fn valid_items(valid: &SplitSeen) -> Vec<(usize, Metrics)> {
    valid
        .items
        .iter()
        .map(|item| (item.epoch, item.metrics.clone()))
        .collect()
}

#[test]
fn validation_with_burns_shuffled_loader_gives_one_devices_items_in_every_mode() {
    let _alone = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    // The loader: `DataLoaderBuilder::new(batcher).batch_size(4).shuffle(seed)`, 10
    // items (a short last batch), learning rate 0 so that only validation differs; two epochs,
    // each a new order of the loader's generator.
    let model = materialized(counting());
    let mut run = Run::new(None, 12, 24);
    run.epochs = 2;
    run.valid = ValidKind::BurnShuffled;
    run.valid_samples = Some(10);
    run.valid_batch = 4;
    // Precision, recall and F1 too: they depend on which items meet in a batch.
    run.all_metrics = true;
    let (_, single) = seen(&model, 0, false, run.clone(), 0.0);
    let expected = valid_items(&single);
    assert_eq!(expected.len(), 6, "3 batches per epoch, 2 epochs");
    // The loader does shuffle, and differently each epoch: otherwise this test proves nothing.
    let losses = |epoch| -> Vec<f64> {
        expected
            .iter()
            .filter(|(e, _)| *e == epoch)
            .flat_map(|(_, m)| m.iter().filter(|(n, ..)| n == "Loss").map(|(_, v, _)| *v))
            .collect()
    };
    assert_ne!(
        losses(1),
        losses(2),
        "one device's two epochs validate other batches"
    );
    // Sharded on thread ranks; between processes a Burn loader is validated on rank 0 alone
    // (its order may differ between processes), which must be one device's validation too.
    for (ranks, tcp, validation) in [
        (2, false, Validation::Sharded),
        (3, false, Validation::Sharded),
        (2, true, Validation::Sharded),
        (3, true, Validation::Sharded),
        (2, false, Validation::Rank0),
        (2, true, Validation::Rank0),
    ] {
        let mut run = run.clone();
        run.config = run.config.clone().with_validation(validation);
        let (_, valid) = seen(&model, ranks, tcp, run, 0.0);
        let got = valid_items(&valid);
        assert_eq!(
            got.len(),
            expected.len(),
            "{ranks} ranks (tcp: {tcp}, {validation:?})"
        );
        for (at, ((epoch, got), (_, want))) in got.iter().zip(&expected).enumerate() {
            let same = got.len() == want.len()
                && got
                    .iter()
                    .zip(want)
                    .all(|(g, w)| g.0 == w.0 && g.2 == w.2 && close(g.1, w.1, 1e-6));
            assert!(
                same,
                "{ranks} ranks (tcp: {tcp}, {validation:?}): validation item {at} of epoch \
                 {epoch} is {got:?}, one device's {want:?}"
            );
        }
    }
}

/// A training item's progress (items processed, items in all) and loss.
type TrainItem = ((usize, usize), Vec<f64>);

/// Every training item's progress and loss, in the order rank 0 reported them.
fn train_items(train: &SplitSeen) -> Vec<TrainItem> {
    train
        .items
        .iter()
        .map(|item| {
            let losses = item
                .metrics
                .iter()
                .filter(|(name, ..)| name == "Loss")
                .map(|(_, value, _)| *value)
                .collect();
            (item.progress, losses)
        })
        .collect()
}

#[test]
fn training_with_a_burn_loader_reports_one_devices_items_and_progress() {
    let _alone = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    // Burn's shuffled loader of the per-replica batch, 100 items: one device trains batches of
    // 24 (the last of 4), N thread ranks batches of 24 / N dealt in turn; burn-train must see
    // the same items with the same progress (items processed of 100) and losses.
    let model = materialized(counting());
    let mut run = Run::new(None, 24, 100);
    run.epochs = 2;
    run.train = TrainKind::Burn;
    let (single, _) = seen(&model, 0, false, run.clone(), 0.05);
    let expected = train_items(&single);
    assert_eq!(expected.len(), 10, "5 steps per epoch, 2 epochs");
    assert_eq!(expected[4].0, (100, 100), "the epoch's last step");
    for ranks in [2, 3] {
        let (train, _) = seen(&model, ranks, false, run.clone(), 0.05);
        let got = train_items(&train);
        assert_eq!(got.len(), expected.len(), "{ranks} ranks");
        for (at, ((progress, loss), (want_progress, want_loss))) in
            got.iter().zip(&expected).enumerate()
        {
            assert_eq!(
                progress, want_progress,
                "{ranks} ranks: item {at}'s progress"
            );
            assert!(
                loss.len() == want_loss.len()
                    && loss.iter().zip(want_loss).all(|(g, w)| close(*g, *w, 1e-4)),
                "{ranks} ranks: item {at}'s loss {loss:?}, one device's {want_loss:?}"
            );
        }
    }
}

#[test]
fn a_short_last_step_reports_one_devices_progress_in_threads_and_processes() {
    let _alone = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    // A DistributedDataLoader of 37 items, 8 a step: the last step has 5, split 3 + 2 (2 ranks)
    // or 2 + 1 + 1 + 1 (4 ranks). burn-train must see one device's items processed after each
    // step, 37 of 37 at the end (the ranks' shards times the world size would say 38 or 40).
    let model = materialized(counting());
    let run = Run::new(None, 8, 37);
    let (single, _) = seen(&model, 0, false, run.clone(), 0.05);
    let expected = progress(&single);
    assert_eq!(
        expected,
        vec![(8, 37), (16, 37), (24, 37), (32, 37), (37, 37)],
        "one device"
    );
    for (ranks, tcp, join) in [
        (2, false, false),
        (4, false, false),
        (2, true, false),
        (2, false, true),
        (2, true, true),
    ] {
        let mut run = run.clone();
        if join {
            run.config = burn_ddp::DdpConfig::default()
                .with_uneven_inputs(burn_ddp::config::UnevenInputs::Join);
        }
        let (train, _) = seen(&model, ranks, tcp, run, 0.05);
        assert_eq!(
            progress(&train),
            expected,
            "{ranks} ranks (tcp: {tcp}, join: {join}): the items processed after each step"
        );
    }
}

fn close(a: f64, b: f64, tolerance: f64) -> bool {
    (a - b).abs() <= tolerance * b.abs().max(1e-12)
}

/// Every item's progress (items processed, items in all), in order.
fn progress(split: &SplitSeen) -> Vec<(usize, usize)> {
    split.items.iter().map(|item| item.progress).collect()
}

#[test]
fn validation_over_10_items_gives_single_device_metrics_on_1_2_and_3_ranks() {
    let _alone = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    // Learning rate 0: every run validates the same model; only where validation runs differs.
    let model = materialized(counting());
    let mut run = Run::new(None, 12, 24);
    run.valid_samples = Some(10);
    run.valid_batch = 2;
    let (_, single) = seen(&model, 0, false, run.clone(), 0.0);
    assert_eq!(single.items.len(), 5, "10 items in batches of 2");
    for (ranks, tcp) in [(1, false), (2, false), (3, false), (2, true), (3, true)] {
        VALIDATED.lock().unwrap().clear();
        let (_, valid) = seen(&model, ranks, tcp, run.clone(), 0.0);
        // Every rank validated its run of whole batches (5 batches of 2 split as evenly as
        // they go, the larger runs first), no rank the whole set.
        let counts = VALIDATED.lock().unwrap().clone();
        for rank in 0..ranks {
            let batches = 5 / ranks + usize::from(rank < 5 % ranks);
            let thread = if ranks == 1 && !tcp {
                // One replica trains on the calling thread.
                std::thread::current()
                    .name()
                    .unwrap_or_default()
                    .to_string()
            } else {
                format!("burn-ddp-rank-{rank}")
            };
            assert_eq!(
                counts.get(&thread).copied(),
                Some(batches),
                "{ranks} ranks (tcp: {tcp}): validation batches per thread {counts:?}"
            );
        }
        for metric in ["Loss", "Accuracy"] {
            let (got, want) = (valid.weighted(metric), single.weighted(metric));
            assert!(
                close(got, want, 1e-6),
                "{ranks} ranks (tcp: {tcp}): {metric} {got}, one device {want}"
            );
        }
        // Every item counted once: the counts add up to the 10 items.
        let counted: usize = valid
            .updates
            .iter()
            .filter(|u| u.name == "Accuracy")
            .map(|u| u.count)
            .sum();
        assert_eq!(counted, 10, "{ranks} ranks (tcp: {tcp})");
        // One item per batch of the loader, with one device's progress and values.
        assert_eq!(
            progress(&valid),
            progress(&single),
            "{ranks} ranks (tcp: {tcp})"
        );
        for metric in ["Loss", "Accuracy"] {
            let (got, want) = (valid.values(metric), single.values(metric));
            assert_eq!(
                got.len(),
                want.len(),
                "{ranks} ranks (tcp: {tcp}): {metric}"
            );
            for (item, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    close(*g, *w, 1e-6),
                    "{ranks} ranks (tcp: {tcp}): {metric} of item {item}: {g}, one device {w}"
                );
            }
        }
    }
}

#[test]
fn the_renderer_sees_one_item_per_step_with_the_global_batch_metrics() {
    let _alone = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    // 10 steps of a global batch of 16: every run sees the same samples per step.
    let model = materialized(counting());
    let run = Run::new(None, 16, 10 * 16);
    let (single, _) = seen(&model, 0, false, run.clone(), 0.1);
    // A train step asks burn_ddp::rank() and world_size() (as a user's metric or callback
    // would): every rank thread answers its own rank, in both modes.
    let expected_ranks = |what: &str| {
        let seen = std::mem::take(&mut *TRAINED_BY.lock().unwrap());
        for rank in 0..2 {
            assert_eq!(
                seen.get(&format!("burn-ddp-rank-{rank}")),
                Some(&[(rank, 2)].into_iter().collect()),
                "{what}: rank() / world_size() in rank {rank}'s train steps: {seen:?}"
            );
        }
    };
    TRAINED_BY.lock().unwrap().clear();
    let (threads, _) = seen(&model, 2, false, run.clone(), 0.1);
    expected_ranks("threads");
    let (processes, _) = seen(&model, 2, true, run, 0.1);
    expected_ranks("processes");
    let expected: Vec<(usize, usize)> = (1..=10).map(|step| (16 * step, 160)).collect();
    assert_eq!(progress(&single), expected, "one device: one item per step");
    for (name, split) in [("threads", &threads), ("processes", &processes)] {
        assert_eq!(
            progress(split),
            expected,
            "{name}: one item per step of 16 samples"
        );
        let (got, want) = (split.values("Loss"), single.values("Loss"));
        assert_eq!(got.len(), 10, "{name}");
        for (step, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                close(*g, *w, 1e-4),
                "{name}: step {step}: loss {g}, one device {w}"
            );
        }
        let (got, want) = (split.weighted("Accuracy"), single.weighted("Accuracy"));
        assert!(
            close(got, want, 1e-6),
            "{name}: accuracy {got}, one device {want}"
        );
    }
    // Threads and processes train bit for bit alike, so they report the same numbers.
    assert_eq!(threads.updates, processes.updates);
}

/// The MLP whose rank-1 replica sleeps 400 ms in its 12th training step: rank 0 waits for it in
/// that step's gradient synchronisation, a spike of rank 0's.
fn straggling() -> Hooked<Mlp> {
    Hooked::new(Mlp::new(&device()), |call| {
        if call.train_step_on(12, 1) {
            std::thread::sleep(std::time::Duration::from_millis(400));
        }
    })
}

/// What the monitoring must show for every rank of a 2-rank run with [`straggling`].
fn assert_monitored(report: &burn_ddp::metrics::TrainingReport, mode: &str) {
    use std::time::Duration;
    assert_eq!(report.ranks.len(), 2, "{mode}: one report per rank");
    for (index, rank) in report.ranks.iter().enumerate() {
        assert_eq!(rank.rank, index, "{mode}");
        assert!(
            rank.compute > Duration::ZERO && rank.train_time >= rank.compute,
            "{mode}: rank {index}: compute {:?} within the loop's {:?}",
            rank.compute,
            rank.train_time
        );
        let utilization = rank.utilization();
        assert!(
            utilization > 0.0 && utilization <= 1.0,
            "{mode}: {utilization}"
        );
        assert_eq!(
            rank.sync.count, rank.comm.steps,
            "{mode}: every synchronisation timed"
        );
        assert!(rank.sync.median <= rank.sync.p90 && rank.sync.p90 <= rank.sync.max);
        assert_eq!(rank.sync.spike_factor, 3.0, "{mode}: the default factor");
        if cfg!(target_os = "linux") {
            assert!(rank.peak_memory.is_some_and(|b| b > 1 << 20), "{mode}");
        }
    }
    let waited = &report.ranks[0].sync;
    assert!(
        waited.max >= Duration::from_millis(300) && waited.spikes >= 1,
        "{mode}: rank 0 waited for the straggler: {waited:?}"
    );
    let summary = report.to_string();
    for shown in ["utilization", "spike(s) over 3x the median", "peak memory"] {
        assert!(summary.contains(shown), "{mode}: `{shown}` in\n{summary}");
    }
}

#[test]
fn the_report_shows_utilization_sync_spikes_and_memory_per_rank_in_threads_and_processes() {
    let model = materialized(straggling());
    let run = Run::new(Some(2), 16, 24 * 16);
    let (_, report) = run_training(model.clone(), SgdConfig::new().init(), 0.1, &run).unwrap();
    assert_monitored(&report.expect("a DdpStrategy report"), "threads");
    let reports = over_tcp(2, |_, group| {
        let run = Run {
            group: Some(group),
            replicas: None,
            ..run.clone()
        };
        run_training(model.clone(), SgdConfig::new().init(), 0.1, &run)
            .unwrap()
            .1
    });
    let rank0 = reports.into_iter().next().unwrap().unwrap();
    assert_monitored(&rank0.expect("rank 0's report"), "processes");
}

#[test]
fn sharding_splits_the_optimizer_state_between_the_ranks_in_threads_and_processes() {
    use burn::optim::{AdamConfig, GradientsParams, ModuleOptimizer};
    use burn_ddp::DdpConfig;
    use burn_ddp::mechanism::optimizer_state_bytes;
    use burn_ddp::metrics::TrainingReport;
    let model = materialized(Mlp::new(&device()));
    // The whole state: plain Burn's Adam after a step of the same model (every parameter has
    // its two moments; their sizes do not depend on the values).
    let whole = {
        let x = burn::tensor::Tensor::<2>::ones([2, burn_ddp_tests::FEATURES], &device());
        let grads = GradientsParams::from_grads(model.forward(x).sum().backward(), &model);
        let mut adam: ModuleOptimizer = AdamConfig::new().init();
        let _ = adam.step(1e-2, model.clone(), grads);
        optimizer_state_bytes(adam.to_record()).unwrap()
    };
    let shares = |report: &TrainingReport| -> Vec<u64> {
        report
            .ranks
            .iter()
            .map(|r| {
                r.optimizer_state
                    .expect("Adam's record is kept per parameter")
            })
            .collect()
    };
    let mut run = Run::new(Some(2), 16, 4 * 16);
    let (_, replicated) =
        run_training(model.clone(), AdamConfig::new().init(), 1e-2, &run).unwrap();
    assert!(
        replicated
            .unwrap()
            .ranks
            .iter()
            .all(|r| r.optimizer_state.is_none()),
        "without sharding the state is not read"
    );
    run.config = DdpConfig::default().with_optimizer_sharding(true);
    let sharded = || AdamConfig::new().init();
    let (_, threads) = run_training(model.clone(), sharded(), 1e-2, &run).unwrap();
    let threads = threads.unwrap();
    let reports = over_tcp(2, |_, group| {
        let run = Run {
            group: Some(group),
            replicas: None,
            ..run.clone()
        };
        run_training(model.clone(), sharded(), 1e-2, &run)
            .unwrap()
            .1
    });
    let processes = reports.into_iter().next().unwrap().unwrap().unwrap();
    for (mode, report) in [("threads", &threads), ("processes", &processes)] {
        let shares = shares(report);
        assert_eq!(
            shares.iter().sum::<u64>(),
            whole,
            "{mode}: the shares {shares:?} make up plain Burn's whole state"
        );
        assert!(
            shares.iter().all(|&s| 0 < s && s < whole),
            "{mode}: every rank holds a part: {shares:?} of {whole}"
        );
        assert!(report.to_string().contains("optimizer state"), "{mode}");
    }
}

#[test]
fn the_metrics_file_has_a_line_per_step_with_the_loss_burn_train_shows_and_a_line_per_rank() {
    use burn_ddp::DdpConfig;
    let model = materialized(Mlp::new(&device()));
    let dir = tempfile::tempdir().unwrap();
    for mode in ["threads", "processes"] {
        let path = dir.path().join(format!("{mode}.jsonl"));
        let mut run = Run::new(Some(2), 16, 6 * 16);
        run.epochs = 2;
        run.recording = Some(Recording::default());
        run.all_metrics = true;
        run.config = DdpConfig::default()
            .with_metrics_file(&path)
            .with_metrics_every(4);
        let recording = run.recording.clone().unwrap();
        if mode == "threads" {
            run_training(model.clone(), SgdConfig::new().init(), 0.1, &run).unwrap();
        } else {
            let results = over_tcp(2, |_, group| {
                let run = Run {
                    group: Some(group),
                    replicas: None,
                    ..run.clone()
                };
                run_training(model.clone(), SgdConfig::new().init(), 0.1, &run).map(drop)
            });
            for result in results {
                result.unwrap().unwrap();
            }
        }
        let lines: Vec<serde_json::Value> = std::fs::read_to_string(&path)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let steps: Vec<&serde_json::Value> = lines.iter().filter(|l| l["kind"] == "step").collect();
        let ranks: Vec<&serde_json::Value> = lines.iter().filter(|l| l["kind"] == "rank").collect();
        let (train, _) = recording.seen();
        assert_eq!(steps.len(), 12, "{mode}: 6 steps in each of 2 epochs");
        assert_eq!(steps.len(), train.items.len(), "{mode}: one line per item");
        for (line, item) in steps.iter().zip(&train.items) {
            let metric = |wanted: &str| {
                item.metrics
                    .iter()
                    .find(|(name, _, _)| name == wanted)
                    .unwrap_or_else(|| panic!("the {wanted} metric"))
            };
            // The loss is counted once per item; the accuracy once per sample.
            let (_, loss, _) = metric("Loss");
            let (_, _, samples) = metric("Accuracy");
            assert_eq!(line["epoch"], item.epoch as u64, "{mode}");
            assert_eq!(line["samples"], *samples as u64, "{mode}: the global batch");
            let logged = line["loss"].as_f64().unwrap();
            assert!(
                (logged - loss).abs() <= 1e-5 * loss.abs().max(1.0),
                "{mode}: the file's loss {logged}, burn-train's {loss}"
            );
            assert!(line["compute_ms"].as_f64().unwrap() > 0.0, "{mode}");
        }
        assert_eq!(
            ranks
                .iter()
                .map(|r| r["rank"].as_u64().unwrap())
                .collect::<Vec<_>>(),
            vec![0, 1],
            "{mode}: one line per rank at the end"
        );
        assert!(ranks.iter().all(|r| r["batches"] == 12), "{mode}");
    }
}
