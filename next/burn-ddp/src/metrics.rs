//! Per-rank communication counters (the figures PyTorch DDP's logging reports). The rest of the
//! root crate's `metrics` (the training report, the metrics file's renderer) follows with the
//! strategy (stage 4 of the port).
//!
//! Times are wall-clock durations measured on the rank's thread. On asynchronous devices (CUDA)
//! a phase's time includes waiting for the device work queued before it.

use std::time::Duration;

/// Communication counters of one rank's [`Reducer`](crate::mechanism::Reducer).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CommStats {
    /// Gradient synchronisations (optimizer steps).
    pub steps: u64,
    /// Buckets all-reduced.
    pub buckets: u64,
    /// Bytes all-reduced by this rank (bucket sizes, `f32`, presence flags included).
    pub bytes: usize,
    /// Time spent flattening gradients into buckets.
    pub flatten: Duration,
    /// Time spent in all-reduce calls, including waiting for slower ranks.
    pub all_reduce: Duration,
    /// Time spent splitting buckets back into gradients.
    pub unflatten: Duration,
    /// Buckets sent as `f32` despite gradient compression, because their values spanned more
    /// than the 16-bit format's range (a bucket is scaled by one power of two, so values more
    /// than the format's normal range apart cannot all be kept).
    pub uncompressed_buckets: u64,
    /// Steps at which the trainable tensors changed on every rank (a layer frozen or unfrozen)
    /// and the buckets were rebuilt.
    pub layout_changes: u64,
    /// Moves of gradient data from the device to the host: on the host groups (threads, TCP,
    /// MPI) one per gradient on Burn's CPU backends (a copy in memory) and one per bucket on
    /// every other backend (wgpu: the bucket concatenated on the device); with NCCL none but
    /// one small read of the flags and checks per phase.
    pub transfers_to_host: u64,
    /// Moves of gradient data from the host to the device (as [`transfers_to_host`]).
    ///
    /// [`transfers_to_host`]: Self::transfers_to_host
    pub transfers_to_device: u64,
    /// Reductions through host buckets, all-reduced (the CPU process groups, and thread
    /// replicas that cannot share tensors): one per gradient synchronisation, two at a step
    /// whose trainable tensors changed (the tensors trained since go in a second reduction),
    /// the end-of-data check included. Which path ran, so that a test can say which it tested.
    pub host_phases: u64,
    /// Reductions reduce-scattered by owner, each rank keeping its own gradients
    /// ([`DdpConfig::with_gradient_sharding`](crate::DdpConfig::with_gradient_sharding)), counted
    /// as [`host_phases`](Self::host_phases).
    pub scattered_phases: u64,
    /// Reductions of device buckets (a group that reduces device tensors: NCCL), counted as
    /// [`host_phases`](Self::host_phases).
    pub device_phases: u64,
    /// Reductions of tensors shared by reference between thread replicas on one device
    /// ([`DdpConfig::with_shared_memory_reduction`](crate::DdpConfig::with_shared_memory_reduction)),
    /// counted as [`host_phases`](Self::host_phases).
    pub shared_phases: u64,
}

impl CommStats {
    /// Transfers to the host and to the device per step, averaged over [`steps`](Self::steps)
    /// (`(0, 0)` before the first step).
    pub fn transfers_per_step(&self) -> (f64, f64) {
        let steps = self.steps.max(1) as f64;
        (
            self.transfers_to_host as f64 / steps,
            self.transfers_to_device as f64 / steps,
        )
    }

    /// Total time in gradient synchronisation: flatten + all-reduce + unflatten.
    pub fn total(&self) -> Duration {
        self.flatten + self.all_reduce + self.unflatten
    }
}
