//! Accepting the higher ranks' connections while a [`TcpGroup`](super::TcpGroup) forms: each
//! handshake on a thread of its own, a bounded number at once (so a connection that stays
//! silent, or sends garbage, cannot hold the accept loop from the real ranks), refusals logged
//! at a bounded rate, and a higher rank's failure to dial this one read from the store.

use std::io;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::time::{Duration, Instant};

use super::ABORT_POLL_INTERVAL;
use super::dial::{HANDSHAKE_DEADLINE, Setup, parse_context};
use super::wire::Peer;
use crate::auth::{self, Service};
use crate::error::{CommError, Result};
use crate::gate::{Gate, RateLimited, printable};

/// Connections at most in their handshake at once (more are closed at once).
const MAX_HANDSHAKES: usize = 32;
/// Connections in their handshake at once from one address (a peer told "busy" tries again).
const MAX_HANDSHAKES_PER_SOURCE: usize = 8;

/// A finished handshake: who connected, the stream, and the rank it proved (or why not).
type Shaken = (SocketAddr, TcpStream, std::result::Result<usize, String>);

/// The accepting side of the set-up: the listener and the state its loop keeps between polls.
pub(super) struct Acceptor<'a> {
    setup: &'a Setup<'a>,
    listener: TcpListener,
    listen_addr: String,
    gate: Gate,
    refusals: RateLimited,
    shaken_tx: Sender<Shaken>,
    shaken_rx: Receiver<Shaken>,
    abort_polled: Instant,
}

impl<'a> Acceptor<'a> {
    /// Accepts on `listener` (published as `listen_addr`), non-blocking.
    pub(super) fn new(
        setup: &'a Setup<'a>,
        listener: TcpListener,
        listen_addr: String,
    ) -> Result<Self> {
        listener
            .set_nonblocking(true)
            .map_err(|e| CommError::Connect {
                rank: setup.topology.rank,
                peer: setup.topology.rank,
                addr: listen_addr.clone(),
                detail: e.to_string(),
            })?;
        let (shaken_tx, shaken_rx) = channel();
        Ok(Self {
            setup,
            listener,
            listen_addr,
            gate: Gate::new(MAX_HANDSHAKES, MAX_HANDSHAKES_PER_SOURCE),
            refusals: RateLimited::new(Duration::from_secs(10)),
            shaken_tx,
            shaken_rx,
            abort_polled: Instant::now(),
        })
    }

