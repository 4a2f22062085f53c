//! The iterator of a [`DistributedDataLoader`](super::DistributedDataLoader)'s epoch, and the
//! background workers that build its next batches ahead of the training step.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, SyncSender};

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::{DataLoaderIterator, Progress};
use burn::data::dataset::{Dataset, DatasetError};
use burn::tensor::Device;

use super::DistributedSampler;
use super::context::{DRAWN, Drawn};

/// What building one epoch's batches of one shard takes, shared with the prefetch workers.
pub(super) struct Build<I, O> {
    pub dataset: Arc<dyn Dataset<I>>,
    pub batcher: Arc<dyn Batcher<I, O>>,
    pub device: Device,
    /// The dataset indices of the epoch, in order.
    pub indices: Arc<Vec<usize>>,
    pub batch_size: usize,
    /// The rank whose shard this is (for error messages).
    pub rank: usize,
}

impl<I, O> Clone for Build<I, O> {
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

impl<I, O> Build<I, O> {
    pub(super) fn batches(&self) -> usize {
        self.indices.len().div_ceil(self.batch_size)
    }

    /// Batch `k`, or a message naming the rank and the sample whose `get` failed or panicked
    /// (or the batch whose batcher panicked).
    pub(super) fn batch(&self, k: usize) -> std::result::Result<O, String> {
        let start = k * self.batch_size;
        let end = (start + self.batch_size).min(self.indices.len());
        let mut items = Vec::with_capacity(end - start);
        for &index in &self.indices[start..end] {
            // Every index is below the dataset length (checked at construction).
            match std::panic::catch_unwind(AssertUnwindSafe(|| self.dataset.get(index))) {
                Ok(Ok(item)) => items.push(item),
                Ok(Err(err)) => {
                    return Err(format!(
                        "rank {}: the dataset's get({index}) failed while building batch {k}: {err}",
                        self.rank
                    ));
                }
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
    pub(super) fn prefetch(
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
pub(super) type Built<O> = std::result::Result<O, String>;

/// A prefetch worker's queue, or why the worker could not start.
pub(super) type Queue<O> = std::result::Result<Receiver<Built<O>>, String>;

pub(super) struct DistributedIterator<I, O> {
    pub build: Build<I, O>,
    /// One queue per prefetch worker (batch `k` comes from queue `k % workers`); `None`: batches
    /// are built on the calling thread.
    pub queues: Option<Vec<Queue<O>>>,
    /// The next batch.
    pub batch: usize,
    /// What the batches drawn record for the thread ([`drawn_on_this_thread`]); `None`: nothing.
    pub counted: Option<Drawn>,
    pub sampler: DistributedSampler,
}

/// [`DistributedDataLoader::iter_steps`]: the batches, then `Ok(None)` until the epoch's steps
/// are done.
pub(super) struct StepIterator<'a, O> {
    pub batches: Box<dyn DataLoaderIterator<O> + 'a>,
    /// Steps of the epoch.
    pub steps: usize,
    /// Steps yielded so far.
    pub taken: usize,
}

impl<O> Iterator for StepIterator<'_, O> {
    type Item = std::result::Result<Option<O>, DatasetError>;

    fn next(&mut self) -> Option<Self::Item> {
        if let Some(batch) = self.batches.next() {
            self.taken += 1;
            return Some(batch.map(Some));
        }
        if self.taken >= self.steps {
            return None;
        }
        self.taken += 1;
        Drawn::enter_step_without_sample();
        Some(Ok(None))
    }
}

/// Why a batch of a [`DistributedDataLoader`](super::DistributedDataLoader) could not be built:
/// the rank, the batch and the sample, and what failed (the dataset's `get`, a panic in it or in
/// the batcher, a worker that ended). Inside the [`DatasetError`] the loader yields.
#[derive(Debug)]
pub(super) struct BatchFailed(pub String);

impl std::fmt::Display for BatchFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for BatchFailed {}

impl<I, O> Iterator for DistributedIterator<I, O> {
    type Item = std::result::Result<O, DatasetError>;

    fn next(&mut self) -> Option<Self::Item> {
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
        // Burn 0.22's loader interface carries the error: burn-train fails the run with it, as for
        // its own loaders' failed reads.
        Some(built.map_err(|message| DatasetError::new(BatchFailed(message))))
    }
}

impl<I, O> Drop for DistributedIterator<I, O> {
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

impl<I, O> DataLoaderIterator<O> for DistributedIterator<I, O> {
    fn progress(&self) -> Progress {
        let done = (self.batch * self.build.batch_size).min(self.build.indices.len());
        Progress::new(done, self.build.indices.len(), None)
    }
}
