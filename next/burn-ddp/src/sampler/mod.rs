//! The distributed sampler and its data loader: which samples each rank trains on, epoch by epoch.
//! [`DistributedSampler`] is here; the loader over it in [`loader`], its prefetch workers and
//! iterator in `prefetch`, and what a rank has drawn (read by the gradient synchronisation) in
//! `context`.

mod context;
mod loader;
mod prefetch;

// For the strategy and the custom loop (stages 3 and 4 of the port).
#[allow(unused_imports)]
pub(crate) use context::{
    Drawn, Purpose, check_loader, drawn_on_this_thread, enter_epoch, epoch_on_this_thread,
};
pub use loader::DistributedDataLoader;

use std::ops::Range;

use rand::SeedableRng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;

use crate::error::{DdpError, Result};
use burn_ddp_comm::group::chunk_range;

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
/// [`DistributedDataLoader`] is a Burn [`DataLoader`](burn::data::dataloader::DataLoader) over a sampler. It presents the rank shards
/// one after another (rank 0's samples, then rank 1's, ...), so that
/// [`DataLoader::slice`](burn::data::dataloader::DataLoader::slice) at multiples of the shard size, which is how
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
