//! [`TcpGroup`]: ranks that are processes (on one machine or many), connected by TCP: what Gloo
//! is to PyTorch. For CPU clusters, and how the multi-process path is tested without GPUs.
//!
//! # Connections
//! After the [rendezvous](crate::rendezvous) every pair of ranks opens one TCP connection (the
//! higher rank connects to the lower), introduced by a handshake (magic, round, rank, world size).
//!
//! # Frames
//! Every message starts with a 40-byte header: kind (data or abort), the collective's operation
//! code, sequence number, length and argument (reduce operation or root), and the payload size.
//! A receiver checks the header against its own call, so ranks that call different collectives
//! get [`DdpError::Mismatch`] instead of misreading each other's bytes. An abort frame carries the
//! reason of the rank that gave up; every rank that gives up sends one to every peer and closes its
//! connections, so a failure spreads from rank to rank (at most `world_size - 1` hops around the
//! ring, each as fast as the network).
//!
//! # All-reduce
//! Ring reduce-scatter then ring all-gather, in `world_size` chunks: each rank sends and receives
//! `2 (N-1)/N` of the buffer. Chunk `c` is summed in the order `c, c+1, ..., c-1` (ranks mod `N`),
//! the same order as [`ThreadGroup`](super::ThreadGroup), so both groups give the same bits, and
//! each element is summed once, so every rank gets the same bits. Sends run on a helper thread
//! while the caller receives, so large chunks cannot deadlock two ranks writing to each other.
//!
//! Payloads are sent in the machine's byte order: all ranks must share it (x86-64 and AArch64 are
//! little-endian).

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::{Collective, ProcessGroup, ReduceOp, chunk_range};
use crate::rendezvous::{Rendezvous, rendezvous};
use crate::topology::Topology;
use crate::{DdpError, Result};

const MAGIC: u32 = 0x4244_5050; // "BDPP"
const VERSION: u32 = 1;
const HEADER_BYTES: usize = 40;
const KIND_DATA: u8 = 1;
const KIND_ABORT: u8 = 2;
/// How long an abort frame may take to write before the peer is given up.
const ABORT_WRITE_TIMEOUT: Duration = Duration::from_secs(1);
/// How often [`ProcessGroup::aborted`] asks the rendezvous store whether a peer aborted (a
/// round trip to the store; collectives that run outside TCP, NCCL's, poll it while they wait).
const ABORT_POLL_INTERVAL: Duration = Duration::from_millis(100);

/// One rank of a process group whose ranks are processes connected by TCP.
pub struct TcpGroup {
    rank: usize,
    world_size: usize,
    seq: AtomicU64,
    peers: Vec<Option<Peer>>,
    aborted: Mutex<Option<String>>,
    rendezvous: Option<Rendezvous>,
    /// When the store was last asked for an abort (see [`ABORT_POLL_INTERVAL`]).
    abort_polled: Mutex<Option<Instant>>,
}

struct Peer {
    rank: usize,
    addr: String,
    reader: Mutex<TcpStream>,
    writer: Mutex<TcpStream>,
    /// A third handle on the connection, for `shutdown` without taking the writer's lock (a
    /// sender blocked in a write holds it).
    control: TcpStream,
    /// Set when a write failed part-way: the stream may end inside a frame, so no abort frame
    /// may follow on it.
    broken: std::sync::atomic::AtomicBool,
}

/// What a rank is doing, for error messages and frame checks.
#[derive(Clone, Copy)]
struct Call {
    seq: u64,
    op: Collective,
    deadline: Option<Instant>,
    timeout: Duration,
}

fn encode(op: Collective) -> (u8, u64, u64) {
    match op {
        Collective::AllReduce { op, len } => (
            1,
            len as u64,
            match op {
                ReduceOp::Sum => 0,
                ReduceOp::Avg => 1,
            },
        ),
        Collective::Broadcast { root, len } => (2, len as u64, root as u64),
        Collective::Barrier => (3, 0, 0),
        Collective::AllGather { len } => (4, len as u64, 0),
    }
}

fn decode(code: u8, len: u64, arg: u64) -> Option<Collective> {
    let len = len as usize;
    Some(match code {
        1 => Collective::AllReduce {
            op: if arg == 0 {
                ReduceOp::Sum
            } else {
                ReduceOp::Avg
            },
            len,
        },
        2 => Collective::Broadcast {
            root: arg as usize,
            len,
        },
        3 => Collective::Barrier,
        4 => Collective::AllGather { len },
        _ => return None,
    })
}

fn header(kind: u8, call: &Call, payload: usize) -> [u8; HEADER_BYTES] {
    let (code, len, arg) = encode(call.op);
    let mut h = [0u8; HEADER_BYTES];
    h[0] = kind;
    h[1] = code;
    h[8..16].copy_from_slice(&call.seq.to_le_bytes());
    h[16..24].copy_from_slice(&len.to_le_bytes());
    h[24..32].copy_from_slice(&arg.to_le_bytes());
    h[32..40].copy_from_slice(&(payload as u64).to_le_bytes());
    h
}

fn word(bytes: &[u8]) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&bytes[..8]);
    u64::from_le_bytes(w)
}

/// Options of [`TcpGroup::connect`].
#[derive(Debug, Clone)]
pub struct TcpGroupOptions {
    /// How long the rendezvous and the connection set-up may take (default 300 s).
    pub connect_timeout: Duration,
}

