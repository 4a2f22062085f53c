//! Whether a [`DdpConfig`] holds together, and its one-line description for start-up logs.

use std::fmt;

use super::{DdpConfig, GradientCompression, UnevenInputs, Validation};
use crate::error::{DdpError, Result};

impl DdpConfig {
    /// Checks the values.
    ///
    /// # Errors
    /// [`DdpError::InvalidConfig`] for a zero timeout, a zero bucket cap, a clipping norm that
    /// is not positive and finite, a spike factor not above 1, or gradient sharding without
    /// optimizer-state sharding.
    pub fn validate(&self) -> Result<()> {
        if self.timeout.is_zero() || self.epoch_end_timeout.is_zero() {
            return Err(DdpError::InvalidConfig(format!(
                "timeouts must be positive, got timeout {:?} and epoch_end_timeout {:?}",
                self.timeout, self.epoch_end_timeout
            )));
        }
        if let Some(max_norm) = self.clip_grad_norm
            && !(max_norm.is_finite() && max_norm > 0.0)
        {
            return Err(DdpError::InvalidConfig(format!(
                "the gradient clipping norm must be positive and finite, got {max_norm}"
            )));
        }
        if self.bucket_cap_bytes == 0 || self.first_bucket_cap_bytes == 0 {
            return Err(DdpError::InvalidConfig(format!(
                "bucket caps must be positive, got bucket_cap_bytes {} and first_bucket_cap_bytes {}",
                self.bucket_cap_bytes, self.first_bucket_cap_bytes
            )));
        }
        if !(self.spike_factor.is_finite() && self.spike_factor > 1.0) {
            return Err(DdpError::InvalidConfig(format!(
                "the spike factor must be finite and above 1, got {}",
                self.spike_factor
            )));
        }
        if self.gradient_sharding && !self.optimizer_sharding {
            return Err(DdpError::InvalidConfig(
                "gradient sharding (with_gradient_sharding) needs optimizer-state sharding \
                 (with_optimizer_sharding(true)): the gradients go to the ranks that own and \
                 step their parameters"
                    .into(),
            ));
        }
        Ok(())
    }
}

impl fmt::Display for DdpConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mib = |b: usize| b as f64 / (1024.0 * 1024.0);
        write!(
            f,
            "timeout {} s, epoch-end timeout {} s, bucket cap {} MiB (first {} MiB)",
            self.timeout.as_secs_f64(),
            self.epoch_end_timeout.as_secs_f64(),
            mib(self.bucket_cap_bytes),
            mib(self.first_bucket_cap_bytes)
        )?;
        if let Some(max_norm) = self.clip_grad_norm {
            write!(f, ", clip grad norm {max_norm}")?;
        }
        if self.uneven_inputs == UnevenInputs::Join {
            f.write_str(", join uneven inputs")?;
        }
        match self.gradient_compression {
            GradientCompression::None => {}
            GradientCompression::Bf16 => f.write_str(", bf16 gradients")?,
            GradientCompression::F16 => f.write_str(", f16 gradients")?,
        }
        if let Some(hook) = &self.comm_hook {
            write!(f, ", communication hook {}", hook.name())?;
        }
        if self.checkpoint_every > 0 {
            write!(f, ", step checkpoint every {} steps", self.checkpoint_every)?;
        }
        if self.resume {
            f.write_str(", resume")?;
        }
        if self.optimizer_sharding {
            f.write_str(", optimizer state sharded")?;
        }
        if self.gradient_sharding {
            f.write_str(", gradients reduce-scattered")?;
        }
        if !self.shared_memory_reduction {
            f.write_str(", host buckets for thread replicas")?;
        }
        if self.validation == Validation::Rank0 {
            f.write_str(", validation on rank 0")?;
        }
        if self.consistency_check_every > 0 {
            write!(
                f,
                ", consistency check every {} steps",
                self.consistency_check_every
            )?;
        }
        Ok(())
    }
}
