//! A loader burn-ddp did not build, read as one device reads it, its batches dealt to the ranks.
//!
//! Burn's single-device strategy makes one copy of a loader (`to_device`) and iterates that copy
//! once per epoch. A shuffled Burn loader draws each epoch's order from the copy's generator when
//! `iter` is called, `to_device` and `slice` fork that generator (so every call changes what the
//! next copy draws), and `slice` shuffles only inside its range of the unshuffled dataset: slices
//! are not pieces of one device's order, and a user's own loader need not make them so either.
//! So the [`Dealer`] makes the one copy in this process (`to_device`, once, before anything else
//! reads the loader), iterates it once per round (an epoch's pass) and deals batch `i` of the
//! pass to rank `i % world_size`: together the ranks take every batch of one device's pass, each
//! once, in its order.
//!
//! - **Several ranks in this process** (threads): the pass runs on a thread of its own and hands
//!   each rank its batches. That needs tensors that any thread may use: Burn's CPU backends
//!   (`replica::shares_plain_values`; on wgpu and CUDA, Burn 0.21's fusion lost track of a
//!   handle used by another thread, even after a sync: not measured again on 0.22), one device
//!   (the copy's).
//! - **One rank in this process**: the rank iterates the pass itself and drops the other ranks'
//!   batches, so every process builds every batch (one device's loading work per process). The
//!   processes must give the same pass: a loader of a fixed order (a `DistributedDataLoader`),
//!   not one whose workers hand out batches in the order they finish (Burn's `num_workers`).
//!
//! Where neither holds the strategy validates on rank 0 alone (`run.rs`).
//!
//! Burn 0.22's loaders yield `Result<O, DatasetError>`: a batch that could not be read breaks the
//! pass for every rank at that batch (as it stops one device there), with the loader's error and
//! the batch's position in one device's order; the batches before it are dealt as usual.

use std::collections::VecDeque;
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, sync_channel};
use std::sync::{Arc, Mutex, PoisonError};

use burn::data::dataloader::{DataLoader, DataLoaderIterator, Progress};
use burn::tensor::Device;

/// Batches queued per rank ahead of its use.
const AHEAD: usize = 2;

/// One rank's share of a step of a pass: its batch's position in one device's order, the batch
/// (`None`: the pass's last step has no batch left for this rank), the loader's progress right
/// after it (one device's `Progress`) and what the step holds.
pub(super) struct Dealt<O> {
    pub index: usize,
    pub batch: Option<O>,
    pub progress: Progress,
    pub step: Step,
}

/// A step of a pass: `world_size` consecutive batches of one device's order, batch `r` of them
/// rank `r`'s (dealt passes only; a rank that iterates its own pass leaves it at its default).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Step {
    /// The step's number in the pass (from 0).
    pub number: usize,
    /// The rank's samples in it (0: no batch).
    pub samples: usize,
    /// The samples of all its batches: one device's batch of `world_size` times the size.
    pub global_samples: usize,
    /// The samples of the pass's first step (a full one).
    pub full_samples: usize,
    /// Its batches (fewer than the world size only in the last step).
    pub batches: usize,
    /// Whether it is the pass's last step.
    pub last: bool,
    /// One device's items processed after the step's last batch (the progress one device with
    /// an `N` times larger batch reports for the step).
    pub items_after: usize,
}

/// What a rank receives of a pass: a batch, or why the pass broke (the loader panicked, or its
/// device failed), which the rank raises.
type Message<O> = std::result::Result<Dealt<O>, String>;

/// One process's copy of a loader, passed once per round and dealt to this process's ranks.
pub(super) struct Dealer<O> {
    /// The one copy (made by `to_device`, as one device makes its own).
    loader: Arc<dyn DataLoader<O>>,
    /// Its batches' device.
    device: Device,
    world_size: usize,
    /// The global ranks of this process, in order (their slots index `rounds`).
    local: Vec<usize>,
    rounds: Mutex<Rounds<O>>,
}

/// The passes started and not yet taken by every local rank.
struct Rounds<O> {
    /// Passes started so far.
    started: usize,
    /// Passes each local rank has taken.
    taken: Vec<usize>,
    /// Per pass not yet taken by every rank: its number and each rank's receiver.
    open: VecDeque<(usize, Receivers<O>)>,
}

