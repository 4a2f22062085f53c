//! Where this process sits in a multi-process job: rank, world size, local rank, and the address
//! of the rendezvous store, read from the environment the way `torch.distributed`'s `env://`
//! initialisation does, plus the variables Slurm (`srun`) and Open MPI (`mpirun`) set, so the same
//! program runs under [the launcher](crate::launch), `torchrun`, `srun` or `mpirun`.
//!
//! | fact | torchrun / burn-ddp launcher | Slurm | Open MPI |
//! | --- | --- | --- | --- |
//! | rank | `RANK` | `SLURM_PROCID` | `OMPI_COMM_WORLD_RANK` |
//! | world size | `WORLD_SIZE` | `SLURM_NTASKS` | `OMPI_COMM_WORLD_SIZE` |
//! | local rank | `LOCAL_RANK` | `SLURM_LOCALID` | `OMPI_COMM_WORLD_LOCAL_RANK` |
//! | local world size | `LOCAL_WORLD_SIZE` | `SLURM_TASKS_PER_NODE` (first number) | `OMPI_COMM_WORLD_LOCAL_SIZE` |
//! | store address | `MASTER_ADDR` | `MASTER_ADDR` | `MASTER_ADDR` |
//! | store port | `MASTER_PORT` | `MASTER_PORT`, else 29500 | `MASTER_PORT`, else 29500 |
//!
//! Slurm's variables count only inside a job step (`srun`, which sets `SLURM_STEP_ID`): a batch
//! script also has `SLURM_PROCID` and `SLURM_NTASKS` but is one process. Under Slurm, set
//! `MASTER_ADDR` to the first node of the job, e.g.
//! `export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)`.
//!
//! The torchrun names win. When they are set and a scheduler's are too, they must agree, unless a
//! launcher (`BURN_DDP_LAUNCHER` or torchrun's `TORCHELASTIC_RUN_ID`) set them: then the
//! scheduler's numbers describe the launchers, not the workers. torchrun itself cannot start
//! burn-ddp workers: its agent serves PyTorch's store at `MASTER_PORT`, whose protocol burn-ddp
//! does not speak; use `burn-ddp run`.

use std::fmt;

use crate::error::{CommError, Result};

/// PyTorch's default rendezvous port, used when a scheduler gives no `MASTER_PORT`.
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// Set by the burn-ddp launcher in its workers' environment.
pub const LAUNCHER_VAR: &str = "BURN_DDP_LAUNCHER";
/// Set by the launcher when it serves the rendezvous store itself (rank 0 must not).
pub const AGENT_STORE_VAR: &str = "BURN_DDP_AGENT_STORE";
/// How many times the launcher restarted the group (0 on the first attempt); namespaces the
/// rendezvous so a restarted group does not meet the previous attempt's keys.
pub const RESTART_COUNT_VAR: &str = "BURN_DDP_RESTART_COUNT";

/// Which environment the topology came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TopologySource {
    /// `RANK`, `WORLD_SIZE`, ... (torchrun, the burn-ddp launcher, or set by hand).
    Torchrun,
    /// `SLURM_PROCID`, `SLURM_NTASKS`, ... (`srun`).
    Slurm,
    /// `OMPI_COMM_WORLD_RANK`, ... (`mpirun`).
    OpenMpi,
}

/// The most processes a job may have: what the rendezvous store checks in one request (a bound
/// on what a malformed `WORLD_SIZE` makes the rendezvous allocate, and a size named at start-up
/// rather than a store that stops answering).
pub const MAX_WORLD_SIZE: usize = crate::store::MAX_KEYS;

/// This process's place in the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    /// Global rank, in `0..world_size`.
    pub rank: usize,
    /// Number of processes in the job.
    pub world_size: usize,
    /// Rank among the processes of this machine (selects the GPU).
    pub local_rank: usize,
    /// Number of processes on this machine.
    pub local_world_size: usize,
    /// Host name or IP address of the rendezvous store. Empty under an MPI launcher (with the
    /// `mpi` feature) when `MASTER_ADDR` is unset: the `MpiGroup` needs no store, and
    /// [`TcpGroup::connect`](crate::group::TcpGroup::connect) refuses it.
    pub master_addr: String,
    /// Port of the rendezvous store.
    pub master_port: u16,
    /// Whether a launcher serves the store (then rank 0 does not).
    pub agent_store: bool,
    /// Restart round (0 on the first attempt).
    pub restart_count: u64,
    /// Where the numbers came from.
    pub source: TopologySource,
}

