//! Process supervision: one attempt of the local workers (spawn with the topology's environment,
//! watch, stop the others when one fails, SIGTERM then SIGKILL after a grace period).

use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::output::pump;
use super::{AttemptOutcome, LaunchConfig, ROUND_KEY, WorkerExit};
use crate::auth::{JOB_TOKEN_VAR, JobIdentity};
use crate::error::{CommError, Result};
use crate::store::StoreClient;
use crate::topology::{AGENT_STORE_VAR, LAUNCHER_VAR, RESTART_COUNT_VAR};

/// Why an attempt ended early.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Failure {
    /// A local worker failed: `(global rank, pid, how)`.
    Worker(usize, u32, WorkerExit),
    /// Another node's launcher started round `.0`: this node's workers were stopped.
    OtherNode(u32),
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Worker(rank, pid, how) => write!(f, "rank {rank} (pid {pid}) {how}"),
            Failure::OtherNode(round) => {
                write!(
                    f,
                    "another node's workers failed (it started round {round})"
                )
            }
        }
    }
}

struct Running {
    rank: usize,
    child: Child,
    pumps: Vec<JoinHandle<()>>,
    exit: Option<WorkerExit>,
}

/// A worker's log file, shared by its two output pumps.
type Log = Option<Arc<Mutex<std::fs::File>>>;

/// Runs one attempt: starts the local workers with the job's environment, watches them until
/// all have exited, one failed, another node started the next round, or a stop signal came, and
/// reports how each ended.
///
/// # Errors
/// [`CommError::Launch`] when a log file cannot be opened or a worker cannot be started (the
/// workers already started are stopped first).
pub(super) fn run_attempt(
    config: &LaunchConfig,
    master_port: u16,
    attempt: u32,
    store: &StoreClient,
    job: &JobIdentity,
) -> Result<AttemptOutcome> {
    let ranks: Vec<usize> = (0..config.nproc_per_node)
        .map(|local| config.node_rank * config.nproc_per_node + local)
        .collect();
    // Open every log file before starting anything, so a failure leaves no worker behind.
    let logs = open_logs(config, &ranks)?;
    let mut workers: Vec<Running> = Vec::new();
    let stdout = Arc::new(Mutex::new(std::io::stdout()));
    let stderr = Arc::new(Mutex::new(std::io::stderr()));
    for (local_rank, (&rank, log)) in ranks.iter().zip(logs).enumerate() {
        let mut command = worker_command(config, master_port, attempt, job, rank, local_rank);
        let mut child = match command.spawn() {
            Ok(child) => child,
            Err(e) => {
                stop_all(&mut workers, config.kill_grace);
                return Err(CommError::Launch(format!(
                    "cannot start rank {rank} ({}): {e}",
                    config.program.display()
                )));
            }
        };
        let mut pumps = Vec::new();
        if let Some(out) = child.stdout.take() {
            pumps.push(pump(out, rank, stdout.clone(), log.clone()));
        }
        if let Some(err) = child.stderr.take() {
            pumps.push(pump(err, rank, stderr.clone(), log.clone()));
        }
        workers.push(Running {
            rank,
            child,
            pumps,
            exit: None,
        });
    }
    let mut watch = Watch::new(attempt);
    loop {
        match watch.poll(&mut workers, store, config) {
            Some(grace) => {
                stop_all(&mut workers, grace);
                break;
            }
            None if workers.iter().all(|w| w.exit.is_some()) => break,
            None => std::thread::sleep(Duration::from_millis(20)),
        }
    }
    Ok(watch.outcome(finish(workers)))
}

/// Each local rank's log file under `config.log_dir`, opened for appending (none without one).
fn open_logs(config: &LaunchConfig, ranks: &[usize]) -> Result<Vec<Log>> {
    ranks
        .iter()
        .map(|rank| match &config.log_dir {
            Some(dir) => {
                let path = dir.join(format!("rank-{rank}.log"));
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&path)
                    .map(|file| Some(Arc::new(Mutex::new(file))))
                    .map_err(|e| CommError::Launch(format!("cannot open {}: {e}", path.display())))
            }
            None => Ok(None),
        })
        .collect()
}