/// Each local rank's receiver of one pass (`None` once taken).
type Receivers<O> = Vec<Option<Receiver<Message<O>>>>;

/// What the thread that starts a pass hands the pass's thread: the epoch a loader of burn-ddp's
/// reads on the thread that iterates it, and the rank that names a failure. (`burn_ddp::rank()`
/// in a batcher answers the process's rank there, as outside the rank threads: the pass is every
/// local rank's.)
#[derive(Debug, Clone, Copy)]
struct Context {
    rank: usize,
    epoch: Option<u64>,
}

impl<O> Dealer<O>
where
    O: Send + 'static,
{
    /// The dealer of `loader` for the global ranks `local` (this process's) of `world_size`,
    /// their batches on `device`. Makes the copy: the first and only call on `loader`.
    pub fn new(
        loader: &Arc<dyn DataLoader<O>>,
        device: &Device,
        world_size: usize,
        local: Vec<usize>,
    ) -> Arc<Self> {
        Arc::new(Self {
            loader: loader.to_device(device),
            device: device.clone(),
            world_size: world_size.max(1),
            rounds: Mutex::new(Rounds {
                started: 0,
                taken: vec![0; local.len()],
                open: VecDeque::new(),
            }),
            local,
        })
    }

    /// Items of the loader (all ranks').
    pub fn num_items(&self) -> usize {
        self.loader.num_items()
    }

    /// The batches of global rank `rank` in its next pass, in one device's order. Alone in its
    /// process, the rank iterates the pass itself; otherwise the first local rank to ask for a
    /// pass starts it on a thread of its own, and the others take theirs from it.
    pub fn take(&self, rank: usize) -> Batches<'_, O> {
        let source = match self.local.as_slice() {
            [only] if *only == rank => Source::Own {
                iterator: self.loader.iter(),
                next: 0,
            },
            _ => Source::Dealt(self.receiver(rank)),
        };
        Batches {
            source,
            rank,
            world_size: self.world_size,
            progress: Progress::new(0, self.loader.num_items(), None),
            index: None,
            step: Step::default(),
        }
    }

    /// Local rank `rank`'s receiver of its next pass (`None`: not a rank of this process).
    fn receiver(&self, rank: usize) -> Option<Receiver<Message<O>>> {
        let slot = self.local.iter().position(|&r| r == rank)?;
        let mut rounds = self.rounds.lock().unwrap_or_else(PoisonError::into_inner);
        rounds.taken[slot] += 1;
        let pass = rounds.taken[slot];
        if pass > rounds.started {
            rounds.started += 1;
            let number = rounds.started;
            let receivers = self.start(number);
            rounds.open.push_back((number, receivers));
        }
        let receiver = rounds
            .open
            .iter_mut()
            .find(|(number, _)| *number == pass)
            .and_then(|(_, receivers)| receivers[slot].take());
        // A pass every rank took is forgotten.
        rounds
            .open
            .retain(|(_, receivers)| receivers.iter().any(Option::is_some));
        receiver
    }

    /// Starts pass `number` on a thread of its own; returns each local rank's receiver.
    fn start(&self, number: usize) -> Receivers<O> {
        let (senders, receivers): (Vec<_>, Vec<_>) =
            self.local.iter().map(|_| sync_channel(AHEAD)).unzip();
        // Clones for the case where no thread starts (they leave with this call otherwise, so
        // the pass ends with its thread's senders).
        let fallback: Vec<SyncSender<Message<O>>> = senders.clone();
        let context = Context {
            rank: crate::context::rank(),
            epoch: crate::sampler::epoch_on_this_thread(),
        };
        let (loader, device) = (self.loader.clone(), self.device.clone());
        let (world_size, local) = (self.world_size, self.local.clone());
        let spawned = std::thread::Builder::new()
            .name(format!("burn-ddp-dealer-{number}"))
            .spawn(move || {
                let pass = Pass {
                    world_size,
                    local: &local,
                    device: &device,
                    context,
                };
                pass.deal(&*loader, senders);
            });
        if let Err(e) = spawned {
            // No thread: every rank reading the pass fails with why (the closure and its
            // senders were dropped, so the message goes through the senders kept here).
            let failure = format!("the loader's pass could not start a thread: {e}");
            for sender in &fallback {
                let _ = sender.send(Err(failure.clone()));
            }
        }
        receivers.into_iter().map(Some).collect()
    }
}

