//! [`DistributedDataLoader`]: a Burn `DataLoader` over a [`DistributedSampler`], sliced into the
//! rank shards by the strategy.

use std::cell::Cell;
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::sync_channel;

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::{DataLoader, DataLoaderIterator};
use burn::data::dataset::Dataset;
use burn::tensor::Device;

use super::DistributedSampler;
use super::context::Drawn;
use super::context::{DRAWN, EPOCH, Purpose, SLICING};
use super::prefetch::{Build, DistributedIterator, StepIterator};
use crate::error::{DdpError, Result};
use burn_ddp_comm::group::chunk_range;

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
pub struct DistributedDataLoader<I, O> {
    dataset: Arc<dyn Dataset<I>>,
    batcher: Arc<dyn Batcher<I, O>>,
    sampler: DistributedSampler,
    batch_size: usize,
    device: Device,
    positions: Range<usize>,
    next_epoch: Arc<AtomicU64>,
    num_workers: usize,
    prefetch_factor: usize,
    /// Whether the warning about a loader read whole by one rank of several was given.
    warned_whole: Arc<std::sync::atomic::AtomicBool>,
}

/// Batches each prefetch worker builds ahead of the training step: PyTorch's `prefetch_factor`
/// default.
pub(crate) const DEFAULT_PREFETCH_FACTOR: usize = 2;

impl<I, O> DistributedDataLoader<I, O>
where
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
        batcher: impl Batcher<I, O> + 'static,
        sampler: DistributedSampler,
        batch_size: usize,
        device: Device,
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
    /// workers. A dataset `get` that fails or panics, or a batcher that panics, in a worker or on
    /// the training thread, is the iterator's `Err` for that batch (a `DatasetError` naming the
    /// rank and the sample index), after the batches before it: burn-train fails the run with
    /// it. Workers are threads, not processes: a batcher that decodes or
    /// augments on the CPU overlaps with the step; there is no `pin_memory` (Burn's backends
    /// copy to the device themselves).
    pub fn with_num_workers(mut self, num_workers: usize) -> Self {
        self.num_workers = num_workers;
        self
    }

    /// Batches each worker builds ahead (default 2, PyTorch's `prefetch_factor`; values
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

    fn derive(&self, positions: Range<usize>, device: Device) -> Self {
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
        burn_ddp_comm::log::warn_console(&format!(
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
            iteration: Drawn::next_iteration(),
            world_size: sampler.world_size() as u64,
            ..Drawn::default()
        })
    }

    /// The epoch's steps for this rank, as many on every rank: `Ok(Some(batch))` with this
    /// rank's samples of the step, `Ok(None)` in a step where it has none (the epoch's last step
    /// holds fewer samples than ranks, or one rank's shard ends a batch earlier), `Err` for a
    /// batch that could not be built (the dataset's `get` failed or panicked, or the batcher
    /// panicked: the message names the rank, the batch and the sample). What a training loop of
    /// your own iterates over a loader of one rank's shard ([`DistributedSampler::with_rank`]),
    /// so that every rank takes part in every gradient synchronisation:
    ///
    /// ```ignore
    /// for batch in loader.iter_steps() {
    ///     let grads = match batch? {
    ///         Some(batch) => GradientsParams::from_grads(model.loss(batch).backward(), &model),
    ///         None => GradientsParams::new(), // no sample of this rank in this step
    ///     };
    ///     let grads = ddp.sync_gradients(&model, grads)?; // weighted by each rank's samples
    ///     model = ddp.optimizer_step(&mut optim, lr, model, grads)?;
    /// }
    /// ```
    ///
    /// Each call starts the next epoch, as [`iter`](DataLoader::iter) does.
    pub fn iter_steps(
        &self,
    ) -> impl Iterator<Item = std::result::Result<Option<O>, burn::data::dataset::DatasetError>> + '_
    {
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
            Purpose::Validation if sampler.rank().is_some() => Some(format!(
                "the validation DistributedDataLoader presents rank {}'s shard only \
                 (DistributedSampler::with_rank): validation would cover that shard as if it \
                 were the whole set; DdpStrategy shares validation out itself: build its \
                 sampler without with_rank",
                sampler.rank().unwrap_or_default()
            )),
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

impl<I, O> DataLoader<O> for DistributedDataLoader<I, O>
where
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

    /// Items of this loader's positions; when `DdpStrategy` checks the loader at start-up, also
    /// its answer to the strategy (a refusal, its sampler's fingerprint).
    fn num_items(&self) -> usize {
        self.answer_check();
        self.positions.len()
    }

    fn to_device(&self, device: &Device) -> Arc<dyn DataLoader<O>> {
        Arc::new(self.derive(self.positions.clone(), device.clone()))
    }

    fn slice(&self, start: usize, end: usize) -> Arc<dyn DataLoader<O>> {
        let begin = (self.positions.start + start).min(self.positions.end);
        let end = (self.positions.start + end).clamp(begin, self.positions.end);
        Arc::new(self.derive(begin..end, self.device.clone()))
    }
}

