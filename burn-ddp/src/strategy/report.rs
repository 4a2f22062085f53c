//! What burn-train's renderer, metric loggers and metrics see: **one item per step**, the
//! replicas' outputs of that step joined into the output of the global batch
//! ([`DistributedOutput`](crate::outputs::DistributedOutput)), with a monotone iteration number,
//! in thread and in process mode alike; and validation **sharded** across the ranks, its outputs
//! joined the same way, so rank 0's metrics are those of single-device validation on the whole
//! set.
//!
//! How the outputs reach rank 0: ranks that are threads of one process send them through a
//! channel as they are produced; ranks that are processes keep them and send them together every
//! [`DdpConfig::with_metrics_every`](crate::DdpConfig::with_metrics_every) steps and at the end of
//! the epoch (two all-gathers: the lengths, then the encoded outputs), so a step stays one
//! collective. Without a codec for the output type (not one of burn-train's outputs), threads
//! report every replica's item on its own and processes only rank 0's, and validation runs on rank
//! 0 alone.

use std::collections::BTreeMap;
use std::sync::mpsc::RecvTimeoutError;
use std::time::Instant;

use burn::data::dataloader::Progress;
use burn::module::AutodiffModule;
use burn::tensor::backend::AutodiffBackend;
use burn::train::{
    EventProcessorTraining, InferenceStep, LearnerEvent, LearningComponentsTypes, TrainingBackend,
    TrainingItem, ValidLoader,
};

use super::validation::validate;
use super::worker::{Leader, ModelOutput, Role, Worker};
use crate::outputs::{Codec, codec};
use crate::{DdpError, Result};

/// The backend of validation (the training backend without autodiff).
pub(super) type InnerBackend<LC> = <TrainingBackend<LC> as AutodiffBackend>::InnerBackend;
/// The output of a validation step.
pub(super) type ValidOutput<LC> =
    <<LC as LearningComponentsTypes>::InferenceModel as InferenceStep>::Output;

/// A rank's output of one step, sent to rank 0 by a rank that is a thread of the same process.
pub(super) enum Part<LC: LearningComponentsTypes> {
    /// Training step `step` of the epoch; `None`: the rank had no batch (join mode).
    Train {
        rank: usize,
        step: usize,
        output: Option<ModelOutput<LC>>,
    },
    /// Validation step `step` of the rank's shard.
    Valid {
        rank: usize,
        step: usize,
        output: ValidOutput<LC>,
    },
    /// The rank validated its whole shard.
    ValidDone { rank: usize },
}

/// What rank 0 knows of a training step besides the outputs: its own progress and learning rate.
struct Meta {
    progress: Progress,
    lr: Option<f64>,
}

/// Per step, per rank: `None` while the rank's part has not arrived, then its output (`None`: no
/// batch).
type Slots<T> = BTreeMap<usize, Vec<Option<Option<T>>>>;

/// One rank's reporting state (see the [module docs](self)).
pub(super) struct Reports<LC: LearningComponentsTypes> {
    /// The job's ranks are threads of this process.
    pub threads: bool,
    /// Process mode: steps between two sends of the outputs to rank 0.
    pub metrics_every: usize,
    /// This rank's shard of the validation set (sharded validation), on its device.
    pub valid_shard: Option<ValidLoader<LC>>,
    /// Items of the whole validation set.
    pub valid_items: usize,
    train_codec: Option<Codec<ModelOutput<LC>, TrainingBackend<LC>>>,
    valid_codec: Option<Codec<ValidOutput<LC>, InnerBackend<LC>>>,
    train: Slots<ModelOutput<LC>>,
    meta: BTreeMap<usize, Meta>,
    /// The next step rank 0 reports.
    next: usize,
    /// Steps this rank reported this epoch.
    steps: usize,
    /// Ranks of the job.
    world_size: usize,
    /// Validation parts that arrived while rank 0 was still collecting training parts (a rank
    /// that finished its steps validates at once).
    stash: std::collections::VecDeque<Part<LC>>,
    /// Rank 0's latest epoch progress (for other ranks' items reported on their own).
    last_progress: Option<Progress>,
}

