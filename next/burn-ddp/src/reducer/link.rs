//! What every part of the reducer talks through: the process group, the timeout of its
//! collectives, the communication counters, and how a bucket fails (the group is aborted first,
//! so that no peer waits for this rank's all-reduce).

use std::sync::Arc;
use std::time::Duration;

use crate::error::DdpError;
use crate::metrics::CommStats;
use burn_ddp_comm::group::ProcessGroup;

/// The reducer's process group, the timeout of every collective it issues, and its counters.
pub(super) struct Link {
    pub group: Arc<dyn ProcessGroup>,
    pub timeout: Duration,
    pub stats: CommStats,
}

impl Link {
    /// This rank.
    pub fn rank(&self) -> usize {
        self.group.rank()
    }

    /// A [`DdpError::Bucket`] for this rank, after aborting the group: the peers must not wait
    /// for this rank's all-reduce.
    pub fn fail_bucket(&self, bucket: usize, detail: String) -> DdpError {
        let err = DdpError::Bucket {
            rank: self.group.rank(),
            bucket,
            detail,
        };
        self.group.abort(&err.to_string());
        err
    }
}
