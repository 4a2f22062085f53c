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

use std::sync::Arc;

use crate::config::DdpConfig;
use crate::error::Result;
use crate::group::ProcessGroup;

/// The process group a replica on `device` trains with: an [`NcclGroup`] over `host` (same
/// ranks, NCCL id shared through `host`) when `device` is a burn-cuda device and the world has
/// more than one rank; `host` itself otherwise (CPU devices, a single replica, or a build
/// without the `cuda` feature). Every rank calls it at the same time.
///
/// # Errors
/// [`NcclGroup::new`]'s: [`DdpError::LibraryNotFound`](crate::DdpError::LibraryNotFound) without
/// libcuda or libnccl, [`DdpError::Nccl`](crate::DdpError::Nccl) when the communicator cannot
/// be built within `config.timeout()`.
pub(crate) fn group_for_device<D: std::any::Any>(
    host: Arc<dyn ProcessGroup>,
    device: &D,
    config: &DdpConfig,
) -> Result<Arc<dyn ProcessGroup>> {
    #[cfg(feature = "cuda")]
    if let Some(cuda) = (device as &dyn std::any::Any).downcast_ref::<cubecl::cuda::CudaDevice>()
        && host.world_size() > 1
        // A group that already reduces device tensors (an `NcclGroup` the caller built) is kept.
        && !crate::group::ExtendedCollectives::reduces_device_tensors(host.as_ref())
    {
        let group = NcclGroup::new(host, cuda.index, NcclIdSource::HostGroup, config.timeout())?;
        return Ok(Arc::new(group));
    }
    let _ = (device, config);
    Ok(host)
}
