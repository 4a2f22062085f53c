//! A rank's training loader when the user's is not a `DistributedDataLoader`: its share of one
//! device's pass ([`Dealer`]), rank `r` the batches `r, r + N, ...`, so that step `k` of the
//! ranks together is batches `kN .. kN + N` of one device's order, the step one device takes with
//! an `N` times larger batch from the same loader. Each batch records on the rank's thread what
//! its step holds (the sampler's [`Drawn`]), as a `DistributedDataLoader`'s do: the strategy
//! weighs each rank's gradients by its share of the step's samples (a short last batch), and a
//! rank without a batch in the last step takes part in it without a sample.

use std::sync::Arc;
use std::time::Duration;

use burn::data::dataloader::{DataLoader, DataLoaderIterator, Progress};
use burn::data::dataset::DatasetError;
use burn::tensor::Device;

use super::dealer::{Batches, Dealer, Step};
use crate::sampler::Drawn;
use burn_ddp_comm::group::ProcessGroup;

/// Global rank `rank`'s share of `dealer`'s passes, as a Burn loader (one pass per `iter`).
pub(super) struct DealtLoader<O> {
    dealer: Arc<Dealer<O>>,
    rank: usize,
    world_size: usize,
    /// How long the rank waits for its next batch (the collectives' timeout).
    timeout: Duration,
    /// The rank's group: a rank that failed aborts it, and the waiting rank gives up then.
    group: Arc<dyn ProcessGroup>,
}

impl<O> DealtLoader<O> {
    /// Rank `group.rank()` of `group.world_size()`, waiting at most `timeout` for a batch.
    pub fn new(dealer: Arc<Dealer<O>>, group: Arc<dyn ProcessGroup>, timeout: Duration) -> Self {
        Self {
            dealer,
            rank: group.rank(),
            world_size: group.world_size(),
            timeout,
            group,
        }
    }
}

impl<O> DataLoader<O> for DealtLoader<O>
where
    O: Send + 'static,
{
    fn iter<'a>(&'a self) -> Box<dyn DataLoaderIterator<O> + 'a> {
        let epoch = crate::sampler::epoch_on_this_thread().unwrap_or_default();
        Box::new(DealtIterator {
            batches: self.dealer.take(self.rank),
            timeout: self.timeout,
            group: self.group.clone(),
            rank: self.rank,
            total: self.dealer.num_items(),
            drawn: Drawn {
                epoch,
                world_size: self.world_size as u64,
                iteration: Drawn::next_iteration(),
                ..Drawn::default()
            },
            world_size: self.world_size,
        })
    }

    /// The rank's share, as even as the loader's items go (an estimate: the batch size is only
    /// seen in the pass).
    fn num_items(&self) -> usize {
        self.dealer.num_items().div_ceil(self.world_size)
    }

    /// The rank's share stays on its device.
    fn to_device(&self, _device: &Device) -> Arc<dyn DataLoader<O>> {
        Arc::new(self.same())
    }

    /// Not a view of an order of its own: the rank's share, whole.
    fn slice(&self, _start: usize, _end: usize) -> Arc<dyn DataLoader<O>> {
        Arc::new(self.same())
    }
}

impl<O> DealtLoader<O> {
    fn same(&self) -> Self {
        Self {
            dealer: self.dealer.clone(),
            rank: self.rank,
            world_size: self.world_size,
            timeout: self.timeout,
            group: self.group.clone(),
        }
    }
}

/// One pass of a rank's share.
struct DealtIterator<'a, O> {
    batches: Batches<'a, O>,
    timeout: Duration,
    group: Arc<dyn ProcessGroup>,
    rank: usize,
    /// Items of the loader (every rank's).
    total: usize,
    /// What the pass has drawn so far, recorded on the thread with every step.
    drawn: Drawn,
    world_size: usize,
}

