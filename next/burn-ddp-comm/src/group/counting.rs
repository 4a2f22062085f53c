//! A process group that counts the collectives issued through it and the bytes they send, for
//! burn-ddp's `RankReport::step_collectives` and
//! `RankReport::step_bus_bytes`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use super::{ExtendedCollectives, HalfFloat, Native, ProcessGroup, ReduceOp};
use crate::error::Result;

/// What a [`CountingGroup`] counted.
#[derive(Debug, Default)]
pub struct Counts {
    /// Collectives issued (all-reduce, broadcast, barrier, all-gather, device all-reduce, `f32`
    /// all-gather, reduce-scatter, shared all-gather), each once whatever its size.
    pub collectives: AtomicU64,
    /// Bytes this rank sends in them, as a bandwidth-optimal algorithm sends them (nccl-tests'
    /// "bus bytes": all-reduce `2 (N - 1) / N` of the buffer, all-gather and reduce-scatter
    /// `(N - 1) / N`, broadcast all of it). Device all-reduces (NCCL) and shared all-gathers (thread
    /// replicas handing each other references) count none.
    pub bus_bytes: AtomicU64,
}

/// Bytes one rank sends in a collective of `bytes` in all (an all-reduce's or broadcast's
/// buffer, an all-gather's result, a reduce-scatter's input) over `world_size` ranks, by a
/// bandwidth-optimal algorithm: all-reduce `2 (N - 1) / N * bytes` (a ring's reduce-scatter and
/// all-gather), reduce-scatter and all-gather `(N - 1) / N * bytes`, broadcast `bytes`; nothing
/// for one rank.
pub(crate) fn bus_bytes(kind: Kind, bytes: usize, world_size: usize) -> u64 {
    let n = world_size.max(1) as u64;
    let bytes = bytes as u64;
    if n == 1 {
        return 0;
    }
    match kind {
        Kind::AllReduce => 2 * (n - 1) * bytes / n,
        Kind::Gather => (n - 1) * bytes / n,
        Kind::Broadcast => bytes,
    }
}

/// The shapes of collective [`bus_bytes`] tells apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    AllReduce,
    /// All-gather and reduce-scatter.
    Gather,
    Broadcast,
}

/// Forwards every call to `inner`, counting each collective once, whatever its size, and the
/// bytes it sends ([`Counts`]).
pub struct CountingGroup {
    inner: Arc<dyn ProcessGroup>,
    counts: Arc<Counts>,
}

impl CountingGroup {
    /// `inner`, counting into `counts`.
    pub fn new(inner: Arc<dyn ProcessGroup>, counts: Arc<Counts>) -> Self {
        Self { inner, counts }
    }

    /// One collective that moves `bytes` in all, shaped as `kind`.
    fn counted(&self, kind: Kind, bytes: usize) {
        self.counts.collectives.fetch_add(1, Ordering::Relaxed);
        let sent = bus_bytes(kind, bytes, self.inner.world_size());
        self.counts.bus_bytes.fetch_add(sent, Ordering::Relaxed);
    }
}

impl ProcessGroup for CountingGroup {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn world_size(&self) -> usize {
        self.inner.world_size()
    }

    fn backend(&self) -> &'static str {
        self.inner.backend()
    }

    fn all_reduce(&self, bucket: &mut [f32], op: ReduceOp, timeout: Duration) -> Result<()> {
        self.counted(Kind::AllReduce, bucket.len() * 4);
        self.inner.all_reduce(bucket, op, timeout)
    }

    fn broadcast(&self, buffer: &mut [f32], root: usize, timeout: Duration) -> Result<()> {
        self.counted(Kind::Broadcast, buffer.len() * 4);
        self.inner.broadcast(buffer, root, timeout)
    }

    fn barrier(&self, timeout: Duration) -> Result<()> {
        self.counted(Kind::Broadcast, 0);
        self.inner.barrier(timeout)
    }

    fn all_gather(&self, values: &[u64], timeout: Duration) -> Result<Vec<u64>> {
        let world_size = self.inner.world_size();
        self.counted(Kind::Gather, values.len() * 8 * world_size);
        self.inner.all_gather(values, timeout)
    }

    fn abort(&self, reason: &str) {
        self.inner.abort(reason);
    }

    fn aborted(&self) -> Option<String> {
        self.inner.aborted()
    }

    fn native(&self) -> Option<&dyn Native> {
        Some(self)
    }
}

