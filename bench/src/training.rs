//! Training throughput: the same model, data and global batch under each strategy, through
//! burn-train's `SupervisedTraining`, timed in windows of steps after a warm-up.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use burn::backend::{Autodiff, Flex};
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::{DataLoader, DataLoaderBuilder};
use burn::data::dataset::InMemDataset;
use burn::module::AutodiffModule;
use burn::optim::{AdamConfig, Optimizer};
use burn::train::logger::InMemoryMetricLogger;
use burn::train::metric::MetricDefinition;
use burn::train::renderer::{
    EvaluationName, EvaluationProgress, MetricState, MetricsRenderer, MetricsRendererEvaluation,
    MetricsRendererTraining, ProgressType, TrainingProgress,
};
use burn::train::{
    ClassificationOutput, ExecutionStrategy, InferenceStep, Learner, MultiDeviceOptim,
    SupervisedTraining, TrainStep,
};
use burn_ddp::metrics::TrainingReport;
use burn_ddp::{DdpStrategy, DdpTraining, DistributedDataLoader, DistributedSampler, ProcessGroup};
use fashion_mnist::data::{FashionBatch, FashionBatcher};
use serde::{Deserialize, Serialize};

use crate::models::{BigMlp, ModelKind, synthetic_images};

/// The CPU backend of the benchmark (the faster one on these models, see the README).
pub type B = Autodiff<Flex>;

/// A way to train.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Strategy {
    /// Plain Burn on one device: the reference.
    Single,
    /// Burn's `ExecutionStrategy::MultiDevice` (gradients gathered on the first device).
    BurnMultiDevice(usize),
    /// Burn's `MultiDevice` with `MultiDeviceOptim::OptimSharded` (the optimizer step sharded
    /// across the devices).
    BurnMultiDeviceSharded(usize),
    /// burn-ddp, replicas as threads.
    DdpThreads(usize),
    /// burn-ddp, replicas as threads, optimizer state sharded (ZeRO-1).
    DdpThreadsSharded(usize),
    /// burn-ddp, replicas as processes over `TcpGroup`.
    DdpProcesses(usize),
    /// burn-ddp, processes over `TcpGroup`, optimizer state and gradients sharded (ZeRO-2).
    DdpProcessesSharded(usize),
    /// burn-ddp, replicas as the processes of `mpirun` over `MpiGroup` (feature `mpi`).
    DdpMpi(usize),
}

impl Strategy {
    /// Replicas.
    pub fn world_size(self) -> usize {
        match self {
            Strategy::Single => 1,
            Strategy::BurnMultiDevice(n)
            | Strategy::BurnMultiDeviceSharded(n)
            | Strategy::DdpThreads(n)
            | Strategy::DdpThreadsSharded(n)
            | Strategy::DdpProcesses(n)
            | Strategy::DdpProcessesSharded(n)
            | Strategy::DdpMpi(n) => n,
        }
    }

    /// Name in tables and plots (without the world size).
    pub fn family(self) -> &'static str {
        match self {
            Strategy::Single => "plain Burn, 1 device",
            Strategy::BurnMultiDevice(_) => "Burn MultiDevice",
            Strategy::BurnMultiDeviceSharded(_) => "Burn MultiDevice, OptimSharded",
            Strategy::DdpThreads(_) => "burn-ddp threads",
            Strategy::DdpThreadsSharded(_) => "burn-ddp threads, sharded optimizer",
            Strategy::DdpProcesses(_) => "burn-ddp processes (TCP)",
            Strategy::DdpProcessesSharded(_) => {
                "burn-ddp processes (TCP), sharded optimizer and gradients"
            }
            Strategy::DdpMpi(_) => "burn-ddp processes (MPI)",
        }
    }
}

/// How long a run is: warm-up steps, then `windows` windows of `window_steps` steps.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct Plan {
    /// Samples per optimizer step over all replicas.
    pub global_batch: usize,
    /// Steps before timing starts.
    pub warmup_steps: usize,
    /// Steps per timed window.
    pub window_steps: usize,
    /// Timed windows.
    pub windows: usize,
}

impl Plan {
    fn steps(&self) -> usize {
        self.warmup_steps + self.window_steps * self.windows
    }
}

