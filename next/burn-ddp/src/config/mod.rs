//! [`DdpConfig`]: the knobs of data-parallel training, with the defaults PyTorch DDP users expect
//! (here), the types of its settings (`settings.rs`), and its check and one-line description
//! (`check.rs`).

mod check;
mod settings;

use std::time::Duration;

pub use crate::compress::GradientCompression;
use burn_ddp_comm::group::DEFAULT_TIMEOUT;
pub use settings::{BufferSync, NonFinite, UnevenInputs, Validation};

/// Configuration of data-parallel training, shared by [`DdpStrategy`](crate::DdpStrategy) and
/// [`DistributedDataParallel`](crate::DistributedDataParallel).
///
/// ```
/// use std::time::Duration;
/// use burn_ddp::DdpConfig;
///
/// let config = DdpConfig::default()
///     .with_timeout(Duration::from_secs(60))
///     .with_bucket_cap_bytes(4 * 1024 * 1024);
/// assert_eq!(config.bucket_cap_bytes(), 4 * 1024 * 1024);
/// println!("{config}"); // one line, for start-up logs
/// ```
#[derive(Debug, Clone)]
pub struct DdpConfig {
    timeout: Duration,
    epoch_end_timeout: Duration,
    bucket_cap_bytes: usize,
    first_bucket_cap_bytes: usize,
    consistency_check_every: u64,
    non_finite: NonFinite,
    clip_grad_norm: Option<f32>,
    buffer_sync: BufferSync,
    uneven_inputs: UnevenInputs,
    checkpoint_dir: Option<std::path::PathBuf>,
    gradient_compression: GradientCompression,
    resume: bool,
    resume_from: Option<std::path::PathBuf>,
    overwrite_checkpoints: bool,
    run_id: Option<String>,
    checkpoint_every: u64,
    stop_on_signal: bool,
    comm_hook: Option<std::sync::Arc<dyn crate::hooks::CommHook>>,
    validation: Validation,
    metrics_every: usize,
    summary: bool,
    spike_factor: f64,
    optimizer_sharding: bool,
    gradient_sharding: bool,
    shared_memory_reduction: bool,
    metrics_file: Option<std::path::PathBuf>,
    /// Where burn-ddp's checkpointers ([`checkpointers`](Self::checkpointers)) note what they
    /// wrote, for the strategy that binds an epoch's records to its state (shared by clones).
    ledger: crate::checkpoint::Ledger,
}

impl PartialEq for DdpConfig {
    /// Equal settings; hooks compare by [name](crate::hooks::CommHook::name).
    fn eq(&self, other: &Self) -> bool {
        let hook = |c: &Self| c.comm_hook.as_ref().map(|h| h.name());
        self.timeout == other.timeout
            && self.epoch_end_timeout == other.epoch_end_timeout
            && self.bucket_cap_bytes == other.bucket_cap_bytes
            && self.first_bucket_cap_bytes == other.first_bucket_cap_bytes
            && self.consistency_check_every == other.consistency_check_every
            && self.non_finite == other.non_finite
            && self.clip_grad_norm.map(f32::to_bits) == other.clip_grad_norm.map(f32::to_bits)
            && self.buffer_sync == other.buffer_sync
            && self.uneven_inputs == other.uneven_inputs
            && self.checkpoint_dir == other.checkpoint_dir
            && self.gradient_compression == other.gradient_compression
            && self.resume == other.resume
            && self.resume_from == other.resume_from
            && self.overwrite_checkpoints == other.overwrite_checkpoints
            && self.run_id == other.run_id
            && self.checkpoint_every == other.checkpoint_every
            && self.stop_on_signal == other.stop_on_signal
            && hook(self) == hook(other)
            && self.validation == other.validation
            && self.metrics_every == other.metrics_every
            && self.summary == other.summary
            && self.spike_factor.to_bits() == other.spike_factor.to_bits()
            && self.optimizer_sharding == other.optimizer_sharding
            && self.gradient_sharding == other.gradient_sharding
            && self.shared_memory_reduction == other.shared_memory_reduction
            && self.metrics_file == other.metrics_file
    }
}

