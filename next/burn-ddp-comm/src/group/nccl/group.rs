//! [`NcclGroup`]: a [`ProcessGroup`] of CUDA devices whose collectives run in NCCL, on device
//! memory.
//!
//! # Streams and ordering
//! CubeCL runs Burn's kernels on its own non-blocking CUDA streams, which NCCL cannot see. A
//! device all-reduce therefore (1) waits for the bucket's pending work (Burn's backend sync, then
//! the CubeCL client's), (2) runs NCCL on a stream of the group's own, and (3) returns only when
//! that stream has finished, polled from the host: Burn's later kernels, which read the bucket,
//! are enqueued after the reduced values are in place.
//!
//! # Timeouts
//! The communicator is non-blocking (`ncclConfig_t.blocking = 0`). While a collective runs, the
//! calling thread polls `ncclCommGetAsyncError` and the stream; when the timeout passes, or the
//! group is aborted (by this rank or by a peer, through the host group), it calls
//! `ncclCommAbort` and returns [`CommError::Timeout`] or [`CommError::Aborted`]. An aborted
//! communicator is not used again: every later collective fails at once.

use std::any::Any;
use std::ffi::c_int;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use burn_backend::DType;
use burn_cubecl::CubeBackend;
use burn_cubecl::fusion::FusionCubeRuntime;
use burn_cubecl::tensor::CubeTensor;
use burn_fusion::FusionTensor;
use cubecl::cuda::CudaRuntime;
use cubecl_runtime::runtime::Runtime;
use cudarc::driver::{result as cu, sys as cusys};

use super::api::{
    self, NCCL_IN_PROGRESS, NCCL_SUCCESS, NcclApi, NcclConfig, NcclUniqueId, RawComm,
};
use super::driver::{check_blocking_env, driver_error, grant_pool_access};
pub use super::driver::{check_cuda_driver, cuda_device_count};
use crate::error::{CommError, Result};
use crate::group::call::Calls;
use crate::group::extension::check_blocks;
use crate::group::{Collective, Native, ProcessGroup, ReduceOp, backoff};

mod collectives;
use collectives::Step;

/// How long dropping a group waits for `ncclCommFinalize` before aborting the communicator.
const FINALIZE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long an aborted communicator's stream may take to drain (NCCL's kernels exit once they
/// see the abort) before the group gives up waiting and logs it.
const ABORT_DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// Waits, polling and bounded by `timeout`, until `stream` has no work left.
fn drain_stream(stream: cusys::CUstream, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    let mut polls = 0u32;
    // SAFETY: `stream` is a live stream of the caller's group.
    while unsafe { cusys::cuStreamQuery(stream) } == cusys::CUresult::CUDA_ERROR_NOT_READY {
        if Instant::now() > deadline {
            tracing::warn!(
                "burn-ddp: the NCCL stream still runs {} s after ncclCommAbort",
                timeout.as_secs_f64()
            );
            return;
        }
        backoff(&mut polls);
    }
}

/// The CUDA runtime's server, whose storage holds a CUDA tensor's device memory (Burn 0.22's
/// `CubeTensor` is one type for every CubeCL runtime; its device says which).
type CudaServer = <CudaRuntime as Runtime>::Server;

/// Where a communicator's [`NcclUniqueId`] comes from.
#[derive(Debug, Clone, Copy)]
pub enum NcclIdSource {
    /// Rank 0 creates it and shares it through the host process group (a broadcast of its 128
    /// bytes): threads of one process ([`ThreadGroup`](crate::group::ThreadGroup)), processes joined
    /// by the rendezvous ([`TcpGroup`](crate::group::TcpGroup)) or by MPI (`MpiGroup`: `MPI_Bcast`).
    HostGroup,
    /// Every rank was given the same id, e.g. through the rendezvous store with
    /// [`NcclUniqueId::share_through_store`]. For groups built with [`NcclGroup::new`] in a
    /// custom loop; `DdpStrategy` always uses [`HostGroup`](Self::HostGroup).
    Given(NcclUniqueId),
}

