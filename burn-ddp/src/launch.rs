//! The launcher: starts one worker process per device on this machine, the way `torchrun` does.
//!
//! For each local worker it sets the environment [`Topology`](crate::Topology) reads (`RANK`,
//! `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`, plus
//! `GROUP_RANK`/`NODE_RANK`, `BURN_DDP_LAUNCHER`, `BURN_DDP_RESTART_COUNT`), serves the
//! rendezvous store on node 0 (so it outlives restarts), prefixes every line a worker prints with
//! `[rank R] `, optionally copies each worker's lines to `LOG_DIR/rank-R.log`, and watches the
//! workers: when one fails (non-zero exit code or a signal) it stops the others (SIGTERM, then
//! SIGKILL after a grace period) and either restarts the whole group (`max_restarts`) or returns
//! an error naming the rank and how it ended.

use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::store::{StoreClient, StoreServer};
use crate::topology::{AGENT_STORE_VAR, DEFAULT_MASTER_PORT, LAUNCHER_VAR, RESTART_COUNT_VAR};
use crate::{DdpError, Result};

/// What to launch and how.
#[derive(Debug, Clone)]
pub struct LaunchConfig {
    /// Worker processes on this machine (one per device).
    pub nproc_per_node: usize,
    /// Machines in the job (each runs a launcher).
    pub nnodes: usize,
    /// This machine's index in `0..nnodes`; node 0 serves the rendezvous store.
    pub node_rank: usize,
    /// Address of node 0, reachable from every node.
    pub master_addr: String,
    /// Port of the rendezvous store on node 0 (0 on a single node: any free port).
    pub master_port: u16,
    /// How many times the whole group may be restarted after a failure.
    pub max_restarts: u32,
    /// Directory for one log file per rank (`rank-R.log`), if any.
    pub log_dir: Option<PathBuf>,
    /// How long workers stopped after another worker failed get between SIGTERM and SIGKILL.
    pub kill_grace: Duration,
    /// How long workers get between SIGTERM and SIGKILL when the launcher itself received a stop
    /// signal: time to reach the next optimizer step and write a checkpoint (burn-ddp workers
    /// stop gracefully on their first SIGTERM).
    pub stop_grace: Duration,
    /// The worker program.
    pub program: PathBuf,
    /// Its arguments.
    pub args: Vec<String>,
    /// Extra environment variables for the workers.
    pub env: Vec<(String, String)>,
}

impl LaunchConfig {
    /// `nproc_per_node` copies of `program args` on this machine, store at 127.0.0.1:29500.
    pub fn new(nproc_per_node: usize, program: impl Into<PathBuf>, args: Vec<String>) -> Self {
        Self {
            nproc_per_node,
            nnodes: 1,
            node_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: DEFAULT_MASTER_PORT,
            max_restarts: 0,
            log_dir: None,
            kill_grace: Duration::from_secs(5),
            stop_grace: Duration::from_secs(60),
            program: program.into(),
            args,
            env: Vec::new(),
        }
    }

    /// Number of workers in the whole job.
    pub fn world_size(&self) -> usize {
        self.nnodes * self.nproc_per_node
    }

    fn validate(&self) -> Result<()> {
        if self.nproc_per_node == 0 || self.nnodes == 0 {
            return Err(DdpError::InvalidConfig(format!(
                "--nproc-per-node ({}) and --nnodes ({}) must be at least 1",
                self.nproc_per_node, self.nnodes
            )));
        }
        if self.node_rank >= self.nnodes {
            return Err(DdpError::InvalidConfig(format!(
                "--node-rank {} is not below --nnodes {}",
                self.node_rank, self.nnodes
            )));
        }
        if self.master_port == 0 && self.node_rank != 0 {
            return Err(DdpError::InvalidConfig(
                "--master-port 0 (any free port) only works on node 0, which picks it".into(),
            ));
        }
        Ok(())
    }
}

/// How a worker process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkerExit {
    /// It exited with this code.
    Code(i32),
    /// A signal ended it (Unix).
    Signal(i32),
}

