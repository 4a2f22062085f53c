//! burn-train renderers for tests: one that shows nothing, and one that records every metric
//! update and progress step it is given (burn-train 0.22's renderer: metric updates through
//! `update_train`/`update_valid`, progress through its `TrainingProgressLogger` calls).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use burn::train::LearnerSummary;
use burn::train::logger::{EvaluationProgressLogger, TrainingProgressLogger};
use burn::train::metric::{MetricDefinition, NumericEntry};
use burn::train::renderer::{
    EvaluationName, MetricState, MetricsRenderer, MetricsRendererEvaluation,
    MetricsRendererTraining,
};

/// A renderer that shows nothing (tests read results, not progress).
pub struct SilentRenderer;

impl MetricsRendererTraining for SilentRenderer {
    fn update_train(&mut self, _state: MetricState) {}
    fn update_valid(&mut self, _state: MetricState) {}
    fn on_train_end(
        &mut self,
        _summary: Option<LearnerSummary>,
    ) -> Result<(), Box<dyn core::error::Error>> {
        Ok(())
    }
}

impl MetricsRendererEvaluation for SilentRenderer {
    fn update_test(&mut self, _name: EvaluationName, _state: MetricState) {}
    fn on_test_end(
        &mut self,
        _summary: Option<LearnerSummary>,
    ) -> Result<(), Box<dyn core::error::Error>> {
        Ok(())
    }
}

impl TrainingProgressLogger for SilentRenderer {
    fn start(&mut self, _: usize, _: usize, _: Option<usize>, _: Option<&str>) {}
    fn update_epoch(&mut self, _epoch: usize) {}
    fn start_split(&mut self, _split: &str, _total_items: usize) {}
    fn update_split(&mut self, _items_processed: usize) {}
    fn end_split(&mut self) {}
    fn end(&mut self) {}
    fn log_event_training(&mut self, _event: String) {}
}

impl EvaluationProgressLogger for SilentRenderer {
    fn start_global_progress(&mut self, _total_tests: usize) {}
    fn start_test(&mut self, _name: &str, _total_items: usize) {}
    fn update_test_progress(&mut self, _items_processed: usize) {}
    fn end_test(&mut self) {}
    fn end_global_progress(&mut self) {}
    fn log_event_evaluation(&mut self, _event: String) {}
}

impl MetricsRenderer for SilentRenderer {
    fn manual_close(&mut self) {}
    fn register_metric(&mut self, _definition: MetricDefinition) {}
}

/// One metric update a [`Recording`] renderer saw: the metric's name, the item's value and its
/// count (samples), and burn-train's epoch (from 1) it came in.
#[derive(Debug, Clone, PartialEq)]
pub struct Update {
    /// The metric's name (burn-train's, e.g. `Loss`, `Accuracy`).
    pub name: String,
    /// The item's value.
    pub value: f64,
    /// Samples behind the value.
    pub count: usize,
    /// burn-train's epoch, from 1.
    pub epoch: usize,
}

/// One training or validation item a [`Recording`] renderer saw: its epoch, the split's
/// progress after it (items processed, items in all) and the metric updates that came with it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SeenItem {
    /// burn-train's epoch (from 1).
    pub epoch: usize,
    /// The split's progress after the item (items processed, items in all), as burn-train
    /// renders it.
    pub progress: (usize, usize),
    /// The item's metric updates (name, value, count), in the order burn-train sent them.
    pub metrics: Vec<(String, f64, usize)>,
}

/// What a [`Recording`] renderer saw of one split (training or validation).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SplitSeen {
    /// Every numeric metric update of an item (not the epochs' final values), in order.
    pub updates: Vec<Update>,
    /// Every item with its updates.
    pub items: Vec<SeenItem>,
    /// Every epoch's final value of a metric that gives one (burn-train 0.22's
    /// `NumericEntry::Final`): name, value, epoch.
    pub finals: Vec<(String, f64, usize)>,
    /// Updates not yet given their item (they come before the item's progress).
    pending: Vec<(String, f64, usize)>,
    /// Items in the split being run (burn-train's `start_split`).
    total: usize,
}

impl SplitSeen {
    /// A metric's value over everything seen, weighted by each item's count, as burn-train's
    /// running value is.
    pub fn weighted(&self, name: &str) -> f64 {
        let (sum, count) = self
            .updates
            .iter()
            .filter(|u| u.name == name)
            .fold((0.0, 0usize), |(s, c), u| {
                (s + u.value * u.count as f64, c + u.count)
            });
        sum / count.max(1) as f64
    }

    /// A metric's epoch value (the mean over the epoch's items, weighted by their counts, as
    /// burn-train's event store aggregates it), if the epoch has items.
    pub fn epoch_mean(&self, name: &str, epoch: usize) -> Option<f64> {
        let (sum, count) = self
            .updates
            .iter()
            .filter(|u| u.name == name && u.epoch == epoch)
            .fold((0.0, 0usize), |(s, c), u| {
                (s + u.value * u.count as f64, c + u.count)
            });
        (count > 0).then(|| sum / count as f64)
    }

