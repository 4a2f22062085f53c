//! burn-ddp's integration tests: one test binary, one module per concern.
//!
//! Multi-rank runs are threads of this process (ThreadGroup); every wait is bounded by a timeout.

mod changes;
mod custom_loop;
mod documentation;
mod equivalence;
mod failures;
mod hooks;
mod in_step;
mod metrics;
#[cfg(feature = "mpi")]
mod mpi;
mod oracle;
mod processes;
mod replicas;
mod sampling;
mod security;
mod semantics;
mod sharding;
mod short_batches;
#[cfg(feature = "wgpu")]
mod wgpu;