    /// Fills `peers[rank + 1..]` with the higher ranks' connections.
    ///
    /// # Errors
    /// [`CommError::Connect`] naming the ranks that did not connect by the deadline, or that
    /// told the store they cannot reach this rank, or a failed `accept`.
    pub(super) fn accept_higher(mut self, peers: &mut [Option<Peer>]) -> Result<()> {
        let rank = self.setup.topology.rank;
        loop {
            self.take_handshakes(peers)?;
            if peers.iter().skip(rank + 1).all(Option::is_some) {
                return Ok(());
            }
            match self.listener.accept() {
                Ok((stream, from)) => self.start_handshake(stream, from),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    self.check_abort_and_deadline(peers)?;
                    crate::net::wait_for_connection(&self.listener, Duration::from_millis(10));
                }
                Err(e) => return Err(self.error(rank, format!("accept: {e}"))),
            }
        }
    }

    /// Keeps the connections whose handshake finished and proved a rank not yet connected;
    /// logs the others (at a bounded rate).
    fn take_handshakes(&mut self, peers: &mut [Option<Peer>]) -> Result<()> {
        while let Ok((from, stream, verdict)) = self.shaken_rx.try_recv() {
            let verdict = verdict.and_then(|peer| match peers[peer] {
                Some(_) => Err(format!(
                    "{from} claims rank {peer}, which is connected already"
                )),
                None => Ok(peer),
            });
            match verdict {
                Ok(peer) => {
                    let addr = from.to_string();
                    let connected =
                        Peer::new(addr.clone(), stream).map_err(|detail| CommError::Connect {
                            rank: self.setup.topology.rank,
                            peer,
                            addr,
                            detail,
                        })?;
                    peers[peer] = Some(connected);
                }
                Err(why) => {
                    if let Some(left_out) = self.refusals.allow() {
                        tracing::warn!(
                            "burn-ddp: rank {}: refused a connection: {} ({left_out} more \
                             refused since the last such line)",
                            self.setup.topology.rank,
                            printable(&why)
                        );
                    }
                }
            }
        }
        Ok(())
    }

    /// Runs the job's handshake with `stream` on a thread of its own, when the gate lets
    /// `from` in (else tells it "busy").
    fn start_handshake(&self, mut stream: TcpStream, from: SocketAddr) {
        let Ok(pass) = self.gate.enter(from.ip()) else {
            auth::refuse_busy(&mut stream);
            return;
        };
        let topology = self.setup.topology;
        let (rank, world_size, round) =
            (topology.rank, topology.world_size, topology.restart_count);
        let (job, mine, tx) = (
            self.setup.job.clone(),
            self.setup.mine.clone(),
            self.shaken_tx.clone(),
        );
        let spawned = std::thread::Builder::new()
            .name("burn-ddp-handshake".into())
            .spawn(move || {
                let _ = stream.set_nonblocking(false);
                let verdict =
                    auth::accept(&mut stream, &job, Service::Group, &mine, HANDSHAKE_DEADLINE)
                        .map_err(|why| format!("{from}: {why}"))
                        .and_then(|accepted| match parse_context(&accepted.context) {
                            Some((peer, world, their_round))
                                if world == world_size
                                    && their_round == round
                                    && peer > rank
                                    && peer < world_size =>
                            {
                                Ok(peer)
                            }
                            other => Err(format!(
                                "{from} says (rank, world size, round) {other:?}; rank {rank} \
                                 has world size {world_size} round {round}"
                            )),
                        });
                drop(pass);
                let _ = tx.send((from, stream, verdict));
            });
        // A handshake thread that cannot start gives its slot back as it drops.
        drop(spawned);
    }

    /// Fails when a higher rank said in the store that it cannot reach this one, or when the
    /// set-up's deadline passed, naming the ranks still missing.
    fn check_abort_and_deadline(&mut self, peers: &[Option<Peer>]) -> Result<()> {
        let (rank, world_size) = (self.setup.topology.rank, self.setup.topology.world_size);
        let missing = || -> Vec<usize> {
            (rank + 1..world_size)
                .filter(|&p| peers[p].is_none())
                .collect()
        };
        if self.abort_polled.elapsed() >= ABORT_POLL_INTERVAL {
            self.abort_polled = Instant::now();
            let store = &self.setup.rendezvous.store;
            let abort_key = self.setup.abort_key();
            if let Ok(present) = store.check(&[&abort_key])
                && present.first() == Some(&true)
            {
                let reason = store
                    .get(&abort_key, Duration::from_secs(1))
                    .map(|r| String::from_utf8_lossy(&r).into_owned())
                    .unwrap_or_default();
                let missing = missing();
                return Err(self.error(
                    missing.first().copied().unwrap_or(rank),
                    format!("rank(s) {missing:?} will not connect: {reason}"),
                ));
            }
        }
        if self.setup.deadline.is_some_and(|d| Instant::now() >= d) {
            let missing = missing();
            return Err(self.error(
                missing.first().copied().unwrap_or(rank),
                format!(
                    "rank(s) {missing:?} did not connect within {} s",
                    self.setup.connect_timeout.as_secs_f64()
                ),
            ));
        }
        Ok(())
    }

    fn error(&self, peer: usize, detail: String) -> CommError {
        CommError::Connect {
            rank: self.setup.topology.rank,
            peer,
            addr: self.listen_addr.clone(),
            detail,
        }
    }
}
