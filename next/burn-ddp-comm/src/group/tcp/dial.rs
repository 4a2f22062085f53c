//! Dialing the lower ranks while a [`TcpGroup`](super::TcpGroup) forms, and what dialing and
//! accepting share: the handshake's context and deadline, and the set-up's state. A published
//! address that refuses connections or cannot be reached fails within seconds, naming the fix.

use std::io;
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use super::wire::Peer;
use super::{SOCKET_IFNAME_VAR, TcpGroup};
use crate::auth::{self, JobIdentity, Role, Service};
use crate::error::{CommError, Result};
use crate::rendezvous::Rendezvous;
use crate::topology::Topology;

/// How long a connection between two ranks has for its handshake.
pub(super) const HANDSHAKE_DEADLINE: Duration = Duration::from_secs(5);

/// A rank's handshake context: rank, world size, restart round.
pub(super) fn context(rank: usize, world_size: usize, round: u64) -> Vec<u8> {
    let mut c = Vec::with_capacity(16);
    c.extend_from_slice(&(rank as u32).to_le_bytes());
    c.extend_from_slice(&(world_size as u32).to_le_bytes());
    c.extend_from_slice(&round.to_le_bytes());
    c
}

/// A rank's handshake context, for tests that speak the handshake themselves.
#[cfg(test)]
pub(crate) fn tests_context(rank: usize, world_size: usize, round: u64) -> Vec<u8> {
    context(rank, world_size, round)
}

/// The rank, world size and round of a handshake context.
pub(super) fn parse_context(c: &[u8]) -> Option<(usize, usize, u64)> {
    let word = |i: usize| Some(u32::from_le_bytes(c.get(i..i + 4)?.try_into().ok()?) as usize);
    Some((
        word(0)?,
        word(4)?,
        u64::from_le_bytes(c.get(8..16)?.try_into().ok()?),
    ))
}

/// What dialing and accepting the peers share: the job, this rank's handshake context, the
/// set-up's deadline and the rendezvous (whose store carries a failed dial to the peers).
pub(super) struct Setup<'a> {
    pub(super) topology: &'a Topology,
    pub(super) job: &'a JobIdentity,
    /// This rank's handshake context ([`context`]).
    pub(super) mine: Vec<u8>,
    pub(super) deadline: Option<Instant>,
    pub(super) connect_timeout: Duration,
    pub(super) rendezvous: &'a Rendezvous,
}

