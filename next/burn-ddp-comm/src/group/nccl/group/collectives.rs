//! The collectives' machinery of [`NcclGroup`]: waiting on the communicator and the group's
//! stream against the timeout and the abort flags, the device scratch buffer for host-memory
//! collectives, and the all-reduce of burn-cuda tensors in place. The communicator's life cycle
//! (set-up, abort, drop) and the `ProcessGroup` calls are in the parent module.

use super::*;

impl NcclGroup {
    /// Waits until the communicator's pending call and the group's stream are done, polling both
    /// and the abort flags until `timeout` passes.
    pub(super) fn wait(
        &self,
        cuda: &mut Cuda,
        step: Step,
        seq: u64,
        timeout: Duration,
    ) -> Result<()> {
        let started = Instant::now();
        let mut polls = 0u32;
        loop {
            let mut state: c_int = NCCL_SUCCESS;
            // SAFETY: valid communicator, `state` valid for a write.
            let code = unsafe { (self.api.comm_get_async_error)(cuda.comm, &mut state) };
            let failed = if code != NCCL_SUCCESS {
                Some(code)
            } else if state != NCCL_SUCCESS && state != NCCL_IN_PROGRESS {
                Some(state)
            } else {
                None
            };
            if let Some(code) = failed {
                let err = self
                    .api
                    .error(code, self.rank, &step.name(), seq, cuda.comm);
                self.break_comm(cuda, &err.to_string());
                return Err(err);
            }
            if state == NCCL_SUCCESS {
                if matches!(step, Step::Init) {
                    return Ok(());
                }
                // SAFETY: the stream belongs to this group.
                match unsafe { cusys::cuStreamQuery(cuda.stream) } {
                    cusys::CUresult::CUDA_SUCCESS => return Ok(()),
                    cusys::CUresult::CUDA_ERROR_NOT_READY => {}
                    other => {
                        let err =
                            driver_error(self.rank, &step.name(), seq, cu::DriverError(other));
                        self.break_comm(cuda, &err.to_string());
                        return Err(err);
                    }
                }
            }
            let aborted = self.calls.aborted().or_else(|| self.host.aborted());
            if let Some(cause) = aborted {
                self.break_comm(cuda, &cause);
                return Err(match step {
                    Step::Collective(op) => CommError::Aborted {
                        rank: self.rank,
                        op,
                        seq,
                        cause,
                    },
                    Step::Init => CommError::Nccl {
                        rank: self.rank,
                        op: step.name(),
                        seq,
                        code: "aborted".into(),
                        detail: cause,
                    },
                });
            }
            if started.elapsed() > timeout {
                let err = match step {
                    Step::Collective(op) => CommError::Timeout {
                        rank: self.rank,
                        op,
                        seq,
                        timeout,
                        missing: Vec::new(),
                        last_seen: Vec::new(),
                    },
                    Step::Init => CommError::Nccl {
                        rank: self.rank,
                        op: step.name(),
                        seq,
                        code: "timeout".into(),
                        detail: format!(
                            "not every rank joined the communicator within {} s; check that \
                             all {} ranks started and see NCCL_DEBUG=WARN",
                            timeout.as_secs_f64(),
                            self.world_size
                        ),
                    },
                };
                let why = err.to_string();
                self.break_comm(cuda, &why);
                // The peers are probably stuck in the same collective: end their wait too.
                self.host.abort(&why);
                return Err(err);
            }
            backoff(&mut polls);
        }
    }

    /// Device memory of at least `bytes` for the host-buffer collectives.
    pub(super) fn scratch(&self, cuda: &mut Cuda, bytes: usize, op: &str, seq: u64) -> Result<u64> {
        if cuda.scratch_bytes < bytes {
            if cuda.scratch != 0 {
                // SAFETY: allocated below by this group; no collective is using it (under lock).
                unsafe { cu::free_sync(cuda.scratch) }
                    .map_err(|e| driver_error(self.rank, op, seq, e))?;
                cuda.scratch = 0;
                cuda.scratch_bytes = 0;
            }
            let size = bytes.next_power_of_two().max(256);
            // SAFETY: plain allocation in the current context.
            cuda.scratch = unsafe { cu::malloc_sync(size) }
                .map_err(|e| driver_error(self.rank, op, seq, e))?;
            cuda.scratch_bytes = size;
        }
        Ok(cuda.scratch)
    }

