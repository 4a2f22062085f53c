//! The one error type of burn-ddp.
//!
//! Every failure is a value that names what went wrong: the rank that saw it, the collective
//! operation and its sequence number, the timeout, and the peers involved. A failed collective also
//! aborts its process group, so every other rank fails too instead of waiting for a peer that will
//! never come.

use std::time::Duration;

use burn_ddp_comm::CommError;

/// Result type of burn-ddp.
pub type Result<T, E = DdpError> = std::result::Result<T, E>;

/// Everything that can go wrong in data-parallel training.
///
/// The collectives' errors come wrapped in [`DdpError::Comm`]: they carry `rank` (the rank that
/// reports the error), `op` (the collective, with its arguments) and `seq` (the collective's
/// sequence number on that rank, counted from 0 over all collectives of the process group), so the
/// logs of different ranks line up: the same `seq` is the same rendezvous on every rank. The other
/// variants name the rank and the step they come from.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DdpError {
    /// A collective, the store, the rendezvous, a connection between ranks or the launcher
    /// failed: [`CommError`] names the rank, the collective, its sequence number and the timeout
    /// (`Timeout`, `PeerLeft`, `Mismatch`, `Aborted`, `Nccl`, `Store`, `WorkerExited`, ...).
    #[error(transparent)]
    Comm(#[from] CommError),

    /// The replicas do not have the same parameters and buffers (count, kind, shape or order), so
    /// their gradient buckets would not line up.
    #[error("replicas differ (seen by rank {rank}): {detail}")]
    ReplicaMismatch {
        /// Rank reporting the error.
        rank: usize,
        /// The first difference, with the tensor's index, path and shapes.
        detail: String,
    },

    /// The model's tensors changed during training in a way the ranks cannot follow together: a
    /// layer added, removed or replaced after the process group was set up, a layer frozen or
    /// unfrozen on some ranks only, or gradients for tensors the model does not train. Reported
    /// by every rank at the same gradient synchronisation.
    #[error(
        "the model changed during training (seen by rank {rank} at gradient synchronisation #{step}): {detail}"
    )]
    ModelChanged {
        /// Rank reporting the error.
        rank: usize,
        /// The gradient synchronisation (0-based, counted over the run) at which it was seen.
        step: u64,
        /// What changed, naming the tensor (index, path, shapes) and the ranks.
        detail: String,
    },

    /// The ranks were not at the same point of training when they synchronised gradients: a
    /// rank skipped or repeated a synchronisation, or its batches hold another number of samples,
    /// or it trains with another learning rate or optimizer. Every rank reports it at the same
    /// synchronisation (found inside the gradient reduction; see `DistributedDataParallel`).
    #[error(
        "ranks out of step at gradient synchronisation #{sync} (seen by rank {rank}): {detail}"
    )]
    OutOfStep {
        /// Rank reporting the error.
        rank: usize,
        /// The gradient synchronisation (0-based, counted since the wrapper was built).
        sync: u64,
        /// What differs, naming the ranks and both values.
        detail: String,
    },

    /// Replicas that must be bit-identical are not (found by a consistency check).
    #[error(
        "replicas diverged by step {step} (seen by rank {rank}): tensor {tensor} differs from rank 0's on rank(s) {ranks:?}"
    )]
    ReplicasDiverged {
        /// Rank reporting the error.
        rank: usize,
        /// Optimizer steps done when the check ran.
        step: u64,
        /// The first differing tensor: index in registration order, path, kind and shape.
        tensor: String,
        /// Ranks whose values of that tensor differ from rank 0's.
        ranks: Vec<usize>,
    },

    /// The ranks do not have the same number of batches: some ran out while others still had data.
    #[error(
        "uneven data at step {step} of epoch {epoch} (seen by rank {rank}): rank(s) {exhausted:?} ran out of batches while rank(s) {remaining:?} still had one; use DistributedSampler shards (equal batch counts) or a dataset that divides evenly"
    )]
    UnevenData {
        /// Rank reporting the error.
        rank: usize,
        /// Epoch (1-based, as burn-train counts).
        epoch: usize,
        /// Step within the epoch (0-based).
        step: usize,
        /// Ranks without a batch.
        exhausted: Vec<usize>,
        /// Ranks that still had a batch.
        remaining: Vec<usize>,
    },

    /// The gradients of a step held NaN or infinity (with [`NonFinite::Error`](crate::config::NonFinite)).
    #[error(
        "non-finite gradients at step {step} of epoch {epoch} (seen by rank {rank}): NaN or infinity first appeared on rank(s) {ranks:?}"
    )]
    NonFinite {
        /// Rank reporting the error.
        rank: usize,
        /// Epoch (1-based).
        epoch: usize,
        /// Optimizer step within the epoch (0-based).
        step: u64,
        /// Ranks whose own gradients were not finite (empty if none was, e.g. an overflow in the
        /// sum).
        ranks: Vec<usize>,
    },

    /// Training stopped because a rank received a stop signal (SIGTERM, as clusters send before
    /// they preempt a job; SIGINT; SIGHUP): every rank stopped at the same optimizer step, and
    /// rank 0 wrote a checkpoint of it when a checkpoint directory is set. Exit with
    /// [`PREEMPTED_EXIT_CODE`](crate::checkpoint::PREEMPTED_EXIT_CODE) ([`DdpError::exit_code`]); a run with
    /// [`DdpConfig::with_resume`](crate::DdpConfig::with_resume) continues from there.
    #[error(
        "training stopped at batch {batches} of epoch {epoch} (seen by rank {rank}): {} received a stop signal; {}",
        describe_signalled(signalled),
        describe_checkpoint(checkpoint)
    )]
    Preempted {
        /// Rank reporting the error.
        rank: usize,
        /// The epoch in progress (burn-train counts from 1).
        epoch: usize,
        /// Batches of that epoch every rank had trained.
        batches: usize,
        /// The ranks that received a signal, with the signal.
        signalled: Vec<(usize, i32)>,
        /// The step checkpoint's state file, when a checkpoint directory is set.
        checkpoint: Option<String>,
    },

    /// A worker thread panicked (in user code, e.g. the model's `step`).
    #[error("rank {rank} panicked: {message}")]
    WorkerPanicked {
        /// The rank whose thread panicked.
        rank: usize,
        /// The panic message.
        message: String,
    },

    /// A rank did not stop within `waited` after another rank failed (its thread is stuck, e.g.
    /// in user code that never returns); it was left running.
    #[error(
        "rank {rank} did not stop within {} s after the training failed; it is still running (stuck outside burn-ddp's collectives?) and was left behind",
        waited.as_secs_f64()
    )]
    Unresponsive {
        /// The rank that did not stop.
        rank: usize,
        /// How long it was waited for.
        waited: Duration,
    },

    /// A thread rank waited `waited` (the collectives' timeout) for its next batch of a pass over
    /// a loader that the ranks of this process share (the validation loader, or a training
    /// loader that is not a `DistributedDataLoader`, read as one device reads it and dealt to
    /// each rank in turn): another rank of the pass stopped reading its own batches.
    #[error(
        "rank {rank} waited {} s for its next {loader} batch: the ranks of this process share one pass over that loader, and another rank stopped reading its batches (stuck or failed; its own error says why)",
        waited.as_secs_f64()
    )]
    LoaderStalled {
        /// The rank that waited.
        rank: usize,
        /// Which loader: `validation` or `training`.
        loader: &'static str,
        /// How long it waited.
        waited: Duration,
    },

    /// A rank's device failed to run the work queued on it (`Backend::sync` reported an
    /// execution error: a kernel that failed, a lost device).
    #[error("rank {rank}: the device failed while {operation}: {detail}")]
    Device {
        /// The rank whose device failed.
        rank: usize,
        /// What the rank was waiting for (`the step's forward and backward passes`).
        operation: String,
        /// The backend's error.
        detail: String,
    },

    /// A gradient or bucket did not have the shape, length or type the layout expects.
    #[error("rank {rank}: bucket {bucket}: {detail}")]
    Bucket {
        /// Rank reporting the error.
        rank: usize,
        /// Index of the bucket in the layout.
        bucket: usize,
        /// What was wrong.
        detail: String,
    },

    /// A checkpoint or DDP state file could not be written or read, or does not fit this run.
    #[error("checkpoint {path}: {detail}")]
    Checkpoint {
        /// The file.
        path: String,
        /// What went wrong.
        detail: String,
    },

    /// A configuration value or argument is invalid (names the value and why).
    #[error("invalid configuration: {0}")]
    InvalidConfig(String),
}

