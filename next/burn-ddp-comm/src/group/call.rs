//! What every transport's collective shares: the call (rank, sequence number, operation,
//! deadline), numbered in program order and refused once the group is aborted; the errors it
//! ends in; and the division that ends an average.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::{Collective, ReduceOp, lock};
use crate::error::{CommError, Result};

/// One collective as a rank runs it, for its checks and its errors.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Call {
    /// The rank running it.
    pub(crate) rank: usize,
    /// Its sequence number on this rank (from 0, over all the group's collectives).
    pub(crate) seq: u64,
    /// The collective and its arguments.
    pub(crate) op: Collective,
    /// `None` when the timeout is too large to add to the clock (e.g. `Duration::MAX`): no limit.
    pub(crate) deadline: Option<Instant>,
    /// The timeout the caller gave.
    pub(crate) timeout: Duration,
}

impl Call {
    /// Call `seq` of `rank`, `op`, due within `timeout` from now.
    pub(crate) fn new(rank: usize, seq: u64, op: Collective, timeout: Duration) -> Self {
        Self {
            rank,
            seq,
            op,
            deadline: Instant::now().checked_add(timeout),
            timeout,
        }
    }

    /// Whether the deadline has passed.
    pub(crate) fn expired(&self) -> bool {
        self.deadline.is_some_and(|d| Instant::now() >= d)
    }

    /// The timeout of this call: `missing` did not arrive (empty when the transport cannot
    /// tell), `last_seen` the last collective each of them entered, where known.
    pub(crate) fn timed_out(
        &self,
        missing: Vec<usize>,
        last_seen: Vec<(usize, Option<u64>)>,
    ) -> CommError {
        CommError::Timeout {
            rank: self.rank,
            op: self.op,
            seq: self.seq,
            timeout: self.timeout,
            missing,
            last_seen,
        }
    }

    /// This call refused because the group was aborted earlier for `cause`.
    pub(crate) fn aborted(&self, cause: String) -> CommError {
        CommError::Aborted {
            rank: self.rank,
            op: self.op,
            seq: self.seq,
            cause,
        }
    }
}

/// A rank's collectives, in program order: their sequence numbers, and the reason of the first
/// abort, after which every call is refused.
#[derive(Debug, Default)]
pub(crate) struct Calls {
    seq: AtomicU64,
    aborted: Mutex<Option<String>>,
}

impl Calls {
    /// The next call of `rank`: `op`, due within `timeout`.
    ///
    /// # Errors
    /// [`CommError::Aborted`] once the group has been aborted (the call still takes its
    /// sequence number, as every rank's does).
    pub(crate) fn begin(&self, rank: usize, op: Collective, timeout: Duration) -> Result<Call> {
        let call = Call::new(rank, self.next(), op, timeout);
        match self.aborted() {
            Some(cause) => Err(call.aborted(cause)),
            None => Ok(call),
        }
    }

    /// Takes the next sequence number.
    pub(crate) fn next(&self) -> u64 {
        self.seq.fetch_add(1, Ordering::Relaxed)
    }

    /// The sequence number the next call will take.
    pub(crate) fn peek(&self) -> u64 {
        self.seq.load(Ordering::Relaxed)
    }

    /// Records `reason` as the group's abort unless one is recorded already; whether this was
    /// the first.
    pub(crate) fn abort(&self, reason: &str) -> bool {
        let mut aborted = lock(&self.aborted);
        if aborted.is_some() {
            return false;
        }
        *aborted = Some(reason.to_string());
        true
    }

    /// The reason of the group's abort, if it has been aborted.
    pub(crate) fn aborted(&self) -> Option<String> {
        lock(&self.aborted).clone()
    }
}

/// Ends an average: divides `values`, the sum over `world_size` ranks, by `world_size` when
/// `op` is [`ReduceOp::Avg`] (a sum is left alone).
pub(crate) fn finish_average(values: &mut [f32], op: ReduceOp, world_size: usize) {
    if op == ReduceOp::Avg {
        let divisor = world_size as f32;
        values.iter_mut().for_each(|v| *v /= divisor);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_are_numbered_in_order_and_refused_after_the_first_abort() {
        let calls = Calls::default();
        let op = Collective::Barrier;
        assert_eq!(calls.begin(2, op, Duration::MAX).unwrap().seq, 0);
        let first = calls.begin(2, op, Duration::from_secs(1)).unwrap();
        assert_eq!((first.rank, first.seq), (2, 1));
        assert!(first.deadline.is_some() && !first.expired());
        assert!(calls.abort("first"));
        assert!(!calls.abort("second"));
        match calls.begin(2, op, Duration::ZERO) {
            Err(CommError::Aborted {
                rank, seq, cause, ..
            }) => {
                assert_eq!((rank, seq, cause.as_str()), (2, 2, "first"));
            }
            other => panic!("expected the abort, got {other:?}"),
        }
        assert_eq!(calls.peek(), 3);
    }

    #[test]
    fn an_average_is_divided_and_a_sum_is_not() {
        let mut values = [3.0f32, -6.0];
        finish_average(&mut values, ReduceOp::Sum, 3);
        assert_eq!(values, [3.0, -6.0]);
        finish_average(&mut values, ReduceOp::Avg, 3);
        assert_eq!(values, [1.0, -2.0]);
    }
}
