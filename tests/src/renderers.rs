//! burn-train renderers for tests: one that shows nothing, and one that records every item it is given.

use std::sync::Arc;

use burn::train::metric::MetricDefinition;
use burn::train::renderer::{
    EvaluationName, EvaluationProgress, MetricState, MetricsRenderer, MetricsRendererEvaluation,
    MetricsRendererTraining, ProgressType, TrainingProgress,
};

/// A renderer that shows nothing (tests read results, not progress).
pub struct SilentRenderer;

impl MetricsRendererTraining for SilentRenderer {
    fn update_train(&mut self, _state: MetricState) {}
    fn update_valid(&mut self, _state: MetricState) {}
    fn render_train(&mut self, _item: TrainingProgress, _progress: Vec<ProgressType>) {}
    fn render_valid(&mut self, _item: TrainingProgress, _progress: Vec<ProgressType>) {}
}

impl MetricsRendererEvaluation for SilentRenderer {
    fn update_test(&mut self, _name: EvaluationName, _state: MetricState) {}
    fn render_test(&mut self, _item: EvaluationProgress, _progress: Vec<ProgressType>) {}
}

impl MetricsRenderer for SilentRenderer {
    fn manual_close(&mut self) {}
    fn register_metric(&mut self, _definition: MetricDefinition) {}
}

/// One item a [`Recording`] renderer saw: its epoch, iteration and numeric metric updates.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SeenItem {
    /// burn-train's epoch (from 1).
    pub epoch: usize,
    /// The item's iteration number.
    pub iteration: Option<usize>,
    /// The epoch's progress after the item (items processed, items in all), as burn-train
    /// renders it.
    pub progress: Option<(usize, usize)>,
    /// Metric name, the item's value, its count, in the order burn-train sent them.
    pub metrics: Vec<(String, f64, usize)>,
}

/// What a [`Recording`] renderer saw of one split (training or validation).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SplitSeen {
    /// The iteration number of every rendered item, in order.
    pub iterations: Vec<Option<usize>>,
    /// Every numeric metric update: metric name, the item's value, its count (samples).
    pub updates: Vec<(String, f64, usize)>,
    /// Every rendered item with its updates.
    pub items: Vec<SeenItem>,
    /// Updates not yet rendered (they come before their item's render).
    pending: Vec<(String, f64, usize)>,
}

impl SplitSeen {
    /// A metric's value over everything seen, weighted by each item's count, as burn-train's
    /// epoch ("running") value is.
    pub fn weighted(&self, name: &str) -> f64 {
        let (sum, count) = self
            .updates
            .iter()
            .filter(|(n, _, _)| n == name)
            .fold((0.0, 0usize), |(s, c), (_, v, n)| {
                (s + v * *n as f64, c + n)
            });
        sum / count.max(1) as f64
    }

    /// A metric's epoch value (the mean over the epoch's items, weighted by their counts, as
    /// burn-train's event store aggregates it), if the epoch has items.
    pub fn epoch_mean(&self, name: &str, epoch: usize) -> Option<f64> {
        let (sum, count) = self
            .items
            .iter()
            .filter(|i| i.epoch == epoch)
            .flat_map(|i| i.metrics.iter().filter(|(n, _, _)| n == name))
            .fold((0.0, 0usize), |(s, c), (_, v, n)| {
                (s + v * *n as f64, c + n)
            });
        (count > 0).then(|| sum / count as f64)
    }

    fn render(&mut self, item: &TrainingProgress) {
        self.iterations.push(item.iteration);
        self.items.push(SeenItem {
            epoch: item.global_progress.items_processed,
            iteration: item.iteration,
            progress: item
                .progress
                .as_ref()
                .map(|p| (p.items_processed, p.items_total)),
            metrics: std::mem::take(&mut self.pending),
        });
    }

    /// The item values of a metric, in order.
    pub fn values(&self, name: &str) -> Vec<f64> {
        self.updates
            .iter()
            .filter(|(n, _, _)| n == name)
            .map(|(_, v, _)| *v)
            .collect()
    }
}

/// A renderer that records what burn-train shows (shared by its clones).
#[derive(Clone, Default)]
pub struct Recording {
    seen: Arc<std::sync::Mutex<(SplitSeen, SplitSeen)>>,
    names: Arc<std::sync::Mutex<std::collections::HashMap<String, String>>>,
}

impl Recording {
    /// What was seen so far: (training, validation).
    pub fn seen(&self) -> (SplitSeen, SplitSeen) {
        self.seen.lock().map(|s| s.clone()).unwrap_or_default()
    }

    fn update(&self, valid: bool, state: MetricState) {
        if let MetricState::Numeric(entry, numeric) = state {
            let id = format!("{:?}", entry.metric_id);
            let name = self
                .names
                .lock()
                .ok()
                .and_then(|n| n.get(&id).cloned())
                .unwrap_or(id);
            let (value, count) = match numeric {
                burn::train::metric::NumericEntry::Value(v) => (v, 1),
                burn::train::metric::NumericEntry::Aggregated {
                    aggregated_value,
                    count,
                } => (aggregated_value, count),
            };
            if let Ok(mut seen) = self.seen.lock() {
                let split = if valid { &mut seen.1 } else { &mut seen.0 };
                split.updates.push((name.clone(), value, count));
                split.pending.push((name, value, count));
            }
        }
    }
}

impl MetricsRendererTraining for Recording {
    fn update_train(&mut self, state: MetricState) {
        self.update(false, state);
    }
    fn update_valid(&mut self, state: MetricState) {
        self.update(true, state);
    }
    fn render_train(&mut self, item: TrainingProgress, _progress: Vec<ProgressType>) {
        if let Ok(mut seen) = self.seen.lock() {
            seen.0.render(&item);
        }
    }
    fn render_valid(&mut self, item: TrainingProgress, _progress: Vec<ProgressType>) {
        if let Ok(mut seen) = self.seen.lock() {
            seen.1.render(&item);
        }
    }
}

impl MetricsRendererEvaluation for Recording {
    fn update_test(&mut self, _name: EvaluationName, _state: MetricState) {}
    fn render_test(&mut self, _item: EvaluationProgress, _progress: Vec<ProgressType>) {}
}

impl MetricsRenderer for Recording {
    fn manual_close(&mut self) {}
    fn register_metric(&mut self, definition: MetricDefinition) {
        if let Ok(mut names) = self.names.lock() {
            names.insert(format!("{:?}", definition.metric_id), definition.name);
        }
    }
}
