//! The launcher: starts one worker process per device on this machine, the way `torchrun` does.
//!
//! For each local worker it sets the environment [`Topology`](crate::topology::Topology) reads (`RANK`,
//! `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`, plus
//! `GROUP_RANK`/`NODE_RANK`, `BURN_DDP_LAUNCHER`, `BURN_DDP_RESTART_COUNT`), serves the
//! rendezvous store on node 0 (so it outlives restarts), prefixes every line a worker prints with
//! `[rank R] `, optionally copies each worker's lines to `LOG_DIR/rank-R.log`, and watches the
//! workers: when one fails (non-zero exit code or a signal) it stops the others (SIGTERM, then
//! SIGKILL after a grace period) and either restarts the whole group (`max_restarts`) or returns
//! an error naming the rank and how it ended.

use std::path::PathBuf;
use std::process::ExitStatus;
use std::time::{Duration, Instant};

mod output;
mod supervise;

use crate::auth::{JOB_TOKEN_VAR, JobIdentity, Role, Secret};
use crate::error::{CommError, Result};
use crate::store::{StoreClient, StoreServer};
use crate::topology::DEFAULT_MASTER_PORT;
use supervise::{Failure, run_attempt};

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
    /// The job's identity (run id and token); `None` (the default): [`LaunchConfig::job`] makes
    /// it from the environment.
    pub job: Option<JobIdentity>,
    /// Run a job of several nodes without a job token (`--allow-no-token`). Off by default: the
    /// job's keys would derive from public values, and anyone who reaches the store's port could
    /// join it or start a restart round.
    pub allow_no_token: bool,
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
            job: None,
            allow_no_token: false,
        }
    }

    /// Number of workers in the whole job (`usize::MAX` when it overflows: refused by
    /// [`launch`]).
    pub fn world_size(&self) -> usize {
        self.nnodes.saturating_mul(self.nproc_per_node)
    }

    /// The job's identity: [`LaunchConfig::job`] when set, else `BURN_DDP_JOB_TOKEN` and
    /// `BURN_DDP_RUN_ID` when set; on a single
    /// node a random token and run id otherwise (the launcher hands them to its workers); on
    /// several nodes without a token, no secret (a warning says so) and a run id from the store's
    /// address, which every node's launcher computes alike.
    ///
    /// # Errors
    /// As [`JobIdentity::for_launcher`].
    pub fn job(&self) -> Result<JobIdentity> {
        if let Some(job) = &self.job {
            return Ok(job.clone());
        }
        JobIdentity::for_launcher(
            self.nnodes == 1,
            &crate::store::host_port(&self.master_addr, self.master_port),
        )
    }

    fn validate(&self) -> Result<()> {
        if self.nproc_per_node == 0 || self.nnodes == 0 {
            return Err(CommError::InvalidConfig(format!(
                "--nproc-per-node ({}) and --nnodes ({}) must be at least 1",
                self.nproc_per_node, self.nnodes
            )));
        }
        if self.node_rank >= self.nnodes {
            return Err(CommError::InvalidConfig(format!(
                "--node-rank {} is not below --nnodes {}",
                self.node_rank, self.nnodes
            )));
        }
        let most = crate::topology::MAX_WORLD_SIZE;
        if self
            .nnodes
            .checked_mul(self.nproc_per_node)
            .is_none_or(|n| n > most)
        {
            return Err(CommError::InvalidConfig(format!(
                "--nnodes {} x --nproc-per-node {} workers: a job has at most {most}",
                self.nnodes, self.nproc_per_node
            )));
        }
        if self.master_port == 0 && self.node_rank != 0 {
            return Err(CommError::InvalidConfig(
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
    /// [`PREEMPTED_EXIT_CODE`](crate::signals::PREEMPTED_EXIT_CODE)).
    pub fn preempted(&self) -> bool {
        *self == WorkerExit::Code(crate::signals::PREEMPTED_EXIT_CODE)
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
pub struct AttemptOutcome {
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
    /// Local workers that exited with code 0 while others were still running, before any
    /// failure: `(global rank, pid)`.
    pub left_early: Vec<(usize, u32)>,
}

impl AttemptOutcome {
    /// The local workers that stopped after a stop signal, their checkpoint written (exit code
    /// [`PREEMPTED_EXIT_CODE`](crate::signals::PREEMPTED_EXIT_CODE)).
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
/// A worker that exits with [`PREEMPTED_EXIT_CODE`](crate::signals::PREEMPTED_EXIT_CODE) stopped after a
/// stop signal (burn-ddp workers checkpoint the step they reached first): that is not a failure,
/// the launcher waits for the others and ends the job without restarting it. SIGINT, SIGTERM or
/// SIGHUP to the launcher is passed to the workers as SIGTERM, with
/// [`LaunchConfig::stop_grace`] to finish.
///
/// # Errors
/// [`CommError::WorkerExited`] naming the first worker that failed in the last attempt and how
/// (exit code or signal), with every attempt in the message; [`CommError::Stopped`] after a stop
/// signal (to the launcher or to its workers); [`CommError::Store`] when node 0 cannot serve the
/// store (port in use); [`CommError::InvalidConfig`]; [`CommError::Launch`] when a worker cannot be
/// started.
pub fn launch(config: &LaunchConfig) -> Result<Vec<AttemptOutcome>> {
    config.validate()?;
    let job = config.job()?;
    check_secret(config, &job)?;
    // Node 0 serves the store for the whole job, restarts included (port 0: any free port, which
    // then goes to the workers), on the address the store is reached at.
    let server = if config.node_rank == 0 {
        let bind =
            crate::store::bind_address(&config.master_addr, config.master_port, config.nnodes > 1)?;
        Some(StoreServer::bind(bind, &job)?)
    } else {
        None
    };
    run_job(config, server, job)
}

/// [`launch`] on node 0 with a store `server` the caller already serves (bound to port 0, say,
/// so the other nodes can be told the port before they start); `config.master_port` is ignored.
///
/// # Errors
/// As [`launch`].
pub fn launch_with_store(
    config: &LaunchConfig,
    server: StoreServer,
) -> Result<Vec<AttemptOutcome>> {
    config.validate()?;
    if config.node_rank != 0 {
        return Err(CommError::InvalidConfig(format!(
            "only node 0 serves the store; this is node {}",
            config.node_rank
        )));
    }
    let job = server.job().clone();
    check_secret(config, &job)?;
    run_job(config, Some(server), job)
}

/// A job of several nodes needs a token, unless [`LaunchConfig::allow_no_token`]: without one
/// its keys derive from public values (a constant and a run id anyone can read), so anyone who
/// reaches the store's port could join it or start a restart round.
///
/// # Errors
/// [`CommError::InvalidConfig`] saying how to make and give a token, or to opt out.
fn check_secret(config: &LaunchConfig, job: &JobIdentity) -> Result<()> {
    if config.nnodes > 1 && job.secret() == Secret::None && !config.allow_no_token {
        return Err(CommError::InvalidConfig(format!(
            "a job of {} nodes without a job token: anyone who reaches port {} of {} could join \
             it; give every node's launcher the same secret (`export \
             {JOB_TOKEN_VAR}=$(openssl rand -hex 32)` once, then that value on every node), or \
             run it open on a network you trust with --allow-no-token",
            config.nnodes, config.master_port, config.master_addr
        )));
    }
    Ok(())
}

fn run_job(
    config: &LaunchConfig,
    server: Option<StoreServer>,
    job: JobIdentity,
) -> Result<Vec<AttemptOutcome>> {
    let master_port = server
        .as_ref()
        .map_or(config.master_port, |s| s.local_addr().port());
    let store = StoreClient::connect(
        &crate::store::host_port(&config.master_addr, master_port),
        Duration::from_secs(300),
        &job,
        Role::Launcher,
    )?;
    if job.secret() == Secret::None {
        eprintln!(
            "burn-ddp: warning: no job token ({JOB_TOKEN_VAR}): the store at {} accepts any \
             process that reaches its port; set {JOB_TOKEN_VAR} to the same secret on every \
             node",
            crate::store::host_port(&config.master_addr, master_port)
        );
    }
    if let Some(dir) = &config.log_dir {
        std::fs::create_dir_all(dir).map_err(|e| {
            CommError::Launch(format!(
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
        let report = run_attempt(config, master_port, attempt, &store, &job)?;
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
                    crate::signals::PREEMPTED_EXIT_CODE
                )
            };
            return Err(CommError::Stopped {
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
                    return Err(CommError::Launch(format!(
                        "{failure}, but no launcher started round {} within 60 s",
                        attempt + 1
                    )));
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            continue;
        }
        let left_early = reports
            .last()
            .map(|r| r.left_early.iter().map(|&(rank, _)| rank).collect())
            .unwrap_or_default();
        return Err(match failure {
            Failure::Worker(rank, pid, how) => CommError::WorkerExited {
                rank,
                pid,
                how: how.to_string(),
                attempts: attempt + 1,
                left_early,
            },
            Failure::OtherNode(round) => CommError::Launch(format!(
                "the job failed on another node in round {round} and no restart is left"
            )),
        });
    }
}

/// Store key holding the job's current round (restart count).
pub(super) const ROUND_KEY: &str = "burn-ddp/launcher/round";

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
        let server =
            StoreServer::bind("0.0.0.0:0".parse().unwrap(), &crate::auth::test_job()).unwrap();
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
    fn a_rank_that_exited_0_while_its_peers_trained_is_named_with_their_failure() {
        // Rank 1 ends at once with code 0 (its loop ended early); rank 0 then fails, as a rank
        // waiting for a peer that left does.
        let config = sh("if [ \"$RANK\" = 1 ]; then exit 0; fi; sleep 1; exit 1", 2);
        match launch(&config).unwrap_err() {
            CommError::WorkerExited {
                rank, left_early, ..
            } => {
                assert_eq!((rank, left_early.clone()), (0, vec![1]));
                let message = CommError::WorkerExited {
                    rank,
                    pid: 0,
                    how: "exited with code 1".into(),
                    attempts: 1,
                    left_early,
                }
                .to_string();
                assert!(
                    message.contains("rank 1 had exited with code 0"),
                    "{message}"
                );
            }
            other => panic!("expected WorkerExited, got {other}"),
        }
        // Workers that all finish are no failure, and nobody left early.
        let reports = launch(&sh("if [ \"$RANK\" = 1 ]; then exit 0; fi; sleep 1", 2)).unwrap();
        assert!(reports[0].left_early.is_empty());
    }

    #[test]
    fn a_failing_worker_stops_the_others_and_is_named() {
        let started = Instant::now();
        // Rank 1 fails at once; rank 0 would sleep for a minute.
        let config = sh("if [ \"$RANK\" = 1 ]; then exit 3; fi; sleep 60", 2);
        let err = launch(&config).unwrap_err();
        match &err {
            CommError::WorkerExited { rank, how, .. } => {
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
        let server =
            StoreServer::bind("0.0.0.0:0".parse().unwrap(), &crate::auth::test_job()).unwrap();
        let port = server.local_addr().port();
        // Node 1's worker fails only once node 0's worker runs round 0 (a marker file, waited
        // for at most 30 s): on a loaded machine node 0's launcher could otherwise start after
        // the failure and join round 1 directly, which is right but not what this test checks.
        let dir = tempfile_dir();
        std::fs::create_dir_all(&dir).unwrap();
        let ready = dir.join("node0-round0");
        let script = format!(
            "if [ \"$BURN_DDP_RESTART_COUNT\" = 0 ] && [ \"$RANK\" = 0 ]; then \
               touch '{ready}'; sleep 60; fi; \
             if [ \"$BURN_DDP_RESTART_COUNT\" = 0 ] && [ \"$RANK\" = 1 ]; then \
               i=0; while [ ! -f '{ready}' ] && [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done; \
               exit 4; fi; \
             exit 0",
            ready = ready.display()
        );
        let node = |node_rank: usize| {
            let mut config = sh(&script, 1);
            // Two launchers of one job share its token (set by hand on every node).
            config.job = Some(crate::auth::test_job());
            config.nnodes = 2;
            config.node_rank = node_rank;
            config.master_port = port;
            config.max_restarts = 1;
            config
        };
        let started = Instant::now();
        let (config0, config1) = (node(0), node(1));
        let node0 = std::thread::spawn(move || launch_with_store(&config0, server));
        let node1 = launch(&config1).unwrap();
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
        let _ = std::fs::remove_dir_all(&dir);
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
        assert!(matches!(launch(&config), Err(CommError::InvalidConfig(_))));
        let config = LaunchConfig {
            master_port: 0,
            ..LaunchConfig::new(1, "/nonexistent/program", Vec::new())
        };
        assert!(matches!(launch(&config), Err(CommError::Launch(_))));
    }

    #[test]
    fn several_nodes_without_a_token_are_refused_unless_allowed_and_sizes_cannot_overflow() {
        // Node 1 of two, without a token: its keys would derive from public values.
        let mut config = sh("true", 1);
        config.nnodes = 2;
        config.node_rank = 1;
        config.master_port = 1;
        config.job = Some(JobIdentity::new("two-nodes", None).unwrap());
        match launch(&config) {
            Err(CommError::InvalidConfig(message)) => {
                assert!(message.contains(JOB_TOKEN_VAR), "{message}");
                assert!(message.contains("--allow-no-token"), "{message}");
            }
            other => panic!("expected the refusal, got {other:?}"),
        }
        // A world size that overflows, or that the store cannot serve, is named.
        let mut huge = sh("true", usize::MAX / 2 + 1);
        huge.nnodes = 2;
        match launch(&huge) {
            Err(CommError::InvalidConfig(message)) => {
                assert!(message.contains("--nnodes"), "{message}")
            }
            other => panic!("expected the refusal, got {other:?}"),
        }
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_worker_whose_launcher_is_gone_before_the_death_signal_is_armed_does_not_start() {
        use std::os::unix::process::CommandExt;
        // The parent a worker would see if its launcher had died: not the launcher.
        let start = |launcher: libc::pid_t| {
            let mut command = std::process::Command::new("/bin/true");
            // SAFETY: as in `supervise`: async-signal-safe calls only.
            unsafe {
                command.pre_exec(move || supervise::arm_parent_death(launcher));
            }
            command.status()
        };
        assert!(start(std::process::id() as libc::pid_t).is_ok_and(|s| s.success()));
        // SAFETY: `getppid` has no preconditions.
        let not_the_launcher = unsafe { libc::getppid() };
        let err = start(not_the_launcher).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::ESRCH), "{err}");
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