impl Default for DdpConfig {
    fn default() -> Self {
        Self {
            timeout: DEFAULT_TIMEOUT,
            epoch_end_timeout: Self::DEFAULT_EPOCH_END_TIMEOUT,
            bucket_cap_bytes: Self::DEFAULT_BUCKET_CAP_BYTES,
            first_bucket_cap_bytes: Self::DEFAULT_FIRST_BUCKET_CAP_BYTES,
            consistency_check_every: 0,
            non_finite: NonFinite::default(),
            clip_grad_norm: None,
            buffer_sync: BufferSync::default(),
            uneven_inputs: UnevenInputs::default(),
            checkpoint_dir: None,
            gradient_compression: GradientCompression::None,
            resume: false,
            resume_from: None,
            overwrite_checkpoints: false,
            run_id: None,
            checkpoint_every: 0,
            stop_on_signal: true,
            comm_hook: None,
            validation: Validation::default(),
            metrics_every: Self::DEFAULT_METRICS_EVERY,
            summary: true,
            spike_factor: Self::DEFAULT_SPIKE_FACTOR,
            optimizer_sharding: false,
            gradient_sharding: false,
            shared_memory_reduction: true,
            metrics_file: None,
            ledger: crate::checkpoint::Ledger::default(),
        }
    }
}

impl DdpConfig {
    /// Size cap of a gradient bucket: 25 MiB, PyTorch DDP's `bucket_cap_mb` default.
    pub const DEFAULT_BUCKET_CAP_BYTES: usize = 25 * 1024 * 1024;

    /// Size cap of the first bucket (the last parameters of the model, whose gradients are ready
    /// first): 1 MiB, PyTorch's `torch.distributed._DEFAULT_FIRST_BUCKET_BYTES`.
    pub const DEFAULT_FIRST_BUCKET_CAP_BYTES: usize = 1024 * 1024;

    /// Steps between two sends of the step outputs to rank 0 in process mode (for burn-train's
    /// metrics): 20, so a step stays one collective on 19 steps in 20 and rank 0's progress lags by
    /// at most 20 steps.
    pub const DEFAULT_METRICS_EVERY: usize = 20;

    /// Default spike factor: a gradient synchronisation over 3 times the running median is a spike
    /// ([`DdpConfig::with_spike_factor`]; our choice: PyTorch has no such check, and 3x stays clear
    /// of the jitter of a loaded CPU machine while catching a stalled link or a straggler).
    pub const DEFAULT_SPIKE_FACTOR: f64 = 3.0;

    /// Default timeout of the collectives that wait while rank 0 validates and writes checkpoints at
    /// the end of an epoch: 30 minutes (PyTorch's Gloo default timeout).
    pub const DEFAULT_EPOCH_END_TIMEOUT: Duration = Duration::from_secs(30 * 60);

    /// Timeout of every collective during training steps (default [`DEFAULT_TIMEOUT`], 300 s).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Timeout of the end-of-epoch collectives, which wait while rank 0 runs validation and writes
    /// checkpoints (default [`DdpConfig::DEFAULT_EPOCH_END_TIMEOUT`], 30 min).
    pub fn with_epoch_end_timeout(mut self, timeout: Duration) -> Self {
        self.epoch_end_timeout = timeout;
        self
    }

    /// Size cap of a gradient bucket in bytes of `f32` gradients (default
    /// [`DdpConfig::DEFAULT_BUCKET_CAP_BYTES`], 25 MiB). A parameter larger than the cap gets a bucket of its
    /// own.
    pub fn with_bucket_cap_bytes(mut self, bytes: usize) -> Self {
        self.bucket_cap_bytes = bytes;
        self
    }

    /// Size cap of the first bucket in bytes (default [`DdpConfig::DEFAULT_FIRST_BUCKET_CAP_BYTES`], 1 MiB).
    pub fn with_first_bucket_cap_bytes(mut self, bytes: usize) -> Self {
        self.first_bucket_cap_bytes = bytes;
        self
    }

