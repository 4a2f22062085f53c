//! The mechanism under the policy of the strategy and the custom loop (as PyTorch's
//! `reducer.cpp` is under `distributed.py`), for custom training loops and tests: the gradient
//! [`Reducer`] and its bucket layout, and the replica checks (layouts, fingerprints). The store,
//! rendezvous, topology and launcher are the communication layer's ([`crate::comm`]). Ported so
//! far: the reducer, the replica and the sharding's owners; the root crate's `SyncWatch` and
//! `SyncBatchNormGuard` follow with their modules.

pub use crate::monitor::SyncWatch;
pub use crate::reducer::{
    Bucket, BucketLayout, ReduceOptions, ReduceOutcome, Reducer, ReducerOptions,
};
pub use crate::replica::{
    LayoutFingerprints, ReplicaLayout, ReplicaView, TensorKind, TensorSpec, value_fingerprint,
};
pub use crate::sharding::OptimizerShards;
pub use crate::sharding::state::optimizer_state_bytes;
pub use crate::sync_bn::{StatsLink, SyncBatchNormGuard};
