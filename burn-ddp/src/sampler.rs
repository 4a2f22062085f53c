//! The distributed sampler and its data loader: which samples each rank trains on, epoch by epoch.

use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::{DataLoader, DataLoaderIterator, Progress};
use burn::data::dataset::Dataset;
use burn::tensor::backend::Backend;
use rand::SeedableRng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;

use std::cell::{Cell, RefCell};
use std::panic::AssertUnwindSafe;
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};

use crate::partition::chunk_range;

thread_local! {
    static EPOCH: Cell<Option<u64>> = const { Cell::new(None) };
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

impl Drop for EpochGuard {
    fn drop(&mut self) {
        let previous = self.previous;
        EPOCH.with(|e| e.set(previous));
    }
}

/// How far the last [`DistributedDataLoader`] iterated on a thread is: the sampler epoch, the
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
}

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

    /// Whether the last step drawn holds fewer samples than a full one (the same on every rank).
    pub fn short_step(&self) -> bool {
        self.global_samples < self.full_step_samples
    }

    /// Whether some step of the epoch leaves a rank without a sample (the last step has fewer
    /// samples than ranks).
    pub fn leaves_a_rank_without_samples(&self) -> bool {
        self.last_step_samples < self.world_size
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
    static DRAWN: Cell<Option<Drawn>> = const { Cell::new(None) };
}

/// What the last counted [`DistributedDataLoader`] iterated on this thread has drawn.
pub(crate) fn drawn_on_this_thread() -> Option<Drawn> {
    DRAWN.with(Cell::get)
}

/// What [`DdpStrategy`](crate::DdpStrategy) hands a loader to: the handshake through which a
/// [`DistributedDataLoader`] (which burn-train sees as any `DataLoader`) refuses a job it was
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
struct Answer {
    /// The first refusal.
    refusal: Option<String>,
    /// A [`DistributedDataLoader`]'s sampler and batch size, hashed.
    fingerprint: Option<u64>,
}

thread_local! {
    /// The purpose announced by [`check_loader`], and what the loader answered.
    static SLICING: RefCell<Option<(Purpose, Answer)>> = const { RefCell::new(None) };
}

/// Announces `purpose` and slices `loader` whole (`slice(0, num_items)`, which a
/// [`DistributedDataLoader`] answers by checking that it fits; other loaders ignore it).
/// Returns the fingerprint of a `DistributedDataLoader`'s sampler and batch size (0 for any other
/// loader), which the ranks of a multi-process job compare.
///
/// # Errors
/// [`DdpError::InvalidConfig`] with the loader's reason: a training loader built for another
/// world size (naming both) or for one rank only; a validation loader that pads or drops items.
pub(crate) fn check_loader<B: Backend, O>(
    loader: &dyn DataLoader<B, O>,
    purpose: Purpose,
) -> Result<u64> {
    SLICING.with(|s| *s.borrow_mut() = Some((purpose, Answer::default())));
    let _ = loader.slice(0, loader.num_items());
    let answer = SLICING
        .with(|s| s.borrow_mut().take())
        .map(|(_, answer)| answer)
        .unwrap_or_default();
    match answer.refusal {
        Some(refusal) => Err(DdpError::InvalidConfig(refusal)),
        None => Ok(answer.fingerprint.unwrap_or(0)),
    }
}
use crate::error::{DdpError, Result};

/// The distributed sampler: which samples each rank trains on, epoch by epoch.
///
/// [`DistributedSampler`] has the semantics of PyTorch's `torch.utils.data.DistributedSampler`:
/// - each epoch, the dataset's indices are shuffled with a generator seeded by `seed + epoch`, so
///   every epoch has a new order without the user calling anything, and every rank computes the
///   same permutation;
/// - rank `r` takes positions `r, r + N, r + 2N, ...` of the permutation: the shards are disjoint
///   and together cover the dataset.
///
/// With the strided shards, batch `k` of every rank together is exactly batch `k` of a single
/// device that iterates the same permutation with an `N` times larger batch: data-parallel
/// training sees the same samples per step as single-device training, **the last step
/// included**. By default nothing is padded or dropped: when the dataset does not divide into
/// global batches, the last step holds one device's last batch, split across the ranks as evenly
/// as it goes (a rank may have one sample fewer, or none when the step has fewer samples than
/// ranks), and [`DdpStrategy`](crate::DdpStrategy) and
/// [`DistributedDataParallel`](crate::DistributedDataParallel) weigh each rank's gradients by its
/// samples, so the step's gradient is the mean over its samples, as on one device (for a loss
/// that is a mean over the batch, as burn-train's outputs are). Where PyTorch's sampler differs:
/// it pads by repeating samples by default, which here is the explicit
/// [`with_duplicate_padding`](Self::with_duplicate_padding).
///
/// [`DistributedDataLoader`] is a Burn [`DataLoader`] over a sampler. It presents the rank shards
/// one after another (rank 0's samples, then rank 1's, ...), so that
/// [`DataLoader::slice`] at multiples of the shard size, which is how
/// [`DdpStrategy`](crate::DdpStrategy) splits a loader between ranks, hands each rank its shard.
///
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DistributedSampler {
    len: usize,
    world_size: usize,
    shuffle: bool,
    seed: u64,
    tail: Tail,
    /// The one rank whose shard a loader presents (custom loops); `None`: every rank's.
    rank: Option<usize>,
}

