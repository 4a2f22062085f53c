//! Device buckets, for process groups that [reduce device tensors](ProcessGroup::reduces_device_tensors)
//! (NCCL on CUDA): the gradients, their presence flags and the control words are concatenated on
//! the device, optionally sent in a 16-bit format ([`compress`](crate::compress)), all-reduced in
//! place in device memory and sliced back into gradients, with no trip through the host. What the
//! host must know (flags, control words, the checks' inputs) comes back in one small read per
//! phase.
//!
//! The NaN probe is the sum of `values * 0` (NaN exactly when a value is not finite; it cannot
//! overflow); the sum of squares is taken per bucket as `max|v|^2 * sum((v / max|v|)^2)`, which
//! cannot overflow `f32` either, and assembled in `f64`. Device reductions need not be
//! deterministic, so these inputs are averaged across ranks (a tiny host all-reduce) before the
//! verdict, and every rank decides the same.

use std::collections::BTreeSet;
use std::time::Instant;

use burn::optim::GradientsParams;
use burn::tensor::{Device, FloatDType, Tensor, TensorData};

use super::checks::Observed;
use super::gradients::{Work, concat_bucket, slice_bucket};
use super::layout::BucketLayout;
use super::link::Link;
use super::options::{Control, ReduceOptions};
use crate::compress::{Fallback, GradientCompression, Wire, choose_wire, from_wire, to_wire};
use crate::error::{DdpError, Result};
use crate::replica::TensorSpec;
use burn_ddp_comm::group::ReduceOp;

/// One phase's buckets after the all-reduce.
pub(super) struct DevicePhase {
    /// Per bucket, as `f32`: reduced values, then flags, then (first bucket) control words.
    reduced: Vec<Tensor<1>>,
    /// Per bucket with values: this rank's NaN probe before the all-reduce.
    local_probes: Vec<Tensor<1>>,
    /// The first bucket's control words (0: it carries none).
    control_len: usize,
}

/// What one read of a [`DevicePhase`] brings to the host.
pub(super) struct DeviceRead {
    /// Every bucket's reduced presence flags, in bucket order.
    pub flags: Vec<f32>,
    /// The reduced control words.
    pub control: Option<Control>,
    /// Per bucket: the NaN probe (with `check_finite`); then per bucket `max|v|` and
    /// `sum((v / max)^2)` (with clipping). Not yet averaged across ranks.
    pub checks: Vec<f32>,
    /// This rank's own gradients held NaN or infinity.
    pub local_non_finite: bool,
}

/// The device buckets of a reducer: the format on the wire, and the buckets whose compression
/// fallback was already reported.
pub(super) struct DeviceBuckets {
    compression: GradientCompression,
    warned: BTreeSet<usize>,
}

/// `flat` all-reduced in place in device memory by the group (NCCL), as a tensor of Burn's CUDA
/// backend (its primitive: a fusion tensor, or CubeCL's `CubeTensor`, which the group takes only
/// on a CUDA device); `None`, without communicating, when the group cannot take it or this build
/// has no CUDA. (The unit tests stage Flex tensors through the same path.)
///
/// # Errors
/// The collective's errors, after aborting the group (a rank that fails before NCCL starts, on a
/// buffer NCCL cannot take, must not leave its peers waiting in theirs).
fn all_reduce_on_device(link: &Link, flat: Tensor<1>, op: ReduceOp) -> Result<Option<Tensor<1>>> {
    #[allow(unused_imports)]
    use burn::backend::DispatchDevice;
    #[allow(unused_imports)]
    use burn_ddp_comm::group::ExtendedCollectives;
    let _ = (link, op);
    let device = flat.device().inner();
    #[allow(unreachable_patterns)]
    match device.as_dispatch() {
        #[cfg(feature = "cuda")]
        DispatchDevice::Cube(_) => {
            type Cuda = burn::backend::Cuda;
            let Ok(mut primitive) = flat.try_into_primitive::<Cuda>() else {
                return Ok(None);
            };
            let done = link
                .group
                .all_reduce_device(&mut primitive, op, link.timeout)
                .inspect_err(|err| link.group.abort(&err.to_string()))?;
            Ok(done.then(|| Tensor::<1>::from_primitive::<Cuda>(primitive)))
        }
        #[cfg(test)]
        DispatchDevice::Flex(_) => {
            type Flex = burn::backend::Flex;
            let Ok(mut primitive) = flat.try_into_primitive::<Flex>() else {
                return Ok(None);
            };
            let done = link
                .group
                .all_reduce_device(&mut primitive, op, link.timeout)
                .inspect_err(|err| link.group.abort(&err.to_string()))?;
            Ok(done.then(|| Tensor::<1>::from_primitive::<Flex>(primitive)))
        }
        _ => Ok(None),
    }
}

