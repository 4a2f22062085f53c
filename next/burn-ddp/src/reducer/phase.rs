//! One reduction of a set of buckets, on the host or on the device. A reducer holds the part its
//! process group needs ([`Buckets`]); a step reduces the agreed buckets, and sometimes a second
//! phase of newly trainable tensors; the phases' control words, checks and gradients are then
//! read back the same way whichever part reduced them.

use burn::optim::GradientsParams;
use burn::tensor::Device;

use super::checks::{Observed, Verdict};
use super::device::{DeviceBuckets, DevicePhase, DeviceRead, observe_device};
use super::gradients::Work;
use super::host::{HostBuckets, HostPhase};
use super::layout::BucketLayout;
use super::link::Link;
use super::options::{Control, ReduceOptions};
use super::scatter::ScatterPhase;
use super::shared::{Shared, SharedBuckets, SharedPhase};
use crate::error::Result;
use crate::replica::TensorSpec;
use burn_ddp_comm::group::ReduceOp;

/// Where a reducer's buckets are reduced: host buffers through the communication hook (the CPU
/// process groups), device tensors (a group that
/// [reduces device tensors](burn_ddp_comm::group::ProcessGroup::reduces_device_tensors): NCCL), or
/// tensors shared by reference between thread replicas on one device (until the first step
/// finds the ranks cannot share: then host buffers).
pub(super) enum Buckets {
    Host(HostBuckets),
    Device(DeviceBuckets),
    Shared(SharedBuckets),
}

/// One phase's reduced buckets.
pub(super) enum Phase {
    Host(HostPhase),
    Scatter(ScatterPhase),
    Device(DevicePhase, DeviceRead),
    Shared(SharedPhase),
}

impl Buckets {
    /// Forgets what belonged to the previous agreed layout.
    pub fn clear(&mut self) {
        match self {
            Buckets::Host(host) => host.clear(),
            Buckets::Shared(shared) => shared.host.iter_mut().for_each(HostBuckets::clear),
            Buckets::Device(device) => device.clear(),
        }
    }

    /// Reduces `work` over the ranks; device buckets are read back at once (flags, control
    /// words, the checks' inputs).
    pub fn reduce(
        &mut self,
        link: &mut Link,
        work: Work<'_>,
        options: &ReduceOptions,
        device: &Device,
    ) -> Result<Phase> {
        let layout = work.layout;
        let phase = match self {
            Buckets::Host(host) => {
                let transfer = host.transfer(device);
                let scattered = host
                    .scatter
                    .as_mut()
                    .is_some_and(|scatter| scatter.takes(link, &work, options));
                match host.scatter.as_mut() {
                    Some(scatter) if scattered => {
                        Phase::Scatter(scatter.reduce(link, work, options, transfer, device)?)
                    }
                    _ => Phase::Host(host.reduce(link, work, options, device)?),
                }
            }
            Buckets::Device(buckets) => {
                let phase = buckets.reduce(link, work, options, device)?;
                let read = phase.read(layout, options, link.rank())?;
                Phase::Device(phase, read)
            }
            Buckets::Shared(shared) => match shared.reduce(link, work, options, device)? {
                Shared::Reduced(phase) => Phase::Shared(phase),
                Shared::Apart(work) => {
                    // Every rank saw the same answer: all use host buckets from now on.
                    if let Some(host) = shared.host.take() {
                        *self = Buckets::Host(host);
                        return self.reduce(link, work, options, device);
                    }
                    return Err(link.fail_bucket(0, "no host buckets to fall back on".into()));
                }
            },
        };
        let stats = &mut link.stats;
        *match phase {
            Phase::Host(_) => &mut stats.host_phases,
            Phase::Scatter(_) => &mut stats.scattered_phases,
            Phase::Device(..) => &mut stats.device_phases,
            Phase::Shared(_) => &mut stats.shared_phases,
        } += 1;
        Ok(phase)
    }

    /// Keeps an agreed phase's host buffers for the next step (its gradients are not used: not
    /// finite).
    pub fn keep(&mut self, phase: Phase) {
        match (self, phase) {
            (Buckets::Host(host), Phase::Host(phase)) => host.keep(phase.buffers),
            (Buckets::Host(host), Phase::Scatter(phase)) => {
                if let Some(scatter) = &mut host.scatter {
                    scatter.keep(phase);
                }
            }
            _ => {}
        }
    }