/// Average time per optimizer step in each phase (burn-ddp runs), in milliseconds.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct StepSplit {
    /// Forward and backward.
    pub compute_ms: f64,
    /// Gradients into buckets.
    pub flatten_ms: f64,
    /// All-reduce, including waiting for slower ranks.
    pub all_reduce_ms: f64,
    /// Buckets back into gradients.
    pub unflatten_ms: f64,
    /// The per-step agreement (every rank has a batch?).
    pub agreement_ms: f64,
    /// Optimizer step.
    pub optimizer_ms: f64,
    /// Collectives issued per step (`RankReport::collectives_per_step`); absent in results of
    /// versions that did not count them.
    #[serde(default)]
    pub collectives_per_step: Option<f64>,
    /// MiB rank 0 sent per step (`RankReport::bus_bytes_per_step`: a bandwidth-optimal
    /// algorithm's count; none for tensors shared by reference).
    #[serde(default)]
    pub sent_mib_per_step: Option<f64>,
}

/// One run's result.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Throughput {
    /// The model.
    pub model: ModelKind,
    /// The strategy.
    pub strategy: Strategy,
    /// Samples/s of each timed window.
    pub windows: Vec<f64>,
    /// Their median.
    pub samples_per_second: f64,
    /// The median of each round's windows, in round order (one entry per round).
    #[serde(default)]
    pub round_medians: Vec<f64>,
    /// Rank 0's step split, for burn-ddp runs.
    pub split: Option<StepSplit>,
    /// The largest optimizer state a rank holds, in MiB: with burn-ddp's sharding the largest
    /// share (`RankReport::optimizer_state`), else Adam's whole state (every replica, or Burn's
    /// main device, holds it); unknown for Burn's `OptimSharded`.
    #[serde(default)]
    pub optimizer_state_mib: Option<f64>,
    /// Why the run has no figure (when it failed or does not apply).
    pub note: Option<String>,
}

/// Records when each training item reached burn-train's renderer, with the samples done so far.
#[derive(Clone, Default)]
struct Clock(Arc<Mutex<Vec<(Instant, usize)>>>);

impl MetricsRendererTraining for Clock {
    fn update_train(&mut self, _state: MetricState) {}
    fn update_valid(&mut self, _state: MetricState) {}
    fn render_train(&mut self, item: TrainingProgress, _indicators: Vec<ProgressType>) {
        if let (Some(progress), Ok(mut ticks)) = (item.progress, self.0.lock()) {
            ticks.push((Instant::now(), progress.items_processed));
        }
    }
    fn render_valid(&mut self, _item: TrainingProgress, _indicators: Vec<ProgressType>) {}
}

impl MetricsRendererEvaluation for Clock {
    fn update_test(&mut self, _name: EvaluationName, _state: MetricState) {}
    fn render_test(&mut self, _item: EvaluationProgress, _indicators: Vec<ProgressType>) {}
}

impl MetricsRenderer for Clock {
    fn manual_close(&mut self) {}
    fn register_metric(&mut self, _definition: MetricDefinition) {}
}

/// Samples/s per window, from the renderer's ticks: window `w` spans the samples
/// `[warmup + w * window, warmup + (w + 1) * window)` (counted over all replicas).
fn windows(ticks: &[(Instant, usize)], plan: &Plan) -> Vec<f64> {
    let time_at = |samples: usize| {
        ticks
            .iter()
            .find(|(_, done)| *done >= samples)
            .map(|(t, _)| *t)
    };
    let per_window = plan.window_steps * plan.global_batch;
    (0..plan.windows)
        .filter_map(|w| {
            let start = (plan.warmup_steps * plan.global_batch) + w * per_window;
            let (a, b) = (time_at(start)?, time_at(start + per_window)?);
            let seconds = (b - a).as_secs_f64();
            (seconds > 0.0).then(|| per_window as f64 / seconds)
        })
        .collect()
}

