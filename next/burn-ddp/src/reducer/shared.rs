//! Shared buckets, for thread replicas on one device: the ranks' gradient tensors are handed to
//! each other by reference ([`all_gather_shared`](burn_ddp_comm::group::ExtendedCollectives::all_gather_shared):
//! an `Arc` clone, no byte copied), each rank sums the gradients of the parameters it owns over
//! every rank with the backend's own tensor ops, and every rank takes the owners' reduced tensors
//! as they are. Nothing is flattened into a host buffer or copied back out of one, and each
//! parameter's reduction is computed once, by its owner, with the work spread over the ranks.
//!
//! A step is two exchanges: this rank's contribution (its device, gradients, weight and control
//! words), then each owner's reduced gradients with the inputs of the checks (per parameter:
//! the NaN probe and, when clipping, the largest magnitude and the scaled sum of squares, read to
//! the host in one transfer). Every rank then sums the control words, the presence of each
//! gradient and the checks in rank and bucket order, so every rank reaches the same verdict, as
//! from a host bucket. The owners are [`balance`](crate::partition::balance)d by bytes over the
//! parameters in registration order, the rule optimizer-state sharding uses, so under sharding
//! an owner reduces the gradients its optimizer steps (until the trainable tensors change:
//! sharding keeps its owners for the run, this balance follows the agreed parameters; the
//! results do not depend on who reduces).
//!
//! The values are the average of the same gradients as the host buckets', summed in rank order
//! (the host buckets start each chunk at another rank): equal up to the rounding of the sum.
//!
//! A group whose ranks are not threads of one process (the exchange answers `None`), or ranks on
//! different devices, fall back to the host buckets at the first step, every rank alike.

use std::sync::Arc;
use std::time::Instant;

use burn::optim::GradientsParams;
use burn::tensor::{Device, FloatDType, Tensor};

use super::checks::Observed;
use super::device::non_finite_probe;
use super::gradients::{Gradients, Work, register_shaped};
use super::host::HostBuckets;
use super::layout::BucketLayout;
use super::link::Link;
use super::options::{Control, ReduceOptions};
use crate::error::Result;
use crate::replica::TensorSpec;
use burn_ddp_comm::group::{ExtendedCollectives, ReduceOp, SharedValue};

/// The shared buckets of a reducer, with the host buckets it falls back on (taken then).
pub(super) struct SharedBuckets {
    pub host: Option<HostBuckets>,
}

/// What [`SharedBuckets::reduce`] did: reduced `work` by sharing, or handed it back because the
/// ranks cannot share tensors (the reducer then uses its host buckets from now on).
pub(super) enum Shared<'a> {
    Reduced(SharedPhase),
    Apart(Work<'a>),
}

/// One rank's contribution to a shared step.
struct Contribution {
    device: Device,
    /// Per bucket, per parameter: this rank's flattened gradient.
    grads: Gradients,
    /// The weight of this rank's gradients ([`ReduceOptions::weight`]).
    weight: f32,
    /// The control words (the step's first phase), else empty.
    control: Vec<f32>,
}

/// One owner's part of a shared step: its parameters' reduced gradients and their checks.
#[derive(Default)]
struct Owned {
    /// Per parameter position (bucket order) this rank owns and some rank had a gradient for.
    grads: Vec<(usize, Tensor<1>)>,
    /// Per such position: the NaN probe (with `check_finite`), then `max |v|` and the sum of
    /// `(v / max)^2` (when clipping).
    checks: Vec<f32>,
    /// The ranks are on different devices: nothing was reduced.
    apart: bool,
}

/// One phase reduced by sharing.
pub(super) struct SharedPhase {
    /// The reduced control words (all of them, the caller's included).
    control: Vec<f32>,
    /// Per parameter position (bucket order): the reduced gradient, when some rank had one.
    reduced: Vec<Option<Tensor<1>>>,
    /// The checks over every owner's gradients, in rank and bucket order.
    pub observed: Observed,
    /// This rank's own contribution, for [`local_non_finite`](Self::local_non_finite).
    own: Arc<Contribution>,
}