/// Loads NCCL once per process.
fn nccl_api() -> Result<Arc<NcclApi>> {
    static API: OnceLock<Arc<NcclApi>> = OnceLock::new();
    if let Some(api) = API.get() {
        return Ok(api.clone());
    }
    let api = Arc::new(NcclApi::load()?);
    Ok(API.get_or_init(|| api).clone())
}

/// CUDA handles, owned by one group and only used under its lock.
struct Cuda {
    ctx: cusys::CUcontext,
    stream: cusys::CUstream,
    comm: RawComm,
    /// Device memory for the host-buffer collectives (grown on demand), and its size in bytes.
    scratch: cusys::CUdeviceptr,
    scratch_bytes: usize,
    /// Set when the communicator was aborted: it is not used again.
    broken: Option<String>,
}

// SAFETY: the raw CUDA and NCCL handles are only used while holding the group's mutex, and CUDA
// contexts, streams and NCCL communicators may be used from any thread (one at a time).
unsafe impl Send for Cuda {}

/// A process group of CUDA devices whose collectives run in NCCL.
///
/// One per rank, each on its own GPU; all ranks build theirs at the same time (the communicator's
/// initialisation is collective). The host group it is built from stays in use for the id
/// exchange and to spread an abort to the peers.
///
/// ```no_run
/// # use std::sync::Arc;
/// # use std::time::Duration;
/// # use burn_ddp_comm::group::{ProcessGroup, TcpGroup, TcpGroupOptions};
/// # use burn_ddp_comm::group::nccl::{NcclGroup, NcclIdSource};
/// # fn main() -> burn_ddp_comm::Result<()> {
/// let host = Arc::new(TcpGroup::from_env(&TcpGroupOptions::default())?);
/// let local_rank = 0; // this process's GPU
/// let group = NcclGroup::new(host, local_rank, NcclIdSource::HostGroup, Duration::from_secs(300))?;
/// let mut values = vec![1.0f32; 4];
/// group.all_reduce(&mut values, burn_ddp_comm::group::ReduceOp::Sum, Duration::from_secs(60))?;
/// # Ok(())
/// # }
/// ```
pub struct NcclGroup {
    rank: usize,
    world_size: usize,
    device_index: usize,
    api: Arc<NcclApi>,
    host: Arc<dyn ProcessGroup>,
    cuda: Mutex<Cuda>,
    /// The sequence numbers (from 1 here: setup steps are 0) and the abort's reason.
    calls: Calls,
}

impl std::fmt::Debug for NcclGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclGroup")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("device_index", &self.device_index)
            .field("nccl", &self.api)
            .finish_non_exhaustive()
    }
}

/// Rank 0's NCCL id to every rank by the host group's broadcast (MPI_Bcast under `MpiGroup`, as
/// Horovod does): 128 bytes as 32 `f32` bit patterns, copied and never computed on
/// (bit-preserving on x86-64 and AArch64).
fn exchange_id(host: &dyn ProcessGroup, api: &NcclApi, timeout: Duration) -> Result<NcclUniqueId> {
    let rank = host.rank();
    let mut bits = [0f32; 32];
    if rank == 0 {
        for (i, word) in api.unique_id(rank)?.to_words().iter().enumerate() {
            bits[2 * i] = f32::from_bits(*word as u32);
            bits[2 * i + 1] = f32::from_bits((*word >> 32) as u32);
        }
    }
    host.broadcast(&mut bits, 0, timeout)?;
    let words: Vec<u64> = bits
        .chunks_exact(2)
        .map(|pair| u64::from(pair[0].to_bits()) | u64::from(pair[1].to_bits()) << 32)
        .collect();
    NcclUniqueId::from_words(&words).ok_or_else(|| {
        CommError::InvalidConfig("the NCCL id exchange returned too few words".into())
    })
}

