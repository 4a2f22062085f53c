//! What a rank's loader has drawn on its thread, for the gradient synchronisation that follows
//! ([`Drawn`]), the sampler epoch the strategy sets ([`enter_epoch`]), and the handshake through
//! which a loader refuses a job it was not built for ([`check_loader`]).

use std::cell::{Cell, RefCell};
use std::sync::atomic::{AtomicU64, Ordering};

use burn::data::dataloader::DataLoader;

use crate::error::{DdpError, Result};

thread_local! {
    pub(super) static EPOCH: Cell<Option<u64>> = const { Cell::new(None) };
}

/// Until the guard is dropped, every [`DistributedDataLoader::iter`] on this thread uses sampler
/// epoch `epoch` instead of the loader's own counter. [`DdpStrategy`](crate::DdpStrategy) enters
/// burn-train's epoch `k` as sampler epoch `k - 1` on every replica thread, so a resumed run gets
/// the data order the uninterrupted run would have had.
pub(crate) fn enter_epoch(epoch: u64) -> EpochGuard {
    let previous = EPOCH.with(|e| e.replace(Some(epoch)));
    EpochGuard {
        previous,
        _not_send: std::marker::PhantomData,
    }
}

/// Restores the previous epoch override when dropped (on the thread that entered it).
pub(crate) struct EpochGuard {
    previous: Option<u64>,
    _not_send: std::marker::PhantomData<*const ()>,
}

/// The sampler epoch the strategy entered on this thread ([`enter_epoch`]), if any.
pub(crate) fn epoch_on_this_thread() -> Option<u64> {
    EPOCH.with(Cell::get)
}

impl Drop for EpochGuard {
    fn drop(&mut self) {
        let previous = self.previous;
        EPOCH.with(|e| e.set(previous));
    }
}

/// How far the last [`DistributedDataLoader`](super::DistributedDataLoader) iterated on a thread is: the sampler epoch, the
/// steps drawn in it, the samples of the last one on this rank and over all ranks, and the
/// epoch's steps. A custom loop's [`DistributedDataParallel`](crate::DistributedDataParallel)
/// sends it at every gradient synchronisation, so a rank that skipped a synchronisation or draws
/// batches of another size is found at once, and weighs the rank's gradients by its share of the
/// step's samples ([`Drawn::weight`]), as does SyncBatchNorm's backward pass. It lasts as long
/// as the iteration (a validation loader iterated and dropped in between leaves nothing behind).
/// Loaders that present every rank's shard (read whole by one rank) do not count.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Drawn {
    pub epoch: u64,
    /// Steps of the epoch drawn so far (a step without a sample for this rank included).
    pub batches: u64,
    /// This rank's samples in the last step drawn (0: none in that step).
    pub samples: u64,
    /// Samples of the last step drawn over all ranks: one device's batch.
    pub global_samples: u64,
    /// Steps of the epoch, the same on every rank.
    pub steps: u64,
    /// Samples of the epoch's last step over all ranks.
    pub last_step_samples: u64,
    /// Samples of a full step over all ranks (the per-rank batch size times the world size).
    pub full_step_samples: u64,
    /// Ranks of the sampler.
    pub world_size: u64,
    /// The iteration that drew it (cleared when that iteration ends).
    pub iteration: u64,
    /// Ranks without a batch in the epoch's last step (a loader whose batches are dealt to the
    /// ranks: the last step has fewer batches than ranks); 0 for a `DistributedDataLoader`,
    /// whose ranks without a sample are those past `last_step_samples`.
    pub last_step_without_batch: u64,
}

/// Iterations numbered so far (every counted iteration of any loader on any thread).
static ITERATIONS: AtomicU64 = AtomicU64::new(1);

impl Drawn {
    /// The factor of this rank's gradients in an average over the ranks (`ReduceOp::Avg`) that
    /// gives the mean over the step's samples: `samples * world_size / global_samples`, exactly
    /// 1 when every rank has its full share, 0 without a sample.
    pub fn weight(&self) -> f32 {
        let share = self.samples * self.world_size;
        if share == self.global_samples || self.global_samples == 0 {
            1.0
        } else {
            (share as f64 / self.global_samples as f64) as f32
        }
    }

