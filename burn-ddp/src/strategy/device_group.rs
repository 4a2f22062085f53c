//! Which process group a replica reduces with: NCCL, in GPU memory, for a burn-cuda device;
//! the host group otherwise.

use std::sync::Arc;
use std::time::Duration;

use burn_ddp_comm::group::ProcessGroup;

use crate::error::Result;

/// The process group a replica on `device` trains with: an `NcclGroup` over `host` (same ranks,
/// NCCL id shared through `host`) when `device` is a burn-cuda device and the world has more
/// than one rank; `host` itself otherwise (CPU devices, a single replica, or a build without the
/// `cuda` feature). Every rank calls it at the same time.
///
/// # Errors
/// `NcclGroup::new`'s (as [`DdpError::Comm`](crate::DdpError::Comm)): `LibraryNotFound` without
/// libcuda or libnccl, `Nccl` when the communicator cannot be built within `timeout`.
pub(crate) fn group_for_device<D: std::any::Any>(
    host: Arc<dyn ProcessGroup>,
    device: &D,
    timeout: Duration,
) -> Result<Arc<dyn ProcessGroup>> {
    #[cfg(feature = "cuda")]
    if let Some(cuda) = (device as &dyn std::any::Any).downcast_ref::<cubecl::cuda::CudaDevice>()
        && host.world_size() > 1
        // A group that already reduces device tensors (an `NcclGroup` the caller built) is kept.
        && !burn_ddp_comm::group::ExtendedCollectives::reduces_device_tensors(host.as_ref())
    {
        use burn_ddp_comm::group::nccl::{NcclGroup, NcclIdSource};
        let group = NcclGroup::new(host, cuda.index, NcclIdSource::HostGroup, timeout)?;
        return Ok(Arc::new(group));
    }
    let _ = (device, timeout);
    Ok(host)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn_ddp_comm::group::ThreadGroup;

    #[test]
    fn cpu_devices_and_one_rank_keep_the_host_group() {
        let host: Arc<dyn ProcessGroup> = Arc::new(ThreadGroup::new_group(1).unwrap().remove(0));
        let timeout = Duration::from_secs(30);
        let cpu = burn::backend::flex::FlexDevice;
        let group = group_for_device(host.clone(), &cpu, timeout).unwrap();
        assert_eq!(group.backend(), "threads");
        #[cfg(feature = "cuda")]
        {
            let cuda = cubecl::cuda::CudaDevice::new(0);
            let group = group_for_device(host, &cuda, timeout).unwrap();
            assert_eq!(group.backend(), "threads", "one rank needs no communicator");
        }
    }
}