    /// A collective on host memory: `buffer[upload]` is copied to the same byte range of the
    /// device scratch buffer, `launch` runs NCCL on the scratch buffer, and the scratch buffer's
    /// first `buffer.len()` bytes are copied back into `buffer` (no host copy of the input).
    pub(super) fn host_collective(
        &self,
        op: Collective,
        buffer: &mut [u8],
        upload: std::ops::Range<usize>,
        timeout: Duration,
        launch: impl FnOnce(&NcclApi, u64, RawComm, cusys::CUstream) -> c_int,
    ) -> Result<()> {
        let seq = self.next_seq();
        let mut cuda = self.lock();
        self.check_usable(&cuda, op, seq)?;
        let name = op.name();
        self.enter(&cuda, name, seq)?;
        let scratch = self.scratch(&mut cuda, buffer.len(), name, seq)?;
        let driver = |e| driver_error(self.rank, name, seq, e);
        if !upload.is_empty() {
            // SAFETY: `scratch` holds at least `buffer.len()` bytes; the copy is ordered before
            // the collective on the same stream, and `buffer` is not touched until it is done.
            unsafe {
                cu::memcpy_htod_async(
                    scratch + upload.start as u64,
                    &buffer[upload.clone()],
                    cuda.stream,
                )
                .map_err(driver)?
            };
        }
        let code = launch(&self.api, scratch, cuda.comm, cuda.stream);
        if code != NCCL_SUCCESS && code != NCCL_IN_PROGRESS {
            let err = self.api.error(code, self.rank, name, seq, cuda.comm);
            self.break_comm(&mut cuda, &err.to_string());
            return Err(err);
        }
        self.wait(&mut cuda, Step::Collective(op), seq, timeout)?;
        if !buffer.is_empty() {
            // SAFETY: the stream is done, so the scratch buffer holds the result.
            unsafe { cu::memcpy_dtoh_sync(buffer, scratch) }.map_err(driver)?;
        }
        Ok(())
    }

    /// All-reduce of a CubeCL CUDA tensor in place, or of `src` into `dst` when given.
    pub(super) fn reduce_cube(
        &self,
        src: CubeTensor,
        dst: Option<CubeTensor>,
        op: ReduceOp,
        timeout: Duration,
    ) -> Result<()> {
        let len = src.meta.shape().num_elements();
        let collective = Collective::AllReduce { op, len };
        let seq = self.next_seq();
        let name = "all_reduce";
        let layout = |detail: String| CommError::Nccl {
            rank: self.rank,
            op: name.into(),
            seq,
            code: "unsupported bucket".into(),
            detail,
        };
        let (dtype, element_bytes) = match src.dtype {
            DType::F32 => (api::dtype::FLOAT32, 4),
            DType::BF16 => (api::dtype::BFLOAT16, 2),
            DType::F16 => (api::dtype::FLOAT16, 2),
            other => {
                return Err(layout(format!(
                    "buckets are f32, bf16 or f16; this one is {other:?}"
                )));
            }
        };
        let target = dst.as_ref().unwrap_or(&src);
        for (what, t) in [("bucket", &src), ("output", target)] {
            match &t.device {
                cubecl::Device::Cuda(device) if device.index == self.device_index => {}
                other => {
                    return Err(layout(format!(
                        "the {what} is on {other:?}, this rank's NCCL communicator on cuda:{}",
                        self.device_index
                    )));
                }
            }
            if !t.is_contiguous() {
                return Err(layout(format!("the {what} is not contiguous")));
            }
            if t.dtype != src.dtype || t.meta.shape().num_elements() != len {
                return Err(layout(format!(
                    "the output ({:?}, {} values) does not match the bucket ({:?}, {len} values)",
                    t.dtype,
                    t.meta.shape().num_elements(),
                    src.dtype
                )));
            }
        }
        let bytes = (len * element_bytes) as u64;
        let resource = |t: &CubeTensor| {
            t.client
                .get_resource::<CudaServer>(t.handle.clone())
                .map_err(|e| layout(format!("cannot reach the buffer's memory: {e:?}")))
        };
        // Kept alive (the allocation is not reused) until the collective is done.
        let send = resource(&src)?;
        let recv = match &dst {
            Some(dst) => Some(resource(dst)?),
            None => None,
        };
        // (1) Finish the work that writes the bucket (and, for an output, any earlier reader).
        // After `get_resource`: it makes this thread's CubeCL stream wait for the stream that
        // last wrote each buffer, and the sync then covers that wait too.
        cubecl::future::block_on(src.client.sync()).map_err(|e| CommError::Nccl {
            rank: self.rank,
            op: name.into(),
            seq,
            code: "device error".into(),
            detail: format!("the device failed before the all-reduce: {e:?}"),
        })?;
        let send_ptr = send.resource().ptr;
        let recv_ptr = recv.as_ref().map_or(send_ptr, |r| r.resource().ptr);
        for (what, size) in [
            ("bucket", send.resource().size),
            ("output", recv.as_ref().map_or(bytes, |r| r.resource().size)),
        ] {
            if size < bytes {
                return Err(layout(format!(
                    "the {what}'s buffer holds {size} bytes, {len} values need {bytes}"
                )));
            }
        }

        let mut cuda = self.lock();
        self.check_usable(&cuda, collective, seq)?;
        self.enter(&cuda, name, seq)?;
        // (2) NCCL on the group's stream.
        // SAFETY: both pointers are device memory of this context holding `len` elements of
        // `dtype` (checked above), kept alive by `send`/`recv`; CubeCL's work on them is done.
        let code = unsafe {
            (self.api.all_reduce)(
                send_ptr as *const std::ffi::c_void,
                recv_ptr as *mut std::ffi::c_void,
                len,
                dtype,
                api::nccl_op(op),
                cuda.comm,
                cuda.stream as api::RawStream,
            )
        };
        if code != NCCL_SUCCESS && code != NCCL_IN_PROGRESS {
            let err = self.api.error(code, self.rank, name, seq, cuda.comm);
            self.break_comm(&mut cuda, &err.to_string());
            return Err(err);
        }
        // (3) Nothing reads the bucket before the stream is done.
        self.wait(&mut cuda, Step::Collective(collective), seq, timeout)?;
        drop(cuda);
        drop((send, recv));
        Ok(())
    }