impl fmt::Display for Topology {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "rank {} of {} (local rank {} of {}), store {}:{}, from {:?} variables",
            self.rank,
            self.world_size,
            self.local_rank,
            self.local_world_size,
            self.master_addr,
            self.master_port,
            self.source
        )
    }
}

impl Topology {
    /// Reads the topology from the process environment. `Ok(None)` when no variable of a
    /// multi-process job is set (a plain single-process run).
    ///
    /// # Errors
    /// [`CommError::Topology`] naming the variable that is missing, not a number, out of range, or
    /// contradicted by another.
    pub fn from_env() -> Result<Option<Topology>> {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// As [`from_env`](Self::from_env), reading variables through `lookup` (for tests and
    /// embedding).
    ///
    /// # Errors
    /// As [`from_env`](Self::from_env).
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Option<Topology>> {
        let vars = Vars(&lookup);
        let torchrun_under_mpirun = (vars.has("RANK") || vars.has("WORLD_SIZE"))
            && vars.has("OMPI_COMM_WORLD_RANK")
            && !vars.has(LAUNCHER_VAR)
            && !vars.has("TORCHELASTIC_RUN_ID");
        Self::read(&vars).map_err(|err| match err {
            // A batch script that exports RANK for PyTorch, then runs mpirun.
            CommError::Topology(detail) if torchrun_under_mpirun => topology_error(format!(
                "{detail} (RANK or WORLD_SIZE is set, so burn-ddp reads torchrun-style variables \
                 and not mpirun's: unset RANK, WORLD_SIZE and LOCAL_RANK to use mpirun's)"
            )),
            other => other,
        })
    }

    fn read(vars: &Vars<'_>) -> Result<Option<Topology>> {
        if vars
            .get("TORCHELASTIC_USE_AGENT_STORE")
            .is_some_and(|v| v.eq_ignore_ascii_case("true"))
        {
            return Err(topology_error(
                "TORCHELASTIC_USE_AGENT_STORE=True: torchrun's agent serves PyTorch's store at \
                 MASTER_PORT, which burn-ddp cannot use; start the workers with `burn-ddp run` \
                 (same options as torchrun) instead"
                    .into(),
            ));
        }
        let Some(place) = Place::read(vars)? else {
            return Ok(None);
        };
        place.check()?;
        let master_addr = master_addr(vars, place.source)?;
        let master_port = master_port(vars, place.source)?;
        let restart_count = vars.optional_number(RESTART_COUNT_VAR)?.unwrap_or(0) as u64;
        Ok(Some(Topology {
            rank: place.rank,
            world_size: place.world_size,
            local_rank: place.local_rank,
            local_world_size: place.local_world_size,
            master_addr,
            master_port,
            agent_store: vars.get(AGENT_STORE_VAR).is_some_and(|v| v == "1"),
            restart_count,
            source: place.source,
        }))
    }
}

impl TopologySource {
    /// The variables that give the rank, the world size, the local rank and the local world
    /// size (for messages).
    fn variables(self) -> [&'static str; 4] {
        match self {
            TopologySource::Torchrun => ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"],
            TopologySource::Slurm => [
                "SLURM_PROCID",
                "SLURM_NTASKS",
                "SLURM_LOCALID",
                "SLURM_TASKS_PER_NODE",
            ],
            TopologySource::OpenMpi => [
                "OMPI_COMM_WORLD_RANK",
                "OMPI_COMM_WORLD_SIZE",
                "OMPI_COMM_WORLD_LOCAL_RANK",
                "OMPI_COMM_WORLD_LOCAL_SIZE",
            ],
        }
    }
}

/// A process's place in its job as one launcher's variables give it, before the store's
/// address.
struct Place {
    rank: usize,
    world_size: usize,
    local_rank: usize,
    local_world_size: usize,
    source: TopologySource,
}

impl Place {
    /// Torchrun-style variables first (also set by the burn-ddp launcher; checked against
    /// Slurm's and Open MPI's when both are set by hand), then Slurm's, then Open MPI's; `None`
    /// when none is set.
    fn read(vars: &Vars<'_>) -> Result<Option<Place>> {
        let slurm =
            vars.has("SLURM_PROCID") && vars.has("SLURM_NTASKS") && vars.has("SLURM_STEP_ID");
        let mpi = vars.has("OMPI_COMM_WORLD_RANK");
        if vars.has("RANK") || vars.has("WORLD_SIZE") {
            let rank = vars.number("RANK")?;
            let world_size = vars.number("WORLD_SIZE")?;
            let local_world_size = vars
                .optional_number("LOCAL_WORLD_SIZE")?
                .unwrap_or(world_size);
            let local_rank = vars.optional_number("LOCAL_RANK")?.unwrap_or(rank);
            let launched = vars.has(LAUNCHER_VAR) || vars.has("TORCHELASTIC_RUN_ID");
            if !launched {
                if slurm {
                    vars.agree("RANK", rank, "SLURM_PROCID")?;
                    vars.agree("WORLD_SIZE", world_size, "SLURM_NTASKS")?;
                }
                if mpi {
                    vars.agree("RANK", rank, "OMPI_COMM_WORLD_RANK")?;
                    vars.agree("WORLD_SIZE", world_size, "OMPI_COMM_WORLD_SIZE")?;
                }
            }
            Ok(Some(Place {
                rank,
                world_size,
                local_rank,
                local_world_size,
                source: TopologySource::Torchrun,
            }))
        } else if slurm {
            let world_size = vars.number("SLURM_NTASKS")?;
            let local_world_size = match vars.get("SLURM_TASKS_PER_NODE") {
                // Slurm writes e.g. "4" or "4(x2)" or "3,2"; the first number is the first
                // node's count, an upper bound for LOCAL_RANK checks on uneven layouts.
                Some(v) => parse_leading_number("SLURM_TASKS_PER_NODE", &v)?,
                None => world_size,
            };
            Ok(Some(Place {
                rank: vars.number("SLURM_PROCID")?,
                world_size,
                local_rank: vars.optional_number("SLURM_LOCALID")?.unwrap_or(0),
                local_world_size,
                source: TopologySource::Slurm,
            }))
        } else if mpi {
            let world_size = vars.number("OMPI_COMM_WORLD_SIZE")?;
            Ok(Some(Place {
                rank: vars.number("OMPI_COMM_WORLD_RANK")?,
                world_size,
                local_rank: vars
                    .optional_number("OMPI_COMM_WORLD_LOCAL_RANK")?
                    .unwrap_or(0),
                local_world_size: vars
                    .optional_number("OMPI_COMM_WORLD_LOCAL_SIZE")?
                    .unwrap_or(world_size),
                source: TopologySource::OpenMpi,
            }))
        } else {
            Ok(None)
        }
    }

