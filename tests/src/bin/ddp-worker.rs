//! A worker process for burn-ddp's multi-process tests: trains the Fashion-MNIST example's CNN on
//! synthetic images as one rank of a job described by the environment (RANK, WORLD_SIZE,
//! MASTER_ADDR, MASTER_PORT, as the launcher sets them), or with `--threads N` as N ranks in this
//! process, and writes rank 0's trained parameters.
//!
//! ```text
//! ddp-worker [--out FILE] [--steps N] [--per-rank-batch B] [--epochs E] [--timeout-s T]
//!            [--delay-ms D] [--ready-dir DIR] [--threads N]
//!            [--checkpoint-dir DIR] [--resume] [--checkpoint-every K]
//!            [--fail-rank R --fail-at-batch K [--fail-attempt A]]
//!            [--signal-rank R --signal-at-batch K] [--bucket-caps FIRST,REST]
//!            [--model cnn|mlp] [--out-every-rank] [--panic-rank R --panic-at-batch K]
//! ddp-worker launch N [--stop-grace-s S] -- WORKER ARGS...
//! ddp-worker mpi-case CASE [--out FILE]      (feature `mpi`, under mpirun)
//! ```
//! `--out-every-rank`: every rank writes its parameters, to FILE.rankR. `--model mlp`: a
//! deterministic MLP without buffers, SGD, on the synthetic 16-feature dataset (comparable with
//! one device), instead of the CNN.
//! `--ready-dir`: after its 2nd batch, each rank writes its pid to DIR/pid-RANK.
//! `--fail-*`: rank R exits with code 3 at its K-th batch (only in restart round A, default 0).
//! `--signal-*`: rank R (a thread rank with `--threads`) sends itself SIGTERM (`--signal hup`:
//! SIGHUP) at its K-th batch (first attempt only).
//! `--checkpoint-dir`: checkpoints in DIR/checkpoint; `--resume` resumes from the newest complete
//! one there, whichever run wrote it (a launcher restart, from its own run's). A run stopped by a signal exits with 143. `--init-seed S`: the
//! CNN's initial values from seed S (default 11), so a resumed run can start from other values
//! than the checkpoint's (it then matches only if the checkpoint was read).
//! `launch N`: runs burn-ddp's launcher with N copies of this program as workers.
//! `mpi-case`: one `MpiGroup` scenario: `collectives` (every collective, the `f32` all-gather and
//! the reduce-scatter included, on known inputs, each
//! rank's results to FILE.rankR), `silent` (rank 1 never calls the all-reduce rank 0 waits in,
//! 1 s timeout), `exit` (rank 1 exits at once without finalising MPI), `mismatch-len` (ranks
//! all-reduce different lengths), `mismatch-op` (rank 0 all-reduces, the others broadcast),
//! `mismatch-half` (rank 0 all-reduces f16, the others bf16).
//! `--panic-rank R --panic-at-batch K`: rank R panics in its K-th batch (a failure the strategy
//! sees, unlike `--fail-rank`'s exit).
//! `--straggle-rank R --straggle-at-batch K`: rank R sleeps in its K-th batch, 800 ms or three
//! times its longest step so far if longer (its peers wait for it in that step's gradient
//! synchronisation, a spike even where a loaded machine makes every step slow); `--spike-factor F`: a
//! synchronisation over F times the median is a spike (`DdpConfig::with_spike_factor`).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use burn_ddp::DdpConfig;
use burn_ddp::comm::launch::{LaunchConfig, launch};
use burn_ddp::comm::topology::Topology;
use burn_ddp_tests::{STEP_HOOK, train_example_cnn_from_env, write_tensors};

struct Args {
    out: Option<PathBuf>,
    steps: usize,
    per_rank_batch: usize,
    epochs: usize,
    timeout: Duration,
    delay: Duration,
    ready_dir: Option<PathBuf>,
    threads: Option<usize>,
    checkpoint_dir: Option<PathBuf>,
    resume: bool,
    checkpoint_every: u64,
    fail_rank: Option<usize>,
    fail_at_batch: usize,
    fail_attempt: u64,
    signal_rank: Option<usize>,
    signal_at_batch: usize,
    signal: i32,
    bucket_caps: Option<(usize, usize)>,
    out_every_rank: bool,
    mlp: bool,
    panic_rank: Option<usize>,
    panic_at_batch: usize,
    straggle_rank: Option<usize>,
    straggle_at_batch: usize,
    spike_factor: Option<f64>,
    init_seed: u64,
}