impl<LC: LearningComponentsTypes> Reports<LC>
where
    ModelOutput<LC>: 'static,
    ValidOutput<LC>: 'static,
{
    /// The reporting of a job whose ranks are threads of one process (`threads`) or processes.
    pub fn new(threads: bool, metrics_every: usize, world_size: usize) -> Self {
        Self {
            threads,
            metrics_every: metrics_every.max(1),
            valid_shard: None,
            valid_items: 0,
            train_codec: codec::<ModelOutput<LC>, TrainingBackend<LC>>(),
            valid_codec: codec::<ValidOutput<LC>, InnerBackend<LC>>(),
            train: BTreeMap::new(),
            meta: BTreeMap::new(),
            next: 0,
            steps: 0,
            world_size,
            stash: std::collections::VecDeque::new(),
            last_progress: None,
        }
    }

    /// Whether validation can be sharded (the validation output type has a codec).
    pub fn can_shard_validation(&self) -> bool {
        self.valid_codec.is_some()
    }

    /// Whether training items can be joined (the training output type has a codec).
    pub fn joins_training(&self) -> bool {
        self.train_codec.is_some()
    }
}

impl<LC: LearningComponentsTypes + Send + 'static> Worker<LC>
where
    ModelOutput<LC>: 'static,
    ValidOutput<LC>: 'static,
{
    /// A new epoch's reporting, from step `first` (the batches a resumed run skips).
    pub(super) fn start_reports(&mut self, first: usize) {
        let reports = &mut self.reports;
        reports.stash.clear();
        reports.train.clear();
        reports.meta.clear();
        reports.next = first;
        reports.steps = first;
    }

    /// Reports this rank's output of training step `step` (0-based within the epoch; `None`: no
    /// batch), with its `progress` (over all ranks) and learning rate.
    ///
    /// # Errors
    /// Process mode, every `metrics_every` steps: the all-gathers' errors.
    pub(super) fn report_train(
        &mut self,
        step: usize,
        output: Option<ModelOutput<LC>>,
        progress: Progress,
        progress_global: &Progress,
    ) -> Result<()> {
        self.reports.steps = step + 1;
        let lr = Some(self.learner.lr_current());
        let world_size = self.group.world_size();
        let rank = self.rank;
        let joined = self.reports.train_codec.is_some();
        match &mut self.role {
            Role::Follower(sender) => {
                // Rank 0 only stops listening when training ends; a failed send means it is
                // gone, which the next collective reports.
                let _ = sender.send(Part::Train { rank, step, output });
                return Ok(());
            }
            Role::Leader(leader) if !joined => {
                // No codec: every replica's item on its own (threads), or rank 0's (processes).
                self.reports.last_progress = Some(progress.clone());
                if let Some(output) = output {
                    let item = TrainingItem::new(
                        output,
                        progress,
                        progress_global.clone(),
                        Some(step + 1),
                        lr,
                    );
                    leader
                        .event_processor
                        .process_train(LearnerEvent::ProcessedItem(item));
                }
                drain_unjoined(leader, &mut self.reports, progress_global);
                return Ok(());
            }
            Role::Silent(_) if !joined => return Ok(()),
            Role::Leader(_) => {
                self.reports.meta.insert(step, Meta { progress, lr });
            }
            Role::Silent(_) => {}
        }
        let slots = self
            .reports
            .train
            .entry(step)
            .or_insert_with(|| (0..world_size).map(|_| None).collect());
        slots[rank] = Some(output);
        if self.reports.threads {
            if let Role::Leader(leader) = &mut self.role {
                drain_parts(leader, &mut self.reports, None)?;
                emit_ready(leader, &mut self.reports, progress_global, &self.device);
            }
            Ok(())
        } else if (step + 1).is_multiple_of(self.reports.metrics_every) {
            self.gather_train(progress_global)
        } else {
            Ok(())
        }
    }

    /// The end of an epoch's training steps: rank 0 reports every step the ranks trained
    /// (waiting for the parts of threads still on their way; gathering those of processes).
    ///
    /// # Errors
    /// Process mode: the all-gathers' errors; thread mode: a rank whose part does not arrive
    /// within the timeout ([`DdpError::Unresponsive`]).
    pub(super) fn finish_train_reports(&mut self, progress_global: &Progress) -> Result<()> {
        if self.reports.train_codec.is_none() {
            if let Role::Leader(leader) = &mut self.role {
                drain_unjoined(leader, &mut self.reports, progress_global);
            }
            return Ok(());
        }
        if !self.reports.threads {
            return self.gather_train(progress_global);
        }
        let timeout = self.config.timeout();
        let steps = self.reports.steps;
        let Role::Leader(leader) = &mut self.role else {
            return Ok(());
        };
        let deadline = Instant::now() + timeout;
        loop {
            emit_ready(leader, &mut self.reports, progress_global, &self.device);
            if self.reports.next >= steps {
                return Ok(());
            }
            drain_parts(leader, &mut self.reports, Some(deadline))?;
        }
    }

    /// Process mode: sends this rank's pending training outputs to rank 0 (every rank calls it
    /// at the same steps), which reports the steps now complete.
    fn gather_train(&mut self, progress_global: &Progress) -> Result<()> {
        let Some(codec) = self.reports.train_codec else {
            return Ok(());
        };
        let rank = self.rank;
        let leader = matches!(self.role, Role::Leader(_));
        // Rank 0 keeps its own outputs; the others send theirs.
        let mine: Vec<(usize, Option<ModelOutput<LC>>)> = if leader {
            Vec::new()
        } else {
            std::mem::take(&mut self.reports.train)
                .into_iter()
                .map(|(step, mut slots)| (step, slots[rank].take().flatten()))
                .collect()
        };
        let mut words = Vec::new();
        for (step, output) in &mine {
            encode_entry(&mut words, *step, output.as_ref(), codec.encode);
        }
        let all = gather_words(self.group.as_ref(), words, self.config.timeout())?;
        let Role::Leader(leader) = &mut self.role else {
            return Ok(());
        };
        for (from, words) in all.iter().enumerate().filter(|(r, _)| *r != rank) {
            let mut rest = words.as_slice();
            while !rest.is_empty() {
                let (step, output) = decode_entry(&mut rest, codec.decode, &self.device)
                    .map_err(|detail| bad_words(rank, from, detail))?;
                let world_size = all.len();
                let slots = self
                    .reports
                    .train
                    .entry(step)
                    .or_insert_with(|| (0..world_size).map(|_| None).collect());
                slots[from] = Some(output);
            }
        }
        emit_ready(leader, &mut self.reports, progress_global, &self.device);
        Ok(())
    }

    /// Validation at the end of an epoch: sharded across the ranks when the output type has a
    /// codec and the configuration asks for it (every rank validates its shard, rank 0 reports
    /// the joined outputs), else on rank 0 alone over the whole set. Ends with burn-train's
    /// `EndEpoch` validation event on rank 0.
    ///
    /// # Errors
    /// The collectives' errors (process mode); a thread rank whose shard does not arrive within
    /// the timeout.
    pub(super) fn validate_epoch(&mut self, progress_global: &Progress) -> Result<()> {
        let epoch = progress_global.items_processed;
        let (Some(shard), Some(codec)) =
            (self.reports.valid_shard.clone(), self.reports.valid_codec)
        else {
            if let Role::Leader(leader) = &mut self.role {
                validate::<LC>(&self.learner, leader, progress_global, &self.interrupter);
            }
            return Ok(());
        };
        let rank = self.rank;
        let world_size = self.group.world_size();
        // This rank's shard.
        let model = self.learner.model().valid();
        // Kept here (rank 0, and every rank in process mode) or sent at once (threads).
        let mut outputs: Vec<ValidOutput<LC>> = Vec::new();
        for (step, item) in shard.iter().enumerate() {
            let output = InferenceStep::step(&model, item);
            match &self.role {
                Role::Follower(sender) => {
                    let _ = sender.send(Part::Valid { rank, step, output });
                }
                _ => outputs.push(output),
            }
            if self.interrupter.should_stop() {
                break;
            }
        }
        // Every rank's outputs, per validation step, in rank order.
        let mut joined: Slots<ValidOutput<LC>> = BTreeMap::new();
        let put = |joined: &mut Slots<ValidOutput<LC>>, from: usize, step: usize, output| {
            let slots = joined
                .entry(step)
                .or_insert_with(|| (0..world_size).map(|_| None).collect());
            slots[from] = Some(Some(output));
        };
        if self.reports.threads {
            match &mut self.role {
                Role::Follower(sender) => {
                    let _ = sender.send(Part::ValidDone { rank });
                    return Ok(());
                }
                Role::Leader(leader) => {
                    for (step, output) in outputs.into_iter().enumerate() {
                        put(&mut joined, rank, step, output);
                    }
                    // The other ranks validate at the same time; each says when it is done.
                    let deadline = Instant::now() + self.config.timeout();
                    let mut done = std::collections::BTreeSet::from([rank]);
                    while done.len() < world_size {
                        let next = match self.reports.stash.pop_front() {
                            Some(part) => Ok(part),
                            None => recv_until(leader, deadline),
                        };
                        match next {
                            Ok(Part::Valid { rank, step, output }) => {
                                put(&mut joined, rank, step, output)
                            }
                            Ok(Part::ValidDone { rank }) => {
                                done.insert(rank);
                            }
                            Ok(Part::Train { rank, step, output }) => {
                                insert_train(&mut self.reports, world_size, rank, step, output)
                            }
                            Err(waited) => {
                                return Err(DdpError::Unresponsive {
                                    rank: (0..world_size).find(|r| !done.contains(r)).unwrap_or(0),
                                    waited,
                                });
                            }
                        }
                    }
                }
                Role::Silent(_) => {}
            }
        } else {
            let mut words = Vec::new();
            if !matches!(self.role, Role::Leader(_)) {
                for (step, output) in outputs.iter().enumerate() {
                    encode_entry(&mut words, step, Some(output), codec.encode);
                }
            }
            let all = gather_words(self.group.as_ref(), words, self.config.timeout())?;
            if !matches!(self.role, Role::Leader(_)) {
                return Ok(());
            }
            let device = self.device.clone();
            for (step, output) in outputs.into_iter().enumerate() {
                put(&mut joined, rank, step, output);
            }
            for (from, words) in all.iter().enumerate().filter(|(r, _)| *r != rank) {
                let mut rest = words.as_slice();
                while !rest.is_empty() {
                    let (step, output) = decode_entry(&mut rest, codec.decode, &device)
                        .map_err(|detail| bad_words(rank, from, detail))?;
                    if let Some(output) = output {
                        put(&mut joined, from, step, output);
                    }
                }
            }
        }
        let Role::Leader(leader) = &mut self.role else {
            return Ok(());
        };
        let device = self.device.clone();
        let total = self.reports.valid_items;
        let mut done = 0;
        for (step, slots) in joined {
            let parts: Vec<ValidOutput<LC>> = slots.into_iter().flatten().flatten().collect();
            if parts.is_empty() {
                continue;
            }
            let output = (codec.join)(parts, &device);
            done += (codec.samples)(&output);
            let item = TrainingItem::new(
                output,
                Progress::new(done.min(total), total),
                progress_global.clone(),
                Some(step + 1),
                None,
            );
            leader
                .event_processor
                .process_valid(LearnerEvent::ProcessedItem(item));
        }
        leader
            .event_processor
            .process_valid(LearnerEvent::EndEpoch(epoch));
        Ok(())
    }
}