    /// Every number in its range, naming the variable that is not.
    fn check(&self) -> Result<()> {
        let [rank_var, world_var, local_var, local_world_var] = self.source.variables();
        let (rank, world_size) = (self.rank, self.world_size);
        let (local_rank, local_world_size) = (self.local_rank, self.local_world_size);
        if world_size == 0 {
            return Err(topology_error(format!(
                "{world_var}=0: a job needs at least one process"
            )));
        }
        if world_size > MAX_WORLD_SIZE {
            return Err(topology_error(format!(
                "{world_var}={world_size} is more than burn-ddp supports ({MAX_WORLD_SIZE} \
                 processes): is the variable right?"
            )));
        }
        if rank >= world_size {
            return Err(topology_error(format!(
                "{rank_var}={rank} is not below {world_var}={world_size}"
            )));
        }
        if local_world_size == 0 || local_world_size > world_size {
            return Err(topology_error(format!(
                "{local_world_var}={local_world_size} must be between 1 and {world_var}={world_size}"
            )));
        }
        if local_rank >= local_world_size {
            return Err(topology_error(format!(
                "{local_var}={local_rank} is not below {local_world_var}={local_world_size}"
            )));
        }
        Ok(())
    }
}

/// `MASTER_ADDR`, the store's host; empty under an MPI launcher with the `mpi` feature (the job
/// meets through MPI, `MpiGroup`). Unset otherwise: an error saying how to set it for `source`.
fn master_addr(vars: &Vars<'_>, source: TopologySource) -> Result<String> {
    let mpi_launcher = cfg!(feature = "mpi")
        && source != TopologySource::Torchrun
        && (vars.has("OMPI_COMM_WORLD_SIZE") || vars.has("PMIX_RANK") || vars.has("PMI_RANK"));
    match (vars.get("MASTER_ADDR"), source) {
        (Some(addr), _) if !addr.is_empty() => Ok(addr),
        _ if mpi_launcher => Ok(String::new()),
        (_, TopologySource::Slurm) => Err(topology_error(
            "MASTER_ADDR is not set: under Slurm set it to the job's first node, e.g. \
             export MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1)"
                .into(),
        )),
        (_, TopologySource::OpenMpi) => Err(topology_error(
            "MASTER_ADDR is not set: pass it to every rank with `mpirun -x \
             MASTER_ADDR=<first host>` (127.0.0.1 on one machine), or build with \
             burn-ddp's `mpi` feature (`features = [\"mpi\"]`) to use MPI itself, \
             without MASTER_ADDR"
                .into(),
        )),
        _ => Err(topology_error(
            "MASTER_ADDR is not set: set it to the host name or IP address of rank 0 \
             (127.0.0.1 on one machine)"
                .into(),
        )),
    }
}

/// `MASTER_PORT`, the store's port: required with torchrun-style variables,
/// [`DEFAULT_MASTER_PORT`] under Slurm and Open MPI.
fn master_port(vars: &Vars<'_>, source: TopologySource) -> Result<u16> {
    let port = match vars.get("MASTER_PORT") {
        Some(v) => v.trim().parse::<u16>().map_err(|_| {
            topology_error(format!("MASTER_PORT={v:?} is not a port number (1-65535)"))
        })?,
        None if source == TopologySource::Torchrun => {
            return Err(topology_error(
                "MASTER_PORT is not set: set it to a free TCP port on rank 0's host".into(),
            ));
        }
        None => DEFAULT_MASTER_PORT,
    };
    if port == 0 {
        return Err(topology_error("MASTER_PORT=0 is not a usable port".into()));
    }
    Ok(port)
}

fn topology_error(detail: String) -> CommError {
    CommError::Topology(detail)
}

fn parse_leading_number(name: &str, value: &str) -> Result<usize> {
    let digits: String = value
        .trim()
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits
        .parse()
        .map_err(|_| topology_error(format!("{name}={value:?} does not start with a number")))
}

struct Vars<'a>(&'a dyn Fn(&str) -> Option<String>);