impl WorkerExit {
    fn of(status: ExitStatus) -> WorkerExit {
        #[cfg(unix)]
        {
            use std::os::unix::process::ExitStatusExt;
            if let Some(signal) = status.signal() {
                return WorkerExit::Signal(signal);
            }
        }
        WorkerExit::Code(status.code().unwrap_or(-1))
    }

    /// Whether it ended successfully (exit code 0).
    pub fn success(&self) -> bool {
        *self == WorkerExit::Code(0)
    }

    /// Whether it stopped after a stop signal, its checkpoint written (exit code
    /// [`PREEMPTED_EXIT_CODE`](crate::PREEMPTED_EXIT_CODE)).
    pub fn preempted(&self) -> bool {
        *self == WorkerExit::Code(crate::PREEMPTED_EXIT_CODE)
    }
}

impl std::fmt::Display for WorkerExit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WorkerExit::Code(code) => write!(f, "exited with code {code}"),
            WorkerExit::Signal(signal) => {
                write!(
                    f,
                    "was killed by signal {signal} ({})",
                    crate::signals::name(*signal)
                )
            }
        }
    }
}

/// How one attempt of the group ended, per local worker.
#[derive(Debug, Clone)]
pub struct AttemptReport {
    /// Restart round (0 for the first attempt).
    pub attempt: u32,
    /// `(global rank, pid, how it ended)` of every local worker.
    pub workers: Vec<(usize, u32, WorkerExit)>,
    /// The first local worker that failed, if any: `(global rank, pid, how)`.
    pub first_failure: Option<(usize, u32, WorkerExit)>,
    /// The round another node started when this attempt was stopped because that node's
    /// workers failed.
    pub other_node: Option<u32>,
    /// The signal (SIGINT, SIGTERM, SIGHUP) that stopped the launcher, if any.
    pub interrupted: Option<i32>,
}

impl AttemptReport {
    /// The local workers that stopped after a stop signal, their checkpoint written (exit code
    /// [`PREEMPTED_EXIT_CODE`](crate::PREEMPTED_EXIT_CODE)).
    pub fn preempted(&self) -> Vec<usize> {
        self.workers
            .iter()
            .filter(|(_, _, exit)| exit.preempted())
            .map(|(rank, _, _)| *rank)
            .collect()
    }
}

/// Runs the job's local workers to completion, restarting the group up to `max_restarts` times.
/// Returns every attempt's report when the last attempt succeeded.
///
/// A worker that exits with [`PREEMPTED_EXIT_CODE`](crate::PREEMPTED_EXIT_CODE) stopped after a
/// stop signal (burn-ddp workers checkpoint the step they reached first): that is not a failure,
/// the launcher waits for the others and ends the job without restarting it. SIGINT, SIGTERM or
/// SIGHUP to the launcher is passed to the workers as SIGTERM, with
/// [`LaunchConfig::stop_grace`] to finish.
///
/// # Errors
/// [`DdpError::WorkerExited`] naming the first worker that failed in the last attempt and how
/// (exit code or signal), with every attempt in the message; [`DdpError::Stopped`] after a stop
/// signal (to the launcher or to its workers); [`DdpError::Store`] when node 0 cannot serve the
/// store (port in use); [`DdpError::InvalidConfig`]; [`DdpError::Launch`] when a worker cannot be
/// started.
pub fn launch(config: &LaunchConfig) -> Result<Vec<AttemptReport>> {
    config.validate()?;
    // Node 0 serves the store for the whole job, restarts included (port 0: any free port, which
    // then goes to the workers).
    let server = if config.node_rank == 0 {
        Some(StoreServer::bind(SocketAddr::new(
            IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            config.master_port,
        ))?)
    } else {
        None
    };
    run_job(config, server)
}

/// [`launch`] on node 0 with a store `server` the caller already serves (bound to port 0, say,
/// so the other nodes can be told the port before they start); `config.master_port` is ignored.
///
/// # Errors
/// As [`launch`].
pub fn launch_with_store(config: &LaunchConfig, server: StoreServer) -> Result<Vec<AttemptReport>> {
    config.validate()?;
    if config.node_rank != 0 {
        return Err(DdpError::InvalidConfig(format!(
            "only node 0 serves the store; this is node {}",
            config.node_rank
        )));
    }
    run_job(config, Some(server))
}

