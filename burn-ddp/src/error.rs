//! The one error type of burn-ddp.
//!
//! Every failure is a value that names what went wrong: the rank that saw it, the collective
//! operation and its sequence number, the timeout, and the peers involved. A failed collective also
//! aborts its process group, so every other rank fails too instead of waiting for a peer that will
//! never come.

use std::time::Duration;

use crate::group::collective::Collective;

/// Result type of burn-ddp.
pub type Result<T, E = DdpError> = std::result::Result<T, E>;

/// Everything that can go wrong in data-parallel training.
///
/// Variants that come from a collective carry `rank` (the rank that reports the error), `op` (the
/// collective, with its arguments) and `seq` (the collective's sequence number on that rank,
/// counted from 0 over all collectives of the process group). Sequence numbers let you line up the
/// logs of different ranks: the same `seq` is the same rendezvous on every rank.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DdpError {
    /// A collective waited longer than its timeout for peers that did not arrive.
    #[error(
        "{op} #{seq} on rank {rank} timed out after {} s: {} did not arrive{}",
        timeout.as_secs_f64(),
        describe_ranks(missing),
        describe_last_seen(last_seen)
    )]
    Timeout {
        /// Rank reporting the error.
        rank: usize,
        /// The collective that timed out.
        op: Collective,
        /// Its sequence number.
        seq: u64,
        /// The timeout that passed.
        timeout: Duration,
        /// Ranks that had not arrived when the timeout passed.
        missing: Vec<usize>,
        /// For each missing rank, the sequence number of the last collective it entered, if any.
        last_seen: Vec<(usize, Option<u64>)>,
    },

    /// A peer left the process group (its handle was dropped: the thread ended, panicked or the
    /// process died) while this rank still expected it in a collective.
    #[error("{op} #{seq} on rank {rank}: rank {peer} left the process group ({reason})")]
    PeerLeft {
        /// Rank reporting the error.
        rank: usize,
        /// The collective this rank was in.
        op: Collective,
        /// Its sequence number.
        seq: u64,
        /// The rank that left.
        peer: usize,
        /// How it left, e.g. "panicked", "dropped its process group handle", "connection closed".
        reason: String,
    },

    /// Ranks called different collectives (or the same collective with different arguments) at the
    /// same point of their sequence. Every rank must issue the same collectives in the same order.
    #[error(
        "collective mismatch seen by rank {rank}: it called {op} #{seq}, but rank {peer} called {peer_op} #{peer_seq}"
    )]
    Mismatch {
        /// Rank reporting the error.
        rank: usize,
        /// What this rank called.
        op: Collective,
        /// Its sequence number on this rank.
        seq: u64,
        /// The first rank whose call differs.
        peer: usize,
        /// What that rank called.
        peer_op: Collective,
        /// Its sequence number on that rank.
        peer_seq: u64,
    },

    /// The process group was aborted by an earlier failure; no further collective can run on it.
    #[error("{op} #{seq} on rank {rank}: the process group was aborted earlier: {cause}")]
    Aborted {
        /// Rank reporting the error.
        rank: usize,
        /// The collective that was refused.
        op: Collective,
        /// Its sequence number.
        seq: u64,
        /// The failure that aborted the group.
        cause: String,
    },

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

    /// The environment does not describe a valid multi-process job (names the variable).
    #[error("job topology: {0}")]
    Topology(String),

    /// The rendezvous store could not be served or reached, or an operation on it failed.
    #[error("store {addr}: {op}: {detail}")]
    Store {
        /// The store's address.
        addr: String,
        /// The operation, with its key.
        op: String,
        /// What went wrong.
        detail: String,
    },

    /// The processes of the job did not meet: ranks missing after the timeout, a rank claimed
    /// twice, ranks that disagree on the world size.
    #[error("rendezvous failed on rank {rank}: {detail}")]
    Rendezvous {
        /// Rank reporting the error.
        rank: usize,
        /// What happened, naming the ranks involved.
        detail: String,
    },

    /// A connection between two ranks could not be set up.
    #[error("rank {rank}: connection with rank {peer} ({addr}): {detail}")]
    Connect {
        /// Rank reporting the error.
        rank: usize,
        /// The other rank.
        peer: usize,
        /// The address involved.
        addr: String,
        /// What went wrong.
        detail: String,
    },

    /// A worker process of the launcher failed (and the restarts, if any, are used up).
    #[error(
        "rank {rank} (pid {pid}) {how} (attempt {attempts} of the group){}",
        describe_left_early(left_early)
    )]
    WorkerExited {
        /// Global rank of the first worker that failed.
        rank: usize,
        /// Its process id.
        pid: u32,
        /// How it ended: "exited with code 3", "was killed by signal 9 (SIGKILL)".
        how: String,
        /// Attempts made (1 + restarts).
        attempts: u32,
        /// Ranks that had exited with code 0 while their peers were still training, before the
        /// failure: often its cause (a rank whose loop ended early leaves its peers waiting).
        left_early: Vec<usize>,
    },

    /// The launcher stopped its job because of a stop signal: it received SIGINT, SIGTERM or
    /// SIGHUP (and stopped its workers), or its workers stopped after one, their checkpoint
    /// written. Exit with [`PREEMPTED_EXIT_CODE`](crate::checkpoint::PREEMPTED_EXIT_CODE).
    #[error("launcher: {detail}")]
    Stopped {
        /// The signal the launcher received, if it received one.
        signal: Option<i32>,
        /// What happened to the workers.
        detail: String,
    },

    /// The launcher could not start a worker or prepare its logs.
    #[error("launcher: {0}")]
    Launch(String),

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

    /// A shared library loaded at run time (NCCL, the CUDA driver) could not be opened.
    #[error("cannot load {library}: tried {} ({detail}); {hint}", searched.join(", "))]
    LibraryNotFound {
        /// What was looked for, e.g. "NCCL".
        library: String,
        /// Every name and path tried, in order.
        searched: Vec<String>,
        /// The dynamic loader's message for the last one.
        detail: String,
        /// How to fix it.
        hint: String,
    },

    /// An NCCL or CUDA call failed, or a device buffer does not fit the collective.
    #[error("{op} #{seq} on rank {rank}: {code}: {detail}")]
    Nccl {
        /// Rank reporting the error.
        rank: usize,
        /// The operation: a collective, or the setup step (e.g. "ncclCommInitRankConfig").
        op: String,
        /// The collective's sequence number (0 for setup steps).
        seq: u64,
        /// The NCCL result or CUDA error name, e.g. "ncclInvalidUsage".
        code: String,
        /// What it means and what to check.
        detail: String,
    },
}