/// The command that starts global rank `rank` (`local_rank` on this node) of attempt `attempt`:
/// the topology's variables, the job's worker environment (never the token: workers cannot act
/// as launchers), its own process group and, on Linux, a SIGTERM when the launcher dies.
fn worker_command(
    config: &LaunchConfig,
    master_port: u16,
    attempt: u32,
    job: &JobIdentity,
    rank: usize,
    local_rank: usize,
) -> Command {
    let mut command = Command::new(&config.program);
    command
        .args(&config.args)
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", config.world_size().to_string())
        .env("LOCAL_RANK", local_rank.to_string())
        .env("LOCAL_WORLD_SIZE", config.nproc_per_node.to_string())
        .env("GROUP_RANK", config.node_rank.to_string())
        .env("NODE_RANK", config.node_rank.to_string())
        .env("MASTER_ADDR", &config.master_addr)
        .env("MASTER_PORT", master_port.to_string())
        .env(LAUNCHER_VAR, "1")
        .env(AGENT_STORE_VAR, "1")
        .env(RESTART_COUNT_VAR, attempt.to_string())
        .env_remove(JOB_TOKEN_VAR)
        .envs(job.worker_env())
        .envs(config.env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    #[cfg(unix)]
    {
        // Each worker leads its own process group, so stopping it also stops what it started
        // (data-loading processes, a shell's children) and nothing keeps its output open; the
        // terminal's Ctrl-C reaches the launcher, which stops the groups.
        std::os::unix::process::CommandExt::process_group(&mut command, 0);
        #[cfg(target_os = "linux")]
        {
            let launcher = std::process::id() as libc::pid_t;
            // SAFETY: `arm_parent_death` calls only async-signal-safe functions (`prctl`,
            // `getppid`) and touches no memory of the parent.
            unsafe {
                std::os::unix::process::CommandExt::pre_exec(&mut command, move || {
                    arm_parent_death(launcher)
                });
            }
        }
    }
    command
}

/// What the watch of an attempt has seen so far, and so when it stops the workers.
struct Watch {
    attempt: u32,
    first_failure: Option<Failure>,
    interrupted: Option<i32>,
    /// Workers that exited with code 0 while others still ran: `(rank, pid)`.
    left_early: Vec<(usize, u32)>,
    last_round_check: Instant,
}

impl Watch {
    fn new(attempt: u32) -> Self {
        Self {
            attempt,
            first_failure: None,
            interrupted: None,
            left_early: Vec::new(),
            last_round_check: Instant::now(),
        }
    }

    /// One look at the workers, the signals and the store's round. Returns the grace the
    /// workers still running get before SIGKILL when they must be stopped now: the kill grace
    /// after a failure (here or on another node), the stop grace (to checkpoint) after a signal.
    fn poll(
        &mut self,
        workers: &mut [Running],
        store: &StoreClient,
        config: &LaunchConfig,
    ) -> Option<Duration> {
        let failed_now = reap(workers);
        // A worker that finished while others still run: fine at the very end of a job, the
        // likely cause when its peers then fail (they wait for a rank that left).
        if self.first_failure.is_none() && workers.iter().any(|w| w.exit.is_none()) {
            for worker in workers
                .iter()
                .filter(|w| w.exit.is_some_and(|e| e.success()))
            {
                let id = (worker.rank, worker.child.id());
                if !self.left_early.contains(&id) {
                    self.left_early.push(id);
                }
            }
        }
        if self.first_failure.is_none()
            && let Some(&(rank, pid, exit)) = failed_now.first()
        {
            let early: Vec<usize> = self.left_early.iter().map(|&(rank, _)| rank).collect();
            let before = match early.as_slice() {
                [] => String::new(),
                early => format!(
                    " (rank(s) {early:?} had exited with code 0 before, while their peers were \
                     still training)"
                ),
            };
            eprintln!("burn-ddp: rank {rank} (pid {pid}) {exit}{before}; stopping the other ranks");
            self.first_failure = Some(Failure::Worker(rank, pid, exit));
        }
        if self.interrupted.is_none()
            && let Some(signal) = crate::signals::received()
        {
            eprintln!(
                "burn-ddp: received signal {signal} ({}); asking the workers to stop (SIGTERM; \
                 {} s to checkpoint)",
                crate::signals::name(signal),
                config.stop_grace.as_secs_f64()
            );
            self.interrupted = Some(signal);
        }
        // Another node may have failed and started the next round.
        if self.first_failure.is_none()
            && self.last_round_check.elapsed() >= Duration::from_millis(250)
        {
            self.last_round_check = Instant::now();
            if let Ok(round) = store.add(ROUND_KEY, 0)
                && round as u32 > self.attempt
            {
                eprintln!("burn-ddp: another node started round {round}; stopping the workers");
                self.first_failure = Some(Failure::OtherNode(round as u32));
            }
        }
        if self.first_failure.is_some() {
            Some(config.kill_grace)
        } else if self.interrupted.is_some() {
            Some(config.stop_grace)
        } else {
            None
        }
    }

    /// The attempt's outcome, with how each worker ended.
    fn outcome(self, workers: Vec<(usize, u32, WorkerExit)>) -> AttemptOutcome {
        AttemptOutcome {
            attempt: self.attempt,
            workers,
            first_failure: match self.first_failure {
                Some(Failure::Worker(rank, pid, exit)) => Some((rank, pid, exit)),
                _ => None,
            },
            interrupted: self.interrupted,
            other_node: match self.first_failure {
                Some(Failure::OtherNode(round)) => Some(round),
                _ => None,
            },
            // Only what preceded a failure is worth reporting.
            left_early: if self.first_failure.is_some() {
                self.left_early
            } else {
                Vec::new()
            },
        }
    }
}

/// Records the exit of every worker that has ended since the last look; returns those that
/// failed, the likely cause first: several workers seen dead in one poll are more likely
/// explained by one that crashed (a signal, a panic's 101) than by one that exited with 1 after
/// losing its peer. A worker stopped by a signal after its checkpoint is not a failure: the
/// others stop at the same step and follow.
fn reap(workers: &mut [Running]) -> Vec<(usize, u32, WorkerExit)> {
    let mut failed_now = Vec::new();
    for worker in workers.iter_mut().filter(|w| w.exit.is_none()) {
        match worker.child.try_wait() {
            Ok(Some(status)) => {
                let exit = WorkerExit::of(status);
                worker.exit = Some(exit);
                if !exit.success() && !exit.preempted() {
                    failed_now.push((worker.rank, worker.child.id(), exit));
                }
            }
            Ok(None) => {}
            Err(e) => {
                eprintln!("burn-ddp: cannot watch rank {}: {e}", worker.rank);
                let exit = WorkerExit::Code(-1);
                worker.exit = Some(exit);
                failed_now.push((worker.rank, worker.child.id(), exit));
            }
        }
    }
    failed_now.sort_by_key(|(rank, _, exit)| {
        let cause = match exit {
            WorkerExit::Signal(_) => 0,
            WorkerExit::Code(1) => 2,
            WorkerExit::Code(_) => 1,
        };
        (cause, *rank)
    });
    failed_now
}

/// How each worker ended, after its output pumps finished. The pumps end when every holder of
/// the worker's output has exited; grandchildren that escaped its process group could hold it
/// open, so they are waited for 2 s at most.
fn finish(workers: Vec<Running>) -> Vec<(usize, u32, WorkerExit)> {
    workers
        .into_iter()
        .map(|worker| {
            let pid = worker.child.id();
            let deadline = Instant::now() + Duration::from_secs(2);
            for pump in worker.pumps {
                while !pump.is_finished() && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(10));
                }
                if pump.is_finished() {
                    let _ = pump.join();
                }
            }
            (
                worker.rank,
                pid,
                worker.exit.unwrap_or(WorkerExit::Code(-1)),
            )
        })
        .collect()
}

