//! The benchmark's outputs: a Markdown report, a JSON file with every figure, SVG plots, and the
//! scaling projection.

use std::fmt::Write as _;
use std::path::Path;

use plotters::prelude::*;
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

    /// The Markdown report.
    pub fn markdown(&self) -> String {
        let mut md = String::new();
        self.throughput_markdown(&mut md);
        self.monitoring_markdown(&mut md);
        self.prefetch_markdown(&mut md);
        self.startup_markdown(&mut md);
        self.collectives_markdown(&mut md);
        self.buckets_markdown(&mut md);
        self.projection_markdown(&mut md);
        md
    }

    /// The throughput table: every strategy against plain Burn on one device.
    fn throughput_markdown(&self, md: &mut String) {
        let _ = writeln!(md, "## Training throughput ({})\n", self.machine);
        let _ = writeln!(
            md,
            "Same model, synthetic data and global batch for every row; samples/s is the median of the timed windows after a warm-up. Efficiency = T1 / (N * TN) against plain Burn on one device; for N = 1 the overhead against it, paired round by round (median and range over rounds).\n"
        );
        let _ = writeln!(
            md,
            "| model | strategy | N | samples/s | vs 1 device | efficiency / overhead | step split ms (compute / flatten / all-reduce / unflatten / agreement / optimizer) | collectives (MiB sent) per step | optimizer state per rank |"
        );
        let _ = writeln!(
            md,
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"
        );
        for t in &self.throughput {
            let base = self.single(t.model);
            let n = t.strategy.world_size();
            let (speedup, efficiency) = match (base, t.samples_per_second) {
                (Some(b), v) if v > 0.0 => {
                    let speedup = v / b;
                    let eff = if n == 1 && t.strategy != Strategy::Single {
                        match self.paired_overhead(t) {
                            Some((median, low, high)) => format!(
                                "overhead {:+.1}% (rounds {:+.1}% to {:+.1}%)",
                                median * 100.0,
                                low * 100.0,
                                high * 100.0
                            ),
                            None => format!("overhead {:+.1}%", (b / v - 1.0) * 100.0),
                        }
                    } else {
                        format!("{:.0}%", speedup / n as f64 * 100.0)
                    };
                    (format!("{speedup:.2}x"), eff)
                }
                _ => ("-".into(), t.note.clone().unwrap_or_else(|| "-".into())),
            };
            let split = t.split.as_ref().map_or("-".into(), |s| {
                format!(
                    "{:.1} / {:.2} / {:.2} / {:.2} / {:.2} / {:.2}",
                    s.compute_ms,
                    s.flatten_ms,
                    s.all_reduce_ms,
                    s.unflatten_ms,
                    s.agreement_ms,
                    s.optimizer_ms
                )
            });
            let collectives = t.split.as_ref().map_or("-".into(), |s| {
                match (s.collectives_per_step, s.sent_mib_per_step) {
                    (Some(c), Some(m)) => format!("{c:.2} ({m:.1})"),
                    (Some(c), None) => format!("{c:.2}"),
                    _ => "-".into(),
                }
            });
            let state = t
                .optimizer_state_mib
                .map_or("-".into(), |m| format!("{m:.1} MiB"));
            let _ = writeln!(
                md,
                "| {} | {} | {} | {:.1} | {} | {} | {} | {} | {} |",
                t.model.name(),
                t.strategy.family(),
                n,
                t.samples_per_second,
                speedup,
                efficiency,
                split,
                collectives,
                state
            );
        }
        let _ = writeln!(
            md,
            "| both | Burn `ExecutionStrategy::ddp` | - | - | - | skipped: needs Burn's `distributed` feature, whose `DistributedBackend` the CPU backends lack (CUDA only) | - | - | - |\n"
        );
    }

    /// What the per-step monitoring costs, when measured.
    fn monitoring_markdown(&self, md: &mut String) {
        if let Some(cost) = &self.monitoring {
            // The fastest step any strategy took: the largest share the monitoring can have.
            let fastest = self
                .throughput
                .iter()
                .filter(|t| t.samples_per_second > 0.0)
                .map(|t| {
                    let steps_per_s = t.samples_per_second / self.global_batch() as f64;
                    (1e9 / steps_per_s, t)
                })
                .min_by(|a, b| a.0.total_cmp(&b.0));
            let _ = writeln!(md, "## Monitoring cost\n");
            match fastest {
                Some((step_ns, t)) => {
                    let _ = writeln!(
                        md,
                        "burn-ddp's per-step monitoring (the step's clock readings and the spike detector) takes {:.0} ns per step (median of {} rounds: {}), {:.4}% of the fastest step measured above ({:.1} ms, {} with {}).\n",
                        cost.per_step_ns,
                        cost.rounds.len(),
                        cost.rounds
                            .iter()
                            .map(|r| format!("{r:.0}"))
                            .collect::<Vec<_>>()
                            .join(", "),
                        100.0 * cost.per_step_ns / step_ns,
                        step_ns / 1e6,
                        t.model.name(),
                        t.strategy.family()
                    );
                }
                None => {
                    let _ = writeln!(
                        md,
                        "burn-ddp's per-step monitoring takes {:.0} ns per step.\n",
                        cost.per_step_ns
                    );
                }
            }
        }
    }

    /// The prefetch workers' effect, when measured.
    fn prefetch_markdown(&self, md: &mut String) {
        if !self.prefetch.is_empty() {
            let _ = writeln!(
                md,
                "## Loader prefetch (DistributedDataLoader::with_num_workers)\n\n\
                 One burn-ddp replica training the CNN; the batcher spins the CPU for a synthetic \
                 decode costing about a quarter of a step. Samples/s is the median of the timed \
                 windows over every round (runs interleaved); the ratio is against 0 workers, \
                 paired round by round.\n"
            );
            let _ = writeln!(
                md,
                "| loader workers | decode ms per batch | samples/s | vs 0 workers (median of rounds) |"
            );
            let _ = writeln!(md, "| --- | --- | --- | --- |");
            let base = self.prefetch.iter().find(|p| p.workers == 0);
            for p in &self.prefetch {
                let ratio = base
                    .map(|b| crate::training::paired_ratio(&p.run, &b.run))
                    .map_or("-".to_string(), |r| format!("x{r:.2}"));
                let _ = writeln!(
                    md,
                    "| {} | {:.1} | {:.1} | {} |",
                    p.workers, p.decode_ms_per_batch, p.run.samples_per_second, ratio
                );
            }
            let _ = writeln!(md);
        }
    }

    /// The start-up's cost, when measured.
    fn startup_markdown(&self, md: &mut String) {
        if let Some(cost) = &self.startup {
            let _ = writeln!(
                md,
                "## Start-up: the job's handshake (loopback, median of {} connections)\n\n\
                 | connection | ms |\n| --- | --- |\n\
                 | plain TCP, one round trip | {:.3} |\n\
                 | store, with the handshake (HMAC-SHA256 both ways) | {:.3} (+{:.3}) |\n\
                 | TcpGroup of 2 ranks formed (rendezvous and pair) | {:.3} |\n",
                cost.samples,
                cost.tcp_connect_ms,
                cost.store_connect_ms,
                cost.store_connect_ms - cost.tcp_connect_ms,
                cost.group_connect_ms
            );
        }
    }

    /// The all-reduce of each group against memcpy, and the notes.
    fn collectives_markdown(&self, md: &mut String) {
        let _ = writeln!(md, "## All-reduce (2 ranks, average)\n");
        let _ = writeln!(
            md,
            "busbw = algbw * 2(n-1)/n (nccl-tests); the roof is one thread's memcpy bandwidth (bytes copied per second), the better of two sweeps run before and after the all-reduces.\n"
        );
        let groups: Vec<GroupKind> = GroupKind::ALL
            .into_iter()
            .filter(|g| self.all_reduce.iter().any(|p| p.group == *g))
            .collect();
        let mut header = "| size | memcpy GB/s |".to_string();
        let mut rule = "| --- | --- |".to_string();
        for g in &groups {
            header.push_str(&format!(" {} time | busbw GB/s |", g.name()));
            rule.push_str(" --- | --- |");
        }
        let _ = writeln!(md, "{header}\n{rule}");
        for m in &self.memcpy {
            let fmt_time = |s: f64| {
                if s < 1e-3 {
                    format!("{:.1} µs", s * 1e6)
                } else {
                    format!("{:.2} ms", s * 1e3)
                }
            };
            let mut row = format!("| {} | {:.2} |", mib(m.bytes), m.gbps);
            for g in &groups {
                match self
                    .all_reduce
                    .iter()
                    .find(|p| p.group == *g && p.bytes == m.bytes)
                {
                    Some(p) => row.push_str(&format!(
                        " {} | {:.2} ({:.0}% of memcpy) |",
                        fmt_time(p.seconds),
                        p.busbw_gbps,
                        p.busbw_gbps / m.gbps * 100.0
                    )),
                    None => row.push_str(" - | - |"),
                }
            }
            let _ = writeln!(md, "{row}");
        }
        for note in &self.notes {
            let _ = writeln!(md, "\n- {note}");
        }
    }

    /// The bucket cap sweep.
    fn buckets_markdown(&self, md: &mut String) {
        let _ = writeln!(
            md,
            "\n## Bucket cap (2 ranks, one gradient synchronisation)\n"
        );
        let _ = writeln!(
            md,
            "| model | group | cap | buckets | ms (median) | split ms (flatten / all-reduce / unflatten, mean) |"
        );
        let _ = writeln!(md, "| --- | --- | --- | --- | --- | --- |");
        for b in &self.buckets {
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {:.2} | {:.2} / {:.2} / {:.2} |",
                b.model.name(),
                b.group.name(),
                b.cap_bytes.map_or("one per parameter".into(), mib),
                b.buckets,
                b.milliseconds,
                b.split_ms[0],
                b.split_ms[1],
                b.split_ms[2]
            );
        }
    }

    /// The projection to GPU links (not a measurement).
    fn projection_markdown(&self, md: &mut String) {
        let _ = writeln!(md, "\n## Projection (not a measurement)\n");
        let _ = writeln!(
            md,
            "Ring all-reduce cost model: T_N = T1/N + 2(N-1)/N * S/busbw + 2(N-1) * latency; efficiency = T1 / (N * T_N). Inputs: T1 = measured single-device step time for the global batch on this machine's CPU (a GPU is faster, which lowers efficiency: scale T1 down to match yours), S = gradient bytes."
        );
        for link in &self.links {
            let _ = writeln!(
                md,
                "- {}: busbw {} GB/s, latency {} µs per ring step",
                link.name, link.busbw_gbps, link.latency_us
            );
        }
        for (model, bytes) in &self.gradient_bytes {
            let t1 = self
                .single(*model)
                .map(|sps| self.global_batch() as f64 / sps);
            let _ = writeln!(
                md,
                "- {}: S = {:.2} MB, T1 = {}",
                model.name(),
                *bytes as f64 / 1e6,
                t1.map_or("n/a".into(), |t| format!("{:.1} ms", t * 1e3))
            );
        }
        let _ = writeln!(md, "\n| model | link | 2 GPUs | 4 GPUs | 8 GPUs |");
        let _ = writeln!(md, "| --- | --- | --- | --- | --- |");
        for (model, _) in &self.gradient_bytes {
            for link in &self.links {
                let cell = |n: usize| {
                    self.projection
                        .iter()
                        .find(|p| p.model == *model && p.link == link.name && p.gpus == n)
                        .map_or("-".into(), |p| format!("{:.0}%", p.efficiency * 100.0))
                };
                let _ = writeln!(
                    md,
                    "| {} | {} | {} | {} | {} |",
                    model.name(),
                    link.name,
                    cell(2),
                    cell(4),
                    cell(8)
                );
            }
        }
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

    fn plot_throughput(&self, path: &Path) -> Result<(), String> {
        let root = SVGBackend::new(path, (960, 420)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        let panels = root.split_evenly((1, 2));
        for (panel, model) in panels.iter().zip([ModelKind::Cnn, ModelKind::Mlp]) {
            let runs: Vec<&Throughput> = self
                .throughput
                .iter()
                .filter(|t| t.model == model && t.samples_per_second > 0.0)
                .collect();
            let max_n = runs
                .iter()
                .map(|t| t.strategy.world_size())
                .max()
                .unwrap_or(2);
            let max_y = runs
                .iter()
                .map(|t| t.samples_per_second)
                .fold(1.0, f64::max)
                * 1.2;
            let mut chart = ChartBuilder::on(panel)
                .caption(format!("{}: samples/s", model.name()), ("sans-serif", 18))
                .margin(10)
                .x_label_area_size(35)
                .y_label_area_size(55)
                .build_cartesian_2d(0.5f64..max_n as f64 + 0.5, 0f64..max_y)
                .map_err(|e| e.to_string())?;
            chart
                .configure_mesh()
                .x_desc("world size")
                .y_desc("samples/s")
                .x_labels(max_n)
                .draw()
                .map_err(|e| e.to_string())?;
            let families = [
                "plain Burn, 1 device",
                "Burn MultiDevice",
                "burn-ddp threads",
                "burn-ddp processes (TCP)",
            ];
            for (i, family) in families.iter().enumerate() {
                let mut points: Vec<(f64, f64)> = runs
                    .iter()
                    .filter(|t| t.strategy.family() == *family)
                    .map(|t| (t.strategy.world_size() as f64, t.samples_per_second))
                    .collect();
                points.sort_by(|a, b| a.0.total_cmp(&b.0));
                if points.is_empty() {
                    continue;
                }
                let color = Palette99::pick(i).to_rgba();
                chart
                    .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))
                    .map_err(|e| e.to_string())?
                    .label(*family)
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color));
                chart
                    .draw_series(points.iter().map(|p| Circle::new(*p, 4, color.filled())))
                    .map_err(|e| e.to_string())?;
            }
            chart
                .configure_series_labels()
                .background_style(WHITE.mix(0.8))
                .border_style(BLACK)
                .position(SeriesLabelPosition::LowerRight)
                .draw()
                .map_err(|e| e.to_string())?;
        }
        root.present().map_err(|e| e.to_string())
    }

    fn plot_split(&self, path: &Path) -> Result<(), String> {
        let runs: Vec<&Throughput> = self
            .throughput
            .iter()
            .filter(|t| t.split.is_some())
            .collect();
        let root = SVGBackend::new(path, (960, 420)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        let max_y = runs
            .iter()
            .filter_map(|t| t.split.as_ref())
            .map(|s| {
                s.compute_ms
                    + s.flatten_ms
                    + s.all_reduce_ms
                    + s.unflatten_ms
                    + s.agreement_ms
                    + s.optimizer_ms
            })
            .fold(1.0, f64::max)
            * 1.15;
        let mut chart = ChartBuilder::on(&root)
            .caption(
                "burn-ddp step time split (rank 0, ms per step)",
                ("sans-serif", 18),
            )
            .margin(10)
            .x_label_area_size(60)
            .y_label_area_size(55)
            .build_cartesian_2d(0f64..runs.len().max(1) as f64, 0f64..max_y)
            .map_err(|e| e.to_string())?;
        let labels: Vec<String> = runs
            .iter()
            .map(|t| {
                format!(
                    "{} {} N={}",
                    t.model.name(),
                    match t.strategy {
                        Strategy::DdpProcesses(_) => "proc",
                        Strategy::DdpProcessesSharded(_) => "proc-zero2",
                        Strategy::DdpMpi(_) => "mpi",
                        Strategy::DdpThreadsSharded(_) => "zero1",
                        _ => "thr",
                    },
                    t.strategy.world_size()
                )
            })
            .collect();
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(runs.len().max(1) * 2)
            .x_label_formatter(&|x| {
                let i = x.floor() as usize;
                if (x - x.floor() - 0.5).abs() < 0.26 {
                    labels.get(i).cloned().unwrap_or_default()
                } else {
                    String::new()
                }
            })
            .y_desc("ms")
            .draw()
            .map_err(|e| e.to_string())?;
        let phases = [
            "forward+backward",
            "flatten",
            "all-reduce",
            "unflatten",
            "agreement",
            "optimizer",
        ];
        for (phase, name) in phases.iter().enumerate() {
            let color = Palette99::pick(phase).to_rgba();
            let bars: Vec<Rectangle<(f64, f64)>> = runs
                .iter()
                .enumerate()
                .filter_map(|(i, t)| {
                    let s = t.split.as_ref()?;
                    let parts = [
                        s.compute_ms,
                        s.flatten_ms,
                        s.all_reduce_ms,
                        s.unflatten_ms,
                        s.agreement_ms,
                        s.optimizer_ms,
                    ];
                    let bottom: f64 = parts[..phase].iter().sum();
                    let top = bottom + parts[phase];
                    Some(Rectangle::new(
                        [(i as f64 + 0.15, bottom), (i as f64 + 0.85, top)],
                        color.filled(),
                    ))
                })
                .collect();
            chart
                .draw_series(bars)
                .map_err(|e| e.to_string())?
                .label(*name)
                .legend(move |(x, y)| {
                    Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled())
                });
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperRight)
            .draw()
            .map_err(|e| e.to_string())?;
        root.present().map_err(|e| e.to_string())
    }

    fn plot_busbw(&self, path: &Path) -> Result<(), String> {
        let root = SVGBackend::new(path, (960, 420)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        let max_y = self
            .all_reduce
            .iter()
            .map(|p| p.busbw_gbps)
            .chain(self.memcpy.iter().map(|m| m.gbps))
            .fold(1.0, f64::max)
            * 1.2;
        let min_x = self.memcpy.iter().map(|m| m.bytes).min().unwrap_or(4096) as f64;
        let max_x = self.memcpy.iter().map(|m| m.bytes).max().unwrap_or(1 << 28) as f64;
        let mut chart = ChartBuilder::on(&root)
            .caption(
                "all-reduce bus bandwidth (2 ranks) and memcpy roof",
                ("sans-serif", 18),
            )
            .margin(10)
            .x_label_area_size(40)
            .y_label_area_size(55)
            .build_cartesian_2d((min_x..max_x).log_scale(), 0f64..max_y)
            .map_err(|e| e.to_string())?;
        chart
            .configure_mesh()
            .x_desc("message size (bytes)")
            .y_desc("GB/s")
            .x_label_formatter(&|x| mib(*x as usize))
            .draw()
            .map_err(|e| e.to_string())?;
        let mut series: Vec<(String, Vec<(f64, f64)>)> = vec![(
            "memcpy (1 thread)".into(),
            self.memcpy
                .iter()
                .map(|m| (m.bytes as f64, m.gbps))
                .collect(),
        )];
        for group in GroupKind::ALL {
            let points: Vec<(f64, f64)> = self
                .all_reduce
                .iter()
                .filter(|p| p.group == group)
                .map(|p| (p.bytes as f64, p.busbw_gbps))
                .collect();
            if !points.is_empty() {
                series.push((format!("{} busbw", group.name()), points));
            }
        }
        for (i, (name, points)) in series.into_iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            chart
                .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))
                .map_err(|e| e.to_string())?
                .label(name)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color));
            chart
                .draw_series(points.iter().map(|p| Circle::new(*p, 3, color.filled())))
                .map_err(|e| e.to_string())?;
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperLeft)
            .draw()
            .map_err(|e| e.to_string())?;
        root.present().map_err(|e| e.to_string())
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