impl DdpError {
    /// The rank that reported this error, when it comes from a rank.
    pub fn rank(&self) -> Option<usize> {
        match self {
            DdpError::Timeout { rank, .. }
            | DdpError::PeerLeft { rank, .. }
            | DdpError::Mismatch { rank, .. }
            | DdpError::Aborted { rank, .. }
            | DdpError::ReplicaMismatch { rank, .. }
            | DdpError::ReplicasDiverged { rank, .. }
            | DdpError::ModelChanged { rank, .. }
            | DdpError::OutOfStep { rank, .. }
            | DdpError::Preempted { rank, .. }
            | DdpError::UnevenData { rank, .. }
            | DdpError::NonFinite { rank, .. }
            | DdpError::WorkerPanicked { rank, .. }
            | DdpError::Unresponsive { rank, .. }
            | DdpError::Bucket { rank, .. }
            | DdpError::Device { rank, .. }
            | DdpError::Rendezvous { rank, .. }
            | DdpError::Connect { rank, .. }
            | DdpError::WorkerExited { rank, .. }
            | DdpError::Nccl { rank, .. } => Some(*rank),
            DdpError::InvalidConfig(_)
            | DdpError::LibraryNotFound { .. }
            | DdpError::Topology(_)
            | DdpError::Store { .. }
            | DdpError::Launch(_)
            | DdpError::Stopped { .. }
            | DdpError::Checkpoint { .. } => None,
        }
    }

    /// Whether this error only repeats an earlier failure ([`DdpError::Aborted`]). When several
    /// ranks fail, the first non-`Aborted` error is the root cause.
    pub fn is_secondary(&self) -> bool {
        matches!(self, DdpError::Aborted { .. })
    }

    /// The exit code for a process that ends with this error:
    /// [`PREEMPTED_EXIT_CODE`](crate::checkpoint::PREEMPTED_EXIT_CODE) (143) for [`DdpError::Preempted`] (a
    /// graceful stop after a signal, checkpoint written), 1 otherwise.
    pub fn exit_code(&self) -> i32 {
        match self {
            DdpError::Preempted { .. } | DdpError::Stopped { .. } => {
                crate::signals::PREEMPTED_EXIT_CODE
            }
            _ => 1,
        }
    }
}

/// "rank 1 (SIGTERM)", "ranks 0 (SIGTERM), 1 (SIGINT)".
fn describe_signalled(signalled: &[(usize, i32)]) -> String {
    let each: Vec<String> = signalled
        .iter()
        .map(|(rank, signal)| format!("{rank} ({})", crate::signals::name(*signal)))
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

/// "rank 1" or "ranks 1, 2".
fn describe_ranks(ranks: &[usize]) -> String {
    match ranks {
        // NCCL does not say which peer is late.
        [] => "a peer".to_string(),
        [one] => format!("rank {one}"),
        many => format!(
            "ranks {}",
            many.iter()
                .map(usize::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

fn describe_last_seen(last_seen: &[(usize, Option<u64>)]) -> String {
    if last_seen.is_empty() {
        return String::new();
    }
    let parts: Vec<String> = last_seen
        .iter()
        .map(|(rank, seq)| match seq {
            Some(seq) => format!("rank {rank} last entered collective #{seq}"),
            None => format!("rank {rank} never entered a collective"),
        })
        .collect();
    format!(" ({})", parts.join(", "))
}

fn describe_left_early(ranks: &[usize]) -> String {
    match ranks {
        [] => String::new(),
        [rank] => format!(
            "; rank {rank} had exited with code 0 before it while its peers were still training \
             (a rank whose loop ended early, e.g. with fewer batches or steps, leaves its peers \
             waiting for it)"
        ),
        ranks => format!(
            "; ranks {ranks:?} had exited with code 0 before it while their peers were still \
             training (a rank whose loop ended early leaves its peers waiting for it)"
        ),
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
    use crate::group::ReduceOp;

    #[test]
    fn timeout_message_names_op_seq_timeout_and_missing_rank() {
        let err = DdpError::Timeout {
            rank: 0,
            op: Collective::AllReduce {
                op: ReduceOp::Avg,
                len: 10,
            },
            seq: 7,
            timeout: Duration::from_secs(2),
            missing: vec![1],
            last_seen: vec![(1, Some(6))],
        };
        let msg = err.to_string();
        assert_eq!(
            msg,
            "all_reduce(avg, 10 f32) #7 on rank 0 timed out after 2 s: rank 1 did not arrive \
             (rank 1 last entered collective #6)"
        );
        assert_eq!(err.rank(), Some(0));
        assert!(!err.is_secondary());
    }
}
