//! [`ThreadGroup`]: ranks that are threads of one process, reducing through shared memory.
//!
//! # How a collective runs
//!
//! Each rank posts its call (operation, sequence number, buffer address) and waits at a phase
//! barrier. Once all have arrived, each rank checks that every rank posted the same call, then works
//! directly on its peers' buffers, which stay alive because their owners are parked in the same
//! collective:
//!
//! - all-reduce (reduce-scatter and all-gather fused, through memory): rank `r` reduces chunk `r`
//!   of every rank's buffer, adding in the order `r, r+1, ..., r-1` (mod N, the order a ring
//!   all-reduce gives, so [`TcpGroup`](super::TcpGroup) computes the same bits), and writes the
//!   result into chunk `r` of every rank's buffer, block by block. Each element is computed once,
//!   so all ranks hold the same bits; the work is spread over all ranks' cores, and each rank
//!   moves as many bytes as one memcpy of the buffer (S in, S out).
//! - broadcast: non-root ranks copy the root's buffer.
//! - all-gather: every rank copies every rank's values.
//!
//! A rank only leaves a collective early (timeout, peer left, abort) once no peer is still
//! reading or writing its buffer (the `busy` count), so no buffer is touched after its owner
//! returned.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

mod reduce;

use super::call::Call;
use super::extension::check_blocks;
use super::{Collective, Native, ProcessGroup, ReduceOp};
use crate::error::{CommError, Result};
use crate::group::chunk_range;
use reduce::{reduce_into, reduce_range};

/// One rank of a process group whose ranks are threads of the same process.
///
/// Create all ranks at once with [`ThreadGroup::new_group`] and move one handle to each thread.
/// Dropping a handle (its thread ended or panicked) makes the other ranks' pending and future
/// collectives fail with [`CommError::PeerLeft`] naming it.
pub struct ThreadGroup {
    rank: usize,
    seq: AtomicU64,
    shared: Arc<Shared>,
}

struct Shared {
    world_size: usize,
    state: Mutex<State>,
    changed: Condvar,
}

struct State {
    /// The call each rank posted for its current collective.
    posted: Vec<Option<Posted>>,
    /// Ranks that arrived at the current phase barrier.
    arrived: Vec<bool>,
    arrived_count: usize,
    /// Number of completed phase barriers; waiters watch it change.
    generation: u64,
    /// Ranks still reading peers' buffers in the current data phase.
    busy: usize,
    /// Sequence number of the last collective each rank entered.
    last_seen: Vec<Option<u64>>,
    /// Why a rank left the group, once it has.
    left: Vec<Option<String>>,
    /// Why the group was aborted, once it has been.
    aborted: Option<String>,
}

#[derive(Clone, Copy)]
struct Posted {
    seq: u64,
    op: Collective,
    /// Address of the rank's buffer (`f32` or `u64` depending on `op`).
    addr: usize,
}

/// What comes after a phase barrier.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Next {
    /// Ranks read each other's buffers until the next barrier.
    Data,
    /// Nobody reads peers' buffers (the collective ends, or only local work follows).
    Local,
}