impl SharedBuckets {
    /// Reduces `work` by sharing tensors with the other ranks (see the module's documentation):
    /// one two-phase [`all_gather_shared`](ExtendedCollectives::all_gather_shared).
    ///
    /// # Errors
    /// The collective's errors; [`DdpError::Device`] when the device fails to finish this rank's
    /// work before it is shared; [`DdpError::Bucket`] when the checks cannot be read back.
    pub fn reduce<'a>(
        &mut self,
        link: &mut Link,
        work: Work<'a>,
        options: &ReduceOptions,
        device: &Device,
    ) -> Result<Shared<'a>> {
        if !crate::replica::shares_plain_values(device) {
            // A device handle cannot cross threads under Burn's fusion: the host buckets
            // (every rank has the same backend, so every rank decides alike, without a word).
            return Ok(Shared::Apart(work));
        }
        let started = Instant::now();
        // No device sync: the backends that get here compute as they are called.
        let own = Arc::new(Contribution {
            device: device.clone(),
            grads: work.taken.clone(),
            weight: options.weight,
            control: work.control.map(Control::words).unwrap_or_default(),
        });
        let (group, timeout) = (link.group.clone(), link.timeout);
        let mut failed = None;
        let mut then = |values: &[SharedValue]| -> SharedValue {
            match own_part(link, values, (work.layout, work.specs), options, device) {
                Ok(part) => Arc::new(part),
                Err(err) => {
                    // The group is aborted: the peers stop at the next barrier.
                    failed = Some(err);
                    Arc::new(Owned::default())
                }
            }
        };
        let gathered = group.all_gather_shared(own.clone(), Some(&mut then), timeout);
        if let Some(err) = failed {
            return Err(err);
        }
        let Some((values, results)) = gathered? else {
            return Ok(Shared::Apart(work));
        };
        let all = downcast_all::<Contribution>(link, values)?;
        let every = downcast_all::<Owned>(link, results)?;
        if every.iter().any(|part| part.apart) {
            // Every rank found the same devices.
            return Ok(Shared::Apart(work));
        }
        let positions = positions(work.layout);
        let mut reduced: Vec<Option<Tensor<1>>> = vec![None; positions.len()];
        let mut checks: Vec<Vec<f32>> = vec![Vec::new(); positions.len()];
        let per = check_words(options);
        for part in &every {
            for (k, (position, grad)) in part.grads.iter().enumerate() {
                reduced[*position] = Some(grad.clone());
                checks[*position] = part.checks[k * per..(k + 1) * per].to_vec();
            }
        }
        let observed = observe(&checks, options);
        let control = sum_words(all.iter().map(|c| c.control.as_slice()), options.op);
        link.stats.all_reduce += started.elapsed();
        link.stats.buckets += work.layout.buckets().len() as u64;
        Ok(Shared::Reduced(SharedPhase {
            control,
            reduced,
            observed,
            own,
        }))
    }
}

/// This rank's share of a shared step, from every rank's contribution: the reduced gradients of
/// the parameters it owns and their checks, computed before they go to the other ranks. Marked
/// `apart` (nothing reduced) when the ranks are on different devices: every rank finds the same.
///
/// # Errors
/// As [`SharedBuckets::reduce`] (after aborting the group).
fn own_part(
    link: &mut Link,
    values: &[SharedValue],
    (layout, specs): (&BucketLayout, &[TensorSpec]),
    options: &ReduceOptions,
    device: &Device,
) -> Result<Owned> {
    let rank = link.rank();
    let all = downcast_all::<Contribution>(link, values.to_vec())?;
    if all.iter().any(|c| c.device != *device) {
        return Ok(Owned {
            apart: true,
            ..Owned::default()
        });
    }
    let positions = positions(layout);
    let owners = owners(layout, specs, all.len());
    let grads = reduce_owned(&all, &positions, &owners, rank, options);
    let checks = read_checks(link, &grads, options)?;
    Ok(Owned {
        grads,
        checks,
        apart: false,
    })
}

impl SharedPhase {
    /// The reduced control words, with `caller` words of the caller's.
    pub fn control(&self, caller: usize) -> Option<Control> {
        Control::from_words(&self.control, caller)
    }