impl Default for TcpGroupOptions {
    fn default() -> Self {
        Self {
            connect_timeout: crate::rendezvous::DEFAULT_RENDEZVOUS_TIMEOUT,
        }
    }
}

impl TcpGroup {
    /// Joins the job described by the environment (see [`Topology::from_env`]).
    ///
    /// # Errors
    /// [`DdpError::Topology`] when the environment does not describe a multi-process job, and
    /// the errors of [`connect`](Self::connect).
    pub fn from_env(options: &TcpGroupOptions) -> Result<TcpGroup> {
        let topology = Topology::from_env()?.ok_or_else(|| {
            DdpError::Topology(
                "this process is not part of a multi-process job: set RANK, WORLD_SIZE, \
                 MASTER_ADDR and MASTER_PORT (or start it with `burn-ddp run`, srun or mpirun)"
                    .into(),
            )
        })?;
        Self::connect(&topology, options)
    }

    /// Meets the other processes of `topology` through the rendezvous store and connects to
    /// each of them.
    ///
    /// # Errors
    /// The rendezvous' errors ([`DdpError::Rendezvous`], [`DdpError::Store`]);
    /// [`DdpError::Connect`] when a peer cannot be reached or answers with a wrong handshake.
    pub fn connect(topology: &Topology, options: &TcpGroupOptions) -> Result<TcpGroup> {
        let rank = topology.rank;
        let world_size = topology.world_size;
        let started = Instant::now();
        let deadline = started.checked_add(options.connect_timeout);
        // Listen on the address this host uses to reach the store (a peer that reaches the store
        // reaches it too, in the same address family), or on the interface
        // `BURN_DDP_SOCKET_IFNAME` names.
        let interface = match std::env::var(SOCKET_IFNAME_VAR) {
            Ok(name) if !name.is_empty() => {
                Some(interface_ip(&name).map_err(|detail| DdpError::Connect {
                    rank,
                    peer: rank,
                    addr: format!("{SOCKET_IFNAME_VAR}={name}"),
                    detail,
                })?)
            }
            _ => None,
        };
        let mut listening = None;
        let rendezvous = rendezvous(topology, options.connect_timeout, |store_ip| {
            let ip = interface.unwrap_or(store_ip);
            let listener =
                TcpListener::bind(SocketAddr::new(ip, 0)).map_err(|e| DdpError::Connect {
                    rank,
                    peer: rank,
                    addr: format!("{ip}:0"),
                    detail: format!("cannot listen: {e}"),
                })?;
            let addr = listener
                .local_addr()
                .map_err(|e| DdpError::Connect {
                    rank,
                    peer: rank,
                    addr: format!("{ip}:0"),
                    detail: e.to_string(),
                })?
                .to_string();
            listening = Some((listener, addr.clone()));
            Ok(addr)
        })?;
        let Some((listener, listen_addr)) = listening else {
            return Err(DdpError::Rendezvous {
                rank,
                detail: "the rendezvous finished without a listening address".into(),
            });
        };

        let mut peers: Vec<Option<Peer>> = (0..world_size).map(|_| None).collect();
        let hello = |stream: &mut TcpStream| -> io::Result<()> {
            let mut h = [0u8; 24];
            h[0..4].copy_from_slice(&MAGIC.to_le_bytes());
            h[4..8].copy_from_slice(&VERSION.to_le_bytes());
            h[8..12].copy_from_slice(&(world_size as u32).to_le_bytes());
            h[12..16].copy_from_slice(&(rank as u32).to_le_bytes());
            h[16..24].copy_from_slice(&topology.restart_count.to_le_bytes());
            stream.write_all(&h)
        };
        // Connect to every lower rank.
        for (peer, addr) in rendezvous.peer_addrs.iter().enumerate().take(rank) {
            let connect_error = |detail: String| DdpError::Connect {
                rank,
                peer,
                addr: addr.clone(),
                detail,
            };
            let target = addr
                .to_socket_addrs()
                .ok()
                .and_then(|mut a| a.next())
                .ok_or_else(|| connect_error("address does not resolve".into()))?;
            // The peer published this address after it started listening there: a refusal or
            // an unreachable network does not get better by waiting, and a working network
            // connects in milliseconds. Fail within seconds, naming the fix, and tell the peers
            // through the store so they do not wait for this connection until their timeout.
            let first_try = Instant::now();
            let mut stream = loop {
                match TcpStream::connect_timeout(&target, Duration::from_secs(2)) {
                    Ok(stream) => break stream,
                    Err(e) => {
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
                        if waited >= give_up || deadline.is_some_and(|d| Instant::now() >= d) {
                            let err = connect_error(unusable_address(
                                peer,
                                addr,
                                &e,
                                waited,
                                topology,
                                &rendezvous.store.local_ip(),
                            ));
                            let _ = rendezvous
                                .store
                                .set(&Self::abort_key(&rendezvous), err.to_string().as_bytes());
                            return Err(err);
                        }
                        std::thread::sleep(Duration::from_millis(100));
                    }
                }
            };
            hello(&mut stream).map_err(|e| connect_error(format!("handshake: {e}")))?;
            // The acceptor answers 1 (accepted) or 0 followed by why it refused.
            let _ = stream.set_read_timeout(Some(Duration::from_secs(30)));
            let mut answer = [0u8; 1];
            stream
                .read_exact(&mut answer)
                .map_err(|e| connect_error(format!("no answer to the handshake: {e}")))?;
            if answer[0] != 1 {
                let mut reason = String::new();
                let _ = stream.read_to_string(&mut reason);
                return Err(connect_error(format!("refused the connection: {reason}")));
            }
            peers[peer] = Some(Peer::new(peer, addr.clone(), stream).map_err(connect_error)?);
        }
        // Accept every higher rank.
        listener
            .set_nonblocking(true)
            .map_err(|e| DdpError::Connect {
                rank,
                peer: rank,
                addr: listen_addr.clone(),
                detail: e.to_string(),
            })?;
        let mut refused: Vec<String> = Vec::new();
        let abort_key = Self::abort_key(&rendezvous);
        let mut abort_polled = Instant::now();
        while peers.iter().skip(rank + 1).any(Option::is_none) {
            match listener.accept() {
                Ok((mut stream, from)) => {
                    let _ = stream.set_nonblocking(false);
                    let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
                    let mut h = [0u8; 24];
                    let field = |h: &[u8; 24], i: usize| {
                        u32::from_le_bytes([h[i], h[i + 1], h[i + 2], h[i + 3]]) as usize
                    };
                    // `Ok(peer)`: a rank this one expects; `Err(why)`: refuse the connection.
                    let verdict = match stream.read_exact(&mut h) {
                        Err(e) => Err(format!("no handshake from {from}: {e}")),
                        Ok(()) => {
                            let round = word(&h[16..24]);
                            let peer = field(&h, 12);
                            if field(&h, 0) != MAGIC as usize || field(&h, 4) != VERSION as usize {
                                Err(format!("{from} is not a burn-ddp rank (bad handshake)"))
                            } else if field(&h, 8) != world_size || round != topology.restart_count
                            {
                                Err(format!(
                                    "{from} (rank {peer}) says world size {} round {round}; rank \
                                     {rank} has world size {world_size} round {}",
                                    field(&h, 8),
                                    topology.restart_count
                                ))
                            } else if peer <= rank || peer >= world_size || peers[peer].is_some() {
                                Err(format!(
                                    "{from} claims rank {peer}, which cannot connect to rank {rank}"
                                ))
                            } else {
                                Ok(peer)
                            }
                        }
                    };
                    match verdict {
                        Ok(peer) => {
                            let addr = from.to_string();
                            let _ = stream.write_all(&[1]);
                            peers[peer] =
                                Some(Peer::new(peer, addr.clone(), stream).map_err(|detail| {
                                    DdpError::Connect {
                                        rank,
                                        peer,
                                        addr,
                                        detail,
                                    }
                                })?);
                        }
                        Err(why) => {
                            let _ = stream.write_all(&[0]);
                            let _ = stream.write_all(why.as_bytes());
                            tracing::warn!("burn-ddp: rank {rank}: refused a connection: {why}");
                            refused.push(why);
                        }
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    // A higher rank that cannot reach this one says so in the store.
                    if abort_polled.elapsed() >= ABORT_POLL_INTERVAL {
                        abort_polled = Instant::now();
                        if let Ok(present) = rendezvous.store.check(&[&abort_key])
                            && present.first() == Some(&true)
                        {
                            let reason = rendezvous
                                .store
                                .get(&abort_key, Duration::from_secs(1))
                                .map(|r| String::from_utf8_lossy(&r).into_owned())
                                .unwrap_or_default();
                            let missing: Vec<usize> = (rank + 1..world_size)
                                .filter(|&p| peers[p].is_none())
                                .collect();
                            return Err(DdpError::Connect {
                                rank,
                                peer: missing.first().copied().unwrap_or(rank),
                                addr: listen_addr,
                                detail: format!("rank(s) {missing:?} will not connect: {reason}"),
                            });
                        }
                    }
                    if deadline.is_some_and(|d| Instant::now() >= d) {
                        let missing: Vec<usize> = (rank + 1..world_size)
                            .filter(|&p| peers[p].is_none())
                            .collect();
                        return Err(DdpError::Connect {
                            rank,
                            peer: missing[0],
                            addr: listen_addr,
                            detail: format!(
                                "rank(s) {missing:?} did not connect within {} s",
                                options.connect_timeout.as_secs_f64()
                            ),
                        });
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(e) => {
                    return Err(DdpError::Connect {
                        rank,
                        peer: rank,
                        addr: listen_addr,
                        detail: format!("accept: {e}"),
                    });
                }
            }
        }
        tracing::info!(
            "burn-ddp: rank {rank} of {world_size} connected over TCP in {:.2} s",
            started.elapsed().as_secs_f64()
        );
        Ok(TcpGroup {
            rank,
            world_size,
            seq: AtomicU64::new(0),
            peers,
            aborted: Mutex::new(None),
            rendezvous: Some(rendezvous),
            abort_polled: Mutex::new(None),
        })
    }

    /// The rendezvous store this group met through (for the NCCL unique id and other
    /// job-wide keys).
    pub fn rendezvous(&self) -> Option<&Rendezvous> {
        self.rendezvous.as_ref()
    }

    /// The store key under which an aborting rank leaves its reason.
    fn abort_key(rendezvous: &Rendezvous) -> String {
        format!("{}/abort", rendezvous.prefix)
    }

    fn begin(&self, op: Collective, timeout: Duration) -> Result<Call> {
        let call = Call {
            seq: self.seq.fetch_add(1, Ordering::Relaxed),
            op,
            deadline: Instant::now().checked_add(timeout),
            timeout,
        };
        if let Some(cause) = lock(&self.aborted).clone() {
            return Err(DdpError::Aborted {
                rank: self.rank,
                op,
                seq: call.seq,
                cause,
            });
        }
        Ok(call)
    }

    fn peer(&self, rank: usize) -> &Peer {
        // Every rank but this one has a connection (built in `connect`); callers never ask for
        // their own rank.
        match &self.peers[rank] {
            Some(peer) => peer,
            None => unreachable!("rank {} has no connection to itself", self.rank),
        }
    }

    fn next(&self) -> usize {
        (self.rank + 1) % self.world_size
    }

    fn prev(&self) -> usize {
        (self.rank + self.world_size - 1) % self.world_size
    }

    /// Runs one collective's body; on failure, aborts the group (telling every peer why).
    fn run<T>(&self, call: Call, body: impl FnOnce() -> Result<T>) -> Result<T> {
        let result = body();
        if let Err(err) = &result {
            self.abort_with(&err.to_string(), call);
        }
        result
    }

    /// Sends `payload` to `peer` and receives into `out` from `from`, concurrently.
    fn exchange(
        &self,
        call: &Call,
        to: usize,
        payload: &[u8],
        from: usize,
        out: &mut [u8],
    ) -> Result<()> {
        std::thread::scope(|s| {
            let sender = s.spawn(|| self.send(call, to, payload));
            let received = self.recv(call, from, out);
            if received.is_err() {
                // The sender may be blocked writing to a peer that stopped reading. Give it a
                // moment to finish (then the abort frame can follow on a clean stream), else
                // unblock it by closing the connection (the group is about to be aborted).
                let waited = Instant::now();
                while !sender.is_finished() && waited.elapsed() < ABORT_WRITE_TIMEOUT {
                    std::thread::sleep(Duration::from_millis(1));
                }
                if !sender.is_finished() {
                    let peer = self.peer(to);
                    peer.broken.store(true, Ordering::Relaxed);
                    let _ = peer.control.shutdown(Shutdown::Both);
                }
            }
            let sent = sender.join().unwrap_or_else(|_| {
                Err(DdpError::PeerLeft {
                    rank: self.rank,
                    op: call.op,
                    seq: call.seq,
                    peer: to,
                    reason: "the sending thread panicked".into(),
                })
            });
            received.and(sent)
        })
    }

    fn send(&self, call: &Call, to: usize, payload: &[u8]) -> Result<()> {
        let peer = self.peer(to);
        let mut writer = lock(&peer.writer);
        write_full(
            &mut writer,
            &header(KIND_DATA, call, payload.len()),
            call.deadline,
        )
        .and_then(|()| write_full(&mut writer, payload, call.deadline))
        .map_err(|e| {
            peer.broken.store(true, Ordering::Relaxed);
            self.io_error(call, peer, e, "sending to")
        })
    }

    fn recv(&self, call: &Call, from: usize, out: &mut [u8]) -> Result<()> {
        let peer = self.peer(from);
        let mut reader = lock(&peer.reader);
        let mut h = [0u8; HEADER_BYTES];
        read_full(&mut reader, &mut h, call.deadline)
            .map_err(|e| self.io_error(call, peer, e, "waiting for"))?;
        let payload = word(&h[32..40]) as usize;
        if h[0] == KIND_ABORT {
            let mut reason = vec![0u8; payload.min(64 << 10)];
            let mut read = 0;
            let _ = reader.set_read_timeout(Some(ABORT_WRITE_TIMEOUT));
            while read < reason.len() {
                match reader.read(&mut reason[read..]) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => read += n,
                }
            }
            reason.truncate(read);
            return Err(DdpError::Aborted {
                rank: self.rank,
                op: call.op,
                seq: call.seq,
                cause: format!("rank {from} gave up: {}", String::from_utf8_lossy(&reason)),
            });
        }
        let peer_seq = word(&h[8..16]);
        let Some(peer_op) =
            decode(h[1], word(&h[16..24]), word(&h[24..32])).filter(|_| h[0] == KIND_DATA)
        else {
            return Err(DdpError::PeerLeft {
                rank: self.rank,
                op: call.op,
                seq: call.seq,
                peer: from,
                reason: "garbled stream (not a burn-ddp frame)".into(),
            });
        };
        if peer_op != call.op || peer_seq != call.seq || payload != out.len() {
            return Err(DdpError::Mismatch {
                rank: self.rank,
                op: call.op,
                seq: call.seq,
                peer: from,
                peer_op,
                peer_seq,
            });
        }
        read_full(&mut reader, out, call.deadline)
            .map_err(|e| self.io_error(call, peer, e, "waiting for"))
    }

    fn io_error(&self, call: &Call, peer: &Peer, e: io::Error, doing: &str) -> DdpError {
        // In the ring a rank only hears from its neighbour: when it times out, the neighbour or a
        // rank before it is late. The timeout names the neighbour, the one this rank waited on.
        match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => DdpError::Timeout {
                rank: self.rank,
                op: call.op,
                seq: call.seq,
                timeout: call.timeout,
                missing: vec![peer.rank],
                last_seen: Vec::new(),
            },
            kind => DdpError::PeerLeft {
                rank: self.rank,
                op: call.op,
                seq: call.seq,
                peer: peer.rank,
                reason: match kind {
                    io::ErrorKind::UnexpectedEof
                    | io::ErrorKind::ConnectionReset
                    | io::ErrorKind::ConnectionAborted
                    | io::ErrorKind::BrokenPipe => format!(
                        "connection to {} closed while {doing} it (its process ended or was killed)",
                        peer.addr
                    ),
                    _ => format!("{doing} {}: {e}", peer.addr),
                },
            },
        }
    }

    fn abort_with(&self, reason: &str, call: Call) {
        {
            let mut aborted = lock(&self.aborted);
            if aborted.is_some() {
                return;
            }
            *aborted = Some(reason.to_string());
        }
        // Peers whose collectives do not read these sockets (NCCL's) look in the store.
        if let Some(rendezvous) = &self.rendezvous {
            let _ = rendezvous
                .store
                .set(&Self::abort_key(rendezvous), reason.as_bytes());
        }
        let deadline = Instant::now().checked_add(ABORT_WRITE_TIMEOUT);
        for peer in self.peers.iter().flatten() {
            // Never write a frame into a stream that may end inside another frame.
            if !peer.broken.load(Ordering::Relaxed)
                && let Ok(mut writer) = peer.writer.try_lock()
            {
                let _ = write_full(
                    &mut writer,
                    &header(KIND_ABORT, &call, reason.len()),
                    deadline,
                )
                .and_then(|()| write_full(&mut writer, reason.as_bytes(), deadline));
            }
            // Peers blocked on this connection see the abort frame, then the end of stream.
            let _ = peer.control.shutdown(Shutdown::Write);
        }
    }
}

impl Peer {
    fn new(rank: usize, addr: String, stream: TcpStream) -> std::result::Result<Peer, String> {
        stream.set_nodelay(true).map_err(|e| e.to_string())?;
        let reader = stream.try_clone().map_err(|e| e.to_string())?;
        let control = stream.try_clone().map_err(|e| e.to_string())?;
        Ok(Peer {
            rank,
            addr,
            reader: Mutex::new(reader),
            writer: Mutex::new(stream),
            control,
            broken: std::sync::atomic::AtomicBool::new(false),
        })
    }
}

/// Reads exactly `buf.len()` bytes, re-arming the socket timeout with the time left before
/// `deadline` at every read, so a peer trickling bytes cannot stretch the call past it.
fn read_full(stream: &mut TcpStream, buf: &mut [u8], deadline: Option<Instant>) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        stream.set_read_timeout(remaining(deadline)?)?;
        match stream.read(&mut buf[done..]) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Writes all of `buf`, re-arming the timeout like [`read_full`].
fn write_full(stream: &mut TcpStream, buf: &[u8], deadline: Option<Instant>) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        stream.set_write_timeout(remaining(deadline)?)?;
        match stream.write(&buf[done..]) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// The socket timeout for the time left before `deadline` (`None`: no limit); an error once it
/// passed.
fn remaining(deadline: Option<Instant>) -> io::Result<Option<Duration>> {
    match deadline {
        None => Ok(None),
        Some(d) => {
            let left = d.saturating_duration_since(Instant::now());
            if left.is_zero() {
                Err(io::ErrorKind::TimedOut.into())
            } else {
                Ok(Some(left))
            }
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// `(send, receive)`: disjoint chunks `a` (read) and `b` (written) of `buf`.
fn split_pair(
    buf: &mut [f32],
    a: std::ops::Range<usize>,
    b: std::ops::Range<usize>,
) -> (&[f32], &mut [f32]) {
    if a.start < b.start {
        let (left, right) = buf.split_at_mut(b.start);
        (&left[a], &mut right[..b.len()])
    } else {
        let (left, right) = buf.split_at_mut(a.start);
        (&right[..a.len()], &mut left[b])
    }
}

/// The variable naming the network interface whose address ranks listen on and publish (like
/// NCCL's `NCCL_SOCKET_IFNAME`, Gloo's `GLOO_SOCKET_IFNAME`): for hosts where the interface that
/// reaches the store is not the one other nodes reach this host on.
pub const SOCKET_IFNAME_VAR: &str = "BURN_DDP_SOCKET_IFNAME";

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

/// The IPv4 (else IPv6) address of the network interface `name`.
#[cfg(unix)]
fn interface_ip(name: &str) -> std::result::Result<std::net::IpAddr, String> {
    use std::ffi::CStr;
    let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: `getifaddrs` fills `list` with a linked list we free below with `freeifaddrs`.
    if unsafe { libc::getifaddrs(&mut list) } != 0 {
        return Err(format!(
            "cannot list the network interfaces: {}",
            io::Error::last_os_error()
        ));
    }
    let mut found: Option<std::net::IpAddr> = None;
    let mut names: Vec<String> = Vec::new();
    let mut cursor = list;
    while !cursor.is_null() {
        // SAFETY: `cursor` is a node of the list `getifaddrs` returned, not yet freed.
        let entry = unsafe { &*cursor };
        cursor = entry.ifa_next;
        if entry.ifa_name.is_null() || entry.ifa_addr.is_null() {
            continue;
        }
        // SAFETY: `ifa_name` is a NUL-terminated string owned by the list.
        let entry_name = unsafe { CStr::from_ptr(entry.ifa_name) }
            .to_string_lossy()
            .into_owned();
        // SAFETY: `ifa_addr` points to a sockaddr whose family says which struct it is.
        let ip = unsafe {
            match i32::from((*entry.ifa_addr).sa_family) {
                libc::AF_INET => {
                    let v4 = &*(entry.ifa_addr as *const libc::sockaddr_in);
                    Some(std::net::IpAddr::from(
                        u32::from_be(v4.sin_addr.s_addr).to_be_bytes(),
                    ))
                }
                libc::AF_INET6 => {
                    let v6 = &*(entry.ifa_addr as *const libc::sockaddr_in6);
                    Some(std::net::IpAddr::from(v6.sin6_addr.s6_addr))
                }
                _ => None,
            }
        };
        if !names.contains(&entry_name) {
            names.push(entry_name.clone());
        }
        if entry_name == name
            && let Some(ip) = ip
            && (found.is_none() || ip.is_ipv4())
            && !found.is_some_and(|f| f.is_ipv4())
        {
            found = Some(ip);
        }
    }
    // SAFETY: frees the list `getifaddrs` allocated; no reference into it outlives this call.
    unsafe { libc::freeifaddrs(list) };
    found.ok_or_else(|| {
        format!(
            "no interface {name} with an IP address (interfaces: {})",
            names.join(", ")
        )
    })
}

#[cfg(not(unix))]
fn interface_ip(name: &str) -> std::result::Result<std::net::IpAddr, String> {
    Err(format!(
        "{SOCKET_IFNAME_VAR}={name}: interfaces are only looked up on Unix"
    ))
}

impl ProcessGroup for TcpGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn backend(&self) -> &'static str {
        "tcp"
    }

    fn all_reduce(&self, bucket: &mut [f32], op: ReduceOp, timeout: Duration) -> Result<()> {
        let n = self.world_size;
        let len = bucket.len();
        let call = self.begin(Collective::AllReduce { op, len }, timeout)?;
        if n == 1 {
            return Ok(());
        }
        self.run(call, || {
            let (next, prev) = (self.next(), self.prev());
            let chunk = |c: usize| chunk_range(len, n, c % n);
            let mut scratch = vec![0f32; len.div_ceil(n)];
            // Reduce-scatter: at step s, send chunk r - s, receive chunk r - s - 1 and add ours.
            for step in 0..n - 1 {
                let send = chunk(self.rank + n - step);
                let recv = chunk(self.rank + n - step - 1);
                let incoming = &mut scratch[..recv.len()];
                self.exchange(
                    &call,
                    next,
                    bytemuck::cast_slice(&bucket[send]),
                    prev,
                    bytemuck::cast_slice_mut(incoming),
                )?;
                for (own, partial) in bucket[recv].iter_mut().zip(incoming.iter()) {
                    // (earlier ranks' partial sum) + this rank's value: the order c, c+1, ...,
                    // with the operands in ThreadGroup's order (that matters only for the
                    // payload of NaNs, but keeps the bits identical).
                    #[allow(clippy::assign_op_pattern)]
                    {
                        *own = *partial + *own;
                    }
                }
            }
            // This rank now holds chunk r + 1 complete.
            let owned = chunk(self.rank + 1);
            if op == ReduceOp::Avg {
                let divisor = n as f32;
                bucket[owned].iter_mut().for_each(|v| *v /= divisor);
            }
            // All-gather: at step s, send chunk r + 1 - s, receive chunk r - s.
            for step in 0..n - 1 {
                let send = chunk(self.rank + 1 + n - step);
                let recv = chunk(self.rank + n - step);
                let (outgoing, incoming) = split_pair(bucket, send, recv);
                self.exchange(
                    &call,
                    next,
                    bytemuck::cast_slice(outgoing),
                    prev,
                    bytemuck::cast_slice_mut(incoming),
                )?;
            }
            Ok(())
        })
    }

    fn broadcast(&self, buffer: &mut [f32], root: usize, timeout: Duration) -> Result<()> {
        let n = self.world_size;
        let call = self.begin(
            Collective::Broadcast {
                root,
                len: buffer.len(),
            },
            timeout,
        )?;
        if root >= n {
            let err = DdpError::InvalidConfig(format!(
                "broadcast #{} on rank {}: root {root} is not below the world size {n}",
                call.seq, self.rank
            ));
            self.abort_with(&err.to_string(), call);
            return Err(err);
        }
        if n == 1 {
            return Ok(());
        }
        self.run(call, || {
            if self.rank == root {
                let payload: &[u8] = bytemuck::cast_slice(buffer);
                std::thread::scope(|s| {
                    let sends: Vec<_> = (0..n)
                        .filter(|&p| p != root)
                        .map(|p| s.spawn(move || self.send(&call, p, payload)))
                        .collect();
                    sends.into_iter().try_for_each(|h| {
                        h.join().unwrap_or_else(|_| {
                            Err(DdpError::InvalidConfig("a sending thread panicked".into()))
                        })
                    })
                })
            } else {
                self.recv(&call, root, bytemuck::cast_slice_mut(buffer))
            }
        })
    }

    fn barrier(&self, timeout: Duration) -> Result<()> {
        let call = self.begin(Collective::Barrier, timeout)?;
        if self.world_size == 1 {
            return Ok(());
        }
        self.run(call, || self.gather_bytes(&call, &[]).map(drop))
    }

    fn all_gather(&self, values: &[u64], timeout: Duration) -> Result<Vec<u64>> {
        let call = self.begin(Collective::AllGather { len: values.len() }, timeout)?;
        if self.world_size == 1 {
            return Ok(values.to_vec());
        }
        self.run(call, || {
            let parts = self.gather_bytes(&call, bytemuck::cast_slice(values))?;
            let mut out = Vec::with_capacity(values.len() * self.world_size);
            for part in parts {
                out.extend(part.chunks_exact(8).map(word));
            }
            Ok(out)
        })
    }

    fn abort(&self, reason: &str) {
        let call = Call {
            seq: self.seq.load(Ordering::Relaxed),
            op: Collective::Barrier,
            deadline: None,
            timeout: Duration::ZERO,
        };
        self.abort_with(
            &format!("rank {} aborted the group: {reason}", self.rank),
            call,
        );
    }

    /// This rank's abort, a peer's abort frame read during a collective, or, at most every
    /// 100 ms, a peer's abort left in the rendezvous store (an unreachable store tells nothing).
    fn aborted(&self) -> Option<String> {
        if let Some(reason) = lock(&self.aborted).clone() {
            return Some(reason);
        }
        let rendezvous = self.rendezvous.as_ref()?;
        {
            let mut polled = lock(&self.abort_polled);
            if polled.is_some_and(|at| at.elapsed() < ABORT_POLL_INTERVAL) {
                return None;
            }
            *polled = Some(Instant::now());
        }
        let key = Self::abort_key(rendezvous);
        if !rendezvous.store.check(&[&key]).ok()?.first().copied()? {
            return None;
        }
        let reason = rendezvous.store.get(&key, Duration::from_secs(1)).ok()?;
        let reason = String::from_utf8_lossy(&reason).into_owned();
        let mut aborted = lock(&self.aborted);
        Some(aborted.get_or_insert(reason).clone())
    }
}

impl TcpGroup {
    /// Every rank sends `mine` to every other rank; returns all ranks' bytes, rank-major.
    fn gather_bytes(&self, call: &Call, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        let n = self.world_size;
        std::thread::scope(|s| {
            let sender = s.spawn(|| {
                (0..n)
                    .filter(|&p| p != self.rank)
                    .try_for_each(|p| self.send(call, p, mine))
            });
            let mut parts = vec![Vec::new(); n];
            let mut received = Ok(());
            for (p, part) in parts.iter_mut().enumerate() {
                if p == self.rank {
                    *part = mine.to_vec();
                } else if received.is_ok() {
                    part.resize(mine.len(), 0);
                    received = self.recv(call, p, part);
                }
            }
            let sent = sender.join().unwrap_or_else(|_| {
                Err(DdpError::InvalidConfig("a sending thread panicked".into()))
            });
            received.and(sent).map(|()| parts)
        })
    }
}

impl Drop for TcpGroup {
    fn drop(&mut self) {
        for peer in self.peers.iter().flatten() {
            let _ = peer.control.shutdown(Shutdown::Both);
        }
    }
}

impl std::fmt::Debug for TcpGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpGroup")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("next_seq", &self.seq.load(Ordering::Relaxed))
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::group::ThreadGroup;
    use crate::topology::TopologySource;

    const T: Duration = Duration::from_secs(20);

    /// Runs `f(group)` for every rank of a loopback TcpGroup, one thread per rank, meeting
    /// through a store the test serves on a port the system picked.
    fn run<R: Send>(n: usize, f: impl Fn(TcpGroup) -> R + Sync) -> Vec<R> {
        let server = crate::store::StoreServer::bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let port = server.local_addr().port();
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..n)
                .map(|rank| {
                    let f = &f;
                    s.spawn(move || {
                        let topology = Topology {
                            rank,
                            world_size: n,
                            local_rank: rank,
                            local_world_size: n,
                            master_addr: "127.0.0.1".into(),
                            master_port: port,
                            agent_store: true,
                            restart_count: 0,
                            source: TopologySource::Torchrun,
                        };
                        let options = TcpGroupOptions {
                            connect_timeout: Duration::from_secs(20),
                        };
                        f(TcpGroup::connect(&topology, &options).unwrap())
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    fn input(rank: usize, i: usize) -> f32 {
        ((rank * 31 + i * 7) % 97) as f32 * 0.37 - 11.0
    }

    #[test]
    fn all_reduce_gives_the_same_bits_as_the_thread_group() {
        for n in [2usize, 3, 4] {
            let len = 10_007;
            let tcp = run(n, |g| {
                let mut sum: Vec<f32> = (0..len).map(|i| input(g.rank(), i)).collect();
                let mut avg = sum.clone();
                g.all_reduce(&mut sum, ReduceOp::Sum, T).unwrap();
                g.all_reduce(&mut avg, ReduceOp::Avg, T).unwrap();
                (sum, avg)
            });
            let groups = ThreadGroup::new_group(n).unwrap();
            let threads: Vec<(Vec<f32>, Vec<f32>)> = std::thread::scope(|s| {
                let handles: Vec<_> = groups
                    .into_iter()
                    .map(|g| {
                        s.spawn(move || {
                            let mut sum: Vec<f32> = (0..len).map(|i| input(g.rank(), i)).collect();
                            let mut avg = sum.clone();
                            g.all_reduce(&mut sum, ReduceOp::Sum, T).unwrap();
                            g.all_reduce(&mut avg, ReduceOp::Avg, T).unwrap();
                            (sum, avg)
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            });
            for rank in 0..n {
                assert_eq!(
                    tcp[rank].0, tcp[0].0,
                    "n {n}: rank {rank} differs from rank 0"
                );
                let same_bits = tcp[rank]
                    .0
                    .iter()
                    .zip(&threads[0].0)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same_bits, "n {n}: TcpGroup and ThreadGroup sums differ");
                assert!(
                    tcp[rank]
                        .1
                        .iter()
                        .zip(&threads[0].1)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "n {n}: averages differ"
                );
            }
            // And the sum is right (to rounding) against a plain sum.
            for i in (0..len).step_by(997) {
                let expected: f32 = (0..n).map(|r| input(r, i)).sum();
                assert!((tcp[0].0[i] - expected).abs() <= 1e-4 * expected.abs().max(1.0));
            }
        }
    }

    #[test]
    fn broadcast_all_gather_and_barrier_work_over_tcp() {
        let results = run(3, |g| {
            let mut buf = vec![g.rank() as f32; 1000];
            g.broadcast(&mut buf, 1, T).unwrap();
            g.barrier(T).unwrap();
            let gathered = g.all_gather(&[g.rank() as u64, 7], T).unwrap();
            (buf, gathered)
        });
        for (buf, gathered) in results {
            assert!(buf.iter().all(|&v| v == 1.0));
            assert_eq!(gathered, vec![0, 7, 1, 7, 2, 7]);
        }
    }

    #[test]
    fn a_mismatch_is_reported_with_the_peers_call() {
        let results = run(2, |g| {
            let mut buf = vec![0f32; 10 + g.rank()];
            g.all_reduce(&mut buf, ReduceOp::Sum, T)
        });
        for (rank, result) in results.iter().enumerate() {
            match result {
                Err(DdpError::Mismatch { peer, .. }) => assert_ne!(*peer, rank),
                // The other rank may read the first rank's abort frame first.
                Err(DdpError::Aborted { cause, .. }) => {
                    assert!(cause.contains("mismatch"), "{cause}")
                }
                other => panic!("rank {rank}: expected a mismatch, got {other:?}"),
            }
        }
    }

    #[test]
    fn a_closed_peer_is_named_and_aborts_propagate() {
        let results = run(3, |g| {
            if g.rank() == 2 {
                drop(g);
                return None;
            }
            let started = Instant::now();
            let result = g.barrier(Duration::from_secs(30));
            Some((result, started.elapsed()))
        });
        for (rank, result) in results.into_iter().take(2).enumerate() {
            let (result, elapsed) = result.unwrap();
            assert!(
                elapsed < Duration::from_secs(5),
                "rank {rank} waited {elapsed:?}"
            );
            match result {
                Err(DdpError::PeerLeft { peer: 2, .. }) => {}
                Err(DdpError::Aborted { cause, .. }) => {
                    assert!(cause.contains("rank 2"), "{cause}")
                }
                other => panic!("rank {rank}: expected rank 2 to be named, got {other:?}"),
            }
        }
    }

    #[test]
    fn an_abort_reaches_peers_that_run_no_tcp_collective() {
        // As under NCCL: rank 1 aborts while rank 0 only polls `aborted()` (bounded wait).
        let (seen_tx, seen_rx) = std::sync::mpsc::channel::<()>();
        let seen_rx = Mutex::new(seen_rx);
        let results = run(2, |g| {
            if g.rank() == 1 {
                g.abort("boom");
                // Stay in the group (and the store up) until rank 0 has seen it.
                if let Ok(rx) = seen_rx.lock() {
                    let _ = rx.recv_timeout(Duration::from_secs(30));
                }
                return g.aborted();
            }
            let deadline = Instant::now() + Duration::from_secs(20);
            let mut seen = None;
            while seen.is_none() && Instant::now() < deadline {
                seen = g.aborted();
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = seen_tx.send(());
            seen
        });
        for (rank, reason) in results.iter().enumerate() {
            let reason = reason
                .as_deref()
                .unwrap_or_else(|| panic!("rank {rank} saw no abort"));
            assert!(
                reason.contains("rank 1 aborted the group: boom"),
                "{reason}"
            );
        }
    }

    #[test]
    fn a_silent_peer_times_out_naming_it() {
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let done_rx = Mutex::new(done_rx);
        let results = run(2, |g| {
            if g.rank() == 1 {
                // Silent, but connected, until rank 0's barrier is over.
                if let Ok(rx) = done_rx.lock() {
                    let _ = rx.recv_timeout(Duration::from_secs(30));
                }
                return None;
            }
            let started = Instant::now();
            let result = g.barrier(Duration::from_millis(500));
            let _ = done_tx.send(());
            Some((result, started.elapsed()))
        });
        let (result, elapsed) = results[0].as_ref().unwrap();
        // The 0.5 s timeout, with room for a loaded machine.
        assert!(*elapsed >= Duration::from_millis(500), "{elapsed:?}");
        assert!(*elapsed < Duration::from_secs(10), "{elapsed:?}");
        match result {
            Err(DdpError::Timeout { missing, .. }) => assert_eq!(missing, &vec![1]),
            other => panic!("expected a timeout naming rank 1, got {other:?}"),
        }
    }
}