/// No codec (thread mode): the other ranks' items, each on its own, as they arrived, with rank
/// 0's latest progress; validation parts of ranks already done training are kept for
/// [`Worker::validate_epoch`].
fn drain_unjoined<LC: LearningComponentsTypes>(
    leader: &mut Leader<LC>,
    reports: &mut Reports<LC>,
    progress_global: &Progress,
) {
    while let Ok(part) = leader.items.try_recv() {
        let (step, output) = match part {
            Part::Train { step, output, .. } => (step, output),
            other => {
                reports.stash.push_back(other);
                continue;
            }
        };
        if let Some(output) = output {
            let item = TrainingItem::new(
                output,
                reports
                    .last_progress
                    .clone()
                    .unwrap_or_else(|| Progress::new(0, 0)),
                progress_global.clone(),
                Some(step + 1),
                None,
            );
            leader
                .event_processor
                .process_train(LearnerEvent::ProcessedItem(item));
        }
    }
}

/// Files a training part under its step and rank.
fn insert_train<LC: LearningComponentsTypes>(
    reports: &mut Reports<LC>,
    world_size: usize,
    rank: usize,
    step: usize,
    output: Option<ModelOutput<LC>>,
) {
    let slots = reports
        .train
        .entry(step)
        .or_insert_with(|| (0..world_size).map(|_| None).collect());
    if let Some(slot) = slots.get_mut(rank) {
        *slot = Some(output);
    }
}

