//! Which reduction a case ran, read from every rank's counters (`CommStats`'s phases by path),
//! so that a path is never silently untested: tensors shared between thread ranks on one device
//! (the default), host buckets all-reduced (thread ranks with sharing off, TCP ranks), or, under
//! ZeRO-2, host buckets reduce-scattered by owner or their fallback, the all-reduce (taken when
//! the owners' blocks would send more than an all-reduce: one owner with over twice the average
//! share). Each case must run a path its configuration allows, and the fixed core must run every
//! path at least once.

use burn_ddp::metrics::CommStats;

use super::cases::{Case, Model, Transport};

/// The reduction a case ran (on every rank alike).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Ran {
    /// One rank: the gradients handed back as they are (some control words reduced).
    Alone,
    Shared,
    Host,
    Scattered,
    /// ZeRO-2 configured, the owners' blocks too uneven: all-reduced through host buckets.
    ScatterFallback,
}

impl Ran {
    /// Every path the core must run.
    pub(super) const ALL: [Ran; 5] = [
        Ran::Alone,
        Ran::Shared,
        Ran::Host,
        Ran::Scattered,
        Ran::ScatterFallback,
    ];
}

/// The path every rank of `case`'s reporting leg (a resumed leg's world and sharding) ran, if
/// the case allows it.
pub(super) fn reduced_as_configured(case: &Case, comm: &[CommStats]) -> Result<Ran, String> {
    let world = case.reporting_world();
    if comm.len() != world {
        return Err(format!(
            "{} ranks' counters for a world of {world}",
            comm.len()
        ));
    }
    let scattered = case.reporting_zero2();
    // A step whose trainable tensors changed reduces the newly trained ones in a second phase,
    // all-reduced through host buckets beside the reduce-scatter.
    let changes_trained = matches!(case.model, Model::Unfrozen | Model::FreezesAfterStep);
    let mut ran = None;
    for (rank, c) in comm.iter().enumerate() {
        let this = match (world, case.transport) {
            // The reducer hands one rank's gradients back as they are, but for the end-of-data
            // checks, join mode's agreements and steps whose trainable tensors changed.
            (1, _) if c.device_phases == 0 => Some(Ran::Alone),
            (1, _) => None,
            _ if c.device_phases > 0 => None,
            (_, Transport::Threads)
                if c.shared_phases > 0 && c.host_phases == 0 && c.scattered_phases == 0 =>
            {
                Some(Ran::Shared)
            }
            (_, Transport::Threads) => None,
            _ if c.shared_phases > 0 => None,
            _ if !scattered && c.host_phases > 0 && c.scattered_phases == 0 => Some(Ran::Host),
            // A second phase at each step whose trainable tensors changed, no other.
            _ if scattered
                && c.scattered_phases > 0
                && (c.host_phases == 0
                    || (changes_trained && c.host_phases <= c.layout_changes)) =>
            {
                Some(Ran::Scattered)
            }
            _ if scattered && c.host_phases > 0 && c.scattered_phases == 0 => {
                Some(Ran::ScatterFallback)
            }
            _ => None,
        };
        let Some(this) = this.filter(|this| ran.is_none_or(|ran| ran == *this)) else {
            return Err(format!(
                "rank {rank} reduced {} times shared, {} through host buckets, {} reduce-scattered \
                 and {} through device buckets (rank 0's path: {ran:?}); the case configures \
                 {world} rank(s) over {:?}{}",
                c.shared_phases,
                c.host_phases,
                c.scattered_phases,
                c.device_phases,
                case.transport,
                if scattered { " with ZeRO-2" } else { "" }
            ));
        };
        ran = Some(this);
    }
    ran.ok_or_else(|| "no rank's counters".to_string())
}