/// Several GPUs in one process (threads): NCCL's intra-process path writes straight into the
/// peers' buffers, which CubeCL allocates from stream-ordered memory pools; peer access to a
/// pool must be granted with `cuMemPoolSetAccess` (NCCL 2.23 and later do without it). The
/// ranks tell each other their devices by one all-gather.
fn share_memory_pools(
    host: &dyn ProcessGroup,
    api: &NcclApi,
    device: cusys::CUdevice,
    device_index: usize,
    timeout: Duration,
) -> Result<()> {
    let rank = host.rank();
    let ordinals = host.all_gather(&[device_index as u64], timeout)?;
    // SAFETY: `device` is a valid device and its context is current.
    let Err(why) = (unsafe { grant_pool_access(device, &ordinals, device_index) }) else {
        return Ok(());
    };
    if api.version < 2 * 10_000 + 23 * 100 {
        return Err(CommError::Nccl {
            rank,
            op: "cuMemPoolSetAccess".into(),
            seq: 0,
            code: "peer access".into(),
            detail: format!(
                "cannot give the other GPUs of this process access to cuda:{device_index}'s \
                 memory pool ({why}), which NCCL {} needs for several GPUs in one process; use \
                 NCCL 2.23 or later, or one process per GPU (burn-ddp run)",
                api::version_string(api.version)
            ),
        });
    }
    tracing::debug!(
        "burn-ddp: rank {rank}: no peer access to cuda:{device_index}'s memory pool ({why}); \
         NCCL {} does not need it",
        api::version_string(api.version)
    );
    Ok(())
}

impl NcclGroup {
    /// Builds rank `host.rank()`'s communicator on GPU `device_index` (a CUDA ordinal, counted
    /// after `CUDA_VISIBLE_DEVICES`), with the same rank and world size as `host`. Every rank
    /// calls it at the same time; `timeout` bounds the id exchange and, again, the
    /// communicator's initialisation.
    ///
    /// # Errors
    /// [`CommError::LibraryNotFound`] when libcuda, NVRTC, the CUDA headers or libnccl is missing
    /// (see [`check_cuda_driver`] and the [module docs](super)); [`CommError::Nccl`] when a
    /// CUDA or NCCL call fails, with code `"timeout"` when the ranks do not all join within
    /// `timeout` and `"aborted"` when a peer aborts meanwhile; [`CommError::InvalidConfig`] for a
    /// device index beyond `i32`; the host group's errors during the id exchange. On error the
    /// host group is aborted, so the peers fail fast too.
    pub fn new(
        host: Arc<dyn ProcessGroup>,
        device_index: usize,
        id: NcclIdSource,
        timeout: Duration,
    ) -> Result<Self> {
        let rank = host.rank();
        let built = Self::build(host.clone(), device_index, id, timeout);
        if let Err(err) = &built {
            host.abort(&format!("rank {rank} could not set up NCCL: {err}"));
        }
        built
    }

    fn build(
        host: Arc<dyn ProcessGroup>,
        device_index: usize,
        id: NcclIdSource,
        timeout: Duration,
    ) -> Result<Self> {
        let rank = host.rank();
        let world_size = host.world_size();
        check_blocking_env(rank)?;
        check_cuda_driver()?;
        let api = nccl_api()?;
        let id = match id {
            NcclIdSource::Given(id) => id,
            NcclIdSource::HostGroup => exchange_id(host.as_ref(), &api, timeout)?,
        };
        let setup = |op: &'static str| move |e: cu::DriverError| driver_error(rank, op, 0, e);
        cu::init().map_err(setup("cuInit"))?;
        let ordinal = c_int::try_from(device_index).map_err(|_| {
            CommError::InvalidConfig(format!("CUDA device index {device_index} is too large"))
        })?;
        let device = cu::device::get(ordinal).map_err(setup("cuDeviceGet"))?;
        // SAFETY: `device` is a valid device; the primary context is the one CubeCL uses, and it
        // is retained for the life of the process (as CubeCL does).
        let ctx = unsafe { cu::primary_ctx::retain(device) }
            .map_err(setup("cuDevicePrimaryCtxRetain"))?;
        // SAFETY: `ctx` was just retained.
        unsafe { cu::ctx::set_current(ctx) }.map_err(setup("cuCtxSetCurrent"))?;
        if host.backend() == "threads" && world_size > 1 {
            share_memory_pools(host.as_ref(), &api, device, device_index, timeout)?;
        }
        let stream = cu::stream::create(cu::stream::StreamKind::NonBlocking)
            .map_err(setup("cuStreamCreate"))?;

        let mut comm: RawComm = std::ptr::null_mut();
        let mut config = NcclConfig::new(false);
        // SAFETY: `comm` and `config` are valid for writes and reads; `id` is 128 bytes, passed
        // by value as nccl.h declares.
        let code = unsafe {
            (api.comm_init_rank_config)(
                &mut comm,
                world_size as c_int,
                id,
                rank as c_int,
                &mut config,
            )
        };
        let group = Self {
            rank,
            world_size,
            device_index,
            api: api.clone(),
            host,
            cuda: Mutex::new(Cuda {
                ctx,
                stream,
                comm,
                scratch: 0,
                scratch_bytes: 0,
                broken: None,
            }),
            calls: Calls::default(),
        };
        if code != NCCL_SUCCESS && code != NCCL_IN_PROGRESS {
            return Err(api.error(code, rank, "ncclCommInitRankConfig", 0, comm));
        }
        {
            let mut cuda = group.lock();
            group.wait(&mut cuda, Step::Init, 0, timeout)?;
        }
        tracing::debug!(
            "burn-ddp: NCCL {} ({}) communicator for rank {rank}/{world_size} on cuda:{device_index}",
            api::version_string(api.version),
            api.path
        );
        Ok(group)
    }

