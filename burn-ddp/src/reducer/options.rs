//! What a reduction takes and gives ([`ReduceOptions`], [`ReduceOutcome`], [`StopVote`]), and the
//! control words that carry a step's votes and layout changes in its first bucket.

use burn::optim::GradientsParams;

use crate::group::ReduceOp;

/// The words the first bucket of every step carries after its presence flags. Summed (or
/// averaged) over the ranks, a word is positive when any rank set it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Control {
    /// This rank's trainable tensors differ from the agreed layout (frozen or unfrozen).
    pub(super) trainable_changed: f32,
    /// This rank's model tensors differ from the agreed layout (added, removed, replaced), or it
    /// has gradients for tensors its model does not train.
    pub(super) structure_changed: f32,
    /// This rank's [`StopVote::interrupt`].
    pub(super) stop: f32,
    /// This rank's [`StopVote::signal`].
    pub(super) signal: f32,
    /// This rank's [`StopVote::out_of_data`].
    pub(super) out_of_data: f32,
}

impl Control {
    /// Number of control words.
    pub(crate) const LEN: usize = 5;

    pub(super) fn len(&self) -> usize {
        Self::LEN
    }

    pub(super) fn words(&self) -> [f32; Self::LEN] {
        [
            self.trainable_changed,
            self.structure_changed,
            self.stop,
            self.signal,
            self.out_of_data,
        ]
    }

    pub(super) fn from_words(words: &[f32]) -> Option<Self> {
        match words {
            [
                trainable_changed,
                structure_changed,
                stop,
                signal,
                out_of_data,
                ..,
            ] => Some(Self {
                trainable_changed: *trainable_changed,
                structure_changed: *structure_changed,
                stop: *stop,
                signal: *signal,
                out_of_data: *out_of_data,
            }),
            _ => None,
        }
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
    /// This rank's vote to stop, carried by the step's first bucket (one collective for the
    /// gradients and the vote); read every rank's in [`ReduceOutcome::stop`]. Default: none.
    pub stop: StopVote,
}

impl Default for ReduceOptions {
    fn default() -> Self {
        Self {
            weight: 1.0,
            op: ReduceOp::Avg,
            clip_norm: None,
            check_finite: false,
            stop: StopVote::default(),
        }
    }
}

/// A rank's request to stop training, carried by a step's gradient all-reduce (two control words
/// of the first bucket) so that no separate collective is needed to agree on it: every rank
/// learns in that step's [`ReduceOutcome::stop`] whether any rank asked.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StopVote {
    /// burn-train's `Interrupter` asked to stop (a user's or a callback's stop).
    pub interrupt: bool,
    /// A stop signal (SIGTERM, SIGINT, SIGHUP) arrived: stop and write a step checkpoint.
    pub signal: bool,
    /// The rank has no batch left: it takes part in the step with no gradients (the same
    /// collectives as every other rank, so even a group that cannot tell calls apart, NCCL,
    /// learns it), and the ranks compare their batch counts.
    pub out_of_data: bool,
}

impl StopVote {
    /// Whether any stop was asked for (the end of the data included).
    pub fn any(&self) -> bool {
        self.interrupt || self.signal || self.out_of_data
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
    /// Whether any rank voted to stop in this step ([`ReduceOptions::stop`]).
    pub stop: StopVote,
}

impl ReduceOutcome {
    pub(super) fn plain(grads: GradientsParams) -> Self {
        Self {
            grads,
            non_finite: false,
            local_non_finite: false,
            grad_norm: None,
            clip_scale: None,
            stop: StopVote::default(),
        }
    }
}