    /// Checks every `steps` optimizer steps that all replicas hold bit-identical parameters and
    /// buffers (one all-gather of one `u64`, plus hashing the model's values on the host); 0, the
    /// default, never checks. A failed check is a
    /// [`DdpError::ReplicasDiverged`](crate::DdpError::ReplicasDiverged) naming the first
    /// differing tensor and ranks.
    pub fn with_consistency_check_every(mut self, steps: u64) -> Self {
        self.consistency_check_every = steps;
        self
    }

    /// What to do with NaN or infinite gradients (default [`NonFinite::SkipStep`]).
    pub fn with_non_finite(mut self, policy: NonFinite) -> Self {
        self.non_finite = policy;
        self
    }

    /// Clips the averaged gradients to this global 2-norm over all parameters before every
    /// optimizer step, with `torch.nn.utils.clip_grad_norm_`'s formula (multiply by
    /// `max_norm / (norm + 1e-6)` when that is below 1). Identical on every rank. Burn's own
    /// per-tensor clipping (the optimizer's `GradientClipping`) stays available beside it.
    pub fn with_clip_grad_norm(mut self, max_norm: f32) -> Self {
        self.clip_grad_norm = Some(max_norm);
        self
    }

    /// How buffers are kept identical (default [`BufferSync::Average`]).
    pub fn with_buffer_sync(mut self, sync: BufferSync) -> Self {
        self.buffer_sync = sync;
        self
    }

    /// What to do with ranks that have different numbers of batches (default
    /// [`UnevenInputs::Error`]).
    pub fn with_uneven_inputs(mut self, mode: UnevenInputs) -> Self {
        self.uneven_inputs = mode;
        self
    }

    /// The checkpoint directory: use burn-train's, `<artifact dir>/checkpoint`. Rank 0 writes
    /// `ddp-state-<epoch>.json` there after every epoch burn-train checkpoints (world size,
    /// epoch, optimizer steps, the SHA-256 of the records written with
    /// [`checkpointers`](Self::checkpointers)), atomically,
    /// next to burn-train's epoch checkpoints, and burn-ddp's step checkpoints (after
    /// a stop signal, or [`with_checkpoint_every`](Self::with_checkpoint_every)); with
    /// [`with_resume`](Self::with_resume) a run starts from the newest complete checkpoint in
    /// it. Without a directory, a stop signal still stops every rank at the same step, but
    /// nothing is written.
    pub fn with_checkpoint_dir(mut self, dir: impl Into<std::path::PathBuf>) -> Self {
        self.checkpoint_dir = Some(dir.into());
        self
    }

    /// burn-ddp's checkpointers of burn-train's epoch checkpoints in the [checkpoint
    /// directory](Self::with_checkpoint_dir), for the model, the optimizer and the LR scheduler:
    /// give them to `SupervisedTraining::with_custom_checkpointers` instead of
    /// `with_default_checkpointers`. They write burn-train's files (`model-<epoch>.bpk`, ...)
    /// atomically (never half written) and tell the strategy which files they wrote and their
    /// SHA-256, which the epoch's state file then holds: a resume takes an epoch checkpoint only
    /// with the very records written for it (see [`checkpoint`](crate::checkpoint)).
    ///
    /// ```
    /// # fn main() -> burn_ddp::Result<()> {
    /// let config = burn_ddp::DdpConfig::default().with_checkpoint_dir("artifacts/checkpoint");
    /// let [model, optim, scheduler] = config.checkpointers()?;
    /// // training.with_custom_checkpointers(model, optim, scheduler)
    /// # let _ = (model, optim, scheduler);
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    /// [`DdpError::InvalidConfig`](crate::DdpError::InvalidConfig) when no checkpoint directory
    /// is set.
    pub fn checkpointers(&self) -> crate::Result<[crate::checkpoint::RecordCheckpointer; 3]> {
        let dir = self.checkpoint_dir.as_deref().ok_or_else(|| {
            crate::DdpError::InvalidConfig(
                "DdpConfig::checkpointers: no checkpoint directory; set \
                 DdpConfig::with_checkpoint_dir(<artifact dir>/checkpoint) first"
                    .into(),
            )
        })?;
        Ok(crate::checkpoint::Checkpoints::epoch_checkpointers(
            dir,
            &self.ledger,
        ))
    }

