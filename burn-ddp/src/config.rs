//! [`DdpConfig`]: the knobs of data-parallel training, with the defaults PyTorch DDP users expect.

use std::fmt;
use std::time::Duration;

use crate::group::DEFAULT_TIMEOUT;
use crate::{DdpError, Result};

/// Size cap of a gradient bucket: 25 MiB, PyTorch DDP's `bucket_cap_mb` default.
pub const DEFAULT_BUCKET_CAP_BYTES: usize = 25 * 1024 * 1024;

/// Size cap of the first bucket (the last parameters of the model, whose gradients are ready
/// first): 1 MiB, PyTorch's `torch.distributed._DEFAULT_FIRST_BUCKET_BYTES`.
pub const DEFAULT_FIRST_BUCKET_CAP_BYTES: usize = 1024 * 1024;

/// Default timeout of the collectives that wait while rank 0 validates and writes checkpoints at
/// the end of an epoch: 30 minutes (PyTorch's Gloo default timeout).
pub const DEFAULT_EPOCH_END_TIMEOUT: Duration = Duration::from_secs(30 * 60);

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
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DdpConfig {
    timeout: Duration,
    epoch_end_timeout: Duration,
    bucket_cap_bytes: usize,
    first_bucket_cap_bytes: usize,
    consistency_check_every: u64,
}

impl Default for DdpConfig {
    fn default() -> Self {
        Self {
            timeout: DEFAULT_TIMEOUT,
            epoch_end_timeout: DEFAULT_EPOCH_END_TIMEOUT,
            bucket_cap_bytes: DEFAULT_BUCKET_CAP_BYTES,
            first_bucket_cap_bytes: DEFAULT_FIRST_BUCKET_CAP_BYTES,
            consistency_check_every: 0,
        }
    }
}

impl DdpConfig {
    /// Timeout of every collective during training steps (default [`DEFAULT_TIMEOUT`], 300 s).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Timeout of the end-of-epoch collectives, which wait while rank 0 runs validation and writes
    /// checkpoints (default [`DEFAULT_EPOCH_END_TIMEOUT`], 30 min).
    pub fn with_epoch_end_timeout(mut self, timeout: Duration) -> Self {
        self.epoch_end_timeout = timeout;
        self
    }

    /// Size cap of a gradient bucket in bytes of `f32` gradients (default
    /// [`DEFAULT_BUCKET_CAP_BYTES`], 25 MiB). A parameter larger than the cap gets a bucket of its
    /// own.
    pub fn with_bucket_cap_bytes(mut self, bytes: usize) -> Self {
        self.bucket_cap_bytes = bytes;
        self
    }

    /// Size cap of the first bucket in bytes (default [`DEFAULT_FIRST_BUCKET_CAP_BYTES`], 1 MiB).
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

    /// First bucket's cap in bytes.
    pub fn first_bucket_cap_bytes(&self) -> usize {
        self.first_bucket_cap_bytes
    }

    /// Checks the values.
    ///
    /// # Errors
    /// [`DdpError::InvalidConfig`] for a zero timeout or a zero bucket cap.
    pub fn validate(&self) -> Result<()> {
        if self.timeout.is_zero() || self.epoch_end_timeout.is_zero() {
            return Err(DdpError::InvalidConfig(format!(
                "timeouts must be positive, got timeout {:?} and epoch_end_timeout {:?}",
                self.timeout, self.epoch_end_timeout
            )));
        }
        if self.bucket_cap_bytes == 0 || self.first_bucket_cap_bytes == 0 {
            return Err(DdpError::InvalidConfig(format!(
                "bucket caps must be positive, got bucket_cap_bytes {} and first_bucket_cap_bytes {}",
                self.bucket_cap_bytes, self.first_bucket_cap_bytes
            )));
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
