//! [`MpiGroup`]: ranks that are the processes of an MPI job (`mpirun`, `srun --mpi=pmix`),
//! reduced with the site's MPI library, so a CPU job on a cluster uses its interconnect
//! (InfiniBand, Omni-Path, Slingshot) and needs neither `MASTER_ADDR` nor a TCP store. This is
//! what PyTorch's `mpi` backend and Horovod do. Feature `mpi` (rsmpi 0.8 over the MPI library
//! found when building; Open MPI 4.1 is the one tested).
//!
//! # Collectives
//! Every call is MPI's non-blocking collective on a duplicate of `MPI_COMM_WORLD`
//! (`MPI_Iallreduce`, `MPI_Ibcast`, `MPI_Iallgather`, `MPI_Ibarrier`), completed by polling
//! `MPI_Test`, so a call can give up after its timeout. Before it, one 32-byte `MPI_Iallgather`
//! of every rank's call (sequence number, operation, length, root) lets every rank see a
//! mismatch in the same call and return [`CommError::Mismatch`] instead of handing MPI buffers of
//! different lengths (which MPI may misread, or abort on with its own message). That check costs
//! one small collective per call (a few microseconds over shared memory).
//!
//! # Reduction order
//! MPI's own: the algorithm (ring, recursive doubling, ...) is the library's choice, so with more
//! than 2 ranks a sum may differ from [`TcpGroup`](super::TcpGroup)'s ring order in the last
//! bits. Every rank still receives the same reduced buffer (MPI's all-reduce delivers one result
//! to all), so replicas stay identical. With 2 ranks both orders add the same two numbers and the
//! bits are the same as TcpGroup's and [`ThreadGroup`](super::ThreadGroup)'s. An average is the
//! sum divided by the world size on each rank, as the other CPU groups do. 16-bit all-reduces
//! (gradient compression) are widened to `f32` and rounded to 16 bits at the end (MPI has no 16-bit
//! float type): no wire saving, and with 3 or more ranks the last bit may differ from
//! TcpGroup's, which rounds at every hop.
//! With Open MPI, the group asks for the ring algorithm of `MPI_Iallreduce` (through the MPI tools
//! interface) unless `OMPI_MCA_coll_libnbc_iallreduce_algorithm` is set: left to choose by size,
//! Open MPI 4.1 was 2-3 times slower from 1 MiB on, on one machine.
//!
//! # Failures end the job
//! An MPI collective cannot be cancelled: once a rank has given its buffer to MPI, it cannot
//! return and free it while a peer may still write into it. So when a call times out, or the
//! job is aborted by a rank that failed outside a collective ([`ProcessGroup::abort`]), this
//! rank prints the error to stderr and calls `MPI_Abort`, which ends every process of the job
//! (exit code 1, as [`CommError::exit_code`] gives for a failure); `mpirun`/`srun` then reports
//! the job as aborted. A process that exits without finalising MPI is ended the same way by
//! `mpirun` itself. A mismatch is the one failure every rank sees at once: a call returns it on
//! every rank, and the group refuses later calls with [`CommError::Aborted`] (under `DdpStrategy`,
//! whose ranks abort on any failure, it then ends the job like the others).

use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use mpi::Threading;
use mpi::collective::SystemOperation;
use mpi::environment::Universe;
use mpi::request::Request;
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;

use super::call::{Call, Calls, finish_average};
use super::extension::check_blocks;
use super::{Collective, HalfFloat, Native, ProcessGroup, ReduceOp, backoff, lock, reduce_widened};
use crate::error::{CommError, Result};

/// The exit code of every process of a job ended by [`MpiGroup`] (`MPI_Abort`'s error code):
/// 1, as [`CommError::exit_code`] gives for any failure.
pub const MPI_ABORT_EXIT_CODE: i32 = 1;

/// The largest all-reduce handed to MPI at once: 4 MiB of `f32` (see `all_reduce`).
const SEGMENT_ELEMENTS: usize = 1 << 20;

/// Whether this process was started by an MPI launcher: Open MPI's `mpirun`
/// (`OMPI_COMM_WORLD_SIZE`), a PMIx launcher such as `srun --mpi=pmix` (`PMIX_RANK`), or MPICH's
/// and Intel MPI's Hydra (`PMI_RANK`), and not by `burn-ddp run` or torchrun (`RANK`, which win).
/// burn-ddp's `DdpStrategy::from_env` builds an [`MpiGroup`] then.
pub fn launched_by_mpi() -> bool {
    let has = |name: &str| std::env::var_os(name).is_some();
    !has("RANK") && (has("OMPI_COMM_WORLD_SIZE") || has("PMIX_RANK") || has("PMI_RANK"))
}