fn run_job(config: &LaunchConfig, server: Option<StoreServer>) -> Result<Vec<AttemptReport>> {
    let master_port = server
        .as_ref()
        .map_or(config.master_port, |s| s.local_addr().port());
    let store = StoreClient::connect(
        &format!("{}:{master_port}", config.master_addr),
        Duration::from_secs(300),
    )?;
    if let Some(dir) = &config.log_dir {
        std::fs::create_dir_all(dir).map_err(|e| {
            DdpError::Launch(format!(
                "cannot create the log directory {}: {e}",
                dir.display()
            ))
        })?;
    }
    // The first stop signal is noted, so the workers can be stopped gracefully; a second one
    // ends the launcher (its workers then get SIGTERM from their parent-death signal).
    let _signals = crate::signals::arm();
    let mut reports = Vec::new();
    loop {
        // Every node's launcher runs the round the store says; a node whose workers fail starts
        // the next round, and the others follow when they see it.
        let attempt = store.add(ROUND_KEY, 0)? as u32;
        let report = run_attempt(config, master_port, attempt, &store)?;
        let failure = match (report.first_failure, report.other_node) {
            (Some((rank, pid, how)), _) => Some(Failure::Worker(rank, pid, how)),
            (None, Some(round)) => Some(Failure::OtherNode(round)),
            (None, None) => None,
        };
        let interrupted = report.interrupted;
        let preempted = report.preempted();
        reports.push(report);
        if interrupted.is_some() || (failure.is_none() && !preempted.is_empty()) {
            let cause = match interrupted {
                Some(signal) => format!(
                    "received signal {signal} ({}) and stopped the workers",
                    crate::signals::name(signal)
                ),
                None => "workers were stopped by a signal".into(),
            };
            let checkpointed = if preempted.is_empty() {
                String::new()
            } else {
                format!(
                    "; rank(s) {preempted:?} stopped at a step boundary (exit code {}; rank 0 \
                     wrote a step checkpoint if the run has a checkpoint directory)",
                    crate::PREEMPTED_EXIT_CODE
                )
            };
            return Err(DdpError::Stopped {
                signal: interrupted,
                detail: format!("{cause}{checkpointed}"),
            });
        }
        let Some(failure) = failure else {
            return Ok(reports);
        };
        if let Failure::Worker(_, _, _) = failure {
            // The first launcher to report this round's failure moves the job to the next one.
            if store.add(&format!("{ROUND_KEY}/{attempt}/failed"), 1)? == 1 {
                store.add(ROUND_KEY, 1)?;
            }
        }
        if attempt < config.max_restarts {
            eprintln!(
                "burn-ddp: {failure}; restarting the group (restart {} of {})",
                attempt + 1,
                config.max_restarts
            );
            // Wait for the next round to be posted (by this launcher or another node's).
            let deadline = Instant::now() + Duration::from_secs(60);
            while store.add(ROUND_KEY, 0)? as u32 <= attempt {
                if Instant::now() >= deadline {
                    return Err(DdpError::Launch(format!(
                        "{failure}, but no launcher started round {} within 60 s",
                        attempt + 1
                    )));
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            continue;
        }
        return Err(match failure {
            Failure::Worker(rank, pid, how) => DdpError::WorkerExited {
                rank,
                pid,
                how: how.to_string(),
                attempts: attempt + 1,
            },
            Failure::OtherNode(round) => DdpError::Launch(format!(
                "the job failed on another node in round {round} and no restart is left"
            )),
        });
    }
}

/// Store key holding the job's current round (restart count).
const ROUND_KEY: &str = "burn-ddp/launcher/round";

/// Why an attempt ended early.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Failure {
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

fn run_attempt(
    config: &LaunchConfig,
    master_port: u16,
    attempt: u32,
    store: &StoreClient,
) -> Result<AttemptReport> {
    let world_size = config.world_size();
    let ranks: Vec<usize> = (0..config.nproc_per_node)
        .map(|local| config.node_rank * config.nproc_per_node + local)
        .collect();
    // Open every log file before starting anything, so a failure leaves no worker behind.
    let logs: Vec<Option<Arc<Mutex<std::fs::File>>>> = ranks
        .iter()
        .map(|rank| match &config.log_dir {
            Some(dir) => {
                let path = dir.join(format!("rank-{rank}.log"));
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&path)
                    .map(|file| Some(Arc::new(Mutex::new(file))))
                    .map_err(|e| DdpError::Launch(format!("cannot open {}: {e}", path.display())))
            }
            None => Ok(None),
        })
        .collect::<Result<_>>()?;
    let mut workers: Vec<Running> = Vec::new();
    let stdout = Arc::new(Mutex::new(std::io::stdout()));
    let stderr = Arc::new(Mutex::new(std::io::stderr()));
    for (local_rank, (&rank, log)) in ranks.iter().zip(logs).enumerate() {
        let mut command = Command::new(&config.program);
        command
            .args(&config.args)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world_size.to_string())
            .env("LOCAL_RANK", local_rank.to_string())
            .env("LOCAL_WORLD_SIZE", config.nproc_per_node.to_string())
            .env("GROUP_RANK", config.node_rank.to_string())
            .env("NODE_RANK", config.node_rank.to_string())
            .env("MASTER_ADDR", &config.master_addr)
            .env("MASTER_PORT", master_port.to_string())
            .env(LAUNCHER_VAR, "1")
            .env(AGENT_STORE_VAR, "1")
            .env(RESTART_COUNT_VAR, attempt.to_string())
            .envs(config.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        #[cfg(unix)]
        {
            // Each worker leads its own process group, so stopping it also stops what it
            // started (data-loading processes, a shell's children) and nothing keeps its output
            // open; the terminal's Ctrl-C reaches the launcher, which stops the groups.
            std::os::unix::process::CommandExt::process_group(&mut command, 0);
            #[cfg(target_os = "linux")]
            // SAFETY: `prctl` is async-signal-safe and only sets a flag of the new process; the
            // closure touches no memory of the parent.
            unsafe {
                std::os::unix::process::CommandExt::pre_exec(&mut command, || {
                    // If the launcher dies (even by SIGKILL), the worker gets SIGTERM.
                    libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                    Ok(())
                });
            }
        }
        let mut child = match command.spawn() {
            Ok(child) => child,
            Err(e) => {
                stop_all(&mut workers, config.kill_grace);
                return Err(DdpError::Launch(format!(
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

    let mut first_failure = None;
    let mut interrupted = None;
    let mut last_round_check = Instant::now();
    loop {
        let mut failed_now = Vec::new();
        for worker in workers.iter_mut().filter(|w| w.exit.is_none()) {
            match worker.child.try_wait() {
                Ok(Some(status)) => {
                    let exit = WorkerExit::of(status);
                    worker.exit = Some(exit);
                    // A worker stopped by a signal after its checkpoint is not a failure: the
                    // others stop at the same step and follow.
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
        // Several workers seen dead in one poll: the likely cause is one that crashed (a signal,
        // a panic's 101) rather than one that exited with 1 after losing its peer.
        failed_now.sort_by_key(|(rank, _, exit)| {
            let cause = match exit {
                WorkerExit::Signal(_) => 0,
                WorkerExit::Code(1) => 2,
                WorkerExit::Code(_) => 1,
            };
            (cause, *rank)
        });
        if first_failure.is_none()
            && let Some(&(rank, pid, exit)) = failed_now.first()
        {
            eprintln!("burn-ddp: rank {rank} (pid {pid}) {exit}; stopping the other ranks");
            first_failure = Some(Failure::Worker(rank, pid, exit));
        }
        if interrupted.is_none()
            && let Some(signal) = crate::signals::received()
        {
            eprintln!(
                "burn-ddp: received signal {signal} ({}); asking the workers to stop (SIGTERM; \
                 {} s to checkpoint)",
                crate::signals::name(signal),
                config.stop_grace.as_secs_f64()
            );
            interrupted = Some(signal);
        }
        // Another node may have failed and started the next round.
        if first_failure.is_none() && last_round_check.elapsed() >= Duration::from_millis(250) {
            last_round_check = Instant::now();
            if let Ok(round) = store.add(ROUND_KEY, 0)
                && round as u32 > attempt
            {
                eprintln!("burn-ddp: another node started round {round}; stopping the workers");
                first_failure = Some(Failure::OtherNode(round as u32));
            }
        }
        if first_failure.is_some() {
            stop_all(&mut workers, config.kill_grace);
            break;
        }
        if interrupted.is_some() {
            stop_all(&mut workers, config.stop_grace);
            break;
        }
        if workers.iter().all(|w| w.exit.is_some()) {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut report = AttemptReport {
        attempt,
        workers: Vec::new(),
        first_failure: match first_failure {
            Some(Failure::Worker(rank, pid, exit)) => Some((rank, pid, exit)),
            _ => None,
        },
        interrupted,
        other_node: match first_failure {
            Some(Failure::OtherNode(round)) => Some(round),
            _ => None,
        },
    };
    for worker in workers {
        let pid = worker.child.id();
        // The pumps end when every holder of the worker's output has exited; grandchildren that
        // escaped its process group could hold it open, so do not wait for them forever.
        let deadline = Instant::now() + Duration::from_secs(2);
        for pump in worker.pumps {
            while !pump.is_finished() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
            if pump.is_finished() {
                let _ = pump.join();
            }
        }
        report.workers.push((
            worker.rank,
            pid,
            worker.exit.unwrap_or(WorkerExit::Code(-1)),
        ));
    }
    Ok(report)
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

/// Copies a worker's output line by line, prefixed with `[rank R] `, to `sink` and `log`.
fn pump(
    stream: impl std::io::Read + Send + 'static,
    rank: usize,
    sink: Arc<Mutex<impl Write + Send + 'static>>,
    log: Option<Arc<Mutex<std::fs::File>>>,
) -> JoinHandle<()> {
    std::thread::spawn(move || {
        let mut reader = BufReader::new(stream);
        let mut line = Vec::new();
        loop {
            line.clear();
            match reader.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => return,
                Ok(_) => {
                    if !line.ends_with(b"\n") {
                        line.push(b'\n');
                    }
                    let prefixed = [format!("[rank {rank}] ").as_bytes(), &line].concat();
                    if let Ok(mut sink) = sink.lock() {
                        let _ = sink.write_all(&prefixed);
                        let _ = sink.flush();
                    }
                    if let Some(log) = &log
                        && let Ok(mut file) = log.lock()
                    {
                        let _ = file.write_all(&prefixed);
                    }
                }
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(script: &str, n: usize) -> LaunchConfig {
        let mut config = LaunchConfig::new(n, "/bin/sh", vec!["-c".into(), script.into()]);
        // The launcher binds port 0 and hands the port it got to the workers.
        config.master_port = 0;
        config.kill_grace = Duration::from_secs(2);
        config
    }

    #[test]
    fn workers_get_the_environment_and_their_lines_are_prefixed() {
        let dir = tempfile_dir();
        let mut config = sh(
            "echo \"rank=$RANK world=$WORLD_SIZE local=$LOCAL_RANK/$LOCAL_WORLD_SIZE \
             master=$MASTER_ADDR:$MASTER_PORT restart=$BURN_DDP_RESTART_COUNT\"",
            2,
        );
        config.log_dir = Some(dir.clone());
        let server = StoreServer::bind("0.0.0.0:0".parse().unwrap()).unwrap();
        let port = server.local_addr().port();
        let reports = launch_with_store(&config, server).unwrap();
        assert_eq!(reports.len(), 1);
        for rank in 0..2 {
            let log = std::fs::read_to_string(dir.join(format!("rank-{rank}.log"))).unwrap();
            assert_eq!(
                log,
                format!(
                    "[rank {rank}] rank={rank} world=2 local={rank}/2 master=127.0.0.1:{port} restart=0\n"
                )
            );
        }
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn a_failing_worker_stops_the_others_and_is_named() {
        let started = Instant::now();
        // Rank 1 fails at once; rank 0 would sleep for a minute.
        let config = sh("if [ \"$RANK\" = 1 ]; then exit 3; fi; sleep 60", 2);
        let err = launch(&config).unwrap_err();
        match &err {
            DdpError::WorkerExited { rank, how, .. } => {
                assert_eq!(*rank, 1);
                assert_eq!(how, "exited with code 3");
            }
            other => panic!("expected WorkerExited, got {other}"),
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "{:?}",
            started.elapsed()
        );
    }

    #[test]
    fn a_signal_is_named_and_restarts_rerun_the_group() {
        // Attempt 0: rank 0 kills itself with SIGKILL; attempt 1 succeeds.
        let mut config = sh(
            "if [ \"$BURN_DDP_RESTART_COUNT\" = 0 ] && [ \"$RANK\" = 0 ]; then kill -9 $$; fi; exit 0",
            2,
        );
        config.max_restarts = 1;
        let reports = launch(&config).unwrap();
        assert_eq!(reports.len(), 2);
        let (rank, _, how) = reports[0].first_failure.unwrap();
        assert_eq!(rank, 0);
        assert_eq!(how, WorkerExit::Signal(9));
        assert_eq!(how.to_string(), "was killed by signal 9 (SIGKILL)");
        assert!(reports[1].workers.iter().all(|(_, _, exit)| exit.success()));
    }

    #[test]
    fn a_failure_on_one_node_restarts_the_workers_of_every_node() {
        // Two launchers (nodes) of one worker each. Node 1's worker fails in round 0; node 0's
        // would sleep for a minute: its launcher must see the new round, stop it and restart.
        // Node 0's store on a port the system picked, known before node 1 starts.
        let server = StoreServer::bind("0.0.0.0:0".parse().unwrap()).unwrap();
        let port = server.local_addr().port();
        let script = "if [ \"$BURN_DDP_RESTART_COUNT\" = 0 ] && [ \"$RANK\" = 1 ]; then exit 4; fi; \
                      if [ \"$BURN_DDP_RESTART_COUNT\" = 0 ]; then sleep 60; fi; exit 0";
        let node = move |node_rank: usize| {
            let mut config = sh(script, 1);
            config.nnodes = 2;
            config.node_rank = node_rank;
            config.master_port = port;
            config.max_restarts = 1;
            config
        };
        let started = Instant::now();
        let node0 = std::thread::spawn(move || launch_with_store(&node(0), server));
        let node1 = launch(&node(1)).unwrap();
        let node0 = node0.join().unwrap().unwrap();
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "{:?}",
            started.elapsed()
        );
        assert_eq!(node1.len(), 2);
        assert_eq!(
            node1[0].first_failure.map(|f| f.2),
            Some(WorkerExit::Code(4))
        );
        assert_eq!(node0.len(), 2);
        assert_eq!(
            node0[0].other_node,
            Some(1),
            "node 0 followed node 1 into round 1"
        );
        assert!(node0[1].workers.iter().all(|(_, _, exit)| exit.success()));
    }

    #[test]
    fn port_zero_picks_a_free_port_for_the_workers() {
        let dir = tempfile_dir();
        let mut config = sh("echo \"port=$MASTER_PORT\"", 1);
        config.master_port = 0;
        config.log_dir = Some(dir.clone());
        launch(&config).unwrap();
        let log = std::fs::read_to_string(dir.join("rank-0.log")).unwrap();
        let port: u16 = log
            .trim()
            .trim_start_matches("[rank 0] port=")
            .parse()
            .unwrap();
        assert_ne!(port, 0);
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn bad_configurations_are_errors() {
        let mut config = sh("true", 1);
        config.node_rank = 1;
        assert!(matches!(launch(&config), Err(DdpError::InvalidConfig(_))));
        let config = LaunchConfig {
            master_port: 0,
            ..LaunchConfig::new(1, "/nonexistent/program", Vec::new())
        };
        assert!(matches!(launch(&config), Err(DdpError::Launch(_))));
    }

    fn tempfile_dir() -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "burn-ddp-launch-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }
}
