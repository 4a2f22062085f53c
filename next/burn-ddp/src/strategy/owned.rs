//! A replica's own copy of a learner loaded on another thread. Burn's fusion (its wgpu and CUDA
//! backends) decides whether an operation may write a tensor in place from a count that threads
//! share, while each thread's operations run later, on its own stream: on Burn 0.21 replicas
//! that shared the loaded model and optimizer state overwrote each other's inputs (Adam's
//! moments after a resume, 1e-3 off the uninterrupted run, now and then). Copied through host
//! memory on the replica's thread (Burn 0.22's records hold host data), every tensor it trains
//! is its own. The CPU backends lose nothing by the copy but its time.

use std::time::Duration;

use burn::train::{Learner, LearnerModel};

use super::sharded::RecordReader;
use crate::error::Result;

/// Replaces `learner`'s model and optimizer state by copies made on this thread (through host
/// memory: Burn 0.22's records are host data, loaded onto each parameter's device). Call it on
/// the replica's thread before its first step.
///
/// # Errors
/// [`DdpError::Checkpoint`](crate::DdpError::Checkpoint) when the optimizer's record cannot be
/// read within `timeout`.
pub(super) fn own_learner<M: LearnerModel>(
    learner: &mut Learner<M>,
    records: &mut RecordReader<M>,
    rank: usize,
    timeout: Duration,
) -> Result<()> {
    let optimizer = records.read(learner, timeout).map_err(|e| match e {
        crate::DdpError::Checkpoint { path, detail } => crate::DdpError::Checkpoint {
            path,
            detail: format!("rank {rank}: cannot copy the resumed optimizer state: {detail}"),
        },
        other => other,
    })?;
    learner.load_model(learner.model().into_record());
    learner.load_optim(optimizer);
    Ok(())
}
