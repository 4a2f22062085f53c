//! What a reducer is built with ([`ReducerOptions`]), what a reduction takes and gives
//! ([`ReduceOptions`], [`ReduceOutcome`]), and the control words that carry a step's layout
//! changes and the caller's words in its first bucket.

use std::sync::Arc;
use std::time::Duration;

use burn::optim::GradientsParams;

use crate::compress::GradientCompression;
use crate::config::DdpConfig;
use crate::error::{DdpError, Result};
use crate::hooks::CommHook;
use burn_ddp_comm::group::{DEFAULT_TIMEOUT, ReduceOp};

/// What a [`Reducer`](super::Reducer) is built with: the six settings of
/// [`DdpConfig`] it reads, with the same defaults (`DistributedDataParallel` hands them over
/// from its configuration).
///
/// ```
/// use burn_ddp::mechanism::ReducerOptions;
/// let options = ReducerOptions {
///     bucket_cap_bytes: 4 << 20,
///     ..ReducerOptions::default()
/// };
/// assert_eq!(options.first_bucket_cap_bytes, 1 << 20);
/// ```
#[derive(Debug, Clone)]
pub struct ReducerOptions {
    /// Timeout of every collective of the reducer (default 300 s,
    /// [`DEFAULT_TIMEOUT`](burn_ddp_comm::group::DEFAULT_TIMEOUT)).
    pub timeout: Duration,
    /// Size cap of the first bucket, in bytes (default
    /// [`DdpConfig::DEFAULT_FIRST_BUCKET_CAP_BYTES`], 1 MiB).
    pub first_bucket_cap_bytes: usize,
    /// Size cap of the other buckets, in bytes (default
    /// [`DdpConfig::DEFAULT_BUCKET_CAP_BYTES`], 25 MiB).
    pub bucket_cap_bytes: usize,
    /// How a host bucket is reduced (default: `None`, the built-in all-reduce or, with
    /// `gradient_compression`, the 16-bit hook).
    pub comm_hook: Option<Arc<dyn CommHook>>,
    /// The gradients' format on the wire (default [`GradientCompression::None`]).
    pub gradient_compression: GradientCompression,
    /// Whether thread replicas on one CPU device hand each other their gradient tensors instead
    /// of copying them through buckets (default `true`).
    pub shared_memory_reduction: bool,
}

impl Default for ReducerOptions {
    fn default() -> Self {
        Self {
            timeout: DEFAULT_TIMEOUT,
            first_bucket_cap_bytes: DdpConfig::DEFAULT_FIRST_BUCKET_CAP_BYTES,
            bucket_cap_bytes: DdpConfig::DEFAULT_BUCKET_CAP_BYTES,
            comm_hook: None,
            gradient_compression: GradientCompression::None,
            shared_memory_reduction: true,
        }
    }
}

impl ReducerOptions {
    /// `config`'s values of the settings a reducer reads.
    pub(crate) fn of(config: &DdpConfig) -> Self {
        Self {
            timeout: config.timeout(),
            first_bucket_cap_bytes: config.first_bucket_cap_bytes(),
            bucket_cap_bytes: config.bucket_cap_bytes(),
            comm_hook: config.comm_hook().cloned(),
            gradient_compression: config.gradient_compression(),
            shared_memory_reduction: config.shared_memory_reduction(),
        }
    }

    /// Checks the values.
    ///
    /// # Errors
    /// [`DdpError::InvalidConfig`] for a zero timeout or a zero bucket cap.
    pub(crate) fn validate(&self) -> Result<()> {
        if self.timeout.is_zero() {
            return Err(DdpError::InvalidConfig(
                "the reducer's timeout must be positive".into(),
            ));
        }
        if self.bucket_cap_bytes == 0 || self.first_bucket_cap_bytes == 0 {
            return Err(DdpError::InvalidConfig(format!(
                "bucket caps must be positive, got bucket_cap_bytes {} and \
                 first_bucket_cap_bytes {}",
                self.bucket_cap_bytes, self.first_bucket_cap_bytes
            )));
        }
        Ok(())
    }
}

/// The words the first bucket of every step carries after its presence flags: the reducer's own
/// two (did the model change) and the caller's ([`ReduceOptions::words`]). Summed (or averaged)
/// over the ranks, a word is positive when any rank set it.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Control {
    /// This rank's trainable tensors differ from the agreed layout (frozen or unfrozen).
    pub(super) trainable_changed: f32,
    /// This rank's model tensors differ from the agreed layout (added, removed, replaced), or it
    /// has gradients for tensors its model does not train.
    pub(super) structure_changed: f32,
    /// The caller's words.
    pub(super) words: Vec<f32>,
}