impl Setup<'_> {
    fn expired(&self) -> bool {
        self.deadline.is_some_and(|d| Instant::now() >= d)
    }

    /// The store key through which a rank that cannot dial a peer tells the others.
    pub(super) fn abort_key(&self) -> String {
        TcpGroup::abort_key(self.rendezvous)
    }

    /// Connects to the lower rank `peer` at its published `addr` and runs the job's handshake
    /// (this rank challenges, both prove the job's key, the acceptor checks this rank's place),
    /// then checks the peer's place.
    pub(super) fn dial(&self, peer: usize, addr: &str) -> Result<Peer> {
        let (rank, world_size) = (self.topology.rank, self.topology.world_size);
        let connect_error = |detail: String| CommError::Connect {
            rank,
            peer,
            addr: addr.to_string(),
            detail,
        };
        let target = addr
            .to_socket_addrs()
            .ok()
            .and_then(|mut a| a.next())
            .ok_or_else(|| connect_error("address does not resolve".into()))?;
        let first_try = Instant::now();
        let (stream, theirs) = loop {
            let mut stream = self.reach(peer, addr, target, first_try)?;
            match auth::connect(
                &mut stream,
                self.job,
                Service::Group,
                Role::Worker,
                &self.mine,
                HANDSHAKE_DEADLINE,
            ) {
                Ok(theirs) => break (stream, theirs),
                // The peer has many connections in their handshake (strangers?): again.
                Err(auth::Refusal::Busy) if !self.expired() => {
                    std::thread::sleep(Duration::from_millis(100));
                }
                Err(why) => return Err(connect_error(format!("handshake: {why}"))),
            }
        };
        let round = self.topology.restart_count;
        if parse_context(&theirs) != Some((peer, world_size, round)) {
            return Err(connect_error(format!(
                "the process there is not rank {peer} of this job's world of {world_size} in \
                 round {round} (it says {:?})",
                parse_context(&theirs)
            )));
        }
        Peer::new(addr.to_string(), stream).map_err(connect_error)
    }

    /// A TCP connection to `target`, `peer`'s published `addr`. The peer published it after it
    /// started listening there: a refusal or an unreachable network does not get better by
    /// waiting, and a working network connects in milliseconds. So this fails within seconds,
    /// naming the fix, and tells the peers through the store so they do not wait for this
    /// connection until their timeout.
    fn reach(
        &self,
        peer: usize,
        addr: &str,
        target: SocketAddr,
        first_try: Instant,
    ) -> Result<TcpStream> {
        loop {
            let e = match TcpStream::connect_timeout(&target, Duration::from_secs(2)) {
                Ok(stream) => return Ok(stream),
                Err(e) => e,
            };
            let unusable = matches!(
                e.kind(),
                io::ErrorKind::ConnectionRefused
                    | io::ErrorKind::HostUnreachable
                    | io::ErrorKind::NetworkUnreachable
                    | io::ErrorKind::AddrNotAvailable
            );
            let waited = first_try.elapsed();
            let give_up = if unusable {
                UNUSABLE_ADDRESS_GRACE
            } else {
                UNREACHABLE_ADDRESS_WINDOW
            };
            if waited >= give_up || self.expired() {
                let store = &self.rendezvous.store;
                let err = CommError::Connect {
                    rank: self.topology.rank,
                    peer,
                    addr: addr.to_string(),
                    detail: unusable_address(
                        peer,
                        addr,
                        &e,
                        waited,
                        self.topology,
                        &store.local_ip(),
                    ),
                };
                let _ = store.set(&self.abort_key(), err.to_string().as_bytes());
                return Err(err);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// How long a published address may refuse connections (or report no route) before it is
/// declared unusable: its rank listens there before publishing it, so only a race with a
/// restarting network would need more.
const UNUSABLE_ADDRESS_GRACE: Duration = Duration::from_secs(2);

/// How long connection attempts to a published address may time out before it is declared
/// unreachable (packets dropped by a firewall or routed nowhere).
const UNREACHABLE_ADDRESS_WINDOW: Duration = Duration::from_secs(10);

/// Why `peer`'s published `addr` cannot be used from this rank, and what to change.
fn unusable_address(
    peer: usize,
    addr: &str,
    error: &io::Error,
    waited: Duration,
    topology: &Topology,
    mine: &std::net::IpAddr,
) -> String {
    let loopback = addr
        .parse::<SocketAddr>()
        .map(|a| a.ip().is_loopback())
        .unwrap_or(false);
    let hint = if loopback && !mine.is_loopback() {
        format!(
            "rank {peer} published a loopback address, which other hosts cannot reach: it met \
             the store through a loopback MASTER_ADDR on its own host, while this rank reaches \
             the store at {}:{} over the network; give every node the same MASTER_ADDR, an \
             address of the store's host that every node reaches (`burn-ddp run --master-addr`)",
            topology.master_addr, topology.master_port
        )
    } else {
        format!(
            "rank {peer} publishes the address of the interface it reaches the store with \
             (MASTER_ADDR={}); if other nodes cannot reach that interface (a container bridge, \
             a second network), set {SOCKET_IFNAME_VAR} to the interface they reach it on, or \
             use a MASTER_ADDR every node reaches through the same network (`burn-ddp run \
             --master-addr`)",
            topology.master_addr
        )
    };
    format!(
        "rank {peer} published {addr} for its peers, but rank {} cannot connect to it ({error}, \
         after {:.1} s): {hint}",
        topology.rank,
        waited.as_secs_f64()
    )
}
