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
//! [`ProcessGroup`] and the [`group`]s that implement it (the collectives), [`config`] (the settings),
//! [`hooks`] (how a gradient bucket is reduced), [`metrics`] (where the time goes); the machinery
//! (reducer, replica checks) is in [`mechanism`]; the communication layer (process groups, store,
//! rendezvous, topology, launcher) is its own crate, [`burn_ddp_comm`], re-exported as [`comm`].
//! Every failure is a [`DdpError`] that names the rank, the collective, its sequence number and
//! the timeout.

#![warn(missing_docs)]

pub mod checkpoint;
mod compress;
pub mod config;
mod context;
mod ddp;
mod error;
pub mod group;
pub mod hooks;
mod lockstep;
pub mod lr;
pub mod mechanism;
pub mod metrics;
mod monitor;
pub mod outputs;
mod partition;
mod reducer;
mod replica;
mod sampler;
mod sharding;
mod strategy;
mod sync_bn;

/// The communication layer, [`burn_ddp_comm`], whole: process groups and their errors
/// ([`CommError`](burn_ddp_comm::CommError), inside [`DdpError::Comm`]), the store, rendezvous,
/// topology, launcher and job identity. A Burn training needs none of it beyond [`group`].
pub use burn_ddp_comm as comm;

// The public API (ARCHITECTURE.md, "API boundary"): what a Burn training needs is here; the
// settings, checkpoints, learning rates, reports, hooks and process groups have a module each;
// the reducer and the replica checks are under `mechanism`; the rest of the communication layer
// (store, rendezvous, topology, launcher) is `comm`.
pub use burn_ddp_comm::group::ProcessGroup;
pub use config::DdpConfig;
pub use context::{is_main_process, rank, world_size};
pub use ddp::DistributedDataParallel;
pub use error::{DdpError, Result};
pub use sampler::{DistributedDataLoader, DistributedSampler};
pub use sharding::ShardedOptimizer;
pub use strategy::{DdpStrategy, DdpTraining};
pub use sync_bn::{SyncBatchNorm, SyncBatchNormBackend, SyncBatchNormConfig};

/// The README's and the user documentation's code blocks, compiled as doc-tests so they stay
/// true.
#[cfg(doctest)]
mod documentation {
    #[doc = include_str!("../../README.md")]
    struct Readme;
    #[doc = include_str!("../../docs/burn-training.md")]
    struct BurnTraining;
    #[doc = include_str!("../../docs/checkpoints.md")]
    struct Checkpoints;
    #[doc = include_str!("../../docs/cuda.md")]
    struct Cuda;
    #[doc = include_str!("../../docs/custom-loop.md")]
    struct CustomLoop;
    #[doc = include_str!("../../docs/development.md")]
    struct Development;
    #[doc = include_str!("../../docs/fashion-mnist.md")]
    struct FashionMnist;
    #[doc = include_str!("../../docs/limits.md")]
    struct Limits;
    #[doc = include_str!("../../docs/processes.md")]
    struct Processes;
    #[doc = include_str!("../../docs/security.md")]
    struct Security;
    #[doc = include_str!("../../docs/semantics.md")]
    struct Semantics;
    #[doc = include_str!("../../docs/troubleshooting.md")]
    struct Troubleshooting;
    #[doc = include_str!("../../docs/wgpu.md")]
    struct Wgpu;
}
