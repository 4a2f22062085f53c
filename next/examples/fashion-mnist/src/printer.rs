//! A burn-train renderer that prints one line per epoch: train loss, test accuracy, samples/s.

use std::collections::HashMap;
use std::time::Instant;

use burn::train::LearnerSummary;
use burn::train::logger::{EvaluationProgressLogger, TrainingProgressLogger};
use burn::train::metric::{MetricDefinition, MetricId, NumericEntry};
use burn::train::renderer::{
    EvaluationName, MetricState, MetricsRenderer, MetricsRendererEvaluation,
    MetricsRendererTraining,
};

/// A metric over one epoch: the weighted mean of its entries, or the epoch's final value when
/// burn-train gives one (burn-train 0.22's `NumericEntry::Final`, computed at the epoch's end).
#[derive(Default, Clone, Copy)]
struct Mean {
    sum: f64,
    weight: f64,
    last: Option<f64>,
}

impl Mean {
    fn add(&mut self, entry: &NumericEntry) {
        let (value, weight) = match entry {
            NumericEntry::Value(v) => (*v, 1.0),
            NumericEntry::Aggregated {
                aggregated_value,
                count,
            } => (*aggregated_value, *count as f64),
            // The mean of nothing (an epoch stopped before its first batch) is NaN: "n/a".
            NumericEntry::Final(v) => {
                self.last = v.is_finite().then_some(*v);
                return;
            }
        };
        self.sum += value * weight;
        self.weight += weight;
    }

    fn get(&self) -> Option<f64> {
        self.last
            .or_else(|| (self.weight > 0.0).then(|| self.sum / self.weight))
    }
}

/// Which split burn-train is in.
#[derive(Default, Clone, Copy, PartialEq, Eq)]
enum Split {
    #[default]
    None,
    Train,
    Valid,
}

/// Per-epoch figures, printed when burn-train ends the epoch.
#[derive(Default)]
struct Epoch {
    train_loss: Mean,
    test_accuracy: Mean,
    samples: usize,
    total_samples: usize,
    started: Option<Instant>,
    train_seconds: Option<f64>,
    /// Next tenth of the epoch at which to print a progress line.
    next_tenth: usize,
}

/// Prints a progress line every tenth of an epoch and, per epoch,
/// `epoch 1/2: train loss 0.4512, test accuracy 86.91%, 1234.5 samples/s`.
///
/// burn-train 0.22 tells it the epochs and splits through its progress-logger calls (`start`,
/// `start_split`, `update_split`, `end_split`, `update_epoch`, `end`) and the metrics through
/// `update_train` / `update_valid`.
#[derive(Default)]
pub struct EpochPrinter {
    names: HashMap<MetricId, String>,
    /// The epoch being trained (1-based) and the run's number of epochs.
    number: usize,
    total: usize,
    split: Split,
    epoch: Epoch,
    /// When the previous epoch's validation ended (or the printer was made): the next epoch's
    /// training starts then. Its first item may arrive much later: between processes, rank 0
    /// receives the ranks' items in groups of `DdpConfig::with_metrics_every` steps.
    since: Option<Instant>,
}

impl EpochPrinter {
    /// A printer (wrap it in `burn_ddp::metrics::MainProcessRenderer` so only rank 0 prints).
    pub fn new() -> Self {
        Self {
            since: Some(Instant::now()),
            ..Self::default()
        }
    }

    fn numeric(&self, state: &MetricState) -> Option<(&str, NumericEntry)> {
        match state {
            MetricState::Numeric(entry, Some(value)) => self
                .names
                .get(&entry.metric_id)
                .map(|name| (name.as_str(), value.clone())),
            _ => None,
        }
    }

