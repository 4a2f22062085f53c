//! The differential harness: every configuration runs twice, with plain Burn on one device
//! (`ExecutionStrategy::SingleDevice` with Burn's own loader over the sampler's order and Burn's
//! own `BatchNorm`: the reference, no burn-ddp code) and with `DdpStrategy` on N ranks (threads
//! or TCP ranks, each with its own `SupervisedTraining`), and everything a user can observe is
//! compared:
//! - the trained parameters and buffers (max relative difference ≤ 1e-5 with SGD, 1e-3 with Adam
//!   and AdamW: see [`parameter_tolerance`]), every rank's bit for bit alike (TCP ranks return
//!   theirs; thread ranks are compared every step by the consistency check);
//! - every item burn-train's renderer receives, training and validation, with loss, accuracy,
//!   top-2 accuracy, precision, recall and F1 (AUROC needs two classes: not on this 4-class
//!   task), item by item (epoch, the split's progress, count, value within 1e-4 relative);
//! - the epochs trained (early stopping on the validation loss must stop where the recorded
//!   epoch losses say, on both sides, and before the last epoch);
//! - with optimizer-state sharding, that the state really is split (every rank's share of the
//!   report is below the whole).
//!
//! - which reduction ran, on every rank (`CommStats`'s phases by path): tensors shared between
//!   thread ranks, host buckets all-reduced, or reduce-scattered by owner under ZeRO-2, as the
//!   case configures (`paths.rs`), so that no path goes silently untested.
//!
//! Configurations are generated: a fixed core that covers every value of every dimension at
//! least once, then a random tail whose seed is printed (set `BURN_DDP_ORACLE_SEED` to replay it
//! and `BURN_DDP_ORACLE_CASES` for a longer sweep; `BURN_DDP_ORACLE_ONLY` runs the cases whose
//! name contains it, e.g. `"random case 34 "`). The dimensions: models (frozen, unfrozen,
//! tied, partly unused layers, SyncBatchNorm, a layer frozen in `optimize` after the step, an
//! EMA teacher), optimizers and schedules, clipping (burn-ddp's setting, or the user's: in the
//! model's `optimize`, Burn 0.22 having no optimizer wrappers), accumulation, sharding (ZeRO-1 and ZeRO-2), datasets of any size (short last steps,
//! ranks without a sample, fewer samples than ranks), join mode, validation loaders (Burn's own,
//! shuffled, on every rank or rank 0 alone), Burn's own training loaders, early stopping, bucket
//! caps, the consistency check off, 1 to 8 thread ranks (tensors shared or host buckets) or 2 to 4
//! TCP ranks; runs stopped and resumed (mid-epoch, or after an epoch on another world size with
//! sharding flipped, ZeRO-2 included) into a model initialised otherwise, compared by their
//! parameters; runs interrupted by burn-train's interrupter during any micro-batch (inside an
//! accumulation window too), against plain Burn interrupted at the same batch; and custom loops
//! (`custom.rs`: `DistributedDataParallel` in a loop a user writes, against the same loop in
//! plain Burn), compared by every rank's parameters.
//!
//! Not one device's by design, so checked for running, staying alike on every rank and learning
//! (the last epoch's mean training loss below the first's): plain `BatchNorm` (per-replica
//! statistics, as PyTorch DDP without `SyncBatchNorm`) and dropout (the backend's random
//! draws). Burn's own *training* loaders (shuffled or not, of the per-replica batch) are drawn
//! on thread ranks, where burn-ddp deals one device's batches to the ranks; between processes
//! burn-ddp slices them (with a warning: not one device's steps), which the harness does not
//! draw. Not drawn either: interrupts in join mode, with early stopping or inside a window with
//! SyncBatchNorm (its statistics keep the window's remaining micro-batches), custom loops with
//! models whose `optimize` hook acts (burn-train's, which a custom loop does not call), a user's
//! clipping in `optimize` under optimizer sharding (it sees its rank's gradients only on Burn
//! 0.22, docs/limits.md), and the device paths (NCCL's buckets, wgpu, the GPU check: not ported
//! to Burn 0.22 yet).
//!
//! Every case's model trains inside the harness's wrapper ([`parts::Harnessed`]: a stop during a
//! chosen micro-batch, counted by each rank, and the user's clipping in `optimize`), on both
//! sides alike.