/// What happens to a dataset that does not divide evenly between ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tail {
    /// Pad by repeating the first samples (PyTorch's default; not one device's result).
    Wrap,
    /// Drop the last samples (PyTorch's `drop_last`).
    Drop,
    /// Neither: shards of unequal sizes, differing by at most one sample (the default).
    Exact,
}

impl DistributedSampler {
    /// A sampler over `len` samples for `world_size` ranks, shuffling with seed 0 (PyTorch's
    /// default), every sample once per epoch (no padding, nothing dropped).
    ///
    /// # Errors
    /// [`DdpError::InvalidConfig`] when `world_size` is 0 or the dataset is empty.
    pub fn new(len: usize, world_size: usize) -> Result<Self> {
        if world_size == 0 {
            return Err(DdpError::InvalidConfig(
                "DistributedSampler needs a world size of at least 1, got 0".into(),
            ));
        }
        if len == 0 {
            return Err(DdpError::InvalidConfig(
                "DistributedSampler needs a non-empty dataset, got 0 samples".into(),
            ));
        }
        Ok(Self {
            len,
            world_size,
            shuffle: true,
            seed: 0,
            tail: Tail::Exact,
            rank: None,
        })
    }

    /// Makes a [`DistributedDataLoader`] over this sampler present `rank`'s shard only, as
    /// PyTorch's `DistributedSampler(num_replicas, rank)` does: what a training loop of your own
    /// iterates on each rank (`burn_ddp::rank()` or `ddp.rank()` gives it). Not for
    /// [`DdpStrategy`](crate::DdpStrategy), which slices the loader of every rank's shards
    /// itself (it refuses one built for a single rank).
    ///
    /// # Errors
    /// [`DdpError::InvalidConfig`] when `rank` is not below the world size.
    pub fn with_rank(mut self, rank: usize) -> Result<Self> {
        if rank >= self.world_size {
            return Err(DdpError::InvalidConfig(format!(
                "DistributedSampler::with_rank({rank}) with world size {}: ranks are 0..{}",
                self.world_size, self.world_size
            )));
        }
        self.rank = Some(rank);
        Ok(self)
    }

    /// The rank whose shard a loader over this sampler presents, if only one
    /// ([`with_rank`](Self::with_rank)).
    pub fn rank(&self) -> Option<usize> {
        self.rank
    }