impl ThreadGroup {
    /// Creates the `world_size` ranks of a new group; element `r` of the result is rank `r`.
    ///
    /// # Errors
    /// [`CommError::InvalidConfig`] when `world_size` is 0.
    pub fn new_group(world_size: usize) -> Result<Vec<ThreadGroup>> {
        if world_size == 0 {
            return Err(CommError::InvalidConfig(
                "a ThreadGroup needs a world size of at least 1, got 0".into(),
            ));
        }
        let shared = Arc::new(Shared {
            world_size,
            state: Mutex::new(State {
                posted: vec![None; world_size],
                arrived: vec![false; world_size],
                arrived_count: 0,
                generation: 0,
                busy: 0,
                last_seen: vec![None; world_size],
                left: vec![None; world_size],
                aborted: None,
            }),
            changed: Condvar::new(),
        });
        Ok((0..world_size)
            .map(|rank| ThreadGroup {
                rank,
                seq: AtomicU64::new(0),
                shared: shared.clone(),
            })
            .collect())
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A poisoned lock means a thread panicked while holding it; every operation under the lock
        // leaves the state consistent, so keep going with it.
        self.shared
            .state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn begin(&self, op: Collective, timeout: Duration) -> Call {
        Call::new(
            self.rank,
            self.seq.fetch_add(1, Ordering::Relaxed),
            op,
            timeout,
        )
    }

    /// Posts this rank's call and waits until every rank has posted, then checks the calls match.
    fn post_and_match(&self, call: Call, addr: usize, next: Next) -> Result<MutexGuard<'_, State>> {
        let mut st = self.lock();
        if let Some(cause) = &st.aborted {
            return Err(aborted(call, cause));
        }
        if let Some((peer, reason)) = first_gone(&st) {
            let err = peer_left(call, peer, reason);
            abort_locked(&mut st, &err.to_string());
            self.shared.changed.notify_all();
            return Err(err);
        }
        st.posted[self.rank] = Some(Posted {
            seq: call.seq,
            op: call.op,
            addr,
        });
        st.last_seen[self.rank] = Some(call.seq);
        let st = self.phase_barrier(st, call, next, false)?;
        let mismatch = st
            .posted
            .iter()
            .enumerate()
            .find_map(|(peer, posted)| match posted {
                Some(p) if p.seq == call.seq && p.op == call.op => None,
                Some(p) => Some((peer, p.op, p.seq)),
                // Unreachable in practice: a rank is counted as arrived only after posting.
                None => Some((peer, Collective::Barrier, u64::MAX)),
            });
        if let Some((peer, peer_op, peer_seq)) = mismatch {
            let err = CommError::Mismatch {
                rank: self.rank,
                op: call.op,
                seq: call.seq,
                peer,
                peer_op,
                peer_seq,
            };
            // Every rank sees the same posted calls, so every rank stops here and nobody reads a
            // peer's buffer (the barrier left `busy` at 0 for a mismatch).
            let mut st = st;
            abort_locked(&mut st, &err.to_string());
            self.shared.changed.notify_all();
            return Err(err);
        }
        Ok(st)
    }

    /// Waits until all ranks arrive at the current phase barrier.
    ///
    /// `leaving_data`: this rank ends a data phase here (it no longer reads peers' buffers).
    /// `next`: whether ranks will read each other's buffers after this barrier.
    fn phase_barrier<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        call: Call,
        next: Next,
        leaving_data: bool,
    ) -> Result<MutexGuard<'a, State>> {
        let n = self.shared.world_size;
        if leaving_data {
            st.busy -= 1;
            if st.busy == 0 {
                self.shared.changed.notify_all();
            }
        }
        if let Some(cause) = st.aborted.clone() {
            return Err(self.leave_after_failure(st, aborted(call, &cause)));
        }
        st.arrived[self.rank] = true;
        st.arrived_count += 1;
        if st.arrived_count == n {
            st.arrived.iter_mut().for_each(|a| *a = false);
            st.arrived_count = 0;
            st.generation += 1;
            // Ranks only read each other's buffers when they all posted the same call; on a
            // mismatch every rank returns an error right after this barrier.
            st.busy = if next == Next::Data && calls_match(&st) {
                n
            } else {
                0
            };
            self.shared.changed.notify_all();
            return Ok(st);
        }
        let generation = st.generation;
        loop {
            if st.generation != generation {
                return Ok(st);
            }
            if let Some(cause) = st.aborted.clone() {
                withdraw(&mut st, self.rank);
                return Err(self.leave_after_failure(st, aborted(call, &cause)));
            }
            if let Some((peer, reason)) = first_gone(&st) {
                return Err(self.fail_at_barrier(st, peer_left(call, peer, reason)));
            }
            let now = Instant::now();
            match call.deadline {
                Some(deadline) if now >= deadline => {
                    let missing: Vec<usize> = (0..n).filter(|&peer| !st.arrived[peer]).collect();
                    let last_seen = missing
                        .iter()
                        .map(|&peer| (peer, st.last_seen[peer]))
                        .collect();
                    let err = call.timed_out(missing, last_seen);
                    return Err(self.fail_at_barrier(st, err));
                }
                Some(deadline) => {
                    st = self
                        .shared
                        .changed
                        .wait_timeout(st, deadline - now)
                        .unwrap_or_else(|poisoned| poisoned.into_inner())
                        .0;
                }
                None => {
                    st = self
                        .shared
                        .changed
                        .wait(st)
                        .unwrap_or_else(|poisoned| poisoned.into_inner());
                }
            }
        }
    }

    /// Ends a data phase: waits at the next phase barrier, which starts phase `next`.
    fn end_phase(&self, call: Call, next: Next) -> Result<()> {
        let st = self.lock();
        self.phase_barrier(st, call, next, true).map(drop)
    }

    /// Gives up a barrier that cannot complete: withdraws this rank's arrival, aborts the group
    /// with `err` and returns it once no peer reads this rank's buffer.
    fn fail_at_barrier(&self, mut st: MutexGuard<'_, State>, err: CommError) -> CommError {
        withdraw(&mut st, self.rank);
        abort_locked(&mut st, &err.to_string());
        self.shared.changed.notify_all();
        self.leave_after_failure(st, err)
    }

    /// Before a failing rank returns, waits until no peer still reads its buffer. Peers in a data
    /// phase only copy or add memory, so this wait is short and bounded.
    fn leave_after_failure(&self, mut st: MutexGuard<'_, State>, err: CommError) -> CommError {
        while st.busy > 0 {
            st = self
                .shared
                .changed
                .wait(st)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
        }
        err
    }

    /// The buffer addresses every rank posted for the current collective, indexed by rank.
    fn peer_addrs(st: &State) -> Vec<usize> {
        st.posted
            .iter()
            .map(|p| p.map(|p| p.addr).unwrap_or(0))
            .collect()
    }

    fn check_not_aborted(&self, call: Call) -> Result<()> {
        match &self.lock().aborted {
            Some(cause) => Err(aborted(call, cause)),
            None => Ok(()),
        }
    }
}