mod cases;
mod custom;
mod parts;
mod paths;

use burn_ddp::DdpConfig;
use burn_ddp::config::UnevenInputs;
use burn_ddp::metrics::{CommStats, TrainingReport};
use burn_ddp_tests::{
    BnCnn, DropoutMlp, FreezesAfterTwoSteps, Mlp, Recording, Run, SplitSeen, SyncBnCnn, TrainKind,
    WithTeacher, deterministic, device, float_tensors, max_relative_difference, over_tcp,
    run_training, with_values,
};

use cases::{Case, Clip, Driver, Model, Opt, Resume, Rng, Transport, core, random};
use parts::{Freezing, Harnessed, Sched, Slot, Special};
use paths::Ran;

// ----------------------------------------------------------------------------------------------
// Running a case.

/// What one side of a comparison observed.
#[derive(Debug)]
struct Observed {
    /// Rank 0's (or the one device's) trained tensors.
    tensors: Vec<Vec<f32>>,
    /// Every other rank's, when they are separate (TCP ranks).
    others: Vec<Vec<Vec<f32>>>,
    train: SplitSeen,
    valid: SplitSeen,
    /// burn-ddp's report (rank 0's, with every rank's figures).
    report: Option<TrainingReport>,
    /// Every rank's communication counters (burn-ddp's side).
    comm: Vec<CommStats>,
}

/// How one training of a case differs from the case itself.
#[derive(Clone, Default)]
struct Leg {
    /// Ranks (`None`: plain Burn on one device).
    replicas: Option<usize>,
    /// The seed of the model's initial values (41 unless a resumed run's).
    init_seed: Option<u64>,
    /// Train this many epochs (the schedule still spans the case's).
    epochs: Option<usize>,
    /// Sharding, when not the case's.
    shard: Option<bool>,
    /// Checkpoints in this directory.
    artifacts: Option<std::path::PathBuf>,
    /// Write a step checkpoint after every optimizer step.
    step_checkpoints: bool,
    /// Stop the training during this micro-batch (counted from 1 over the run, by each rank).
    stop_at: Option<usize>,
    /// Resume from the newest checkpoint (`Some(epoch)`: burn-train's of that epoch).
    resume: Option<Option<usize>>,
}

/// Runs `case` on one device (`None`) or on `replicas` ranks, resumed as the case says, on a
/// fresh thread (models keep step counts in thread-locals) and returns what it observed.
fn observe(case: &Case, replicas: Option<usize>) -> Observed {
    if case.driver == Driver::CustomLoop {
        return std::thread::scope(|s| {
            s.spawn(|| custom::observe(case, replicas))
                .join()
                .unwrap_or_else(|payload| std::panic::resume_unwind(payload))
        });
    }
    let leg = Leg {
        replicas,
        ..Leg::default()
    };
    match (replicas, case.resume) {
        // Interrupted at the case's batch, if it says so: one device too.
        (None, _) | (_, Resume::No) => observe_leg(
            case,
            &Leg {
                stop_at: case.interrupt_at,
                ..leg
            },
        ),
        (Some(_), Resume::MidEpoch) => {
            let dir = scratch(case);
            // Stopped mid-epoch: at the batch halfway through the run's first epoch, or its
            // second when the first is a single step; not before the first accumulation
            // window's last micro-batch (stopped inside a window, a run steps no optimizer for
            // it, as plain Burn, and would have no step checkpoint to resume from).
            let batches = case.samples.div_ceil(case.global_batch);
            let stop_at = ((batches / 2).max(1) + usize::from(batches == 1))
                .max(case.accumulation.unwrap_or(1));
            let stopped = observe_leg(
                case,
                &Leg {
                    artifacts: Some(dir.clone()),
                    step_checkpoints: true,
                    stop_at: Some(stop_at),
                    ..leg.clone()
                },
            );
            // Or the resumed run would start from the end, and test nothing.
            assert!(
                stopped.train.items.len() < batches * case.epochs,
                "the run was not stopped: {} of {} steps trained",
                stopped.train.items.len(),
                batches * case.epochs
            );
            let resumed = observe_leg(
                case,
                &Leg {
                    artifacts: Some(dir.clone()),
                    init_seed: Some(77),
                    resume: Some(None),
                    ..leg
                },
            );
            let _ = std::fs::remove_dir_all(dir);
            resumed
        }
        (Some(_), Resume::AfterEpoch { world }) => {
            let dir = scratch(case);
            observe_leg(
                case,
                &Leg {
                    artifacts: Some(dir.clone()),
                    epochs: Some(1),
                    ..leg
                },
            );
            let resumed = observe_leg(
                case,
                &Leg {
                    replicas: Some(world),
                    artifacts: Some(dir.clone()),
                    init_seed: Some(77),
                    shard: Some(!case.shard),
                    resume: Some(Some(1)),
                    ..Leg::default()
                },
            );
            let _ = std::fs::remove_dir_all(dir);
            resumed
        }
    }
}

