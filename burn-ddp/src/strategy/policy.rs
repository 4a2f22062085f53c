//! The decisions of a training step that do not depend on Burn's types, in one place: how the
//! ranks' gradients are combined (join mode's weighting), when an optimizer step happens
//! (gradient accumulation), what a step with uneven data or non-finite gradients means.

use crate::group::ReduceOp;
use crate::reducer::ReduceOptions;
use crate::{DdpConfig, DdpError, NonFinite, Result, UnevenInputs};

/// What the ranks agreed on before a step (the per-step all-gather).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Agreement {
    /// Each rank's samples in its batch (0: it has none left).
    pub samples: Vec<u64>,
    /// Some rank's burn-train `Interrupter` asked to stop.
    pub interrupted: bool,
    /// The ranks that received a stop signal, with the signal.
    pub signalled: Vec<(usize, i32)>,
}

impl Agreement {
    /// Words per rank in the all-gather.
    pub const WORDS: usize = 3;

    /// This rank's words: samples, interrupted, stop signal (0: none).
    pub fn words(samples: usize, interrupted: bool, signal: Option<i32>) -> [u64; Self::WORDS] {
        [
            samples as u64,
            u64::from(interrupted),
            signal.map_or(0, |s| s as u64),
        ]
    }

    /// The agreement from every rank's words, rank-major.
    pub fn from_words(all: &[u64]) -> Self {
        let ranks = all.chunks(Self::WORDS);
        Self {
            samples: ranks.clone().map(|w| w[0]).collect(),
            interrupted: ranks.clone().any(|w| w[1] != 0),
            signalled: ranks
                .enumerate()
                .filter(|(_, w)| w[2] != 0)
                .map(|(r, w)| (r, w[2] as i32))
                .collect(),
        }
    }

    /// Samples over all ranks.
    pub fn total(&self) -> u64 {
        self.samples.iter().sum()
    }
}

/// What to do with a step whose reduced gradients are not finite.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum OnNonFinite {
    /// Skip the optimizer step (and the LR scheduler step) on every rank.
    Skip,
    /// Stop training with [`DdpError::NonFinite`].
    Fail,
}

/// The step decisions of one rank's training loop.
#[derive(Debug, Clone)]
pub(super) struct StepPolicy {
    join: bool,
    accumulation: usize,
    micro_batches: usize,
    non_finite: NonFinite,
    clip_norm: Option<f32>,
}

impl StepPolicy {
    /// The policy of `config` with `grads_accumulation(accumulation)`.
    ///
    /// # Errors
    /// [`DdpError::InvalidConfig`] for join mode with gradient accumulation.
    pub fn new(config: &DdpConfig, accumulation: usize) -> Result<Self> {
        let join = config.uneven_inputs() == UnevenInputs::Join;
        if join && accumulation > 1 {
            return Err(DdpError::InvalidConfig(
                "UnevenInputs::Join cannot be combined with grads_accumulation".into(),
            ));
        }
        Ok(Self {
            join,
            accumulation: accumulation.max(1),
            micro_batches: 0,
            non_finite: config.non_finite(),
            clip_norm: config.clip_grad_norm(),
        })
    }

    /// A new epoch: micro-batches left over from the last one were dropped (as burn-train
    /// drops them), so the next batch starts an optimizer step.
    pub fn start_epoch(&mut self) {
        self.micro_batches = 0;
    }

    /// Whether ranks may run out of batches at different steps (join mode).
    pub fn join(&self) -> bool {
        self.join
    }

    /// Whether the next batch starts an optimizer step (no micro-batch of an accumulation is
    /// pending): the only place where training may stop for a checkpoint.
    pub fn at_step_boundary(&self) -> bool {
        self.micro_batches == 0
    }

    /// Whether gradients are accumulated over several micro-batches.
    pub fn accumulates(&self) -> bool {
        self.accumulation > 1
    }

    /// Counts a micro-batch; true when it completes an optimizer step.
    pub fn micro_batch_done(&mut self) -> bool {
        self.micro_batches += 1;
        if self.micro_batches >= self.accumulation {
            self.micro_batches = 0;
            true
        } else {
            false
        }
    }

    /// Checks that every rank has a batch, unless join mode lets ranks run out.
    ///
    /// # Errors
    /// [`DdpError::UnevenData`] naming the ranks without a batch and those with one.
    pub fn check_even(
        &self,
        agreement: &Agreement,
        rank: usize,
        epoch: usize,
        step: usize,
    ) -> Result<()> {
        let with_batch: Vec<usize> = (0..agreement.samples.len())
            .filter(|&r| agreement.samples[r] > 0)
            .collect();
        if self.join || with_batch.len() == agreement.samples.len() || with_batch.is_empty() {
            return Ok(());
        }
        Err(DdpError::UnevenData {
            rank,
            epoch,
            step,
            exhausted: (0..agreement.samples.len())
                .filter(|r| !with_batch.contains(r))
                .collect(),
            remaining: with_batch,
        })
    }

