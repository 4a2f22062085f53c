//! A worker process for burn-ddp's multi-process tests: trains the Fashion-MNIST example's CNN on
//! synthetic images as one rank of a job described by the environment (RANK, WORLD_SIZE,
//! MASTER_ADDR, MASTER_PORT, as the launcher sets them), and writes rank 0's trained parameters.
//!
//! ```text
//! ddp-worker --out FILE [--steps N] [--per-rank-batch B] [--timeout-s T] [--delay-ms D]
//!            [--ready-dir DIR] [--fail-rank R --fail-at-batch K [--fail-attempt A]]
//! ```
//! `--ready-dir`: after its 2nd batch, each rank writes its pid to DIR/pid-RANK.
//! `--fail-*`: rank R exits with code 3 at its K-th batch (only in restart round A, default 0).

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use burn_ddp::{DdpConfig, TcpGroup, TcpGroupOptions, Topology};
use burn_ddp_tests::{STEP_HOOK, train_example_cnn, write_tensors};

struct Args {
    out: Option<PathBuf>,
    steps: usize,
    per_rank_batch: usize,
    timeout: Duration,
    delay: Duration,
    ready_dir: Option<PathBuf>,
    fail_rank: Option<usize>,
    fail_at_batch: usize,
    fail_attempt: u64,
}

fn parse() -> Result<Args, String> {
    let mut args = Args {
        out: None,
        steps: 3,
        per_rank_batch: 2,
        timeout: Duration::from_secs(20),
        delay: Duration::ZERO,
        ready_dir: None,
        fail_rank: None,
        fail_at_batch: 2,
        fail_attempt: 0,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        let number = |v: String| v.parse::<u64>().map_err(|e| format!("{v}: {e}"));
        match flag.as_str() {
            "--out" => args.out = Some(PathBuf::from(value()?)),
            "--steps" => args.steps = number(value()?)? as usize,
            "--per-rank-batch" => args.per_rank_batch = number(value()?)? as usize,
            "--timeout-s" => args.timeout = Duration::from_secs(number(value()?)?),
            "--delay-ms" => args.delay = Duration::from_millis(number(value()?)?),
            "--ready-dir" => args.ready_dir = Some(PathBuf::from(value()?)),
            "--fail-rank" => args.fail_rank = Some(number(value()?)? as usize),
            "--fail-at-batch" => args.fail_at_batch = number(value()?)? as usize,
            "--fail-attempt" => args.fail_attempt = number(value()?)?,
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(args)
}

fn main() -> ExitCode {
    let args = match parse() {
        Ok(args) => args,
        Err(e) => {
            eprintln!("ddp-worker: {e}");
            return ExitCode::from(2);
        }
    };
    let topology = match Topology::from_env() {
        Ok(Some(topology)) => topology,
        Ok(None) => {
            eprintln!("ddp-worker: not started as part of a job (RANK/WORLD_SIZE unset)");
            return ExitCode::from(2);
        }
        Err(e) => {
            eprintln!("ddp-worker: {e}");
            return ExitCode::FAILURE;
        }
    };
    let rank = topology.rank;
    let attempt = topology.restart_count;
    let (delay, ready_dir) = (args.delay, args.ready_dir.clone());
    let (fail_rank, fail_at, fail_attempt) =
        (args.fail_rank, args.fail_at_batch, args.fail_attempt);
    let _ = STEP_HOOK.set(Box::new(move |batch| {
        if fail_rank == Some(rank) && batch == fail_at && attempt == fail_attempt {
            eprintln!("ddp-worker rank {rank}: failing on purpose at batch {batch}");
            std::process::exit(3);
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
    let options = TcpGroupOptions {
        connect_timeout: args.timeout,
    };
    let group = match TcpGroup::connect(&topology, &options) {
        Ok(group) => group,
        Err(e) => {
            eprintln!("ddp-worker rank {rank}: {e}");
            return ExitCode::FAILURE;
        }
    };
    let config = DdpConfig::default().with_timeout(args.timeout);
    match train_example_cnn(
        Some(Arc::new(group)),
        1,
        args.steps,
        args.per_rank_batch,
        config,
    ) {
        Ok((tensors, _)) => {
            if rank == 0
                && let Some(out) = &args.out
                && let Err(e) = write_tensors(out, &tensors)
            {
                eprintln!(
                    "ddp-worker rank {rank}: cannot write {}: {e}",
                    out.display()
                );
                return ExitCode::FAILURE;
            }
            println!("ddp-worker rank {rank}: done");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("ddp-worker rank {rank}: {e}");
            ExitCode::FAILURE
        }
    }
}