fn peer_left(call: Call, peer: usize, reason: String) -> CommError {
    CommError::PeerLeft {
        rank: call.rank,
        op: call.op,
        seq: call.seq,
        peer,
        reason,
    }
}

fn aborted(call: Call, cause: &str) -> CommError {
    call.aborted(cause.to_string())
}

/// The first rank that left the group without arriving at the current barrier, with why.
fn first_gone(st: &State) -> Option<(usize, String)> {
    st.left
        .iter()
        .enumerate()
        .find_map(|(peer, left)| match left {
            Some(reason) if !st.arrived[peer] => Some((peer, reason.clone())),
            _ => None,
        })
}

/// Whether every rank posted the same call as rank 0.
fn calls_match(st: &State) -> bool {
    let first = st.posted[0].map(|p| (p.seq, p.op));
    st.posted.iter().all(|p| p.map(|p| (p.seq, p.op)) == first)
}

fn abort_locked(st: &mut State, reason: &str) {
    if st.aborted.is_none() {
        st.aborted = Some(reason.to_string());
    }
}

/// Takes back this rank's arrival at a barrier that will not complete.
fn withdraw(st: &mut State, rank: usize) {
    if st.arrived[rank] {
        st.arrived[rank] = false;
        st.arrived_count -= 1;
    }
}

