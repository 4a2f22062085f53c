//! Per-rank timing and communication counters (the figures PyTorch DDP's logging reports), the
//! training report, and burn-train renderer and logger wrappers that keep them to the main
//! process.
//!
//! Times are wall-clock durations measured on the rank's thread. On asynchronous devices (CUDA)
//! a phase's time includes waiting for the device work queued before it.

use burn::train::logger::{EvaluationProgressLogger, MetricLogger, TrainingProgressLogger};
use burn::train::metric::store::{EpochSummary, MetricsUpdate, Split};
use burn::train::metric::{MetricDefinition, NumericEntry};
use burn::train::renderer::{
    EvaluationName, MetricState, MetricsRenderer, MetricsRendererEvaluation,
    MetricsRendererTraining,
};
use std::fmt;
use std::time::Duration;

/// Communication counters of one rank's [`Reducer`](crate::mechanism::Reducer).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CommStats {
    /// Gradient synchronisations (optimizer steps).
    pub steps: u64,
    /// Buckets all-reduced.
    pub buckets: u64,
    /// Bytes all-reduced by this rank (bucket sizes, `f32`, presence flags included).
    pub bytes: usize,
    /// Time spent flattening gradients into buckets.
    pub flatten: Duration,
    /// Time spent in all-reduce calls, including waiting for slower ranks.
    pub all_reduce: Duration,
    /// Time spent splitting buckets back into gradients.
    pub unflatten: Duration,
    /// Buckets sent as `f32` despite gradient compression, because their values spanned more
    /// than the 16-bit format's range (a bucket is scaled by one power of two, so values more
    /// than the format's normal range apart cannot all be kept).
    pub uncompressed_buckets: u64,
    /// Steps at which the trainable tensors changed on every rank (a layer frozen or unfrozen)
    /// and the buckets were rebuilt.
    pub layout_changes: u64,
    /// Moves of gradient data from the device to the host: on the host groups (threads, TCP,
    /// MPI) one per gradient on Burn's CPU backends (a copy in memory) and one per bucket on
    /// every other backend (wgpu: the bucket concatenated on the device); with NCCL none but
    /// one small read of the flags and checks per phase.
    pub transfers_to_host: u64,
    /// Moves of gradient data from the host to the device (as [`transfers_to_host`]).
    ///
    /// [`transfers_to_host`]: Self::transfers_to_host
    pub transfers_to_device: u64,
    /// Reductions through host buckets, all-reduced (the CPU process groups, and thread
    /// replicas that cannot share tensors): one per gradient synchronisation, two at a step
    /// whose trainable tensors changed (the tensors trained since go in a second reduction),
    /// the end-of-data check included. Which path ran, so that a test can say which it tested.
    pub host_phases: u64,
    /// Reductions reduce-scattered by owner, each rank keeping its own gradients
    /// ([`DdpConfig::with_gradient_sharding`](crate::DdpConfig::with_gradient_sharding)), counted
    /// as [`host_phases`](Self::host_phases).
    pub scattered_phases: u64,
    /// Reductions of device buckets (a group that reduces device tensors: NCCL), counted as
    /// [`host_phases`](Self::host_phases).
    pub device_phases: u64,
    /// Reductions of tensors shared by reference between thread replicas on one device
    /// ([`DdpConfig::with_shared_memory_reduction`](crate::DdpConfig::with_shared_memory_reduction)),
    /// counted as [`host_phases`](Self::host_phases).
    pub shared_phases: u64,
}

impl CommStats {
    /// Transfers to the host and to the device per step, averaged over [`steps`](Self::steps)
    /// (`(0, 0)` before the first step).
    pub fn transfers_per_step(&self) -> (f64, f64) {
        let steps = self.steps.max(1) as f64;
        (
            self.transfers_to_host as f64 / steps,
            self.transfers_to_device as f64 / steps,
        )
    }

    /// Total time in gradient synchronisation: flatten + all-reduce + unflatten.
    pub fn total(&self) -> Duration {
        self.flatten + self.all_reduce + self.unflatten
    }
}