/// One pass over a loader on its own thread: who takes which batch, and where they are.
struct Pass<'a> {
    world_size: usize,
    local: &'a [usize],
    device: &'a Device,
    context: Context,
}

/// The failure of batch `index` of a pass (its position in one device's order).
fn unreadable(index: usize, error: &burn::data::dataset::DatasetError) -> String {
    format!("batch {index} of the loader's pass could not be read: {error}")
}

impl Pass<'_> {
    /// Batch `i` of `loader`'s pass to `senders[slot of rank i % world_size]`, dropped when that
    /// rank is not local; each batch complete on its device before it leaves this thread (a
    /// GPU backend's queued work belongs to the thread that queued it). Ends with the loader, or
    /// once no local rank takes batches any more; a panic of the loader (a batcher's, say) or a
    /// failed device goes to every local rank still reading.
    fn deal<O>(&self, loader: &dyn DataLoader<O>, senders: Vec<SyncSender<Message<O>>>) {
        let _epoch = self.context.epoch.map(crate::sampler::enter_epoch);
        let mut senders: Vec<Option<SyncSender<Message<O>>>> =
            senders.into_iter().map(Some).collect();
        let passed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.pass(loader, &mut senders)
        }));
        let failure = match passed {
            Ok(Ok(())) => return,
            Ok(Err(failure)) => failure,
            Err(panic) => format!(
                "the loader panicked during its pass: {}",
                crate::error::panic_message(panic.as_ref())
            ),
        };
        for sender in senders.iter().flatten() {
            let _ = sender.send(Err(failure.clone()));
        }
    }

    /// The pass, a step at a time: the step's batches are read (and the next step's first, to
    /// know whether this one is the last) before any is handed out, so that every rank learns
    /// the step's samples with its batch. A batch that cannot be read ends the pass with its
    /// error after the steps before it are handed out.
    fn pass<O>(
        &self,
        loader: &dyn DataLoader<O>,
        senders: &mut [Option<SyncSender<Message<O>>>],
    ) -> std::result::Result<(), String> {
        let mut iterator = loader.iter();
        let mut read = 0;
        let mut position = 0;
        // The next batch of the pass and the items read after it (an error: where it failed).
        let mut take = |iterator: &mut Box<dyn DataLoaderIterator<O> + '_>| {
            let at = position;
            position += 1;
            iterator.next().map(|batch| match batch {
                Ok(batch) => Ok((batch, iterator.progress())),
                Err(error) => Err(unreadable(at, &error)),
            })
        };
        let mut next = take(&mut iterator).transpose()?;
        let mut full_samples = 0;
        let mut number = 0;
        let mut broken = None;
        while next.is_some() && senders.iter().any(Option::is_some) {
            let mut step = Vec::with_capacity(self.world_size);
            while step.len() < self.world_size
                && let Some((batch, progress)) = next.take()
            {
                let samples = progress.items_processed.saturating_sub(read).max(1);
                read = progress.items_processed;
                step.push((batch, progress, samples));
                // A failure of the next batch is raised after this step is handed out.
                match take(&mut iterator).transpose() {
                    Ok(batch) => next = batch,
                    Err(failure) => {
                        broken = Some(failure);
                        break;
                    }
                }
            }
            let global_samples = step.iter().map(|(_, _, samples)| samples).sum();
            if number == 0 {
                full_samples = global_samples;
            }
            let shape = Step {
                number,
                samples: 0,
                global_samples,
                full_samples,
                batches: step.len(),
                last: next.is_none() && broken.is_none(),
                items_after: read,
            };
            let first = number * self.world_size;
            let mut step = step.into_iter();
            for rank in 0..self.world_size {
                let taken = step.next();
                let Some(slot) = self.local.iter().position(|&r| r == rank) else {
                    continue;
                };
                let Some(sender) = &senders[slot] else {
                    continue;
                };
                crate::replica::sync_device(
                    self.context.rank,
                    self.device,
                    "a batch of the loader's pass",
                )
                .map_err(|e| e.to_string())?;
                let (batch, progress, samples) = match taken {
                    Some((batch, progress, samples)) => (Some(batch), progress, samples),
                    None => (None, Progress::new(read, loader.num_items(), None), 0),
                };
                let dealt = Dealt {
                    index: first + rank,
                    batch,
                    progress,
                    step: Step { samples, ..shape },
                };
                if sender.send(Ok(dealt)).is_err() {
                    // The rank stopped reading (an interrupt): the others go on.
                    senders[slot] = None;
                }
            }
            number += 1;
            if let Some(failure) = broken {
                return Err(failure);
            }
        }
        Ok(())
    }
}