    /// The item values of a metric, in order.
    pub fn values(&self, name: &str) -> Vec<f64> {
        self.updates
            .iter()
            .filter(|u| u.name == name)
            .map(|u| u.value)
            .collect()
    }
}

/// Which split burn-train is in, as its progress calls say.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
enum Split {
    #[default]
    Train,
    Valid,
}

#[derive(Default)]
struct Seen {
    train: SplitSeen,
    valid: SplitSeen,
    split: Split,
    /// burn-train's epoch being run, from 1.
    epoch: usize,
    names: HashMap<String, String>,
}

impl Seen {
    fn split(&mut self, split: Split) -> &mut SplitSeen {
        match split {
            Split::Train => &mut self.train,
            Split::Valid => &mut self.valid,
        }
    }
}

/// A renderer that records what burn-train shows (shared by its clones).
#[derive(Clone, Default)]
pub struct Recording {
    seen: Arc<Mutex<Seen>>,
}

impl Recording {
    /// What was seen so far: (training, validation).
    pub fn seen(&self) -> (SplitSeen, SplitSeen) {
        let seen = self.lock();
        (seen.train.clone(), seen.valid.clone())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Seen> {
        self.seen.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn update(&self, split: Split, state: MetricState) {
        let MetricState::Numeric(entry, Some(numeric)) = state else {
            return;
        };
        let mut seen = self.lock();
        let id = format!("{:?}", entry.metric_id);
        let name = seen.names.get(&id).cloned().unwrap_or(id);
        let epoch = seen.epoch.max(1);
        let (value, count) = match numeric {
            NumericEntry::Value(v) => (v, 1),
            NumericEntry::Aggregated {
                aggregated_value,
                count,
            } => (aggregated_value, count),
            NumericEntry::Final(v) => {
                seen.split(split).finals.push((name, v, epoch));
                return;
            }
        };
        let seen = seen.split(split);
        seen.updates.push(Update {
            name: name.clone(),
            value,
            count,
            epoch,
        });
        seen.pending.push((name, value, count));
    }
}

impl MetricsRendererTraining for Recording {
    fn update_train(&mut self, state: MetricState) {
        self.update(Split::Train, state);
    }
    fn update_valid(&mut self, state: MetricState) {
        self.update(Split::Valid, state);
    }
    fn on_train_end(
        &mut self,
        _summary: Option<LearnerSummary>,
    ) -> Result<(), Box<dyn core::error::Error>> {
        Ok(())
    }
}

impl MetricsRendererEvaluation for Recording {
    fn update_test(&mut self, _name: EvaluationName, _state: MetricState) {}
    fn on_test_end(
        &mut self,
        _summary: Option<LearnerSummary>,
    ) -> Result<(), Box<dyn core::error::Error>> {
        Ok(())
    }
}

impl TrainingProgressLogger for Recording {
    fn start(&mut self, _total: usize, starting_epoch: usize, _: Option<usize>, _: Option<&str>) {
        self.lock().epoch = starting_epoch.max(1);
    }

    fn update_epoch(&mut self, epoch: usize) {
        self.lock().epoch = epoch + 1;
    }

    fn start_split(&mut self, split: &str, total_items: usize) {
        let mut seen = self.lock();
        seen.split = if split == "valid" {
            Split::Valid
        } else {
            Split::Train
        };
        let split = seen.split;
        seen.split(split).total = total_items;
    }

    fn update_split(&mut self, items_processed: usize) {
        let mut seen = self.lock();
        let (split, epoch) = (seen.split, seen.epoch.max(1));
        let seen = seen.split(split);
        let metrics = std::mem::take(&mut seen.pending);
        let progress = (items_processed, seen.total);
        seen.items.push(SeenItem {
            epoch,
            progress,
            metrics,
        });
    }

    fn end_split(&mut self) {}
    fn end(&mut self) {}
    fn log_event_training(&mut self, _event: String) {}
}

impl EvaluationProgressLogger for Recording {
    fn start_global_progress(&mut self, _total_tests: usize) {}
    fn start_test(&mut self, _name: &str, _total_items: usize) {}
    fn update_test_progress(&mut self, _items_processed: usize) {}
    fn end_test(&mut self) {}
    fn end_global_progress(&mut self) {}
    fn log_event_evaluation(&mut self, _event: String) {}
}

impl MetricsRenderer for Recording {
    fn manual_close(&mut self) {}
    fn register_metric(&mut self, definition: MetricDefinition) {
        self.lock().names.insert(
            format!("{:?}", definition.metric_id),
            definition.name.to_string(),
        );
    }
}
