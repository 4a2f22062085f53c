//! [`TcpGroup`]: ranks that are processes (on one machine or many), connected by TCP: what Gloo
//! is to PyTorch. For CPU clusters, and how the multi-process path is tested without GPUs.
//!
//! The rooms: [`connect`] sets the group up (rendezvous, one connection per pair of ranks, a
//! handshake); [`wire`] is what travels (frames) and how (all of a collective's sends and
//! receives progressed together over non-blocking sockets by one thread, no thread spawned and
//! nothing allocated per call); this file holds the collectives.
//!
//! # All-reduce
//! Ring reduce-scatter then ring all-gather, in `world_size` chunks: each rank sends and receives
//! `2 (N-1)/N` of the buffer. Chunk `c` is summed in the order `c, c+1, ..., c-1` (ranks mod `N`),
//! the same order as [`ThreadGroup`](super::ThreadGroup), so both groups give the same bits, and
//! each element is summed once, so every rank gets the same bits. A chunk is added into the
//! rank's own as its bytes arrive, while the rest is still on the wire. 16-bit all-reduces
//! ([`ExtendedCollectives::all_reduce_half`](crate::group::ExtendedCollectives::all_reduce_half)) send half the bytes; each hop adds in `f32` and rounds to
//! the 16-bit format.
//!
//! # Failures
//! A receiver checks every frame's header against its own call, so ranks that call different
//! collectives get [`CommError::Mismatch`] instead of misreading each other's bytes. A rank that
//! gives up sends an abort frame with its reason to every peer, leaves it in the rendezvous
//! store (for collectives that do not read these sockets: NCCL's) and closes its connections, so
//! a failure spreads from rank to rank within one hop.
//!
//! Payloads are sent in the machine's byte order: all ranks must share it (x86-64 and AArch64 are
//! little-endian).

mod accept;
mod connect;
mod dial;
mod wire;

pub use connect::TcpGroupOptions;

use std::sync::Mutex;
use std::time::{Duration, Instant};

use bytemuck::Pod;

use super::call::{Call, Calls, finish_average};
use super::extension::check_blocks;
use super::{Collective, HalfFloat, Native, ProcessGroup, ReduceOp, lock};
use crate::error::{CommError, Result};
use crate::group::chunk_range;
use crate::rendezvous::Rendezvous;
use wire::{Incoming, Outgoing, Peer, Streams};

/// The variable naming the network interface whose address ranks listen on and publish (like
/// NCCL's `NCCL_SOCKET_IFNAME`, Gloo's `GLOO_SOCKET_IFNAME`): for hosts where the interface that
/// reaches the store is not the one other nodes reach this host on.
pub const SOCKET_IFNAME_VAR: &str = "BURN_DDP_SOCKET_IFNAME";

/// How often [`ProcessGroup::aborted`] asks the rendezvous store whether a peer aborted (a
/// round trip to the store; collectives that run outside TCP, NCCL's, poll it while they wait).
const ABORT_POLL_INTERVAL: Duration = Duration::from_millis(100);

/// One rank of a process group whose ranks are processes connected by TCP.
pub struct TcpGroup {
    rank: usize,
    world_size: usize,
    /// The sequence numbers and the abort's reason.
    calls: Calls,
    peers: Vec<Option<Peer>>,
    rendezvous: Option<Rendezvous>,
    /// When the store was last asked for an abort (see [`ABORT_POLL_INTERVAL`]).
    abort_polled: Mutex<Option<Instant>>,
    /// Where a ring all-reduce receives its peer's partial sums, kept between calls (8-byte
    /// words, so it can hold any element type).
    scratch: Mutex<Vec<u64>>,
}

