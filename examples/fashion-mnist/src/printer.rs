//! A burn-train renderer that prints one line per epoch: train loss, test accuracy, samples/s.

use std::collections::HashMap;
use std::time::Instant;

use burn::train::LearnerSummary;
use burn::train::metric::{MetricDefinition, MetricId, NumericEntry};
use burn::train::renderer::{
    EvaluationName, EvaluationProgress, MetricState, MetricsRenderer, MetricsRendererEvaluation,
    MetricsRendererTraining, ProgressType, TrainingProgress,
};

/// A weighted mean of a metric over one epoch.
#[derive(Default, Clone, Copy)]
struct Mean {
    sum: f64,
    weight: f64,
}

impl Mean {
    fn add(&mut self, entry: &NumericEntry) {
        let (value, weight) = match entry {
            NumericEntry::Value(v) => (*v, 1.0),
            NumericEntry::Aggregated {
                aggregated_value,
                count,
            } => (*aggregated_value, *count as f64),
        };
        self.sum += value * weight;
        self.weight += weight;
    }

    fn get(&self) -> Option<f64> {
        (self.weight > 0.0).then(|| self.sum / self.weight)
    }
}

/// Per-epoch figures, printed when the next epoch starts or training ends.
#[derive(Default)]
struct Epoch {
    number: usize,
    total: usize,
    train_loss: Mean,
    test_accuracy: Mean,
    samples: usize,
    started: Option<Instant>,
    train_seconds: Option<f64>,
    /// Next tenth of the epoch at which to print a progress line.
    next_tenth: usize,
}

/// Prints a progress line every tenth of an epoch and, per epoch,
/// `epoch 1/2: train loss 0.4512, test accuracy 86.91%, 1234.5 samples/s`.
#[derive(Default)]
pub struct EpochPrinter {
    names: HashMap<MetricId, String>,
    epoch: Epoch,
    /// When the previous epoch's validation last reported (or the printer was made): the next
    /// epoch's training starts then. Its first item may arrive much later: between processes,
    /// rank 0 receives the ranks' items in groups of `DdpConfig::with_metrics_every` steps.
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

    fn name(&self, state: &MetricState) -> Option<(&str, NumericEntry)> {
        match state {
            MetricState::Numeric(entry, value) => self
                .names
                .get(&entry.metric_id)
                .map(|name| (name.as_str(), value.clone())),
            MetricState::Generic(_) => None,
        }
    }

    fn begin(&mut self, epoch: usize, total: usize) {
        if self.epoch.number != epoch {
            self.print();
            self.epoch = Epoch {
                number: epoch,
                total,
                started: Some(self.since.unwrap_or_else(Instant::now)),
                next_tenth: 1,
                ..Epoch::default()
            };
        }
    }

    fn print(&mut self) {
        let e = &self.epoch;
        if e.number == 0 {
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
            e.number,
            e.total,
            e.samples,
            e.train_seconds.unwrap_or(0.0)
        );
        self.epoch.number = 0;
    }
}

impl MetricsRendererTraining for EpochPrinter {
    fn update_train(&mut self, state: MetricState) {
        if let Some(("Loss", value)) = self.name(&state) {
            self.epoch.train_loss.add(&value);
        }
    }

    fn update_valid(&mut self, state: MetricState) {
        if let Some(("Accuracy", value)) = self.name(&state) {
            self.epoch.test_accuracy.add(&value);
        }
    }

    fn render_train(&mut self, item: TrainingProgress, _indicators: Vec<ProgressType>) {
        self.begin(
            item.global_progress.items_processed,
            item.global_progress.items_total,
        );
        if let Some(progress) = item.progress {
            self.epoch.samples = self.epoch.samples.max(progress.items_processed);
            let e = &mut self.epoch;
            if e.next_tenth < 10
                && progress.items_processed * 10 >= e.next_tenth * progress.items_total
            {
                let loss = e
                    .train_loss
                    .get()
                    .map_or("n/a".to_string(), |l| format!("{l:.4}"));
                let elapsed = e.started.map_or(0.0, |s| s.elapsed().as_secs_f64());
                println!(
                    "  epoch {}: {}% ({}/{} samples, {elapsed:.0} s), train loss so far {loss}",
                    e.number,
                    e.next_tenth * 10,
                    progress.items_processed,
                    progress.items_total
                );
                e.next_tenth += 1;
            }
        }
    }

    fn render_valid(&mut self, _item: TrainingProgress, _indicators: Vec<ProgressType>) {
        if self.epoch.train_seconds.is_none() {
            self.epoch.train_seconds = self.epoch.started.map(|s| s.elapsed().as_secs_f64());
        }
        self.since = Some(Instant::now());
    }

    fn on_train_end(
        &mut self,
        _summary: Option<LearnerSummary>,
    ) -> Result<(), Box<dyn core::error::Error>> {
        self.print();
        Ok(())
    }
}

impl MetricsRendererEvaluation for EpochPrinter {
    fn update_test(&mut self, _name: EvaluationName, _state: MetricState) {}
    fn render_test(&mut self, _item: EvaluationProgress, _indicators: Vec<ProgressType>) {}
}

impl MetricsRenderer for EpochPrinter {
    fn manual_close(&mut self) {}

    fn register_metric(&mut self, definition: MetricDefinition) {
        self.names.insert(definition.metric_id, definition.name);
    }
}
