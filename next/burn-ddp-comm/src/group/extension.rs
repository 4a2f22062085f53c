//! The collectives beyond [`ProcessGroup`]'s: the 16-bit all-reduce of gradient compression,
//! the all-reduce of device tensors (NCCL), and the `f32` all-gather and reduce-scatter of
//! optimizer-state sharding. The crate's own groups run them natively (they
//! implement [`Native`], which is sealed: another crate can name it, to forward a wrapped
//! group's, but not implement it); for any other group,
//! [`ExtendedCollectives`] falls back to the `f32` all-reduce and to host buckets. So the trait a
//! user implements stays small, and a user's group still works with compression (without the
//! saving on the wire).

use std::any::Any;
use std::sync::Arc;
use std::time::Duration;

use super::collective::{HalfFloat, ReduceOp};
use super::{ProcessGroup, reduce_widened};
use crate::error::{CommError, Result};

/// A value one rank hands to the others by reference in
/// [`all_gather_shared`](ExtendedCollectives::all_gather_shared): tensors (Burn's tensors are
/// values behind reference counts) or anything else a thread may share.
pub type SharedValue = Arc<dyn Any + Send + Sync>;

/// The second phase of [`all_gather_shared`](ExtendedCollectives::all_gather_shared): this
/// rank's result from every rank's value.
pub type Then<'a> = &'a mut dyn FnMut(&[SharedValue]) -> SharedValue;

/// What [`all_gather_shared`](ExtendedCollectives::all_gather_shared) gives every rank: every
/// rank's value, and every rank's result of the second phase (empty without one).
pub type SharedGather = (Vec<SharedValue>, Vec<SharedValue>);

/// Keeps [`Native`] to the crate's own groups.
mod sealed {
    /// Implemented by the crate's own groups (and, with `test-support`, burn-ddp's test groups).
    pub trait Sealed {}
}
#[cfg(feature = "test-support")]
pub use sealed::Sealed;
#[cfg(not(feature = "test-support"))]
pub(crate) use sealed::Sealed;

/// The extended collectives of burn-ddp's own process groups (sealed: implemented by them only).
/// A group of yours that wraps one of them forwards its
/// [`native`](ProcessGroup::native): `fn native(&self) -> Option<&dyn Native> {
/// self.inner.native() }`.
pub trait Native: ProcessGroup + Sealed {
    /// As [`ExtendedCollectives::all_reduce_half`]; by default widened to `f32`.
    fn all_reduce_half(
        &self,
        bucket: &mut [u16],
        format: HalfFloat,
        op: ReduceOp,
        timeout: Duration,
    ) -> Result<()> {
        reduce_widened(bucket, format, |wide| self.all_reduce(wide, op, timeout))
    }

    /// As [`ExtendedCollectives::reduces_device_tensors`].
    fn reduces_device_tensors(&self) -> bool {
        false
    }

    /// As [`ExtendedCollectives::all_reduce_device`].
    fn all_reduce_device(
        &self,
        tensor: &mut dyn Any,
        op: ReduceOp,
        timeout: Duration,
    ) -> Result<bool> {
        let _ = (tensor, op, timeout);
        Ok(false)
    }

    /// As [`ExtendedCollectives::all_gather_f32`]; by default one broadcast per rank.
    fn all_gather_f32(&self, send: &[f32], recv: &mut [f32], timeout: Duration) -> Result<()> {
        gather_by_broadcasts(self, send, recv, timeout)
    }

    /// As [`ExtendedCollectives::reduce_scatter`]; by default an all-reduce of a copy.
    fn reduce_scatter(
        &self,
        send: &[f32],
        recv: &mut [f32],
        op: ReduceOp,
        timeout: Duration,
    ) -> Result<()> {
        scatter_after_all_reduce(self, send, recv, op, timeout)
    }

    /// As [`ExtendedCollectives::all_gather_shared`]; by default `Ok(None)` (ranks in separate
    /// address spaces).
    fn all_gather_shared(
        &self,
        value: SharedValue,
        then: Option<Then<'_>>,
        timeout: Duration,
    ) -> Result<Option<SharedGather>> {
        let _ = (value, then, timeout);
        Ok(None)
    }
}

/// The collectives the reducer and the communication hooks run beyond [`ProcessGroup`]'s, on any
/// process group: natively on the crate's own groups, by the fallback given for each method on
/// any other.
pub trait ExtendedCollectives {
    /// Reduces `bucket`, 16-bit floats in `format` (their bits), across ranks in place: every
    /// rank gets the element-wise sum (or average) of all ranks' values, rounded to `format`,
    /// bit-identical on every rank. For gradient compression: a group that moves bytes sends half
    /// of them ([`TcpGroup`](super::TcpGroup) sends the 16-bit values, adding in `f32` and
    /// rounding at every hop). Fallback: widens to `f32`, runs
    /// [`all_reduce`](ProcessGroup::all_reduce) and rounds once (no saving on the wire).
    ///
    /// # Errors
    /// As [`all_reduce`](ProcessGroup::all_reduce).
    fn all_reduce_half(
        &self,
        bucket: &mut [u16],
        format: HalfFloat,
        op: ReduceOp,
        timeout: Duration,
    ) -> Result<()>;