    /// The ledger [`checkpointers`](Self::checkpointers) note their writes in.
    pub(crate) fn ledger(&self) -> &crate::checkpoint::Ledger {
        &self.ledger
    }

    /// Continue this run from its newest complete checkpoint in the [checkpoint
    /// directory](Self::with_checkpoint_dir) (default off): burn-train's epoch checkpoints and
    /// burn-ddp's step checkpoints **of this run** (their state files carry the run id, see
    /// [`with_run_id`](Self::with_run_id)) are candidates, newest first; one that does not load
    /// (truncated, unreadable) is passed over with a warning naming it. A step checkpoint resumes
    /// mid-epoch, skipping the batches already trained, so the run continues as the
    /// uninterrupted one would (bit for bit, without dropout-style randomness: the backend's
    /// random state is not part of a checkpoint). A step checkpoint of another world size is
    /// refused; an epoch boundary re-shards (see the README). Another run's checkpoints are never
    /// taken: when the directory holds only those, or nothing, the run fails with
    /// [`DdpError::Checkpoint`](crate::DdpError::Checkpoint) naming the file and both run ids (resume another run's checkpoint
    /// with [`with_resume_from`](Self::with_resume_from)). A launcher's restart resumes the same
    /// way by itself, but starts afresh with a warning when there is nothing of the run to
    /// resume. Needs no `SupervisedTraining::checkpoint(epoch)`; when that is given too, only
    /// newer checkpoints are considered.
    pub fn with_resume(mut self, resume: bool) -> Self {
        self.resume = resume;
        self
    }

    /// Start from a checkpoint you point at, whichever run wrote it: a step checkpoint's state
    /// file (`ddp-step-<run tag>-<n>.json`), an epoch's (`ddp-state-<epoch>.json`, whose burn-train
    /// checkpoint is in the checkpoint directory), or a directory (its newest complete
    /// checkpoint). Implies [`with_resume`](Self::with_resume).
    pub fn with_resume_from(mut self, path: impl Into<std::path::PathBuf>) -> Self {
        self.resume_from = Some(path.into());
        self.resume = true;
        self
    }

    /// Lets this run write burn-train's epoch checkpoints into a [checkpoint
    /// directory](Self::with_checkpoint_dir) that holds another run's (default off: such a run
    /// is refused at start-up, naming the directory and the other run, since burn-train's files
    /// of an epoch, `model-<epoch>` and so on, carry no run and would be overwritten, and its
    /// checkpointing strategy would delete older ones). burn-ddp's own step checkpoints are kept
    /// per run and never touched by another run, with or without this. A run resumed from
    /// another's checkpoint ([`with_resume_from`](Self::with_resume_from)) continues that run
    /// and needs no permission.
    pub fn with_overwrite_checkpoints(mut self, overwrite: bool) -> Self {
        self.overwrite_checkpoints = overwrite;
        self
    }

    /// Whether this run may overwrite another run's epoch checkpoints.
    pub fn overwrite_checkpoints(&self) -> bool {
        self.overwrite_checkpoints
    }

    /// The run id checkpoints are written and resumed under (default: `BURN_DDP_RUN_ID`, the
    /// launcher's or the scheduler's job id, else one made per process: a new process is a new
    /// run unless told otherwise).
    pub fn with_run_id(mut self, run_id: impl Into<String>) -> Self {
        self.run_id = Some(run_id.into());
        self
    }

    /// The checkpoint to resume from whichever run wrote it, if set.
    pub fn resume_from(&self) -> Option<&std::path::Path> {
        self.resume_from.as_deref()
    }

    /// The run id set with [`with_run_id`](Self::with_run_id), if any.
    pub fn run_id(&self) -> Option<&str> {
        self.run_id.as_deref()
    }

