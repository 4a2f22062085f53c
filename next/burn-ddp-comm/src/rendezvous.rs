//! Rendezvous: the processes of a job find each other through the [store](crate::store).
//!
//! Each process claims its rank, publishes its world size and the address where it accepts
//! process-group connections, and waits until every rank has done the same. Failures name what
//! happened: "expected 4 ranks, 2 arrived (0, 1) after 30 s", a rank claimed twice, ranks that
//! disagree on the world size, a port already in use.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::auth::{JobIdentity, Role};
use crate::error::{CommError, Result};
use crate::store::{StoreClient, StoreServer, bind_address, host_port};
use crate::topology::Topology;

/// Default rendezvous timeout: 300 s, like the collectives'.
pub const DEFAULT_RENDEZVOUS_TIMEOUT: Duration = Duration::from_secs(300);

/// The outcome of a rendezvous.
pub struct Rendezvous {
    /// The connection to the store.
    pub store: Arc<StoreClient>,
    /// The store server, when this process serves it (rank 0 without a launcher); it must live
    /// as long as other processes may still use the store.
    pub server: Option<StoreServer>,
    /// Every rank's process-group address (`ip:port`), indexed by rank.
    pub peer_addrs: Vec<String>,
    /// The key prefix of this rendezvous round (`burn-ddp/round-<restart count>`).
    pub prefix: String,
    /// The job the processes proved they belong to (its run id names the run's checkpoints).
    pub job: JobIdentity,
}

/// Meets the other processes of `topology`'s job. `listen(ip)` starts listening for
/// process-group connections on `ip`, the local address this host uses to reach the store (so
/// every peer that reaches the store can reach it, in the same address family), and returns the
/// `ip:port` to publish. Rank 0 serves the store at `MASTER_PORT` unless a launcher does.
///
/// # Errors
/// [`CommError::Store`] when the store cannot be served (port in use) or reached;
/// [`CommError::Rendezvous`] when not every rank arrives within `timeout` (naming the ones that
/// did), a rank is claimed by two processes, or ranks disagree on the world size.
pub fn rendezvous(
    topology: &Topology,
    timeout: Duration,
    job: &JobIdentity,
    listen: impl FnOnce(IpAddr) -> Result<String>,
) -> Result<Rendezvous> {
    let started = Instant::now();
    let rank = topology.rank;
    let world_size = topology.world_size;
    let server = if rank == 0 && !topology.agent_store {
        // Bound to the address the store is reached at, not every interface.
        let several_nodes = topology.world_size > topology.local_world_size;
        let bind = bind_address(&topology.master_addr, topology.master_port, several_nodes)?;
        Some(StoreServer::bind(bind, job)?)
    } else {
        None
    };
    let store_addr = host_port(&topology.master_addr, topology.master_port);
    let store = Arc::new(StoreClient::connect(
        &store_addr,
        timeout,
        job,
        Role::Worker,
    )?);
    let prefix = format!("burn-ddp/round-{}", topology.restart_count);
    let fail = |detail: String| CommError::Rendezvous { rank, detail };

    let claims = store.add(&format!("{prefix}/rank/{rank}/claims"), 1)?;
    if claims > 1 {
        return Err(fail(format!(
            "rank {rank} was already claimed in this round (restart {}) by another process, or \
             by an earlier attempt of this one: two processes have RANK={rank}, or a single rank \
             was restarted by hand (restart the whole job)",
            topology.restart_count
        )));
    }
    let listen_addr = listen(store.local_ip())?;
    store.set(
        &format!("{prefix}/rank/{rank}/info"),
        format!("{world_size} {listen_addr}").as_bytes(),
    )?;

    let arrivals = Arrivals {
        rank,
        world_size,
        prefix: &prefix,
        store: &store,
        store_addr: &store_addr,
    };
    let peer_addrs = arrivals.wait(started.checked_add(timeout), timeout)?;
    tracing::debug!(
        "burn-ddp: rank {rank}: all {world_size} ranks met in {:.2} s",
        started.elapsed().as_secs_f64()
    );
    Ok(Rendezvous {
        store,
        server,
        peer_addrs,
        prefix,
        job: job.clone(),
    })
}