    /// Whether this rank's own gradients held NaN or infinity (read only when a reduced value
    /// did not, so a step pays for it only when it is skipped).
    pub fn local_non_finite(&self) -> bool {
        let probes: Vec<Tensor<1>> = self
            .own
            .grads
            .iter()
            .flatten()
            .flatten()
            .map(|g| non_finite_probe(g.clone()))
            .collect();
        if probes.is_empty() {
            return false;
        }
        Tensor::cat(probes, 0)
            .cast(FloatDType::F32)
            .into_data()
            .convert::<f32>()
            .try_to_vec::<f32>()
            .map_or(true, |v| v.iter().any(|p| !p.is_finite()))
    }

    /// Writes the reduced gradients (times `scale`) into `grads`, leaving out the parameters no
    /// rank had a gradient for and those `keep` leaves out.
    pub fn unflatten(
        self,
        layout: &BucketLayout,
        specs: &[TensorSpec],
        grads: &mut GradientsParams,
        scale: f32,
        keep: Option<&[bool]>,
    ) {
        for ((bucket, j), reduced) in positions(layout).into_iter().zip(self.reduced) {
            let spec = &specs[layout.buckets()[bucket].params[j]];
            let Some(reduced) = reduced else { continue };
            if keep.is_some_and(|keep| !keep.get(spec.index).copied().unwrap_or(true)) {
                continue;
            }
            let reduced = if scale == 1.0 {
                reduced
            } else {
                reduced.mul_scalar(scale)
            };
            register_shaped(grads, spec, reduced);
        }
    }
}

/// Every parameter position of `layout`: (bucket, place in the bucket), in bucket order.
fn positions(layout: &BucketLayout) -> Vec<(usize, usize)> {
    layout
        .buckets()
        .iter()
        .enumerate()
        .flat_map(|(b, bucket)| (0..bucket.params.len()).map(move |j| (b, j)))
        .collect()
}

/// The owner of each parameter position of `layout`: the parameters balanced by bytes in
/// registration order (`specs`' order), as optimizer-state sharding balances its trainable ones.
fn owners(layout: &BucketLayout, specs: &[TensorSpec], world_size: usize) -> Vec<usize> {
    let sizes: Vec<u64> = specs
        .iter()
        .map(|s| (s.numel() * s.element_bytes) as u64)
        .collect();
    let (of_spec, _) = crate::partition::balance(&sizes, world_size);
    positions(layout)
        .into_iter()
        .map(|(b, j)| of_spec[layout.buckets()[b].params[j]])
        .collect()
}

/// This rank's owned positions reduced over every rank's contribution, in rank order: each
/// gradient times its rank's weight, summed, divided by the world size for an average.
fn reduce_owned(
    all: &[Arc<Contribution>],
    positions: &[(usize, usize)],
    owners: &[usize],
    rank: usize,
    options: &ReduceOptions,
) -> Vec<(usize, Tensor<1>)> {
    let mut owned = Vec::new();
    for (position, &(b, j)) in positions.iter().enumerate() {
        if owners[position] != rank {
            continue;
        }
        let mut sum: Option<Tensor<1>> = None;
        for contribution in all {
            let Some(grad) = contribution.grads[b][j].clone() else {
                continue;
            };
            // Summed in f32, as the host buckets sum: 16-bit gradients of several ranks would
            // overflow before the division, and the checks' floor would round to 0.
            let grad = if grad.dtype() == burn::tensor::DType::F32 {
                grad
            } else {
                grad.cast(FloatDType::F32)
            };
            let grad = if contribution.weight == 1.0 {
                grad
            } else {
                grad.mul_scalar(contribution.weight)
            };
            sum = Some(match sum {
                Some(sum) => sum.add(grad),
                None => grad,
            });
        }
        let Some(mut sum) = sum else { continue };
        if options.op == ReduceOp::Avg {
            sum = sum.div_scalar(all.len() as f32);
        }
        owned.push((position, sum));
    }
    owned
}

/// Words of checks per reduced gradient under `options`.
fn check_words(options: &ReduceOptions) -> usize {
    usize::from(options.check_finite) + 2 * usize::from(options.clip_norm.is_some())
}

