//! Where user code runs: [`rank`], [`world_size`] and [`is_main_process`], reachable from a train
//! step, a metric, a callback or `main`, like `torch.distributed.get_rank()`.
//!
//! The answer comes from, in order:
//! 1. the rank thread the caller is on: [`DdpStrategy`](crate::DdpStrategy) and the rank threads
//!    of a thread-mode run set it for their thread (so a train step on rank 1's thread sees 1);
//!    in a loop of your own, the thread that built a
//!    [`DistributedDataParallel`](crate::DistributedDataParallel), for as long as it lives;
//! 2. the process: a multi-process run (its process group), or a thread-mode run, which counts as
//!    the main process (rank 0) outside its rank threads, since rank 0 drives burn-train's events;
//! 3. the launcher's environment (`RANK`/`WORLD_SIZE`, Slurm's or Open MPI's variables, as
//!    [`Topology::from_env`](crate::comm::topology::Topology::from_env) reads them), so `main` can ask
//!    before training starts;
//! 4. otherwise rank 0 of 1.

use std::cell::Cell;
use std::sync::Mutex;

thread_local! {
    static THREAD: Cell<Option<(usize, usize)>> = const { Cell::new(None) };
}

static PROCESS: Mutex<Option<(usize, usize)>> = Mutex::new(None);

/// Threads that built a `DistributedDataParallel` still alive: (thread, hold, rank, world size).
static HELD: Mutex<Vec<(std::thread::ThreadId, u64, usize, usize)>> = Mutex::new(Vec::new());

/// Numbers the holds.
static HOLDS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// This caller's global rank (`0..world_size()`): see the module documentation for where it comes
/// from. 0 when nothing is distributed.
pub fn rank() -> usize {
    current().0
}

/// The number of replicas in the job (every process and thread), 1 when nothing is distributed.
pub fn world_size() -> usize {
    current().1
}

/// Whether this caller is global rank 0, the one that should print, log metrics and write files
/// (PyTorch users write `if dist.get_rank() == 0`).
pub fn is_main_process() -> bool {
    rank() == 0
}

fn current() -> (usize, usize) {
    if let Some(found) = THREAD.with(Cell::get) {
        return found;
    }
    let me = std::thread::current().id();
    if let Some(&(_, _, rank, world_size)) = HELD
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .rev()
        .find(|(thread, ..)| *thread == me)
    {
        return (rank, world_size);
    }
    if let Some(found) = *PROCESS.lock().unwrap_or_else(|e| e.into_inner()) {
        return found;
    }
    match burn_ddp_comm::topology::Topology::from_env() {
        Ok(Some(topology)) => (topology.rank, topology.world_size),
        _ => (0, 1),
    }
}

/// Makes [`rank`] and [`world_size`] answer `rank` and `world_size` on this thread until the guard
/// is dropped.
pub(crate) fn enter_rank(rank: usize, world_size: usize) -> RankGuard {
    let previous = THREAD.with(|t| t.replace(Some((rank, world_size))));
    RankGuard {
        previous,
        _not_send: std::marker::PhantomData,
    }
}

/// Restores the previous thread rank when dropped.
pub(crate) struct RankGuard {
    previous: Option<(usize, usize)>,
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Drop for RankGuard {
    fn drop(&mut self) {
        let previous = self.previous;
        THREAD.with(|t| t.set(previous));
    }
}

/// Makes [`rank`] and [`world_size`] answer `rank` and `world_size` on the calling thread for as
/// long as the returned hold lives, wherever it is dropped (it may move to another thread with
/// the `DistributedDataParallel` that keeps it). The rank thread of a strategy run wins.
pub(crate) fn hold_rank(rank: usize, world_size: usize) -> RankHold {
    let token = HOLDS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    HELD.lock().unwrap_or_else(|e| e.into_inner()).push((
        std::thread::current().id(),
        token,
        rank,
        world_size,
    ));
    RankHold { token }
}

/// Ends a [`hold_rank`] when dropped.
#[derive(Debug)]
pub(crate) struct RankHold {
    token: u64,
}

impl Drop for RankHold {
    fn drop(&mut self) {
        HELD.lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|(_, token, ..)| *token != self.token);
    }
}

/// Records the process's place in the job (kept after the run: `main` may still ask).
pub(crate) fn set_process(rank: usize, world_size: usize) {
    *PROCESS.lock().unwrap_or_else(|e| e.into_inner()) = Some((rank, world_size));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rank_thread_wins_and_is_restored() {
        let before = (rank(), world_size());
        {
            let _outer = enter_rank(2, 4);
            assert_eq!((rank(), world_size(), is_main_process()), (2, 4, false));
            {
                let _inner = enter_rank(0, 4);
                assert!(is_main_process());
            }
            assert_eq!(rank(), 2);
            // Another thread does not see this thread's rank.
            let other = std::thread::spawn(|| THREAD.with(Cell::get))
                .join()
                .unwrap();
            assert_eq!(other, None);
        }
        assert_eq!((rank(), world_size()), before);
    }
}
