//! # burn-ddp-comm: process groups, rendezvous and a launcher for data-parallel jobs
//!
//! The communication layer under [burn-ddp](https://github.com/burn-ddp/burn-ddp), as
//! `torch.distributed`'s c10d is under PyTorch's DDP. It knows nothing of Burn's models or
//! training loop (Burn's tensor types appear only behind the `cuda` feature, for NCCL's
//! all-reduce of device tensors), so a Rust program on another framework can use it as it is.
//!
//! - [`group`]: the [`ProcessGroup`](group::ProcessGroup) trait (all-reduce, broadcast, barrier,
//!   all-gather, abort; every call with a timeout, bit-identical results on every rank) and its
//!   implementations: [`ThreadGroup`](group::ThreadGroup) (ranks are threads),
//!   [`TcpGroup`](group::TcpGroup) (processes over TCP), `MpiGroup` (feature `mpi`) and
//!   `nccl::NcclGroup` (feature `cuda`); [`ExtendedCollectives`](group::ExtendedCollectives)
//!   adds the 16-bit all-reduce, the reduce-scatter and the `f32` all-gather on any group.
//! - [`store`] and [`rendezvous`]: the key-value store (`TCPStore`) through which the processes
//!   of a job find each other; [`auth`]: the job's identity, proven at every connection.
//! - [`topology`]: where this process sits in its job, read from the environment (torchrun,
//!   Slurm, Open MPI, the launcher).
//! - [`launch`]: the launcher behind `burn-ddp run` (one worker process per device, restarts,
//!   `[rank R]` log prefixes); [`signals`]: stop requests (SIGTERM, SIGINT) as values.
//!
//! Every failure is a [`CommError`] that names the rank, the collective, its sequence number and
//! the timeout.
//!
//! ## A group and an all-reduce
//!
//! Four ranks as threads of one process; each averages its buffer with the others':
//!
//! ```
//! use std::time::Duration;
//! use burn_ddp_comm::group::{ProcessGroup, ReduceOp, ThreadGroup};
//!
//! let groups = ThreadGroup::new_group(4)?;
//! std::thread::scope(|s| {
//!     for group in &groups {
//!         s.spawn(move || {
//!             let mut bucket = vec![group.rank() as f32; 3];
//!             group.all_reduce(&mut bucket, ReduceOp::Avg, Duration::from_secs(10))?;
//!             assert_eq!(bucket, [1.5; 3]); // (0 + 1 + 2 + 3) / 4 on every rank
//!             Ok::<(), burn_ddp_comm::CommError>(())
//!         });
//!     }
//! });
//! # Ok::<(), burn_ddp_comm::CommError>(())
//! ```
//!
//! ## Processes
//!
//! A process started by the launcher (`burn-ddp run --nproc-per-node 4 -- ./my-program`),
//! torchrun or Slurm reads its place from the environment and meets its peers through the store
//! that the launcher (or rank 0) serves:
//!
//! ```no_run
//! use std::time::Duration;
//! use burn_ddp_comm::group::{ProcessGroup, ReduceOp, TcpGroup, TcpGroupOptions};
//! use burn_ddp_comm::topology::Topology;
//!
//! let topology = Topology::from_env()?.expect("started by a launcher");
//! let group = TcpGroup::connect(&topology, &TcpGroupOptions::default())?;
//! let mut gradients = vec![0.5f32; 1024];
//! group.all_reduce(&mut gradients, ReduceOp::Avg, Duration::from_secs(300))?;
//! # Ok::<(), burn_ddp_comm::CommError>(())
//! ```
//!
//! ## The launcher
//!
//! What `burn-ddp run --nproc-per-node 2 -- ./train --epochs 3` does, as a library call (burn-ddp's
//! `burn-ddp` binary is a command line over it): two worker processes with the environment above,
//! their output prefixed with `[rank R]`, the others stopped when one fails.
//!
//! ```no_run
//! use burn_ddp_comm::launch::{LaunchConfig, launch};
//!
//! let config = LaunchConfig::new(2, "./train", vec!["--epochs".into(), "3".into()]);
//! let attempts = launch(&config)?;
//! assert!(attempts.last().is_some_and(|attempt| attempt.first_failure.is_none()));
//! # Ok::<(), burn_ddp_comm::CommError>(())
//! ```

#![warn(missing_docs)]

pub mod auth;
mod error;
mod gate;
pub mod group;
pub mod launch;
pub mod log;
mod net;
pub mod rendezvous;
pub mod signals;
pub mod store;
pub mod topology;

pub use error::{CommError, Result};