impl TcpGroup {
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
        self.calls.begin(self.rank, op, timeout)
    }

    fn next(&self) -> usize {
        (self.rank + 1) % self.world_size
    }

    fn prev(&self) -> usize {
        (self.rank + self.world_size - 1) % self.world_size
    }

    /// Runs one collective's body; on failure, aborts the group (telling every peer why). A peer
    /// that left after aborting the group (its reason is in the store) is reported with that
    /// reason: the closed connection can reach this rank before the abort frame does.
    fn run<T>(&self, call: Call, body: impl FnOnce() -> Result<T>) -> Result<T> {
        let mut result = body();
        if let Err(CommError::PeerLeft { rank, op, seq, .. }) = &result
            && let Some(rendezvous) = &self.rendezvous
            && let Ok(reason) = rendezvous
                .store
                .get(&Self::abort_key(rendezvous), Duration::from_millis(200))
        {
            result = Err(CommError::Aborted {
                rank: *rank,
                op: *op,
                seq: *seq,
                cause: String::from_utf8_lossy(&reason).into_owned(),
            });
        }
        if let Err(err) = &result {
            self.abort_with(&err.to_string(), call);
        }
        result
    }

    /// The ring all-reduce of [`ProcessGroup::all_reduce`], for any element type:
    /// `combine(partial, own)` adds an earlier rank's partial sum to this rank's value, and
    /// `finish`, when given, turns a complete sum into the result (the average).
    fn ring<E: Pod>(
        &self,
        call: &Call,
        bucket: &mut [E],
        combine: impl Fn(E, E) -> E,
        finish: Option<&dyn Fn(E) -> E>,
    ) -> Result<()> {
        let n = self.world_size;
        let len = bucket.len();
        let size = std::mem::size_of::<E>();
        let (next, prev) = (self.next(), self.prev());
        let chunk = |c: usize| chunk_range(len, n, c % n);
        let mut scratch = lock(&self.scratch);
        let words = (len.div_ceil(n) * size).div_ceil(8);
        if scratch.len() < words {
            scratch.resize(words, 0);
        }
        let scratch: &mut [u8] = bytemuck::cast_slice_mut(&mut scratch[..]);
        let mut streams = Streams::lock(&self.peers, &[next, prev]);
        // Reduce-scatter: at step s, send chunk r - s, receive chunk r - s - 1 and add ours.
        for step in 0..n - 1 {
            let send = chunk(self.rank + n - step);
            let recv = chunk(self.rank + n - step - 1);
            let incoming = &mut scratch[..recv.len() * size];
            let (outgoing, own) = split_pair(bucket, send, recv);
            let mut sends = [Outgoing::new(call, next, bytemuck::cast_slice(outgoing))];
            let mut receives = [Incoming::new(prev, incoming)];
            let mut added = 0;
            streams.transfer(call, &mut sends, &mut receives, |_, arrived| {
                // (earlier ranks' partial sum) + this rank's value, element by element as
                // whole elements arrive: the order c, c+1, ..., with the operands in
                // ThreadGroup's order (that matters only for NaN payloads, but keeps the bits
                // identical).
                let complete = arrived.len() / size;
                if complete <= added {
                    return;
                }
                let bytes = &arrived[added * size..complete * size];
                let own = &mut own[added..complete];
                // The scratch is 8-byte aligned, so the elements can be read in place (a loop
                // the compiler vectorises); the unaligned path is a fallback.
                match bytemuck::try_cast_slice::<u8, E>(bytes) {
                    Ok(partials) => {
                        for (own, &partial) in own.iter_mut().zip(partials) {
                            *own = combine(partial, *own);
                        }
                    }
                    Err(_) => {
                        for (own, bytes) in own.iter_mut().zip(bytes.chunks_exact(size)) {
                            *own = combine(bytemuck::pod_read_unaligned(bytes), *own);
                        }
                    }
                }
                added = complete;
            })?;
        }
        // This rank now holds chunk r + 1 complete.
        if let Some(finish) = finish {
            bucket[chunk(self.rank + 1)]
                .iter_mut()
                .for_each(|v| *v = finish(*v));
        }
        // All-gather: at step s, send chunk r + 1 - s, receive chunk r - s.
        for step in 0..n - 1 {
            let send = chunk(self.rank + 1 + n - step);
            let recv = chunk(self.rank + n - step);
            let (outgoing, incoming) = split_pair(bucket, send, recv);
            let mut sends = [Outgoing::new(call, next, bytemuck::cast_slice(outgoing))];
            let mut receives = [Incoming::new(prev, bytemuck::cast_slice_mut(incoming))];
            streams.transfer(call, &mut sends, &mut receives, |_, _| {})?;
        }
        Ok(())
    }

    /// The direct exchange of the `f32` all-gather and reduce-scatter: every other rank `p` is
    /// sent `outgoing(p)` (`len` values), and rank `p`'s values arrive in block `p` of `incoming`
    /// (blocks of `len`; this rank's block is left alone). With `len` 0 only the headers travel
    /// (the peers still compare the calls).
    fn exchange_blocks<'a>(
        &self,
        call: &Call,
        outgoing: impl Fn(usize) -> &'a [f32],
        incoming: &mut [f32],
        len: usize,
    ) -> Result<()> {
        if len == 0 {
            return self.gather_bytes(call, &[]).map(drop);
        }
        let others = self.others();
        let mut sends: Vec<Outgoing<'_>> = others
            .iter()
            .map(|&p| Outgoing::new(call, p, bytemuck::cast_slice(outgoing(p))))
            .collect();
        let mut receives: Vec<Incoming<'_>> = incoming
            .chunks_mut(len)
            .enumerate()
            .filter(|(p, _)| *p != self.rank)
            .map(|(p, block)| Incoming::new(p, bytemuck::cast_slice_mut(block)))
            .collect();
        Streams::lock(&self.peers, &others).transfer(call, &mut sends, &mut receives, |_, _| {})
    }

    /// Every rank but this one.
    fn others(&self) -> Vec<usize> {
        (0..self.world_size).filter(|&p| p != self.rank).collect()
    }

    /// Every rank sends `mine` to every other rank; returns all ranks' bytes, rank-major.
    fn gather_bytes(&self, call: &Call, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        let n = self.world_size;
        let others = self.others();
        let mut parts: Vec<Vec<u8>> = (0..n)
            .map(|p| {
                if p == self.rank {
                    mine.to_vec()
                } else {
                    vec![0u8; mine.len()]
                }
            })
            .collect();
        let mut streams = Streams::lock(&self.peers, &others);
        let mut sends: Vec<Outgoing<'_>> = others
            .iter()
            .map(|&p| Outgoing::new(call, p, mine))
            .collect();
        let mut receives: Vec<Incoming<'_>> = parts
            .iter_mut()
            .enumerate()
            .filter(|(p, _)| *p != self.rank)
            .map(|(p, part)| Incoming::new(p, part))
            .collect();
        streams.transfer(call, &mut sends, &mut receives, |_, _| {})?;
        drop(receives);
        Ok(parts)
    }

    fn abort_with(&self, reason: &str, call: Call) {
        if !self.calls.abort(reason) {
            return;
        }
        // Peers whose collectives do not read these sockets (NCCL's) look in the store.
        if let Some(rendezvous) = &self.rendezvous {
            let _ = rendezvous
                .store
                .set(&Self::abort_key(rendezvous), reason.as_bytes());
        }
        for peer in self.peers.iter().flatten() {
            // Peers blocked on this connection see the abort frame, then the end of stream.
            peer.send_abort(&call, reason);
        }
    }
}

