//! The Learner strategy (stage 4 of the port): data-parallel training as a drop-in strategy for
//! burn-train's `Learner`. So far its parts that do not drive burn-train itself: the step
//! decisions ([`policy`]: join, accumulation, non-finite gradients), the start-up agreement
//! ([`startup`]), the words ranks exchange ([`wire`]), the NCCL group of a thread run's devices
//! ([`device_group`]), the handing of outputs to rank 0 ([`handoff`]), the metrics file
//! ([`metrics_file`]), and the dealer and its loader ([`dealer`], [`dealt_loader`]: one device's
//! batches of a loader burn-ddp did not build, dealt to the ranks), and a Learner's sharded
//! optimizer ([`sharded`]: its step, its share of a resumed state, the whole state on rank 0
//! for a checkpoint); and, not yet driven (their caller, the epoch loop, follows), the ranks'
//! roles and messages ([`rank`]), rank 0's training events ([`events`]: one joined item per
//! step, burn-train 0.22's `TrainingItem` without a global progress, an event a metric cannot
//! take failing the interrupter as burn-train's loop does) and validation ([`validation`]: one
//! device's batches in one device's order, sharded or on rank 0, ending in 0.22's `EndSplit`).
//! The strategy itself, its workers and epochs follow.

mod dealer;
mod dealt_loader;
mod device_group;
mod events;
mod handoff;
mod metrics_file;
mod policy;
mod rank;
mod sharded;
mod shards;
mod startup;
mod validation;
mod wire;