/// The next part from the ranks that are threads, waiting until `deadline`; `Err(waited)` when
/// none came (or every sender is gone).
fn recv_until<LC: LearningComponentsTypes>(
    leader: &mut Leader<LC>,
    deadline: Instant,
) -> std::result::Result<Part<LC>, std::time::Duration> {
    let started = Instant::now();
    match leader
        .items
        .recv_timeout(deadline.saturating_duration_since(Instant::now()))
    {
        Ok(part) => Ok(part),
        Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => Err(started.elapsed()),
    }
}

/// Files the parts that arrived (thread mode); with a `deadline`, waits for at least one.
fn drain_parts<LC: LearningComponentsTypes>(
    leader: &mut Leader<LC>,
    reports: &mut Reports<LC>,
    deadline: Option<Instant>,
) -> Result<()> {
    let world_size = reports.world_size;
    if let Some(deadline) = deadline {
        match recv_until(leader, deadline) {
            Ok(Part::Train { rank, step, output }) => {
                insert_train(reports, world_size, rank, step, output)
            }
            Ok(other) => reports.stash.push_back(other),
            Err(waited) => {
                // The first rank whose part of the next step is missing.
                let missing = reports
                    .train
                    .get(&reports.next)
                    .and_then(|slots| slots.iter().position(Option::is_none))
                    .unwrap_or(0);
                return Err(DdpError::Unresponsive {
                    rank: missing,
                    waited,
                });
            }
        }
    }
    while let Ok(part) = leader.items.try_recv() {
        match part {
            Part::Train { rank, step, output } => {
                insert_train(reports, world_size, rank, step, output)
            }
            other => reports.stash.push_back(other),
        }
    }
    Ok(())
}