    /// The CUDA ordinal of this rank's GPU.
    pub fn device_index(&self) -> usize {
        self.device_index
    }

    /// The NCCL version in use, as `ncclGetVersion` reports it (e.g. 22703 for 2.27.3).
    pub fn nccl_version(&self) -> i32 {
        self.api.version
    }

    fn lock(&self) -> MutexGuard<'_, Cuda> {
        self.cuda.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn next_seq(&self) -> u64 {
        self.calls.next() + 1
    }

    /// Fails fast on a group that was aborted or whose communicator is broken.
    fn check_usable(&self, cuda: &Cuda, op: Collective, seq: u64) -> Result<()> {
        let cause = cuda.broken.clone().or_else(|| self.calls.aborted());
        match cause {
            Some(cause) => Err(CommError::Aborted {
                rank: self.rank,
                op,
                seq,
                cause,
            }),
            None => Ok(()),
        }
    }

    /// Makes the group's context current on the calling thread.
    fn enter(&self, cuda: &Cuda, op: &str, seq: u64) -> Result<()> {
        // SAFETY: the context was retained in `build` and is never released.
        unsafe { cu::ctx::set_current(cuda.ctx) }.map_err(|e| driver_error(self.rank, op, seq, e))
    }

    /// Aborts the communicator (once) and records why.
    fn break_comm(&self, cuda: &mut Cuda, why: &str) {
        if cuda.broken.is_none() {
            // SAFETY: the communicator is valid and not used again once `broken` is set. The
            // abort makes NCCL's kernels exit; waiting for the stream then guarantees nothing
            // writes a buffer that the caller releases after the error.
            unsafe { (self.api.comm_abort)(cuda.comm) };
            drain_stream(cuda.stream, ABORT_DRAIN_TIMEOUT);
            cuda.broken = Some(why.to_string());
        }
    }
}

