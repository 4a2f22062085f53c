//! Learning rates for data-parallel training: the linear scaling rule with warm-up.
//!
//! **What a step is.** [`DdpStrategy`](crate::DdpStrategy) steps burn-train's LR scheduler once
//! per *optimizer step*, after the gradients of the global batch (all ranks, all accumulated
//! micro-batches) are averaged, and not once per replica or per micro-batch. A schedule written
//! for single-device training with the same global batch therefore runs unchanged. A step
//! skipped for non-finite gradients does not step the scheduler.
//!
//! **Linear scaling** (Goyal et al., 2017, "Accurate, Large Minibatch SGD: Training ImageNet in
//! 1 Hour"): when the global batch is `k` times the batch a learning rate was tuned for, multiply
//! the learning rate by `k`, and reach it gradually: start from the tuned rate and increase it
//! linearly over the first optimizer steps (the paper uses 5 epochs), because the large rate is
//! unstable at the start of training.

use burn::optim::LearningRate;
use burn::optim::lr_scheduler::{LrScheduler, LrSchedulerRecord};

use crate::error::{DdpError, Result};

/// `base_lr * global_batch / reference_batch`: the learning rate for `global_batch` samples per
/// optimizer step when `base_lr` was tuned for `reference_batch`.
pub fn linear_scaling_lr(base_lr: f64, reference_batch: usize, global_batch: usize) -> f64 {
    base_lr * global_batch as f64 / reference_batch.max(1) as f64
}

/// A burn-train LR scheduler for the linear scaling rule with gradual warm-up: optimizer step `t`
/// (from 0) gets `base + (scaled - base) * min(t, warmup) / warmup`, where `scaled` is
/// [`linear_scaling_lr`]; after the warm-up it stays at `scaled`.
///
/// ```
/// use burn::optim::lr_scheduler::LrScheduler;
/// use burn_ddp::lr::LinearScalingWarmup;
///
/// // Tuned at 0.1 for batch 256; the job runs 8 replicas of 128 (global batch 1024): 0.4.
/// let mut lr = LinearScalingWarmup::new(0.1, 256, 1024, 4).unwrap();
/// let steps: Vec<f64> = (0..6).map(|_| lr.step()).collect();
/// for (got, want) in steps.iter().zip([0.1, 0.175, 0.25, 0.325, 0.4, 0.4]) {
///     assert!((got - want).abs() < 1e-12);
/// }
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinearScalingWarmup {
    base: f64,
    scaled: f64,
    warmup_steps: usize,
    step: usize,
}

impl LinearScalingWarmup {
    /// From the rate `base_lr` tuned for `reference_batch`, to the scaled rate for `global_batch`
    /// (samples per optimizer step over all ranks), over `warmup_steps` optimizer steps (0: no
    /// warm-up).
    ///
    /// # Errors
    /// [`DdpError::InvalidConfig`] when `base_lr` is not positive and finite or a batch is 0.
    pub fn new(
        base_lr: f64,
        reference_batch: usize,
        global_batch: usize,
        warmup_steps: usize,
    ) -> Result<Self> {
        if !(base_lr.is_finite() && base_lr > 0.0) || reference_batch == 0 || global_batch == 0 {
            return Err(DdpError::InvalidConfig(format!(
                "linear scaling needs a positive learning rate and batch sizes, got lr {base_lr}, \
                 reference batch {reference_batch}, global batch {global_batch}"
            )));
        }
        Ok(Self {
            base: base_lr,
            scaled: linear_scaling_lr(base_lr, reference_batch, global_batch),
            warmup_steps,
            step: 0,
        })
    }

    /// The learning rate after the warm-up.
    pub fn scaled_lr(&self) -> f64 {
        self.scaled
    }
}

/// The key of the optimizer steps taken in [`LinearScalingWarmup`]'s record (named for it: Burn's
/// Noam and sequential schedulers keep a `"step"` of their own).
const STEP_KEY: &str = "linear_scaling_warmup.step";

impl LrScheduler for LinearScalingWarmup {
    fn step(&mut self) -> LearningRate {
        let t = self.step.min(self.warmup_steps);
        self.step += 1;
        if self.warmup_steps == 0 {
            return self.scaled;
        }
        self.base + (self.scaled - self.base) * t as f64 / self.warmup_steps as f64
    }

    /// The optimizer steps taken so far, under `"linear_scaling_warmup.step"`.
    fn to_record(&self) -> LrSchedulerRecord {
        LrSchedulerRecord::new().with_scalar(STEP_KEY, self.step as u64)
    }

    /// Continues from the steps `record` holds (a record without them leaves the schedule as
    /// it is, as Burn's own schedulers do).
    fn load_record(&mut self, record: LrSchedulerRecord) {
        if let Some(step) = record
            .scalar::<u64>(STEP_KEY)
            .and_then(|s| usize::try_from(s).ok())
        {
            self.step = step;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rate_scales_with_the_batch_and_ramps_up_linearly() {
        assert_eq!(linear_scaling_lr(0.1, 256, 2048), 0.8);
        let mut lr = LinearScalingWarmup::new(0.1, 32, 64, 2).unwrap();
        for want in [0.1, 0.15, 0.2, 0.2] {
            assert!((lr.step() - want).abs() < 1e-12);
        }
        let mut no_warmup = LinearScalingWarmup::new(0.1, 32, 96, 0).unwrap();
        assert!((no_warmup.step() - 0.3).abs() < 1e-12);
    }

    #[test]
    fn resuming_continues_the_ramp() {
        let mut lr = LinearScalingWarmup::new(0.1, 32, 64, 4).unwrap();
        lr.step();
        lr.step();
        let record = lr.to_record();
        let mut resumed = LinearScalingWarmup::new(0.1, 32, 64, 4).unwrap();
        resumed.load_record(record);
        assert_eq!(resumed.step(), lr.step());
        // A record of another scheduler leaves the ramp where it is.
        let mut fresh = LinearScalingWarmup::new(0.1, 32, 64, 4).unwrap();
        fresh.load_record(LrSchedulerRecord::new().with_scalar("step", 3u64));
        assert_eq!(fresh.step(), 0.1);
    }

    #[test]
    fn bad_arguments_are_errors() {
        assert!(LinearScalingWarmup::new(0.0, 32, 64, 1).is_err());
        assert!(LinearScalingWarmup::new(0.1, 0, 64, 1).is_err());
        assert!(LinearScalingWarmup::new(f64::NAN, 32, 64, 1).is_err());
    }
}