/// The distribution of one rank's gradient synchronisation times (the reduction of a step,
/// waiting for the slowest rank included): what "communication latency" means in PyTorch's
/// monitoring advice. Quantiles are read from a histogram with eight buckets per doubling, so
/// they are at most 9% above the true value (for times above 10 µs).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SyncTimes {
    /// Synchronisations measured.
    pub count: u64,
    /// Median time.
    pub median: Duration,
    /// 90th percentile.
    pub p90: Duration,
    /// Longest.
    pub max: Duration,
    /// Synchronisations that took more than `spike_factor` times the median of the previous 64
    /// (after 8): congestion, or a rank that arrived late. The first three are logged as
    /// warnings naming the rank and the step.
    pub spikes: u64,
    /// The factor ([`DdpConfig::with_spike_factor`](crate::DdpConfig::with_spike_factor)).
    pub spike_factor: f64,
}

/// What one rank did during a training run.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RankReport {
    /// The rank.
    pub rank: usize,
    /// Training batches this rank processed (micro-batches with gradient accumulation).
    pub batches: u64,
    /// Time in forward + backward passes (`TrainStep::step`).
    pub compute: Duration,
    /// Time in the per-step agreement collective of join mode (does every rank still have a
    /// batch?) and in the end-of-data barrier of each epoch, including waiting for slower ranks.
    pub coordination: Duration,
    /// Time in optimizer steps.
    pub optimizer: Duration,
    /// Optimizer steps skipped because the gradients were not finite
    /// ([`NonFinite::SkipStep`](crate::config::NonFinite)).
    pub skipped_steps: u64,
    /// Gradient synchronisation counters.
    pub comm: CommStats,
    /// Collectives this rank issued in its training steps (from the first batch of each epoch
    /// to its last, validation and the end-of-epoch barrier excluded): gradient buckets, buffer
    /// averaging, SyncBatchNorm, checks, the stop votes, and in join mode the per-step agreement
    /// (see [`collectives_per_step`](Self::collectives_per_step)).
    pub step_collectives: u64,
    /// Bytes this rank sent in those collectives, as a bandwidth-optimal algorithm sends them
    /// (nccl-tests' bus bytes: an all-reduce of `S` bytes `2 (N - 1) / N * S`, a reduce-scatter
    /// or all-gather of `S` bytes in all `(N - 1) / N * S`); NCCL's device all-reduces and thread
    /// replicas sharing tensors by reference count none. See
    /// [`bus_bytes_per_step`](Self::bus_bytes_per_step).
    pub step_bus_bytes: u64,
    /// Wall time of this rank's training loops (from the first batch of each epoch to its last;
    /// validation excluded): what [`utilization`](Self::utilization) divides by.
    pub train_time: Duration,
    /// The distribution of this rank's gradient synchronisation times, with its spikes.
    pub sync: SyncTimes,
    /// Peak resident memory of this rank's process, in bytes (Linux `VmHWM`; ranks that are
    /// threads of one process share it); `None` where the system does not tell. Device memory:
    /// [`device_memory`](Self::device_memory).
    pub peak_memory: Option<u64>,
    /// Bytes of this rank's optimizer state at the end of training, with
    /// [`DdpConfig::with_optimizer_sharding`](crate::DdpConfig::with_optimizer_sharding): its
    /// share, the record's entries at full precision (Adam's two moments of each parameter it
    /// owns), as [`optimizer_state_bytes`](crate::mechanism::optimizer_state_bytes) counts them.
    /// `None` without sharding (every rank then holds the whole state, which reading would copy
    /// to the host) and where the optimizer's record is not kept per parameter.
    pub optimizer_state: Option<u64>,
    /// Device memory held by the backend's memory pools on this rank's device at the end of
    /// training, in bytes (CubeCL's reserved bytes; its pools keep what they took, so this is
    /// close to the peak): CUDA devices; `None` on CPU devices. (On Burn 0.22, `None` until the
    /// strategy reads it: CubeCL 0.11's client reports memory otherwise than 0.10's.)
    pub device_memory: Option<u64>,
}

impl RankReport {
    /// Words of [`to_words`](Self::to_words).
    pub(crate) const WORDS: usize = 32;

    /// The report as fixed-length words, for gathering every process's report on rank 0.
    pub(crate) fn to_words(&self) -> Vec<u64> {
        let ns = |d: Duration| d.as_nanos().min(u128::from(u64::MAX)) as u64;
        let c = &self.comm;
        vec![
            self.rank as u64,
            self.batches,
            ns(self.compute),
            ns(self.coordination),
            ns(self.optimizer),
            self.skipped_steps,
            self.step_collectives,
            ns(self.train_time),
            c.steps,
            c.buckets,
            c.bytes as u64,
            ns(c.flatten),
            ns(c.all_reduce),
            ns(c.unflatten),
            c.uncompressed_buckets,
            c.layout_changes,
            self.sync.count,
            ns(self.sync.median),
            ns(self.sync.p90),
            ns(self.sync.max),
            self.sync.spikes,
            self.sync.spike_factor.to_bits(),
            self.peak_memory.unwrap_or(u64::MAX),
            self.optimizer_state.unwrap_or(u64::MAX),
            self.device_memory.unwrap_or(u64::MAX),
            c.transfers_to_host,
            c.transfers_to_device,
            self.step_bus_bytes,
            c.host_phases,
            c.scattered_phases,
            c.device_phases,
            c.shared_phases,
        ]
    }