impl Vars<'_> {
    fn get(&self, name: &str) -> Option<String> {
        (self.0)(name)
    }

    fn has(&self, name: &str) -> bool {
        self.get(name).is_some()
    }

    fn number(&self, name: &str) -> Result<usize> {
        match self.optional_number(name)? {
            Some(n) => Ok(n),
            None => Err(topology_error(format!("{name} is not set"))),
        }
    }

    fn optional_number(&self, name: &str) -> Result<Option<usize>> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => {
                v.trim().parse().map(Some).map_err(|_| {
                    topology_error(format!("{name}={v:?} is not a non-negative integer"))
                })
            }
        }
    }

    fn agree(&self, name: &str, value: usize, other: &str) -> Result<()> {
        match self.optional_number(other)? {
            Some(v) if v != value => Err(topology_error(format!(
                "{name}={value} contradicts {other}={v} (unset one, or launch through \
                 `burn-ddp run`, which sets {LAUNCHER_VAR})"
            ))),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn topology(vars: &[(&str, &str)]) -> Result<Option<Topology>> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Topology::from_lookup(|name| map.get(name).cloned())
    }

    fn message(vars: &[(&str, &str)]) -> String {
        topology(vars).unwrap_err().to_string()
    }

    const TORCHRUN: [(&str, &str); 6] = [
        ("RANK", "3"),
        ("WORLD_SIZE", "8"),
        ("LOCAL_RANK", "1"),
        ("LOCAL_WORLD_SIZE", "2"),
        ("MASTER_ADDR", "10.0.0.1"),
        ("MASTER_PORT", "29400"),
    ];

    #[test]
    fn torchrun_variables_give_the_topology() {
        let t = topology(&TORCHRUN).unwrap().unwrap();
        assert_eq!(
            (t.rank, t.world_size, t.local_rank, t.local_world_size),
            (3, 8, 1, 2)
        );
        assert_eq!((t.master_addr.as_str(), t.master_port), ("10.0.0.1", 29400));
        assert_eq!(t.source, TopologySource::Torchrun);
        assert!(!t.agent_store);
        assert_eq!(t.restart_count, 0);
    }

    #[test]
    fn no_variables_is_a_single_process_run() {
        assert_eq!(topology(&[("HOME", "/root")]).unwrap(), None);
    }

    #[test]
    fn slurm_and_open_mpi_variables_are_understood() {
        let slurm = [
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_STEP_ID", "0"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_TASKS_PER_NODE", "4(x2)"),
            ("MASTER_ADDR", "node-a"),
        ];
        let t = topology(&slurm).unwrap().unwrap();
        assert_eq!(
            (t.rank, t.world_size, t.local_rank, t.local_world_size),
            (5, 8, 1, 4)
        );
        assert_eq!((t.master_addr.as_str(), t.master_port), ("node-a", 29500));
        assert_eq!(t.source, TopologySource::Slurm);
        // Without MASTER_ADDR, the error says how to set it.
        assert!(message(&slurm[..5]).contains("scontrol show hostnames"));
        // A batch script (no job step) is a single process.
        let batch: Vec<_> = slurm
            .iter()
            .filter(|(k, _)| *k != "SLURM_STEP_ID")
            .cloned()
            .collect();
        assert_eq!(topology(&batch).unwrap(), None);

        let t = topology(&[
            ("OMPI_COMM_WORLD_RANK", "2"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
            ("MASTER_ADDR", "node0"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!((t.rank, t.world_size, t.local_rank), (2, 4, 0));
        assert_eq!(t.source, TopologySource::OpenMpi);
    }

    #[test]
    fn missing_and_bad_values_name_the_variable() {
        assert!(message(&[("RANK", "0")]).contains("WORLD_SIZE is not set"));
        assert!(message(&[("RANK", "x"), ("WORLD_SIZE", "2")]).contains("RANK=\"x\""));
        let without = |name: &str| -> Vec<(&'static str, &'static str)> {
            TORCHRUN
                .iter()
                .filter(|(k, _)| *k != name)
                .cloned()
                .collect()
        };
        assert!(message(&without("MASTER_ADDR")).contains("MASTER_ADDR is not set"));
        assert!(message(&without("MASTER_PORT")).contains("MASTER_PORT is not set"));
        let with = |name: &'static str, value: &'static str| {
            let mut vars = without(name);
            vars.push((name, value));
            vars
        };
        assert!(message(&with("RANK", "8")).contains("RANK=8 is not below WORLD_SIZE=8"));
        assert!(
            message(&with("LOCAL_RANK", "2"))
                .contains("LOCAL_RANK=2 is not below LOCAL_WORLD_SIZE=2")
        );
        assert!(message(&with("MASTER_PORT", "70000")).contains("MASTER_PORT=\"70000\""));
        // A world the store cannot serve in one request is named at start-up (not "the store
        // stopped answering" at the rendezvous).
        assert!(message(&with("WORLD_SIZE", "65537")).contains("WORLD_SIZE=65537"));
        assert!(
            message(&[
                ("SLURM_PROCID", "0"),
                ("SLURM_NTASKS", "0"),
                ("SLURM_STEP_ID", "1")
            ])
            .contains("SLURM_NTASKS=0")
        );
        let open_mpi = [("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "2")];
        if cfg!(feature = "mpi") {
            // The job meets through MPI: no store address needed (TcpGroup refuses it).
            let topology = topology(&open_mpi).unwrap().unwrap();
            assert_eq!((topology.rank, topology.world_size), (0, 2));
            assert_eq!(topology.master_addr, "");
        } else {
            let message = message(&open_mpi);
            assert!(message.contains("MASTER_ADDR"), "{message}");
            assert!(message.contains("`mpi` feature"), "{message}");
        }
        let mut vars = TORCHRUN.to_vec();
        vars.push(("TORCHELASTIC_USE_AGENT_STORE", "True"));
        assert!(message(&vars).contains("burn-ddp run"));
    }

    #[test]
    fn rank_exported_before_mpirun_says_that_torchrun_variables_win() {
        let open_mpi = [("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "2")];
        let hinted = message(&[("RANK", "0"), open_mpi[0], open_mpi[1]]);
        assert!(hinted.contains("WORLD_SIZE is not set"), "{hinted}");
        assert!(
            hinted.contains("unset RANK, WORLD_SIZE and LOCAL_RANK to use mpirun's"),
            "{hinted}"
        );
        // Under the burn-ddp launcher the same variables are expected, and no hint is added.
        let launched = message(&[("RANK", "0"), (LAUNCHER_VAR, "1"), open_mpi[0]]);
        assert!(!launched.contains("mpirun's"), "{launched}");
    }

    #[test]
    fn contradictions_name_both_variables_unless_a_launcher_set_them() {
        let mut vars = TORCHRUN.to_vec();
        vars.push(("SLURM_PROCID", "1"));
        vars.push(("SLURM_NTASKS", "8"));
        vars.push(("SLURM_STEP_ID", "0"));
        assert!(message(&vars).contains("RANK=3 contradicts SLURM_PROCID=1"));
        // Under srun + launcher, Slurm's numbers count launchers: no contradiction.
        vars.push((LAUNCHER_VAR, "1"));
        assert_eq!(topology(&vars).unwrap().unwrap().rank, 3);
    }

    #[test]
    fn the_launcher_variables_are_read() {
        let mut vars = TORCHRUN.to_vec();
        vars.push((AGENT_STORE_VAR, "1"));
        vars.push((RESTART_COUNT_VAR, "2"));
        let t = topology(&vars).unwrap().unwrap();
        assert!(t.agent_store);
        assert_eq!(t.restart_count, 2);
    }
}