impl ProcessGroup for NcclGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn backend(&self) -> &'static str {
        "nccl"
    }

    fn all_reduce(&self, bucket: &mut [f32], op: ReduceOp, timeout: Duration) -> Result<()> {
        let len = bucket.len();
        self.host_all_reduce(Collective::AllReduce { op, len }, bucket, op, timeout)
    }

    fn broadcast(&self, buffer: &mut [f32], root: usize, timeout: Duration) -> Result<()> {
        let len = buffer.len();
        if root >= self.world_size {
            return Err(CommError::InvalidConfig(format!(
                "broadcast root {root} is not a rank of a group of {}",
                self.world_size
            )));
        }
        let bytes = bytemuck::cast_slice_mut::<f32, u8>(buffer);
        // Only the root's values travel.
        let upload = if self.rank == root {
            0..bytes.len()
        } else {
            0..0
        };
        self.host_collective(
            Collective::Broadcast { root, len },
            bytes,
            upload,
            timeout,
            |api, scratch, comm, stream| {
                // SAFETY: as in `host_all_reduce`.
                unsafe {
                    (api.broadcast)(
                        scratch as *const std::ffi::c_void,
                        scratch as *mut std::ffi::c_void,
                        len,
                        api::dtype::FLOAT32,
                        root as c_int,
                        comm,
                        stream as api::RawStream,
                    )
                }
            },
        )
    }

    fn barrier(&self, timeout: Duration) -> Result<()> {
        // A one-value all-reduce: NCCL has no barrier, and this is what PyTorch's does.
        self.host_all_reduce(Collective::Barrier, &mut [0.0], ReduceOp::Sum, timeout)
    }

    fn all_gather(&self, values: &[u64], timeout: Duration) -> Result<Vec<u64>> {
        let len = values.len();
        let rank = self.rank;
        // NCCL's in-place layout: this rank's values at its slot of the result.
        let mut out = vec![0u64; len * self.world_size];
        out[rank * len..(rank + 1) * len].copy_from_slice(values);
        self.host_all_gather(
            Collective::AllGather { len },
            &mut out,
            len,
            api::dtype::UINT64,
            timeout,
        )?;
        Ok(out)
    }

    fn abort(&self, reason: &str) {
        self.calls
            .abort(&format!("rank {} aborted the group: {reason}", self.rank));
        // The peers learn it through the host group (their waits poll it).
        self.host.abort(reason);
    }

    fn aborted(&self) -> Option<String> {
        self.calls.aborted().or_else(|| self.host.aborted())
    }

    fn native(&self) -> Option<&dyn Native> {
        Some(self)
    }
}

impl crate::group::Sealed for NcclGroup {}

impl Native for NcclGroup {
    fn reduces_device_tensors(&self) -> bool {
        true
    }

    /// `ncclAllGather` of the host values through the device scratch buffer (NCCL's in-place
    /// layout).
    fn all_gather_f32(&self, send: &[f32], recv: &mut [f32], timeout: Duration) -> Result<()> {
        let len = send.len();
        check_blocks(self, "all_gather_f32", len, recv.len())?;
        let rank = self.rank;
        recv[rank * len..(rank + 1) * len].copy_from_slice(send);
        self.host_all_gather(
            Collective::AllGatherF32 { len },
            recv,
            len,
            api::dtype::FLOAT32,
            timeout,
        )
    }

    /// `ncclReduceScatter` of the host values through the device scratch buffer (in place: this
    /// rank's block is its result).
    fn reduce_scatter(
        &self,
        send: &[f32],
        recv: &mut [f32],
        op: ReduceOp,
        timeout: Duration,
    ) -> Result<()> {
        let len = recv.len();
        check_blocks(self, "reduce_scatter", len, send.len())?;
        let rank = self.rank;
        let mut all = send.to_vec();
        let bytes = all.len() * 4;
        self.host_collective(
            Collective::ReduceScatter { op, len },
            bytemuck::cast_slice_mut(&mut all),
            0..bytes,
            timeout,
            |api, scratch, comm, stream| {
                // SAFETY: `scratch` holds the `world_size * len` f32 uploaded; the result goes
                // to this rank's block of it.
                unsafe {
                    (api.reduce_scatter)(
                        scratch as *const std::ffi::c_void,
                        (scratch + (rank * len * 4) as u64) as *mut std::ffi::c_void,
                        len,
                        api::dtype::FLOAT32,
                        api::nccl_op(op),
                        comm,
                        stream as api::RawStream,
                    )
                }
            },
        )?;
        recv.copy_from_slice(&all[rank * len..(rank + 1) * len]);
        Ok(())
    }

    fn all_reduce_device(
        &self,
        tensor: &mut dyn Any,
        op: ReduceOp,
        timeout: Duration,
    ) -> Result<bool> {
        match Self::cube_tensor(tensor) {
            Some(tensor) => self.reduce_cube(tensor, None, op, timeout).map(|()| true),
            None => Ok(false),
        }
    }
}