/// A fresh directory for a case's checkpoints.
fn scratch(case: &Case) -> std::path::PathBuf {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!(
        "burn-ddp-oracle-{}-{n}-{:?}",
        std::process::id(),
        case.resume
    ));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// One training of `case` as `leg` says, on a fresh thread.
fn observe_leg(case: &Case, leg: &Leg) -> Observed {
    let case = *case;
    std::thread::scope(|s| {
        s.spawn(move || match (leg.replicas, case.transport) {
            (Some(world), Transport::Tcp) => {
                let results = over_tcp(world, |_, group| {
                    let mut run = run_of(&case, leg);
                    run.replicas = None;
                    run.group = Some(group);
                    train(&case, &run, leg)
                });
                let mut sides = results.into_iter().map(|r| r.unwrap());
                let mut first = sides.next().unwrap();
                first.others = sides.map(|o| o.tensors).collect();
                first
            }
            _ => train(&case, &run_of(&case, leg), leg),
        })
        .join()
        .unwrap()
    })
}

fn run_of(case: &Case, leg: &Leg) -> Run {
    let replicas = leg.replicas;
    let mut run = Run::new(replicas, case.global_batch, case.samples);
    run.epochs = leg.epochs.or(case.stop_after).unwrap_or(case.epochs);
    run.grad_accumulation = case.accumulation;
    run.shuffle = case.shuffle;
    run.valid = case.valid;
    if case.train_burn {
        run.train = TrainKind::Burn;
    }
    run.valid_samples = Some(case.valid_samples);
    run.valid_batch = case.valid_batch;
    run.early_stopping = case.early_stopping;
    run.recording = Some(Recording::default());
    run.all_metrics = true;
    run.artifacts = leg.artifacts.clone();
    run.resume_after = leg.resume.flatten();
    let mut config = match replicas {
        Some(_) => settings(case, leg.shard.unwrap_or(case.shard)),
        None => DdpConfig::default(),
    };
    if case.valid_rank0 {
        config = config.with_validation(burn_ddp::config::Validation::Rank0);
    }
    if case.join {
        config = config.with_uneven_inputs(UnevenInputs::Join);
    }
    if replicas.is_some() {
        if leg.step_checkpoints {
            config = config.with_checkpoint_every(1);
        }
        if leg.resume == Some(None) {
            config = config.with_resume(true);
        }
    }
    run.config = config;
    run
}

