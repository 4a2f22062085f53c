//! The mechanism under the policy of [`DdpStrategy`](crate::DdpStrategy) and
//! [`DistributedDataParallel`](crate::DistributedDataParallel) (as PyTorch's `reducer.cpp` is
//! under `distributed.py`), for custom training loops and tests: the gradient [`Reducer`] and its
//! bucket layout, and the replica checks (layouts, fingerprints, broadcasts). The store,
//! rendezvous, topology and launcher are the communication layer's ([`crate::comm`]). A Burn
//! training needs none of it; these items may change between minor versions more readily than
//! the crate root's.

pub use crate::monitor::SyncWatch;
pub use crate::reducer::{
    Bucket, BucketLayout, ReduceOptions, ReduceOutcome, Reducer, ReducerOptions,
};
pub use crate::replica::{ReplicaLayout, TensorKind, TensorSpec, value_fingerprint};
pub use crate::sharding::OptimizerShards;
pub use crate::sharding::state::optimizer_state_bytes;
pub use crate::sync_bn::SyncBatchNormGuard;
