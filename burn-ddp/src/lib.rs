//! # burn-ddp: distributed data-parallel training for Burn
//!
//! Each device holds a full replica of the model. Each step every replica takes its own shard of
//! the global batch, runs forward and backward, the gradients are averaged across replicas with an
//! all-reduce, and every replica applies the same optimizer step, so the replicas stay identical.
//!
//! Two ways in:
//! - [`DdpStrategy`]: a drop-in strategy for burn-train's `SupervisedTraining`
//!   (`.with_training_strategy(DdpStrategy::new(devices).into())`), with
//!   [`DdpTraining::launch_ddp`] to get failures as values;
//! - [`DistributedDataParallel`]: for training loops you write yourself
//!   (`sync_gradients(&model, grads)` before each optimizer step).
//!
//! The pieces, in the order a training step uses them (see ARCHITECTURE.md):
//! [`DistributedSampler`] / [`DistributedDataLoader`] (which samples each rank sees),
//! [`ProcessGroup`] / [`ThreadGroup`] (the collectives), [`ReplicaLayout`] (the replica's tensors,
//! checked across ranks), [`Reducer`] (gradient buckets), [`metrics`] (where the time goes).
//! Every failure is a [`DdpError`] that names the rank, the collective, its sequence number and
//! the timeout.

#![warn(missing_docs)]

pub mod checkpoint;
mod config;
mod ddp;
mod error;
pub mod group;
pub mod hooks;
pub mod launch;
pub mod lr;
pub mod metrics;
pub mod nccl;
mod partition;
pub mod reducer;
pub mod rendezvous;
pub mod replica;
pub mod sampler;
mod signals;
pub mod store;
mod strategy;
pub mod sync_bn;
pub mod topology;

pub use config::{
    BufferSync, DEFAULT_BUCKET_CAP_BYTES, DEFAULT_EPOCH_END_TIMEOUT,
    DEFAULT_FIRST_BUCKET_CAP_BYTES, DdpConfig, NonFinite, UnevenInputs,
};
pub use ddp::DistributedDataParallel;
pub use error::{DdpError, Result};
pub use group::{
    Collective, DEFAULT_TIMEOUT, ProcessGroup, ReduceOp, TcpGroup, TcpGroupOptions, ThreadGroup,
};
pub use reducer::GradientCompression;
pub use reducer::{Bucket, BucketLayout, ReduceOptions, ReduceOutcome, Reducer};
pub use replica::{
    ReplicaLayout, TensorKind, TensorSpec, broadcast_buffers, broadcast_module,
    tensor_fingerprints, value_fingerprint, verify_values_across,
};
pub use sampler::{DistributedDataLoader, DistributedSampler};
pub use signals::PREEMPTED_EXIT_CODE;
pub use strategy::{DdpStrategy, DdpTraining};
pub use sync_bn::{SyncBatchNorm, SyncBatchNormBackend, SyncBatchNormConfig};
pub use topology::Topology;

/// The README's code blocks, compiled as doc-tests so they stay true.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
struct ReadmeDoctests;