    /// The report [`to_words`](Self::to_words) wrote; `None` for another number of words.
    pub(crate) fn from_words(w: &[u64]) -> Option<Self> {
        if w.len() != Self::WORDS {
            return None;
        }
        let d = Duration::from_nanos;
        Some(Self {
            rank: w[0] as usize,
            batches: w[1],
            compute: d(w[2]),
            coordination: d(w[3]),
            optimizer: d(w[4]),
            skipped_steps: w[5],
            step_collectives: w[6],
            step_bus_bytes: w[27],
            train_time: d(w[7]),
            comm: CommStats {
                steps: w[8],
                buckets: w[9],
                bytes: w[10] as usize,
                flatten: d(w[11]),
                all_reduce: d(w[12]),
                unflatten: d(w[13]),
                uncompressed_buckets: w[14],
                layout_changes: w[15],
                transfers_to_host: w[25],
                transfers_to_device: w[26],
                host_phases: w[28],
                scattered_phases: w[29],
                device_phases: w[30],
                shared_phases: w[31],
            },
            sync: SyncTimes {
                count: w[16],
                median: d(w[17]),
                p90: d(w[18]),
                max: d(w[19]),
                spikes: w[20],
                spike_factor: f64::from_bits(w[21]),
            },
            peak_memory: (w[22] != u64::MAX).then_some(w[22]),
            optimizer_state: (w[23] != u64::MAX).then_some(w[23]),
            device_memory: (w[24] != u64::MAX).then_some(w[24]),
        })
    }

    /// The share of the training loop this rank spent computing (forward and backward passes),
    /// not waiting for data, communication or the optimizer: 0 to 1 ("above 90% is good").
    pub fn utilization(&self) -> f64 {
        self.compute.as_secs_f64() / self.train_time.as_secs_f64().max(f64::MIN_POSITIVE)
    }

    /// [`step_collectives`](Self::step_collectives) per gradient synchronisation: 1 for a model
    /// whose gradients fit one bucket, without SyncBatchNorm or buffer averaging, in the default
    /// mode (every rank has as many batches: the stop votes ride in the gradient all-reduce), plus
    /// one reduction and one all-gather per epoch at the end of the data. Join mode adds the
    /// per-step agreement; process mode adds two all-gathers of outputs every `metrics_every`
    /// steps.
    pub fn collectives_per_step(&self) -> f64 {
        self.step_collectives as f64 / self.comm.steps.max(1) as f64
    }

    /// [`step_bus_bytes`](Self::step_bus_bytes) per gradient synchronisation: for plain DDP
    /// about `2 (N - 1) / N` times the gradients' bytes; with the optimizer sharded on separate
    /// ranks (gradients reduce-scattered, parameters all-gathered) about `2 (N - 1) / N` times
    /// too, where sharding with an all-reduce moved `3 (N - 1) / N`.
    pub fn bus_bytes_per_step(&self) -> f64 {
        self.step_bus_bytes as f64 / self.comm.steps.max(1) as f64
    }
}

/// Throughput of one training epoch, measured on rank 0 from the first step to the last.
#[derive(Debug, Clone, PartialEq)]
pub struct EpochReport {
    /// Epoch number, 1-based as burn-train counts.
    pub epoch: usize,
    /// Samples trained on, summed over ranks (the global batch times the steps).
    pub samples: u64,
    /// Optimizer steps.
    pub steps: u64,
    /// Wall time of the epoch's training loop (validation excluded).
    pub train_time: Duration,
}

impl EpochReport {
    /// Training throughput in samples per second.
    pub fn samples_per_second(&self) -> f64 {
        self.samples as f64 / self.train_time.as_secs_f64().max(f64::MIN_POSITIVE)
    }
}

