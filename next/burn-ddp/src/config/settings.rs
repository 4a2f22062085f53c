//! The types of [`DdpConfig`](super::DdpConfig)'s settings that are not numbers.

/// What to do when the gradients of a step hold NaN or infinity (on any rank). The check runs on
/// the all-reduced gradients, so every rank reaches the same verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum NonFinite {
    /// Skip the optimizer step on every rank and count it in
    /// [`RankReport::skipped_steps`](crate::metrics::RankReport::skipped_steps), as mixed-precision
    /// loss scalers do. The learning-rate scheduler has stepped for the skipped step's batches
    /// (burn-train steps it before each forward pass): its learning rate is spent, as with
    /// PyTorch's `GradScaler`. The default.
    #[default]
    SkipStep,
    /// Stop training with [`DdpError::NonFinite`](crate::DdpError::NonFinite) naming the step and the ranks whose own
    /// gradients were not finite (found by an all-gather of per-rank flags).
    Error,
    /// No check (saves one pass over the gradients per step).
    Ignore,
}

/// How buffers (float tensors without gradients, e.g. BatchNorm running statistics) are kept
/// identical across replicas after every step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BufferSync {
    /// Replace each differing buffer by its average over the replicas. The default; for replicas
    /// that are threads, Burn's shared `RunningState` already does this.
    #[default]
    Average,
    /// Copy rank 0's buffers to every replica (PyTorch DDP's `broadcast_buffers=True`). Applies to
    /// replicas in separate processes; threads share Burn's `RunningState`, which averages.
    Broadcast,
    /// Leave buffers alone (replicas in separate processes then drift apart).
    None,
}

/// Where validation runs at the end of every epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Validation {
    /// Every process reads the validation loader as one device does (one copy, one pass per
    /// epoch), rank `r` validates the pass's batches `r, r + N, ...`, and rank 0 reports each
    /// batch as its own item, in the pass's order, so every metric equals single-device
    /// validation on the whole set, also with Burn's shuffled loaders. The default. Where one
    /// device's batches cannot reach every rank, rank 0 validates alone, with a warning at
    /// start-up: thread replicas on several devices or on wgpu and CUDA; between processes, a
    /// validation loader other than a [`DistributedDataLoader`](crate::DistributedDataLoader)
    /// (its order may differ between processes), or an output type burn-ddp cannot send (not a
    /// [`DistributedOutput`](crate::outputs::DistributedOutput): burn-train's classification,
    /// multi-label and regression outputs are).
    #[default]
    Sharded,
    /// Rank 0 validates the whole set while the other ranks wait, as single-device training
    /// does: for metrics that cannot be computed from joined outputs (a metric that keeps state
    /// across items in an order-dependent way, or an output type without a codec).
    Rank0,
}

/// What to do when ranks do not have the same number of batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum UnevenInputs {
    /// Stop with [`DdpError::UnevenData`](crate::DdpError::UnevenData): use `DistributedSampler` padding or `drop_last` so
    /// every rank has as many batches. The default.
    #[default]
    Error,
    /// PyTorch's `Join`: ranks that run out of batches keep taking part in the collectives with
    /// zero gradients, and every step's average is weighted by the number of real samples on each
    /// rank, so the result equals single-device training on the same samples. The training set is
    /// split into shards whose sizes differ by at most one, without padding or dropping.
    Join,
}