    /// Shuffles each epoch with a generator seeded by `seed + epoch` (the default, with seed 0);
    /// turns shuffling on if [`without_shuffle`](Self::without_shuffle) turned it off.
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self.shuffle = true;
        self
    }

    /// Keeps the dataset order (no shuffling).
    pub fn without_shuffle(mut self) -> Self {
        self.shuffle = false;
        self
    }

    /// `true`: drops the tail of the permutation so it divides evenly between ranks (PyTorch's
    /// `drop_last`: up to `world_size - 1` samples are not trained in an epoch); `false`: every
    /// sample once (the default).
    ///
    /// # Errors
    /// [`DdpError::InvalidConfig`] when `drop_last` would leave the ranks without samples
    /// (fewer samples than ranks).
    pub fn with_drop_last(mut self, drop_last: bool) -> Result<Self> {
        if drop_last && self.len < self.world_size {
            return Err(DdpError::InvalidConfig(format!(
                "drop_last with {} samples and world size {} leaves every rank without samples",
                self.len, self.world_size
            )));
        }
        self.tail = if drop_last { Tail::Drop } else { Tail::Exact };
        Ok(self)
    }

    /// Pads the permutation to a multiple of the world size by repeating its first samples, so
    /// every rank has as many samples: PyTorch's `DistributedSampler` default. **Not one
    /// device's result**: up to `world_size - 1` samples train twice per epoch, weighed as new
    /// ones, and the training metrics count them. For comparing with a PyTorch run; the default
    /// trains every sample once and gives one device's result.
    pub fn with_duplicate_padding(mut self) -> Self {
        self.tail = Tail::Wrap;
        self
    }

    /// Neither pads nor drops: the shards cover the dataset exactly once and their sizes differ
    /// by at most one sample (ranks below `len % world_size` get one more). The default (this
    /// undoes [`with_drop_last`](Self::with_drop_last) and
    /// [`with_duplicate_padding`](Self::with_duplicate_padding)); what a validation loader
    /// needs.
    pub fn with_uneven_shards(mut self) -> Self {
        self.tail = Tail::Exact;
        self
    }

    /// Number of samples in the dataset.
    pub fn dataset_len(&self) -> usize {
        self.len
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Samples of the largest shard per epoch: `ceil(len / N)`, or `floor(len / N)` with
    /// `drop_last`.
    pub fn num_samples(&self) -> usize {
        match self.tail {
            Tail::Drop => self.len / self.world_size,
            Tail::Wrap | Tail::Exact => self.len.div_ceil(self.world_size),
        }
    }

    /// Samples per epoch over all ranks: the dataset's length, `num_samples * N` with padding,
    /// or less with `drop_last`.
    pub fn total_size(&self) -> usize {
        match self.tail {
            Tail::Exact => self.len,
            Tail::Wrap | Tail::Drop => self.num_samples() * self.world_size,
        }
    }

    /// Steps of an epoch with `batch_size` samples per rank (the same on every rank), and the
    /// samples of step `k` over all ranks: one device's batches of `batch_size * N`.
    fn global_step_samples(&self, batch_size: usize, k: usize) -> usize {
        let global = batch_size * self.world_size;
        self.total_size().saturating_sub(k * global).min(global)
    }

    /// Samples of `rank`'s shard per epoch.
    pub fn shard_len(&self, rank: usize) -> usize {
        chunk_range(self.total_size(), self.world_size, rank).len()
    }

    /// The epoch's permutation of dataset indices, padded or cut to [`total_size`](Self::total_size).
    pub fn epoch_order(&self, epoch: u64) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.len).collect();
        if self.shuffle {
            let mut rng = StdRng::seed_from_u64(self.seed.wrapping_add(epoch));
            order.shuffle(&mut rng);
        }
        let total = self.total_size();
        if total <= order.len() {
            order.truncate(total);
        } else {
            let mut i = 0;
            while order.len() < total {
                order.push(order[i]);
                i += 1;
            }
        }
        order
    }

    /// The dataset indices of `rank`'s shard in `epoch`, in the order the rank visits them:
    /// positions `rank, rank + N, ...` of [`epoch_order`](Self::epoch_order).
    ///
    /// # Panics
    /// Never; a `rank` outside `0..world_size` yields an empty shard.
    pub fn indices(&self, epoch: u64, rank: usize) -> Vec<usize> {
        if rank >= self.world_size {
            return Vec::new();
        }
        self.epoch_order(epoch)
            .into_iter()
            .skip(rank)
            .step_by(self.world_size)
            .collect()
    }

    /// The rank whose shard holds position `position` of the shard-major sequence.
    fn rank_of_position(&self, position: usize) -> usize {
        let total = self.total_size();
        (0..self.world_size)
            .find(|&r| chunk_range(total, self.world_size, r).contains(&position))
            .unwrap_or(0)
    }

    /// Dataset indices at `positions` of the epoch's shard-major sequence (rank 0's shard, then
    /// rank 1's, ...), the order [`DistributedDataLoader`] presents. Rank `r`'s shard occupies
    /// positions `chunk_range(total_size, N, r)`.
    fn shard_major(&self, epoch: u64, positions: Range<usize>) -> Vec<usize> {
        let order = self.epoch_order(epoch);
        let total = self.total_size();
        let starts: Vec<usize> = (0..self.world_size)
            .map(|r| chunk_range(total, self.world_size, r).start)
            .collect();
        positions
            .map(|p| {
                let rank = starts.partition_point(|&start| start <= p) - 1;
                order[(p - starts[rank]) * self.world_size + rank]
            })
            .collect()
    }
}

/// A Burn [`DataLoader`] that batches the samples a [`DistributedSampler`] gives.
///
/// Build one for the whole training set with the world size you will train with and hand it to
/// `SupervisedTraining` as usual; [`DdpStrategy`](crate::DdpStrategy) slices it into the rank
/// shards (and refuses, naming both numbers, a loader built for another world size).
/// `batch_size` is the **per-rank** batch (PyTorch's convention): the global batch is
/// `batch_size * world_size`. For validation give `SupervisedTraining` a plain Burn `DataLoader`
/// (burn-ddp shards it without padding); a padded `DistributedDataLoader` there is refused,
/// since it would count items twice.
///
/// Each call to [`iter`](DataLoader::iter) starts the next epoch (0, 1, 2, ... unless
/// [`with_epoch`](Self::with_epoch) sets the first), so every epoch gets a new order. Under
/// [`DdpStrategy`](crate::DdpStrategy) the epoch follows burn-train's (burn-train's epoch `k` is
/// sampler epoch `k - 1`, set by the strategy on every replica's thread), also when resuming from
/// a checkpoint.
///
/// With [`with_num_workers`](Self::with_num_workers) (PyTorch's `num_workers`), background
/// threads build the next batches while the replica trains on the current one.
pub struct DistributedDataLoader<B: Backend, I, O> {
    dataset: Arc<dyn Dataset<I>>,
    batcher: Arc<dyn Batcher<B, I, O>>,
    sampler: DistributedSampler,
    batch_size: usize,
    device: B::Device,
    positions: Range<usize>,
    next_epoch: Arc<AtomicU64>,
    num_workers: usize,
    prefetch_factor: usize,
    /// Whether the warning about a loader read whole by one rank of several was given.
    warned_whole: Arc<std::sync::atomic::AtomicBool>,
}

/// Batches each prefetch worker builds ahead of the training step: PyTorch's `prefetch_factor`
/// default.
pub const DEFAULT_PREFETCH_FACTOR: usize = 2;