impl<I, O> DistributedDataLoader<I, O>
where
    I: Send + Sync + Clone + 'static,
    O: Send + 'static,
{
    /// Answers the strategy's `check_loader`, when it asks on this thread: why this loader cannot serve the purpose announced, and its sampler's and batch
    /// size's fingerprint.
    fn answer_check(&self) {
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
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::data::dataset::DatasetError;

    /// Items `0..len`, whose `get(fail)` fails (a read error of Burn 0.22's fallible datasets).
    struct Failing {
        len: usize,
        fail: usize,
    }

    #[derive(Debug)]
    struct ReadError;

    impl std::fmt::Display for ReadError {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("the disk said no")
        }
    }

    impl std::error::Error for ReadError {}

    impl Dataset<u32> for Failing {
        fn get(&self, index: usize) -> std::result::Result<u32, DatasetError> {
            if index == self.fail {
                Err(DatasetError::new(ReadError))
            } else {
                Ok(index as u32)
            }
        }

        fn len(&self) -> usize {
            self.len
        }
    }

    /// The items of a batch, as they are.
    #[derive(Clone)]
    struct Items;

    impl Batcher<u32, Vec<u32>> for Items {
        fn batch(&self, items: Vec<u32>, _device: &Device) -> Vec<u32> {
            items
        }
    }

    #[test]
    fn a_failed_read_is_the_iterators_error_naming_the_rank_and_the_sample() {
        for workers in [0, 2] {
            let sampler = DistributedSampler::new(8, 1).unwrap().without_shuffle();
            let loader = DistributedDataLoader::new(
                Arc::new(Failing { len: 8, fail: 5 }),
                Items,
                sampler,
                2,
                Device::flex(),
            )
            .unwrap()
            .with_num_workers(workers);
            let mut batches = loader.iter();
            assert_eq!(
                batches.next().unwrap().unwrap(),
                vec![0, 1],
                "{workers} workers"
            );
            assert_eq!(
                batches.next().unwrap().unwrap(),
                vec![2, 3],
                "{workers} workers"
            );
            let err = batches.next().unwrap().unwrap_err().to_string();
            for part in ["rank 0", "get(5)", "batch 2", "the disk said no"] {
                assert!(err.contains(part), "{workers} workers: {err}");
            }
        }
    }

    #[test]
    fn the_steps_of_a_shard_are_the_samplers_with_a_step_without_sample_at_the_end() {
        // 5 samples over 2 ranks, batches of 2: rank 0 has 0, 2, 4 (two steps), rank 1 has 1, 3
        // (one batch, then a step without a sample); every rank iterates two steps.
        for (rank, expected) in [
            (0, vec![Some(vec![0, 2]), Some(vec![4])]),
            (1, vec![Some(vec![1, 3]), None]),
        ] {
            let sampler = DistributedSampler::new(5, 2)
                .unwrap()
                .without_shuffle()
                .with_rank(rank)
                .unwrap();
            let loader = DistributedDataLoader::new(
                Arc::new(Failing {
                    len: 5,
                    fail: usize::MAX,
                }),
                Items,
                sampler,
                2,
                Device::flex(),
            )
            .unwrap();
            let steps: Vec<Option<Vec<u32>>> =
                loader.iter_steps().map(|step| step.unwrap()).collect();
            assert_eq!(steps, expected, "rank {rank}");
        }
    }

    #[test]
    fn the_steps_drawn_say_one_devices_progress_with_and_without_padding_or_drop_last() {
        // 37 items, 2 ranks of 4: steps of 8, the last of 5; rank 0 (the larger shard) draws a
        // sample in every step. Padded: 38 items (one twice); drop_last: 36.
        /// How a case's sampler treats the items its ranks do not divide.
        type Tail = fn(DistributedSampler) -> DistributedSampler;
        let cases: [(Tail, Vec<(u64, u64)>); 3] = [
            (|s| s, vec![(8, 37), (16, 37), (24, 37), (32, 37), (37, 37)]),
            (
                |s| s.with_duplicate_padding(),
                vec![(8, 38), (16, 38), (24, 38), (32, 38), (38, 38)],
            ),
            (
                |s| s.with_drop_last(true).unwrap(),
                vec![(8, 36), (16, 36), (24, 36), (32, 36), (36, 36)],
            ),
        ];
        for (tail, expected) in cases {
            let sampler = tail(DistributedSampler::new(37, 2).unwrap())
                .with_rank(0)
                .unwrap();
            let loader = DistributedDataLoader::new(
                Arc::new(Failing { len: 37, fail: 99 }),
                Items,
                sampler,
                4,
                Device::flex(),
            )
            .unwrap();
            let mut seen = Vec::new();
            for batch in loader.iter() {
                batch.unwrap();
                let drawn = crate::sampler::drawn_on_this_thread().expect("a drawn step");
                seen.push(drawn.global_progress());
            }
            assert_eq!(seen, expected);
        }
    }
}