/// Where a rank's batches of a pass come from.
enum Source<'a, O> {
    /// The rank iterates the pass itself (alone in its process); `next` is the position of the
    /// pass's next batch.
    Own {
        iterator: Box<dyn DataLoaderIterator<O> + 'a>,
        next: usize,
    },
    /// The pass's thread hands them over (`None`: not a rank of this process).
    Dealt(Option<Receiver<Message<O>>>),
}

/// Why a rank stopped waiting for its next batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Stall {
    /// The caller's check said to give up (the group was aborted by a rank that failed).
    GivenUp(String),
    /// No batch came within the timeout (another rank of the pass stopped reading its own).
    TimedOut(std::time::Duration),
    /// The pass broke, with why: a batch could not be read (the loader's error), the loader
    /// panicked (a batcher's panic, say), its device failed, or its thread could not start.
    Broken(String),
}

impl Stall {
    /// The run's error for global rank `rank` that stopped waiting for its next batch of
    /// `loader` (`"validation"` or `"training"`).
    pub fn into_error(self, rank: usize, loader: &'static str) -> crate::error::DdpError {
        match self {
            Stall::GivenUp(cause) => burn_ddp_comm::CommError::Aborted {
                rank,
                op: burn_ddp_comm::group::Collective::Barrier,
                seq: 0,
                cause: format!("while waiting for its next {loader} batch: {cause}"),
            }
            .into(),
            Stall::TimedOut(waited) => crate::error::DdpError::LoaderStalled {
                rank,
                loader,
                waited,
            },
            // The loader's code failed for this rank, as a panic on its own thread would.
            Stall::Broken(failure) => crate::error::DdpError::WorkerPanicked {
                rank,
                message: format!("the {loader} loader's pass failed: {failure}"),
            },
        }
    }
}

/// How often a rank waiting for a dealt batch asks whether to give up.
const POLL: std::time::Duration = std::time::Duration::from_millis(100);

/// A rank's batches of one pass, in one device's order.
pub(super) struct Batches<'a, O> {
    source: Source<'a, O>,
    rank: usize,
    world_size: usize,
    /// One device's progress after the last batch taken.
    progress: Progress,
    /// The position of the last batch taken in one device's order.
    index: Option<usize>,
    /// The step of the last batch taken (dealt passes).
    step: Step,
}