impl<B, I, O> DistributedDataLoader<B, I, O>
where
    B: Backend,
    I: Send + Sync + Clone + 'static,
    O: Send + 'static,
{
    /// A loader over all ranks' shards of `dataset` (length `sampler.total_size()`), batching
    /// `batch_size` samples per rank on `device`, on the training thread (no workers).
    ///
    /// # Errors
    /// [`DdpError::InvalidConfig`] when `batch_size` is 0 or the sampler was built for a dataset
    /// of another length.
    pub fn new(
        dataset: Arc<dyn Dataset<I>>,
        batcher: impl Batcher<B, I, O> + 'static,
        sampler: DistributedSampler,
        batch_size: usize,
        device: B::Device,
    ) -> Result<Self> {
        if batch_size == 0 {
            return Err(DdpError::InvalidConfig(
                "batch size must be positive, got 0".into(),
            ));
        }
        if sampler.dataset_len() != dataset.len() {
            return Err(DdpError::InvalidConfig(format!(
                "the sampler was built for {} samples but the dataset has {}",
                sampler.dataset_len(),
                dataset.len()
            )));
        }
        Ok(Self {
            dataset,
            batcher: Arc::new(batcher),
            positions: match sampler.rank() {
                Some(rank) => chunk_range(sampler.total_size(), sampler.world_size(), rank),
                None => 0..sampler.total_size(),
            },
            sampler,
            batch_size,
            device,
            next_epoch: Arc::new(AtomicU64::new(0)),
            num_workers: 0,
            prefetch_factor: DEFAULT_PREFETCH_FACTOR,
            warned_whole: Arc::default(),
        })
    }

    /// Builds batches on `num_workers` background threads per replica (0, the default: on the
    /// training thread between steps), as PyTorch's `DataLoader(num_workers=...)`.
    ///
    /// Worker `w` builds batches `w, w + num_workers, ...` of the epoch, at most
    /// `prefetch_factor` ahead ([`with_prefetch_factor`](Self::with_prefetch_factor)), and the
    /// training thread takes them in turn, so the order is exactly the sampler's, as with 0
    /// workers. A dataset `get` or a batcher that panics in a worker surfaces on the training
    /// thread as a panic naming the rank and the sample index (under
    /// [`DdpStrategy`](crate::DdpStrategy): [`DdpError::WorkerPanicked`] for that rank), after
    /// the batches before it. Workers are threads, not processes: a batcher that decodes or
    /// augments on the CPU overlaps with the step; there is no `pin_memory` (Burn's backends
    /// copy to the device themselves).
    pub fn with_num_workers(mut self, num_workers: usize) -> Self {
        self.num_workers = num_workers;
        self
    }

    /// Batches each worker builds ahead (default
    /// [`DEFAULT_PREFETCH_FACTOR`](crate::config::DEFAULT_PREFETCH_FACTOR), PyTorch's; values
    /// below 1 count as 1). Memory: up to `num_workers * (prefetch_factor + 1)` batches per
    /// replica (each worker's queue and the batch it is building), plus the one being trained on.
    pub fn with_prefetch_factor(mut self, prefetch_factor: usize) -> Self {
        self.prefetch_factor = prefetch_factor.max(1);
        self
    }

    /// Makes the next [`iter`](DataLoader::iter) use sampler epoch `epoch` (the first call uses 0
    /// by default). burn-train counts epochs from 1 and its epoch `k` iterates sampler epoch
    /// `k - 1`, so to resume after the checkpoint of burn-train epoch `c`, use `with_epoch(c)`.
    pub fn with_epoch(self, epoch: u64) -> Self {
        self.next_epoch.store(epoch, Ordering::Relaxed);
        self
    }

    /// The sampler.
    pub fn sampler(&self) -> &DistributedSampler {
        &self.sampler
    }

    fn derive(&self, positions: Range<usize>, device: B::Device) -> Self {
        Self {
            dataset: self.dataset.clone(),
            batcher: self.batcher.clone(),
            sampler: self.sampler,
            batch_size: self.batch_size,
            device,
            positions,
            // A derived loader (a rank's shard) counts its own epochs from where this one is.
            next_epoch: Arc::new(AtomicU64::new(self.next_epoch.load(Ordering::Relaxed))),
            num_workers: self.num_workers,
            prefetch_factor: self.prefetch_factor,
            warned_whole: self.warned_whole.clone(),
        }
    }

    /// Warns once when one rank of a multi-rank job reads every rank's shard (a loader of your
    /// own loop built without [`DistributedSampler::with_rank`]): each rank would train on the
    /// whole dataset, `world_size` times the work, with every sample counted `world_size` times.
    fn warn_if_read_whole(&self, under_strategy: bool) {
        let whole = self.positions == (0..self.sampler.total_size());
        if under_strategy
            || !whole
            || self.sampler.world_size() < 2
            || crate::context::world_size() < 2
            || self.warned_whole.swap(true, Ordering::Relaxed)
        {
            return;
        }
        crate::log::warn_console(&format!(
            "rank {}: this DistributedDataLoader presents all {} ranks' shards, so this rank reads \
             the whole dataset; in a training loop of your own build its sampler with \
             DistributedSampler::with_rank(burn_ddp::rank())",
            crate::context::rank(),
            self.sampler.world_size()
        ));
    }

    /// What an iteration of `epoch` records for the thread ([`drawn_on_this_thread`]) before its
    /// first batch; `None` for a loader of every rank's shard read whole by one rank of several
    /// (its batches are no rank's steps).
    fn counted(&self, epoch: u64) -> Option<Drawn> {
        static ITERATIONS: AtomicU64 = AtomicU64::new(1);
        let sampler = &self.sampler;
        let whole = self.positions == (0..sampler.total_size());
        if whole && sampler.world_size() > 1 {
            return None;
        }
        let steps = sampler
            .total_size()
            .div_ceil(self.batch_size * sampler.world_size());
        Some(Drawn {
            epoch,
            steps: steps as u64,
            last_step_samples: sampler.global_step_samples(self.batch_size, steps.saturating_sub(1))
                as u64,
            full_step_samples: (self.batch_size * sampler.world_size()) as u64,
            iteration: ITERATIONS.fetch_add(1, Ordering::Relaxed),
            world_size: sampler.world_size() as u64,
            ..Drawn::default()
        })
    }

    /// The epoch's steps for this rank, as many on every rank: `Some(batch)` with this rank's
    /// samples of the step, `None` in a step where it has none (the epoch's last step holds
    /// fewer samples than ranks, or one rank's shard ends a batch earlier). What a training
    /// loop of your own iterates over a loader of one rank's shard
    /// ([`DistributedSampler::with_rank`]), so that every rank takes part in every gradient
    /// synchronisation:
    ///
    /// ```ignore
    /// for batch in loader.iter_steps() {
    ///     let grads = match batch {
    ///         Some(batch) => GradientsParams::from_grads(model.loss(batch).backward(), &model),
    ///         None => GradientsParams::new(), // no sample of this rank in this step
    ///     };
    ///     let grads = ddp.sync_gradients(&model, grads)?; // weighted by each rank's samples
    ///     model = ddp.optimizer_step(&mut optim, lr, model, grads)?;
    /// }
    /// ```
    ///
    /// Each call starts the next epoch, as [`iter`](DataLoader::iter) does.
    pub fn iter_steps(&self) -> impl Iterator<Item = Option<O>> + '_ {
        let batches = self.iter();
        let steps = DRAWN.with(Cell::get).map_or(0, |d| d.steps as usize);
        StepIterator {
            batches,
            steps,
            taken: 0,
        }
    }

    /// Why this loader cannot serve `purpose`, if it cannot.
    fn refusal(&self, purpose: Purpose) -> Option<String> {
        let sampler = &self.sampler;
        match purpose {
            Purpose::Training { .. } if sampler.rank().is_some() => Some(format!(
                "the training DistributedDataLoader presents rank {}'s shard only \
                 (DistributedSampler::with_rank, for loops of your own); DdpStrategy shards the \
                 loader itself: build its sampler without with_rank",
                sampler.rank().unwrap_or_default()
            )),
            Purpose::Training { world_size, .. } if world_size != sampler.world_size() => {
                Some(format!(
                    "the training DistributedDataLoader was built for world size {} but the job \
                     has {world_size} replicas: its shards would not be the ranks' shards; build \
                     its sampler with DistributedSampler::new(len, {world_size}) \
                     (burn_ddp::world_size() gives it)",
                    sampler.world_size()
                ))
            }
            Purpose::Training { .. } => None,
            Purpose::Validation if sampler.total_size() > sampler.dataset_len() => Some(format!(
                "the validation loader is a DistributedDataLoader whose sampler pads {} items to \
                 {} for {} ranks: validation would count {} item(s) twice; give \
                 SupervisedTraining a plain DataLoader for validation (burn-ddp shards it across \
                 ranks without padding), or build the sampler with .with_uneven_shards()",
                sampler.dataset_len(),
                sampler.total_size(),
                sampler.world_size(),
                sampler.total_size() - sampler.dataset_len()
            )),
            Purpose::Validation if sampler.total_size() < sampler.dataset_len() => Some(format!(
                "the validation loader is a DistributedDataLoader whose sampler drops {} of {} \
                 items (drop_last): validation must see every item; give SupervisedTraining a \
                 plain DataLoader for validation, or build the sampler with .with_uneven_shards()",
                sampler.dataset_len() - sampler.total_size(),
                sampler.dataset_len()
            )),
            Purpose::Validation => None,
        }
    }
}