    fn print(&mut self) {
        let e = &self.epoch;
        if e.started.is_none() {
            return;
        }
        let loss = e
            .train_loss
            .get()
            .map_or("n/a".to_string(), |l| format!("{l:.4}"));
        let accuracy = e
            .test_accuracy
            .get()
            .map_or("n/a".to_string(), |a| format!("{a:.2}%"));
        let throughput = e.train_seconds.map_or("n/a".to_string(), |s| {
            format!("{:.1}", e.samples as f64 / s)
        });
        println!(
            "epoch {}/{}: train loss {loss}, test accuracy {accuracy}, {throughput} samples/s ({} samples in {:.1} s)",
            self.number,
            self.total,
            e.samples,
            e.train_seconds.unwrap_or(0.0)
        );
        self.epoch = Epoch::default();
    }
}

impl MetricsRendererTraining for EpochPrinter {
    fn update_train(&mut self, state: MetricState) {
        if let Some(("Loss", value)) = self.numeric(&state) {
            self.epoch.train_loss.add(&value);
        }
    }

    fn update_valid(&mut self, state: MetricState) {
        if let Some(("Accuracy", value)) = self.numeric(&state) {
            self.epoch.test_accuracy.add(&value);
        }
    }

    fn on_train_end(
        &mut self,
        _summary: Option<LearnerSummary>,
    ) -> Result<(), Box<dyn core::error::Error>> {
        self.print();
        Ok(())
    }
}

impl TrainingProgressLogger for EpochPrinter {
    fn start(
        &mut self,
        total_epochs: usize,
        starting_epoch: usize,
        _total_items: Option<usize>,
        _label: Option<&str>,
    ) {
        self.total = total_epochs;
        self.number = starting_epoch.max(1);
    }

    fn update_epoch(&mut self, epoch: usize) {
        self.number = epoch;
        self.print();
        self.number = epoch + 1;
    }

    fn start_split(&mut self, split: &str, total_items: usize) {
        self.split = match split {
            "train" => Split::Train,
            "valid" => Split::Valid,
            _ => Split::None,
        };
        if self.split == Split::Train {
            self.epoch = Epoch {
                total_samples: total_items,
                started: Some(self.since.unwrap_or_else(Instant::now)),
                next_tenth: 1,
                ..Epoch::default()
            };
        }
    }

    fn update_split(&mut self, items_processed: usize) {
        if self.split != Split::Train {
            return;
        }
        let number = self.number;
        let e = &mut self.epoch;
        e.samples = e.samples.max(items_processed);
        if e.next_tenth < 10
            && e.total_samples > 0
            && items_processed * 10 >= e.next_tenth * e.total_samples
        {
            let loss = e
                .train_loss
                .get()
                .map_or("n/a".to_string(), |l| format!("{l:.4}"));
            let elapsed = e.started.map_or(0.0, |s| s.elapsed().as_secs_f64());
            println!(
                "  epoch {number}: {}% ({items_processed}/{} samples, {elapsed:.0} s), train loss so far {loss}",
                e.next_tenth * 10,
                e.total_samples
            );
            e.next_tenth += 1;
        }
    }

    fn end_split(&mut self) {
        match self.split {
            Split::Train => {
                self.epoch.train_seconds = self.epoch.started.map(|s| s.elapsed().as_secs_f64());
            }
            Split::Valid => self.since = Some(Instant::now()),
            Split::None => {}
        }
        self.split = Split::None;
    }

    fn end(&mut self) {}

    fn log_event_training(&mut self, _event: String) {}
}

impl EvaluationProgressLogger for EpochPrinter {
    fn start_global_progress(&mut self, _total_tests: usize) {}
    fn start_test(&mut self, _name: &str, _total_items: usize) {}
    fn update_test_progress(&mut self, _items_processed: usize) {}
    fn end_test(&mut self) {}
    fn end_global_progress(&mut self) {}
    fn log_event_evaluation(&mut self, _event: String) {}
}

impl MetricsRendererEvaluation for EpochPrinter {
    fn update_test(&mut self, _name: EvaluationName, _state: MetricState) {}
}

impl MetricsRenderer for EpochPrinter {
    fn manual_close(&mut self) {}

    fn register_metric(&mut self, definition: MetricDefinition) {
        self.names
            .insert(definition.metric_id, definition.name.to_string());
    }
}