/// The median of `values` (0 when empty).
pub fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    match sorted.len() {
        0 => 0.0,
        n if n % 2 == 1 => sorted[n / 2],
        n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

/// The training loader's workers and the synthetic decode cost of its batcher.
#[derive(Debug, Clone, Copy, Default)]
pub struct Loader {
    /// `DistributedDataLoader::with_num_workers`.
    pub workers: usize,
    /// CPU time the batcher spins per sample (a stand-in for decoding an image).
    pub decode_per_sample: Duration,
}

/// The batch of the example, after spinning the CPU `per_sample` for every sample.
#[derive(Clone)]
struct CostlyBatcher {
    per_sample: Duration,
}

impl<Bk: burn::tensor::backend::Backend>
    burn::data::dataloader::batcher::Batcher<Bk, fashion_mnist::data::FashionItem, FashionBatch<Bk>>
    for CostlyBatcher
{
    fn batch(
        &self,
        items: Vec<fashion_mnist::data::FashionItem>,
        device: &Bk::Device,
    ) -> FashionBatch<Bk> {
        let until = Instant::now() + self.per_sample * items.len() as u32;
        while Instant::now() < until {
            std::hint::spin_loop();
        }
        FashionBatcher.batch(items, device)
    }
}

/// One row of the prefetch comparison.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PrefetchRun {
    /// Loader workers per replica.
    pub workers: usize,
    /// Synthetic decode time per batch, in milliseconds.
    pub decode_ms_per_batch: f64,
    /// The run (every round's windows).
    pub run: Throughput,
}

/// The median over rounds of `run`'s round median divided by `base`'s (rounds paired in order).
pub fn paired_ratio(run: &Throughput, base: &Throughput) -> f64 {
    let ratios: Vec<f64> = run
        .round_medians
        .iter()
        .zip(&base.round_medians)
        .filter(|(_, b)| **b > 0.0)
        .map(|(r, b)| r / b)
        .collect();
    median(&ratios)
}

/// The CNN on one burn-ddp replica with `loader`.
pub fn run_with_loader(plan: &Plan, loader: Loader) -> Throughput {
    let device = Default::default();
    let model = fashion_mnist::model::Cnn::<B>::new(&device);
    let _ = burn_ddp::mechanism::value_fingerprint(&model);
    run_model(
        ModelKind::Cnn,
        model,
        Strategy::DdpThreads(1),
        plan,
        None,
        loader,
    )
}

/// Trains `kind` with `strategy` in this process (`group`: this process is one rank of a
/// multi-process job) and times it.
pub fn run(
    kind: ModelKind,
    strategy: Strategy,
    plan: &Plan,
    group: Option<Arc<dyn ProcessGroup>>,
) -> Throughput {
    let loader = Loader::default();
    let device = Default::default();
    match kind {
        ModelKind::Cnn => {
            let model = fashion_mnist::model::Cnn::<B>::new(&device);
            let _ = burn_ddp::mechanism::value_fingerprint(&model);
            run_model(kind, model, strategy, plan, group, loader)
        }
        ModelKind::Mlp => {
            let model = BigMlp::<B>::new(&device);
            let _ = burn_ddp::mechanism::value_fingerprint(&model);
            run_model(kind, model, strategy, plan, group, loader)
        }
        ModelKind::MlpFrozen => {
            let model = BigMlp::<B>::new(&device);
            let _ = burn_ddp::mechanism::value_fingerprint(&model);
            run_model(kind, model.frozen_half(), strategy, plan, group, loader)
        }
    }
}

