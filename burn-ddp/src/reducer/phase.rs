//! One reduction of a set of buckets, on the host or on the device. A reducer holds the part its
//! process group needs ([`Buckets`]); a step reduces the agreed buckets, and sometimes a second
//! phase of newly trainable tensors; the phases' control words, checks and gradients are then
//! read back the same way whichever part reduced them.

use burn::optim::GradientsParams;
use burn::tensor::backend::Backend;

use super::checks::{Observed, Verdict};
use super::device::{DeviceBuckets, DevicePhase, DeviceRead, observe_device};
use super::gradients::Work;
use super::host::{HostBuckets, HostPhase};
use super::layout::BucketLayout;
use super::link::Link;
use super::options::{Control, ReduceOptions};
use crate::error::Result;
use crate::group::ReduceOp;
use crate::replica::TensorSpec;

/// Where a reducer's buckets are reduced: host buffers through the communication hook (the CPU
/// process groups), or device tensors (a group that
/// [reduces device tensors](crate::group::ProcessGroup::reduces_device_tensors): NCCL).
pub(super) enum Buckets {
    Host(HostBuckets),
    Device(DeviceBuckets),
}

/// One phase's reduced buckets.
pub(super) enum Phase<B: Backend> {
    Host(HostPhase),
    Device(DevicePhase<B>, DeviceRead),
}

impl Buckets {
    /// Forgets what belonged to the previous agreed layout.
    pub fn clear(&mut self) {
        match self {
            Buckets::Host(host) => host.clear(),
            Buckets::Device(device) => device.clear(),
        }
    }

    /// Reduces `work` over the ranks; device buckets are read back at once (flags, control
    /// words, the checks' inputs).
    pub fn reduce<B: Backend>(
        &mut self,
        link: &mut Link,
        work: Work<'_, B>,
        options: &ReduceOptions,
        device: &B::Device,
    ) -> Result<Phase<B>> {
        let layout = work.layout;
        Ok(match self {
            Buckets::Host(host) => Phase::Host(host.reduce::<B>(link, work, options, device)?),
            Buckets::Device(buckets) => {
                let phase = buckets.reduce::<B>(link, work, options, device)?;
                let read = phase.read(layout, options, link.rank())?;
                Phase::Device(phase, read)
            }
        })
    }

    /// Keeps an agreed phase's host buffers for the next step (its gradients are not used: not
    /// finite).
    pub fn keep<B: Backend>(&mut self, phase: Phase<B>) {
        if let (Buckets::Host(host), Phase::Host(phase)) = (self, phase) {
            host.keep(phase.buffers);
        }
    }

    /// Writes one phase's reduced gradients (times `scale`) into `grads` (host buckets: those
    /// `keep` keeps, [`ReduceOptions::keep`](super::ReduceOptions::keep)); keeps an agreed host
    /// phase's buffers for the next step. `work`: the phase's layout, parameters, and whether the
    /// layout is the agreed one.
    #[allow(clippy::too_many_arguments)]
    pub fn unflatten<B: Backend>(
        &mut self,
        link: &mut Link,
        phase: Phase<B>,
        work: (&BucketLayout, &[TensorSpec], bool),
        grads: &mut GradientsParams,
        scale: f32,
        keep: Option<&[bool]>,
        device: &B::Device,
    ) -> Result<()> {
        let (layout, specs, agreed) = work;
        match phase {
            Phase::Host(phase) => {
                let rank = link.rank();
                let (buffers, written) =
                    phase.unflatten::<B>(layout, specs, grads, scale, keep, device, rank)?;
                link.stats.transfers_to_device += written;
                if let (Buckets::Host(host), true) = (self, agreed) {
                    host.keep(buffers);
                }
            }
            Phase::Device(phase, read) => {
                phase.unflatten(layout, specs, grads, &read.flags, scale);
            }
        }
        Ok(())
    }
}

impl<B: Backend> Phase<B> {
    /// The reduced control words, with `caller` words of the caller's.
    pub fn control(&self, layout: &BucketLayout, caller: usize) -> Option<Control> {
        match self {
            Phase::Host(host) => host.control(layout, caller),
            Phase::Device(_, read) => read.control.clone(),
        }
    }
}

/// The verdict over a step's phases (in bucket order), and whether this rank's own gradients
/// held NaN or infinity. Device reductions need not be deterministic: every rank decides on the
/// average of their checks (one small host all-reduce).
///
/// # Errors
/// The all-reduce's errors.
pub(super) fn verdict<B: Backend>(
    link: &Link,
    phases: &[(&Phase<B>, &BucketLayout)],
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