impl ProcessGroup for ThreadGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world_size
    }

    fn backend(&self) -> &'static str {
        "threads"
    }

    fn all_reduce(&self, bucket: &mut [f32], op: ReduceOp, timeout: Duration) -> Result<()> {
        let n = self.shared.world_size;
        let len = bucket.len();
        let call = self.begin(Collective::AllReduce { op, len }, timeout);
        if n == 1 {
            // Sum and average over one rank are the identity.
            return self.check_not_aborted(call);
        }
        // From here on the buffer is only accessed through `own`, as peers access it too.
        let own = bucket.as_mut_ptr();
        let st = self.post_and_match(call, own as usize, Next::Data)?;
        let addrs = Self::peer_addrs(&st);
        drop(st);

        // One data phase: this rank reduces chunk `rank` of every buffer and writes the result
        // into chunk `rank` of every buffer (reduce-scatter and all-gather fused). Each rank
        // moves S/N elements in and S/N out per buffer: 2S in all, like one memcpy of the
        // bucket, where a separate all-gather phase would add another S/N copy per peer.
        // SAFETY: all ranks posted buffers of `len` elements (checked by `post_and_match`) and are
        // parked in this collective until the barrier that ends this phase; in it rank `r` reads
        // and writes chunk `r` of every buffer only, and the chunks do not overlap.
        unsafe { reduce_range(&addrs, self.rank, chunk_range(len, n, self.rank), op) };
        self.end_phase(call, Next::Local)
    }

    fn broadcast(&self, buffer: &mut [f32], root: usize, timeout: Duration) -> Result<()> {
        let n = self.shared.world_size;
        let len = buffer.len();
        let call = self.begin(Collective::Broadcast { root, len }, timeout);
        if root >= n {
            let err = CommError::InvalidConfig(format!(
                "broadcast #{} on rank {}: root {root} is not below the world size {n}",
                call.seq, self.rank
            ));
            // The peers must not wait for a broadcast this rank will never join.
            self.abort(&err.to_string());
            return Err(err);
        }
        if n == 1 {
            return self.check_not_aborted(call);
        }
        let own = buffer.as_mut_ptr();
        let st = self.post_and_match(call, own as usize, Next::Data)?;
        let root_addr = Self::peer_addrs(&st)[root];
        drop(st);
        if self.rank != root {
            // SAFETY: the root's buffer has `len` elements (checked), is only read in this phase,
            // and stays alive until the last barrier; `own` is this rank's exclusive buffer.
            unsafe { std::ptr::copy_nonoverlapping(root_addr as *const f32, own, len) };
        }
        self.end_phase(call, Next::Local)
    }

    fn barrier(&self, timeout: Duration) -> Result<()> {
        let call = self.begin(Collective::Barrier, timeout);
        if self.shared.world_size == 1 {
            return self.check_not_aborted(call);
        }
        let st = self.post_and_match(call, 0, Next::Local)?;
        // A second phase so that no rank posts its next call before every rank checked this one.
        self.phase_barrier(st, call, Next::Local, false).map(drop)
    }

    fn all_gather(&self, values: &[u64], timeout: Duration) -> Result<Vec<u64>> {
        let n = self.shared.world_size;
        let len = values.len();
        let call = self.begin(Collective::AllGather { len }, timeout);
        if n == 1 {
            self.check_not_aborted(call)?;
            return Ok(values.to_vec());
        }
        let st = self.post_and_match(call, values.as_ptr() as usize, Next::Data)?;
        let addrs = Self::peer_addrs(&st);
        drop(st);
        let mut out = Vec::with_capacity(n * len);
        for &addr in &addrs {
            // SAFETY: every rank posted `len` values (checked) that stay alive and unchanged until
            // the last barrier of this collective.
            out.extend_from_slice(unsafe { std::slice::from_raw_parts(addr as *const u64, len) });
        }
        self.end_phase(call, Next::Local)?;
        Ok(out)
    }

    fn abort(&self, reason: &str) {
        let mut st = self.lock();
        abort_locked(
            &mut st,
            &format!("rank {} aborted the group: {reason}", self.rank),
        );
        self.shared.changed.notify_all();
    }

    fn aborted(&self) -> Option<String> {
        self.lock().aborted.clone()
    }

    fn native(&self) -> Option<&dyn Native> {
        Some(self)
    }
}

impl super::Sealed for ThreadGroup {}

impl Native for ThreadGroup {
    fn all_gather_f32(&self, send: &[f32], recv: &mut [f32], timeout: Duration) -> Result<()> {
        let len = send.len();
        check_blocks(self, "all_gather_f32", len, recv.len())?;
        let call = self.begin(Collective::AllGatherF32 { len }, timeout);
        let n = self.shared.world_size;
        if n == 1 {
            recv.copy_from_slice(send);
            return self.check_not_aborted(call);
        }
        let st = self.post_and_match(call, send.as_ptr() as usize, Next::Data)?;
        let addrs = Self::peer_addrs(&st);
        drop(st);
        for (block, &addr) in recv.chunks_mut(len.max(1)).zip(&addrs) {
            // SAFETY: every rank posted `len` values (checked) that stay alive and unchanged
            // until the last barrier of this collective; `recv` is this rank's own.
            block.copy_from_slice(unsafe { std::slice::from_raw_parts(addr as *const f32, len) });
        }
        self.end_phase(call, Next::Local)
    }