/// Every rank's entry of a rendezvous round (`<prefix>/rank/<r>/info`: its world size and
/// address), as they arrive in the store.
struct Arrivals<'a> {
    rank: usize,
    world_size: usize,
    prefix: &'a str,
    store: &'a StoreClient,
    store_addr: &'a str,
}

impl Arrivals<'_> {
    /// Every rank's published address, once all have arrived, indexed by rank.
    ///
    /// # Errors
    /// [`CommError::Rendezvous`] when the deadline passes or the store stops answering first
    /// (naming the ranks that arrived and those missing), an entry is malformed, or a rank has
    /// another world size.
    fn wait(&self, deadline: Option<Instant>, timeout: Duration) -> Result<Vec<String>> {
        let keys: Vec<String> = (0..self.world_size)
            .map(|r| format!("{}/rank/{r}/info", self.prefix))
            .collect();
        let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let mut addrs: Vec<Option<String>> = vec![None; self.world_size];
        loop {
            let present = match self.store.check(&key_refs) {
                Ok(present) => present,
                // The store's process ended (rank 0 gave up first, or died): say who was there.
                Err(e) => {
                    return Err(
                        self.incomplete(&addrs, format!("when the store stopped answering ({e})"))
                    );
                }
            };
            for (r, here) in present.iter().enumerate() {
                if *here && addrs[r].is_none() {
                    addrs[r] = Some(self.read(r, &keys[r])?);
                }
            }
            if addrs.iter().all(Option::is_some) {
                return Ok(addrs.into_iter().map(Option::unwrap_or_default).collect());
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(self.incomplete(&addrs, format!("after {} s", timeout.as_secs_f64())));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Rank `r`'s address, from its entry at `key`, checked against this rank's world size.
    fn read(&self, r: usize, key: &str) -> Result<String> {
        let raw = self.store.get(key, Duration::from_secs(5))?;
        let text = String::from_utf8_lossy(&raw).to_string();
        let (world, addr) = text
            .split_once(' ')
            .and_then(|(w, a)| Some((w.parse::<usize>().ok()?, a.to_string())))
            .ok_or_else(|| self.fail(format!("rank {r} published a malformed entry {text:?}")))?;
        if world != self.world_size {
            return Err(self.fail(format!(
                "rank {r} has WORLD_SIZE={world} but this rank (rank {}) has WORLD_SIZE={}",
                self.rank, self.world_size
            )));
        }
        Ok(addr)
    }

    /// "expected 3 ranks, 2 arrived (0, 1) <when>; missing rank(s) 2 (store ...)".
    fn incomplete(&self, addrs: &[Option<String>], when: String) -> CommError {
        let list = |present: bool| -> Vec<String> {
            (0..self.world_size)
                .filter(|&r| addrs[r].is_some() == present)
                .map(|r| r.to_string())
                .collect()
        };
        let arrived = list(true);
        self.fail(format!(
            "expected {} ranks, {} arrived ({}) {when}; missing rank(s) {} (store {})",
            self.world_size,
            arrived.len(),
            arrived.join(", "),
            list(false).join(", "),
            self.store_addr,
        ))
    }

    fn fail(&self, detail: String) -> CommError {
        CommError::Rendezvous {
            rank: self.rank,
            detail,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::topology::TopologySource;

    /// A store on a port the system picked (no race with other tests for a "free" port), served
    /// by the test as a launcher would: the ranks' topologies say so (`agent_store`).
    fn store() -> (StoreServer, u16) {
        let server =
            StoreServer::bind("127.0.0.1:0".parse().unwrap(), &crate::auth::test_job()).unwrap();
        let port = server.local_addr().port();
        (server, port)
    }

    fn addr(port: u16) -> impl FnOnce(IpAddr) -> Result<String> {
        move |ip| Ok(format!("{ip}:{port}"))
    }

    fn topology(rank: usize, world_size: usize, port: u16) -> Topology {
        Topology {
            rank,
            world_size,
            local_rank: rank,
            local_world_size: world_size,
            master_addr: "127.0.0.1".into(),
            master_port: port,
            agent_store: true,
            restart_count: 0,
            source: TopologySource::Torchrun,
        }
    }

    #[test]
    fn ranks_meet_and_learn_each_others_addresses() {
        let (_server, port) = store();
        let handles: Vec<_> = (0..3)
            .map(|rank| {
                std::thread::spawn(move || {
                    rendezvous(
                        &topology(rank, 3, port),
                        Duration::from_secs(10),
                        &crate::auth::test_job(),
                        |ip| {
                            assert!(ip.is_loopback());
                            Ok(format!("{ip}:{}", 4000 + rank))
                        },
                    )
                    .map(|r| r.peer_addrs)
                })
            })
            .collect();
        for handle in handles {
            assert_eq!(
                handle.join().unwrap().unwrap(),
                vec!["127.0.0.1:4000", "127.0.0.1:4001", "127.0.0.1:4002"]
            );
        }
    }

    #[test]
    fn a_missing_rank_is_named_within_the_timeout() {
        let (_server, port) = store();
        let started = Instant::now();
        let handles: Vec<_> = (0..2)
            .map(|rank| {
                std::thread::spawn(move || {
                    rendezvous(
                        &topology(rank, 3, port),
                        Duration::from_secs(1),
                        &crate::auth::test_job(),
                        addr(1),
                    )
                    .err()
                    .map(|e| e.to_string())
                })
            })
            .collect();
        for handle in handles {
            let message = handle.join().unwrap().expect("rendezvous must fail");
            assert!(
                message.contains("expected 3 ranks, 2 arrived (0, 1) after 1 s; missing rank(s) 2"),
                "{message}"
            );
        }
        assert!(started.elapsed() < Duration::from_secs(8));
    }

    #[test]
    fn a_duplicate_rank_and_a_different_world_size_are_errors() {
        let (_server, port) = store();
        let first = std::thread::spawn(move || {
            rendezvous(
                &topology(0, 2, port),
                Duration::from_secs(5),
                &crate::auth::test_job(),
                addr(1),
            )
            .err()
        });
        // Until the first process has claimed rank 0 (an event, not a guess of how long).
        let watcher = StoreClient::connect(
            &format!("127.0.0.1:{port}"),
            Duration::from_secs(5),
            &crate::auth::test_job(),
            crate::auth::Role::Worker,
        )
        .unwrap();
        watcher
            .wait(&["burn-ddp/round-0/rank/0/claims"], Duration::from_secs(20))
            .unwrap();
        // A second process claiming rank 0 (it connects to the store rank 0 serves).
        let mut duplicate = topology(0, 2, port);
        duplicate.agent_store = true;
        let err = rendezvous(
            &duplicate,
            Duration::from_secs(2),
            &crate::auth::test_job(),
            addr(2),
        )
        .err()
        .unwrap()
        .to_string();
        assert!(err.contains("rank 0 was already claimed"), "{err}");
        // A rank 1 that believes the world has 3 ranks.
        let mut wrong = topology(1, 3, port);
        wrong.agent_store = true;
        let err = rendezvous(
            &wrong,
            Duration::from_secs(2),
            &crate::auth::test_job(),
            addr(3),
        )
        .err()
        .unwrap()
        .to_string();
        assert!(
            err.contains("WORLD_SIZE=2") && err.contains("WORLD_SIZE=3"),
            "{err}"
        );
        let _ = first.join();
    }
}