impl<O> Iterator for DealtIterator<'_, O> {
    type Item = std::result::Result<O, DatasetError>;

    /// The rank's next batch; `None` in a last step without one (recorded as such, so the rank
    /// takes part in the step without a sample) and after the pass.
    ///
    /// # Panics
    /// With the [`DdpError`](crate::DdpError) the strategy reports for this rank, on its thread
    /// (`Iterator::next` has no error channel): `LoaderStalled` when no batch came within the
    /// timeout, `Aborted` when a rank that failed aborted the group meanwhile, `WorkerPanicked`
    /// when the pass broke (a batch could not be read, the loader panicked on the pass's thread,
    /// or its device failed). Every batch it yields is `Ok`: a batch that could not be read
    /// breaks the pass for every rank, which is the strategy's error for each, not a data error
    /// of one.
    fn next(&mut self) -> Option<Self::Item> {
        let group = &self.group;
        let next = match self
            .batches
            .next_step_within(&|| group.aborted(), self.timeout)
        {
            Ok(next) => next?,
            // The one way out of `Iterator::next` (burn-train's loader interface has no error
            // channel): the rank's worker catches the payload and returns it as this `DdpError`.
            Err(stall) => std::panic::panic_any(stall.into_error(self.rank, "training")),
        };
        let step: Step = self.batches.step();
        let world_size = self.world_size as u64;
        self.drawn = Drawn {
            // The strategy counts a step without a sample itself (`enter_step_without_sample`).
            batches: step.number as u64 + u64::from(next.is_some()),
            samples: step.samples as u64,
            global_samples: step.global_samples as u64,
            full_step_samples: step.full_samples as u64,
            steps: if step.last {
                step.number as u64 + 1
            } else {
                u64::MAX
            },
            last_step_samples: if step.last {
                step.global_samples as u64
            } else {
                u64::MAX
            },
            last_step_without_batch: if step.last {
                world_size.saturating_sub(step.batches as u64)
            } else {
                0
            },
            ..self.drawn
        };
        Drawn::set_on_this_thread(Some(self.drawn));
        next.map(Ok)
    }
}

impl<O> DataLoaderIterator<O> for DealtIterator<'_, O> {
    /// One device's progress after the last step taken (the strategy reports it as it is, as
    /// one device with an `N` times larger batch would).
    fn progress(&self) -> Progress {
        Progress::new(self.batches.step().items_after, self.total, None)
    }
}

impl<O> Drop for DealtIterator<'_, O> {
    /// The pass ends: what it drew no longer describes the thread's steps.
    fn drop(&mut self) {
        if crate::sampler::drawn_on_this_thread()
            .is_some_and(|drawn| drawn.iteration == self.drawn.iteration)
        {
            Drawn::set_on_this_thread(None);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::data::dataloader::DataLoaderBuilder;
    use burn::data::dataloader::batcher::Batcher;
    use burn::data::dataset::InMemDataset;
    use burn_ddp_comm::group::ThreadGroup;

    #[derive(Clone)]
    struct Items;

    impl Batcher<usize, Vec<usize>> for Items {
        fn batch(&self, items: Vec<usize>, _: &Device) -> Vec<usize> {
            items
        }
    }

    fn shuffled() -> Arc<dyn DataLoader<Vec<usize>>> {
        // 10 items in batches of 4: one device's pass is 4, 4 and 2 items.
        DataLoaderBuilder::new(Items)
            .batch_size(4)
            .shuffle(3)
            .build(InMemDataset::new((0..10).collect()))
    }

    #[test]
    fn thread_ranks_iterate_one_devices_pass_and_record_each_steps_samples() {
        let one_device: Vec<Vec<usize>> = shuffled()
            .to_device(&Device::flex())
            .iter()
            .map(|batch| batch.unwrap())
            .collect();
        let dealer = Dealer::new(&shuffled(), &Device::flex(), 2, vec![0, 1]);
        let groups = ThreadGroup::new_group(2).unwrap();
        let seen: Vec<Vec<(Vec<usize>, Drawn)>> = std::thread::scope(|s| {
            let handles: Vec<_> = groups
                .into_iter()
                .map(|group| {
                    let dealer = dealer.clone();
                    s.spawn(move || {
                        let group: Arc<dyn ProcessGroup> = Arc::new(group);
                        let loader = DealtLoader::new(dealer, group, Duration::from_secs(30));
                        let mut iterator = loader.iter();
                        let mut seen = Vec::new();
                        for batch in iterator.by_ref() {
                            let drawn = crate::sampler::drawn_on_this_thread().unwrap();
                            seen.push((batch.unwrap(), drawn));
                        }
                        assert_eq!(iterator.progress().items_processed, 10);
                        seen
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        // Rank 0 takes batches 0 and 2, rank 1 batch 1 and no batch in the last step.
        assert_eq!(seen[0].len(), 2);
        assert_eq!(seen[1].len(), 1);
        assert_eq!(seen[0][0].0, one_device[0]);
        assert_eq!(seen[1][0].0, one_device[1]);
        assert_eq!(seen[0][1].0, one_device[2]);
        let (first, last) = (seen[0][0].1, seen[0][1].1);
        assert_eq!((first.samples, first.global_samples), (4, 8));
        assert_eq!((last.samples, last.global_samples, last.steps), (2, 2, 2));
        assert_eq!(
            last.last_step_without_batch, 1,
            "rank 1 has no batch in the last step"
        );
    }
}