    /// One device's progress through the epoch after the last step drawn: the samples of the
    /// steps drawn so far over all ranks, and of the whole epoch (what burn-train shows of one
    /// device's loader: a rank's share times the world size over-counts a short last step).
    pub fn global_progress(&self) -> (u64, u64) {
        let whole = self.steps.saturating_sub(1) * self.full_step_samples
            + self.last_step_samples * u64::from(self.steps > 0);
        let done = if self.batches >= self.steps {
            whole
        } else {
            self.batches * self.full_step_samples
        };
        (done, whole)
    }

    /// Whether the last step drawn holds fewer samples than a full one (the same on every rank).
    pub fn short_step(&self) -> bool {
        self.global_samples < self.full_step_samples
    }

    /// Whether some step of the epoch leaves a rank without a sample (the last step has fewer
    /// samples than ranks).
    pub fn leaves_a_rank_without_samples(&self) -> bool {
        self.last_step_samples < self.world_size || self.last_step_without_batch > 0
    }

    /// A new iteration's number, never handed out before in this process.
    pub fn next_iteration() -> u64 {
        ITERATIONS.fetch_add(1, Ordering::Relaxed)
    }

    /// Records `drawn` as what this thread's loader drew (`None`: nothing counts any more).
    pub fn set_on_this_thread(drawn: Option<Drawn>) {
        DRAWN.with(|d| d.set(drawn));
    }

    /// This rank takes part in a step without a sample of its own: the step is drawn.
    pub fn enter_step_without_sample() {
        DRAWN.with(|d| {
            if let Some(mut drawn) = d.get() {
                drawn.batches += 1;
                drawn.samples = 0;
                drawn.global_samples = drawn.last_step_samples;
                d.set(Some(drawn));
            }
        });
    }
}

thread_local! {
    pub(super) static DRAWN: Cell<Option<Drawn>> = const { Cell::new(None) };
}

/// What the last counted [`DistributedDataLoader`](super::DistributedDataLoader) iterated on this thread has drawn.
pub(crate) fn drawn_on_this_thread() -> Option<Drawn> {
    DRAWN.with(Cell::get)
}

/// What [`DdpStrategy`](crate::DdpStrategy) hands a loader to: the handshake through which a
/// [`DistributedDataLoader`](super::DistributedDataLoader) (which burn-train sees as any `DataLoader`) refuses a job it was
/// not built for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Purpose {
    /// Training with `world_size` replicas: the loader's sampler must be built for that world
    /// size, for every rank.
    Training { world_size: usize },
    /// Validation, sharded or on rank 0: every item must count once (no padding, no drops).
    Validation,
}

/// What a loader answered [`check_loader`].
#[derive(Debug, Default)]
pub(super) struct Answer {
    /// The first refusal.
    pub refusal: Option<String>,
    /// A [`DistributedDataLoader`](super::DistributedDataLoader)'s sampler and batch size, hashed.
    pub fingerprint: Option<u64>,
}

thread_local! {
    /// The purpose announced by [`check_loader`], and what the loader answered.
    pub(super) static SLICING: RefCell<Option<(Purpose, Answer)>> = const { RefCell::new(None) };
}

/// Announces `purpose` and asks `loader` for its item count, which a
/// [`DistributedDataLoader`](super::DistributedDataLoader) answers by checking that it fits;
/// other loaders only count (nothing else is called on them: a Burn loader's `slice` and
/// `to_device` advance its shuffling generator, which would change the order one device draws).
/// Returns the fingerprint of a `DistributedDataLoader`'s sampler and batch size (0 for any other
/// loader), which the ranks of a multi-process job compare.
///
/// # Errors
/// [`DdpError::InvalidConfig`] with the loader's reason: a training loader built for another
/// world size (naming both) or for one rank only; a validation loader that pads or drops items.
pub(crate) fn check_loader<O>(loader: &dyn DataLoader<O>, purpose: Purpose) -> Result<u64> {
    SLICING.with(|s| *s.borrow_mut() = Some((purpose, Answer::default())));
    let _ = loader.num_items();
    let answer = SLICING
        .with(|s| s.borrow_mut().take())
        .map(|(_, answer)| answer)
        .unwrap_or_default();
    match answer.refusal {
        Some(refusal) => Err(DdpError::InvalidConfig(refusal)),
        None => Ok(answer.fingerprint.unwrap_or(0)),
    }
}