    /// Rank 0 writes a step checkpoint every `steps` optimizer steps (0, the default: only at
    /// the end of epochs and after a stop signal), into the [checkpoint
    /// directory](Self::with_checkpoint_dir): full-precision records read back before they
    /// count, the last two kept. For long epochs on machines that may be lost without warning.
    pub fn with_checkpoint_every(mut self, steps: u64) -> Self {
        self.checkpoint_every = steps;
        self
    }

    /// Whether SIGTERM, SIGINT and SIGHUP stop training gracefully (default `true`): while a
    /// run lasts, the first such signal to any rank makes every rank stop at the next optimizer
    /// step, rank 0 write a checkpoint of it (with a checkpoint directory), and the run end with
    /// [`DdpError::Preempted`](crate::DdpError::Preempted) (`launch_ddp`), or the process exit with
    /// [`PREEMPTED_EXIT_CODE`](crate::checkpoint::PREEMPTED_EXIT_CODE) (plain `launch`); a second signal
    /// ends the process at once. `false` leaves the signals' default effect.
    pub fn with_stop_on_signal(mut self, stop: bool) -> Self {
        self.stop_on_signal = stop;
        self
    }

    /// Where validation runs (default [`Validation::Sharded`]: every rank validates its shard,
    /// rank 0 reports metrics over the whole set).
    pub fn with_validation(mut self, validation: Validation) -> Self {
        self.validation = validation;
        self
    }

    /// Where validation runs.
    pub fn validation(&self) -> Validation {
        self.validation
    }

    /// Process mode: the ranks send their step outputs to rank 0 (for burn-train's metrics and
    /// renderer) every `steps` steps and at the end of every epoch (default
    /// [`DdpConfig::DEFAULT_METRICS_EVERY`]; 0 counts as 1). Threads send theirs at once.
    pub fn with_metrics_every(mut self, steps: usize) -> Self {
        self.metrics_every = steps.max(1);
        self
    }

    /// Steps between two sends of the step outputs to rank 0 (process mode).
    pub fn metrics_every(&self) -> usize {
        self.metrics_every
    }

    /// Whether rank 0 prints the end-of-training summary (samples/s per epoch; per rank compute,
    /// communication and optimizer time, utilization, synchronisation times and spikes, peak
    /// memory) to stderr (default `true`). The same figures are in
    /// [`DdpStrategy::report`](crate::DdpStrategy::report).
    pub fn with_summary(mut self, summary: bool) -> Self {
        self.summary = summary;
        self
    }

    /// Whether rank 0 prints the end-of-training summary.
    pub fn summary(&self) -> bool {
        self.summary
    }

    /// A gradient synchronisation that takes more than `factor` times the median of the
    /// previous 64 is a spike: counted in [`SyncTimes`](crate::metrics::SyncTimes), and the first
    /// three on each rank logged as warnings naming the rank and the step (default
    /// [`DdpConfig::DEFAULT_SPIKE_FACTOR`], 3). `factor` must be above 1
    /// ([`validate`](Self::validate)).
    pub fn with_spike_factor(mut self, factor: f64) -> Self {
        self.spike_factor = factor;
        self
    }

    /// The spike factor.
    pub fn spike_factor(&self) -> f64 {
        self.spike_factor
    }

