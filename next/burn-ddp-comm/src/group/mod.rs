//! Process groups: the ranks that train together and the collectives they run.
//!
//! A [`ProcessGroup`] is one rank's handle on a group of `world_size` ranks (the term and the
//! semantics follow `torch.distributed`). The collectives are the four a data-parallel trainer
//! needs, in the order a training run calls them:
//!
//! 1. [`all_gather`](ProcessGroup::all_gather) of a few `u64` (start-up checks: model fingerprints,
//!    per-step agreement on whether every rank still has a batch);
//! 2. [`broadcast`](ProcessGroup::broadcast) of rank 0's parameters and buffers before step 1;
//! 3. [`all_reduce`](ProcessGroup::all_reduce) of flat `f32` gradient buckets, every step;
//! 4. [`barrier`](ProcessGroup::barrier) where ranks must wait for each other (end of an epoch).
//!
//! Contract shared by every implementation:
//! - every rank issues the same collectives, with the same arguments, in the same order; a rank
//!   that does not gets [`CommError::Mismatch`](crate::CommError::Mismatch) on every rank, not a hang;
//! - every call takes a timeout; when it passes, the call returns
//!   [`CommError::Timeout`](crate::CommError::Timeout) naming the ranks that did not arrive;
//! - a failed collective aborts the group: every later call on any rank fails at once with
//!   [`CommError::Aborted`](crate::CommError::Aborted), so one failure ends the whole job quickly;
//! - all-reduce results are bit-identical on every rank: the buffer is split into `world_size`
//!   contiguous chunks (sizes differing by at most one) and chunk `c` is summed in the fixed order `c, c+1, ..., c-1`
//!   (ranks mod N, the order of a ring all-reduce), independent of timing. All CPU groups use this
//!   order, so threads and processes give the same bits.
//!
//! Implementations: [`ThreadGroup`] (ranks are threads of one process, shared memory),
//! [`TcpGroup`] (ranks are processes, on one machine or many, connected by TCP) and, with the
//! `mpi` feature, `MpiGroup` (the processes of an MPI job, over the site's MPI library; its
//! reduction order is MPI's own and a failure ends the job with `MPI_Abort`, see its docs).

pub(crate) mod call;
pub(crate) mod collective;
mod counting;
mod extension;
#[cfg(feature = "mpi")]
mod mpi;
pub mod nccl;
mod tcp;
mod thread;

use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

pub use collective::{Collective, HalfFloat, ReduceOp};
pub use counting::{CountingGroup, Counts};
pub(crate) use extension::Sealed;
/// The sealed trait behind [`Native`], for burn-ddp's unit tests only (feature `test-support`).
#[cfg(feature = "test-support")]
#[doc(hidden)]
pub use extension::Sealed as TestSealed;
pub use extension::{ExtendedCollectives, Native};
pub use extension::{SharedGather, SharedValue, Then};
#[cfg(feature = "mpi")]
pub use mpi::{MPI_ABORT_EXIT_CODE, MpiGroup, launched_by_mpi};
/// `n` connected [`TcpGroup`]s on this machine, for burn-ddp's unit tests only (feature
/// `test-support`).
#[cfg(any(test, feature = "test-support"))]
#[doc(hidden)]
pub use tcp::loopback_groups;
pub use tcp::{SOCKET_IFNAME_VAR, TcpGroup, TcpGroupOptions};
pub use thread::ThreadGroup;

use crate::error::Result;

/// Default timeout of a collective: 300 s (the timeout the project's design card sets; PyTorch's
/// NCCL default is 600 s, Gloo's 1800 s). Configurable per call and in
/// burn-ddp's `DdpConfig`.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// The half-open range of chunk `index` when `len` elements are split into `parts` contiguous
/// chunks whose sizes differ by at most one (the first `len % parts` chunks get one more): which
/// chunk of a bucket rank `index` reduces in the CPU groups' all-reduce and reduce-scatter (so
/// the summation order the module docs give), and which samples a rank gets where burn-ddp splits
/// data the same way.
pub fn chunk_range(len: usize, parts: usize, index: usize) -> std::ops::Range<usize> {
    let base = len / parts;
    let extra = len % parts;
    let start = index * base + index.min(extra);
    let size = base + usize::from(index < extra);
    start..start + size
}

/// `m`'s guard, also after a panic on another thread (the groups' state stays consistent: every
/// update is one assignment).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Sleeps a little longer each time a poll finds the work unfinished (NCCL's and MPI's
/// non-blocking calls): the first polls spin, later ones sleep up to 200 µs, so a short
/// collective returns quickly and a long wait does not burn a core.
#[cfg(any(feature = "cuda", feature = "mpi"))]
pub(crate) fn backoff(polls: &mut u32) {
    *polls += 1;
    match *polls {
        0..=64 => std::hint::spin_loop(),
        65..=256 => std::thread::yield_now(),
        _ => std::thread::sleep(Duration::from_micros(200)),
    }
}

/// A 16-bit all-reduce done in `f32`: `bucket` (bits in `format`) widened, reduced in place by
/// `reduce`, rounded back to `format` once.
pub(crate) fn reduce_widened(
    bucket: &mut [u16],
    format: HalfFloat,
    reduce: impl FnOnce(&mut [f32]) -> Result<()>,
) -> Result<()> {
    let mut wide: Vec<f32> = bucket.iter().map(|&bits| format.to_f32(bits)).collect();
    reduce(&mut wide)?;
    for (bits, value) in bucket.iter_mut().zip(wide) {
        *bits = format.from_f32(value);
    }
    Ok(())
}