impl DeviceBuckets {
    pub fn new(compression: GradientCompression) -> Self {
        Self {
            compression,
            warned: BTreeSet::new(),
        }
    }

    /// Forgets the warnings (the agreed layout changed: the buckets are new).
    pub fn clear(&mut self) {
        self.warned.clear();
    }

    /// All-reduces `work` in device buckets on `device`; the control words go into the first
    /// bucket, after the flags.
    pub fn reduce(
        &mut self,
        link: &mut Link,
        work: Work<'_>,
        options: &ReduceOptions,
        device: &Device,
    ) -> Result<DevicePhase> {
        let Work {
            layout,
            specs,
            taken,
            control,
            ..
        } = work;
        let world_size = link.group.world_size();
        let started = Instant::now();
        // This rank's buckets: weighted values (None for a bucket without parameters) and flags.
        let mut values: Vec<Option<Tensor<1>>> = Vec::with_capacity(layout.buckets().len());
        let mut flags: Vec<Vec<f32>> = Vec::with_capacity(layout.buckets().len());
        let mut local_probes = Vec::new();
        for (bucket, grads) in layout.buckets().iter().zip(taken) {
            let (bucket_values, present) = concat_bucket(bucket, specs, grads, device);
            let bucket_values = bucket_values.map(|mut v| {
                if options.check_finite {
                    local_probes.push(non_finite_probe(v.clone()));
                }
                // The weight scales the gradients only: a flag says "had a gradient" whatever
                // the weight (as on the host path).
                if options.weight != 1.0 {
                    v = v.mul_scalar(options.weight);
                }
                v
            });
            values.push(bucket_values);
            flags.push(present);
        }
        let wires = self.agree_wires(link, &values, options)?;
        let mut reduced = Vec::with_capacity(values.len());
        let divide = match options.op {
            ReduceOp::Avg => world_size as f32,
            ReduceOp::Sum => 1.0,
        };
        let mut flattened = started.elapsed();
        for (bucket_index, (bucket_values, present)) in values.into_iter().zip(flags).enumerate() {
            let started = Instant::now();
            let numel = layout.buckets()[bucket_index].numel;
            let mut rest = present;
            if let (0, Some(control)) = (bucket_index, control) {
                rest.extend_from_slice(&control.words());
            }
            let count = rest.len();
            let rest = Tensor::<1>::from_data(TensorData::new(rest, [count]), device);
            let wire = wires[bucket_index];
            let flat = match bucket_values {
                Some(v) => to_wire(v, rest, wire, self.compression, divide),
                // Flags and control words only.
                None => match (wire, self.compression.wire_dtype()) {
                    (Wire::Half { .. }, Some(dtype)) => rest.div_scalar(divide).cast(dtype),
                    _ => rest,
                },
            };
            let wire_op = match wire {
                Wire::F32 => options.op,
                Wire::Half { .. } => ReduceOp::Sum,
            };
            let element_bytes = match wire {
                Wire::F32 => 4,
                Wire::Half { .. } => self.compression.element_bytes(),
            };
            flattened += started.elapsed();
            let reducing = Instant::now();
            let Some(on_wire) = all_reduce_on_device(link, flat, wire_op)? else {
                return Err(link.fail_bucket(
                    bucket_index,
                    format!(
                        "the {} process group reduces device tensors, but not this backend's; \
                         use CUDA devices with it",
                        link.group.backend()
                    ),
                ));
            };
            reduced.push(from_wire(on_wire, wire, numel));
            link.stats.all_reduce += reducing.elapsed();
            link.stats.buckets += 1;
            link.stats.bytes += (numel + count) * element_bytes;
        }
        link.stats.flatten += flattened;
        Ok(DevicePhase {
            reduced,
            local_probes,
            control_len: control.map_or(0, Control::len),
        })
    }

