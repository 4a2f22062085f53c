//! The benchmark's outputs: the results with every figure (written as JSON), the scaling
//! projection, and, in their own files, the Markdown report ([`markdown`]) and the SVG plots
//! ([`plots`]).

mod markdown;
mod plots;

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::collectives::{AllReducePoint, BucketPoint, GroupKind, MemcpyPoint};
use crate::models::ModelKind;
use crate::training::{Strategy, Throughput, median};

/// A named link for the projection.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Link {
    /// Its name.
    pub name: String,
    /// Bus bandwidth of a ring all-reduce, GB/s.
    pub busbw_gbps: f64,
    /// Latency per ring step, microseconds.
    pub latency_us: f64,
}

/// The links of the projection table: a consumer PCIe 4.0 box and an NVLink H100 node.
pub fn links() -> Vec<Link> {
    vec![
        Link {
            name: "PCIe 4.0 consumer GPUs".into(),
            busbw_gbps: 25.0,
            latency_us: 10.0,
        },
        Link {
            name: "NVLink H100 (NVSwitch)".into(),
            busbw_gbps: 370.0,
            latency_us: 5.0,
        },
    ]
}

/// One cell of the projection.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Projection {
    /// The model.
    pub model: ModelKind,
    /// The link's name.
    pub link: String,
    /// GPUs.
    pub gpus: usize,
    /// Projected scaling efficiency `T1 / (N * T_N)`.
    pub efficiency: f64,
}

/// Ring all-reduce cost model: `T_N = T1 / N + 2(N-1)/N * S / busbw + 2(N-1) * latency`, with
/// `T1` the measured single-device step time for the global batch and `S` the gradient bytes;
/// efficiency `T1 / (N * T_N)`. Compute is assumed to split perfectly and not to overlap with
/// communication (burn-ddp all-reduces after the backward pass), so this is a lower bound for an
/// overlapping implementation and an upper bound when per-GPU batches get too small to keep a
/// GPU busy.
pub fn project(t1_seconds: f64, gradient_bytes: usize, gpus: usize, link: &Link) -> f64 {
    let n = gpus as f64;
    let comm = 2.0 * (n - 1.0) / n * gradient_bytes as f64 / (link.busbw_gbps * 1e9)
        + 2.0 * (n - 1.0) * link.latency_us * 1e-6;
    let tn = t1_seconds / n + comm;
    t1_seconds / (n * tn)
}

/// Everything the benchmark measured.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Results {
    /// When and where: `uname`-like description and the options.
    pub machine: String,
    /// Training throughput runs.
    pub throughput: Vec<Throughput>,
    /// All-reduce sweep.
    pub all_reduce: Vec<AllReducePoint>,
    /// memcpy roof.
    pub memcpy: Vec<MemcpyPoint>,
    /// Bucket cap sweep.
    pub buckets: Vec<BucketPoint>,
    /// Gradient bytes per model.
    pub gradient_bytes: Vec<(ModelKind, usize)>,
    /// The projection.
    pub projection: Vec<Projection>,
    /// Links of the projection.
    pub links: Vec<Link>,
    /// Loader prefetch: the same training with a costly batcher and 0 or more loader workers.
    #[serde(default)]
    pub prefetch: Vec<crate::training::PrefetchRun>,
    /// What the job's authentication costs at start-up.
    #[serde(default)]
    pub startup: Option<crate::startup::StartupCost>,
    /// What the per-step monitoring costs.
    #[serde(default)]
    pub monitoring: Option<crate::monitoring::MonitoringCost>,
    /// Why a measurement is missing (a peer not installed, a feature not built).
    #[serde(default)]
    pub notes: Vec<String>,
}

fn mib(bytes: usize) -> String {
    if bytes >= 1 << 20 {
        format!("{} MiB", bytes >> 20)
    } else {
        format!("{} KiB", bytes >> 10)
    }
}

