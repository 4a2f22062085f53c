//! Process groups: the ranks that train together and the collectives they run, from the
//! communication layer, [`burn_ddp_comm`] (re-exported whole as [`crate::comm`]: the store,
//! rendezvous, topology and launcher, the errors of collectives, NCCL's helpers).
//!
//! A [`ProcessGroup`](crate::ProcessGroup) is one rank's handle on a group of `world_size` ranks;
//! every call takes a timeout, a failed collective aborts the group, and all-reduce results are
//! bit-identical on every rank (see [`burn_ddp_comm::group`] for the contract). burn-ddp picks one
//! for you ([`DdpStrategy::from_env`](crate::DdpStrategy::from_env), [`ThreadGroup`] for the
//! devices of one process); build one yourself to give to
//! [`DdpStrategy::with_process_group`](crate::DdpStrategy::with_process_group) or
//! [`DistributedDataParallel`](crate::DistributedDataParallel).

#[cfg(feature = "mpi")]
pub use burn_ddp_comm::group::MpiGroup;
#[cfg(feature = "cuda")]
pub use burn_ddp_comm::group::nccl::NcclGroup;
pub use burn_ddp_comm::group::{
    ExtendedCollectives, ReduceOp, TcpGroup, TcpGroupOptions, ThreadGroup,
};
