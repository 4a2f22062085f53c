//! The CUDA driver side of the NCCL path: what must be present before CubeCL touches a device
//! (driver, NVRTC, headers), device counting, driver errors as [`CommError`]s, the environment
//! NCCL must not run under (`NCCL_COMM_BLOCKING=1`), and peer access to the devices' memory pools
//! for several GPUs in one process.

use std::ffi::c_int;

use cudarc::driver::{result as cu, sys as cusys};

use crate::error::{CommError, Result};

/// Checks what CubeCL needs at run time before anything touches a CUDA device (cudarc and CubeCL
/// panic when a piece is missing): the CUDA driver library, NVRTC (CubeCL's kernel compiler),
/// and the CUDA headers its kernels include (`<CUDA_PATH>/include/cuda_runtime.h`, where
/// `CUDA_PATH` defaults to `/usr/local/cuda`, then `/opt/cuda`, as CubeCL looks for them).
/// Call it before creating a burn-cuda device; `NcclGroup::new` calls it too.
///
/// # Errors
/// [`CommError::LibraryNotFound`] naming the library and the file names tried.
pub fn check_cuda_driver() -> Result<()> {
    // SAFETY: cudarc's probes only try to load the libraries.
    if !unsafe { cusys::is_culib_present() } {
        return Err(CommError::LibraryNotFound {
            library: "the CUDA driver (libcuda)".into(),
            searched: cudarc::get_lib_name_candidates("cuda"),
            detail: "no candidate loads".into(),
            hint: "run on a machine with an NVIDIA driver (libcuda.so.1 comes with it), or add \
                   its directory to LD_LIBRARY_PATH"
                .into(),
        });
    }
    let cuda_path = cubecl::cuda::install::cuda_path();
    let header = cuda_path
        .as_ref()
        .map(|p| p.join("include").join("cuda_runtime.h"));
    if !header.as_ref().is_some_and(|h| h.is_file()) {
        return Err(CommError::LibraryNotFound {
            library: "the CUDA headers (cuda_runtime.h) CubeCL compiles its kernels with".into(),
            searched: vec![match &header {
                Some(header) => header.display().to_string(),
                None => "$CUDA_PATH, /usr/local/cuda, /opt/cuda, /usr (with /usr/bin/nvcc)".into(),
            }],
            detail: "not found".into(),
            hint: "install a CUDA toolkit, or point CUDA_PATH at a directory whose include/ holds \
                   cuda_runtime.h (e.g. the nvidia-cuda-runtime wheel's)"
                .into(),
        });
    }
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(CommError::LibraryNotFound {
            library: "NVRTC (libnvrtc), CubeCL's kernel compiler".into(),
            searched: cudarc::get_lib_name_candidates("nvrtc"),
            detail: "no candidate loads".into(),
            hint: "install the CUDA runtime libraries (a CUDA toolkit's lib64, or `pip install \
                   nvidia-cuda-nvrtc-cu13`) and add the directory of libnvrtc.so.* to \
                   LD_LIBRARY_PATH"
                .into(),
        });
    }
    Ok(())
}

/// The number of CUDA devices this process sees (after `CUDA_VISIBLE_DEVICES`).
///
/// # Errors
/// [`CommError::LibraryNotFound`] without libcuda; [`CommError::Nccl`] naming the failed driver
/// call (e.g. `cuInit` with `CUDA_ERROR_NO_DEVICE`).
pub fn cuda_device_count() -> Result<usize> {
    check_cuda_driver()?;
    let driver = |op: &'static str| move |e: cu::DriverError| driver_error(0, op, 0, e);
    cu::init().map_err(driver("cuInit"))?;
    let count = cu::device::get_count().map_err(driver("cuDeviceGetCount"))?;
    Ok(usize::try_from(count).unwrap_or(0))
}

/// A CUDA driver error as a [`CommError::Nccl`].
pub(super) fn driver_error(rank: usize, op: &str, seq: u64, err: cu::DriverError) -> CommError {
    let name = err
        .error_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|_| format!("CUresult {:?}", err.0));
    let text = err
        .error_string()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    CommError::Nccl {
        rank,
        op: op.to_string(),
        seq,
        code: name,
        detail: text,
    }
}

/// `NCCL_COMM_BLOCKING=1` makes every NCCL call block until it completes, whatever the
/// communicator's configuration says, so a collective that never completes could be neither
/// timed out nor aborted: refused, with why.
pub(super) fn check_blocking_env(rank: usize) -> Result<()> {
    check_blocking(std::env::var("NCCL_COMM_BLOCKING").ok().as_deref(), rank)
}

/// [`check_blocking_env`] for the variable's value.
pub(super) fn check_blocking(value: Option<&str>, rank: usize) -> Result<()> {
    match value {
        Some(value) if value.trim() == "1" => Err(CommError::InvalidConfig(format!(
            "rank {rank}: NCCL_COMM_BLOCKING=1 makes NCCL's calls blocking, which defeats \
             burn-ddp's collective timeouts and aborts (a rank that never arrives would hang \
             the others for ever); unset it"
        ))),
        _ => Ok(()),
    }
}

/// Lets the devices `ordinals` (but `mine`) read and write the memory pool `device` allocates
/// from (the one `cuMemAllocAsync` uses).
///
/// # Safety
/// `device` must be a valid device whose context is current on this thread.
pub(super) unsafe fn grant_pool_access(
    device: cusys::CUdevice,
    ordinals: &[u64],
    mine: usize,
) -> std::result::Result<(), String> {
    // `CUmemLocation` is `{ type, id }` (two C ints) in every CUDA release, but CUDA 13.2 wraps
    // `id` in a union, so cudarc's struct differs by version: it is written as two ints.
    const _: () = assert!(std::mem::size_of::<cusys::CUmemLocation>() == 8);
    let peers: Vec<cusys::CUmemAccessDesc> = ordinals
        .iter()
        .filter(|&&o| o as usize != mine)
        .map(|&o| {
            // SAFETY: an all-zero descriptor is a valid value of this plain C struct; its
            // location is then written as the two ints it is.
            let mut desc: cusys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
            let location = (&mut desc.location as *mut cusys::CUmemLocation).cast::<[c_int; 2]>();
            // SAFETY: `location` points to the 8 bytes of `desc.location` (checked above).
            unsafe {
                *location = [
                    cusys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE as c_int,
                    o as c_int,
                ];
            }
            desc.flags = cusys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
            desc
        })
        .collect();
    if peers.is_empty() {
        return Ok(());
    }
    let mut pool: cusys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: `pool` is valid for writes; `device` is valid (the caller's guarantee).
    let code = unsafe { cusys::cuDeviceGetMemPool(&mut pool, device) };
    if code != cusys::CUresult::CUDA_SUCCESS {
        return Err(format!("cuDeviceGetMemPool: {code:?}"));
    }
    // SAFETY: `pool` is the device's current pool; `peers` holds `peers.len()` descriptors.
    let code = unsafe { cusys::cuMemPoolSetAccess(pool, peers.as_ptr(), peers.len()) };
    if code != cusys::CUresult::CUDA_SUCCESS {
        return Err(format!("cuMemPoolSetAccess: {code:?}"));
    }
    Ok(())
}
