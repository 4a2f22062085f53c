//! `burn-ddp`: the launcher of multi-process data-parallel jobs (the counterpart of `torchrun`).
//!
//! ```text
//! burn-ddp run --nproc-per-node N [--nnodes M --node-rank K --master-addr A --master-port P]
//!              [--max-restarts R] [--log-dir DIR] -- PROGRAM [ARGS...]
//! ```

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use burn_ddp::comm::launch::{LaunchConfig, launch};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    version,
    about = "Launch data-parallel workers (one process per device)"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Start PROGRAM once per local device with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
    /// MASTER_ADDR and MASTER_PORT set; stop them all when one fails.
    Run {
        /// Worker processes on this machine (one per device).
        #[arg(long)]
        nproc_per_node: usize,
        /// Machines in the job (run one launcher on each).
        #[arg(long, default_value_t = 1)]
        nnodes: usize,
        /// This machine's index; node 0 serves the rendezvous store.
        #[arg(long, default_value_t = 0)]
        node_rank: usize,
        /// Address of node 0, reachable from every node.
        #[arg(long, default_value = "127.0.0.1")]
        master_addr: String,
        /// Port of the rendezvous store on node 0.
        #[arg(long, default_value_t = burn_ddp::comm::topology::DEFAULT_MASTER_PORT)]
        master_port: u16,
        /// Restart the whole group up to R times after a failure (workers should resume from
        /// their last checkpoint; BURN_DDP_RESTART_COUNT tells them the round).
        #[arg(long, default_value_t = 0)]
        max_restarts: u32,
        /// Also write each rank's output to DIR/rank-R.log.
        #[arg(long)]
        log_dir: Option<PathBuf>,
        /// Seconds between SIGTERM and SIGKILL when stopping workers after one failed.
        #[arg(long, default_value_t = 5.0)]
        kill_grace: f64,
        /// Seconds workers get to reach a step boundary and checkpoint when the launcher is
        /// stopped by SIGTERM/SIGINT (then SIGKILL).
        #[arg(long, default_value_t = 60.0)]
        stop_grace: f64,
        /// Run a job of several nodes without BURN_DDP_JOB_TOKEN (anyone who reaches the store's
        /// port could join it): only on a network you trust.
        #[arg(long)]
        allow_no_token: bool,
        /// The worker program and its arguments, after `--`.
        #[arg(last = true, required = true)]
        command: Vec<String>,
    },
}

fn main() -> ExitCode {
    let Command::Run {
        nproc_per_node,
        nnodes,
        node_rank,
        master_addr,
        master_port,
        max_restarts,
        log_dir,
        kill_grace,
        stop_grace,
        allow_no_token,
        command,
    } = Cli::parse().command;
    let seconds = |s: f64, default: u64| {
        Duration::try_from_secs_f64(s.clamp(0.0, 86_400.0)).unwrap_or(Duration::from_secs(default))
    };
    let (program, args) = match command.split_first() {
        Some((program, args)) => (program.clone(), args.to_vec()),
        None => {
            eprintln!("burn-ddp: no program given after `--`");
            return ExitCode::FAILURE;
        }
    };
    let config = LaunchConfig {
        nnodes,
        node_rank,
        master_addr,
        master_port,
        max_restarts,
        log_dir,
        kill_grace: seconds(kill_grace, 5),
        stop_grace: seconds(stop_grace, 60),
        allow_no_token,
        ..LaunchConfig::new(nproc_per_node, program, args)
    };
    match launch(&config) {
        Ok(reports) => {
            if reports.len() > 1 {
                eprintln!(
                    "burn-ddp: the job succeeded after {} restart(s)",
                    reports.len() - 1
                );
            }
            ExitCode::SUCCESS
        }
        Err(err @ burn_ddp::comm::CommError::Stopped { .. }) => {
            eprintln!("burn-ddp: job stopped: {err}");
            ExitCode::from(err.exit_code() as u8)
        }
        Err(err) => {
            eprintln!("burn-ddp: job failed: {err}");
            ExitCode::FAILURE
        }
    }
}