impl<B, I, O> DataLoader<B, O> for DistributedDataLoader<B, I, O>
where
    B: Backend,
    I: Send + Sync + Clone + 'static,
    O: Send + 'static,
{
    fn iter<'a>(&'a self) -> Box<dyn DataLoaderIterator<O> + 'a> {
        let counted = self.next_epoch.fetch_add(1, Ordering::Relaxed);
        let strategy_epoch = EPOCH.with(Cell::get);
        let epoch = strategy_epoch.unwrap_or(counted);
        self.warn_if_read_whole(strategy_epoch.is_some());
        let build = Build {
            dataset: self.dataset.clone(),
            batcher: self.batcher.clone(),
            device: self.device.clone(),
            indices: Arc::new(self.sampler.shard_major(epoch, self.positions.clone())),
            batch_size: self.batch_size,
            rank: self.sampler.rank_of_position(self.positions.start),
        };
        // `burn_ddp::rank()` in a dataset's `get` or a batcher answers the replica's rank on the
        // workers too.
        let (rank, world_size) = (crate::context::rank(), crate::context::world_size());
        let queues = (self.num_workers > 0).then(|| {
            (0..self.num_workers)
                .map(|worker| {
                    let (sender, receiver) = sync_channel(self.prefetch_factor);
                    let build = build.clone();
                    let workers = self.num_workers;
                    let spawned = std::thread::Builder::new()
                        .name(format!("burn-ddp-loader-{}-{worker}", build.rank))
                        .spawn(move || {
                            let _rank = crate::context::enter_rank(rank, world_size);
                            build.prefetch(worker, workers, sender)
                        });
                    // A worker that cannot start reports it when its first batch is due.
                    spawned.map(|_| receiver).map_err(|e| e.to_string())
                })
                .collect()
        });
        let counted = self.counted(epoch);
        if counted.is_some() {
            DRAWN.with(|d| d.set(counted));
        }
        Box::new(DistributedIterator {
            build,
            queues,
            batch: 0,
            counted,
            sampler: self.sampler,
        })
    }

    fn num_items(&self) -> usize {
        self.positions.len()
    }

    fn to_device(&self, device: &B::Device) -> Arc<dyn DataLoader<B, O>> {
        Arc::new(self.derive(self.positions.clone(), device.clone()))
    }

    fn slice(&self, start: usize, end: usize) -> Arc<dyn DataLoader<B, O>> {
        SLICING.with(|s| {
            if let Some((purpose, answer)) = s.borrow_mut().as_mut() {
                if answer.refusal.is_none() {
                    answer.refusal = self.refusal(*purpose);
                }
                let sampler = &self.sampler;
                answer.fingerprint = Some(crate::replica::fnv(
                    [
                        sampler.len as u64,
                        sampler.world_size as u64,
                        u64::from(sampler.shuffle),
                        sampler.seed,
                        sampler.tail as u64,
                        self.batch_size as u64,
                    ]
                    .into_iter(),
                ));
            }
        });
        let begin = (self.positions.start + start).min(self.positions.end);
        let end = (self.positions.start + end).clamp(begin, self.positions.end);
        Arc::new(self.derive(begin..end, self.device.clone()))
    }
}

