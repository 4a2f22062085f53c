//! NCCL: the process group of CUDA devices (`NcclGroup`, feature `cuda`); `libnccl` is found and
//! loaded at run time (`BURN_DDP_NCCL_LIB`, the `nvidia-nccl-cu*` Python wheels, the dynamic
//! linker's search).
//!
//! The library lookup and the C API's types are plain Rust, built and tested without a GPU; the
//! group itself needs the `cuda` feature.

// Without `cuda` only their unit tests use them.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) mod api;
#[cfg(feature = "cuda")]
mod driver;
#[cfg(feature = "cuda")]
mod group;
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) mod library;

pub use api::{NcclUniqueId, version_string};
#[cfg(feature = "cuda")]
pub use group::{NcclGroup, NcclIdSource, check_cuda_driver, cuda_device_count};
pub use library::NCCL_LIB_ENV;
