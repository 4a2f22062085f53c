//! burn-ddp's integration tests on Burn 0.22.1: one test binary, one module per concern, every
//! multi-rank result compared with plain Burn on one device (`ExecutionStrategy::SingleDevice`).
//!
//! Multi-rank runs are threads of this process (thread replicas, or TCP groups over loopback);
//! every wait is bounded by a timeout.

mod changes;
mod custom_loop;
mod equivalence;
mod failures;
mod hooks;
mod in_step;
mod metrics;
mod oracle;
mod replicas;
mod sampling;
mod semantics;
mod short_batches;