/// What building one epoch's batches of one shard takes, shared with the prefetch workers.
struct Build<B: Backend, I, O> {
    dataset: Arc<dyn Dataset<I>>,
    batcher: Arc<dyn Batcher<B, I, O>>,
    device: B::Device,
    /// The dataset indices of the epoch, in order.
    indices: Arc<Vec<usize>>,
    batch_size: usize,
    /// The rank whose shard this is (for error messages).
    rank: usize,
}

impl<B: Backend, I, O> Clone for Build<B, I, O> {
    fn clone(&self) -> Self {
        Self {
            dataset: self.dataset.clone(),
            batcher: self.batcher.clone(),
            device: self.device.clone(),
            indices: self.indices.clone(),
            batch_size: self.batch_size,
            rank: self.rank,
        }
    }
}

impl<B: Backend, I, O> Build<B, I, O> {
    fn batches(&self) -> usize {
        self.indices.len().div_ceil(self.batch_size)
    }

    /// Batch `k`, or a message naming the rank and the sample whose `get` (or the batch whose
    /// batcher) panicked.
    fn batch(&self, k: usize) -> std::result::Result<O, String> {
        let start = k * self.batch_size;
        let end = (start + self.batch_size).min(self.indices.len());
        let mut items = Vec::with_capacity(end - start);
        for &index in &self.indices[start..end] {
            // Every index is below the dataset length (checked at construction); a dataset whose
            // `get` still returns `None` yields a smaller batch.
            match std::panic::catch_unwind(AssertUnwindSafe(|| self.dataset.get(index))) {
                Ok(Some(item)) => items.push(item),
                Ok(None) => {}
                Err(payload) => {
                    return Err(format!(
                        "rank {}: the dataset's get({index}) panicked while building batch {k}: {}",
                        self.rank,
                        panic_text(payload.as_ref())
                    ));
                }
            }
        }
        std::panic::catch_unwind(AssertUnwindSafe(|| self.batcher.batch(items, &self.device)))
            .map_err(|payload| {
                format!(
                    "rank {}: the batcher panicked on batch {k} (samples {:?}): {}",
                    self.rank,
                    &self.indices[start..end],
                    panic_text(payload.as_ref())
                )
            })
    }