/// The world size the launcher announced: Open MPI's `OMPI_COMM_WORLD_SIZE`, Hydra's
/// `PMI_SIZE`, or Slurm's `SLURM_NTASKS` inside a job step.
fn launcher_world_size() -> Option<(&'static str, usize)> {
    let number = |name: &str| std::env::var(name).ok()?.trim().parse::<usize>().ok();
    if let Some(n) = number("OMPI_COMM_WORLD_SIZE") {
        return Some(("OMPI_COMM_WORLD_SIZE", n));
    }
    if let Some(n) = number("PMI_SIZE") {
        return Some(("PMI_SIZE", n));
    }
    if std::env::var_os("SLURM_STEP_ID").is_some() {
        return number("SLURM_NTASKS").map(|n| ("SLURM_NTASKS", n));
    }
    None
}

/// MPI itself: initialised by the first [`MpiGroup::world`] of the process, finalised
/// (`MPI_Finalize`) when the last group is dropped. MPI cannot be initialised twice.
struct Environment {
    /// `None` when the program initialised MPI itself (it finalises it, too).
    universe: Option<Universe>,
    /// Whether MPI gives `MPI_THREAD_MULTIPLE` (else calls must never overlap, `MPI_Abort`
    /// included).
    multiple: bool,
}

/// The environment of the live groups, if any, and whether burn-ddp initialised MPI in this
/// process (then a dead environment means MPI is finalised, or being finalised right now).
static CURRENT: Mutex<(Weak<Environment>, bool)> = Mutex::new((Weak::new(), false));

impl Drop for Environment {
    /// Finalises MPI under [`CURRENT`]'s lock, so a group being made meanwhile sees MPI either
    /// alive or finalised, never half-way.
    fn drop(&mut self) {
        let _current = lock(&CURRENT);
        drop(self.universe.take());
    }
}

fn environment() -> Result<Arc<Environment>> {
    let mut current = lock(&CURRENT);
    if let Some(env) = current.0.upgrade() {
        return Ok(env);
    }
    // `current.1`: the last group's drop may be finalising MPI on another thread right now.
    if current.1 || mpi::environment::is_finalized() {
        return Err(CommError::InvalidConfig(
            "MPI was finalised in this process (its last MpiGroup was dropped) and cannot be \
             initialised again: keep one MpiGroup for the life of the process"
                .into(),
        ));
    }
    let universe = if mpi::environment::is_initialized() {
        // The program initialised MPI: its thread level must let this group's calls come from
        // the training thread (this group serialises its own calls).
        let level = mpi::environment::threading_support();
        if level < Threading::Serialized {
            return Err(CommError::InvalidConfig(format!(
                "MPI was initialised with thread support {level:?}; MpiGroup needs at least \
                 Serialized (MPI_THREAD_SERIALIZED): initialise with \
                 mpi::initialize_with_threading, or let MpiGroup::world initialise MPI"
            )));
        }
        (None, level)
    } else {
        let (universe, level) =
            mpi::initialize_with_threading(Threading::Multiple).ok_or_else(|| {
                CommError::InvalidConfig("MPI could not be initialised (MPI_Init_thread)".into())
            })?;
        if level < Threading::Serialized {
            return Err(CommError::InvalidConfig(format!(
                "this MPI library gives thread support {level:?}; MpiGroup needs at least \
                 Serialized (MPI_THREAD_SERIALIZED): rebuild MPI with thread support"
            )));
        }
        (Some(universe), level)
    };
    let (universe, level) = universe;
    if universe.is_some() {
        let ring = prefer_ring_all_reduce();
        tracing::debug!("burn-ddp: Open MPI's ring all-reduce chosen: {ring}");
    }
    let ours = universe.is_some();
    let env = Arc::new(Environment {
        universe,
        multiple: level == Threading::Multiple,
    });
    *current = (Arc::downgrade(&env), ours);
    Ok(env)
}

/// Open MPI's variable choosing the algorithm of `MPI_Iallreduce` (0 lets it choose by size,
/// 1 is the ring).
const OPEN_MPI_IALLREDUCE_ALGORITHM: &str = "coll_libnbc_iallreduce_algorithm";

