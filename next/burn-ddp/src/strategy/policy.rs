//! The decisions of a training step that do not depend on Burn's types, in one place: how the
//! ranks' gradients are combined (join mode's weighting), when an optimizer step happens
//! (gradient accumulation), what a step with uneven data or non-finite gradients means.

use crate::config::{DdpConfig, NonFinite, UnevenInputs};
use crate::error::{DdpError, Result};
use crate::reducer::ReduceOptions;
use burn_ddp_comm::group::ReduceOp;

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

/// A rank's request to stop training, carried by the step's gradient reduction (four words of
/// the reducer's first bucket, [`ReduceOptions::words`]) so that no separate collective is needed
/// to agree on it: every rank learns in that step whether any rank asked.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct StopVote {
    /// burn-train's `Interrupter` asked to stop (a user's or a callback's stop), seen first after
    /// the step's last micro-batch: the step is taken, then training stops.
    pub interrupt: bool,
    /// A stop signal (SIGTERM, SIGINT, SIGHUP) arrived: stop and write a step checkpoint.
    pub signal: bool,
    /// The rank has no batch left: it takes part in the step with no gradients (the same
    /// collectives as every other rank, so even a group that cannot tell calls apart, NCCL,
    /// learns it), and the ranks compare their batch counts.
    pub out_of_data: bool,
    /// burn-train's `Interrupter` asked to stop, seen after a micro-batch of this accumulation
    /// window that was not its last: burn-train's own loop stops right after that micro-batch,
    /// without the window's optimizer step ([`skips_window_step`]).
    ///
    /// [`skips_window_step`]: Self::skips_window_step
    pub interrupted_inside: bool,
}

impl StopVote {
    /// This rank's vote as reduction words (1.0 for yes).
    pub fn words(&self) -> Vec<f32> {
        [
            self.interrupt,
            self.signal,
            self.out_of_data,
            self.interrupted_inside,
        ]
        .into_iter()
        .map(|v| f32::from(u8::from(v)))
        .collect()
    }

    /// Whether the step's optimizer update is left out: some rank saw the interrupt inside the
    /// accumulation window and none first after its last micro-batch (plain Burn interrupted at
    /// that micro-batch never reaches the step). Thread ranks share one `Interrupter`, and a
    /// rank behind the others sees a stop raised during the window's last micro-batch before
    /// its own last one: the rank furthest on decides, where the window had ended.
    pub fn skips_window_step(&self) -> bool {
        self.interrupted_inside && !self.interrupt
    }

    /// Whether some rank asked to stop, inside the window or after its last micro-batch.
    pub fn interrupted(&self) -> bool {
        self.interrupt || self.interrupted_inside
    }

    /// Every rank's votes from the reduced words: a word is positive when any rank voted.
    pub fn from_reduced(words: &[f32]) -> Self {
        let yes = |i: usize| words.get(i).is_some_and(|w| *w > 0.0);
        Self {
            interrupt: yes(0),
            signal: yes(1),
            out_of_data: yes(2),
            interrupted_inside: yes(3),
        }
    }
}

/// The end of the data without a per-step agreement (not join mode): after a reduction in which
/// some rank said it is out of data, every rank all-gathers `[out of data, batches trained this
/// epoch]` (`words`, rank-major). Fine when every rank is out of data after as many batches;
/// otherwise the ranks with fewer batches are named against those with more.
///
/// # Errors
/// [`DdpError::UnevenData`] (the same on every rank, but for `rank`).
pub(super) fn end_of_data(words: &[u64], rank: usize, epoch: usize, step: usize) -> Result<()> {
    let ranks: Vec<(u64, u64)> = words.chunks(2).map(|w| (w[0], w[1])).collect();
    let most = ranks.iter().map(|&(_, batches)| batches).max().unwrap_or(0);
    let all_out = ranks.iter().all(|&(out, _)| out != 0);
    if all_out && ranks.iter().all(|&(_, batches)| batches == most) {
        return Ok(());
    }
    // Ranks still with a batch, or (all out) with more batches than others, are "remaining".
    let remaining: Vec<usize> = (0..ranks.len())
        .filter(|&r| ranks[r].0 == 0 || (all_out && ranks[r].1 == most))
        .collect();
    Err(DdpError::UnevenData {
        rank,
        epoch,
        step,
        exhausted: (0..ranks.len())
            .filter(|r| !remaining.contains(r))
            .collect(),
        remaining,
    })
}