    fn reduce_scatter(
        &self,
        send: &[f32],
        recv: &mut [f32],
        op: ReduceOp,
        timeout: Duration,
    ) -> Result<()> {
        let len = recv.len();
        check_blocks(self, "reduce_scatter", len, send.len())?;
        let call = self.begin(Collective::ReduceScatter { op, len }, timeout);
        let n = self.shared.world_size;
        if n == 1 {
            recv.copy_from_slice(send);
            return self.check_not_aborted(call);
        }
        let st = self.post_and_match(call, send.as_ptr() as usize, Next::Data)?;
        let addrs = Self::peer_addrs(&st);
        drop(st);
        let range = self.rank * len..(self.rank + 1) * len;
        // SAFETY: every rank posted `n * len` values (checked) that no rank writes until the last
        // barrier of this collective; `recv` is this rank's own buffer, not a posted one.
        unsafe { reduce_into(&addrs, self.rank, range, recv, op) };
        self.end_phase(call, Next::Local)
    }

    fn all_gather_shared(
        &self,
        value: super::SharedValue,
        then: Option<super::Then<'_>>,
        timeout: Duration,
    ) -> Result<Option<super::SharedGather>> {
        let phases = Collective::AllGatherShared {
            then: then.is_some(),
        };
        let call = self.begin(phases, timeout);
        if self.shared.world_size == 1 {
            self.check_not_aborted(call)?;
            let values = vec![value];
            let results = then.map(|then| vec![then(&values)]).unwrap_or_default();
            return Ok(Some((values, results)));
        }
        let slots = Slots {
            value,
            result: std::sync::OnceLock::new(),
        };
        let st = self.post_and_match(call, &slots as *const Slots as usize, Next::Data)?;
        let addrs = Self::peer_addrs(&st);
        drop(st);
        // SAFETY: every rank posted the address of its own `Slots`, alive until the last barrier
        // of this collective; a peer's value is only read (an `Arc` clone touches its count).
        let peer = |addr: usize| unsafe { &*(addr as *const Slots) };
        let values: Vec<super::SharedValue> =
            addrs.iter().map(|&a| peer(a).value.clone()).collect();
        let Some(then) = then else {
            self.end_phase(call, Next::Local)?;
            return Ok(Some((values, Vec::new())));
        };
        // This rank's share of the work, between the two phases. A panic in it must not leave
        // the peers waiting for this rank's result: the group is aborted, the phase ended, and
        // the panic goes on.
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| then(&values))) {
            Ok(result) => {
                let _ = slots.result.set(result);
            }
            Err(panic) => {
                self.abort(&format!(
                    "its thread panicked inside {} #{}",
                    call.op, call.seq
                ));
                let _ = self.end_phase(call, Next::Local);
                std::panic::resume_unwind(panic);
            }
        }
        // The results were set before this barrier, under its lock.
        self.end_phase(call, Next::Data)?;
        let results: Option<Vec<super::SharedValue>> = addrs
            .iter()
            .map(|&a| peer(a).result.get().cloned())
            .collect();
        self.end_phase(call, Next::Local)?;
        results
            .map(|results| Some((values, results)))
            .ok_or_else(|| {
                // Unreachable: every rank sets its result before the barrier.
                aborted(call, "a rank reached the second phase without its result")
            })
    }
}

/// What a rank posts for [`Native::all_gather_shared`]: its value, and its result of the
/// second phase, set before the barrier that starts it.
struct Slots {
    value: super::SharedValue,
    result: std::sync::OnceLock<super::SharedValue>,
}

impl Drop for ThreadGroup {
    fn drop(&mut self) {
        let reason = if std::thread::panicking() {
            "its thread panicked"
        } else {
            "its handle was dropped"
        };
        let mut st = self.lock();
        st.left[self.rank] = Some(reason.to_string());
        self.shared.changed.notify_all();
    }
}