/// What a [`DdpStrategy`](crate::DdpStrategy) run did: one entry per epoch and per rank.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TrainingReport {
    /// World size of the run.
    pub world_size: usize,
    /// Per-epoch throughput, in order.
    pub epochs: Vec<EpochReport>,
    /// Per-rank counters, indexed by rank (filled when training ends).
    pub ranks: Vec<RankReport>,
}

/// `bytes` in MiB, for the summary.
fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}

impl fmt::Display for TrainingReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "burn-ddp report, world size {}", self.world_size)?;
        for e in &self.epochs {
            writeln!(
                f,
                "  epoch {}: {} samples in {:.1} s, {:.1} samples/s",
                e.epoch,
                e.samples,
                e.train_time.as_secs_f64(),
                e.samples_per_second()
            )?;
        }
        for r in &self.ranks {
            writeln!(
                f,
                "  rank {}: {} batches, compute {:.2} s, gradient sync {:.2} s (all-reduce {:.2} s, \
                 flatten {:.2} s, unflatten {:.2} s, {:.1} MiB), agreement {:.2} s, optimizer {:.2} s, \
                 {:.2} collectives per step ({} sent)",
                r.rank,
                r.batches,
                r.compute.as_secs_f64(),
                r.comm.total().as_secs_f64(),
                r.comm.all_reduce.as_secs_f64(),
                r.comm.flatten.as_secs_f64(),
                r.comm.unflatten.as_secs_f64(),
                r.comm.bytes as f64 / (1024.0 * 1024.0),
                r.coordination.as_secs_f64(),
                r.optimizer.as_secs_f64(),
                r.collectives_per_step(),
                mib(r.bus_bytes_per_step() as u64),
            )?;
            writeln!(
                f,
                "          utilization {:.0}%, synchronisation median {:.1?}, p90 {:.1?}, max \
                 {:.1?}, {} spike(s) over {}x the median, peak memory {}, transfers per step \
                 {:.1} to the host, {:.1} to the device",
                100.0 * r.utilization(),
                r.sync.median,
                r.sync.p90,
                r.sync.max,
                r.sync.spikes,
                r.sync.spike_factor,
                r.peak_memory.map_or("unknown".to_string(), mib),
                r.comm.transfers_per_step().0,
                r.comm.transfers_per_step().1,
            )?;
            if let Some(bytes) = r.optimizer_state {
                writeln!(f, "          optimizer state (its share) {}", mib(bytes))?;
            }
            if let Some(bytes) = r.device_memory {
                writeln!(f, "          device memory {}", mib(bytes))?;
            }
        }
        Ok(())
    }
}

/// A burn-train renderer that renders on the main process only ([`is_main_process`] when it is
/// built), like PyTorch users' `if rank == 0:` around their progress bars.
///
/// In a multi-process job every process builds its `SupervisedTraining`, renderer included, and
/// burn-train calls its renderer on every process (at least its end-of-training summary): wrap
/// it so that only rank 0's reaches the console. On the other ranks the inner renderer is dropped
/// at construction (a terminal UI never takes their terminal) and every call does nothing.
/// Under [`DdpStrategy`](crate::DdpStrategy) in one process (threads) this process is the main
/// one, so the wrapper renders everything.
///
/// Burn 0.22 split a renderer into its metrics (`MetricsRendererTraining`,
/// `MetricsRendererEvaluation`) and its progress (`TrainingProgressLogger`,
/// `EvaluationProgressLogger`): the wrapper forwards all four, each only where `R` has it.
///
/// [`is_main_process`]: crate::is_main_process
pub struct MainProcessRenderer<R> {
    inner: Option<R>,
}

impl<R> MainProcessRenderer<R> {
    /// Keeps `renderer` if this process is the main one, drops it otherwise.
    pub fn new(renderer: R) -> Self {
        Self {
            inner: crate::context::is_main_process().then_some(renderer),
        }
    }

    /// Whether this wrapper renders (this process is the main one).
    pub fn is_active(&self) -> bool {
        self.inner.is_some()
    }

    /// `call` on the inner renderer, if this process renders.
    fn with(&mut self, call: impl FnOnce(&mut R)) {
        if let Some(inner) = &mut self.inner {
            call(inner);
        }
    }
}

impl<R: MetricsRendererTraining> MetricsRendererTraining for MainProcessRenderer<R> {
    fn update_train(&mut self, state: MetricState) {
        self.with(|inner| inner.update_train(state));
    }

    fn update_valid(&mut self, state: MetricState) {
        self.with(|inner| inner.update_valid(state));
    }