/// burn-ddp's settings of `case` (the strategy's and the custom loop's), the optimizer state
/// sharded or not.
fn settings(case: &Case, shard: bool) -> DdpConfig {
    let mut config = DdpConfig::default();
    if case.clip == Clip::Setting {
        // burn-ddp's setting; plain Burn clips in the model's `optimize` (`Harnessed`).
        config = config.with_clip_grad_norm(CLIP);
    }
    // Thread ranks return rank 0's model only: every rank is compared every step.
    config = config
        .with_consistency_check_every(u64::from(!case.unchecked))
        .with_optimizer_sharding(shard)
        .with_gradient_sharding(case.shard_grads && shard)
        .with_shared_memory_reduction(case.transport != Transport::ThreadBuckets)
        .with_run_id("burn-ddp-oracle");
    if let Some(cap) = case.bucket_cap {
        config = config
            .with_bucket_cap_bytes(cap)
            .with_first_bucket_cap_bytes(cap);
    }
    config
}

/// Global-norm clipping threshold of the clipping cases.
const CLIP: f32 = 0.05;

/// Where one side clips by the global norm in the model's `optimize` (the harness's wrapper):
/// plain Burn whenever the case clips, burn-ddp when the user clips (`Clip::Wrapper`; with
/// `Clip::Setting` burn-ddp's setting clips).
fn clip_in_optimize(case: &Case, ddp: bool) -> Option<f32> {
    match (case.clip, ddp) {
        (Clip::Off, _) | (Clip::Setting, true) => None,
        (Clip::Setting, false) | (Clip::Wrapper, _) => Some(CLIP),
    }
}

/// Trains the case's model with its optimizer and scheduler under `run`.
fn train(case: &Case, run: &Run, leg: &Leg) -> Observed {
    let ddp = run.replicas.is_some() || run.group.is_some();
    let seed = leg.init_seed.unwrap_or(41);
    let interrupt: Option<(Slot, usize)> = leg.stop_at.map(|at| (Slot::default(), at));
    let mut run = run.clone();
    run.interrupter = interrupt.as_ref().map(|(slot, _)| slot.clone());
    let run = &run;
    let lr = Sched::build(case);
    let clip = clip_in_optimize(case, ddp);
    let recording = run.recording.clone().unwrap_or_default();
    macro_rules! training {
        ($model:expr) => {
            run_training(
                Harnessed::new(deterministic($model, seed), interrupt.clone(), clip),
                parts::optim(case.opt),
                lr,
                run,
            )
        };
    }
    let trained = match case.model {
        Model::Plain => training!(Mlp::new(&device())),
        Model::Frozen | Model::Unfrozen => training!(Freezing {
            inner: Mlp::new(&device()).with_first_frozen(),
            unfreeze_after: (case.model == Model::Unfrozen).then_some(2),
        }),
        Model::Tied | Model::PartlyUnused => training!(Special::new(
            &device(),
            case.model == Model::Tied,
            case.model == Model::PartlyUnused,
        )),
        // burn-ddp's SyncBatchNorm against Burn's own BatchNorm on one device, from the same
        // values.
        Model::SyncBn if ddp => training!(SyncBnCnn::new(&device())),
        Model::SyncBn => run_training(
            Harnessed::new(
                with_values(
                    BnCnn::new(&device()),
                    &float_tensors(&deterministic(SyncBnCnn::new(&device()), seed)),
                ),
                interrupt.clone(),
                clip,
            ),
            parts::optim(case.opt),
            lr,
            run,
        ),
        Model::FreezesAfterStep => training!(FreezesAfterTwoSteps::new(&device())),
        Model::Teacher => training!(WithTeacher::new(&device())),
        Model::PlainBn => training!(BnCnn::new(&device())),
        Model::Dropout => training!(DropoutMlp::new(&device())),
    };
    let (tensors, report) = match (trained, leg.stop_at) {
        (Ok(trained), _) => trained,
        // A leg stopped by the interrupter ends as burn-train's interrupted runs do.
        (Err(_), Some(_)) => (Vec::new(), None),
        (Err(err), None) => panic!(
            "{case:?} ({}): {err}",
            if ddp { "burn-ddp" } else { "one device" }
        ),
    };
    let (train, valid) = recording.seen();
    let comm = report
        .iter()
        .flat_map(|r| r.ranks.iter().map(|rank| rank.comm.clone()))
        .collect();
    Observed {
        tensors,
        others: Vec::new(),
        train,
        valid,
        report,
        comm,
    }
}