    /// A prefetch worker: builds batches `worker, worker + workers, ...` into `queue` until the
    /// epoch ends, a batch fails (the failure is sent) or the iterator is dropped.
    fn prefetch(
        self,
        worker: usize,
        workers: usize,
        queue: SyncSender<std::result::Result<O, String>>,
    ) {
        for k in (worker..self.batches()).step_by(workers) {
            let built = self.batch(k);
            let failed = built.is_err();
            if queue.send(built).is_err() || failed {
                return;
            }
        }
    }
}

/// The text of a panic's payload.
fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".into()
    }
}

/// What a prefetch worker sends: a batch, or why it could not build it.
type Built<O> = std::result::Result<O, String>;

/// A prefetch worker's queue, or why the worker could not start.
type Queue<O> = std::result::Result<Receiver<Built<O>>, String>;

struct DistributedIterator<B: Backend, I, O> {
    build: Build<B, I, O>,
    /// One queue per prefetch worker (batch `k` comes from queue `k % workers`); `None`: batches
    /// are built on the calling thread.
    queues: Option<Vec<Queue<O>>>,
    /// The next batch.
    batch: usize,
    /// What the batches drawn record for the thread ([`drawn_on_this_thread`]); `None`: nothing.
    counted: Option<Drawn>,
    sampler: DistributedSampler,
}

/// [`DistributedDataLoader::iter_steps`]: the batches, then `None` until the epoch's steps are
/// done.
struct StepIterator<'a, O> {
    batches: Box<dyn DataLoaderIterator<O> + 'a>,
    /// Steps of the epoch.
    steps: usize,
    /// Steps yielded so far.
    taken: usize,
}

impl<O> Iterator for StepIterator<'_, O> {
    type Item = Option<O>;

    fn next(&mut self) -> Option<Option<O>> {
        if let Some(batch) = self.batches.next() {
            self.taken += 1;
            return Some(Some(batch));
        }
        if self.taken >= self.steps {
            return None;
        }
        self.taken += 1;
        Drawn::enter_step_without_sample();
        Some(None)
    }
}

impl<B: Backend, I, O> Iterator for DistributedIterator<B, I, O> {
    type Item = O;

    fn next(&mut self) -> Option<O> {
        let k = self.batch;
        if k >= self.build.batches() {
            return None;
        }
        self.batch += 1;
        let built = match &self.queues {
            None => self.build.batch(k),
            Some(queues) => {
                let worker = k % queues.len();
                match &queues[worker] {
                    Ok(queue) => queue.recv().unwrap_or_else(|_| {
                        Err(format!(
                            "rank {}: loader worker {worker} ended without building batch {k}",
                            self.build.rank
                        ))
                    }),
                    Err(e) => Err(format!(
                        "rank {}: loader worker {worker} could not start: {e}",
                        self.build.rank
                    )),
                }
            }
        };
        if let Some(counted) = self.counted {
            let start = k * self.build.batch_size;
            let samples = (start + self.build.batch_size).min(self.build.indices.len()) - start;
            DRAWN.with(|d| {
                d.set(Some(Drawn {
                    batches: self.batch as u64,
                    samples: samples as u64,
                    global_samples: self.sampler.global_step_samples(self.build.batch_size, k)
                        as u64,
                    ..counted
                }))
            });
        }
        // The one panic kept on purpose: `Iterator::next` (burn-train's loader interface) has no
        // error channel, so a batch that could not be built unwinds the training thread, where
        // DdpStrategy catches it and reports `DdpError::WorkerPanicked` for this rank (the same
        // as a panicking `get` with 0 workers, which Burn's own loaders also propagate).
        Some(built.unwrap_or_else(|message| panic!("{message}")))
    }
}

impl<B: Backend, I, O> Drop for DistributedIterator<B, I, O> {
    /// The iteration ends: what it drew no longer describes the thread's steps.
    fn drop(&mut self) {
        if let Some(counted) = self.counted {
            DRAWN.with(|d| {
                if d.get()
                    .is_some_and(|drawn| drawn.iteration == counted.iteration)
                {
                    d.set(None);
                }
            });
        }
    }
}