fn run_model<M>(
    kind: ModelKind,
    model: M,
    strategy: Strategy,
    plan: &Plan,
    group: Option<Arc<dyn ProcessGroup>>,
    loader: Loader,
) -> Throughput
where
    M: TrainStep<Input = FashionBatch<B>, Output = ClassificationOutput<B>>
        + AutodiffModule<B>
        + core::fmt::Display
        + 'static,
    M::InnerModule: InferenceStep<
            Input = FashionBatch<burn::backend::Flex>,
            Output = ClassificationOutput<burn::backend::Flex>,
        >,
{
    let device: burn::tensor::Device<B> = Default::default();
    let whole_optimizer_state = whole_adam_state(&model);
    let n = group
        .as_ref()
        .map_or(strategy.world_size(), |g| g.world_size());
    let train = match train_loader(strategy, plan, n, loader, device) {
        Ok(train) => train,
        Err(e) => return failed(kind, strategy, e),
    };
    let valid = DataLoaderBuilder::new(FashionBatcher)
        .batch_size(8)
        .build(InMemDataset::new(synthetic_images(8)));
    let clock = Clock::default();
    let directory = std::env::temp_dir().join(format!("ddp-bench-{}", std::process::id()));
    // One per strategy: its learning components include the optimizer's type.
    macro_rules! training {
        () => {
            SupervisedTraining::new(directory.clone(), train.clone(), valid.clone())
                .num_epochs(1)
                .renderer(clock.clone())
                .with_metric_logger(InMemoryMetricLogger::new())
                .with_application_logger(None)
        };
    }
    let learner = || Learner::new(model.clone(), AdamConfig::new().init(), 1e-3);
    let mut report: Option<TrainingReport> = None;
    match strategy {
        Strategy::Single => {
            let learner = learner();
            training!()
                .with_training_strategy(ExecutionStrategy::SingleDevice(device).into())
                .launch(learner);
        }
        Strategy::BurnMultiDevice(n) | Strategy::BurnMultiDeviceSharded(n) => {
            let learner = learner();
            let optim = match strategy {
                Strategy::BurnMultiDeviceSharded(_) => MultiDeviceOptim::OptimSharded,
                _ => MultiDeviceOptim::OptimMainDevice,
            };
            training!()
                .with_training_strategy(
                    ExecutionStrategy::MultiDevice(vec![device; n], optim).into(),
                )
                .launch(learner);
        }
        Strategy::DdpThreads(_)
        | Strategy::DdpThreadsSharded(_)
        | Strategy::DdpProcesses(_)
        | Strategy::DdpProcessesSharded(_)
        | Strategy::DdpMpi(_) => {
            let ddp = match group {
                // The windows are timed by rank 0's renderer: in process mode it must hear of
                // every step as it ends, not of 20 at once (the default metrics interval). That
                // costs two small all-gathers per step, counted in the figures.
                Some(group) => {
                    let sharded = matches!(strategy, Strategy::DdpProcessesSharded(_));
                    DdpStrategy::with_process_group(device, group).with_config(
                        burn_ddp::DdpConfig::default()
                            .with_metrics_every(1)
                            .with_optimizer_sharding(sharded)
                            .with_gradient_sharding(sharded),
                    )
                }
                None => DdpStrategy::new(vec![device; n]).with_config(
                    burn_ddp::DdpConfig::default().with_optimizer_sharding(matches!(
                        strategy,
                        Strategy::DdpThreadsSharded(_)
                    )),
                ),
            };
            let handle = ddp.clone();
            // The sharded optimizer: Burn's Adam wrapped (the plain Adam without sharding).
            let learner = Learner::new(
                model.clone(),
                burn_ddp::ShardedOptimizer::new(AdamConfig::new().init()),
                1e-3,
            );
            if let Err(e) = training!().launch_ddp(learner, ddp) {
                return failed(kind, strategy, e.to_string());
            }
            report = Some(handle.report());
        }
    }
    // Let burn-train's event thread deliver the last items.
    std::thread::sleep(Duration::from_millis(100));
    let ticks = clock.0.lock().map(|t| t.clone()).unwrap_or_default();
    summarise(kind, strategy, plan, &ticks, report, whole_optimizer_state)
}

/// The training loader of `strategy` over `n` replicas: Burn's strategies slice the loader
/// themselves and take its batch size per device; burn-ddp gets a `DistributedDataLoader` with the
/// same per-replica batch.
fn train_loader(
    strategy: Strategy,
    plan: &Plan,
    n: usize,
    loader: Loader,
    device: burn::tensor::Device<B>,
) -> Result<Arc<dyn DataLoader<B, FashionBatch<B>>>, String> {
    let samples = plan.steps() * plan.global_batch;
    let items = Arc::new(InMemDataset::new(synthetic_images(samples)));
    let per_replica = plan.global_batch / n;
    Ok(match strategy {
        Strategy::Single => DataLoaderBuilder::new(FashionBatcher)
            .batch_size(plan.global_batch)
            .build(InMemDataset::new(synthetic_images(samples))),
        Strategy::BurnMultiDevice(_) | Strategy::BurnMultiDeviceSharded(_) => {
            DataLoaderBuilder::new(FashionBatcher)
                .batch_size(per_replica)
                .build(InMemDataset::new(synthetic_images(samples)))
        }
        _ => match DistributedSampler::new(samples, n).and_then(|sampler| {
            let batcher = CostlyBatcher {
                per_sample: loader.decode_per_sample,
            };
            DistributedDataLoader::new(items, batcher, sampler, per_replica, device)
        }) {
            Ok(distributed) => Arc::new(distributed.with_num_workers(loader.workers)),
            Err(e) => return Err(e.to_string()),
        },
    })
}