    /// Whether [`all_reduce_device`](Self::all_reduce_device) takes device tensors; the
    /// burn-ddp's `Reducer` then builds its buckets in device memory instead
    /// of host buffers. Fallback: `false`.
    fn reduces_device_tensors(&self) -> bool;

    /// Reduces `tensor`, a flat bucket in device memory, in place, like
    /// [`all_reduce`](ProcessGroup::all_reduce). `tensor` is the backend's float tensor primitive
    /// (`B::FloatTensorPrimitive`, e.g. a `CubeTensor` or a `FusionTensor` of burn-cuda) of
    /// shape `[len]`, the same `len` and dtype on every rank.
    ///
    /// Returns `Ok(false)`, without communicating, when the group cannot reduce that kind of
    /// tensor (the fallback for any tensor).
    ///
    /// # Errors
    /// As [`all_reduce`](ProcessGroup::all_reduce); [`Nccl`](crate::CommError::Nccl) for a failed
    /// NCCL or CUDA call or a buffer that does not fit (not contiguous, unsupported dtype).
    fn all_reduce_device(
        &self,
        tensor: &mut dyn Any,
        op: ReduceOp,
        timeout: Duration,
    ) -> Result<bool>;

    /// Every rank contributes `send` (`L` values, the same `L` on every rank) and receives every
    /// rank's in `recv` (`world_size * L` values, rank-major: rank `r`'s at `r * L..(r + 1) * L`),
    /// bit for bit (a copy, no arithmetic: any bits may travel as `f32`). The all-gather of
    /// updated parameters under optimizer-state sharding. Native: `ThreadGroup` copies from the
    /// peers' buffers, `TcpGroup` sends `send` to every peer, `MpiGroup` runs
    /// `MPI_Iallgather`, `NcclGroup` `ncclAllGather`. Fallback: one
    /// [`broadcast`](ProcessGroup::broadcast) per rank.
    ///
    /// # Errors
    /// As [`all_reduce`](ProcessGroup::all_reduce); [`InvalidConfig`](crate::CommError::InvalidConfig)
    /// when `recv.len() != world_size * send.len()`.
    fn all_gather_f32(&self, send: &[f32], recv: &mut [f32], timeout: Duration) -> Result<()>;

    /// Every rank contributes `send` (`world_size * L` values, `world_size` blocks of `L`);
    /// rank `r` receives in `recv` (`L` values) the sum (or average) over the ranks of block `r`,
    /// summed in the order `r, r + 1, ..., r - 1` (ranks mod N) on the crate's CPU groups: the
    /// bits [`all_reduce`](ProcessGroup::all_reduce) gives that block when `L` divides it evenly.
    /// Native on the crate's groups (`MPI_Ireduce_scatter_block`, `ncclReduceScatter`, each with
    /// its library's order). Fallback: an all-reduce of a copy of `send`, keeping block `r`.
    ///
    /// # Errors
    /// As [`all_gather_f32`](Self::all_gather_f32), with `send.len() != world_size * recv.len()`.
    fn reduce_scatter(
        &self,
        send: &[f32],
        recv: &mut [f32],
        op: ReduceOp,
        timeout: Duration,
    ) -> Result<()>;

    /// Every rank's `value` to every rank, by reference: `Some((values, results))`, indexed by
    /// rank (this rank's own included), when the ranks share one address space
    /// ([`ThreadGroup`]: the values are `Arc` clones, no byte is copied); `Ok(None)`, without
    /// communicating, on a group whose ranks are separate processes (the fallback). The same
    /// answer on every rank of a group, so every rank takes the same path.
    ///
    /// With `then`, one collective of two phases, as an all-reduce is a reduce-scatter and an
    /// all-gather: each rank runs `then` on every rank's value (its share of the work) and its
    /// result goes to every rank in `results`; without, `results` is empty. Every rank must pass
    /// `then` or none alike. Thread replicas on one device exchange gradient and parameter
    /// tensors with it instead of copying them through buckets.
    ///
    /// [`ThreadGroup`]: super::ThreadGroup
    ///
    /// # Errors
    /// As [`all_reduce`](ProcessGroup::all_reduce) (a rank that does not call it: `Timeout`,
    /// another collective: `Mismatch`); a rank whose `then` panicked aborts the group (its
    /// peers: `Aborted`) and the panic goes on on its thread.
    fn all_gather_shared(
        &self,
        value: SharedValue,
        then: Option<Then<'_>>,
        timeout: Duration,
    ) -> Result<Option<SharedGather>>;
}

