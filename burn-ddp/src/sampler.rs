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

use std::cell::Cell;

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
use crate::{DdpError, Result};

/// The distributed sampler: which samples each rank trains on, epoch by epoch.
///
/// [`DistributedSampler`] has the semantics of PyTorch's `torch.utils.data.DistributedSampler`:
/// - each epoch, the dataset's indices are shuffled with a generator seeded by `seed + epoch`, so
///   every epoch has a new order without the user calling anything, and every rank computes the
///   same permutation;
/// - the permutation is padded by wrapping around to a multiple of the world size (or cut down to
///   one, with `drop_last`), so **every rank gets the same number of samples**, hence the same
///   number of batches, and no rank waits for a batch that never comes;
/// - rank `r` takes positions `r, r + N, r + 2N, ...` of the permutation: the shards are disjoint
///   (apart from the wrapped padding) and together cover the dataset.
///
/// With the strided shards, batch `k` of every rank together is exactly batch `k` of a single
/// device that iterates the same permutation with an `N` times larger batch: data-parallel
/// training sees the same samples per step as single-device training.
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
}

/// What happens to a dataset that does not divide evenly between ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tail {
    /// Pad by repeating the first samples (PyTorch's default).
    Wrap,
    /// Drop the last samples (PyTorch's `drop_last`).
    Drop,
    /// Keep shards of unequal sizes, differing by at most one sample (for `UnevenInputs::Join`).
    Uneven,
}

impl DistributedSampler {
    /// A sampler over `len` samples for `world_size` ranks, shuffling with seed 0 and padding by
    /// wrapping (PyTorch's defaults).
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
            tail: Tail::Wrap,
        })
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

    /// `true`: drops the tail of the permutation so it divides evenly between ranks;
    /// `false` (default): pads it by repeating its first samples.
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
        self.tail = if drop_last { Tail::Drop } else { Tail::Wrap };
        Ok(self)
    }

    /// Neither pads nor drops: the shards cover the dataset exactly once and their sizes differ
    /// by at most one sample (ranks below `len % world_size` get one more), so ranks can run out
    /// of batches at different steps. For [`UnevenInputs::Join`](crate::UnevenInputs::Join),
    /// which handles exactly that.
    pub fn with_uneven_shards(mut self) -> Self {
        self.tail = Tail::Uneven;
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

    /// Samples per rank and epoch: `ceil(len / N)`, or `floor(len / N)` with `drop_last`; with
    /// uneven shards, the largest shard's size.
    pub fn num_samples(&self) -> usize {
        match self.tail {
            Tail::Drop => self.len / self.world_size,
            Tail::Wrap | Tail::Uneven => self.len.div_ceil(self.world_size),
        }
    }

    /// Samples per epoch over all ranks: `num_samples * N`, or the dataset's length with uneven
    /// shards.
    pub fn total_size(&self) -> usize {
        match self.tail {
            Tail::Uneven => self.len,
            Tail::Wrap | Tail::Drop => self.num_samples() * self.world_size,
        }
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
/// shards. `batch_size` is the **per-rank** batch (PyTorch's convention): the global batch is
/// `batch_size * world_size`.
///
/// Each call to [`iter`](DataLoader::iter) starts the next epoch (0, 1, 2, ... unless
/// [`with_epoch`](Self::with_epoch) sets the first), so every epoch gets a new order. Under
/// [`DdpStrategy`](crate::DdpStrategy) the epoch follows burn-train's (burn-train's epoch `k` is
/// sampler epoch `k - 1`, set by the strategy on every replica's thread), also when resuming from
/// a checkpoint.
pub struct DistributedDataLoader<B: Backend, I, O> {
    dataset: Arc<dyn Dataset<I>>,
    batcher: Arc<dyn Batcher<B, I, O>>,
    sampler: DistributedSampler,
    batch_size: usize,
    device: B::Device,
    positions: Range<usize>,
    next_epoch: Arc<AtomicU64>,
}

impl<B, I, O> DistributedDataLoader<B, I, O>
where
    B: Backend,
    I: Send + Sync + Clone + 'static,
    O: Send + 'static,
{
    /// A loader over all ranks' shards of `dataset` (length `sampler.total_size()`), batching
    /// `batch_size` samples per rank on `device`.
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
            positions: 0..sampler.total_size(),
            sampler,
            batch_size,
            device,
            next_epoch: Arc::new(AtomicU64::new(0)),
        })
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
        let epoch = EPOCH.with(Cell::get).unwrap_or(counted);
        let indices = self.sampler.shard_major(epoch, self.positions.clone());
        Box::new(DistributedIterator {
            loader: self,
            indices,
            next: 0,
        })
    }

    fn num_items(&self) -> usize {
        self.positions.len()
    }

    fn to_device(&self, device: &B::Device) -> Arc<dyn DataLoader<B, O>> {
        Arc::new(self.derive(self.positions.clone(), device.clone()))
    }

    fn slice(&self, start: usize, end: usize) -> Arc<dyn DataLoader<B, O>> {
        let begin = (self.positions.start + start).min(self.positions.end);
        let end = (self.positions.start + end).clamp(begin, self.positions.end);
        Arc::new(self.derive(begin..end, self.device.clone()))
    }
}

struct DistributedIterator<'a, B: Backend, I, O> {
    loader: &'a DistributedDataLoader<B, I, O>,
    indices: Vec<usize>,
    next: usize,
}

impl<B: Backend, I, O> Iterator for DistributedIterator<'_, B, I, O> {
    type Item = O;

    fn next(&mut self) -> Option<O> {
        if self.next >= self.indices.len() {
            return None;
        }
        let end = (self.next + self.loader.batch_size).min(self.indices.len());
        // Every index is below the dataset length (checked at construction); a dataset whose `get`
        // still returns `None` yields a smaller batch.
        let items: Vec<I> = self.indices[self.next..end]
            .iter()
            .filter_map(|&i| self.loader.dataset.get(i))
            .collect();
        self.next = end;
        Some(self.loader.batcher.batch(items, &self.loader.device))
    }
}

impl<B: Backend, I, O> DataLoaderIterator<O> for DistributedIterator<'_, B, I, O> {
    fn progress(&self) -> Progress {
        Progress::new(self.next, self.indices.len())
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
    fn padding_wraps_and_drop_last_cuts_so_every_rank_has_as_many_samples() {
        let pad = DistributedSampler::new(11, 2).unwrap();
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

        // Padding larger than the dataset (3 samples, 8 ranks) wraps several times.
        let tiny = DistributedSampler::new(3, 8).unwrap().without_shuffle();
        assert_eq!(tiny.epoch_order(0), vec![0, 1, 2, 0, 1, 2, 0, 1]);
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
        assert_eq!(plain.indices(0, 1), vec![1, 3, 0]);
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