/// Asks Open MPI for the ring algorithm in its non-blocking all-reduce, through the MPI tools
/// interface (`MPI_T_cvar_write`), unless the user chose one
/// (`OMPI_MCA_coll_libnbc_iallreduce_algorithm`, or an MCA parameter file: only the default 0,
/// "Open MPI chooses", is replaced). The setting is process-wide: the program's own
/// `MPI_Iallreduce` calls get the ring too. Left to choose, Open MPI 4.1 takes 1.05 ms
/// for 1 MiB and 68 ms for 64 MiB on 2 ranks of one machine; with the ring 0.38 ms and 52 ms
/// (`ddp-bench mpi-sweep`, same machine, side by side). Other MPI libraries have no such
/// variable: nothing changes. Returns whether the ring was set.
fn prefer_ring_all_reduce() -> bool {
    use mpi::ffi;
    use std::os::raw::{c_int, c_void};
    if std::env::var_os(format!("OMPI_MCA_{OPEN_MPI_IALLREDUCE_ALGORITHM}")).is_some() {
        return false;
    }
    let Ok(name) = std::ffi::CString::new(OPEN_MPI_IALLREDUCE_ALGORITHM) else {
        return false;
    };
    // SAFETY: the MPI tools interface may be used at any time after MPI_T_init_thread (here,
    // after MPI_Init); `name` is a valid C string, every out-pointer points at a live local,
    // the handle is freed before MPI_T_finalize, and `ring` (an int, the variable's type)
    // outlives the write, which copies it.
    unsafe {
        let mut provided: c_int = 0;
        if ffi::MPI_T_init_thread(ffi::RSMPI_THREAD_MULTIPLE, &mut provided) != 0 {
            return false;
        }
        let mut written = false;
        let mut index: c_int = 0;
        if ffi::MPI_T_cvar_get_index(name.as_ptr(), &mut index) == 0 {
            let mut handle: ffi::MPI_T_cvar_handle = std::ptr::null_mut();
            let mut count: c_int = 0;
            if ffi::MPI_T_cvar_handle_alloc(index, std::ptr::null_mut(), &mut handle, &mut count)
                == 0
            {
                // Only over "let Open MPI choose" (0): a value from an MCA parameter file (or
                // the program) stays.
                let mut current: c_int = -1;
                let ring: c_int = 1;
                written = count == 1
                    && ffi::MPI_T_cvar_read(handle, (&mut current as *mut c_int).cast::<c_void>())
                        == 0
                    && current == 0
                    && ffi::MPI_T_cvar_write(handle, (&ring as *const c_int).cast::<c_void>()) == 0;
                ffi::MPI_T_cvar_handle_free(&mut handle);
            }
        }
        ffi::MPI_T_finalize();
        written
    }
}

/// The communicator and the buffers of the calls, behind [`MpiGroup`]'s lock.
struct Comm {
    /// A duplicate of `MPI_COMM_WORLD`: this group's traffic never matches the program's own.
    world: SimpleCommunicator,
    /// The all-reduce's send buffer (MPI's all-reduce reads one buffer and writes another).
    send: Vec<f32>,
}

// SAFETY: MPI handles are plain identifiers that any thread may use once MPI is initialised with
// at least MPI_THREAD_SERIALIZED (checked in `environment`); `MpiGroup` only touches a `Comm`
// under its mutex, so no two MPI calls on it run at once.
unsafe impl Send for Comm {}

/// One rank of a process group whose ranks are the processes of an MPI job.
///
/// ```no_run
/// use std::time::Duration;
/// use burn_ddp_comm::group::{MpiGroup, ProcessGroup, ReduceOp};
/// // `mpirun -np 4 ./train`: rank, world size and local rank come from MPI.
/// let group = MpiGroup::world()?;
/// let mut values = vec![group.rank() as f32; 4];
/// group.all_reduce(&mut values, ReduceOp::Avg, Duration::from_secs(60))?;
/// # Ok::<(), burn_ddp_comm::CommError>(())
/// ```
///
/// burn-ddp's `DdpStrategy::from_env` builds one by itself under an MPI launcher (see
/// [`launched_by_mpi`]); `DdpStrategy::with_process_group` takes one you built.
pub struct MpiGroup {
    rank: usize,
    world_size: usize,
    local_rank: usize,
    local_world_size: usize,
    /// The sequence numbers and the abort's reason.
    calls: Calls,
    comm: Mutex<Comm>,
    /// Declared last: dropped (finalising MPI if this was the last group) after `comm` is freed.
    environment: Arc<Environment>,
}