impl<G: ProcessGroup + ?Sized> ExtendedCollectives for G {
    fn all_reduce_half(
        &self,
        bucket: &mut [u16],
        format: HalfFloat,
        op: ReduceOp,
        timeout: Duration,
    ) -> Result<()> {
        match self.native() {
            Some(native) => native.all_reduce_half(bucket, format, op, timeout),
            None => reduce_widened(bucket, format, |wide| self.all_reduce(wide, op, timeout)),
        }
    }

    fn reduces_device_tensors(&self) -> bool {
        self.native().is_some_and(Native::reduces_device_tensors)
    }

    fn all_reduce_device(
        &self,
        tensor: &mut dyn Any,
        op: ReduceOp,
        timeout: Duration,
    ) -> Result<bool> {
        match self.native() {
            Some(native) => native.all_reduce_device(tensor, op, timeout),
            None => Ok(false),
        }
    }

    fn all_gather_f32(&self, send: &[f32], recv: &mut [f32], timeout: Duration) -> Result<()> {
        match self.native() {
            Some(native) => native.all_gather_f32(send, recv, timeout),
            None => gather_by_broadcasts(self, send, recv, timeout),
        }
    }

    fn reduce_scatter(
        &self,
        send: &[f32],
        recv: &mut [f32],
        op: ReduceOp,
        timeout: Duration,
    ) -> Result<()> {
        match self.native() {
            Some(native) => native.reduce_scatter(send, recv, op, timeout),
            None => scatter_after_all_reduce(self, send, recv, op, timeout),
        }
    }

    fn all_gather_shared(
        &self,
        value: SharedValue,
        then: Option<Then<'_>>,
        timeout: Duration,
    ) -> Result<Option<SharedGather>> {
        match self.native() {
            Some(native) => native.all_gather_shared(value, then, timeout),
            None => Ok(None),
        }
    }
}

/// Refuses blocks that do not fit: `whole` must be `world_size * block` values. Checked on
/// every rank before any communication (a rank that passes wrong lengths fails alone; its peers
/// then see it leave or time out naming it).
pub(crate) fn check_blocks(
    group: &(impl ProcessGroup + ?Sized),
    op: &str,
    block: usize,
    whole: usize,
) -> Result<()> {
    let n = group.world_size();
    if block.checked_mul(n) != Some(whole) {
        let err = CommError::InvalidConfig(format!(
            "{op} on rank {}: {whole} values are not {n} blocks of {block} (world size {n})",
            group.rank()
        ));
        group.abort(&err.to_string());
        return Err(err);
    }
    Ok(())
}

/// [`ExtendedCollectives::all_gather_f32`] by one broadcast per rank (exact: broadcasts copy).
fn gather_by_broadcasts(
    group: &(impl ProcessGroup + ?Sized),
    send: &[f32],
    recv: &mut [f32],
    timeout: Duration,
) -> Result<()> {
    let len = send.len();
    check_blocks(group, "all_gather_f32", len, recv.len())?;
    let rank = group.rank();
    recv[rank * len..(rank + 1) * len].copy_from_slice(send);
    for (root, block) in recv.chunks_mut(len.max(1)).enumerate() {
        group.broadcast(block, root, timeout)?;
    }
    Ok(())
}