/// One rank's handle on a process group.
///
/// Handles are `Send + Sync`, but a rank's collectives must be issued one at a time, in program
/// order (one thread per rank), as with `torch.distributed`.
pub trait ProcessGroup: Send + Sync {
    /// This rank, in `0..world_size`.
    fn rank(&self) -> usize;

    /// Number of ranks in the group.
    fn world_size(&self) -> usize;

    /// Short name of the transport, for logs: `"threads"`, `"tcp"`, `"nccl"`.
    fn backend(&self) -> &'static str;

    /// Reduces `bucket` across ranks in place: afterwards every rank holds the element-wise sum
    /// (or average, for [`ReduceOp::Avg`]) of all ranks' buffers, bit-identical on every rank.
    ///
    /// `bucket.len()` must be the same on every rank.
    ///
    /// # Errors
    /// [`Timeout`](crate::CommError::Timeout) when a rank does not arrive within `timeout`,
    /// [`PeerLeft`](crate::CommError::PeerLeft), [`Mismatch`](crate::CommError::Mismatch) when ranks
    /// called different collectives or lengths, [`Aborted`](crate::CommError::Aborted) after an
    /// earlier failure.
    fn all_reduce(&self, bucket: &mut [f32], op: ReduceOp, timeout: Duration) -> Result<()>;

    /// Copies `root`'s `buffer` into every other rank's `buffer` (same length on every rank).
    ///
    /// # Errors
    /// As [`all_reduce`](ProcessGroup::all_reduce); [`InvalidConfig`](crate::CommError::InvalidConfig)
    /// when `root >= world_size`.
    fn broadcast(&self, buffer: &mut [f32], root: usize, timeout: Duration) -> Result<()>;

    /// Returns once every rank has called `barrier`.
    ///
    /// # Errors
    /// As [`all_reduce`](ProcessGroup::all_reduce).
    fn barrier(&self, timeout: Duration) -> Result<()>;

    /// Every rank contributes `values` (same length `L` on every rank) and receives all ranks'
    /// values, rank-major: the result has length `world_size * L` and `result[r * L..(r + 1) * L]`
    /// is rank `r`'s contribution. Meant for small checks, not bulk data.
    ///
    /// # Errors
    /// As [`all_reduce`](ProcessGroup::all_reduce).
    fn all_gather(&self, values: &[u64], timeout: Duration) -> Result<Vec<u64>>;

    /// Aborts the group on behalf of this rank: every rank's pending and future collectives fail
    /// at once with [`Aborted`](crate::CommError::Aborted) carrying `reason`. A rank calls this
    /// when it fails outside a collective (an error in its data or model), so its peers do not
    /// wait for the timeout. Aborting twice keeps the first reason.
    fn abort(&self, reason: &str);

    /// Why the group was aborted (by this rank or, where the transport tells, by a peer), if it
    /// has been. Device collectives poll it while they wait, so an abort reaches them before
    /// their timeout. Default: `None` (the group does not say).
    fn aborted(&self) -> Option<String> {
        None
    }

    /// burn-ddp's own groups' native 16-bit and device collectives (see
    /// [`ExtendedCollectives`]). Keep the default, `None` (your group gets the fallbacks), unless
    /// your group wraps one of burn-ddp's: then forward it, `self.inner.native()`, so that NCCL
    /// still reduces device buckets and TCP still sends 16-bit values.
    fn native(&self) -> Option<&dyn Native> {
        None
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// One call of every kind, with different arguments (for encoding tests).
    pub(crate) fn every_kind() -> [Collective; 10] {
        [
            Collective::AllReduce {
                op: ReduceOp::Avg,
                len: 7,
            },
            Collective::AllReduce {
                op: ReduceOp::Sum,
                len: 0,
            },
            Collective::Broadcast { root: 3, len: 9 },
            Collective::Barrier,
            Collective::AllGather { len: 2 },
            Collective::AllReduceHalf {
                op: ReduceOp::Avg,
                len: 5,
                format: HalfFloat::F16,
            },
            Collective::AllReduceHalf {
                op: ReduceOp::Sum,
                len: 5,
                format: HalfFloat::Bf16,
            },
            Collective::AllGatherF32 { len: 2 },
            Collective::ReduceScatter {
                op: ReduceOp::Avg,
                len: 4,
            },
            Collective::ReduceScatter {
                op: ReduceOp::Sum,
                len: 4,
            },
        ]
    }

    #[test]
    fn different_calls_encode_to_different_numbers_that_decode_back() {
        let calls = every_kind();
        for (i, call) in calls.iter().enumerate() {
            let (code, len, arg) = call.encode();
            assert_eq!(Collective::decode(code, len, arg), Some(*call));
            for other in &calls[i + 1..] {
                assert_ne!(call.encode(), other.encode(), "{call} and {other}");
            }
        }
        assert_eq!(Collective::decode(0, 1, 2), None);
    }

    #[test]
    fn chunks_cover_the_buffer_without_overlap() {
        for len in [0usize, 1, 5, 16, 17, 1000] {
            for parts in 1..6 {
                let mut next = 0;
                for index in 0..parts {
                    let range = chunk_range(len, parts, index);
                    assert_eq!(range.start, next, "len {len} parts {parts} index {index}");
                    assert!(range.len() == len / parts || range.len() == len / parts + 1);
                    next = range.end;
                }
                assert_eq!(next, len);
            }
        }
    }

    #[test]
    fn collective_display_names_arguments() {
        assert_eq!(
            Collective::Broadcast { root: 0, len: 3 }.to_string(),
            "broadcast(root 0, 3 f32)"
        );
        assert_eq!(
            Collective::AllGather { len: 2 }.to_string(),
            "all_gather(2 u64)"
        );
        assert_eq!(Collective::Barrier.to_string(), "barrier");
    }
}