impl MpiGroup {
    /// Joins `MPI_COMM_WORLD`: rank and world size are MPI's, the local rank is the rank in
    /// `MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)` (the processes of this machine). Initialises
    /// MPI (`MPI_THREAD_MULTIPLE` asked, `MPI_THREAD_SERIALIZED` at least) unless the program
    /// did; the last group dropped finalises it. Every rank calls it at the same time (it is
    /// collective: it duplicates the world communicator).
    ///
    /// Run the program under an MPI launcher (`mpirun -np 4 ./train`, `srun --mpi=pmix ./train`);
    /// started alone it is a world of one. MPI's start-up has no timeout of burn-ddp's: a rank
    /// that never starts is the launcher's to report.
    ///
    /// Dropping the last group finalises MPI (`MPI_Finalize`), which waits for every rank: a rank
    /// that gives up before its peers do (an error of its own between this call and the end of
    /// training) must call [`ProcessGroup::abort`] first, or its peers wait for their next
    /// collective's timeout while it waits in `MPI_Finalize`. `DdpStrategy` does this for the
    /// errors it sees. Calls may come from any thread, one at a time (the group serialises
    /// them); if the program also calls MPI from other threads, it needs the
    /// `MPI_THREAD_MULTIPLE` this group asks for (Open MPI gives it). A program that initialised
    /// MPI itself must keep its `Universe` alive longer than its groups.
    ///
    /// # Errors
    /// [`CommError::InvalidConfig`] when MPI cannot be initialised, gives less than
    /// `MPI_THREAD_SERIALIZED`, was already finalised in this process, or makes this process a
    /// world of one while the launcher announced more (`OMPI_COMM_WORLD_SIZE`, `PMI_SIZE`, or
    /// `SLURM_NTASKS` in a job step: MPI did not reach the launcher, e.g. `srun` without
    /// `--mpi=pmix`).
    pub fn world() -> Result<MpiGroup> {
        // Read before MPI_Init, which may change the environment.
        let announced = launcher_world_size();
        let environment = environment()?;
        let world = SimpleCommunicator::world().duplicate();
        let local = world.split_shared(world.rank());
        let world_size = world.size() as usize;
        // A launcher whose MPI this library cannot reach (srun without the right `--mpi`
        // plugin, another MPI's mpirun) leaves every process a world of one, which would train
        // alone without a word.
        if let Some((var, expected)) = announced
            && world_size == 1
            && expected > 1
        {
            return Err(CommError::InvalidConfig(format!(
                "MPI gives this process a world of {world_size} but {var}={expected}: the MPI \
                 library did not reach the launcher that started the job (under srun pass \
                 --mpi=pmix, or the plugin this MPI was built with; use the mpirun of the MPI \
                 this program was built against)"
            )));
        }
        let group = MpiGroup {
            rank: world.rank() as usize,
            world_size,
            local_rank: local.rank() as usize,
            local_world_size: local.size() as usize,
            calls: Calls::default(),
            comm: Mutex::new(Comm {
                world,
                send: Vec::new(),
            }),
            environment,
        };
        Ok(group)
    }

    /// Rank among the processes of this machine (selects the GPU), from
    /// `MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)`.
    pub fn local_rank(&self) -> usize {
        self.local_rank
    }

    /// Number of processes of this job on this machine.
    pub fn local_world_size(&self) -> usize {
        self.local_world_size
    }

    /// Starts a call: its sequence number, refused after an abort.
    fn begin(&self, op: Collective, timeout: Duration) -> Result<Call> {
        self.calls.begin(self.rank, op, timeout)
    }

    /// Waits for `request` until the call's deadline, polling `MPI_Test`; past it, ends the job.
    fn complete<'a, D: ?Sized, S: mpi::request::Scope<'a>>(
        &self,
        call: &Call,
        mut request: Request<'a, D, S>,
    ) {
        let mut polls = 0u32;
        loop {
            match request.test() {
                Ok(_) => return,
                Err(pending) => request = pending,
            }
            if call.expired() {
                self.end_job(&call.timed_out(Vec::new(), Vec::new()).to_string());
            }
            backoff(&mut polls);
        }
    }

