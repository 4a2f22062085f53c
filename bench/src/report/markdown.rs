//! The benchmark's Markdown report: throughput against plain Burn, monitoring, prefetch,
//! start-up, collectives, buckets and the scaling projection, one section each.

use std::fmt::Write as _;

use super::*;

impl Results {
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
}