    /// Shards the optimizer state (ZeRO stage 1, PyTorch's `ZeroRedundancyOptimizer`), around
    /// Burn's own `ModuleOptimizer` (no wrapper: the sharding is in the optimizer step): each rank
    /// owns a share of the parameters (whole tensors, the trainable bytes balanced: see
    /// [`OptimizerShards`](crate::mechanism::OptimizerShards)), runs the optimizer step on its own
    /// parameters only, so Burn's optimizer keeps state (Adam's two moments) for those only, and
    /// the updated parameters are all-gathered inside the optimizer step (one
    /// [`all_gather_f32`](burn_ddp_comm::group::ExtendedCollectives::all_gather_f32) per step). Optimizer
    /// memory per rank falls by the world size (as far as whole tensors allow), and so does the
    /// optimizer step's work, but the all-gather adds time back (on the benchmark's 2-core CPU
    /// as much as it saves, see `bench/README.md`); the gradients are still all-reduced, so
    /// clipping, the NaN check, the hooks and the model's `optimize` see them whole
    /// ([`with_gradient_sharding`](Self::with_gradient_sharding) reduce-scatters them instead). Checkpoints hold the whole optimizer
    /// state (gathered on rank 0), so a run resumes with another world size or without sharding;
    /// while one is written, rank 0 holds the whole state again and every rank every share in
    /// host memory.
    /// [`DistributedDataParallel::optimizer_step`](crate::DistributedDataParallel::optimizer_step)
    /// shards any `ModuleOptimizer` (parameter groups included). Limits: the parameters' all-gather
    /// goes through host memory (NCCL's too), and the first steps' check that every rank runs the
    /// same optimizer cannot see a difference (the all-gather makes the parameters equal).
    /// Default `false`. Every rank must use the same setting, and under sharding the same
    /// checkpointing (checked at start-up).
    pub fn with_optimizer_sharding(mut self, shard: bool) -> Self {
        self.optimizer_sharding = shard;
        self
    }

    /// Whether the optimizer state is sharded.
    pub fn optimizer_sharding(&self) -> bool {
        self.optimizer_sharding
    }

    /// Shards the reduced gradients too (ZeRO stage 2; DeepSpeed's stage 2, FSDP's
    /// `SHARD_GRAD_OP`), on top of [`with_optimizer_sharding`](Self::with_optimizer_sharding):
    /// the ranks' gradients are reduce-scattered by owner instead of all-reduced, so each rank
    /// receives only the reduced gradients of the parameters it owns and steps, and a ring moves
    /// half the bytes of an all-reduce for them (with the parameters' all-gather, a sharded step
    /// then moves what plain DDP's all-reduce does, where it moved 1.5 times that;
    /// [`RankReport::bus_bytes_per_step`](crate::metrics::RankReport::bus_bytes_per_step)). The
    /// NaN check and [`with_clip_grad_norm`](Self::with_clip_grad_norm) still see every
    /// gradient (each owner's part, gathered). The model's `optimize` receives only this rank's
    /// own gradients: clip with [`with_clip_grad_norm`](Self::with_clip_grad_norm), not inside
    /// `optimize`, and do not read the other parameters' gradients there. Host buckets only
    /// (every CPU group; thread replicas on one device already reduce by owner, see
    /// [`with_shared_memory_reduction`](Self::with_shared_memory_reduction), and NCCL all-reduces
    /// device buckets); with a communication hook or gradient compression, or a model whose
    /// largest owner's share is over twice the average (one tensor larger than all the others
    /// together: the padded blocks would send more than an all-reduce), the gradients are
    /// all-reduced and the others' dropped. Default `false`.
    ///
    /// # Errors
    /// [`validate`](Self::validate) refuses it without optimizer-state sharding.
    pub fn with_gradient_sharding(mut self, shard: bool) -> Self {
        self.gradient_sharding = shard;
        self
    }

    /// Whether the reduced gradients are sharded
    /// ([`with_gradient_sharding`](Self::with_gradient_sharding)).
    pub fn gradient_sharding(&self) -> bool {
        self.gradient_sharding
    }

    /// Lets replicas that are threads of one process on one device of Burn's CPU backends
    /// (NdArray, Flex: every CPU replica of a thread run) hand each other their tensors by reference
    /// instead of copying them through host buckets: each rank sums the gradients of the
    /// parameters it owns over every replica with the backend's own tensor ops and every replica
    /// takes the reduced tensors as they are (see [`Reducer`](crate::mechanism::Reducer)); under
    /// optimizer-state sharding each rank also takes the others' updated parameters as they are,
    /// instead of an all-gather. The results are those of the host buckets up to the rounding of
    /// the sum (the ranks are summed in rank order). Ranks in separate processes, or threads on
    /// different devices, find out at the first step and use the host buckets; a communication
    /// hook or gradient compression keeps the host buckets too, and so do wgpu and CUDA, where a
    /// tensor is a handle into its thread's stream that Burn 0.21's fusion cannot share with
    /// another thread (several replicas on one GPU: host buckets). Default `true`; `false` keeps
    /// the host buckets everywhere (to compare). Every rank must use the same setting.
    pub fn with_shared_memory_reduction(mut self, shared: bool) -> Self {
        self.shared_memory_reduction = shared;
        self
    }