/// The checks' inputs of this rank's reduced gradients, read to the host in one transfer.
///
/// # Errors
/// [`DdpError::Bucket`] when they cannot be read as `f32`.
fn read_checks(
    link: &mut Link,
    owned: &[(usize, Tensor<1>)],
    options: &ReduceOptions,
) -> Result<Vec<f32>> {
    if check_words(options) == 0 || owned.is_empty() {
        return Ok(Vec::new());
    }
    let mut parts: Vec<Tensor<1>> = Vec::new();
    for (_, grad) in owned {
        if options.check_finite {
            // A finite sum means finite values; the rare sum that is not is probed exactly
            // below (a large finite sum may overflow). One pass, no tensor of the gradient's size.
            parts.push(grad.clone().sum());
        }
        if options.clip_norm.is_some() {
            // As the device buckets: the f32 sum of (v / m)^2 cannot overflow.
            let max = grad.clone().abs().max().clamp_min(f32::MIN_POSITIVE);
            parts.push(grad.clone().div(max.clone()).powf_scalar(2.0).sum());
            parts.insert(parts.len() - 1, max);
        }
    }
    let mut checks = read_f32(link, parts)?;
    let per = check_words(options);
    if options.check_finite {
        let overflowed: Vec<usize> = (0..owned.len())
            .filter(|&k| !checks[k * per].is_finite())
            .collect();
        if !overflowed.is_empty() {
            let probes = overflowed
                .iter()
                .map(|&k| non_finite_probe(owned[k].1.clone()))
                .collect();
            for (k, probe) in overflowed.into_iter().zip(read_f32(link, probes)?) {
                checks[k * per] = probe;
            }
        }
    }
    Ok(checks)
}

/// `parts` (one value each) read to the host in one transfer.
///
/// # Errors
/// [`DdpError::Bucket`](crate::error::DdpError::Bucket) (after aborting the group) when they
/// cannot be read as `f32`.
fn read_f32(link: &mut Link, parts: Vec<Tensor<1>>) -> Result<Vec<f32>> {
    link.stats.transfers_to_host += 1;
    Tensor::cat(parts, 0)
        .cast(FloatDType::F32)
        .into_data()
        .convert::<f32>()
        .try_to_vec::<f32>()
        .map_err(|e| link.fail_bucket(0, format!("cannot read the gradients' checks: {e:?}")))
}

/// The [`Observed`] of every position's checks (empty: no gradient), in bucket order.
fn observe(checks: &[Vec<f32>], options: &ReduceOptions) -> Observed {
    let mut observed = Observed::default();
    for words in checks.iter().filter(|w| !w.is_empty()) {
        let mut words = words.as_slice();
        if options.check_finite {
            observed.non_finite |= !words[0].is_finite();
            words = &words[1..];
        }
        if let [max, scaled] = words {
            observed.sum_of_squares += f64::from(*max) * f64::from(*max) * f64::from(*scaled);
        }
    }
    observed
}

/// The ranks' words summed in rank order (divided by their number for an average).
fn sum_words<'a>(words: impl Iterator<Item = &'a [f32]>, op: ReduceOp) -> Vec<f32> {
    let mut sum: Vec<f32> = Vec::new();
    let mut ranks = 0;
    for words in words {
        ranks += 1;
        if sum.len() < words.len() {
            sum.resize(words.len(), 0.0);
        }
        sum.iter_mut().zip(words).for_each(|(s, w)| *s += w);
    }
    if op == ReduceOp::Avg && ranks > 0 {
        sum.iter_mut().for_each(|s| *s /= ranks as f32);
    }
    sum
}

/// Every rank's shared value as a `T`.
///
/// # Errors
/// [`DdpError::Bucket`](crate::error::DdpError::Bucket) (after aborting the group) for a rank
/// that shared something else (its backend differs).
fn downcast_all<T: Send + Sync + 'static>(
    link: &Link,
    values: Vec<SharedValue>,
) -> Result<Vec<Arc<T>>> {
    values
        .into_iter()
        .enumerate()
        .map(|(peer, value)| {
            value.downcast::<T>().map_err(|_| {
                link.fail_bucket(
                    0,
                    format!("rank {peer} shared another kind of value in a shared reduction"),
                )
            })
        })
        .collect()
}
