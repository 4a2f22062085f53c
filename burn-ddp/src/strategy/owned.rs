//! A replica's own copy of a learner loaded on another thread. Burn 0.21's fusion (its wgpu and
//! CUDA backends) decides whether an operation may write a tensor in place from a count that
//! threads share, while each thread's operations run later, on its own stream: replicas that
//! share the loaded model and optimizer state overwrite each other's inputs (Adam's moments
//! after a resume, 1e-3 off the uninterrupted run, now and then). Copied through host memory on
//! the replica's thread, every tensor it trains is its own. The CPU backends run at once and
//! lose nothing by the copy but its time.

use std::time::Duration;

use burn::record::{BinBytesRecorder, DoublePrecisionSettings, Recorder};
use burn::tensor::Device;
use burn::train::{Learner, LearningComponentsTypes, TrainingBackend};

use super::sharded::RecordReader;
use crate::error::{DdpError, Result};

/// Replaces `learner`'s model and optimizer state by copies made on this thread (through host
/// memory, in double precision: every value of a half, single or double precision tensor comes
/// back as it was). Call it on the replica's thread before its first step.
///
/// # Errors
/// [`DdpError::Checkpoint`] naming `rank` when a record cannot be read (the optimizer's within
/// `timeout`) or copied.
pub(super) fn own_learner<LC: LearningComponentsTypes>(
    learner: &mut Learner<LC>,
    records: &mut RecordReader<LC>,
    device: &Device<TrainingBackend<LC>>,
    rank: usize,
    timeout: Duration,
) -> Result<()> {
    let recorder = BinBytesRecorder::<DoublePrecisionSettings>::default();
    let failed = |what: &str, e: &dyn std::fmt::Display| DdpError::Checkpoint {
        path: String::new(),
        detail: format!("rank {rank}: cannot copy the resumed {what} for this replica: {e}"),
    };
    let model = recorder
        .record(burn::module::Module::into_record(learner.model()), ())
        .map_err(|e| failed("model", &e))?;
    let optimizer = records.read(learner, timeout)?;
    let optimizer = recorder
        .record(optimizer, ())
        .map_err(|e| failed("optimizer state", &e))?;
    learner.load_model(
        recorder
            .load(model, device)
            .map_err(|e| failed("model", &e))?,
    );
    learner.load_optim(
        recorder
            .load(optimizer, device)
            .map_err(|e| failed("optimizer state", &e))?,
    );
    Ok(())
}