    /// Resolves a float tensor primitive of Burn's CubeCL backend (with or without fusion) to
    /// its `CubeTensor`, sharing the same device memory. (Which runtime it is on, CUDA or
    /// another, is its device's to say: [`reduce_cube`](Self::reduce_cube) checks.)
    pub(super) fn cube_tensor(tensor: &dyn Any) -> Option<CubeTensor> {
        if let Some(t) = tensor.downcast_ref::<CubeTensor>() {
            return Some(t.clone());
        }
        let fused = tensor.downcast_ref::<FusionTensor<FusionCubeRuntime>>()?;
        // Resolving a clone leaves the fusion server's handle in place (read-only status), so
        // the fusion tensor keeps pointing at the memory the all-reduce writes.
        Some(
            fused
                .client
                .resolve_tensor_float::<CubeBackend>(fused.clone()),
        )
    }

    /// All-reduce of `src` into `dst` (float tensor primitives of burn-cuda of the same dtype
    /// and length, disjoint; with or without fusion). In place is
    /// [`all_reduce_device`](crate::group::ExtendedCollectives::all_reduce_device); this out-of-place form lets a
    /// check tell a stale read from a fresh one.
    ///
    /// # Errors
    /// As [`all_reduce_device`](crate::group::ExtendedCollectives::all_reduce_device): [`CommError::Nccl`] with code
    /// `"unsupported bucket"` for a dtype other than f32/bf16/f16, a tensor that is not
    /// contiguous, on another GPU than the group's, or of another length or dtype than the other
    /// (these return before any communication and, unlike the reducer, do not abort the peers);
    /// [`CommError::InvalidConfig`] when either tensor is not a burn-cuda tensor.
    pub fn all_reduce_into(
        &self,
        src: &dyn Any,
        dst: &dyn Any,
        op: ReduceOp,
        timeout: Duration,
    ) -> Result<()> {
        match (Self::cube_tensor(src), Self::cube_tensor(dst)) {
            (Some(src), Some(dst)) => self.reduce_cube(src, Some(dst), op, timeout),
            _ => Err(CommError::InvalidConfig(
                "NcclGroup::all_reduce_into takes burn-cuda float tensors".into(),
            )),
        }
    }
}

impl NcclGroup {
    /// All-gather of host values through the scratch buffer, in NCCL's in-place layout: `all`
    /// holds `world_size` blocks of `len` elements of `dtype`, this rank's already at its slot;
    /// afterwards every block holds its rank's. `collective` names it in errors.
    pub(super) fn host_all_gather<E: bytemuck::Pod>(
        &self,
        collective: Collective,
        all: &mut [E],
        len: usize,
        dtype: c_int,
        timeout: Duration,
    ) -> Result<()> {
        let rank = self.rank;
        let block = len * std::mem::size_of::<E>();
        self.host_collective(
            collective,
            bytemuck::cast_slice_mut(all),
            rank * block..(rank + 1) * block,
            timeout,
            |api, scratch, comm, stream| {
                // SAFETY: `scratch` holds `world_size * len` elements with this rank's at its
                // slot (the upload above), on this group's stream.
                unsafe {
                    (api.all_gather)(
                        (scratch + (rank * block) as u64) as *const std::ffi::c_void,
                        scratch as *mut std::ffi::c_void,
                        len,
                        dtype,
                        comm,
                        stream as api::RawStream,
                    )
                }
            },
        )
    }

    /// All-reduce of a host buffer through the scratch buffer; `collective` names it in errors.
    pub(super) fn host_all_reduce(
        &self,
        collective: Collective,
        bucket: &mut [f32],
        op: ReduceOp,
        timeout: Duration,
    ) -> Result<()> {
        let len = bucket.len();
        let bytes = bytemuck::cast_slice_mut::<f32, u8>(bucket);
        let upload = 0..bytes.len();
        self.host_collective(
            collective,
            bytes,
            upload,
            timeout,
            |api, scratch, comm, stream| {
                // SAFETY: `scratch` holds `len` f32 (the copy above), on this group's stream.
                unsafe {
                    (api.all_reduce)(
                        scratch as *const std::ffi::c_void,
                        scratch as *mut std::ffi::c_void,
                        len,
                        api::dtype::FLOAT32,
                        api::nccl_op(op),
                        comm,
                        stream as api::RawStream,
                    )
                }
            },
        )
    }
}

/// What a wait is for, to name it in errors.
#[derive(Clone, Copy)]
pub(super) enum Step {
    Init,
    Collective(Collective),
}

impl Step {
    pub(super) fn name(&self) -> String {
        match self {
            Step::Init => "ncclCommInitRankConfig".into(),
            Step::Collective(op) => op.name().to_string(),
        }
    }
}