impl<O> Batches<'_, O> {
    /// One device's progress after the last batch taken (items processed of the whole loader).
    pub fn progress(&self) -> Progress {
        self.progress.clone()
    }

    /// The last batch taken's position in one device's order.
    pub fn index(&self) -> Option<usize> {
        self.index
    }

    /// The step of the last batch taken, or of the last step without one (dealt passes).
    pub fn step(&self) -> Step {
        self.step
    }

    /// The rank's next batch (`None` at the pass's end), waiting at most `timeout` for a dealt
    /// one and asking `give_up` every tenth of a second meanwhile; a last step without a batch
    /// for this rank is passed over.
    ///
    /// # Errors
    /// [`Stall`]: `give_up` answered, nothing came within `timeout`, or the pass broke (a batch
    /// could not be read, the loader panicked on the pass's thread, or its device failed). A
    /// rank that iterates the
    /// pass itself (alone in its process) unwinds from the loader's panic on its own thread, as
    /// under Burn's own strategy.
    pub fn next_within(
        &mut self,
        give_up: &dyn Fn() -> Option<String>,
        timeout: std::time::Duration,
    ) -> std::result::Result<Option<O>, Stall> {
        loop {
            match self.next_step_within(give_up, timeout)? {
                Some(Some(batch)) => return Ok(Some(batch)),
                Some(None) => {}
                None => return Ok(None),
            }
        }
    }

    /// The rank's share of the pass's next step: `Some(Some(batch))`, `Some(None)` in a last
    /// step without a batch for it, `None` at the pass's end. Bounded and raised as
    /// [`next_within`](Self::next_within).
    ///
    /// # Errors
    /// [`Stall`], as [`next_within`](Self::next_within).
    pub fn next_step_within(
        &mut self,
        give_up: &dyn Fn() -> Option<String>,
        timeout: std::time::Duration,
    ) -> std::result::Result<Option<Option<O>>, Stall> {
        let receiver = match &mut self.source {
            Source::Own { iterator, next } => {
                while let Some(batch) = iterator.next() {
                    let index = *next;
                    *next += 1;
                    // Whoever's batch it is: one device stops at it, so does every rank.
                    let batch = batch.map_err(|error| Stall::Broken(unreadable(index, &error)))?;
                    if index % self.world_size == self.rank {
                        self.progress = iterator.progress();
                        self.index = Some(index);
                        return Ok(Some(Some(batch)));
                    }
                }
                return Ok(None);
            }
            Source::Dealt(None) => return Ok(None),
            Source::Dealt(Some(receiver)) => receiver,
        };
        // `None`: no bound (a timeout past what an `Instant` holds).
        let deadline = std::time::Instant::now().checked_add(timeout);
        let dealt = loop {
            if let Some(why) = give_up() {
                return Err(Stall::GivenUp(why));
            }
            let left = deadline.map_or(POLL, |d| {
                d.saturating_duration_since(std::time::Instant::now())
            });
            match receiver.recv_timeout(POLL.min(left)) {
                Ok(message) => break message,
                Err(RecvTimeoutError::Disconnected) => return Ok(None),
                Err(RecvTimeoutError::Timeout) if left.is_zero() => {
                    return Err(Stall::TimedOut(timeout));
                }
                Err(RecvTimeoutError::Timeout) => {}
            }
        };
        let dealt = dealt.map_err(Stall::Broken)?;
        self.progress = dealt.progress;
        self.index = Some(dealt.index);
        self.step = dealt.step;
        Ok(Some(dealt.batch))
    }
}