/// Stops every worker still running: SIGTERM, then SIGKILL for those alive after `grace`.
fn stop_all(workers: &mut [Running], grace: Duration) {
    for worker in workers.iter_mut().filter(|w| w.exit.is_none()) {
        signal_group(&worker.child, Signal::Terminate);
    }
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline && workers.iter().any(|w| w.exit.is_none()) {
        for worker in workers.iter_mut().filter(|w| w.exit.is_none()) {
            if let Ok(Some(status)) = worker.child.try_wait() {
                worker.exit = Some(WorkerExit::of(status));
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    for worker in workers.iter_mut().filter(|w| w.exit.is_none()) {
        signal_group(&worker.child, Signal::Kill);
        let _ = worker.child.kill();
        worker.exit = worker.child.wait().ok().map(WorkerExit::of);
    }
}

#[derive(Clone, Copy)]
enum Signal {
    Terminate,
    Kill,
}

/// Sends a signal to the worker's process group (its pid: each worker leads its own group).
#[cfg(unix)]
fn signal_group(child: &Child, signal: Signal) {
    let signal = match signal {
        Signal::Terminate => libc::SIGTERM,
        Signal::Kill => libc::SIGKILL,
    };
    if let Ok(pid) = libc::pid_t::try_from(child.id()) {
        // SAFETY: `kill` only sends a signal. A negative pid names the process group our child
        // leads (set with `process_group(0)` at spawn), which contains only its processes.
        unsafe {
            libc::kill(-pid, signal);
        }
    }
}

#[cfg(not(unix))]
fn signal_group(child: &Child, _signal: Signal) {
    let _ = child;
}

/// In a worker between fork and exec: SIGTERM when the launcher (`launcher`, its parent) dies,
/// even by SIGKILL. A launcher that died before the signal was armed has left the worker to
/// another parent already, which no signal would tell: the exec is then abandoned (`ESRCH`), so
/// no worker outlives its launcher unseen.
///
/// # Errors
/// `prctl`'s error; `ESRCH` when the parent is no longer `launcher`.
#[cfg(target_os = "linux")]
pub(super) fn arm_parent_death(launcher: libc::pid_t) -> std::io::Result<()> {
    // SAFETY: `prctl(PR_SET_PDEATHSIG)` and `getppid` are async-signal-safe system calls.
    unsafe {
        if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) == -1 {
            return Err(std::io::Error::last_os_error());
        }
        if libc::getppid() != launcher {
            return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
        }
    }
    Ok(())
}
