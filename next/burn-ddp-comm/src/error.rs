//! The error type of the communication layer.
//!
//! Every failure is a value that names what went wrong: the rank that saw it, the collective
//! operation and its sequence number, the timeout, and the peers involved. A failed collective also
//! aborts its process group, so every other rank fails too instead of waiting for a peer that will
//! never come. burn-ddp wraps it in its own error (`DdpError::Comm`).

use std::time::Duration;

use crate::group::collective::Collective;

/// Result type of the communication layer.
pub type Result<T, E = CommError> = std::result::Result<T, E>;

/// Everything that can go wrong in a process group, the store, the rendezvous or the launcher.
///
/// Variants that come from a collective carry `rank` (the rank that reports the error), `op` (the
/// collective, with its arguments) and `seq` (the collective's sequence number on that rank,
/// counted from 0 over all collectives of the process group). Sequence numbers let you line up the
/// logs of different ranks: the same `seq` is the same rendezvous on every rank.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CommError {
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
    /// written. Exit with [`PREEMPTED_EXIT_CODE`](crate::signals::PREEMPTED_EXIT_CODE).
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

impl CommError {
    /// The rank that reported this error, when it comes from a rank.
    pub fn rank(&self) -> Option<usize> {
        match self {
            CommError::Timeout { rank, .. }
            | CommError::PeerLeft { rank, .. }
            | CommError::Mismatch { rank, .. }
            | CommError::Aborted { rank, .. }
            | CommError::Rendezvous { rank, .. }
            | CommError::Connect { rank, .. }
            | CommError::WorkerExited { rank, .. }
            | CommError::Nccl { rank, .. } => Some(*rank),
            CommError::InvalidConfig(_)
            | CommError::LibraryNotFound { .. }
            | CommError::Topology(_)
            | CommError::Store { .. }
            | CommError::Launch(_)
            | CommError::Stopped { .. } => None,
        }
    }

    /// Whether this error only repeats an earlier failure ([`CommError::Aborted`]). When several
    /// ranks fail, the first non-`Aborted` error is the root cause.
    pub fn is_secondary(&self) -> bool {
        matches!(self, CommError::Aborted { .. })
    }

    /// The exit code for a process that ends with this error:
    /// [`PREEMPTED_EXIT_CODE`](crate::signals::PREEMPTED_EXIT_CODE) (143) for
    /// [`CommError::Stopped`] (the launcher stopped its job after a signal), 1 otherwise.
    pub fn exit_code(&self) -> i32 {
        match self {
            CommError::Stopped { .. } => crate::signals::PREEMPTED_EXIT_CODE,
            _ => 1,
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::group::ReduceOp;

    #[test]
    fn timeout_message_names_op_seq_timeout_and_missing_rank() {
        let err = CommError::Timeout {
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