// ----------------------------------------------------------------------------------------------
// The comparison.

/// Relative tolerance of metric values (sums in other orders).
const METRIC_TOLERANCE: f64 = 1e-4;

fn close(a: f64, b: f64) -> bool {
    (a.is_nan() && b.is_nan()) || (a - b).abs() <= METRIC_TOLERANCE * b.abs().max(1e-3)
}

/// The epoch early stopping on the validation loss (`NoImprovementSince { n_epochs: 1 }`, epoch
/// means) must stop after, from the epoch losses `valid` recorded, or `epochs` if none.
fn expected_stop(valid: &SplitSeen, epochs: usize) -> usize {
    let mut best = (f64::MAX, 0);
    for epoch in 1..=epochs {
        let Some(loss) = valid.epoch_mean("Loss", epoch) else {
            return epoch;
        };
        if loss < best.0 {
            best = (loss, epoch);
        } else if epoch - best.1 >= 1 {
            return epoch;
        }
    }
    epochs
}

/// Compares the items of one split, over the epochs both sides trained.
fn compare_split(
    what: &str,
    one: &SplitSeen,
    ddp: &SplitSeen,
    epochs: usize,
    extra: usize,
) -> Result<(), String> {
    let keep = |s: &SplitSeen| -> Vec<burn_ddp_tests::SeenItem> {
        s.items
            .iter()
            .filter(|i| i.epoch <= epochs)
            .cloned()
            .collect()
    };
    let (one, ddp) = (keep(one), keep(ddp));
    if one.len() + extra != ddp.len() {
        return Err(format!(
            "{what}: {} items on one device, {} with burn-ddp (expected {extra} more)",
            one.len(),
            ddp.len()
        ));
    }
    for (index, (a, b)) in one.iter().zip(&ddp).enumerate() {
        if (a.epoch, a.progress) != (b.epoch, b.progress) {
            return Err(format!(
                "{what} item {index}: epoch {} progress {:?} on one device, epoch {} progress {:?} with burn-ddp",
                a.epoch, a.progress, b.epoch, b.progress
            ));
        }
        if a.metrics.len() != b.metrics.len() {
            return Err(format!(
                "{what} item {index}: metrics {:?} vs {:?}",
                a.metrics, b.metrics
            ));
        }
        for ((name, va, na), (other, vb, nb)) in a.metrics.iter().zip(&b.metrics) {
            if name != other || na != nb || !close(*vb, *va) {
                return Err(format!(
                    "{what} item {index} (epoch {}, progress {:?}): {name} {va} (count {na}) on one device, {other} {vb} (count {nb}) with burn-ddp",
                    a.epoch, a.progress
                ));
            }
        }
    }
    Ok(())
}

/// How far the trained parameters may be from one device's (max relative difference).
///
/// SGD: 1e-5, the rounding of sums taken in another order (the all-reduce's, SyncBatchNorm's).
/// Adam and AdamW: 1e-3. Their update `m / (sqrt(v) + eps)` turns the rounding of a gradient
/// near zero into a step of the learning rate's size: measured on a case that failed 1e-5,
/// burn-ddp with one replica equals plain Burn bit for bit, and three replicas differ from it by
/// 1e-4 after a few steps, from the three-way average's rounding alone. A wrong reduction (a
/// rank's gradients lost, a wrong divisor, a stale bucket) is off by far more, and every metric
/// of every item is held to 1e-4 whatever the optimizer.
fn parameter_tolerance(case: &Case) -> f32 {
    match case.opt {
        Opt::SgdMomentum => 1e-5,
        Opt::Adam | Opt::AdamW => 1e-3,
    }
}