    /// Writes one phase's reduced gradients (times `scale`) into `grads` (host buckets: those
    /// `keep` keeps, [`ReduceOptions::keep`](super::ReduceOptions::keep)); keeps an agreed host
    /// phase's buffers for the next step. `work`: the phase's layout, parameters, and whether the
    /// layout is the agreed one.
    #[allow(clippy::too_many_arguments)]
    pub fn unflatten(
        &mut self,
        link: &mut Link,
        phase: Phase,
        work: (&BucketLayout, &[TensorSpec], bool),
        grads: &mut GradientsParams,
        scale: f32,
        keep: Option<&[bool]>,
        device: &Device,
    ) -> Result<()> {
        let (layout, specs, agreed) = work;
        match phase {
            Phase::Host(phase) => {
                let rank = link.rank();
                let (buffers, written) =
                    phase.unflatten(layout, specs, grads, scale, keep, device, rank)?;
                link.stats.transfers_to_device += written;
                if let (Buckets::Host(host), true) = (self, agreed) {
                    host.keep(buffers);
                }
            }
            Phase::Device(phase, read) => {
                phase.unflatten(layout, specs, grads, &read.flags, scale);
            }
            Phase::Shared(phase) => phase.unflatten(layout, specs, grads, scale, keep),
            Phase::Scatter(phase) => {
                let rank = link.rank();
                if let Buckets::Host(HostBuckets {
                    scatter: Some(scatter),
                    ..
                }) = self
                {
                    let written =
                        scatter.unflatten(phase, specs, grads, scale, keep, device, rank)?;
                    link.stats.transfers_to_device += written;
                }
            }
        }
        Ok(())
    }
}

impl Phase {
    /// The reduced control words, with `caller` words of the caller's.
    pub fn control(&self, layout: &BucketLayout, caller: usize) -> Option<Control> {
        match self {
            Phase::Host(host) => host.control(layout, caller),
            Phase::Device(_, read) => read.control.clone(),
            Phase::Shared(shared) => shared.control(caller),
            Phase::Scatter(scatter) => scatter.control(caller),
        }
    }
}

/// The verdict over a step's phases (in bucket order), and whether this rank's own gradients
/// held NaN or infinity. Device reductions need not be deterministic: every rank decides on the
/// average of their checks (one small host all-reduce).
///
/// # Errors
/// The all-reduce's errors.
pub(super) fn verdict(
    link: &Link,
    phases: &[(&Phase, &BucketLayout)],
    options: &ReduceOptions,
) -> Result<(Verdict, bool)> {
    let mut observed = Observed::default();
    let mut local_non_finite = false;
    let mut device_checks: Vec<(Vec<f32>, usize)> = Vec::new();
    for (phase, layout) in phases {
        match phase {
            Phase::Host(host) => {
                let o = host.observe(layout, options);
                observed.non_finite |= o.non_finite;
                observed.sum_of_squares += o.sum_of_squares;
                local_non_finite |= host.local_non_finite;
            }
            Phase::Device(_, read) => {
                device_checks.push((read.checks.clone(), layout.buckets().len()));
                local_non_finite |= read.local_non_finite;
            }
            Phase::Scatter(scatter) => {
                observed.non_finite |= scatter.observed.non_finite;
                observed.sum_of_squares += scatter.observed.sum_of_squares;
                local_non_finite |= scatter.local_non_finite;
            }
            Phase::Shared(shared) => {
                observed.non_finite |= shared.observed.non_finite;
                observed.sum_of_squares += shared.observed.sum_of_squares;
                // Read only for a step that will be skipped or reported.
                if options.check_finite && shared.observed.non_finite {
                    local_non_finite |= shared.local_non_finite();
                }
            }
        }
    }
    if !device_checks.is_empty() {
        let mut all: Vec<f32> = device_checks.iter().flat_map(|(c, _)| c.clone()).collect();
        if !all.is_empty() {
            link.group
                .all_reduce(&mut all, ReduceOp::Avg, link.timeout)?;
        }
        let mut rest = all.as_slice();
        for (checks, buckets) in &device_checks {
            let (mine, after) = rest.split_at(checks.len());
            let o = observe_device(mine, *buckets, options);
            observed.non_finite |= o.non_finite;
            observed.sum_of_squares += o.sum_of_squares;
            rest = after;
        }
    }
    Ok((Verdict::of(observed, options), local_non_finite))
}