fn parse(raw: &[String]) -> Result<Args, String> {
    let mut args = Args {
        out: None,
        steps: 3,
        per_rank_batch: 2,
        epochs: 1,
        timeout: Duration::from_secs(20),
        delay: Duration::ZERO,
        ready_dir: None,
        threads: None,
        checkpoint_dir: None,
        resume: false,
        checkpoint_every: 0,
        fail_rank: None,
        fail_at_batch: 2,
        fail_attempt: 0,
        signal_rank: None,
        signal_at_batch: 2,
        signal: libc::SIGTERM,
        bucket_caps: None,
        out_every_rank: false,
        mlp: false,
        panic_rank: None,
        panic_at_batch: 2,
        straggle_rank: None,
        straggle_at_batch: 2,
        spike_factor: None,
        init_seed: 11,
    };
    let mut it = raw.iter().cloned();
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        let number = |v: String| v.parse::<u64>().map_err(|e| format!("{v}: {e}"));
        match flag.as_str() {
            "--out" => args.out = Some(PathBuf::from(value()?)),
            "--steps" => args.steps = number(value()?)? as usize,
            "--per-rank-batch" => args.per_rank_batch = number(value()?)? as usize,
            "--epochs" => args.epochs = number(value()?)? as usize,
            "--timeout-s" => args.timeout = Duration::from_secs(number(value()?)?),
            "--delay-ms" => args.delay = Duration::from_millis(number(value()?)?),
            "--ready-dir" => args.ready_dir = Some(PathBuf::from(value()?)),
            "--threads" => args.threads = Some(number(value()?)? as usize),
            "--checkpoint-dir" => args.checkpoint_dir = Some(PathBuf::from(value()?)),
            "--resume" => args.resume = true,
            "--out-every-rank" => args.out_every_rank = true,
            "--panic-rank" => args.panic_rank = Some(number(value()?)? as usize),
            "--panic-at-batch" => args.panic_at_batch = number(value()?)? as usize,
            "--straggle-rank" => args.straggle_rank = Some(number(value()?)? as usize),
            "--straggle-at-batch" => args.straggle_at_batch = number(value()?)? as usize,
            "--spike-factor" => {
                let text = value()?;
                args.spike_factor = Some(
                    text.parse()
                        .map_err(|e| format!("--spike-factor {text}: {e}"))?,
                );
            }
            "--model" => match value()?.as_str() {
                "mlp" => args.mlp = true,
                "cnn" => args.mlp = false,
                other => return Err(format!("--model mlp|cnn, got {other}")),
            },
            "--checkpoint-every" => args.checkpoint_every = number(value()?)?,
            "--init-seed" => args.init_seed = number(value()?)?,
            "--fail-rank" => args.fail_rank = Some(number(value()?)? as usize),
            "--fail-at-batch" => args.fail_at_batch = number(value()?)? as usize,
            "--fail-attempt" => args.fail_attempt = number(value()?)?,
            "--signal-rank" => args.signal_rank = Some(number(value()?)? as usize),
            "--signal" => {
                args.signal = match value()?.as_str() {
                    "hup" => libc::SIGHUP,
                    "term" => libc::SIGTERM,
                    other => return Err(format!("--signal hup|term, got {other}")),
                }
            }
            "--signal-at-batch" => args.signal_at_batch = number(value()?)? as usize,
            "--bucket-caps" => {
                let caps = value()?;
                let (first, rest) = caps
                    .split_once(',')
                    .ok_or(format!("--bucket-caps FIRST,REST, got {caps}"))?;
                args.bucket_caps = Some((
                    number(first.to_string())? as usize,
                    number(rest.to_string())? as usize,
                ));
            }
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(args)
}

/// `ddp-worker launch N [--stop-grace-s S] -- ARGS`: the launcher, with this program as worker.
fn launcher(raw: &[String]) -> ExitCode {
    let Some(n) = raw.first().and_then(|n| n.parse::<usize>().ok()) else {
        err_line("ddp-worker launch: expected the number of workers".to_string());
        return ExitCode::from(2);
    };
    let mut rest = &raw[1..];
    let mut stop_grace = Duration::from_secs(60);
    if rest.first().map(String::as_str) == Some("--stop-grace-s") {
        let Some(s) = rest.get(1).and_then(|s| s.parse::<u64>().ok()) else {
            err_line("ddp-worker launch: --stop-grace-s needs seconds".to_string());
            return ExitCode::from(2);
        };
        stop_grace = Duration::from_secs(s);
        rest = &rest[2..];
    }
    let worker_args = match rest.split_first() {
        Some((dashes, args)) if dashes == "--" => args.to_vec(),
        _ => {
            err_line("ddp-worker launch: expected `--` before the worker's arguments".to_string());
            return ExitCode::from(2);
        }
    };
    let program = match std::env::current_exe() {
        Ok(program) => program,
        Err(e) => {
            err_line(format!("ddp-worker launch: {e}"));
            return ExitCode::FAILURE;
        }
    };
    let mut config = LaunchConfig::new(n, program, worker_args);
    config.master_port = 0;
    config.stop_grace = stop_grace;
    match launch(&config) {
        Ok(_) => ExitCode::SUCCESS,
        Err(e) => {
            err_line(format!("ddp-worker launch: {e}"));
            ExitCode::from(e.exit_code() as u8)
        }
    }
}

fn main() -> ExitCode {
    let raw: Vec<String> = std::env::args().skip(1).collect();
    if raw.first().map(String::as_str) == Some("launch") {
        return launcher(&raw[1..]);
    }
    #[cfg(feature = "mpi")]
    if raw.first().map(String::as_str) == Some("mpi-case") {
        return mpi_case(&raw[1..]);
    }
    let args = match parse(&raw) {
        Ok(args) => args,
        Err(e) => {
            err_line(format!("ddp-worker: {e}"));
            return ExitCode::from(2);
        }
    };
    let topology = match (args.threads, Topology::from_env()) {
        (Some(_), _) => None,
        (None, Ok(Some(topology))) => Some(topology),
        (None, Ok(None)) => {
            err_line(
                "ddp-worker: not started as part of a job (RANK/WORLD_SIZE unset)".to_string(),
            );
            return ExitCode::from(2);
        }
        (None, Err(e)) => {
            err_line(format!("ddp-worker: {e}"));
            return ExitCode::FAILURE;
        }
    };
    let process_rank = topology.as_ref().map(|t| t.rank);
    let attempt = topology.as_ref().map_or(0, |t| t.restart_count);
    let (delay, ready_dir) = (args.delay, args.ready_dir.clone());
    let (fail_rank, fail_at, fail_attempt) =
        (args.fail_rank, args.fail_at_batch, args.fail_attempt);
    let (signal_rank, signal_at, signal) = (args.signal_rank, args.signal_at_batch, args.signal);
    let (panic_rank, panic_at) = (args.panic_rank, args.panic_at_batch);
    let (straggle_rank, straggle_at) = (args.straggle_rank, args.straggle_at_batch);
    let _ = STEP_HOOK.set(Box::new(move |batch| {
        // This rank: the process's, or the thread's ("burn-ddp-rank-R"; rank 0 of a single
        // replica trains on the main thread).
        let rank = process_rank.unwrap_or_else(|| {
            std::thread::current()
                .name()
                .and_then(|n| n.strip_prefix("burn-ddp-rank-"))
                .and_then(|r| r.parse().ok())
                .unwrap_or(0)
        });
        if fail_rank == Some(rank) && batch == fail_at && attempt == fail_attempt {
            err_line(format!(
                "ddp-worker rank {rank}: failing on purpose at batch {batch}"
            ));
            std::process::exit(3);
        }
        if straggle_rank == Some(rank) {
            straggle(batch, straggle_at);
        }
        if panic_rank == Some(rank) && batch == panic_at {
            panic!("ddp-worker rank {rank}: panicking on purpose at batch {batch}");
        }
        if signal_rank == Some(rank) && batch == signal_at && attempt == 0 {
            err_line(format!(
                "ddp-worker rank {rank}: sending itself signal {signal} at batch {batch}"
            ));
            // SAFETY: `raise` only sends a signal to this process.
            unsafe {
                libc::raise(signal);
            }
        }
        if batch == 2
            && let Some(dir) = &ready_dir
        {
            let _ = std::fs::write(
                dir.join(format!("pid-{rank}")),
                std::process::id().to_string(),
            );
        }
        std::thread::sleep(delay);
    }));
    let rank = process_rank.unwrap_or(0);
    let mut config = DdpConfig::default()
        .with_timeout(args.timeout)
        .with_checkpoint_every(args.checkpoint_every);
    if let Some(factor) = args.spike_factor {
        config = config.with_spike_factor(factor);
    }
    if let Some((first, rest)) = args.bucket_caps {
        config = config
            .with_first_bucket_cap_bytes(first)
            .with_bucket_cap_bytes(rest);
    }
    // A restart by the launcher resumes its own run by itself (DdpStrategy::from_env notices
    // it); `--resume` points at the checkpoint directory, whichever run wrote it.
    if args.resume
        && let Some(dir) = &args.checkpoint_dir
    {
        config = config.with_resume_from(dir.join("checkpoint"));
    }
    // Threads (--threads) or this process's rank, built from the launcher's environment in one
    // call, as a user's program would.
    let trained = if args.mlp {
        burn_ddp_tests::train_mlp(None, args.steps, args.per_rank_batch, config, args.timeout)
    } else {
        train_example_cnn_from_env(
            args.threads.unwrap_or(1),
            args.steps,
            args.per_rank_batch,
            config,
            args.epochs,
            args.checkpoint_dir.clone(),
            args.timeout,
            args.init_seed,
        )
    };
    match trained {
        Ok((tensors, _)) => {
            let out = match &args.out {
                Some(out) if args.out_every_rank => Some(out.with_extension(format!("rank{rank}"))),
                Some(out) if rank == 0 => Some(out.clone()),
                _ => None,
            };
            if let Some(out) = &out
                && let Err(e) = write_tensors(out, &tensors)
            {
                err_line(format!(
                    "ddp-worker rank {rank}: cannot write {}: {e}",
                    out.display()
                ));
                return ExitCode::FAILURE;
            }
            out_line(format!("ddp-worker rank {rank}: done"));
            ExitCode::SUCCESS
        }
        Err(e) => {
            err_line(format!("ddp-worker rank {rank}: {e}"));
            ExitCode::from(e.exit_code() as u8)
        }
    }
}

/// `ddp-worker mpi-case CASE [--out FILE]`: one scenario of the MPI process group (see the
/// module docs). Exit code 0 when the scenario ran as expected on this rank, 1 with the error on
/// stderr otherwise.
#[cfg(feature = "mpi")]
fn mpi_case(raw: &[String]) -> ExitCode {
    use burn_ddp::ProcessGroup;
    use burn_ddp::group::{ExtendedCollectives, MpiGroup, ReduceOp};
    use burn_ddp_tests::collective_input;

    let case = raw.first().map(String::as_str).unwrap_or("");
    let out = match raw.get(1..3) {
        Some([flag, file]) if flag == "--out" => Some(PathBuf::from(file)),
        _ => None,
    };
    let group = match MpiGroup::world() {
        Ok(group) => group,
        Err(e) => {
            err_line(format!("ddp-worker mpi-case: {e}"));
            return ExitCode::FAILURE;
        }
    };
    let (rank, n) = (group.rank(), group.world_size());
    let long = Duration::from_secs(30);
    let result: Result<(), burn_ddp::DdpError> = match case {
        "collectives" => (|| {
            let len = 10_007;
            let mut sum: Vec<f32> = (0..len).map(|i| collective_input(rank, i)).collect();
            let mut avg = sum.clone();
            group.all_reduce(&mut sum, ReduceOp::Sum, long)?;
            group.all_reduce(&mut avg, ReduceOp::Avg, long)?;
            let mut broadcast = vec![rank as f32 + 0.5; 1000];
            group.broadcast(&mut broadcast, n - 1, long)?;
            group.barrier(long)?;
            let gathered = group.all_gather(&[rank as u64, 7], long)?;
            // An empty all-reduce and all-gather are calls too (same sequence on every rank).
            group.all_reduce(&mut [], ReduceOp::Sum, long)?;
            let empty = group.all_gather(&[], long)?;
            let gathered: Vec<f32> = gathered.iter().map(|&v| v as f32).collect();
            // Fewer elements than ranks (some ranks' share is empty in a ring).
            let mut tiny = vec![rank as f32 + 1.0, 2.0];
            group.all_reduce(&mut tiny, ReduceOp::Sum, long)?;
            // 16-bit compression: f16 averages of the same inputs.
            let format = burn_ddp::comm::group::HalfFloat::F16;
            let mut half: Vec<u16> = (0..len)
                .map(|i| format.from_f32(collective_input(rank, i)))
                .collect();
            group.all_reduce_half(&mut half, format, ReduceOp::Avg, long)?;
            let half: Vec<f32> = half.iter().map(|&b| format.to_f32(b)).collect();
            // Optimizer-state sharding's collectives: an f32 all-gather (bits copied) and a
            // reduce-scatter of 5 values per rank.
            let mut gathered_f32 = vec![0.0f32; 3 * n];
            group.all_gather_f32(&[rank as f32 + 0.25; 3], &mut gathered_f32, long)?;
            let whole: Vec<f32> = (0..5 * n).map(|i| collective_input(rank, i)).collect();
            let mut scattered = vec![0.0f32; 5];
            group.reduce_scatter(&whole, &mut scattered, ReduceOp::Sum, long)?;
            let tensors = [
                sum,
                avg,
                broadcast,
                gathered,
                vec![empty.len() as f32],
                tiny,
                half,
                gathered_f32,
                scattered,
            ];
            if let Some(out) = &out {
                let file = out.with_extension(format!("rank{rank}"));
                write_tensors(&file, &tensors).map_err(|e| {
                    burn_ddp::DdpError::InvalidConfig(format!("{}: {e}", file.display()))
                })?;
            }
            Ok(())
        })(),
        "silent" => {
            if rank == 1 {
                // Never calls the collective; ended by rank 0's MPI_Abort (bounded anyway).
                std::thread::sleep(Duration::from_secs(20));
                Ok(())
            } else {
                group
                    .all_reduce(&mut [1.0; 16], ReduceOp::Sum, Duration::from_secs(1))
                    .map_err(Into::into)
            }
        }
        "exit" => {
            if rank == 1 {
                err_line("ddp-worker rank 1: exiting without a collective".to_string());
                std::process::exit(0);
            }
            group
                .all_reduce(&mut [1.0; 16], ReduceOp::Sum, long)
                .map_err(Into::into)
        }
        "mismatch-len" => {
            let mut bucket = vec![1.0f32; 10 + rank];
            let first = group.all_reduce(&mut bucket, ReduceOp::Sum, long);
            // The group refuses what follows.
            let second = group.barrier(long);
            err_line(format!("ddp-worker rank {rank}: then {second:?}"));
            first.map_err(Into::into)
        }
        "mismatch-half" => {
            use burn_ddp::comm::group::HalfFloat;
            let format = if rank == 0 {
                HalfFloat::F16
            } else {
                HalfFloat::Bf16
            };
            group
                .all_reduce_half(&mut [0u16; 10], format, ReduceOp::Sum, long)
                .map_err(Into::into)
        }
        "mismatch-op" => {
            let mut bucket = vec![1.0f32; 10];
            if rank == 0 {
                group
                    .all_reduce(&mut bucket, ReduceOp::Sum, long)
                    .map_err(Into::into)
            } else {
                group.broadcast(&mut bucket, 0, long).map_err(Into::into)
            }
        }
        other => {
            err_line(format!("ddp-worker mpi-case: unknown case {other:?}"));
            return ExitCode::from(2);
        }
    };
    match result {
        Ok(()) => {
            out_line(format!("ddp-worker rank {rank}: done"));
            ExitCode::SUCCESS
        }
        Err(e) => {
            err_line(format!("ddp-worker rank {rank}: {e}"));
            ExitCode::FAILURE
        }
    }
}

/// Prints `line` on stderr in one write: the ranks of an `mpirun` job share one terminal, and
/// `eprintln!` writes its pieces one by one, so two ranks' lines interleaved mid-line.
fn err_line(line: String) {
    let _ = std::io::Write::write_all(&mut std::io::stderr(), format!("{line}\n").as_bytes());
}

/// [`err_line`] on stdout.
fn out_line(line: String) {
    let _ = std::io::Write::write_all(&mut std::io::stdout(), format!("{line}\n").as_bytes());
}

/// The straggler's hook, called at the start of each of its batches: in batch `at` it sleeps
/// 800 ms, or three times the longest step it has seen if longer, so that its peers, whose
/// compute of that step can be slowed as much as its own by a loaded machine, still wait for
/// it (a fixed 800 ms was less than one slow step of the example CNN on a busy CI machine).
fn straggle(batch: usize, at: usize) {
    use std::cell::Cell;
    use std::time::Instant;
    thread_local! {
        static LAST: Cell<Option<Instant>> = const { Cell::new(None) };
        static LONGEST: Cell<Duration> = const { Cell::new(Duration::ZERO) };
    }
    let now = Instant::now();
    if let Some(last) = LAST.get() {
        LONGEST.set(LONGEST.get().max(now - last));
    }
    if batch == at {
        std::thread::sleep(Duration::from_millis(800).max(3 * LONGEST.get()));
    }
    LAST.set(Some(Instant::now()));
}