    fn on_train_end(
        &mut self,
        summary: Option<burn::train::LearnerSummary>,
    ) -> std::result::Result<(), Box<dyn core::error::Error>> {
        match &mut self.inner {
            Some(inner) => inner.on_train_end(summary),
            None => Ok(()),
        }
    }
}

impl<R: MetricsRendererEvaluation> MetricsRendererEvaluation for MainProcessRenderer<R> {
    fn update_test(&mut self, name: EvaluationName, state: MetricState) {
        self.with(|inner| inner.update_test(name, state));
    }

    fn on_test_end(
        &mut self,
        summary: Option<burn::train::LearnerSummary>,
    ) -> std::result::Result<(), Box<dyn core::error::Error>> {
        match &mut self.inner {
            Some(inner) => inner.on_test_end(summary),
            None => Ok(()),
        }
    }
}

impl<R: TrainingProgressLogger> TrainingProgressLogger for MainProcessRenderer<R> {
    fn start(
        &mut self,
        total_epochs: usize,
        starting_epoch: usize,
        total_items: Option<usize>,
        label: Option<&str>,
    ) {
        self.with(|inner| inner.start(total_epochs, starting_epoch, total_items, label));
    }

    fn update_epoch(&mut self, epoch: usize) {
        self.with(|inner| inner.update_epoch(epoch));
    }

    fn start_split(&mut self, split: &str, total_items: usize) {
        self.with(|inner| inner.start_split(split, total_items));
    }

    fn update_split(&mut self, items_processed: usize) {
        self.with(|inner| inner.update_split(items_processed));
    }

    fn end_split(&mut self) {
        self.with(|inner| inner.end_split());
    }

    fn end(&mut self) {
        self.with(|inner| inner.end());
    }

    fn log_event_training(&mut self, event: String) {
        self.with(|inner| inner.log_event_training(event));
    }
}

impl<R: EvaluationProgressLogger> EvaluationProgressLogger for MainProcessRenderer<R> {
    fn start_global_progress(&mut self, total_tests: usize) {
        self.with(|inner| inner.start_global_progress(total_tests));
    }

    fn start_test(&mut self, name: &str, total_items: usize) {
        self.with(|inner| inner.start_test(name, total_items));
    }

    fn update_test_progress(&mut self, items_processed: usize) {
        self.with(|inner| inner.update_test_progress(items_processed));
    }

    fn end_test(&mut self) {
        self.with(|inner| inner.end_test());
    }

    fn end_global_progress(&mut self) {
        self.with(|inner| inner.end_global_progress());
    }

    fn log_event_evaluation(&mut self, event: String) {
        self.with(|inner| inner.log_event_evaluation(event));
    }
}

impl<R: MetricsRenderer> MetricsRenderer for MainProcessRenderer<R> {
    fn manual_close(&mut self) {
        self.with(|inner| inner.manual_close());
    }

    fn register_metric(&mut self, definition: MetricDefinition) {
        self.with(|inner| inner.register_metric(definition));
    }
}

/// A burn-train metric logger that logs on the main process only ([`is_main_process`] when it
/// is built); the other ranks log nothing and read back no entries.
///
/// Every process of a job runs its own `SupervisedTraining` with the same artifact directory:
/// without this wrapper (or an `InMemoryMetricLogger` on the other ranks) their file loggers
/// would write the same files. Under [`DdpStrategy`](crate::DdpStrategy) only rank 0 receives
/// metrics anyway, aggregated over every rank's samples.
///
/// [`is_main_process`]: crate::is_main_process
pub struct MainProcessLogger<L> {
    inner: Option<L>,
}

impl<L> MainProcessLogger<L> {
    /// Keeps `logger` if this process is the main one, drops it otherwise.
    pub fn new(logger: L) -> Self {
        Self {
            inner: crate::context::is_main_process().then_some(logger),
        }
    }
}

impl<L: MetricLogger> MetricLogger for MainProcessLogger<L> {
    fn log(&mut self, update: MetricsUpdate, epoch: usize, split: &Split) {
        if let Some(inner) = &mut self.inner {
            inner.log(update, epoch, split);
        }
    }

    fn read_numeric(
        &mut self,
        name: &str,
        epoch: usize,
        split: &Split,
    ) -> std::result::Result<Vec<NumericEntry>, String> {
        match &mut self.inner {
            Some(inner) => inner.read_numeric(name, epoch, split),
            None => Ok(Vec::new()),
        }
    }

