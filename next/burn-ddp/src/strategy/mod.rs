//! The Learner strategy (stage 4 of the port): data-parallel training as a drop-in strategy for
//! burn-train's `Learner`. So far its parts that do not drive burn-train itself: the step
//! decisions ([`policy`]: join, accumulation, non-finite gradients), the start-up agreement
//! ([`startup`]), the words ranks exchange ([`wire`]), the NCCL group of a thread run's devices
//! ([`device_group`]), the handing of outputs to rank 0 ([`handoff`]), the metrics file
//! ([`metrics_file`]), and the dealer and its loader ([`dealer`], [`dealt_loader`]: one device's
//! batches of a loader burn-ddp did not build, dealt to the ranks), and a Learner's sharded
//! optimizer ([`sharded`]: its step, its share of a resumed state, the whole state on rank 0
//! for a checkpoint). The strategy itself, its workers, epochs and validation follow.

mod dealer;
mod dealt_loader;
mod device_group;
mod handoff;
mod metrics_file;
mod policy;
mod sharded;
mod shards;
mod startup;
mod wire;
