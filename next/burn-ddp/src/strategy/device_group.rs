//! Which process group a replica reduces with: NCCL, in GPU memory, for a CUDA device; the host
//! group otherwise.

use std::sync::Arc;
use std::time::Duration;

use burn::tensor::Device;
use burn_ddp_comm::group::ProcessGroup;

use crate::error::Result;

/// The process group a replica on `device` trains with: an `NcclGroup` over `host` (same ranks,
/// NCCL id shared through `host`) when `device` is a CUDA device (Burn 0.22's `Device::cuda(i)`,
/// with or without autodiff) and the world has more than one rank; `host` itself otherwise (CPU
/// devices, a single replica, or a build without the `cuda` feature). Every rank calls it at the
/// same time.
///
/// # Errors
/// `NcclGroup::new`'s (as [`DdpError::Comm`](crate::DdpError::Comm)): `LibraryNotFound` without
/// libcuda or libnccl, `Nccl` when the communicator cannot be built within `timeout`.
pub(crate) fn group_for_device(
    host: Arc<dyn ProcessGroup>,
    device: &Device,
    timeout: Duration,
) -> Result<Arc<dyn ProcessGroup>> {
    #[cfg(feature = "cuda")]
    if let Some(index) = cuda_index(device)
        && host.world_size() > 1
        // A group that already reduces device tensors (an `NcclGroup` the caller built) is kept.
        && !burn_ddp_comm::group::ExtendedCollectives::reduces_device_tensors(host.as_ref())
    {
        use burn_ddp_comm::group::nccl::{NcclGroup, NcclIdSource};
        let group = NcclGroup::new(host, index, NcclIdSource::HostGroup, timeout)?;
        return Ok(Arc::new(group));
    }
    let _ = (device, timeout);
    Ok(host)
}

/// The CUDA index of `device`, if it is a CUDA device (one of CubeCL's runtimes, which Burn 0.22
/// dispatches as one backend).
#[cfg(feature = "cuda")]
pub(crate) fn cuda_index(device: &Device) -> Option<usize> {
    use burn::backend::DispatchDevice;
    use burn::backend::cubecl::Device as CubeDevice;
    match device.clone().inner().as_dispatch() {
        DispatchDevice::Cube(CubeDevice::Cuda(cuda)) => Some(cuda.index),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn_ddp_comm::group::ThreadGroup;

    #[test]
    fn cpu_devices_and_one_rank_keep_the_host_group() {
        let host: Arc<dyn ProcessGroup> = Arc::new(ThreadGroup::new_group(1).unwrap().remove(0));
        let timeout = Duration::from_secs(30);
        for cpu in [Device::flex(), Device::flex().autodiff()] {
            let group = group_for_device(host.clone(), &cpu, timeout).unwrap();
            assert_eq!(group.backend(), "threads");
        }
        #[cfg(feature = "cuda")]
        {
            // Naming a CUDA device needs no driver; only its client would.
            for cuda in [Device::cuda(0), Device::cuda(1).autodiff()] {
                assert!(cuda_index(&cuda).is_some(), "{cuda:?}");
                let group = group_for_device(host.clone(), &cuda, timeout).unwrap();
                assert_eq!(group.backend(), "threads", "one rank needs no communicator");
            }
            assert_eq!(cuda_index(&Device::cuda(1)), Some(1));
            assert_eq!(cuda_index(&Device::flex()), None);
        }
    }
}