impl Results {
    fn single(&self, model: ModelKind) -> Option<f64> {
        self.throughput
            .iter()
            .find(|t| t.model == model && t.strategy == Strategy::Single)
            .map(|t| t.samples_per_second)
            .filter(|v| *v > 0.0)
    }

    /// The overhead of a world-size-1 run against plain Burn, paired round by round (each round
    /// runs both back to back, so a drift of the machine cancels): the median over rounds of
    /// `T_single_r / T_run_r - 1`, with the smallest and largest round. `None` without rounds.
    pub fn paired_overhead(&self, run: &Throughput) -> Option<(f64, f64, f64)> {
        let single = self
            .throughput
            .iter()
            .find(|t| t.model == run.model && t.strategy == Strategy::Single)?;
        let ratios: Vec<f64> = single
            .round_medians
            .iter()
            .zip(&run.round_medians)
            .filter(|(s, r)| **s > 0.0 && **r > 0.0)
            .map(|(s, r)| s / r - 1.0)
            .collect();
        if ratios.is_empty() {
            return None;
        }
        let low = ratios.iter().copied().fold(f64::INFINITY, f64::min);
        let high = ratios.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        Some((median(&ratios), low, high))
    }

    /// The global batch of the throughput runs (recorded in `machine`'s options).
    pub fn global_batch(&self) -> usize {
        self.machine
            .split("global batch ")
            .nth(1)
            .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(64)
    }

    /// Writes `bench.json`, `throughput.svg`, `step_split.svg`, `busbw.svg` into `dir`.
    ///
    /// # Errors
    /// The file system's or the plotting library's errors, as text.
    pub fn write(&self, dir: &Path) -> Result<(), String> {
        std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
        let json = serde_json::to_string_pretty(self).map_err(|e| e.to_string())?;
        std::fs::write(dir.join("bench.json"), json).map_err(|e| e.to_string())?;
        std::fs::write(dir.join("bench.md"), self.markdown()).map_err(|e| e.to_string())?;
        self.plot_throughput(&dir.join("throughput.svg"))?;
        self.plot_split(&dir.join("step_split.svg"))?;
        self.plot_busbw(&dir.join("busbw.svg"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_projection_follows_the_ring_cost_model() {
        let link = Link {
            name: "test".into(),
            busbw_gbps: 10.0,
            latency_us: 0.0,
        };
        // T1 = 1 s, S = 10 GB: 2 GPUs: 0.5 s compute + 2(1)/2 * 10 GB / 10 GB/s = 1 s comm.
        let e = project(1.0, 10_000_000_000, 2, &link);
        assert!((e - 1.0 / (2.0 * 1.5)).abs() < 1e-12);
        // Free communication scales perfectly.
        assert!((project(1.0, 0, 8, &link) - 1.0).abs() < 1e-12);
    }

    #[test]
    fn the_overhead_is_paired_round_by_round() {
        let run = |strategy, rounds: &[f64]| Throughput {
            model: ModelKind::Cnn,
            strategy,
            windows: rounds.to_vec(),
            samples_per_second: median(rounds),
            round_medians: rounds.to_vec(),
            split: None,
            optimizer_state_mib: None,
            note: None,
        };
        // The machine drifts from 100 to 200 samples/s; burn-ddp is 10%, 0% and 20% slower in
        // the same rounds: paired, the median overhead is +11.1% (100/90 - 1), not the pooled
        // medians' ratio.
        let results = Results {
            throughput: vec![
                run(Strategy::Single, &[100.0, 150.0, 200.0]),
                run(Strategy::DdpThreads(1), &[90.0, 150.0, 200.0 / 1.2]),
            ],
            ..Results::default()
        };
        let (median, low, high) = results.paired_overhead(&results.throughput[1]).unwrap();
        assert!((median - (100.0 / 90.0 - 1.0)).abs() < 1e-12, "{median}");
        assert!(low.abs() < 1e-12);
        assert!((high - 0.2).abs() < 1e-12);
        assert!(
            results
                .paired_overhead(&run(Strategy::DdpThreads(1), &[]))
                .is_none()
        );
    }
}
