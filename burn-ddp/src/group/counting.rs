//! A process group that counts the collectives issued through it, for
//! [`RankReport::collectives`](crate::metrics::RankReport::collectives).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use super::{ExtendedCollectives, HalfFloat, Native, ProcessGroup, ReduceOp};
use crate::error::Result;

/// Forwards every call to `inner`, counting each collective (all-reduce, broadcast, barrier,
/// all-gather, device all-reduce, `f32` all-gather, reduce-scatter) once, whatever its size.
pub(crate) struct CountingGroup {
    inner: Arc<dyn ProcessGroup>,
    count: Arc<AtomicU64>,
}

impl CountingGroup {
    /// `inner`, counting into `count`.
    pub fn new(inner: Arc<dyn ProcessGroup>, count: Arc<AtomicU64>) -> Self {
        Self { inner, count }
    }

    fn counted(&self) {
        self.count.fetch_add(1, Ordering::Relaxed);
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
        self.counted();
        self.inner.all_reduce(bucket, op, timeout)
    }

    fn broadcast(&self, buffer: &mut [f32], root: usize, timeout: Duration) -> Result<()> {
        self.counted();
        self.inner.broadcast(buffer, root, timeout)
    }

    fn barrier(&self, timeout: Duration) -> Result<()> {
        self.counted();
        self.inner.barrier(timeout)
    }

    fn all_gather(&self, values: &[u64], timeout: Duration) -> Result<Vec<u64>> {
        self.counted();
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
        self.counted();
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
        self.counted();
        self.inner.all_reduce_device(tensor, op, timeout)
    }

    fn all_gather_f32(&self, send: &[f32], recv: &mut [f32], timeout: Duration) -> Result<()> {
        self.counted();
        self.inner.all_gather_f32(send, recv, timeout)
    }

    fn reduce_scatter(
        &self,
        send: &[f32],
        recv: &mut [f32],
        op: ReduceOp,
        timeout: Duration,
    ) -> Result<()> {
        self.counted();
        self.inner.reduce_scatter(send, recv, op, timeout)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::group::ThreadGroup;

    #[test]
    fn every_collective_is_counted_once_and_forwarded() {
        let timeout = Duration::from_secs(10);
        let groups = ThreadGroup::new_group(2).unwrap();
        let counts: Vec<u64> = std::thread::scope(|s| {
            let handles: Vec<_> = groups
                .into_iter()
                .map(|g| {
                    s.spawn(move || {
                        let count = Arc::new(AtomicU64::new(0));
                        let group = CountingGroup::new(Arc::new(g), count.clone());
                        let mut bucket = vec![group.rank() as f32 + 1.0; 3];
                        group
                            .all_reduce(&mut bucket, ReduceOp::Sum, timeout)
                            .unwrap();
                        assert_eq!(bucket, vec![3.0; 3]);
                        let all = group.all_gather(&[group.rank() as u64], timeout).unwrap();
                        assert_eq!(all, vec![0, 1]);
                        group.barrier(timeout).unwrap();
                        let _ = (group.world_size(), group.backend(), group.aborted());
                        count.load(Ordering::Relaxed)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(counts, vec![3, 3]);
    }
}