    fn log_metric_definition(&mut self, definition: MetricDefinition) {
        if let Some(inner) = &mut self.inner {
            inner.log_metric_definition(definition);
        }
    }

    fn log_epoch_summary(&mut self, summary: EpochSummary) {
        if let Some(inner) = &mut self.inner {
            inner.log_epoch_summary(summary);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rank_report_round_trips_through_its_words() {
        let ms = Duration::from_millis;
        let report = RankReport {
            rank: 3,
            batches: 40,
            compute: ms(1200),
            coordination: ms(7),
            optimizer: ms(300),
            skipped_steps: 1,
            step_collectives: 44,
            step_bus_bytes: 3 << 30,
            train_time: ms(2000),
            comm: CommStats {
                steps: 40,
                buckets: 80,
                bytes: 1 << 20,
                flatten: ms(10),
                all_reduce: ms(90),
                unflatten: ms(11),
                uncompressed_buckets: 2,
                layout_changes: 1,
                transfers_to_host: 80,
                transfers_to_device: 79,
                host_phases: 38,
                scattered_phases: 3,
                device_phases: 5,
                shared_phases: 7,
            },
            sync: SyncTimes {
                count: 40,
                median: ms(2),
                p90: ms(3),
                max: ms(30),
                spikes: 1,
                spike_factor: 3.0,
            },
            peak_memory: Some(123 << 20),
            optimizer_state: Some(45 << 20),
            device_memory: Some(3 << 30),
        };
        let words = report.to_words();
        assert_eq!(words.len(), RankReport::WORDS);
        assert_eq!(RankReport::from_words(&words), Some(report.clone()));
        let unknown = RankReport {
            peak_memory: None,
            optimizer_state: None,
            device_memory: None,
            ..report
        };
        assert_eq!(RankReport::from_words(&unknown.to_words()), Some(unknown));
        assert_eq!(RankReport::from_words(&words[1..]), None);
        assert!((RankReport::from_words(&words).unwrap().utilization() - 0.6).abs() < 1e-9);
    }

    /// Records the progress calls it receives.
    #[derive(Default)]
    struct Progress(std::sync::Arc<std::sync::Mutex<Vec<String>>>);

    impl TrainingProgressLogger for Progress {
        fn start(&mut self, epochs: usize, first: usize, items: Option<usize>, _: Option<&str>) {
            self.0
                .lock()
                .unwrap()
                .push(format!("start {epochs} {first} {items:?}"));
        }
        fn update_epoch(&mut self, epoch: usize) {
            self.0.lock().unwrap().push(format!("epoch {epoch}"));
        }
        fn start_split(&mut self, split: &str, items: usize) {
            self.0
                .lock()
                .unwrap()
                .push(format!("split {split} {items}"));
        }
        fn update_split(&mut self, items: usize) {
            self.0.lock().unwrap().push(format!("items {items}"));
        }
        fn end_split(&mut self) {
            self.0.lock().unwrap().push("end split".into());
        }
        fn end(&mut self) {
            self.0.lock().unwrap().push("end".into());
        }
        fn log_event_training(&mut self, event: String) {
            self.0.lock().unwrap().push(event);
        }
    }

    fn drive(renderer: &mut impl TrainingProgressLogger) {
        renderer.start(2, 1, Some(64), None);
        renderer.start_split("train", 64);
        renderer.update_split(32);
        renderer.end_split();
        renderer.update_epoch(1);
        renderer.log_event_training("checkpoint".into());
        renderer.end();
    }

    #[test]
    fn the_renderer_forwards_every_progress_call_on_the_main_process_and_none_elsewhere() {
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut main = {
            let _rank = crate::context::enter_rank(0, 2);
            MainProcessRenderer::new(Progress(seen.clone()))
        };
        assert!(main.is_active());
        drive(&mut main);
        let expected = [
            "start 2 1 Some(64)",
            "split train 64",
            "items 32",
            "end split",
            "epoch 1",
            "checkpoint",
            "end",
        ];
        assert_eq!(*seen.lock().unwrap(), expected);

        let other = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut rank_1 = {
            let _rank = crate::context::enter_rank(1, 2);
            MainProcessRenderer::new(Progress(other.clone()))
        };
        assert!(!rank_1.is_active());
        drive(&mut rank_1);
        assert!(
            other.lock().unwrap().is_empty(),
            "{:?}",
            other.lock().unwrap()
        );
    }
}
