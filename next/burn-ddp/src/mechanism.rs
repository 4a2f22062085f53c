//! The mechanism under the policy of the strategy and the custom loop (as PyTorch's
//! `reducer.cpp` is under `distributed.py`), for custom training loops and tests: the gradient
//! [`Reducer`] and its bucket layout, and the replica checks (layouts, fingerprints). The store,
//! rendezvous, topology and launcher are the communication layer's (`burn_ddp_comm`). Ported so
//! far: the reducer and the replica; the root crate's `SyncWatch`, `OptimizerShards`,
//! `optimizer_state_bytes` and `SyncBatchNormGuard` follow with their modules.

pub use crate::reducer::{
    Bucket, BucketLayout, ReduceOptions, ReduceOutcome, Reducer, ReducerOptions,
};
pub use crate::replica::{
    LayoutFingerprints, ReplicaLayout, ReplicaView, TensorKind, TensorSpec, value_fingerprint,
};
