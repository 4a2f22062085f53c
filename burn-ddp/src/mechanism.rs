//! The mechanism under the policy of [`DdpStrategy`](crate::DdpStrategy) and
//! [`DistributedDataParallel`](crate::DistributedDataParallel) (as PyTorch's `reducer.cpp` is
//! under `distributed.py`), for custom training loops, launchers and tests: the gradient [`Reducer`] and its bucket layout, the replica checks
//! (layouts, fingerprints, broadcasts), the rendezvous [`store`], the [`topology`] read from the
//! environment, and the [`launch`]er behind the `burn-ddp` binary. A Burn training needs none of
//! it; these items may change between minor versions more readily than the crate root's.

pub use crate::monitor::SyncWatch;
pub use crate::reducer::compress;
pub use crate::reducer::{Bucket, BucketLayout, ReduceOptions, ReduceOutcome, Reducer};
pub use crate::replica::{
    LayoutFingerprints, Replica, ReplicaLayout, ReplicaView, TensorKind, TensorSpec,
    average_buffers, broadcast_buffers, broadcast_module, fingerprints_of, tensor_fingerprints,
    value_fingerprint, verify_values_across,
};
pub use crate::sharding::OptimizerShards;
pub use crate::sharding::state::optimizer_state_bytes;
pub use crate::sync_bn::SyncBatchNormGuard;
pub use crate::topology::{Topology, TopologySource};

/// Who belongs to a job: its run id and secret, and the handshake that proves them. Every
/// connection to the store and between two ranks starts with an HMAC-SHA256 challenge-response
/// under a key derived from the job token and bound to the run id; a process of another run is
/// refused naming both ids, a stranger before it reads or writes anything. The variables, what
/// is not protected and how to run on an untrusted network: `docs/security.md` in the
/// repository.
pub mod auth {
    pub use crate::auth::{
        JOB_TOKEN_VAR, JobIdentity, RUN_ID_VAR, Role, Secret, WORKER_KEY_VAR, run_id_from_env,
    };
}

/// The launcher: one worker process per device on this machine, as `torchrun` starts them.
pub mod launch {
    pub use crate::launch::*;
}

/// The rendezvous: ranks find each other through the store.
pub mod rendezvous {
    pub use crate::rendezvous::*;
}

/// The key-value store of the rendezvous (`torch.distributed.TCPStore`).
pub mod store {
    pub use crate::store::*;
}

/// The job's shape read from the environment (torchrun, Slurm, Open MPI, the launcher).
pub mod topology {
    pub use crate::topology::*;
}
