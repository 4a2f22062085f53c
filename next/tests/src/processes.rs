//! Child processes of the tests: a clean environment, the test job's identity, tensors in files, TCP groups over loopback, and one bounded way to wait for a child.

use std::sync::Arc;

use burn_ddp::{DdpError, ProcessGroup};

/// Removes the variables of a surrounding job (a CI runner inside Slurm or MPI: Slurm's, Open
/// MPI's, PMIx's and Hydra's, torchrun's, burn-ddp's) from `command`, so the worker sees only the
/// job the test describes.
pub fn clean_env(command: &mut std::process::Command) -> &mut std::process::Command {
    for (key, _) in std::env::vars_os() {
        let key = key.to_string_lossy();
        let job = [
            "SLURM_",
            "OMPI_",
            "PMIX_",
            "PMI_",
            "BURN_DDP_",
            "TORCHELASTIC_",
            "MASTER_",
        ]
        .iter()
        .any(|prefix| key.starts_with(prefix))
            || ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"].contains(&key.as_ref());
        if job {
            command.env_remove(key.as_ref());
        }
    }
    command
}

/// The job identity of the tests' multi-process jobs (run id and token, as a user sets them by
/// hand for Slurm or mpirun).
pub fn test_job() -> burn_ddp::comm::auth::JobIdentity {
    burn_ddp::comm::auth::JobIdentity::new(TEST_RUN_ID, Some(TEST_TOKEN.as_bytes()))
        .expect("a valid identity")
}

/// The run id of [`test_job`].
pub const TEST_RUN_ID: &str = "burn-ddp-tests";

/// The token of [`test_job`].
pub const TEST_TOKEN: &str = "burn-ddp tests token";

/// Gives a worker process started by hand (not by the launcher) the tests' job identity.
pub fn with_test_job(command: &mut std::process::Command) -> &mut std::process::Command {
    command
        .env(burn_ddp::comm::auth::RUN_ID_VAR, TEST_RUN_ID)
        .env(burn_ddp::comm::auth::JOB_TOKEN_VAR, TEST_TOKEN)
}

/// Rank `rank`'s `i`-th input in the collective tests (exact in `f32`, different per rank).
pub fn collective_input(rank: usize, i: usize) -> f32 {
    ((rank * 31 + i * 7) % 97) as f32 * 0.37 - 11.0
}

/// Writes tensors as `u64` length then little-endian `f32` values, tensor after tensor.
pub fn write_tensors(path: &std::path::Path, tensors: &[Vec<f32>]) -> std::io::Result<()> {
    let mut bytes = Vec::new();
    for t in tensors {
        bytes.extend_from_slice(&(t.len() as u64).to_le_bytes());
        for v in t {
            bytes.extend_from_slice(&v.to_le_bytes());
        }
    }
    std::fs::write(path, bytes)
}

/// Reads what [`write_tensors`] wrote.
pub fn read_tensors(path: &std::path::Path) -> std::io::Result<Vec<Vec<f32>>> {
    let bytes = std::fs::read(path)?;
    let mut out = Vec::new();
    let mut at = 0;
    while at + 8 <= bytes.len() {
        let mut len = [0u8; 8];
        len.copy_from_slice(&bytes[at..at + 8]);
        let len = u64::from_le_bytes(len) as usize;
        at += 8;
        let end = at + 4 * len;
        if end > bytes.len() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "truncated",
            ));
        }
        out.push(
            bytes[at..end]
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        );
        at = end;
    }
    Ok(out)
}

/// Runs `f(rank, group)` for every rank of a `world_size` job whose ranks are threads of this
/// test connected by `TcpGroup`s over loopback (process mode without processes: each rank has
/// its own `SupervisedTraining`), with the store served by the test on a port the system
/// picked. The threads are named like burn-ddp's rank threads.
pub fn over_tcp<T: Send>(
    world_size: usize,
    f: impl Fn(usize, Arc<dyn ProcessGroup>) -> T + Sync,
) -> Vec<Result<T, DdpError>> {
    use burn_ddp::comm::topology::{Topology, TopologySource};
    use burn_ddp::group::TcpGroup;
    use burn_ddp::group::TcpGroupOptions;
    let store = burn_ddp::comm::store::StoreServer::bind(
        "127.0.0.1:0".parse().expect("an address"),
        &test_job(),
    )
    .expect("a store on loopback");
    let port = store.local_addr().port();
    let f = &f;
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..world_size)
            .map(|rank| {
                std::thread::Builder::new()
                    .name(format!("burn-ddp-rank-{rank}"))
                    .spawn_scoped(s, move || -> Result<T, DdpError> {
                        let topology = Topology {
                            rank,
                            world_size,
                            local_rank: rank,
                            local_world_size: world_size,
                            master_addr: "127.0.0.1".into(),
                            master_port: port,
                            agent_store: true,
                            restart_count: 0,
                            source: TopologySource::Torchrun,
                        };
                        let options = TcpGroupOptions {
                            connect_timeout: std::time::Duration::from_secs(30),
                            job: Some(test_job()),
                        };
                        let group: Arc<dyn ProcessGroup> =
                            Arc::new(TcpGroup::connect(&topology, &options)?);
                        Ok(f(rank, group))
                    })
                    .expect("a rank thread")
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a rank thread that does not panic"))
            .collect()
    })
}

/// How a child process ended, with what it wrote to its piped outputs.
#[derive(Debug)]
pub struct Finished {
    /// The exit code (`None`: ended by a signal).
    pub code: Option<i32>,
    /// Its stdout, when piped (else empty).
    pub stdout: String,
    /// Its stderr, when piped (else empty).
    pub stderr: String,
    /// From the call to its end.
    pub took: std::time::Duration,
}

impl Finished {
    /// Whether it exited with code 0.
    pub fn success(&self) -> bool {
        self.code == Some(0)
    }
}

/// Waits for `child`, at most `within`: the one bounded wait of the tests. Past `within` the
/// child is killed (with the process group it leads, if it leads one: `mpirun` and its ranks)
/// and the test fails naming `what`.
pub fn finish_within(
    child: std::process::Child,
    within: std::time::Duration,
    what: &str,
) -> Finished {
    let started = std::time::Instant::now();
    let pid = child.id() as i32;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    let Ok(output) = rx.recv_timeout(within) else {
        #[cfg(unix)]
        // SAFETY: signals the child this test started and has not reaped, and the process
        // group it leads when it was started as a group leader (else the first call fails).
        unsafe {
            libc::kill(-pid, libc::SIGKILL);
            libc::kill(pid, libc::SIGKILL);
        }
        panic!("{what} did not end within {within:?}");
    };
    let output = output.unwrap_or_else(|e| panic!("{what}: {e}"));
    Finished {
        code: output.status.code(),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
        took: started.elapsed(),
    }
}