impl Control {
    /// The reducer's own words.
    const OWN: usize = 2;

    /// Number of words, the caller's included.
    pub(super) fn len(&self) -> usize {
        Self::OWN + self.words.len()
    }

    /// Number of words of a control with `caller` words of the caller's.
    pub(super) fn len_with(caller: usize) -> usize {
        Self::OWN + caller
    }

    pub(super) fn words(&self) -> Vec<f32> {
        let mut words = vec![self.trainable_changed, self.structure_changed];
        words.extend_from_slice(&self.words);
        words
    }

    /// The control of `caller` caller's words at the front of `words`.
    pub(super) fn from_words(words: &[f32], caller: usize) -> Option<Self> {
        let words = words.get(..Self::len_with(caller))?;
        Some(Self {
            trainable_changed: words[0],
            structure_changed: words[1],
            words: words[Self::OWN..].to_vec(),
        })
    }
}

/// How [`Reducer::reduce_with`](super::Reducer::reduce_with) combines the ranks' gradients.
#[derive(Debug, Clone, PartialEq)]
pub struct ReduceOptions {
    /// This rank's gradients are multiplied by `weight` before the all-reduce (default 1). Join
    /// mode weights each rank by its share of the step's samples and sums.
    pub weight: f32,
    /// The reduction ([`ReduceOp::Avg`] by default).
    pub op: ReduceOp,
    /// Clip the reduced gradients to this global 2-norm, as `torch.nn.utils.clip_grad_norm_`
    /// does: multiply by `max_norm / (norm + 1e-6)` when that is below 1.
    pub clip_norm: Option<f32>,
    /// Check the gradients for NaN and infinity (before and after the all-reduce).
    pub check_finite: bool,
    /// Words of the caller's, carried by the step's first bucket after the gradients (so they
    /// cost no collective of their own) and read back, reduced, in [`ReduceOutcome::words`]:
    /// votes and checks that every rank must see alike. Keep them small non-negative numbers
    /// (0 or 1): they travel on the bucket's wire (16-bit with compression) and are summed, or
    /// averaged, over the ranks, so after the reduction a word is positive exactly when some
    /// rank's was. At most [`ReduceOptions::MAX_WORDS`]; the bucket always carries that many (the
    /// rest zeros), so its size never depends on a rank's input. Default: none.
    pub words: Vec<f32>,
    /// Which of the model's float tensors (registration order, as
    /// [`TensorSpec::index`](crate::mechanism::TensorSpec::index)) get their reduced gradient
    /// written back into the result; `None`, all (the default). Optimizer-state sharding keeps
    /// each rank's own parameters, and saves copying the others' out of the host buckets (the
    /// NCCL device buckets write every gradient back).
    pub keep: Option<std::sync::Arc<[bool]>>,
}

impl ReduceOptions {
    /// The most [`words`](Self::words) a reduction carries (`DistributedDataParallel` uses 32 of
    /// them for its lockstep check: 16 are left to its callers).
    pub const MAX_WORDS: usize = 48;
}

impl Default for ReduceOptions {
    fn default() -> Self {
        Self {
            weight: 1.0,
            op: ReduceOp::Avg,
            clip_norm: None,
            check_finite: false,
            words: Vec::new(),
            keep: None,
        }
    }
}

/// What [`Reducer::reduce_with`](super::Reducer::reduce_with) produced.
#[derive(Debug)]
pub struct ReduceOutcome {
    /// The reduced (and possibly clipped) gradients; empty when they are not finite.
    pub grads: GradientsParams,
    /// Some rank's gradients held NaN or infinity (checked on the reduced values, so every rank
    /// agrees).
    pub non_finite: bool,
    /// This rank's own gradients held NaN or infinity before the all-reduce.
    pub local_non_finite: bool,
    /// The global 2-norm of the reduced gradients before clipping, when clipping is on.
    pub grad_norm: Option<f64>,
    /// The factor the gradients were multiplied by, when they were clipped.
    pub clip_scale: Option<f32>,
    /// The callers' [`ReduceOptions::words`], reduced over the ranks (the same on every rank).
    pub words: Vec<f32>,
}

impl ReduceOutcome {
    pub(super) fn plain(grads: GradientsParams) -> Self {
        Self {
            grads,
            non_finite: false,
            local_non_finite: false,
            grad_norm: None,
            clip_scale: None,
            words: Vec::new(),
        }
    }
}