    /// How the ranks' gradients are combined for a step in which this rank had `samples` of the
    /// step's `total`: the average (each rank's mean gradient, averaged); in join mode each rank
    /// weighted by its share of the samples and summed, which is the mean over all the step's
    /// samples.
    pub fn reduce_options(&self, samples: u64, total: u64) -> ReduceOptions {
        ReduceOptions {
            weight: if self.join {
                samples as f32 / total.max(1) as f32
            } else {
                1.0
            },
            op: if self.join {
                ReduceOp::Sum
            } else {
                ReduceOp::Avg
            },
            clip_norm: self.clip_norm,
            check_finite: self.non_finite != NonFinite::Ignore,
        }
    }

    /// What a step with non-finite reduced gradients leads to.
    pub fn on_non_finite(&self) -> OnNonFinite {
        match self.non_finite {
            NonFinite::Error => OnNonFinite::Fail,
            NonFinite::SkipStep | NonFinite::Ignore => OnNonFinite::Skip,
        }
    }

    /// Whether a step may be skipped (then buffers must be restored after a bad batch).
    pub fn may_skip(&self) -> bool {
        self.non_finite == NonFinite::SkipStep
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn agreement(samples: &[u64]) -> Agreement {
        let words: Vec<u64> = samples
            .iter()
            .flat_map(|&s| Agreement::words(s as usize, false, None))
            .collect();
        Agreement::from_words(&words)
    }

    #[test]
    fn the_agreement_round_trips_and_names_the_signalled_ranks() {
        let words: Vec<u64> = [
            Agreement::words(8, false, None),
            Agreement::words(0, true, Some(15)),
        ]
        .concat();
        let a = Agreement::from_words(&words);
        assert_eq!(a.samples, vec![8, 0]);
        assert!(a.interrupted);
        assert_eq!(a.signalled, vec![(1, 15)]);
        assert_eq!(a.total(), 8);
    }

    #[test]
    fn uneven_batches_are_an_error_unless_joined() {
        let plain = StepPolicy::new(&DdpConfig::default(), 1).unwrap();
        match plain.check_even(&agreement(&[4, 0, 4]), 2, 1, 7) {
            Err(DdpError::UnevenData {
                exhausted,
                remaining,
                step,
                ..
            }) => {
                assert_eq!((exhausted, remaining, step), (vec![1], vec![0, 2], 7));
            }
            other => panic!("expected UnevenData, got {other:?}"),
        }
        // Everyone done, or everyone with a batch: fine.
        assert!(plain.check_even(&agreement(&[0, 0]), 0, 1, 7).is_ok());
        assert!(plain.check_even(&agreement(&[3, 3]), 0, 1, 7).is_ok());
        let join = StepPolicy::new(
            &DdpConfig::default().with_uneven_inputs(UnevenInputs::Join),
            1,
        )
        .unwrap();
        assert!(join.check_even(&agreement(&[4, 0]), 0, 1, 7).is_ok());
        // Join weights by samples and sums; the default averages.
        let options = join.reduce_options(1, 4);
        assert_eq!((options.weight, options.op), (0.25, ReduceOp::Sum));
        let options = plain.reduce_options(1, 4);
        assert_eq!((options.weight, options.op), (1.0, ReduceOp::Avg));
        assert!(options.check_finite);
        assert!(
            StepPolicy::new(
                &DdpConfig::default().with_uneven_inputs(UnevenInputs::Join),
                2
            )
            .is_err()
        );
    }

    #[test]
    fn accumulation_steps_every_k_micro_batches_and_stops_only_at_boundaries() {
        let mut policy = StepPolicy::new(&DdpConfig::default(), 3).unwrap();
        assert!(policy.accumulates());
        let (boundaries, steps): (Vec<bool>, Vec<bool>) = (0..7)
            .map(|_| (policy.at_step_boundary(), policy.micro_batch_done()))
            .unzip();
        assert_eq!(
            boundaries,
            vec![true, false, false, true, false, false, true]
        );
        assert_eq!(steps, vec![false, false, true, false, false, true, false]);
        assert!(!policy.at_step_boundary());
        // A new epoch drops the leftover micro-batch: the next batch starts a step.
        policy.start_epoch();
        assert!(policy.at_step_boundary());
        let policy =
            StepPolicy::new(&DdpConfig::default().with_non_finite(NonFinite::Error), 1).unwrap();
        assert_eq!(policy.on_non_finite(), OnNonFinite::Fail);
        assert!(!policy.may_skip());
    }
}