/// Rank 0 reports the steps whose parts are all there, in order: one joined item each.
fn emit_ready<LC: LearningComponentsTypes>(
    leader: &mut Leader<LC>,
    reports: &mut Reports<LC>,
    progress_global: &Progress,
    device: &burn::tensor::Device<TrainingBackend<LC>>,
) where
    ModelOutput<LC>: 'static,
{
    let Some(codec) = reports.train_codec else {
        return;
    };
    while let Some(slots) = reports.train.get(&reports.next) {
        if slots.iter().any(Option::is_none) {
            return;
        }
        let step = reports.next;
        reports.next += 1;
        let slots = reports.train.remove(&step).unwrap_or_default();
        let meta = reports.meta.remove(&step);
        let parts: Vec<ModelOutput<LC>> = slots.into_iter().flatten().flatten().collect();
        let (Some(meta), false) = (meta, parts.is_empty()) else {
            continue;
        };
        let output = (codec.join)(parts, device);
        let item = TrainingItem::new(
            output,
            meta.progress,
            progress_global.clone(),
            Some(step + 1),
            meta.lr,
        );
        leader
            .event_processor
            .process_train(LearnerEvent::ProcessedItem(item));
    }
}

/// One entry of the words a rank sends: `[step, present, length, words of the output...]`.
fn encode_entry<T>(
    words: &mut Vec<u64>,
    step: usize,
    output: Option<&T>,
    encode: fn(&T, &mut Vec<u64>),
) {
    words.push(step as u64);
    match output {
        Some(output) => {
            words.push(1);
            let at = words.len();
            words.push(0);
            encode(output, words);
            words[at] = (words.len() - at - 1) as u64;
        }
        None => {
            words.push(0);
            words.push(0);
        }
    }
}

/// The entry [`encode_entry`] wrote at the front of `words`.
fn decode_entry<T, D>(
    words: &mut &[u64],
    decode: fn(&mut &[u64], &D) -> std::result::Result<T, String>,
    device: &D,
) -> std::result::Result<(usize, Option<T>), String> {
    let [step, present, length] = match words {
        [a, b, c, ..] => [*a, *b, *c],
        _ => return Err("an entry header is cut short".into()),
    };
    let rest = &words[3..];
    let length = length as usize;
    if rest.len() < length {
        return Err(format!("an entry of {length} words, {} left", rest.len()));
    }
    let (mut body, after) = rest.split_at(length);
    *words = after;
    let output = if present != 0 {
        let output = decode(&mut body, device)?;
        if !body.is_empty() {
            return Err(format!("{} words left after an output", body.len()));
        }
        Some(output)
    } else {
        None
    };
    Ok((step as usize, output))
}

/// Every rank's `words` (of any length), in rank order: two all-gathers (the lengths, then the
/// words padded to the longest).
fn gather_words(
    group: &dyn crate::group::ProcessGroup,
    words: Vec<u64>,
    timeout: std::time::Duration,
) -> Result<Vec<Vec<u64>>> {
    let lengths = group.all_gather(&[words.len() as u64], timeout)?;
    let longest = lengths.iter().copied().max().unwrap_or(0) as usize;
    if longest == 0 {
        return Ok(vec![Vec::new(); lengths.len()]);
    }
    let mut padded = words;
    padded.resize(longest, 0);
    let all = group.all_gather(&padded, timeout)?;
    Ok(all
        .chunks(longest)
        .zip(&lengths)
        .map(|(chunk, &len)| chunk[..len as usize].to_vec())
        .collect())
}

fn bad_words(rank: usize, from: usize, detail: String) -> DdpError {
    DdpError::Bucket {
        rank,
        bucket: 0,
        detail: format!(
            "the step outputs rank {from} sent for the metrics cannot be read: {detail}"
        ),
    }
}
