//! `cargo xtask bench`: burn-ddp against the data-parallel options a Burn user already has,
//! measured side by side in one run.
//!
//! - training throughput of the Fashion-MNIST CNN and a communication-heavy MLP (5.7 M
//!   parameters) at the same global batch: plain Burn on one device, Burn's `MultiDevice`,
//!   burn-ddp with threads (world size 1 and 2, and 4 with `--long`) and with processes over
//!   `TcpGroup` (2); samples/s is the median of timed windows after a warm-up;
//! - all-reduce of 4 KiB to 256 MiB on `ThreadGroup` and `TcpGroup`, `MpiGroup` under `mpirun`
//!   (feature `mpi`: `cargo xtask bench --features mpi`) and PyTorch's gloo on 2 processes
//!   (`python3` with torch; skipped with a note otherwise), against memcpy;
//! - bucket caps (one all-reduce per parameter, 1, 4, 25, 100 MiB);
//! - a projection of scaling efficiency at 2, 4 and 8 GPUs for named links;
//! - the start-up cost of the job's authentication (a store connection and a group of 2 formed,
//!   against a plain TCP connection).
//!
//! Prints a Markdown report and writes `bench.json`, `bench.md` and SVG plots to `--out`.

mod collectives;
mod models;
mod monitoring;
mod report;
mod startup;
mod training;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use burn_ddp::comm::launch::{LaunchConfig, launch};
use burn_ddp::group::TcpGroupOptions;
use burn_ddp::{ProcessGroup, group::TcpGroup};
use clap::{Parser, Subcommand};

use crate::collectives::GroupKind;
use crate::models::ModelKind;
use crate::report::{Projection, Results, links, project};
use crate::training::{Plan, Strategy, Throughput};

#[derive(Parser)]
#[command(about = "burn-ddp benchmark: throughput, collectives, bucket caps, projection")]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// Longer timed windows, 5 rounds, world size 4 with threads, bigger collective budgets.
    #[arg(long)]
    long: bool,
    /// Directory for bench.json, bench.md and the SVG plots.
    #[arg(long, default_value = "target/bench")]
    out: PathBuf,
    /// Skip the training throughput runs.
    #[arg(long)]
    skip_training: bool,
    /// Skip the all-reduce and bucket sweeps.
    #[arg(long)]
    skip_collectives: bool,
    /// Skip the loader prefetch comparison.
    #[arg(long)]
    skip_prefetch: bool,
    /// Models to train, comma-separated: `cnn`, `mlp` (default: both), `mlp-frozen` (the MLP
    /// with 56% of its parameters frozen).
    #[arg(long, value_delimiter = ',', value_parser = parse_model)]
    models: Vec<ModelKind>,
    /// Strategies, comma-separated: `single`, `multi-device-N`, `threads-N`, `processes-N`,
    /// `mpi-N` (default: single, multi-device-2, threads-1, threads-2, processes-2, mpi-2 when
    /// built with the `mpi` feature, and threads-4 with `--long`).
    #[arg(long, value_delimiter = ',', value_parser = parse_strategy)]
    strategies: Vec<Strategy>,
    /// Repeat the throughput runs this many times, interleaved (A B A B ...), and report the
    /// median over every round's windows: the comparison then shares the machine's drifts.
    /// (Default 3, or 5 with `--long`.)
    #[arg(long)]
    rounds: Option<usize>,
}

fn parse_model(s: &str) -> Result<ModelKind, String> {
    ModelKind::parse(s).ok_or_else(|| format!("unknown model `{s}` (cnn, mlp, mlp-frozen)"))
}

fn parse_strategy(s: &str) -> Result<Strategy, String> {
    let (family, n) = s.rsplit_once('-').unwrap_or((s, "1"));
    let n: usize = n
        .parse()
        .ok()
        .filter(|&n| n > 0)
        .ok_or_else(|| format!("`{s}`: the world size after `-` must be a positive number"))?;
    match family {
        "single" => Ok(Strategy::Single),
        "multi-device" => Ok(Strategy::BurnMultiDevice(n)),
        "multi-device-sharded" => Ok(Strategy::BurnMultiDeviceSharded(n)),
        "threads" => Ok(Strategy::DdpThreads(n)),
        "threads-sharded" => Ok(Strategy::DdpThreadsSharded(n)),
        "processes" => Ok(Strategy::DdpProcesses(n)),
        "processes-sharded" => Ok(Strategy::DdpProcessesSharded(n)),
        "mpi" => Ok(Strategy::DdpMpi(n)),
        _ => Err(format!(
            "unknown strategy `{s}` (single, multi-device-N, multi-device-sharded-N, threads-N, \
             threads-sharded-N, processes-N, processes-sharded-N, mpi-N)"
        )),
    }
}