/// [`ExtendedCollectives::reduce_scatter`] by an all-reduce of a copy of `send`.
fn scatter_after_all_reduce(
    group: &(impl ProcessGroup + ?Sized),
    send: &[f32],
    recv: &mut [f32],
    op: ReduceOp,
    timeout: Duration,
) -> Result<()> {
    let len = recv.len();
    check_blocks(group, "reduce_scatter", len, send.len())?;
    let mut all = send.to_vec();
    group.all_reduce(&mut all, op, timeout)?;
    let rank = group.rank();
    recv.copy_from_slice(&all[rank * len..(rank + 1) * len]);
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::group::{ThreadGroup, loopback_groups};

    const T: Duration = Duration::from_secs(20);

    /// A group without natives: what a user's group gets (the fallbacks).
    struct Plain(Arc<dyn ProcessGroup>);

    impl ProcessGroup for Plain {
        fn rank(&self) -> usize {
            self.0.rank()
        }
        fn world_size(&self) -> usize {
            self.0.world_size()
        }
        fn backend(&self) -> &'static str {
            "plain"
        }
        fn all_reduce(&self, bucket: &mut [f32], op: ReduceOp, timeout: Duration) -> Result<()> {
            self.0.all_reduce(bucket, op, timeout)
        }
        fn broadcast(&self, buffer: &mut [f32], root: usize, timeout: Duration) -> Result<()> {
            self.0.broadcast(buffer, root, timeout)
        }
        fn barrier(&self, timeout: Duration) -> Result<()> {
            self.0.barrier(timeout)
        }
        fn all_gather(&self, values: &[u64], timeout: Duration) -> Result<Vec<u64>> {
            self.0.all_gather(values, timeout)
        }
        fn abort(&self, reason: &str) {
            self.0.abort(reason)
        }
    }

    /// Rank `rank`'s `i`-th input: values whose sums round differently in another order, a NaN
    /// payload and a subnormal (the gather must copy bits).
    fn input(rank: usize, i: usize) -> f32 {
        match i % 7 {
            5 => f32::from_bits(0x7fc0_0000 | (rank as u32 + 1)),
            6 => f32::from_bits(rank as u32 + 1),
            _ => (0.1 + rank as f32 * 1e-3) * (i as f32 + 1.0).powi(3),
        }
    }

    /// What every rank gets: the all-gather, the reduce-scatter (sum and average) and the
    /// all-reduce (sum) of the same inputs, as bits.
    fn exchange(group: &dyn ProcessGroup, block: usize) -> [Vec<u32>; 4] {
        let (rank, n) = (group.rank(), group.world_size());
        let mine: Vec<f32> = (0..block).map(|i| input(rank, i)).collect();
        let mut gathered = vec![0.0; n * block];
        group.all_gather_f32(&mine, &mut gathered, T).unwrap();
        // Reduce the finite values only (sums of NaN payloads depend on the hardware).
        let whole: Vec<f32> = (0..n * block)
            .map(|i| input(rank, i % 5 + i / 5 * 7))
            .collect();
        let (mut sum, mut avg) = (vec![0.0; block], vec![0.0; block]);
        group
            .reduce_scatter(&whole, &mut sum, ReduceOp::Sum, T)
            .unwrap();
        group
            .reduce_scatter(&whole, &mut avg, ReduceOp::Avg, T)
            .unwrap();
        let mut reduced = whole.clone();
        group.all_reduce(&mut reduced, ReduceOp::Sum, T).unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
        let own = bits(&reduced[rank * block..(rank + 1) * block]);
        [bits(&gathered), bits(&sum), bits(&avg), own]
    }

    fn on_threads(n: usize, plain: bool, block: usize) -> Vec<[Vec<u32>; 4]> {
        let groups = ThreadGroup::new_group(n).unwrap();
        std::thread::scope(|s| {
            let handles: Vec<_> = groups
                .into_iter()
                .map(|g| {
                    s.spawn(move || {
                        if plain {
                            exchange(&Plain(Arc::new(g)), block)
                        } else {
                            exchange(&g, block)
                        }
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn all_gather_copies_bits_and_reduce_scatter_gives_the_all_reduce_bits_on_every_group() {
        for n in [1, 2, 3] {
            let block = 11;
            let threads = on_threads(n, false, block);
            for (rank, [gathered, sum, avg, own]) in threads.iter().enumerate() {
                let expected: Vec<u32> = (0..n)
                    .flat_map(|r| (0..block).map(move |i| input(r, i).to_bits()))
                    .collect();
                assert_eq!(gathered, &expected, "rank {rank} of {n}: all_gather_f32");
                assert_eq!(sum, own, "rank {rank} of {n}: reduce_scatter vs all_reduce");
                let divided: Vec<u32> = own
                    .iter()
                    .map(|b| (f32::from_bits(*b) / n as f32).to_bits())
                    .collect();
                assert_eq!(avg, &divided, "rank {rank} of {n}: average");
            }
            assert_eq!(on_threads(n, true, block), threads, "fallbacks, {n} ranks");
            let (_store, groups) = loopback_groups(n, T);
            let tcp: Vec<_> = std::thread::scope(|s| {
                let handles: Vec<_> = groups
                    .into_iter()
                    .map(|g| s.spawn(move || exchange(&g, block)))
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            });
            assert_eq!(tcp, threads, "TCP, {n} ranks");
        }
    }

    #[test]
    fn blocks_that_do_not_fit_are_refused_naming_the_operation() {
        let groups = ThreadGroup::new_group(1).unwrap();
        let group: &dyn ProcessGroup = &groups[0];
        let err = group
            .all_gather_f32(&[1.0, 2.0], &mut [0.0; 3], T)
            .unwrap_err();
        assert!(err.to_string().contains("all_gather_f32"), "{err}");
        let err = Plain(Arc::new(ThreadGroup::new_group(1).unwrap().remove(0)))
            .reduce_scatter(&[1.0, 2.0, 3.0], &mut [0.0; 2], ReduceOp::Sum, T)
            .unwrap_err();
        assert!(err.to_string().contains("reduce_scatter"), "{err}");
    }
}