    /// Prints `why` and ends every process of the job (`MPI_Abort` on `MPI_COMM_WORLD`, without
    /// this group's lock, so another thread's pending call does not delay it): a pending MPI
    /// collective cannot be cancelled, so no rank may return while a peer could still write
    /// into its buffers.
    fn end_job(&self, why: &str) -> ! {
        crate::log::to_stderr(&format!(
            "burn-ddp: {why}\nburn-ddp: rank {}: ending the MPI job (MPI_Abort, exit code \
             {MPI_ABORT_EXIT_CODE}): an MPI collective cannot be cancelled\n",
            self.rank
        ));
        tracing::error!(target: "burn_ddp_comm::log", "rank {}: {why}; MPI_Abort", self.rank);
        SimpleCommunicator::world().abort(MPI_ABORT_EXIT_CODE)
    }

    /// The call check, then the element-wise sum over ranks of `bucket`, in place, in segments
    /// of at most 4 MiB, so the send copy (MPI's all-reduce reads one buffer and writes another)
    /// is one segment, in cache, not a second copy of the bucket; measured as fast as one call
    /// from 1 to 256 MiB (2 ranks, one machine).
    fn sum(&self, call: &Call, bucket: &mut [f32]) -> Result<()> {
        let mut guard = lock(&self.comm);
        self.check(&guard, call)?;
        for segment in bucket.chunks_mut(SEGMENT_ELEMENTS) {
            guard.send.clear();
            guard.send.extend_from_slice(segment);
            let comm = &*guard;
            mpi::request::scope(|scope| {
                let request = comm.world.immediate_all_reduce_into(
                    scope,
                    &comm.send[..],
                    segment,
                    SystemOperation::sum(),
                );
                self.complete(call, request);
            });
        }
        Ok(())
    }

    /// Every rank's call, compared: a rank whose call differs from this rank's is a
    /// [`CommError::Mismatch`] on every rank, in this same call.
    fn check(&self, comm: &Comm, call: &Call) -> Result<()> {
        // The frame header's encoding of TcpGroup (`Collective::encode`), with the sequence.
        let (kind, len, arg) = call.op.encode();
        let mine = [call.seq, u64::from(kind), len, arg];
        let mut all = vec![0u64; 4 * self.world_size];
        mpi::request::scope(|scope| {
            let request = comm
                .world
                .immediate_all_gather_into(scope, &mine[..], &mut all[..]);
            self.complete(call, request);
        });
        for (peer, theirs) in all.chunks_exact(4).enumerate() {
            if theirs != mine {
                let err = CommError::Mismatch {
                    rank: self.rank,
                    op: call.op,
                    seq: call.seq,
                    peer,
                    // Every rank encodes with the same code, so a peer's words always decode.
                    peer_op: Collective::decode(theirs[1] as u8, theirs[2], theirs[3])
                        .unwrap_or(Collective::Barrier),
                    peer_seq: theirs[0],
                };
                self.calls.abort(&err.to_string());
                return Err(err);
            }
        }
        Ok(())
    }
}

impl ProcessGroup for MpiGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn backend(&self) -> &'static str {
        "mpi"
    }

    fn all_reduce(&self, bucket: &mut [f32], op: ReduceOp, timeout: Duration) -> Result<()> {
        let call = self.begin(
            Collective::AllReduce {
                op,
                len: bucket.len(),
            },
            timeout,
        )?;
        if self.world_size == 1 {
            return Ok(());
        }
        self.sum(&call, bucket)?;
        finish_average(bucket, op, self.world_size);
        Ok(())
    }

    fn broadcast(&self, buffer: &mut [f32], root: usize, timeout: Duration) -> Result<()> {
        let call = self.begin(
            Collective::Broadcast {
                root,
                len: buffer.len(),
            },
            timeout,
        )?;
        let invalid = || {
            CommError::InvalidConfig(format!(
                "broadcast #{} on rank {}: root {root} is not below the world size {}",
                call.seq, self.rank, self.world_size
            ))
        };
        if self.world_size == 1 {
            return if root == 0 { Ok(()) } else { Err(invalid()) };
        }
        let comm = lock(&self.comm);
        // The check first: a root that differs between ranks is a mismatch on every rank; one
        // that every rank gives and is out of range is refused by every rank.
        self.check(&comm, &call)?;
        if root >= self.world_size {
            return Err(invalid());
        }
        // In segments: MPI counts elements in an `int`, and a model's broadcast can be larger.
        for segment in buffer.chunks_mut(SEGMENT_ELEMENTS) {
            mpi::request::scope(|scope| {
                let request = comm
                    .world
                    .process_at_rank(root as i32)
                    .immediate_broadcast_into(scope, segment);
                self.complete(&call, request);
            });
        }
        Ok(())
    }

    fn barrier(&self, timeout: Duration) -> Result<()> {
        let call = self.begin(Collective::Barrier, timeout)?;
        if self.world_size == 1 {
            return Ok(());
        }
        let comm = lock(&self.comm);
        self.check(&comm, &call)?;
        let request = comm.world.immediate_barrier();
        self.complete(&call, request);
        Ok(())
    }

    fn all_gather(&self, values: &[u64], timeout: Duration) -> Result<Vec<u64>> {
        let call = self.begin(Collective::AllGather { len: values.len() }, timeout)?;
        if self.world_size == 1 {
            return Ok(values.to_vec());
        }
        let comm = lock(&self.comm);
        self.check(&comm, &call)?;
        let mut all = vec![0u64; values.len() * self.world_size];
        if !values.is_empty() {
            mpi::request::scope(|scope| {
                let request = comm
                    .world
                    .immediate_all_gather_into(scope, values, &mut all[..]);
                self.complete(&call, request);
            });
        }
        Ok(all)
    }

    /// Prints `reason` and ends the job (`MPI_Abort`) when there are peers: they may be waiting
    /// in a collective that cannot be cancelled. A group of one only records it.
    fn abort(&self, reason: &str) {
        let reason = format!("rank {} aborted the group: {reason}", self.rank);
        self.calls.abort(&reason);
        if self.world_size > 1 {
            // Below MPI_THREAD_MULTIPLE no two MPI calls may overlap: wait for a pending call
            // (it ends by its deadline, with MPI_Abort of its own if it times out).
            let _serialised = (!self.environment.multiple).then(|| lock(&self.comm));
            self.end_job(&reason);
        }
    }

    fn aborted(&self) -> Option<String> {
        self.calls.aborted()
    }

    fn native(&self) -> Option<&dyn Native> {
        Some(self)
    }
}

