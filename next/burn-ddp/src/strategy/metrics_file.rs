//! [`DdpConfig::with_metrics_file`](crate::DdpConfig::with_metrics_file): rank 0's JSON Lines
//! file, one line per training step and one per rank at the end.

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Serialize;

use crate::metrics::TrainingReport;

/// Rank 0's own times in one training step, for its line.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct StepTimes {
    /// The whole step (batch, forward, backward, synchronisation, optimizer).
    pub wall: Duration,
    /// Forward and backward.
    pub compute: Duration,
    /// The optimizer step (with sharding: and the parameters' all-gather).
    pub optimizer: Duration,
}

/// One step's line.
#[derive(Serialize)]
struct StepLine {
    kind: &'static str,
    epoch: usize,
    step: usize,
    samples: Option<usize>,
    samples_per_s: Option<f64>,
    lr: Option<f64>,
    loss: Option<f64>,
    step_ms: f64,
    compute_ms: f64,
    optimizer_ms: f64,
    peak_memory: Option<u64>,
}

/// One rank's line at the end.
#[derive(Serialize)]
struct RankLine {
    kind: &'static str,
    rank: usize,
    batches: u64,
    compute_s: f64,
    sync_s: f64,
    optimizer_s: f64,
    utilization: f64,
    sync_median_ms: f64,
    sync_p90_ms: f64,
    spikes: u64,
    peak_memory: Option<u64>,
    optimizer_state: Option<u64>,
}

/// The open file (opened at the first line, appended to: a resumed run continues it).
pub(super) struct MetricsFile {
    path: PathBuf,
    writer: Option<BufWriter<File>>,
    /// Set once a write failed (warned once, then the file is left alone).
    failed: bool,
}

impl MetricsFile {
    /// The metrics file at `path`.
    pub fn new(path: &Path) -> Self {
        Self {
            path: path.to_path_buf(),
            writer: None,
            failed: false,
        }
    }

    /// Appends the line of training step `step` (1-based in the epoch) of `epoch`: `samples` of
    /// the global batch (`None`: not known, an output type burn-ddp cannot join), its samples/s
    /// over rank 0's time for the step.
    pub fn step(
        &mut self,
        epoch: usize,
        step: usize,
        samples: Option<usize>,
        lr: Option<f64>,
        loss: Option<f64>,
        times: StepTimes,
    ) {
        let samples_per_s = samples
            .filter(|_| !times.wall.is_zero())
            .map(|samples| samples as f64 / times.wall.as_secs_f64());
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        self.write(&StepLine {
            kind: "step",
            epoch,
            step,
            samples,
            samples_per_s,
            lr,
            loss,
            step_ms: ms(times.wall),
            compute_ms: ms(times.compute),
            optimizer_ms: ms(times.optimizer),
            peak_memory: crate::monitor::peak_resident_bytes(),
        });
    }

    /// Appends one line per rank of `report`.
    pub fn ranks(&mut self, report: &TrainingReport) {
        for r in &report.ranks {
            self.write(&RankLine {
                kind: "rank",
                rank: r.rank,
                batches: r.batches,
                compute_s: r.compute.as_secs_f64(),
                sync_s: r.comm.total().as_secs_f64(),
                optimizer_s: r.optimizer.as_secs_f64(),
                utilization: r.utilization(),
                sync_median_ms: r.sync.median.as_secs_f64() * 1e3,
                sync_p90_ms: r.sync.p90.as_secs_f64() * 1e3,
                spikes: r.sync.spikes,
                peak_memory: r.peak_memory,
                optimizer_state: r.optimizer_state,
            });
        }
    }

    fn write(&mut self, line: &impl Serialize) {
        if self.failed {
            return;
        }
        let result = (|| -> std::io::Result<()> {
            if self.writer.is_none() {
                if let Some(dir) = self.path.parent().filter(|d| !d.as_os_str().is_empty()) {
                    std::fs::create_dir_all(dir)?;
                }
                let file = OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&self.path)?;
                self.writer = Some(BufWriter::new(file));
            }
            let writer = self.writer.as_mut().ok_or(std::io::ErrorKind::Other)?;
            serde_json::to_writer(&mut *writer, line)?;
            writer.write_all(b"\n")?;
            // A line a user can read while training runs.
            writer.flush()
        })();
        if let Err(e) = result {
            self.failed = true;
            tracing::warn!(
                "burn-ddp: cannot write the metrics file {}: {e} (no more lines are written)",
                self.path.display()
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_json_objects_appended_one_per_step() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/metrics.jsonl");
        let mut file = MetricsFile::new(&path);
        let times = StepTimes {
            wall: Duration::from_millis(20),
            compute: Duration::from_millis(12),
            optimizer: Duration::from_millis(3),
        };
        file.step(1, 1, Some(64), Some(0.1), Some(2.5), times);
        file.step(1, 2, None, Some(0.1), None, times);
        drop(file);
        // A resumed run appends.
        MetricsFile::new(&path).step(2, 1, Some(64), None, Some(1.0), times);
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 3);
        assert_eq!(lines[0]["kind"], "step");
        assert_eq!(lines[0]["loss"], 2.5);
        // 64 samples in a 20 ms step.
        assert!((lines[0]["samples_per_s"].as_f64().unwrap() - 3200.0).abs() < 1e-6);
        assert_eq!(lines[1]["samples"], serde_json::Value::Null);
        assert_eq!(lines[1]["samples_per_s"], serde_json::Value::Null);
        assert_eq!(lines[1]["loss"], serde_json::Value::Null);
        assert_eq!(lines[2]["epoch"], 2);
        assert!((lines[0]["compute_ms"].as_f64().unwrap() - 12.0).abs() < 1e-9);
    }

    #[test]
    fn a_file_that_cannot_be_written_is_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        // A directory where the file should be.
        let mut file = MetricsFile::new(dir.path());
        file.step(1, 1, Some(1), None, None, StepTimes::default());
        assert!(file.failed);
        file.step(1, 2, Some(1), None, None, StepTimes::default());
    }
}