    /// The wire of every bucket this step: `f32` without compression; with it, the ranks agree on
    /// each bucket's magnitudes first (one read to the host and one all-gather of two words per
    /// bucket) and [`choose_wire`] decides.
    fn agree_wires(
        &mut self,
        link: &mut Link,
        values: &[Option<Tensor<1>>],
        options: &ReduceOptions,
    ) -> Result<Vec<Wire>> {
        if self.compression == GradientCompression::None {
            return Ok(vec![Wire::F32; values.len()]);
        }
        let rank = link.group.rank();
        let mut stats: Vec<Tensor<1>> = Vec::new();
        for v in values.iter().flatten() {
            let magnitude = v.clone().abs();
            stats.push(magnitude.clone().max());
            let zero = magnitude.clone().equal_elem(0.0);
            stats.push(magnitude.mask_fill(zero, f32::INFINITY).min());
        }
        let local: Vec<f32> = if stats.is_empty() {
            Vec::new()
        } else {
            Tensor::cat(stats, 0)
                .into_data()
                .convert::<f32>()
                .try_to_vec::<f32>()
                .map_err(|e| DdpError::Bucket {
                    rank,
                    bucket: 0,
                    detail: format!("cannot read the buckets' magnitudes back: {e:?}"),
                })?
        };
        let bits: Vec<u64> = local.iter().map(|v| u64::from(v.to_bits())).collect();
        let all = link.group.all_gather(&bits, link.timeout)?;
        let per_rank = bits.len();
        let value = |r: usize, i: usize| f32::from_bits(all[r * per_rank + i] as u32);
        let ranks = link.group.world_size();
        let mut wires = Vec::with_capacity(values.len());
        let mut at = 0;
        for (bucket_index, v) in values.iter().enumerate() {
            if v.is_none() {
                // Flags and control words only: no values to scale.
                wires.push(
                    choose_wire(self.compression, options.op, ranks, 0.0, f32::INFINITY)
                        .unwrap_or(Wire::F32),
                );
                continue;
            }
            let (mut max, mut min) = (0f32, f32::INFINITY);
            for r in 0..ranks {
                // `max` of NaN stays NaN, so a NaN anywhere is seen by every rank.
                let (rmax, rmin) = (value(r, at), value(r, at + 1));
                max = if rmax.is_nan() || max.is_nan() {
                    f32::NAN
                } else {
                    max.max(rmax)
                };
                min = min.min(rmin);
            }
            let wire = match choose_wire(self.compression, options.op, ranks, max, min) {
                Ok(wire) => wire,
                Err(Fallback::NonFinite) => Wire::F32,
                Err(Fallback::Range) => {
                    link.stats.uncompressed_buckets += 1;
                    let (mine_max, mine_min) = (local[at], local[at + 1]);
                    // The ranks that hold an extreme name themselves, once per bucket.
                    if (mine_min == min || mine_max == max) && self.warned.insert(bucket_index) {
                        tracing::warn!(
                            "burn-ddp: rank {rank}: {:?} gradient compression: bucket \
                             {bucket_index} holds gradients from {min:e} to {max:e} (over all \
                             ranks; this rank's from {mine_min:e} to {mine_max:e}), more than \
                             the format's normal range at world size {ranks}; it goes as f32 \
                             this step (counted in CommStats::uncompressed_buckets; bf16 covers \
                             f32's range)",
                            self.compression
                        );
                    }
                    Wire::F32
                }
            };
            wires.push(wire);
            at += 2;
        }
        Ok(wires)
    }
}