/// `buf[a]` to read and `buf[b]` to write, for disjoint ranges.
fn split_pair<E>(
    buf: &mut [E],
    a: std::ops::Range<usize>,
    b: std::ops::Range<usize>,
) -> (&[E], &mut [E]) {
    if a.start < b.start {
        let (left, right) = buf.split_at_mut(b.start);
        (&left[a], &mut right[..b.len()])
    } else {
        let (left, right) = buf.split_at_mut(a.start);
        (&right[..a.len()], &mut left[b])
    }
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
        let call = self.begin(
            Collective::AllReduce {
                op,
                len: bucket.len(),
            },
            timeout,
        )?;
        if self.world_size == 1 {
            return Ok(());
        }
        let divisor = self.world_size as f32;
        let average = |v: f32| v / divisor;
        let finish: Option<&dyn Fn(f32) -> f32> = (op == ReduceOp::Avg).then_some(&average);
        self.run(call, || {
            self.ring(
                &call,
                bucket,
                |partial: f32, own: f32| partial + own,
                finish,
            )
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
            let err = CommError::InvalidConfig(format!(
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
                let others: Vec<usize> = (0..n).filter(|&p| p != root).collect();
                let payload: &[u8] = bytemuck::cast_slice(buffer);
                let mut sends: Vec<Outgoing<'_>> = others
                    .iter()
                    .map(|&p| Outgoing::new(&call, p, payload))
                    .collect();
                Streams::lock(&self.peers, &others).transfer(&call, &mut sends, &mut [], |_, _| {})
            } else {
                let mut receives = [Incoming::new(root, bytemuck::cast_slice_mut(buffer))];
                Streams::lock(&self.peers, &[root]).transfer(
                    &call,
                    &mut [],
                    &mut receives,
                    |_, _| {},
                )
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
                out.extend(part.chunks_exact(8).map(wire::word));
            }
            Ok(out)
        })
    }

    fn abort(&self, reason: &str) {
        let call = Call::new(
            self.rank,
            self.calls.peek(),
            Collective::Barrier,
            Duration::ZERO,
        );
        self.abort_with(
            &format!("rank {} aborted the group: {reason}", self.rank),
            call,
        );
    }

    /// This rank's abort, a peer's abort frame read during a collective, or, at most every
    /// 100 ms, a peer's abort left in the rendezvous store (an unreachable store tells nothing).
    fn aborted(&self) -> Option<String> {
        if let Some(reason) = self.calls.aborted() {
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
        self.calls.abort(&String::from_utf8_lossy(&reason));
        self.calls.aborted()
    }

    fn native(&self) -> Option<&dyn Native> {
        Some(self)
    }
}

impl crate::group::Sealed for TcpGroup {}

impl Native for TcpGroup {
    fn all_reduce_half(
        &self,
        bucket: &mut [u16],
        format: HalfFloat,
        op: ReduceOp,
        timeout: Duration,
    ) -> Result<()> {
        let call = self.begin(
            Collective::AllReduceHalf {
                op,
                len: bucket.len(),
                format,
            },
            timeout,
        )?;
        if self.world_size == 1 {
            return Ok(());
        }
        let divisor = self.world_size as f32;
        let average = |v: u16| format.from_f32(format.to_f32(v) / divisor);
        let finish: Option<&dyn Fn(u16) -> u16> = (op == ReduceOp::Avg).then_some(&average);
        self.run(call, || {
            self.ring(
                &call,
                bucket,
                |partial: u16, own: u16| {
                    format.from_f32(format.to_f32(partial) + format.to_f32(own))
                },
                finish,
            )
        })
    }

    /// `send` goes to every peer directly (as [`all_gather`](ProcessGroup::all_gather)'s
    /// values): each rank sends and receives `(N - 1) * L` values, as in a ring.
    fn all_gather_f32(&self, send: &[f32], recv: &mut [f32], timeout: Duration) -> Result<()> {
        let len = send.len();
        check_blocks(self, "all_gather_f32", len, recv.len())?;
        let call = self.begin(Collective::AllGatherF32 { len }, timeout)?;
        let rank = self.rank;
        recv[rank * len..(rank + 1) * len].copy_from_slice(send);
        if self.world_size == 1 {
            return Ok(());
        }
        self.run(call, || self.exchange_blocks(&call, |_| send, recv, len))
    }

    /// Block `p` of `send` goes to rank `p` directly; this rank sums the blocks it receives in
    /// the order `r, r + 1, ..., r - 1`, the order of [`all_reduce`](ProcessGroup::all_reduce)'s
    /// ring (and of `ThreadGroup`), so the bits agree with theirs.
    fn reduce_scatter(
        &self,
        send: &[f32],
        recv: &mut [f32],
        op: ReduceOp,
        timeout: Duration,
    ) -> Result<()> {
        let len = recv.len();
        check_blocks(self, "reduce_scatter", len, send.len())?;
        let call = self.begin(Collective::ReduceScatter { op, len }, timeout)?;
        let (rank, n) = (self.rank, self.world_size);
        recv.copy_from_slice(&send[rank * len..(rank + 1) * len]);
        if n == 1 {
            return Ok(());
        }
        self.run(call, || {
            // The peers' blocks arrive in the scratch kept between calls: a fresh buffer of the
            // gradients' size every step would be faulted in again each time.
            let mut scratch = lock(&self.scratch);
            let words = (n * len).div_ceil(2);
            if scratch.len() < words {
                scratch.resize(words, 0);
            }
            let blocks = &mut bytemuck::cast_slice_mut::<u64, f32>(&mut scratch[..])[..n * len];
            self.exchange_blocks(&call, |p| &send[p * len..(p + 1) * len], blocks, len)?;
            for i in 1..n {
                let p = (rank + i) % n;
                for (own, theirs) in recv.iter_mut().zip(&blocks[p * len..(p + 1) * len]) {
                    *own += *theirs;
                }
            }
            finish_average(recv, op, n);
            Ok(())
        })
    }
}

impl Drop for TcpGroup {
    fn drop(&mut self) {
        for peer in self.peers.iter().flatten() {
            peer.shut_down();
        }
    }
}

impl std::fmt::Debug for TcpGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpGroup")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("next_seq", &self.calls.peek())
            .finish()
    }
}