/// What to do with a step whose reduced gradients are not finite.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum OnNonFinite {
    /// Skip the optimizer step on every rank. The learning-rate scheduler has already stepped
    /// for the step's batches (burn-train steps it before each forward pass), so the skipped
    /// step's learning rate is spent, as with PyTorch's `GradScaler` skipping `optimizer.step()`
    /// after `scheduler.step()`.
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

    /// A new epoch: the next batch starts an optimizer step (an epoch's last micro-batch
    /// completes its window, [`micro_batch_done`](Self::micro_batch_done); one that ended
    /// inside a window was interrupted, and its micro-batches go unstepped, as burn-train's).
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

    /// Counts a micro-batch; true when it completes an optimizer step: the window is full, or it
    /// is the epoch's last (`last_of_epoch`: burn-train 0.22 steps a short last window, where
    /// 0.21 dropped it).
    pub fn micro_batch_done(&mut self, last_of_epoch: bool) -> bool {
        self.micro_batches += 1;
        if self.micro_batches >= self.accumulation || last_of_epoch {
            self.micro_batches = 0;
            true
        } else {
            false
        }
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
            words: Vec::new(),
            keep: None,
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
    fn an_interrupt_inside_a_window_skips_its_step_unless_a_rank_saw_the_window_end() {
        // Rank 0 saw the interrupt after its window's last micro-batch, rank 1 (behind it) inside
        // the window: rank 0's window had ended, so the step is taken, then training stops.
        let after = StopVote {
            interrupt: true,
            ..StopVote::default()
        };
        let inside = StopVote {
            interrupted_inside: true,
            ..StopVote::default()
        };
        let summed: Vec<f32> = after
            .words()
            .iter()
            .zip(inside.words())
            .map(|(a, b)| a + b)
            .collect();
        let votes = StopVote::from_reduced(&summed);
        assert!(!votes.skips_window_step() && votes.interrupted() && !votes.signal);
        // Inside the window only (on one rank, the others not interrupted): no step.
        let none = StopVote::default().words();
        let summed: Vec<f32> = inside
            .words()
            .iter()
            .zip(&none)
            .map(|(a, b)| a + b)
            .collect();
        let votes = StopVote::from_reduced(&summed);
        assert!(votes.skips_window_step() && votes.interrupted());
        let votes = StopVote::from_reduced(&after.words());
        assert!(!votes.skips_window_step() && votes.interrupted());
        assert!(!StopVote::from_reduced(&StopVote::default().words()).interrupted());
        assert_eq!(StopVote::from_reduced(&inside.words()), inside);
    }

    #[test]
    fn the_end_of_data_names_ranks_with_fewer_batches_and_join_weights_by_samples() {
        let plain = StepPolicy::new(&DdpConfig::default(), 1).unwrap();
        // Everyone out after 5 batches: fine.
        assert!(end_of_data(&[1, 5, 1, 5, 1, 5], 0, 1, 5).is_ok());
        let uneven = |words: &[u64]| match end_of_data(words, 2, 3, 7) {
            Err(DdpError::UnevenData {
                rank,
                epoch,
                step,
                exhausted,
                remaining,
            }) => {
                assert_eq!((rank, epoch, step), (2, 3, 7));
                (exhausted, remaining)
            }
            other => panic!("expected UnevenData, got {other:?}"),
        };
        // Rank 1 is out, ranks 0 and 2 still have a batch.
        assert_eq!(uneven(&[0, 7, 1, 7, 0, 7]), (vec![1], vec![0, 2]));
        // All out, but rank 0 trained 7 micro-batches and the others 5 (an accumulation window
        // left over on one rank only).
        assert_eq!(uneven(&[1, 7, 1, 5, 1, 5]), (vec![1, 2], vec![0]));
        let join = StepPolicy::new(
            &DdpConfig::default().with_uneven_inputs(UnevenInputs::Join),
            1,
        )
        .unwrap();
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
    fn accumulation_steps_every_k_micro_batches_and_at_the_epochs_last_as_burn_train_0_22() {
        let mut policy = StepPolicy::new(&DdpConfig::default(), 3).unwrap();
        assert!(policy.accumulates());
        // 7 micro-batches in the epoch: windows of 3, 3, and the last one's 1, which burn-train
        // 0.22 steps too (its loop steps when the window is full or the epoch's data is done).
        let (boundaries, steps): (Vec<bool>, Vec<bool>) = (0..7)
            .map(|batch| {
                (
                    policy.at_step_boundary(),
                    policy.micro_batch_done(batch == 6),
                )
            })
            .unzip();
        assert_eq!(
            boundaries,
            vec![true, false, false, true, false, false, true]
        );
        assert_eq!(steps, vec![false, false, true, false, false, true, true]);
        assert!(policy.at_step_boundary());
        // An epoch that ends inside a window (an interrupt): the next one starts a step.
        policy.micro_batch_done(false);
        assert!(!policy.at_step_boundary());
        policy.start_epoch();
        assert!(policy.at_step_boundary());
        let policy =
            StepPolicy::new(&DdpConfig::default().with_non_finite(NonFinite::Error), 1).unwrap();
        assert_eq!(policy.on_non_finite(), OnNonFinite::Fail);
        assert!(!policy.may_skip());
    }
}