#[cfg(test)]
impl<O> Iterator for Batches<'_, O> {
    type Item = O;

    /// [`next_within`](Self::next_within) without a check or a bound.
    fn next(&mut self) -> Option<O> {
        self.next_within(&|| None, std::time::Duration::MAX)
            .ok()
            .flatten()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::data::dataloader::DataLoaderBuilder;
    use burn::data::dataloader::batcher::Batcher;
    use burn::data::dataset::{Dataset, DatasetError, InMemDataset};

    #[derive(Clone)]
    struct Items;

    impl Batcher<usize, Vec<usize>> for Items {
        fn batch(&self, items: Vec<usize>, _: &Device) -> Vec<usize> {
            items
        }
    }

    fn device() -> Device {
        Device::flex()
    }

    /// One device's passes over `loader`: as Burn's single-device strategy makes them.
    fn one_device(loader: &Arc<dyn DataLoader<Vec<usize>>>, passes: usize) -> Vec<Vec<Vec<usize>>> {
        let copy = loader.to_device(&device());
        (0..passes)
            .map(|_| copy.iter().map(|batch| batch.unwrap()).collect())
            .collect()
    }

    fn shuffled(items: usize, batch: usize) -> Arc<dyn DataLoader<Vec<usize>>> {
        DataLoaderBuilder::new(Items)
            .batch_size(batch)
            .shuffle(5)
            .build(InMemDataset::new((0..items).collect()))
    }

    #[test]
    fn thread_ranks_take_one_devices_batches_of_a_shuffled_burn_loader_in_its_order() {
        let expected = one_device(&shuffled(10, 4), 3);
        let dealer = Dealer::new(&shuffled(10, 4), &device(), 2, vec![0, 1]);
        for pass in &expected {
            let (mut zero, mut one) = (dealer.take(0), dealer.take(1));
            // Rank 1 reads first: the pass is shared, whoever starts it.
            let one: Vec<(usize, Vec<usize>)> =
                std::iter::from_fn(|| one.next().map(|b| (one.index().unwrap(), b))).collect();
            let zero: Vec<(usize, Vec<usize>)> =
                std::iter::from_fn(|| zero.next().map(|b| (zero.index().unwrap(), b))).collect();
            let mut all: Vec<(usize, Vec<usize>)> = zero.iter().chain(&one).cloned().collect();
            all.sort();
            assert!(zero.iter().all(|(i, _)| i % 2 == 0) && one.iter().all(|(i, _)| i % 2 == 1));
            assert_eq!(all.into_iter().map(|(_, b)| b).collect::<Vec<_>>(), *pass);
        }
        // The passes differ from one another, as one device's epochs do.
        assert_ne!(expected[0], expected[1]);
    }

    #[test]
    fn each_rank_learns_its_steps_samples_and_one_devices_progress_after_the_step() {
        // 10 items in batches of 4 over 2 ranks: step 0 is batches 0 and 1 (8 items), step 1
        // batch 2 (2 items) for rank 0 and nothing for rank 1.
        let dealer = Dealer::new(&shuffled(10, 4), &device(), 2, vec![0, 1]);
        let (mut zero, mut one) = (dealer.take(0), dealer.take(1));
        let steps = |batches: &mut Batches<'_, Vec<usize>>| {
            std::iter::from_fn(|| {
                let batch = batches
                    .next_step_within(&|| None, std::time::Duration::from_secs(10))
                    .unwrap()?;
                Some((batch.map(|b| b.len()), batches.step()))
            })
            .collect::<Vec<_>>()
        };
        let (zero, one) = (steps(&mut zero), steps(&mut one));
        let shape = |s: &Step| (s.number, s.samples, s.global_samples, s.items_after, s.last);
        assert_eq!(
            zero.iter().map(|(b, s)| (*b, shape(s))).collect::<Vec<_>>(),
            vec![
                (Some(4), (0, 4, 8, 8, false)),
                (Some(2), (1, 2, 2, 10, true))
            ]
        );
        assert_eq!(
            one.iter().map(|(b, s)| (*b, shape(s))).collect::<Vec<_>>(),
            vec![(Some(4), (0, 4, 8, 8, false)), (None, (1, 0, 2, 10, true))]
        );
        assert!(zero.iter().chain(&one).all(|(_, s)| s.full_samples == 8));
    }

    #[test]
    fn a_process_keeps_its_ranks_batches_and_one_devices_progress() {
        let expected = one_device(&shuffled(10, 3), 1).remove(0);
        // Rank 1 of 3, alone in its process.
        let dealer = Dealer::new(&shuffled(10, 3), &device(), 3, vec![1]);
        let mut batches = dealer.take(1);
        let first = batches.next();
        assert_eq!(first.as_ref(), Some(&expected[1]));
        assert_eq!(batches.progress().items_processed, 6);
        assert_eq!(batches.progress().items_total, 10);
        // 4 batches: rank 1 of 3 has batch 1 only.
        assert_eq!(batches.next(), None);
    }

    #[test]
    fn a_rank_that_stops_reading_leaves_the_others_their_batches() {
        let expected = one_device(&shuffled(12, 2), 1).remove(0);
        let dealer = Dealer::new(&shuffled(12, 2), &device(), 2, vec![0, 1]);
        let mut zero = dealer.take(0);
        let one = dealer.take(1);
        drop(one);
        let taken: Vec<Vec<usize>> = std::iter::from_fn(|| zero.next()).collect();
        let evens: Vec<Vec<usize>> = expected.into_iter().step_by(2).collect();
        assert_eq!(taken, evens);
    }

    #[derive(Clone)]
    struct Panicking;

    impl Batcher<usize, Vec<usize>> for Panicking {
        fn batch(&self, items: Vec<usize>, _: &Device) -> Vec<usize> {
            assert!(!items.contains(&5), "item 5 cannot be batched");
            items
        }
    }

    #[test]
    fn a_loader_that_panics_fails_the_rank_reading_the_pass_not_a_short_pass() {
        let loader: Arc<dyn DataLoader<Vec<usize>>> = DataLoaderBuilder::new(Panicking)
            .batch_size(2)
            .build(InMemDataset::new((0..8).collect()));
        // Alone in its process the rank reads the pass itself: the panic unwinds there.
        let dealer = Dealer::new(&loader, &device(), 1, vec![0]);
        let mut batches = dealer.take(0);
        assert_eq!(batches.next(), Some(vec![0, 1]));
        assert_eq!(batches.next(), Some(vec![2, 3]));
        let failed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| batches.next()));
        let message = crate::error::panic_message(failed.unwrap_err().as_ref());
        assert!(message.contains("item 5 cannot be batched"), "{message}");
        // Two ranks of the process: the pass's thread catches it, and the rank reading the
        // pass gets it as its error, not a short pass.
        let dealer = Dealer::new(&loader, &device(), 2, vec![0, 1]);
        let (mut zero, _one) = (dealer.take(0), dealer.take(1));
        let wait = std::time::Duration::from_secs(10);
        let stall = loop {
            match zero.next_within(&|| None, wait) {
                Ok(Some(_)) => {}
                Ok(None) => panic!("the pass ended short instead of failing"),
                Err(stall) => break stall,
            }
        };
        match stall {
            Stall::Broken(failure) => {
                assert!(failure.contains("item 5 cannot be batched"), "{failure}");
                match Stall::Broken(failure).into_error(0, "training") {
                    crate::error::DdpError::WorkerPanicked { rank: 0, message } => {
                        assert!(
                            message.contains("training loader's pass failed"),
                            "{message}"
                        )
                    }
                    other => panic!("expected WorkerPanicked, got {other:?}"),
                }
            }
            other => panic!("expected the broken pass, got {other:?}"),
        }
    }

    #[test]
    fn a_rank_of_another_process_takes_nothing_here() {
        let dealer = Dealer::new(&shuffled(4, 2), &device(), 2, vec![0]);
        assert_eq!(dealer.take(1).count(), 0);
    }

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

    impl Dataset<usize> for Failing {
        fn get(&self, index: usize) -> std::result::Result<usize, DatasetError> {
            if index == self.fail {
                Err(DatasetError::new(ReadError))
            } else {
                Ok(index)
            }
        }

        fn len(&self) -> usize {
            self.len
        }
    }

    #[test]
    fn a_batch_that_cannot_be_read_breaks_the_pass_there_for_every_rank() {
        // 12 items in batches of 2, item 7 unreadable: batch 3 fails. One device reads batches
        // 0 to 2 and stops at 3; so do the ranks, dealt or reading the pass themselves.
        let loader = || -> Arc<dyn DataLoader<Vec<usize>>> {
            DataLoaderBuilder::new(Items)
                .batch_size(2)
                .build(Failing { len: 12, fail: 7 })
        };
        let read_until_stall = |batches: &mut Batches<'_, Vec<usize>>| {
            let mut read = Vec::new();
            loop {
                match batches.next_within(&|| None, std::time::Duration::from_secs(10)) {
                    Ok(Some(batch)) => read.push(batch),
                    Ok(None) => panic!("the pass ended after {read:?} instead of failing"),
                    Err(Stall::Broken(failure)) => return (read, failure),
                    Err(other) => panic!("expected the broken pass, got {other:?}"),
                }
            }
        };
        // Two thread ranks: steps 0 (batches 0, 1) and 1 (batch 2, then 3 fails: the step is
        // handed out with batch 2 for rank 0 and none for rank 1, then the failure).
        let dealer = Dealer::new(&loader(), &device(), 2, vec![0, 1]);
        let (mut zero, mut one) = (dealer.take(0), dealer.take(1));
        let (zero, failure) = read_until_stall(&mut zero);
        assert_eq!(zero, vec![vec![0, 1], vec![4, 5]]);
        assert!(
            failure.contains("batch 3") && failure.contains("the disk said no"),
            "{failure}"
        );
        let (one, failure) = read_until_stall(&mut one);
        assert_eq!(one, vec![vec![2, 3]]);
        assert!(failure.contains("batch 3"), "{failure}");
        // A rank alone in its process, whose batches are 1 and 3: it fails at batch 3 too, and
        // rank 0 of 2 (batches 0 and 2) at the same batch, though it is not its own.
        for (rank, expected) in [(1, vec![vec![2, 3]]), (0, vec![vec![0, 1], vec![4, 5]])] {
            let dealer = Dealer::new(&loader(), &device(), 2, vec![rank]);
            let mut batches = dealer.take(rank);
            let (read, failure) = read_until_stall(&mut batches);
            assert_eq!(read, expected, "rank {rank}");
            assert!(failure.contains("batch 3"), "rank {rank}: {failure}");
        }
    }
}