/// `n` ranks of a loopback `TcpGroup` (connected on one thread each) and the store they met
/// through, served by the test on a port the system picked (no free-port race). For the
/// crate's unit tests.
#[cfg(any(test, feature = "test-support"))]
pub fn loopback_groups(
    n: usize,
    connect_timeout: Duration,
) -> (crate::store::StoreServer, Vec<TcpGroup>) {
    loopback_groups_at(n, connect_timeout, "127.0.0.1")
}

/// Rank `rank` of `n` meeting through the store at `host:port`, as the tests' job.
#[cfg(any(test, feature = "test-support"))]
pub(crate) fn test_topology(
    rank: usize,
    n: usize,
    host: &str,
    port: u16,
) -> crate::topology::Topology {
    crate::topology::Topology {
        rank,
        world_size: n,
        local_rank: rank,
        local_world_size: n,
        master_addr: host.into(),
        master_port: port,
        agent_store: true,
        restart_count: 0,
        source: crate::topology::TopologySource::Torchrun,
    }
}

/// [`loopback_groups`] with the store at `host` (`::1` for IPv6).
#[cfg(any(test, feature = "test-support"))]
pub(crate) fn loopback_groups_at(
    n: usize,
    connect_timeout: Duration,
    host: &str,
) -> (crate::store::StoreServer, Vec<TcpGroup>) {
    let server = crate::store::StoreServer::bind(
        crate::store::bind_address(host, 0, false).unwrap(),
        &crate::auth::test_job(),
    )
    .unwrap();
    let port = server.local_addr().port();
    let groups = std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|rank| {
                s.spawn(move || {
                    TcpGroup::connect(
                        &test_topology(rank, n, host, port),
                        &TcpGroupOptions {
                            connect_timeout,
                            job: Some(crate::auth::test_job()),
                        },
                    )
                    .unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    (server, groups)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::group::ThreadGroup;
    use std::net::SocketAddr;

    const T: Duration = Duration::from_secs(20);

    /// Runs `f(group)` for every rank of a loopback TcpGroup, one thread per rank.
    fn run<R: Send>(n: usize, f: impl Fn(TcpGroup) -> R + Sync) -> Vec<R> {
        let (_server, groups) = loopback_groups(n, T);
        std::thread::scope(|s| {
            let f = &f;
            let handles: Vec<_> = groups
                .into_iter()
                .map(|group| s.spawn(move || f(group)))
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
    fn a_topology_without_a_store_address_is_refused_naming_master_addr() {
        // What `Topology::from_env` gives under mpirun (feature `mpi`) without MASTER_ADDR.
        let topology = crate::topology::Topology {
            rank: 0,
            world_size: 2,
            local_rank: 0,
            local_world_size: 2,
            master_addr: String::new(),
            master_port: 29500,
            agent_store: false,
            restart_count: 0,
            source: crate::topology::TopologySource::OpenMpi,
        };
        let started = Instant::now();
        let err = TcpGroup::connect(
            &topology,
            &TcpGroupOptions {
                connect_timeout: T,
                job: Some(crate::auth::test_job()),
            },
        )
        .unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(1));
        assert!(
            matches!(&err, CommError::Topology(m) if m.contains("MASTER_ADDR is not set")),
            "{err}"
        );
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
                Err(CommError::Mismatch { peer, .. }) => assert_ne!(*peer, rank),
                // The other rank may read the first rank's abort frame first.
                Err(CommError::Aborted { cause, .. }) => {
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
                Err(CommError::PeerLeft { peer: 2, .. }) => {}
                Err(CommError::Aborted { cause, .. }) => {
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
            Err(CommError::Timeout { missing, .. }) => assert_eq!(missing, &vec![1]),
            other => panic!("expected a timeout naming rank 1, got {other:?}"),
        }
    }

    #[test]
    fn ranks_meet_over_ipv6_loopback() {
        if std::net::TcpListener::bind("[::1]:0").is_err() {
            // A machine without an IPv6 loopback cannot run this; every other test covers IPv4.
            eprintln!("skipped: this machine has no IPv6 loopback");
            return;
        }
        let (_server, groups) = loopback_groups_at(2, T, "::1");
        let sums: Vec<Vec<f32>> = std::thread::scope(|s| {
            let handles: Vec<_> = groups
                .into_iter()
                .map(|g| {
                    s.spawn(move || {
                        let mut v = vec![g.rank() as f32 + 1.0; 3];
                        g.all_reduce(&mut v, ReduceOp::Sum, T).unwrap();
                        v
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(sums, vec![vec![3.0; 3]; 2]);
    }

    /// Rank 0 waits for rank 1 while `strangers` connect to its published address; then rank 1
    /// comes. Returns the two ranks' sums of an all-reduce.
    fn with_strangers_at_rank_0(strangers: impl FnOnce(SocketAddr)) -> Vec<Vec<f32>> {
        let server = crate::store::StoreServer::bind(
            "127.0.0.1:0".parse().unwrap(),
            &crate::auth::test_job(),
        )
        .unwrap();
        let port = server.local_addr().port();
        let connect = move |rank| {
            let g = TcpGroup::connect(
                &test_topology(rank, 2, "127.0.0.1", port),
                &TcpGroupOptions {
                    connect_timeout: T,
                    job: Some(crate::auth::test_job()),
                },
            )
            .unwrap();
            let mut v = vec![rank as f32 + 1.0; 4];
            g.all_reduce(&mut v, ReduceOp::Sum, T).unwrap();
            v
        };
        std::thread::scope(|s| {
            let rank0 = s.spawn(move || connect(0));
            // Rank 0's address, as a member of the job reads it.
            let store = crate::store::StoreClient::connect(
                &format!("127.0.0.1:{port}"),
                T,
                &crate::auth::test_job(),
                crate::auth::Role::Worker,
            )
            .unwrap();
            let info = store.get("burn-ddp/round-0/rank/0/info", T).unwrap();
            let info = String::from_utf8(info).unwrap();
            let addr: SocketAddr = info.split(' ').nth(1).unwrap().parse().unwrap();
            strangers(addr);
            let rank1 = s.spawn(move || connect(1));
            vec![rank0.join().unwrap(), rank1.join().unwrap()]
        })
    }

    #[test]
    fn strangers_at_a_ranks_port_are_refused_and_the_job_connects() {
        use std::io::Write;
        let mut silent = Vec::new();
        let sums = with_strangers_at_rank_0(|addr| {
            // A connection that never speaks, and the old public hello of a would-be rank 1.
            silent.push(std::net::TcpStream::connect(addr).unwrap());
            let mut hello = std::net::TcpStream::connect(addr).unwrap();
            let _ = hello.write_all(&[0x50, 0x50, 0x44, 0x42, 2, 0, 0, 0, 2, 0, 0, 0, 1, 0, 0, 0]);
            // A process with another token, claiming rank 1 properly otherwise.
            let intruder = crate::auth::JobIdentity::new("unit-tests", Some(b"guess")).unwrap();
            let mut claim = std::net::TcpStream::connect(addr).unwrap();
            let refused = crate::auth::connect(
                &mut claim,
                &intruder,
                crate::auth::Service::Group,
                crate::auth::Role::Worker,
                &super::dial::tests_context(1, 2, 0),
                Duration::from_secs(5),
            );
            assert!(refused.is_err(), "an intruder passed: {refused:?}");
        });
        assert_eq!(sums, vec![vec![3.0; 4]; 2]);
        drop(silent);
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig {
            cases: std::env::var("BURN_DDP_FUZZ_CASES")
                .ok()
                .and_then(|c| c.parse().ok())
                .unwrap_or(8),
            ..proptest::prelude::ProptestConfig::default()
        })]

        /// Random and truncated frames at a rank's port during set-up never stop the job.
        #[test]
        fn random_frames_at_a_ranks_port_never_stop_the_job(
            frames in proptest::collection::vec(
                proptest::collection::vec(proptest::prelude::any::<u8>(), 0..96),
                1..4,
            ),
        ) {
            use std::io::Write;
            let sums = with_strangers_at_rank_0(|addr| {
                for frame in &frames {
                    if let Ok(mut stream) = std::net::TcpStream::connect(addr) {
                        let _ = stream.write_all(frame);
                    }
                }
            });
            proptest::prop_assert_eq!(sums, vec![vec![3.0f32; 4]; 2]);
        }
    }
}