/// A run's result from the step clock's `ticks` (time, samples so far), burn-ddp's report (when the strategy is
/// burn-ddp's) and Adam's whole state in MiB: samples/s per timed window, the step split and the
/// optimizer state per rank.
fn summarise(
    kind: ModelKind,
    strategy: Strategy,
    plan: &Plan,
    ticks: &[(Instant, usize)],
    report: Option<TrainingReport>,
    whole_optimizer_state: Option<f64>,
) -> Throughput {
    let windows = windows(ticks, plan);
    let mib = |bytes: u64| bytes as f64 / (1024.0 * 1024.0);
    let optimizer_state_mib = match strategy {
        Strategy::DdpThreadsSharded(_) | Strategy::DdpProcessesSharded(_) => report
            .as_ref()
            .and_then(|r| r.ranks.iter().filter_map(|rank| rank.optimizer_state).max())
            .map(mib),
        Strategy::BurnMultiDeviceSharded(_) => None,
        _ => whole_optimizer_state,
    };
    let split = report.and_then(|r| r.ranks.first().cloned()).map(|rank| {
        let steps = rank.comm.steps.max(1) as f64;
        let ms = |d: Duration| d.as_secs_f64() * 1e3 / steps;
        StepSplit {
            compute_ms: ms(rank.compute),
            flatten_ms: ms(rank.comm.flatten),
            all_reduce_ms: ms(rank.comm.all_reduce),
            unflatten_ms: ms(rank.comm.unflatten),
            agreement_ms: ms(rank.coordination),
            optimizer_ms: ms(rank.optimizer),
            collectives_per_step: Some(rank.collectives_per_step()),
            sent_mib_per_step: Some(rank.bus_bytes_per_step() / (1024.0 * 1024.0)),
        }
    });
    Throughput {
        model: kind,
        strategy,
        samples_per_second: median(&windows),
        round_medians: vec![median(&windows)],
        note: windows
            .is_empty()
            .then(|| "no complete window was timed".to_string()),
        windows,
        split,
        optimizer_state_mib,
    }
}

/// Adam's whole state for `model` in MiB, as `RankReport::optimizer_state` counts it: the record
/// after one step on a small batch (every parameter then has its moments).
fn whole_adam_state<M>(model: &M) -> Option<f64>
where
    M: TrainStep<Input = FashionBatch<B>, Output = ClassificationOutput<B>> + AutodiffModule<B>,
{
    let batch = FashionBatcher.batch(synthetic_images(2), &Default::default());
    let grads = model.step(batch).grads;
    let mut adam = AdamConfig::new().init::<B, M>();
    let _ = adam.step(1e-3, model.clone(), grads);
    burn_ddp::mechanism::optimizer_state_bytes::<B, _>(adam.to_record())
        .ok()
        .map(|bytes| bytes as f64 / (1024.0 * 1024.0))
}

/// One result from several rounds of the same run: the windows of every round, their median,
/// and the step split of the first round that has one. `None` for no rounds.
pub fn merge_rounds(rounds: Vec<Throughput>) -> Option<Throughput> {
    let mut merged = rounds.first()?.clone();
    merged.windows = rounds.iter().flat_map(|r| r.windows.clone()).collect();
    merged.samples_per_second = median(&merged.windows);
    merged.round_medians = rounds.iter().map(|r| r.samples_per_second).collect();
    merged.split = rounds.iter().find_map(|r| r.split.clone());
    merged.note = if merged.windows.is_empty() {
        rounds.iter().find_map(|r| r.note.clone())
    } else {
        None
    };
    Some(merged)
}

fn failed(model: ModelKind, strategy: Strategy, note: String) -> Throughput {
    Throughput {
        model,
        strategy,
        windows: Vec::new(),
        samples_per_second: 0.0,
        round_medians: Vec::new(),
        split: None,
        optimizer_state_mib: None,
        note: Some(note),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_are_timed_between_sample_counts() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        // 10 samples per step; ticks every step at 100 ms.
        let ticks: Vec<(Instant, usize)> = (1..=10).map(|s| (at(100 * s as u64), 10 * s)).collect();
        let plan = Plan {
            global_batch: 10,
            warmup_steps: 2,
            window_steps: 4,
            windows: 2,
        };
        // Window 0: samples 20..60, ticks at 200 ms and 600 ms: 40 samples in 0.4 s.
        let rates = windows(&ticks, &plan);
        assert_eq!(rates.len(), 2);
        assert!((rates[0] - 100.0).abs() < 1e-6);
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
    }
}