impl std::fmt::Debug for ThreadGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadGroup")
            .field("rank", &self.rank)
            .field("world_size", &self.shared.world_size)
            .field("next_seq", &self.seq.load(Ordering::Relaxed))
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::thread;

    const T: Duration = Duration::from_secs(10);

    /// Runs `f(rank, group)` on one thread per rank and returns the results in rank order.
    fn run<R: Send>(world_size: usize, f: impl Fn(usize, ThreadGroup) -> R + Sync) -> Vec<R> {
        let groups = ThreadGroup::new_group(world_size).unwrap();
        thread::scope(|s| {
            let handles: Vec<_> = groups
                .into_iter()
                .enumerate()
                .map(|(rank, g)| {
                    let f = &f;
                    s.spawn(move || f(rank, g))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn all_reduce_sums_and_averages_in_ring_order_on_every_rank() {
        for n in [1usize, 2, 3, 4] {
            let len = 5003; // not a multiple of the block or of n
            let input = |rank: usize, i: usize| ((rank * 31 + i * 7) % 97) as f32 * 0.37 - 11.0;
            let results = run(n, |rank, g| {
                let mut sum: Vec<f32> = (0..len).map(|i| input(rank, i)).collect();
                let mut avg = sum.clone();
                g.all_reduce(&mut sum, ReduceOp::Sum, T).unwrap();
                g.all_reduce(&mut avg, ReduceOp::Avg, T).unwrap();
                (sum, avg)
            });
            for i in 0..len {
                // Independent computation: sequential sum starting at the rank that owns the
                // element's chunk (chunk c is summed c, c+1, ..., c-1).
                let owner = (0..n)
                    .find(|&c| chunk_range(len, n, c).contains(&i))
                    .unwrap();
                let mut expected = input(owner, i);
                for k in 1..n {
                    expected += input((owner + k) % n, i);
                }
                for (rank, (sum, avg)) in results.iter().enumerate() {
                    assert_eq!(
                        sum[i].to_bits(),
                        expected.to_bits(),
                        "n {n} rank {rank} i {i}"
                    );
                    assert_eq!(
                        avg[i].to_bits(),
                        (expected / n as f32).to_bits(),
                        "n {n} rank {rank} i {i}"
                    );
                }
            }
        }
    }

    #[test]
    fn broadcast_copies_the_root_buffer() {
        let results = run(3, |rank, g| {
            let mut buf = vec![rank as f32; 100];
            g.broadcast(&mut buf, 2, T).unwrap();
            buf
        });
        for buf in results {
            assert!(buf.iter().all(|&v| v == 2.0));
        }
    }

    #[test]
    fn all_gather_is_rank_major() {
        let results = run(3, |rank, g| {
            g.all_gather(&[rank as u64, 10 + rank as u64], T).unwrap()
        });
        for out in results {
            assert_eq!(out, vec![0, 10, 1, 11, 2, 12]);
        }
    }

    #[test]
    fn a_rank_that_never_arrives_is_named_within_the_timeout() {
        let timeout = Duration::from_secs(1);
        let (late_tx, late_rx) = std::sync::mpsc::channel::<()>();
        let late_rx = std::sync::Mutex::new(late_rx);
        let results = run(3, |rank, g| {
            let mut buf = vec![1.0f32; 8];
            if rank == 2 {
                // Rank 2 skips the all-reduce; it shows up for a barrier once the others failed.
                if let Ok(rx) = late_rx.lock() {
                    let _ = rx.recv_timeout(Duration::from_secs(20));
                }
                return (g.barrier(timeout), Duration::ZERO);
            }
            let start = Instant::now();
            let result = g.all_reduce(&mut buf, ReduceOp::Avg, timeout);
            let _ = late_tx.send(());
            (result, start.elapsed())
        });
        for (rank, (result, elapsed)) in results.iter().take(2).enumerate() {
            let err = result.as_ref().unwrap_err();
            assert!(
                elapsed < &Duration::from_secs(5),
                "rank {rank} took {elapsed:?}"
            );
            match err {
                // The first rank to time out names rank 2 (and maybe a slow rank 0 or 1); the
                // other one may see that rank's abort first.
                CommError::Timeout { missing, seq, .. } => {
                    assert!(missing.contains(&2), "{err}");
                    assert_eq!(*seq, 0);
                }
                CommError::Aborted { cause, .. } => {
                    assert!(cause.contains("rank 2") || cause.contains(", 2"), "{err}")
                }
                other => panic!("rank {rank}: unexpected error {other}"),
            }
        }
        // The late rank finds the group aborted instead of waiting.
        assert!(matches!(results[2].0, Err(CommError::Aborted { .. })));
    }

    #[test]
    fn different_kinds_of_collective_are_a_mismatch_on_every_rank() {
        let results = run(2, |rank, g| {
            if rank == 0 {
                g.all_gather(&[1], T).map(|_| ())
            } else {
                g.barrier(T)
            }
        });
        for (rank, result) in results.iter().enumerate() {
            match result {
                Err(CommError::Mismatch { op, peer_op, .. }) => {
                    assert_ne!(op, peer_op, "rank {rank}");
                }
                other => panic!("rank {rank}: expected a mismatch, got {other:?}"),
            }
        }
    }

    #[test]
    fn an_unbounded_timeout_is_accepted() {
        let results = run(2, |_, g| g.barrier(Duration::MAX));
        assert!(results.iter().all(Result::is_ok));
    }

    #[test]
    fn mismatched_calls_fail_on_every_rank() {
        let results = run(2, |rank, g| {
            let mut buf = vec![0.0f32; 4 + rank];
            g.all_reduce(&mut buf, ReduceOp::Sum, T)
        });
        for (rank, result) in results.iter().enumerate() {
            match result {
                Err(CommError::Mismatch { peer, .. }) => assert_ne!(*peer, rank),
                other => panic!("rank {rank}: expected a mismatch, got {other:?}"),
            }
        }
    }

    #[test]
    fn a_dropped_rank_is_named_at_once() {
        // Rank 1 drops its handle before rank 0 even starts its barrier, and while it waits.
        for drop_first in [true, false] {
            let (dropped_tx, dropped_rx) = std::sync::mpsc::channel::<()>();
            let dropped_rx = std::sync::Mutex::new(dropped_rx);
            let (waiting_tx, waiting_rx) = std::sync::mpsc::channel::<()>();
            let waiting_rx = std::sync::Mutex::new(waiting_rx);
            let results = run(2, |rank, g| {
                if rank == 1 {
                    if !drop_first && let Ok(rx) = waiting_rx.lock() {
                        // Rank 0 is about to wait in its barrier (or already does).
                        let _ = rx.recv_timeout(Duration::from_secs(20));
                    }
                    drop(g);
                    let _ = dropped_tx.send(());
                    return Ok(Duration::ZERO);
                }
                if drop_first && let Ok(rx) = dropped_rx.lock() {
                    let _ = rx.recv_timeout(Duration::from_secs(20));
                }
                let _ = waiting_tx.send(());
                let start = Instant::now();
                match g.barrier(Duration::from_secs(30)) {
                    Err(CommError::PeerLeft { peer: 1, .. }) => Ok(start.elapsed()),
                    other => Err(format!("expected PeerLeft naming rank 1, got {other:?}")),
                }
            });
            // "At once": far below the barrier's 30 s timeout, with room for a loaded machine.
            let waited = results[0].clone().unwrap();
            assert!(
                waited < Duration::from_secs(10),
                "drop_first {drop_first}: waited {waited:?}"
            );
        }
    }

    #[test]
    fn abort_wakes_waiting_ranks_with_the_reason() {
        let results = run(2, |rank, g| {
            if rank == 1 {
                thread::sleep(Duration::from_millis(50));
                g.abort("bad batch");
                return Ok(());
            }
            g.barrier(Duration::from_secs(30))
        });
        match &results[0] {
            Err(CommError::Aborted { cause, .. }) => assert!(cause.contains("bad batch")),
            other => panic!("expected Aborted, got {other:?}"),
        }
    }

    #[test]
    fn zero_world_size_is_an_error() {
        assert!(matches!(
            ThreadGroup::new_group(0),
            Err(CommError::InvalidConfig(_))
        ));
    }
}