    /// Whether thread replicas on one device share tensors
    /// ([`with_shared_memory_reduction`](Self::with_shared_memory_reduction)).
    pub fn shared_memory_reduction(&self) -> bool {
        self.shared_memory_reduction
    }

    /// Rank 0 appends the run's figures to `path` as JSON Lines, for plotting: one line per
    /// training step as rank 0 reports it to burn-train (`{"kind":"step","epoch","step",
    /// "samples","samples_per_s","lr","loss","step_ms","compute_ms","optimizer_ms",
    /// "peak_memory"}`: the step's global batch and its samples over rank 0's time for the step,
    /// the loss of burn-train's output types (mean over the global batch; for other outputs
    /// `samples`, `samples_per_s` and `loss` are `null`), rank 0's own times in milliseconds
    /// and its process's peak memory in bytes), and at the end one line per rank
    /// (`{"kind":"rank","rank","batches","compute_s","sync_s","optimizer_s","utilization",
    /// "sync_median_ms","sync_p90_ms","spikes","peak_memory","optimizer_state"}`, from
    /// [`RankReport`](crate::metrics::RankReport)). In process mode the step lines come in
    /// bursts of [`with_metrics_every`](Self::with_metrics_every). Lines are appended: a resumed
    /// run continues the file, and so does a new run at the same path (nothing in a line tells
    /// runs apart: give each run its own path). A file that cannot be written is a warning, not
    /// a failed run. Refused by [`DistributedDataParallel`](crate::DistributedDataParallel) (a
    /// custom loop writes its own). Default: none.
    pub fn with_metrics_file(mut self, path: impl Into<std::path::PathBuf>) -> Self {
        self.metrics_file = Some(path.into());
        self
    }

    /// The JSON Lines metrics file, if any.
    pub fn metrics_file(&self) -> Option<&std::path::Path> {
        self.metrics_file.as_deref()
    }

    /// Reduces the gradient buckets with `hook` instead of the built-in all-reduce (PyTorch's
    /// `register_comm_hook`; see [`hooks`](crate::hooks)). Every rank must install the same hook
    /// (its [name](crate::hooks::CommHook::name) is compared at start-up). The NaN/infinity
    /// check and clipping run on what the hook returns. Hooks reduce host buckets: with NCCL's
    /// group (CUDA devices) a hook is refused;
    /// [`with_gradient_compression`](Self::with_gradient_compression) works there too.
    pub fn with_comm_hook(mut self, hook: std::sync::Arc<dyn crate::hooks::CommHook>) -> Self {
        self.comm_hook = Some(hook);
        self
    }

    /// The communication hook installed with [`with_comm_hook`](Self::with_comm_hook), if any.
    pub fn comm_hook(&self) -> Option<&std::sync::Arc<dyn crate::hooks::CommHook>> {
        self.comm_hook.as_ref()
    }

    /// Whether to resume from the newest complete checkpoint.
    pub fn resume(&self) -> bool {
        self.resume
    }

    /// Optimizer steps between step checkpoints (0: none).
    pub fn checkpoint_every(&self) -> u64 {
        self.checkpoint_every
    }

    /// Whether stop signals stop training gracefully.
    pub fn stop_on_signal(&self) -> bool {
        self.stop_on_signal
    }

    /// The NaN/infinity policy.
    pub fn non_finite(&self) -> NonFinite {
        self.non_finite
    }

    /// The global-norm clipping threshold, if any.
    pub fn clip_grad_norm(&self) -> Option<f32> {
        self.clip_grad_norm
    }

    /// The buffer synchronisation.
    pub fn buffer_sync(&self) -> BufferSync {
        self.buffer_sync
    }