impl DdpError {
    /// The rank that reported this error, when it comes from a rank.
    pub fn rank(&self) -> Option<usize> {
        match self {
            DdpError::Comm(err) => err.rank(),
            DdpError::ReplicaMismatch { rank, .. }
            | DdpError::ReplicasDiverged { rank, .. }
            | DdpError::ModelChanged { rank, .. }
            | DdpError::OutOfStep { rank, .. }
            | DdpError::Preempted { rank, .. }
            | DdpError::UnevenData { rank, .. }
            | DdpError::NonFinite { rank, .. }
            | DdpError::WorkerPanicked { rank, .. }
            | DdpError::Unresponsive { rank, .. }
            | DdpError::LoaderStalled { rank, .. }
            | DdpError::Bucket { rank, .. }
            | DdpError::Device { rank, .. } => Some(*rank),
            DdpError::InvalidConfig(_) | DdpError::Checkpoint { .. } => None,
        }
    }

    /// Whether this error only repeats an earlier failure ([`CommError::Aborted`]). When several
    /// ranks fail, the first non-`Aborted` error is the root cause.
    pub fn is_secondary(&self) -> bool {
        matches!(self, DdpError::Comm(err) if err.is_secondary())
    }

    /// The exit code for a process that ends with this error:
    /// [`PREEMPTED_EXIT_CODE`](crate::checkpoint::PREEMPTED_EXIT_CODE) (143) for [`DdpError::Preempted`] (a
    /// graceful stop after a signal, checkpoint written), 1 otherwise.
    pub fn exit_code(&self) -> i32 {
        match self {
            DdpError::Preempted { .. } => burn_ddp_comm::signals::PREEMPTED_EXIT_CODE,
            DdpError::Comm(err) => err.exit_code(),
            _ => 1,
        }
    }
}

