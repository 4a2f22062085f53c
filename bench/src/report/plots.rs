//! The benchmark's SVG plots: throughput, the step's split into its phases, and the
//! collectives' bus bandwidth.

use plotters::prelude::*;

use super::*;

impl Results {
    pub(super) fn plot_throughput(&self, path: &Path) -> Result<(), String> {
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

    pub(super) fn plot_split(&self, path: &Path) -> Result<(), String> {
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

    pub(super) fn plot_busbw(&self, path: &Path) -> Result<(), String> {
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