    /// The uneven-inputs mode.
    pub fn uneven_inputs(&self) -> UnevenInputs {
        self.uneven_inputs
    }

    /// The directory of the DDP state files, if any.
    pub fn checkpoint_dir(&self) -> Option<&std::path::Path> {
        self.checkpoint_dir.as_deref()
    }

    /// Optimizer steps between replica consistency checks (0: never).
    pub fn consistency_check_every(&self) -> u64 {
        self.consistency_check_every
    }

    /// Timeout of collectives during training steps.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Timeout of the end-of-epoch collectives.
    pub fn epoch_end_timeout(&self) -> Duration {
        self.epoch_end_timeout
    }

    /// Bucket cap in bytes.
    pub fn bucket_cap_bytes(&self) -> usize {
        self.bucket_cap_bytes
    }

    /// The dtype gradient buckets travel in (default [`GradientCompression::None`], `f32`).
    pub fn gradient_compression(&self) -> GradientCompression {
        self.gradient_compression
    }

    /// First bucket's cap in bytes.
    pub fn first_bucket_cap_bytes(&self) -> usize {
        self.first_bucket_cap_bytes
    }

    /// A hash of the settings that every rank must share (bucket caps, clipping, non-finite
    /// policy, uneven inputs, buffer sync, gradient compression, communication hook, the cadence
    /// of the consistency check and of step checkpoints), compared
    /// across ranks at start-up.
    pub(crate) fn semantics_fingerprint(&self) -> u64 {
        let text = format!(
            "{} {} {:?} {:?} {:?} {:?} {:?} {:?} {:?} {} {} {} {} {}",
            self.bucket_cap_bytes,
            self.first_bucket_cap_bytes,
            self.clip_grad_norm.map(f32::to_bits),
            self.non_finite,
            self.uneven_inputs,
            self.buffer_sync,
            self.gradient_compression,
            self.comm_hook.as_ref().map(|h| h.name()),
            (self.validation, self.metrics_every),
            // Both run collectives at their cadence.
            self.consistency_check_every,
            self.checkpoint_every,
            // The parameters' all-gather runs every step; the gradients are reduce-scattered.
            self.optimizer_sharding,
            self.gradient_sharding,
            // Thread replicas exchange tensors instead of running an all-reduce.
            self.shared_memory_reduction
        );
        text.bytes().fold(0xcbf2_9ce4_8422_2325u64, |hash, byte| {
            (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3)
        })
    }

    /// Sends gradient buckets as `bf16` or `f16` (half the bytes), like PyTorch DDP's
    /// `bf16_compress_hook`, scaled per bucket so that neither large nor tiny gradients are lost:
    /// the result matches the `f32` average within the 16-bit format's rounding, and a bucket the
    /// format cannot hold goes as `f32`, counted and reported (see
    /// [`CommStats::uncompressed_buckets`](crate::metrics::CommStats::uncompressed_buckets)). On every process group: NCCL's reduces
    /// 16-bit device buckets, the CPU groups run the [`Compress16`](crate::hooks::Compress16)
    /// hook ([`TcpGroup`](burn_ddp_comm::group::TcpGroup) sends half the bytes). Every rank must use the same
    /// setting.
    pub fn with_gradient_compression(mut self, compression: GradientCompression) -> Self {
        self.gradient_compression = compression;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_follow_pytorch_and_zero_values_are_rejected() {
        let config = DdpConfig::default();
        assert_eq!(config.bucket_cap_bytes(), 25 << 20);
        assert_eq!(config.first_bucket_cap_bytes(), 1 << 20);
        assert_eq!(config.timeout(), Duration::from_secs(300));
        assert!(config.validate().is_ok());
        assert_eq!(
            config.to_string(),
            "timeout 300 s, epoch-end timeout 1800 s, bucket cap 25 MiB (first 1 MiB)"
        );
        assert!(
            DdpConfig::default()
                .with_timeout(Duration::ZERO)
                .validate()
                .is_err()
        );
        assert!(
            DdpConfig::default()
                .with_bucket_cap_bytes(0)
                .validate()
                .is_err()
        );
    }
}