/// Runs `case` both ways and returns the reduction it ran, or the first difference (a failed
/// run is one).
fn differential(case: &Case) -> Result<Ran, String> {
    let run = |case: &Case, replicas| {
        std::panic::catch_unwind(|| observe(case, replicas)).map_err(|payload| {
            payload
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default()
        })
    };
    if !case.model.exact() {
        let ddp = run(case, Some(case.world))?;
        let ran = paths::reduced_as_configured(case, &ddp.comm)?;
        return learns_alike(case, &ddp).map(|()| ran);
    }
    // The reference of an early-stopping case: plain Burn without early stopping over every
    // epoch, whose recorded losses say where to stop, then trained that far. (burn-train's own
    // loop can decide before the epoch's loss reached its store: it is no reference for that.)
    let one = if case.early_stopping {
        let unstopped = Case {
            early_stopping: false,
            ..*case
        };
        let stop = expected_stop(&run(&unstopped, None)?.valid, case.epochs);
        run(
            &Case {
                stop_after: Some(stop),
                ..unstopped
            },
            None,
        )?
    } else {
        run(case, None)?
    };
    let ddp = run(case, Some(case.world))?;
    if case.resume == Resume::No && case.driver == Driver::Learner {
        same_course(case, &one, &ddp)?;
    }
    let ran = paths::reduced_as_configured(case, &ddp.comm)?;
    // An interrupted leg that failed returns none: nothing would be compared.
    if one.tensors.is_empty() || ddp.tensors.is_empty() {
        return Err(format!(
            "no trained tensors: {} on one device, {} with burn-ddp",
            one.tensors.len(),
            ddp.tensors.len()
        ));
    }
    let diff = max_relative_difference(&ddp.tensors, &one.tensors);
    let tolerance = parameter_tolerance(case);
    if diff > tolerance {
        return Err(format!(
            "parameters {diff} away from one device's (relative; tolerance {tolerance})"
        ));
    }
    alike(&ddp)?;
    // The harness's optimizer checkpoints Adam's state only: the others report none.
    if case.shard
        && case.world > 1
        && case.resume == Resume::No
        && case.opt == Opt::Adam
        && case.driver == Driver::Learner
        && case.interrupt_at.is_none()
    {
        shards_split(&ddp)?;
    }
    Ok(ran)
}

/// The epochs trained and every item seen are one device's.
fn same_course(case: &Case, one: &Observed, ddp: &Observed) -> Result<(), String> {
    let epochs_of = |o: &Observed| o.train.items.iter().map(|i| i.epoch).max().unwrap_or(0);
    let (one_epochs, ddp_epochs) = (epochs_of(one), epochs_of(ddp));
    if case.early_stopping {
        // burn-ddp decides on its own recorded losses, and they must say what one device's say.
        let expected = expected_stop(&ddp.valid, case.epochs);
        if ddp_epochs != expected {
            return Err(format!(
                "burn-ddp trained {ddp_epochs} epochs, its recorded validation losses say {expected} (epoch means {:?})",
                (1..=ddp_epochs)
                    .map(|e| ddp.valid.epoch_mean("Loss", e))
                    .collect::<Vec<_>>()
            ));
        }
    }
    if one_epochs != ddp_epochs {
        return Err(format!(
            "{one_epochs} epochs on one device, {ddp_epochs} with burn-ddp"
        ));
    }
    let extra = window_rest(case);
    compare_split("training", &one.train, &ddp.train, one_epochs, extra)?;
    compare_split("validation", &one.valid, &ddp.valid, one_epochs, 0)
}

/// The micro-batches burn-ddp still runs after an interrupt inside an accumulation window, where
/// plain Burn stops at once: the rest of the window (the ranks learn of the stop at the window's
/// gradient reduction; those micro-batches' items reach burn-train, docs/semantics.md). Neither
/// side takes the window's optimizer step.
fn window_rest(case: &Case) -> usize {
    match (case.interrupt_at, case.accumulation) {
        (Some(at), Some(every)) => {
            let batches = case.batches();
            let within = (at - 1) % batches + 1;
            (within.div_ceil(every) * every).min(batches) - within
        }
        _ => 0,
    }
}

/// Every rank holds rank 0's tensors (TCP ranks return theirs; thread ranks were compared every
/// step by the consistency check).
fn alike(ddp: &Observed) -> Result<(), String> {
    for (rank, tensors) in ddp.others.iter().enumerate() {
        if tensors != &ddp.tensors {
            return Err(format!("rank {} differs from rank 0", rank + 1));
        }
    }
    Ok(())
}