#[derive(Subcommand)]
enum Command {
    /// (Internal) one rank of the multi-process throughput run, started by the launcher.
    Worker {
        #[arg(long)]
        model: String,
        #[arg(long)]
        global_batch: usize,
        #[arg(long)]
        warmup: usize,
        #[arg(long)]
        window: usize,
        #[arg(long)]
        windows: usize,
        #[arg(long)]
        out: PathBuf,
        /// Join the job through MPI (`MpiGroup`, under `mpirun`) instead of the launcher's TCP
        /// store.
        #[arg(long)]
        mpi: bool,
        /// Shard the optimizer state and the gradients (ZeRO-2).
        #[arg(long)]
        sharded: bool,
    },
    /// (Internal) one rank of the MpiGroup all-reduce sweep, started by `mpirun`; rank 0 prints
    /// `{"seconds": [...]}`.
    MpiSweep {
        /// Sizes in bytes, comma-separated.
        #[arg(long, value_delimiter = ',')]
        sizes: Vec<usize>,
        /// Time budget per size, milliseconds.
        #[arg(long)]
        budget_ms: u64,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Some(Command::Worker {
            model,
            global_batch,
            warmup,
            window,
            windows,
            out,
            mpi,
            sharded,
        }) => {
            let plan = Plan {
                global_batch,
                warmup_steps: warmup,
                window_steps: window,
                windows,
            };
            return worker(&model, &plan, &out, mpi, sharded);
        }
        Some(Command::MpiSweep { sizes, budget_ms }) => {
            return mpi_sweep(&sizes, Duration::from_millis(budget_ms));
        }
        None => {}
    }
    let results = bench(&cli);
    println!("{}", results.markdown());
    match results.write(&cli.out) {
        Ok(()) => {
            println!(
                "Wrote {}/bench.json, bench.md, throughput.svg, step_split.svg, busbw.svg",
                cli.out.display()
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("ddp-bench: cannot write the results: {e}");
            ExitCode::FAILURE
        }
    }
}

/// This process's group in a multi-process run: `MpiGroup` under `mpirun` (`mpi`), else the
/// launcher's `TcpGroup`.
fn join(mpi: bool) -> Result<Arc<dyn ProcessGroup>, String> {
    if mpi {
        #[cfg(feature = "mpi")]
        return burn_ddp::group::MpiGroup::world()
            .map(|g| Arc::new(g) as Arc<dyn ProcessGroup>)
            .map_err(|e| e.to_string());
        #[cfg(not(feature = "mpi"))]
        return Err("built without the `mpi` feature".into());
    }
    TcpGroup::from_env(&TcpGroupOptions::default())
        .map(|g| Arc::new(g) as Arc<dyn ProcessGroup>)
        .map_err(|e| e.to_string())
}

fn worker(model: &str, plan: &Plan, out: &PathBuf, mpi: bool, sharded: bool) -> ExitCode {
    let Some(kind) = ModelKind::parse(model) else {
        eprintln!("ddp-bench worker: unknown model {model}");
        return ExitCode::FAILURE;
    };
    let group = match join(mpi) {
        Ok(group) => group,
        Err(e) => {
            eprintln!("ddp-bench worker: {e}");
            return ExitCode::FAILURE;
        }
    };
    let rank = group.rank();
    let n = group.world_size();
    let strategy = match (mpi, sharded) {
        (true, _) => Strategy::DdpMpi(n),
        (false, true) => Strategy::DdpProcessesSharded(n),
        (false, false) => Strategy::DdpProcesses(n),
    };
    let result = training::run(kind, strategy, plan, Some(group));
    if rank == 0 {
        let json = serde_json::to_string(&result).unwrap_or_default();
        if let Err(e) = std::fs::write(out, json) {
            eprintln!("ddp-bench worker: cannot write {}: {e}", out.display());
            return ExitCode::FAILURE;
        }
    }
    ExitCode::SUCCESS
}

/// `ddp-bench mpi-sweep`: this rank's part of the MpiGroup sweep; rank 0 prints the result.
fn mpi_sweep(sizes: &[usize], budget: Duration) -> ExitCode {
    let group = match join(true) {
        Ok(group) => group,
        Err(e) => {
            println!("{}", serde_json::json!({ "skipped": e }));
            return ExitCode::SUCCESS;
        }
    };
    let seconds = collectives::sweep_rank(group.as_ref(), sizes, budget);
    // Every rank's medians to rank 0: the slowest rank's time counts, as in the other sweeps.
    let bits: Vec<u64> = seconds.iter().map(|s| s.to_bits()).collect();
    let all = group
        .all_gather(&bits, Duration::from_secs(600))
        .unwrap_or(bits);
    if group.rank() == 0 {
        let slowest: Vec<f64> = (0..sizes.len())
            .map(|i| {
                all.chunks_exact(sizes.len())
                    .map(|rank| f64::from_bits(rank[i]))
                    .fold(0.0, f64::max)
            })
            .collect();
        println!("{}", serde_json::json!({ "seconds": slowest }));
    }
    ExitCode::SUCCESS
}

/// `mpirun` as the benchmark starts it: `n` ranks on this machine, as root if need be.
fn mpirun(n: usize) -> std::process::Command {
    let mut command = std::process::Command::new("mpirun");
    command.args([
        "--oversubscribe",
        "--allow-run-as-root",
        "-np",
        &n.to_string(),
    ]);
    command
}

/// The multi-process run: this binary started `n` times, by burn-ddp's launcher
/// ([`Strategy::DdpProcesses`], over `TcpGroup`) or by `mpirun` ([`Strategy::DdpMpi`]).
fn processes(kind: ModelKind, strategy: Strategy, plan: &Plan) -> Throughput {
    let n = strategy.world_size();
    let mpi = matches!(strategy, Strategy::DdpMpi(_));
    let out = std::env::temp_dir().join(format!(
        "ddp-bench-{}-{}-{}.json",
        std::process::id(),
        if mpi { "mpi" } else { "tcp" },
        kind.arg()
    ));
    let failed = |note: String| Throughput {
        model: kind,
        strategy,
        windows: Vec::new(),
        samples_per_second: 0.0,
        round_medians: Vec::new(),
        split: None,
        optimizer_state_mib: None,
        note: Some(note),
    };
    let program = match std::env::current_exe() {
        Ok(program) => program,
        Err(e) => return failed(format!("cannot find this program: {e}")),
    };
    let mut args = vec!["worker".to_string()];
    if mpi {
        args.push("--mpi".into());
    }
    if matches!(strategy, Strategy::DdpProcessesSharded(_)) {
        args.push("--sharded".into());
    }
    for (flag, value) in [
        ("--model", kind.arg().to_string()),
        ("--global-batch", plan.global_batch.to_string()),
        ("--warmup", plan.warmup_steps.to_string()),
        ("--window", plan.window_steps.to_string()),
        ("--windows", plan.windows.to_string()),
        ("--out", out.display().to_string()),
    ] {
        args.extend([flag.to_string(), value]);
    }
    let started = if mpi {
        match mpirun(n).arg(program).args(&args).status() {
            Ok(status) if status.success() => Ok(()),
            Ok(status) => Err(format!("mpirun: {status}")),
            Err(e) => Err(format!("cannot start mpirun: {e}")),
        }
    } else {
        let mut config = LaunchConfig::new(n, program, args);
        config.master_port = 0;
        launch(&config).map(drop).map_err(|e| e.to_string())
    };
    if let Err(e) = started {
        return failed(e);
    }
    let result = std::fs::read_to_string(&out)
        .map_err(|e| e.to_string())
        .and_then(|json| serde_json::from_str(&json).map_err(|e| e.to_string()));
    let _ = std::fs::remove_file(&out);
    result.unwrap_or_else(|e| failed(format!("no result from rank 0: {e}")))
}

/// The CNN on one replica whose batcher costs about a quarter of a step (a spinning synthetic
/// decode, calibrated on a run without it), with 0, 1 and 2 loader workers, interleaved.
fn prefetch(plan: &Plan, round_count: usize) -> Vec<training::PrefetchRun> {
    use training::{Loader, PrefetchRun};
    eprintln!("loader prefetch: calibrating the step time");
    let calibration = training::run_with_loader(plan, Loader::default());
    if calibration.samples_per_second <= 0.0 {
        return Vec::new();
    }
    let step = Duration::from_secs_f64(plan.global_batch as f64 / calibration.samples_per_second);
    // A quarter of the step with decoding: d = (s + d) / 4, so d = s / 3.
    let per_batch = step / 3;
    let per_sample = per_batch / plan.global_batch as u32;
    let workers = [0usize, 1, 2];
    let mut rounds: Vec<Vec<Throughput>> = vec![Vec::new(); workers.len()];
    for round in 0..round_count {
        for (i, &w) in workers.iter().enumerate() {
            eprintln!("loader prefetch: {w} worker(s), round {}", round + 1);
            let loader = Loader {
                workers: w,
                decode_per_sample: per_sample,
            };
            let result = training::run_with_loader(plan, loader);
            eprintln!("  {:.1} samples/s", result.samples_per_second);
            rounds[i].push(result);
        }
    }
    workers
        .iter()
        .zip(rounds)
        .filter_map(|(&w, runs)| {
            training::merge_rounds(runs).map(|run| PrefetchRun {
                workers: w,
                decode_ms_per_batch: per_batch.as_secs_f64() * 1e3,
                run,
            })
        })
        .collect()
}

fn bench(cli: &Cli) -> Results {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let plan = if cli.long {
        Plan {
            global_batch: 64,
            warmup_steps: 5,
            window_steps: 10,
            windows: 8,
        }
    } else {
        Plan {
            global_batch: 64,
            warmup_steps: 3,
            window_steps: 5,
            windows: 4,
        }
    };
    let round_count = cli.rounds.unwrap_or(if cli.long { 5 } else { 3 }).max(1);
    let mut results = Results {
        machine: format!(
            "{} CPU threads, Flex backend, global batch {}, {} warm-up steps + {} windows of {} steps, {} round(s) interleaved",
            threads,
            plan.global_batch,
            plan.warmup_steps,
            plan.windows,
            plan.window_steps,
            round_count
        ),
        links: links(),
        ..Results::default()
    };
    let mut strategies = cli.strategies.clone();
    if strategies.is_empty() {
        strategies = vec![
            Strategy::Single,
            Strategy::BurnMultiDevice(2),
            Strategy::BurnMultiDeviceSharded(2),
            Strategy::DdpThreads(1),
            Strategy::DdpThreads(2),
            Strategy::DdpThreadsSharded(2),
            Strategy::DdpProcesses(2),
            Strategy::DdpProcessesSharded(2),
        ];
        if cfg!(feature = "mpi") {
            strategies.push(Strategy::DdpMpi(2));
        }
        if cli.long {
            strategies.push(Strategy::BurnMultiDevice(4));
            strategies.push(Strategy::BurnMultiDeviceSharded(4));
            strategies.push(Strategy::DdpThreads(4));
            strategies.push(Strategy::DdpThreadsSharded(4));
        }
    }
    let models = if cli.models.is_empty() {
        vec![ModelKind::Cnn, ModelKind::Mlp]
    } else {
        cli.models.clone()
    };
    if !cli.skip_training {
        for &kind in &models {
            let mut rounds: Vec<Vec<Throughput>> = vec![Vec::new(); strategies.len()];
            for round in 0..round_count {
                for (i, &strategy) in strategies.iter().enumerate() {
                    eprintln!(
                        "training {} with {} (N = {}), round {}",
                        kind.name(),
                        strategy.family(),
                        strategy.world_size(),
                        round + 1
                    );
                    let result = match strategy {
                        Strategy::DdpProcesses(_)
                        | Strategy::DdpProcessesSharded(_)
                        | Strategy::DdpMpi(_) => processes(kind, strategy, &plan),
                        _ => training::run(kind, strategy, &plan, None),
                    };
                    eprintln!("  {:.1} samples/s", result.samples_per_second);
                    rounds[i].push(result);
                }
            }
            results
                .throughput
                .extend(rounds.into_iter().filter_map(training::merge_rounds));
        }
    }
    if !cli.skip_prefetch {
        results.prefetch = prefetch(&plan, round_count);
    }
    eprintln!("monitoring: its cost per step");
    results.monitoring = Some(monitoring::measure(round_count.max(3), 200_000));
    eprintln!("start-up: connections with and without the handshake");
    match startup::measure(if cli.long { 200 } else { 40 }) {
        Ok(cost) => results.startup = Some(cost),
        Err(e) => results.notes.push(format!("start-up cost: {e}")),
    }
    for &kind in &models {
        results
            .gradient_bytes
            .push((kind, collectives::gradient_bytes(kind)));
    }
    if !cli.skip_collectives {
        sweep_collectives(cli, &models, &mut results);
    }
    project_links(&mut results, &plan);
    results
}

/// The collectives: memcpy before and after, the all-reduce sweeps of every group (MPI and
/// gloo as programs of their own), and the bucket cap sweep of every model.
fn sweep_collectives(cli: &Cli, models: &[ModelKind], results: &mut Results) {
    let budget = Duration::from_millis(if cli.long { 1000 } else { 300 });
    let sizes: Vec<usize> = (0..9).map(|i| 4096usize << (2 * i)).collect();
    eprintln!("memcpy sweep");
    let before = collectives::memcpy_sweep(&sizes, budget);
    for group in [GroupKind::Threads, GroupKind::Tcp] {
        eprintln!("all-reduce sweep: {}", group.name());
        results
            .all_reduce
            .extend(collectives::all_reduce_sweep(group, 2, &sizes, budget));
    }
    let sizes_arg = sizes
        .iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let budget_arg = budget.as_millis().to_string();
    let mpi = if cfg!(feature = "mpi") {
        eprintln!("all-reduce sweep: {}", GroupKind::Mpi.name());
        let mut command = mpirun(2);
        command
            .arg(std::env::current_exe().unwrap_or_else(|_| "ddp-bench".into()))
            .args([
                "mpi-sweep",
                "--sizes",
                &sizes_arg,
                "--budget-ms",
                &budget_arg,
            ]);
        collectives::external_sweep(GroupKind::Mpi, 2, &sizes, command)
    } else {
        Err(format!(
            "{}: not built (`cargo xtask bench --features mpi`)",
            GroupKind::Mpi.name()
        ))
    };
    eprintln!("all-reduce sweep: {}", GroupKind::Gloo.name());
    let mut command = std::process::Command::new("python3");
    command
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/gloo_allreduce.py"))
        .args(["--sizes", &sizes_arg, "--budget-ms", &budget_arg]);
    let gloo = collectives::external_sweep(GroupKind::Gloo, 2, &sizes, command);
    for sweep in [mpi, gloo] {
        match sweep {
            Ok(points) => results.all_reduce.extend(points),
            Err(note) => results.notes.push(note),
        }
    }
    // The roof is the better of two sweeps, before and after the all-reduces: the machine's
    // drift then lowers the ratios rather than raising them.
    eprintln!("memcpy sweep, again");
    let after = collectives::memcpy_sweep(&sizes, budget);
    results.memcpy = collectives::best_of(before, after);
    for &kind in models {
        for group in [GroupKind::Threads, GroupKind::Tcp] {
            eprintln!("bucket sweep: {} on {}", kind.name(), group.name());
            results.buckets.extend(collectives::bucket_sweep(
                kind,
                group,
                &[1, 4, 25, 100],
                budget,
            ));
        }
    }
}

/// The projection of each model's measured single-device step onto the GPU links, from its
/// gradient bytes.
fn project_links(results: &mut Results, plan: &Plan) {
    for (kind, bytes) in results.gradient_bytes.clone() {
        let Some(single) = results.throughput.iter().find(|t| {
            t.model == kind && t.strategy == Strategy::Single && t.samples_per_second > 0.0
        }) else {
            continue;
        };
        let t1 = plan.global_batch as f64 / single.samples_per_second;
        for link in links() {
            for gpus in [2, 4, 8] {
                results.projection.push(Projection {
                    model: kind,
                    link: link.name.clone(),
                    gpus,
                    efficiency: project(t1, bytes, gpus, &link),
                });
            }
        }
    }
}