impl DevicePhase {
    /// Reads the flags, the control words and the checks' inputs back to the host, in one read.
    pub fn read(
        &self,
        layout: &BucketLayout,
        options: &ReduceOptions,
        rank: usize,
    ) -> Result<DeviceRead> {
        let buckets = layout.buckets();
        let device = self.reduced.first().map(Tensor::device);
        let Some(device) = device else {
            return Ok(DeviceRead {
                flags: Vec::new(),
                control: None,
                checks: Vec::new(),
                local_non_finite: false,
            });
        };
        let constant = |v: f32| Tensor::<1>::from_data(TensorData::new(vec![v], [1]), &device);
        let mut probe: Vec<Tensor<1>> = Vec::new();
        let flag_count: usize = buckets.iter().map(|b| b.params.len()).sum();
        for (b, r) in buckets.iter().zip(&self.reduced) {
            if !b.params.is_empty() {
                probe.push(r.clone().slice(b.numel..b.numel + b.params.len()));
            }
        }
        let control_len = self.control_len;
        if let (true, Some(first), Some(r)) =
            (control_len > 0, buckets.first(), self.reduced.first())
        {
            let at = first.numel + first.params.len();
            probe.push(r.clone().slice(at..at + control_len));
        }
        let values = |r: &Tensor<1>, numel: usize| r.clone().slice(0..numel);
        if options.check_finite {
            for (b, r) in buckets.iter().zip(&self.reduced) {
                probe.push(if b.numel == 0 {
                    constant(0.0)
                } else {
                    non_finite_probe(values(r, b.numel))
                });
            }
        }
        if options.clip_norm.is_some() {
            // Per bucket: the largest magnitude m and the sum of (v / m)^2, so the f32 sum
            // cannot overflow; the sum of squares m^2 * sum is assembled in f64 on the host.
            for (b, r) in buckets.iter().zip(&self.reduced) {
                if b.numel == 0 {
                    probe.push(constant(f32::MIN_POSITIVE));
                    probe.push(constant(0.0));
                    continue;
                }
                let max = values(r, b.numel).abs().max().clamp_min(f32::MIN_POSITIVE);
                let scaled = values(r, b.numel).div(max.clone()).powf_scalar(2.0).sum();
                probe.push(max);
                probe.push(scaled);
            }
        }
        let local_count = self.local_probes.len();
        probe.extend(self.local_probes.iter().cloned());
        let host: Vec<f32> = Tensor::cat(probe, 0)
            .cast(FloatDType::F32)
            .into_data()
            .convert::<f32>()
            .try_to_vec::<f32>()
            .map_err(|e| DdpError::Bucket {
                rank,
                bucket: 0,
                detail: format!("cannot read the reduced flags back: {e:?}"),
            })?;
        let (flags, rest) = host.split_at(flag_count);
        let (control, rest) = rest.split_at(control_len);
        let (checks, local) = rest.split_at(rest.len() - local_count);
        Ok(DeviceRead {
            flags: flags.to_vec(),
            control: Control::from_words(control, control_len.saturating_sub(Control::len_with(0))),
            checks: checks.to_vec(),
            local_non_finite: local.iter().any(|v| !v.is_finite()),
        })
    }

    /// Slices the reduced buckets back into `grads`, times `scale`, leaving out the parameters
    /// whose reduced flag is not positive.
    pub fn unflatten(
        self,
        layout: &BucketLayout,
        specs: &[TensorSpec],
        grads: &mut GradientsParams,
        flags: &[f32],
        scale: f32,
    ) {
        let mut flags = flags.iter().copied();
        for (bucket, reduced) in layout.buckets().iter().zip(self.reduced) {
            let reduced = if scale == 1.0 || bucket.numel == 0 {
                reduced
            } else {
                reduced.mul_scalar(scale)
            };
            slice_bucket(bucket, specs, &reduced, &mut flags, None, grads);
        }
    }
}

/// The [`Observed`] of averaged device checks: per bucket the NaN
/// probe, then per bucket `(max, scaled sum of squares)`.
pub(super) fn observe_device(checks: &[f32], buckets: usize, options: &ReduceOptions) -> Observed {
    let mut observed = Observed::default();
    let mut rest = checks;
    if options.check_finite {
        let (sums, after) = rest.split_at(buckets.min(rest.len()));
        observed.non_finite = sums.iter().any(|v| !v.is_finite());
        rest = after;
    }
    if options.clip_norm.is_some() {
        observed.sum_of_squares = rest
            .chunks_exact(2)
            .map(|pair| {
                let (max, scaled) = (f64::from(pair[0]), f64::from(pair[1]));
                max * max * scaled
            })
            .sum();
    }
    observed
}

/// A one-element tensor that is NaN exactly when `values` holds a NaN or an infinity: the sum of
/// `values * 0`, which a large finite sum cannot overflow.
pub(super) fn non_finite_probe(values: Tensor<1>) -> Tensor<1> {
    values.mul_scalar(0.0).sum()
}