impl crate::group::Sealed for CountingGroup {}

impl Native for CountingGroup {
    fn all_reduce_half(
        &self,
        bucket: &mut [u16],
        format: HalfFloat,
        op: ReduceOp,
        timeout: Duration,
    ) -> Result<()> {
        self.counted(Kind::AllReduce, bucket.len() * 2);
        self.inner.all_reduce_half(bucket, format, op, timeout)
    }

    fn reduces_device_tensors(&self) -> bool {
        self.inner.reduces_device_tensors()
    }

    fn all_reduce_device(
        &self,
        tensor: &mut dyn std::any::Any,
        op: ReduceOp,
        timeout: Duration,
    ) -> Result<bool> {
        // The device tensor's size is the backend's: not counted in bytes.
        self.counted(Kind::AllReduce, 0);
        self.inner.all_reduce_device(tensor, op, timeout)
    }

    fn all_gather_f32(&self, send: &[f32], recv: &mut [f32], timeout: Duration) -> Result<()> {
        self.counted(Kind::Gather, recv.len() * 4);
        self.inner.all_gather_f32(send, recv, timeout)
    }

    fn reduce_scatter(
        &self,
        send: &[f32],
        recv: &mut [f32],
        op: ReduceOp,
        timeout: Duration,
    ) -> Result<()> {
        self.counted(Kind::Gather, send.len() * 4);
        self.inner.reduce_scatter(send, recv, op, timeout)
    }

    fn all_gather_shared(
        &self,
        value: super::SharedValue,
        then: Option<super::Then<'_>>,
        timeout: Duration,
    ) -> Result<Option<super::SharedGather>> {
        let gathered = self.inner.all_gather_shared(value, then, timeout)?;
        if gathered.is_some() {
            // References, not bytes.
            self.counted(Kind::Gather, 0);
        }
        Ok(gathered)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::group::ThreadGroup;

    #[test]
    fn every_collective_is_counted_once_with_the_bytes_it_sends_and_forwarded() {
        let timeout = Duration::from_secs(10);
        let groups = ThreadGroup::new_group(2).unwrap();
        let counts: Vec<(u64, u64)> = std::thread::scope(|s| {
            let handles: Vec<_> = groups
                .into_iter()
                .map(|g| {
                    s.spawn(move || {
                        let counts = Arc::new(Counts::default());
                        let group = CountingGroup::new(Arc::new(g), counts.clone());
                        let mut bucket = vec![group.rank() as f32 + 1.0; 3];
                        group
                            .all_reduce(&mut bucket, ReduceOp::Sum, timeout)
                            .unwrap();
                        assert_eq!(bucket, vec![3.0; 3]);
                        let all = group.all_gather(&[group.rank() as u64], timeout).unwrap();
                        assert_eq!(all, vec![0, 1]);
                        group.barrier(timeout).unwrap();
                        let _ = (group.world_size(), group.backend(), group.aborted());
                        let mut own = vec![group.rank() as f32; 4];
                        let mut all = vec![0.0; 8];
                        Native::all_gather_f32(&group, &own, &mut all, timeout).unwrap();
                        assert_eq!(all, [0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]);
                        Native::reduce_scatter(&group, &all, &mut own, ReduceOp::Sum, timeout)
                            .unwrap();
                        assert_eq!(own, vec![2.0 * group.rank() as f32; 4]);
                        (
                            counts.collectives.load(Ordering::Relaxed),
                            counts.bus_bytes.load(Ordering::Relaxed),
                        )
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        // Bytes sent per rank: the all-reduce of 12 bytes 2 * 1/2 * 12, the all-gather of one
        // u64 8, the barrier none, the f32 all-gather's 32 bytes 16, the reduce-scatter's 16.
        assert_eq!(counts, vec![(5, 12 + 8 + 16 + 16); 2]);
    }
}