impl Drop for NcclGroup {
    fn drop(&mut self) {
        let cuda = self.cuda.get_mut().unwrap_or_else(|e| e.into_inner());
        // SAFETY: the handles belong to this group and nothing uses them after this point.
        unsafe {
            let _ = cu::ctx::set_current(cuda.ctx);
            // A communicator whose initialisation failed is NULL: nothing to finalize.
            if cuda.broken.is_none() && !cuda.comm.is_null() {
                // Finalize flushes what peers may still be receiving; bounded, then destroy. A
                // communicator that does not finish in time is aborted instead.
                let mut finished = false;
                let code = (self.api.comm_finalize)(cuda.comm);
                if code == NCCL_SUCCESS || code == NCCL_IN_PROGRESS {
                    let deadline = Instant::now() + FINALIZE_TIMEOUT;
                    let mut polls = 0u32;
                    loop {
                        let mut state = NCCL_SUCCESS;
                        let code = (self.api.comm_get_async_error)(cuda.comm, &mut state);
                        if code != NCCL_SUCCESS || state != NCCL_IN_PROGRESS {
                            finished = code == NCCL_SUCCESS && state == NCCL_SUCCESS;
                            break;
                        }
                        if Instant::now() > deadline {
                            break;
                        }
                        backoff(&mut polls);
                    }
                }
                if finished {
                    let _ = (self.api.comm_destroy)(cuda.comm);
                } else {
                    let _ = (self.api.comm_abort)(cuda.comm);
                }
                drain_stream(cuda.stream, ABORT_DRAIN_TIMEOUT);
            }
            if cuda.scratch != 0 {
                let _ = cu::free_sync(cuda.scratch);
            }
            let _ = cu::stream::destroy(cuda.stream);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::group::ThreadGroup;
    use crate::group::nccl::driver::check_blocking;

    #[test]
    fn nccl_comm_blocking_is_refused_with_why() {
        match check_blocking(Some("1"), 3) {
            Err(CommError::InvalidConfig(why)) => {
                assert!(why.contains("rank 3") && why.contains("timeouts"), "{why}");
            }
            other => panic!("expected InvalidConfig, got {other:?}"),
        }
        assert!(check_blocking(Some("0"), 0).is_ok());
        assert!(check_blocking(None, 0).is_ok());
    }

    /// Without a driver (CI), building the group is a clear error and the host group is aborted
    /// so the peers do not wait; with one (a GPU machine), a world of one builds and reduces.
    #[test]
    fn a_missing_driver_is_an_error_that_aborts_the_host_group() {
        let host: Arc<dyn ProcessGroup> = Arc::new(ThreadGroup::new_group(1).unwrap().remove(0));
        let built = NcclGroup::new(
            host.clone(),
            0,
            NcclIdSource::HostGroup,
            Duration::from_secs(30),
        );
        match check_cuda_driver() {
            Err(expected) => {
                let err = built.unwrap_err();
                assert_eq!(err, expected);
                match &err {
                    CommError::LibraryNotFound { searched, hint, .. } => {
                        assert!(searched.iter().any(|s| s.starts_with("libcuda.so")));
                        assert!(hint.contains("LD_LIBRARY_PATH"));
                    }
                    other => panic!("expected LibraryNotFound, got {other:?}"),
                }
                let aborted = host.aborted().expect("the host group is aborted");
                assert!(aborted.contains("could not set up NCCL"), "{aborted}");
                assert!(cuda_device_count().is_err());
            }
            Ok(()) => {
                if let Ok(group) = built {
                    let mut values = vec![1.5f32, -2.0, 3.25];
                    group
                        .all_reduce(&mut values, ReduceOp::Sum, Duration::from_secs(30))
                        .unwrap();
                    assert_eq!(values, [1.5, -2.0, 3.25]);
                    assert_eq!(
                        group.all_gather(&[9, 8], Duration::from_secs(30)).unwrap(),
                        [9, 8]
                    );
                }
            }
        }
    }
}
