//! What the seed tells users to watch, measured on each rank while it trains: the distribution of
//! its gradient synchronisation times, with the spikes that are a sign of congestion (or of a
//! straggling rank), and the process's peak memory. (The device memory of a CUDA rank, which the
//! root crate reads from CubeCL 0.10's client, follows with the strategy: CubeCL 0.11's client
//! reports it otherwise.)
//!
//! A synchronisation is a **spike** when it takes more than `factor` times the median of the
//! previous [`WINDOW`] synchronisations (once [`WARM_UP`] of them have been seen): counted, and
//! the first [`WARNINGS`] are logged naming the rank, the step and the times. The distribution is
//! kept in a histogram with eight buckets per doubling (quantiles within 9% above 10 µs, 14% at
//! 2 µs), so a run of any
//! length costs a fixed 3 KiB and a few hundred nanoseconds per step.

use std::collections::VecDeque;
use std::time::Duration;

use crate::metrics::SyncTimes;

/// Synchronisations the running median looks back on.
pub(crate) const WINDOW: usize = 64;
/// Synchronisations seen before any can be a spike.
pub(crate) const WARM_UP: usize = 8;
/// Spikes logged per rank; the rest are counted.
pub(crate) const WARNINGS: u64 = 3;
/// Histogram buckets per doubling of the time.
const PER_OCTAVE: f64 = 8.0;
/// Buckets: microseconds from 1 to 2^48.
const BUCKETS: usize = 48 * 8;

/// One rank's gradient-synchronisation times: their distribution (a histogram with eight buckets
/// per doubling) and the spikes, a time over `factor` times the median of the previous 64 once 8
/// were seen (the first three per watch logged as warnings). What
/// [`RankReport::sync`](crate::metrics::RankReport::sync) reports; public for the benchmark's
/// measure of its cost.
pub struct SyncWatch {
    factor: f64,
    recent: VecDeque<Duration>,
    histogram: Vec<u64>,
    count: u64,
    max: Duration,
    spikes: u64,
}

impl SyncWatch {
    /// A watch calling spikes at `factor` times the running median (`factor` > 1, as
    /// [`DdpConfig::with_spike_factor`](crate::DdpConfig::with_spike_factor) checks).
    pub fn new(factor: f64) -> Self {
        Self {
            factor,
            recent: VecDeque::with_capacity(WINDOW),
            histogram: vec![0; BUCKETS],
            count: 0,
            max: Duration::ZERO,
            spikes: 0,
        }
    }

    /// Files the time of gradient synchronisation `step` of `rank`; returns whether it was a
    /// spike.
    pub fn observe(&mut self, rank: usize, step: u64, took: Duration) -> bool {
        let spike = self.recent.len() >= WARM_UP && {
            let median = median(&self.recent);
            let spike = took.as_secs_f64() > self.factor * median.as_secs_f64();
            if spike {
                self.spikes += 1;
                if self.spikes <= WARNINGS {
                    // To the console as well as to `tracing` (burn-train sends `tracing` to
                    // its experiment.log only): the docs promise the user sees these.
                    burn_ddp_comm::log::warn_console(&format!(
                        "rank {rank}: gradient synchronisation #{step} took {took:.1?}, \
                         {:.1}x the median of the last {} ({median:.1?}): congestion or a slow \
                         rank{}",
                        took.as_secs_f64() / median.as_secs_f64().max(f64::MIN_POSITIVE),
                        self.recent.len(),
                        if self.spikes == WARNINGS {
                            " (further spikes are counted in the report, not logged)"
                        } else {
                            ""
                        }
                    ));
                }
            }
            spike
        };
        if self.recent.len() == WINDOW {
            self.recent.pop_front();
        }
        self.recent.push_back(took);
        self.histogram[bucket(took)] += 1;
        self.count += 1;
        self.max = self.max.max(took);
        spike
    }

    /// The distribution so far.
    pub fn times(&self) -> SyncTimes {
        SyncTimes {
            count: self.count,
            median: self.quantile(0.5),
            p90: self.quantile(0.9),
            max: self.max,
            spikes: self.spikes,
            spike_factor: self.factor,
        }
    }

    /// The `q` quantile (0 to 1), as the upper bound of its histogram bucket (at most `max`).
    fn quantile(&self, q: f64) -> Duration {
        if self.count == 0 {
            return Duration::ZERO;
        }
        let rank = ((q * self.count as f64).ceil() as u64).clamp(1, self.count);
        let mut seen = 0;
        for (index, &n) in self.histogram.iter().enumerate() {
            seen += n;
            if seen >= rank {
                let upper = 2f64.powf((index + 1) as f64 / PER_OCTAVE) - 1.0;
                return Duration::from_secs_f64(upper / 1e6).min(self.max);
            }
        }
        self.max
    }
}

fn bucket(took: Duration) -> usize {
    let micros = took.as_secs_f64() * 1e6;
    ((PER_OCTAVE * (micros + 1.0).log2()) as usize).min(BUCKETS - 1)
}

fn median(times: &VecDeque<Duration>) -> Duration {
    let mut sorted: Vec<Duration> = times.iter().copied().collect();
    sorted.sort_unstable();
    sorted[sorted.len() / 2]
}

/// The process's peak resident memory in bytes (`VmHWM` of `/proc/self/status`, Linux); `None`
/// where the system does not tell.
pub(crate) fn peak_resident_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line
        .trim_start_matches("VmHWM:")
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    kib.checked_mul(1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: f64) -> Duration {
        Duration::from_secs_f64(v / 1e3)
    }

    #[test]
    fn a_step_over_the_factor_times_the_running_median_is_a_spike_after_the_warm_up() {
        let mut watch = SyncWatch::new(3.0);
        // During the warm-up nothing is a spike, however slow.
        for step in 0..WARM_UP as u64 {
            assert!(!watch.observe(0, step, if step == 2 { ms(100.0) } else { ms(4.0) }));
        }
        assert!(
            !watch.observe(0, 8, ms(11.9)),
            "under 3x the median of 4 ms"
        );
        assert!(watch.observe(0, 9, ms(12.1)), "over 3x the median of 4 ms");
        for step in 10..20 {
            watch.observe(0, step, ms(4.0));
        }
        assert!(watch.observe(0, 20, ms(50.0)));
        let times = watch.times();
        assert_eq!(times.count, 21);
        assert_eq!(times.spikes, 2);
        assert_eq!(times.max, ms(100.0));
        assert_eq!(times.spike_factor, 3.0);
    }

    #[test]
    fn quantiles_are_within_a_ninth_of_the_true_values() {
        let mut watch = SyncWatch::new(1e9);
        // 1, 2, ..., 1000 ms: median 500 ms, p90 900 ms.
        for (step, v) in (1..=1000).enumerate() {
            watch.observe(1, step as u64, ms(v as f64));
        }
        let times = watch.times();
        let within = |got: Duration, want: f64| {
            let got = got.as_secs_f64() * 1e3;
            assert!(got >= want && got <= want * 1.1, "{got} ms for {want} ms");
        };
        within(times.median, 500.0);
        within(times.p90, 900.0);
        assert_eq!(times.max, ms(1000.0));
        assert_eq!(times.spikes, 0);
        assert_eq!(SyncWatch::new(3.0).times().median, Duration::ZERO);
    }

    #[test]
    fn the_peak_memory_of_this_process_is_read_on_linux() {
        if cfg!(target_os = "linux") {
            let peak = peak_resident_bytes().expect("VmHWM on Linux");
            // A test process holds at least a megabyte and less than the machine.
            assert!(peak > 1 << 20 && peak < 1 << 40, "{peak}");
        }
    }
}