impl crate::group::Sealed for MpiGroup {}

impl Native for MpiGroup {
    /// Widened to `f32`, summed by MPI, then rounded to `format` at the end (MPI has no 16-bit float
    /// type). [`TcpGroup`](super::TcpGroup) rounds at every hop of its ring instead, so with 3 or
    /// more ranks the two can differ in the last bit; every rank still gets the same bits.
    fn all_reduce_half(
        &self,
        bucket: &mut [u16],
        format: HalfFloat,
        op: ReduceOp,
        timeout: Duration,
    ) -> Result<()> {
        let call = self.begin(
            Collective::AllReduceHalf {
                op,
                len: bucket.len(),
                format,
            },
            timeout,
        )?;
        if self.world_size == 1 {
            return Ok(());
        }
        reduce_widened(bucket, format, |wide| {
            self.sum(&call, wide)?;
            finish_average(wide, op, self.world_size);
            Ok(())
        })
    }

    /// `MPI_Iallgather` of the `f32` values (a copy: every bit kept).
    fn all_gather_f32(&self, send: &[f32], recv: &mut [f32], timeout: Duration) -> Result<()> {
        let len = send.len();
        check_blocks(self, "all_gather_f32", len, recv.len())?;
        let call = self.begin(Collective::AllGatherF32 { len }, timeout)?;
        if self.world_size == 1 {
            recv.copy_from_slice(send);
            return Ok(());
        }
        let comm = lock(&self.comm);
        self.check(&comm, &call)?;
        mpi::request::scope(|scope| {
            let request = comm.world.immediate_all_gather_into(scope, send, recv);
            self.complete(&call, request);
        });
        Ok(())
    }

    /// `MPI_Ireduce_scatter_block` with `MPI_SUM` (MPI's summation order), then the division of
    /// an average.
    fn reduce_scatter(
        &self,
        send: &[f32],
        recv: &mut [f32],
        op: ReduceOp,
        timeout: Duration,
    ) -> Result<()> {
        let len = recv.len();
        check_blocks(self, "reduce_scatter", len, send.len())?;
        let call = self.begin(Collective::ReduceScatter { op, len }, timeout)?;
        if self.world_size == 1 {
            recv.copy_from_slice(send);
            return Ok(());
        }
        let comm = lock(&self.comm);
        self.check(&comm, &call)?;
        mpi::request::scope(|scope| {
            let request = comm.world.immediate_reduce_scatter_block_into(
                scope,
                send,
                recv,
                SystemOperation::sum(),
            );
            self.complete(&call, request);
        });
        finish_average(recv, op, self.world_size);
        Ok(())
    }
}

impl std::fmt::Debug for MpiGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiGroup")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("local_rank", &self.local_rank)
            .field("next_seq", &self.calls.peek())
            .finish()
    }
}