/// Under sharding every rank's share of the optimizer state is below the whole.
fn shards_split(ddp: &Observed) -> Result<(), String> {
    let shares: Vec<Option<u64>> = ddp
        .report
        .as_ref()
        .map(|r| r.ranks.iter().map(|rank| rank.optimizer_state).collect())
        .unwrap_or_default();
    let known: Vec<u64> = shares.iter().flatten().copied().collect();
    let whole: u64 = known.iter().sum();
    if known.len() != shares.len() || shares.is_empty() || known.iter().any(|&s| s >= whole) {
        return Err(format!(
            "the optimizer state is not split: shares {shares:?} of {whole} bytes"
        ));
    }
    Ok(())
}

/// A case that is not one device's by design: it trained every epoch, the ranks are alike and
/// the last epoch's mean training loss is below the first's.
fn learns_alike(case: &Case, ddp: &Observed) -> Result<(), String> {
    alike(ddp)?;
    let (first, last) = (
        ddp.train.epoch_mean("Loss", 1),
        ddp.train.epoch_mean("Loss", case.epochs),
    );
    match (first, last) {
        (Some(first), Some(last)) if last < first => Ok(()),
        _ => Err(format!(
            "the training loss did not fall: epoch 1 {first:?}, epoch {} {last:?}",
            case.epochs
        )),
    }
}

#[test]
fn burn_ddp_trains_and_reports_as_plain_burn_on_one_device() {
    let seed = std::env::var("BURN_DDP_ORACLE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        });
    let tail: usize = std::env::var("BURN_DDP_ORACLE_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(48);
    // On success too: a later failure of the same code can be replayed.
    println!("the harness's random tail: BURN_DDP_ORACLE_SEED={seed}, {tail} cases");
    let mut rng = Rng(seed);
    let core = core();
    let early_stopping: Vec<Case> = core.iter().filter(|c| c.early_stopping).copied().collect();
    let cases: Vec<(String, Case)> = core
        .into_iter()
        .enumerate()
        .map(|(i, c)| (format!("core case {i}"), c))
        .chain((0..tail).map(|i| (format!("random case {i} of seed {seed}"), random(&mut rng))))
        .collect();
    // `BURN_DDP_ORACLE_ONLY="random case 34 "` replays the cases whose name contains it.
    let only = std::env::var("BURN_DDP_ORACLE_ONLY").ok();
    let mut failures = Vec::new();
    let chosen = cases.iter().filter(|(name, _)| {
        only.as_ref()
            .is_none_or(|only| name.contains(only.as_str()))
    });
    // The reductions the core ran: every path at least once, or one is silently untested.
    let mut core_ran = std::collections::BTreeSet::new();
    for (name, case) in chosen {
        match differential(case) {
            Ok(ran) => {
                // Shown with `--nocapture`.
                println!("{name}: reduced as {ran:?}");
                if name.starts_with("core") {
                    core_ran.insert(ran);
                }
            }
            Err(difference) => failures.push(format!("{name}: {case:?}\n  {difference}")),
        }
    }
    let missing: Vec<Ran> = Ran::ALL
        .into_iter()
        .filter(|ran| !core_ran.contains(ran))
        .collect();
    if only.is_none() && !missing.is_empty() {
        failures.push(format!("the core ran no case through {missing:?}"));
    }
    // The early-stopping cases must stop early, or they test nothing.
    for case in early_stopping {
        let one = observe(
            &Case {
                early_stopping: false,
                ..case
            },
            None,
        );
        let stop = expected_stop(&one.valid, case.epochs);
        if stop >= case.epochs {
            failures.push(format!(
                "{case:?}\n  does not stop early (its losses say epoch {stop} of {})",
                case.epochs
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} configurations differ from plain Burn on one device (replay the random ones with \
         BURN_DDP_ORACLE_SEED={seed}):\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}