/// "rank 1 (SIGTERM)", "ranks 0 (SIGTERM), 1 (SIGINT)".
fn describe_signalled(signalled: &[(usize, i32)]) -> String {
    let each: Vec<String> = signalled
        .iter()
        .map(|(rank, signal)| format!("{rank} ({})", burn_ddp_comm::signals::name(*signal)))
        .collect();
    match each.len() {
        0 => "no rank".into(),
        1 => format!("rank {}", each[0]),
        _ => format!("ranks {}", each.join(", ")),
    }
}

fn describe_checkpoint(checkpoint: &Option<String>) -> String {
    match checkpoint {
        Some(path) => format!(
            "rank 0 wrote a checkpoint of that step ({path}); resume with DdpConfig::with_resume"
        ),
        None => "no checkpoint was written (set DdpConfig::with_checkpoint_dir)".into(),
    }
}

/// The message of a panic's payload.
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn_ddp_comm::group::{Collective, ReduceOp};

    #[test]
    fn a_communication_error_keeps_its_message_rank_and_exit_code() {
        let comm = CommError::Aborted {
            rank: 2,
            op: Collective::AllReduce {
                op: ReduceOp::Avg,
                len: 10,
            },
            seq: 7,
            cause: "rank 1 failed".into(),
        };
        let err = DdpError::from(comm.clone());
        assert_eq!(err.to_string(), comm.to_string());
        assert_eq!(err.rank(), Some(2));
        assert!(err.is_secondary());
        assert_eq!(err.exit_code(), 1);
        let stopped = DdpError::from(CommError::Stopped {
            signal: Some(15),
            detail: "stopped".into(),
        });
        assert_eq!(
            stopped.exit_code(),
            burn_ddp_comm::signals::PREEMPTED_EXIT_CODE
        );
        assert!(!DdpError::InvalidConfig("x".into()).is_secondary());
    }
}
