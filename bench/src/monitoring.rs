//! What burn-ddp's per-step monitoring costs: the clock readings of a step
//! (`StepTimes`: three `Instant::now`) and `SyncWatch::observe` (the spike detector and the
//! histogram behind `RankReport::sync`), timed alone over many steps, as a share of a step.
//! A training A/B cannot resolve it: the rounds of one strategy spread by ±10% on this machine.

use std::hint::black_box;
use std::time::{Duration, Instant};

use burn_ddp::mechanism::SyncWatch;
use serde::{Deserialize, Serialize};

/// The monitoring's cost per step.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MonitoringCost {
    /// Nanoseconds per step, median over the rounds.
    pub per_step_ns: f64,
    /// Each round's nanoseconds per step.
    pub rounds: Vec<f64>,
}

/// Times `steps` steps' monitoring, `rounds` times.
pub fn measure(rounds: usize, steps: u64) -> MonitoringCost {
    let mut per_round: Vec<f64> = (0..rounds.max(1))
        .map(|_| {
            let mut watch = SyncWatch::new(3.0);
            let started = Instant::now();
            for step in 0..steps {
                // The step's clock readings (start, after compute, after the optimizer).
                let begin = black_box(Instant::now());
                let _computed = black_box(Instant::now());
                let _ended = black_box(Instant::now());
                // A synchronisation time around 1 ms, never a spike (no log line).
                let took = Duration::from_micros(1000 + step % 7) + begin.elapsed() / 1000;
                black_box(watch.observe(0, step, took));
            }
            started.elapsed().as_nanos() as f64 / steps as f64
        })
        .collect();
    let rounds = per_round.clone();
    per_round.sort_by(f64::total_cmp);
    MonitoringCost {
        per_step_ns: per_round[per_round.len() / 2],
        rounds,
    }
}