impl<B: Backend, I, O> DataLoaderIterator<O> for DistributedIterator<B, I, O> {
    fn progress(&self) -> Progress {
        let done = (self.batch * self.build.batch_size).min(self.build.indices.len());
        Progress::new(done, self.build.indices.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    #[test]
    fn shards_are_disjoint_and_cover_the_dataset() {
        for (len, n) in [(10usize, 2usize), (12, 3), (100, 4), (7, 1)] {
            let sampler = DistributedSampler::new(len, n).unwrap().with_seed(3);
            let shards: Vec<Vec<usize>> = (0..n).map(|r| sampler.indices(5, r)).collect();
            let mut all = BTreeSet::new();
            for shard in &shards {
                assert_eq!(shard.len(), sampler.num_samples());
                for &i in shard {
                    assert!(all.insert(i), "index {i} in two shards (len {len}, n {n})");
                }
            }
            assert_eq!(all, (0..len).collect::<BTreeSet<_>>());
        }
    }

    #[test]
    fn the_default_covers_the_dataset_once_padding_repeats_and_drop_last_cuts() {
        let exact = DistributedSampler::new(11, 2).unwrap();
        assert_eq!((exact.shard_len(0), exact.shard_len(1)), (6, 5));
        assert_eq!(exact.epoch_order(0).len(), 11);
        let union: BTreeSet<usize> = (0..2).flat_map(|r| exact.indices(0, r)).collect();
        assert_eq!(union, (0..11).collect());

        let pad = DistributedSampler::new(11, 2)
            .unwrap()
            .with_duplicate_padding();
        assert_eq!(pad.num_samples(), 6);
        let order = pad.epoch_order(0);
        assert_eq!(order.len(), 12);
        assert_eq!(order[11], order[0], "padding repeats the first sample");
        let union: BTreeSet<usize> = (0..2).flat_map(|r| pad.indices(0, r)).collect();
        assert_eq!(union, (0..11).collect());

        let drop = DistributedSampler::new(11, 2)
            .unwrap()
            .with_drop_last(true)
            .unwrap();
        assert_eq!(drop.num_samples(), 5);
        assert_eq!(drop.indices(0, 0).len(), 5);
        assert_eq!(drop.indices(0, 1).len(), 5);
        // drop_last(false) is the default again, not padding.
        assert_eq!(drop.with_drop_last(false).unwrap(), exact);

        // Padding larger than the dataset (3 samples, 8 ranks) wraps several times.
        let tiny = DistributedSampler::new(3, 8)
            .unwrap()
            .without_shuffle()
            .with_duplicate_padding();
        assert_eq!(tiny.epoch_order(0), vec![0, 1, 2, 0, 1, 2, 0, 1]);
    }

    #[test]
    fn a_step_holds_one_devices_batch_and_each_rank_weighs_by_its_share() {
        // 11 samples, 3 ranks, 2 per rank: steps of 6 and 5 samples, the last 2 + 2 + 1.
        let s = DistributedSampler::new(11, 3).unwrap();
        assert_eq!(s.global_step_samples(2, 0), 6);
        assert_eq!(s.global_step_samples(2, 1), 5);
        let drawn = |samples, global| Drawn {
            samples,
            global_samples: global,
            world_size: 3,
            ..Drawn::default()
        };
        assert_eq!(
            drawn(2, 6).weight(),
            1.0,
            "a full step is weighed exactly 1"
        );
        assert_eq!(drawn(2, 5).weight(), 1.2);
        assert_eq!(drawn(1, 5).weight(), 0.6);
        assert_eq!(drawn(0, 5).weight(), 0.0);
        // The weights of a step's ranks average to 1: a gradient equal on every sample stays.
        let weights: f32 = [drawn(2, 5), drawn(2, 5), drawn(1, 5)]
            .iter()
            .map(Drawn::weight)
            .sum();
        assert!((weights / 3.0 - 1.0).abs() < 1e-6, "{weights}");
    }

    #[test]
    fn every_epoch_has_a_new_order_and_the_same_seed_repeats_it() {
        let s = DistributedSampler::new(1000, 2).unwrap().with_seed(42);
        assert_ne!(s.indices(1, 0), s.indices(2, 0));
        assert_eq!(s.indices(1, 0), s.indices(1, 0));
        let other = DistributedSampler::new(1000, 2).unwrap().with_seed(43);
        assert_ne!(s.indices(1, 0), other.indices(1, 0));
        let plain = DistributedSampler::new(5, 2).unwrap().without_shuffle();
        assert_eq!(plain.indices(0, 0), vec![0, 2, 4]);
        assert_eq!(plain.indices(0, 1), vec![1, 3]);
    }

    #[test]
    fn shard_major_order_lists_rank_shards_one_after_another() {
        let s = DistributedSampler::new(10, 2).unwrap().with_seed(9);
        let all = s.shard_major(4, 0..10);
        assert_eq!(&all[..5], s.indices(4, 0).as_slice());
        assert_eq!(&all[5..], s.indices(4, 1).as_slice());
    }

    #[test]
    fn uneven_shards_cover_the_dataset_once_with_sizes_differing_by_one() {
        let s = DistributedSampler::new(11, 2)
            .unwrap()
            .with_seed(1)
            .with_uneven_shards();
        assert_eq!((s.shard_len(0), s.shard_len(1)), (6, 5));
        let order = s.epoch_order(0);
        assert_eq!(order.len(), 11);
        assert_eq!(s.indices(0, 0).len(), 6);
        assert_eq!(s.indices(0, 1).len(), 5);
        let all = s.shard_major(0, 0..11);
        assert_eq!(&all[..6], s.indices(0, 0).as_slice());
        assert_eq!(&all[6..], s.indices(0, 1).as_slice());
        let union: BTreeSet<usize> = all.into_iter().collect();
        assert_eq!(union, (0..11).collect());
    }

    #[test]
    fn bad_arguments_are_errors() {
        assert!(DistributedSampler::new(10, 0).is_err());
        assert!(DistributedSampler::new(0, 2).is_err());
        assert!(
            DistributedSampler::new(1, 2)
                .unwrap()
                .with_drop_last(true)
                .is_err()
        );
    }
}
