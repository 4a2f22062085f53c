//! The reducer: averages a replica's gradients across ranks, bucket by bucket.
//!
//! Following PyTorch DDP's `Reducer`:
//! - parameters are assigned to buckets in **reverse registration order** (the last layers'
//!   gradients come first out of the backward pass), with a size cap per bucket: 1 MiB for the
//!   first, 25 MiB for the others by default ([`DdpConfig`]); a bucket closes once it reaches its
//!   cap, so a parameter larger than the cap gets a bucket of its own;
//! - the layout depends only on shapes and order, so it is the same on every rank (checked at
//!   start-up by [`ReplicaLayout::verify_across`]);
//! - each step, each bucket's gradients are copied into **one contiguous `f32` host buffer that
//!   lives as long as the reducer** (PyTorch keeps its bucket tensors too), all-reduced with
//!   [`ReduceOp::Avg`] (sum in rank order, divided by the world size), and copied back into the
//!   gradients' own storage. A persistent buffer matters on the CPU: a fresh bucket-sized
//!   allocation every step is returned to the system and faulted in again, which cost more than
//!   the all-reduce itself (`cargo xtask bench`, bucket sweep). On backends whose `into_data` and
//!   `from_data` move the storage (Flex, NdArray), a step allocates nothing.
//!
//! A parameter that got no gradient on a rank (unused in that rank's forward pass) contributes
//! zeros. Each bucket carries one extra element per parameter, 1.0 where the rank has a gradient,
//! so after the all-reduce every rank knows whether any rank had one: a parameter without a
//! gradient on every rank is left out of the result, exactly as single-device training would leave
//! it out of the optimizer step.
//!
//! With a process group that reduces device tensors ([`NcclGroup`](crate::nccl::NcclGroup), on
//! CUDA), the bucket is a **device tensor** instead: the gradients (and the presence flags) are
//! concatenated on the device, optionally compressed to `bf16`/`f16`
//! ([`DdpConfig::with_gradient_compression`]), all-reduced in place in GPU memory, and sliced
//! back into gradients, with no trip through the host. The flags and the NaN/norm checks come
//! back to the host together, one small read per step, and not at all (no host sync) when this
//! rank had every gradient and no check is asked: every flag is then positive anyway.

use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::optim::GradientsParams;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData, TensorPrimitive};

use crate::group::{ProcessGroup, ReduceOp};
use crate::metrics::CommStats;
use crate::nccl::GradientCompression;
use crate::nccl::compress::{compress, decompress};
use crate::replica::{ReplicaLayout, TensorSpec};
use crate::{DdpConfig, DdpError, Result};

/// Bytes of one gradient element in a bucket (`f32`).
const ELEMENT_BYTES: usize = 4;

/// Runs `$body` with `$D` bound to the const dimension `$ndims` (1 to 8).
macro_rules! with_dims {
    ($ndims:expr, $D:ident => $body:expr, else $fallback:expr) => {
        with_dims!(@arms $ndims, $D, $body, $fallback, 1 2 3 4 5 6 7 8)
    };
    (@arms $ndims:expr, $D:ident, $body:expr, $fallback:expr, $($n:literal)*) => {
        match $ndims {
            $($n => {
                const $D: usize = $n;
                $body
            })*
            _ => $fallback,
        }
    };
}

/// One bucket: parameters whose gradients are all-reduced together.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bucket {
    /// Indices into the reducer's parameter list (registration order), in bucket order.
    pub params: Vec<usize>,
    /// Offset of each parameter's gradient in the flat bucket, in elements.
    pub offsets: Vec<usize>,
    /// Number of gradient elements (`f32`), without the presence flags.
    pub numel: usize,
}

impl Bucket {
    /// Size of the gradients in bytes (`numel * 4`).
    pub fn bytes(&self) -> usize {
        self.numel * ELEMENT_BYTES
    }
}

/// Assignment of parameters to buckets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BucketLayout {
    buckets: Vec<Bucket>,
}

impl BucketLayout {
    /// Assigns parameters (given in registration order, with their element counts) to buckets in
    /// reverse order. The first bucket closes once it holds `first_cap_bytes` or more, every later
    /// bucket once it holds `cap_bytes` or more (PyTorch's `compute_bucket_assignment_by_size`).
    pub fn new(param_numels: &[usize], first_cap_bytes: usize, cap_bytes: usize) -> Self {
        let mut buckets = Vec::new();
        let mut current = Bucket {
            params: Vec::new(),
            offsets: Vec::new(),
            numel: 0,
        };
        for (index, &numel) in param_numels.iter().enumerate().rev() {
            current.params.push(index);
            current.offsets.push(current.numel);
            current.numel += numel;
            let cap = if buckets.is_empty() {
                first_cap_bytes
            } else {
                cap_bytes
            };
            if current.bytes() >= cap {
                buckets.push(std::mem::replace(
                    &mut current,
                    Bucket {
                        params: Vec::new(),
                        offsets: Vec::new(),
                        numel: 0,
                    },
                ));
            }
        }
        if !current.params.is_empty() {
            buckets.push(current);
        }
        Self { buckets }
    }

    /// The buckets, in all-reduce order.
    pub fn buckets(&self) -> &[Bucket] {
        &self.buckets
    }
}

/// Averages gradients across the ranks of a process group.
///
/// Build one per replica with [`Reducer::new`] (every rank at the same time: it checks that the
/// replicas match), then call [`Reducer::reduce`] once per optimizer step.
pub struct Reducer {
    group: Arc<dyn ProcessGroup>,
    params: Vec<TensorSpec>,
    layout: BucketLayout,
    timeout: Duration,
    stats: CommStats,
    /// One host buffer per bucket (its gradients, then one presence flag per parameter),
    /// allocated at the first multi-rank step and reused: `4 * (numel + params)` bytes each.
    buffers: Vec<Vec<f32>>,
    /// The dtype of device buckets on the wire.
    compression: GradientCompression,
}

impl Reducer {
    /// Builds the bucket layout of `replica`'s parameters and checks, with every other rank, that
    /// all replicas have the same layout. Every rank must call it.
    ///
    /// # Errors
    /// [`DdpError::ReplicaMismatch`] (on every rank) when the replicas differ; the collective's
    /// errors; [`DdpError::InvalidConfig`] for an invalid `config`.
    pub fn new(
        group: Arc<dyn ProcessGroup>,
        replica: &ReplicaLayout,
        config: &DdpConfig,
    ) -> Result<Self> {
        config.validate()?;
        replica.verify_across(group.as_ref(), config.timeout())?;
        let params: Vec<TensorSpec> = replica.parameters().cloned().collect();
        let numels: Vec<usize> = params.iter().map(TensorSpec::numel).collect();
        let layout = BucketLayout::new(
            &numels,
            config.first_bucket_cap_bytes(),
            config.bucket_cap_bytes(),
        );
        Ok(Self {
            group,
            params,
            layout,
            timeout: config.timeout(),
            stats: CommStats::default(),
            buffers: Vec::new(),
            compression: config.gradient_compression(),
        })
    }

    /// The bucket layout.
    pub fn layout(&self) -> &BucketLayout {
        &self.layout
    }

    /// The parameters whose gradients are reduced, in registration order.
    pub fn parameters(&self) -> &[TensorSpec] {
        &self.params
    }

    /// Communication counters since the reducer was built.
    pub fn stats(&self) -> &CommStats {
        &self.stats
    }

    /// The process group.
    pub fn group(&self) -> &Arc<dyn ProcessGroup> {
        &self.group
    }

    /// Replaces every parameter's gradient in `grads` by its average over all ranks. `B` is the
    /// backend the gradients live on (the inner backend of the autodiff backend), `device` the
    /// rank's device, where the reduced gradients are put. Gradients of tensors that are not parameters of
    /// the layout are returned untouched.
    ///
    /// With a world size of 1 the gradients are returned as they are (the average of one rank).
    ///
    /// # Errors
    /// [`DdpError::Bucket`] when a gradient's shape differs from its parameter's; the all-reduce's
    /// errors ([`DdpError::Timeout`], [`DdpError::PeerLeft`], [`DdpError::Mismatch`], ...). After
    /// an error the gradients are lost and the process group is aborted.
    pub fn reduce<B: Backend>(
        &mut self,
        grads: GradientsParams,
        device: &B::Device,
    ) -> Result<GradientsParams> {
        self.reduce_with::<B>(Some(grads), device, &ReduceOptions::default())
            .map(|outcome| outcome.grads)
    }

    /// [`reduce`](Self::reduce) with options: a weight for this rank's contribution (join mode),
    /// clipping by the global norm of the reduced gradients, and a check for NaN and infinity.
    /// `grads: None` contributes zeros (a rank without a batch in join mode); the result then
    /// holds the other ranks' reduced gradients.
    ///
    /// Every rank must call it with the same `options.op`, `clip_norm` and `check_finite`. The
    /// verdicts of the outcome (non-finite, norm, clipping) are computed from the reduced values,
    /// so they are the same on every rank. When the reduced gradients are not finite, the
    /// outcome's gradients are empty: the step must be skipped (or reported).
    ///
    /// # Errors
    /// As [`reduce`](Self::reduce).
    pub fn reduce_with<B: Backend>(
        &mut self,
        grads: Option<GradientsParams>,
        device: &B::Device,
        options: &ReduceOptions,
    ) -> Result<ReduceOutcome> {
        if self.group.world_size() == 1
            && options.weight == 1.0
            && let Some(grads) = grads
        {
            // One rank: nothing to reduce, and no host copy of the gradients either. The checks
            // run on the device, one scalar per parameter.
            self.stats.steps += 1;
            return Ok(self.local_checks::<B>(grads, options));
        }
        if self.group.reduces_device_tensors() {
            return self.reduce_on_device::<B>(grads, device, options);
        }
        let mut grads = grads.unwrap_or_default();
        let rank = self.group.rank();
        if self.buffers.len() != self.layout.buckets.len() {
            self.buffers = self
                .layout
                .buckets
                .iter()
                .map(|b| vec![0.0; b.numel + b.params.len()])
                .collect();
        }
        let mut local_non_finite = false;
        // Each present gradient's own host data, refilled with the reduced values afterwards.
        let mut storage: Vec<Vec<Option<TensorData>>> =
            Vec::with_capacity(self.layout.buckets.len());
        for (bucket_index, bucket) in self.layout.buckets.iter().enumerate() {
            let started = Instant::now();
            let buffer = &mut self.buffers[bucket_index];
            let mut datas = Vec::with_capacity(bucket.params.len());
            for (j, &p) in bucket.params.iter().enumerate() {
                let spec = &self.params[p];
                let range = bucket.offsets[j]..bucket.offsets[j] + spec.numel();
                let fail = |detail: String| {
                    let err = DdpError::Bucket {
                        rank,
                        bucket: bucket_index,
                        detail,
                    };
                    // The peers must not wait for this rank's all-reduce.
                    self.group.abort(&err.to_string());
                    err
                };
                let data = match take_flat::<B>(&mut grads, spec).map_err(fail)? {
                    Some(grad) => {
                        let data = grad.into_data().convert::<f32>();
                        let values = data.as_slice::<f32>().map_err(|e| {
                            fail(format!(
                                "gradient of `{}` is not readable as f32: {e:?}",
                                spec.path
                            ))
                        })?;
                        if values.len() != range.len() {
                            return Err(fail(format!(
                                "gradient of `{}` has {} values, the parameter {}",
                                spec.path,
                                values.len(),
                                range.len()
                            )));
                        }
                        buffer[range].copy_from_slice(values);
                        buffer[bucket.numel + j] = 1.0;
                        Some(data)
                    }
                    None => {
                        buffer[range].fill(0.0);
                        buffer[bucket.numel + j] = 0.0;
                        None
                    }
                };
                datas.push(data);
            }
            let flattened = Instant::now();
            let values = &mut buffer[..bucket.numel];
            if options.check_finite {
                local_non_finite |= values.iter().any(|v| !v.is_finite());
            }
            if options.weight != 1.0 {
                values.iter_mut().for_each(|v| *v *= options.weight);
            }
            self.group.all_reduce(buffer, options.op, self.timeout)?;
            self.stats.flatten += flattened - started;
            self.stats.all_reduce += flattened.elapsed();
            self.stats.buckets += 1;
            self.stats.bytes += buffer.len() * ELEMENT_BYTES;
            storage.push(datas);
        }
        self.stats.steps += 1;

        let started = Instant::now();
        let mut outcome = ReduceOutcome {
            local_non_finite,
            ..ReduceOutcome::plain(GradientsParams::new())
        };
        let reduced = || {
            self.layout
                .buckets
                .iter()
                .zip(&self.buffers)
                .map(|(bucket, buffer)| &buffer[..bucket.numel])
        };
        if options.check_finite {
            outcome.non_finite = reduced().any(|values| values.iter().any(|v| !v.is_finite()));
            if outcome.non_finite {
                return Ok(outcome);
            }
        }
        let mut scale = 1.0f32;
        if let Some(max_norm) = options.clip_norm {
            // torch.nn.utils.clip_grad_norm_: the 2-norm over all gradients, accumulated in f64
            // in bucket order (the same order, so the same norm, on every rank).
            let sum_sq: f64 = reduced()
                .map(|values| {
                    values
                        .iter()
                        .map(|&v| f64::from(v) * f64::from(v))
                        .sum::<f64>()
                })
                .sum();
            let norm = sum_sq.sqrt();
            outcome.grad_norm = Some(norm);
            let coefficient = f64::from(max_norm) / (norm + 1e-6);
            if coefficient < 1.0 {
                scale = coefficient as f32;
                outcome.clip_scale = Some(scale);
            }
        }
        let buckets = self.layout.buckets.iter().zip(&self.buffers).zip(storage);
        for (bucket_index, ((bucket, buffer), datas)) in buckets.enumerate() {
            for ((j, &p), data) in bucket.params.iter().enumerate().zip(datas) {
                // The flag's all-reduce: positive when any rank had a gradient.
                if buffer[bucket.numel + j] <= 0.0 {
                    continue;
                }
                let spec = &self.params[p];
                let source = &buffer[bucket.offsets[j]..bucket.offsets[j] + spec.numel()];
                // This rank's own gradient storage when it had one (no allocation), else new.
                let mut data = data
                    .unwrap_or_else(|| TensorData::new(vec![0.0f32; spec.numel()], [spec.numel()]));
                // Readable as f32 above, so writable now; an error here would leave this rank
                // with other gradients than its peers, so it is reported, never skipped.
                let target = data.as_mut_slice::<f32>().map_err(|e| DdpError::Bucket {
                    rank,
                    bucket: bucket_index,
                    detail: format!("cannot write the reduced `{}`: {e:?}", spec.path),
                })?;
                if scale == 1.0 {
                    target.copy_from_slice(source);
                } else {
                    target
                        .iter_mut()
                        .zip(source)
                        .for_each(|(t, &s)| *t = s * scale);
                }
                let flat = Tensor::<B, 1>::from_data(data, device);
                register_shaped::<B>(&mut grads, spec, flat);
            }
        }
        self.stats.unflatten += started.elapsed();
        outcome.grads = grads;
        Ok(outcome)
    }

    /// [`reduce_with`](Self::reduce_with) with buckets in device memory, for groups that
    /// [reduce device tensors](ProcessGroup::reduces_device_tensors).
    fn reduce_on_device<B: Backend>(
        &mut self,
        grads: Option<GradientsParams>,
        device: &B::Device,
        options: &ReduceOptions,
    ) -> Result<ReduceOutcome> {
        let mut grads = grads.unwrap_or_default();
        let rank = self.group.rank();
        let world_size = self.group.world_size();
        let mut reduced: Vec<Tensor<B, 1>> = Vec::with_capacity(self.layout.buckets.len());
        let mut local_sums: Vec<Tensor<B, 1>> = Vec::new();
        // Whether this rank had every gradient: then every flag is positive after the
        // all-reduce, and without checks the step needs no read back to the host (no sync).
        let mut all_present = true;
        for (bucket_index, bucket) in self.layout.buckets.iter().enumerate() {
            let started = Instant::now();
            let fail = |detail: String| {
                let err = DdpError::Bucket {
                    rank,
                    bucket: bucket_index,
                    detail,
                };
                self.group.abort(&err.to_string());
                err
            };
            let mut parts: Vec<Tensor<B, 1>> = Vec::with_capacity(bucket.params.len() + 1);
            let mut flags = Vec::with_capacity(bucket.params.len());
            for &p in &bucket.params {
                let spec = &self.params[p];
                match take_flat::<B>(&mut grads, spec).map_err(fail)? {
                    Some(grad) => {
                        parts.push(grad);
                        flags.push(1.0f32);
                    }
                    None => {
                        parts.push(Tensor::zeros([spec.numel()], device));
                        flags.push(0.0);
                        all_present = false;
                    }
                }
            }
            let count = flags.len();
            let mut values = Tensor::cat(parts, 0);
            if options.check_finite {
                local_sums.push(non_finite_probe(values.clone()));
            }
            // The weight scales the gradients only: a flag says "had a gradient" whatever the
            // weight (as on the host path).
            if options.weight != 1.0 {
                values = values.mul_scalar(options.weight);
            }
            let flags = Tensor::from_data(TensorData::new(flags, [count]), device);
            let flat = Tensor::cat(vec![values, flags], 0);
            let (wire, wire_op) = compress(flat, options.op, world_size, self.compression);
            let mut primitive = wire.into_primitive().tensor();
            let flattened = Instant::now();
            let done = self
                .group
                .all_reduce_device(&mut primitive, wire_op, self.timeout)
                .inspect_err(|err| {
                    // A rank that fails before NCCL starts (a buffer NCCL cannot take) must not
                    // leave its peers waiting in theirs.
                    self.group.abort(&err.to_string());
                })?;
            if !done {
                return Err(fail(format!(
                    "the {} process group reduces device tensors, but not this backend's; \
                     use CUDA devices with it",
                    self.group.backend()
                )));
            }
            let wire = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(primitive));
            reduced.push(decompress(wire, self.compression));
            self.stats.flatten += flattened - started;
            self.stats.all_reduce += flattened.elapsed();
            self.stats.buckets += 1;
            self.stats.bytes += (bucket.numel + count) * self.compression.element_bytes();
        }
        self.stats.steps += 1;

        let started = Instant::now();
        let buckets = self.layout.buckets.len();
        let flag_count: usize = self.layout.buckets.iter().map(|b| b.params.len()).sum();
        if all_present && !options.check_finite && options.clip_norm.is_none() {
            self.unflatten_device(&mut grads, reduced, None, 1.0);
            self.stats.unflatten += started.elapsed();
            return Ok(ReduceOutcome::plain(grads));
        }
        // One read for the flags and checks: [flags of every bucket | per-bucket sums | per-bucket
        // sums of squares | this rank's per-bucket sums before the all-reduce].
        let mut probe: Vec<Tensor<B, 1>> = self
            .layout
            .buckets
            .iter()
            .zip(&reduced)
            .map(|(b, r)| r.clone().slice(b.numel..b.numel + b.params.len()))
            .collect();
        let values = |r: &Tensor<B, 1>, b: &Bucket| r.clone().slice(0..b.numel);
        if options.check_finite {
            probe.extend(
                self.layout
                    .buckets
                    .iter()
                    .zip(&reduced)
                    .map(|(b, r)| non_finite_probe(values(r, b))),
            );
        }
        if options.clip_norm.is_some() {
            // Per bucket: the largest magnitude m and the sum of (v / m)^2, so the f32 sum
            // cannot overflow; the norm m * sqrt(sum) is assembled in f64 on the host.
            for (b, r) in self.layout.buckets.iter().zip(&reduced) {
                let max = values(r, b).abs().max().clamp_min(f32::MIN_POSITIVE);
                let scaled = values(r, b).div(max.clone()).powf_scalar(2.0).sum();
                probe.push(max);
                probe.push(scaled);
            }
        }
        probe.extend(local_sums);
        let host: Vec<f32> = Tensor::cat(probe, 0)
            .into_data()
            .convert::<f32>()
            .to_vec::<f32>()
            .map_err(|e| DdpError::Bucket {
                rank,
                bucket: 0,
                detail: format!("cannot read the reduced flags back: {e:?}"),
            })?;
        let (flags, mut rest) = host.split_at(flag_count);
        // The sums come from identical buckets, but a device reduction need not be
        // deterministic: averaging them across ranks makes every rank take the same decision.
        let mut checks: Vec<f32> = Vec::new();
        let mut outcome = ReduceOutcome::plain(GradientsParams::new());
        if options.check_finite {
            checks.extend_from_slice(&rest[..buckets]);
            rest = &rest[buckets..];
        }
        if options.clip_norm.is_some() {
            checks.extend_from_slice(&rest[..2 * buckets]);
            rest = &rest[2 * buckets..];
        }
        if options.check_finite {
            outcome.local_non_finite = rest.iter().any(|v| !v.is_finite());
        }
        if !checks.is_empty() {
            self.group
                .all_reduce(&mut checks, ReduceOp::Avg, self.timeout)?;
        }
        let (sums, squares) = checks.split_at(if options.check_finite { buckets } else { 0 });
        if options.check_finite && sums.iter().any(|v| !v.is_finite()) {
            outcome.non_finite = true;
            return Ok(outcome);
        }
        let mut scale = 1.0f32;
        if let Some(max_norm) = options.clip_norm {
            let norm = squares
                .chunks_exact(2)
                .map(|pair| {
                    let (max, scaled) = (f64::from(pair[0]), f64::from(pair[1]));
                    max * max * scaled
                })
                .sum::<f64>()
                .sqrt();
            outcome.grad_norm = Some(norm);
            let coefficient = f64::from(max_norm) / (norm + 1e-6);
            if coefficient < 1.0 {
                scale = coefficient as f32;
                outcome.clip_scale = Some(scale);
            }
        }
        self.unflatten_device(&mut grads, reduced, Some(flags), scale);
        self.stats.unflatten += started.elapsed();
        outcome.grads = grads;
        Ok(outcome)
    }

    /// Slices the reduced device buckets back into `grads`, times `scale`, leaving out the
    /// parameters whose reduced flag is not positive (`flags: None`: every parameter).
    fn unflatten_device<B: Backend>(
        &self,
        grads: &mut GradientsParams,
        reduced: Vec<Tensor<B, 1>>,
        flags: Option<&[f32]>,
        scale: f32,
    ) {
        let mut flags = flags.map(<[f32]>::iter);
        for (bucket, reduced) in self.layout.buckets.iter().zip(reduced) {
            let reduced = if scale == 1.0 {
                reduced
            } else {
                reduced.mul_scalar(scale)
            };
            for (j, &p) in bucket.params.iter().enumerate() {
                // The flag's all-reduce: positive when any rank had a gradient.
                if let Some(flags) = flags.as_mut()
                    && flags.next().is_none_or(|&f| f <= 0.0)
                {
                    continue;
                }
                let spec = &self.params[p];
                let start = bucket.offsets[j];
                let flat = reduced.clone().slice(start..start + spec.numel());
                register_shaped::<B>(grads, spec, flat);
            }
        }
    }

    /// The NaN/infinity check and clipping of [`reduce_with`](Self::reduce_with) for a world
    /// size of 1, on the device: one sum (or sum of squares, when clipping) per parameter, read
    /// back together; clipping multiplies each gradient on the device.
    fn local_checks<B: Backend>(
        &self,
        mut grads: GradientsParams,
        options: &ReduceOptions,
    ) -> ReduceOutcome {
        if options.clip_norm.is_none() && !options.check_finite {
            return ReduceOutcome::plain(grads);
        }
        let squares = options.clip_norm.is_some();
        let mut parts: Vec<Tensor<B, 1>> = Vec::with_capacity(self.params.len());
        for spec in &self.params {
            let part: Option<Tensor<B, 1>> = with_dims!(spec.shape.len(), D => {
                grads.get::<B, D>(spec.id).map(|g| {
                    let g = g.reshape([spec.numel()]);
                    // NaN and infinity survive a sum (and a sum of squares).
                    if squares { g.powf_scalar(2.0).sum() } else { g.sum() }
                })
            }, else None);
            parts.extend(part);
        }
        let mut outcome = ReduceOutcome::plain(GradientsParams::new());
        if parts.is_empty() {
            outcome.grads = grads;
            return outcome;
        }
        let values: Vec<f64> = Tensor::cat(parts, 0)
            .into_data()
            .convert::<f64>()
            .to_vec::<f64>()
            .unwrap_or_default();
        if values.iter().any(|v| !v.is_finite()) {
            if options.check_finite {
                outcome.non_finite = true;
                outcome.local_non_finite = true;
                return outcome;
            }
        } else if let Some(max_norm) = options.clip_norm {
            let norm = values.iter().sum::<f64>().sqrt();
            outcome.grad_norm = Some(norm);
            let coefficient = f64::from(max_norm) / (norm + 1e-6);
            if coefficient < 1.0 {
                outcome.clip_scale = Some(coefficient as f32);
                for spec in &self.params {
                    with_dims!(spec.shape.len(), D => {
                        if let Some(g) = grads.remove::<B, D>(spec.id) {
                            grads.register::<B, D>(spec.id, g.mul_scalar(coefficient));
                        }
                    }, else {});
                }
            }
        }
        outcome.grads = grads;
        outcome
    }
}

/// How [`Reducer::reduce_with`] combines the ranks' gradients.
#[derive(Debug, Clone, PartialEq)]
pub struct ReduceOptions {
    /// This rank's gradients are multiplied by `weight` before the all-reduce (default 1). Join
    /// mode weights each rank by its share of the step's samples and sums.
    pub weight: f32,
    /// The reduction ([`ReduceOp::Avg`] by default).
    pub op: ReduceOp,
    /// Clip the reduced gradients to this global 2-norm, as `torch.nn.utils.clip_grad_norm_`
    /// does: multiply by `max_norm / (norm + 1e-6)` when that is below 1.
    pub clip_norm: Option<f32>,
    /// Check the gradients for NaN and infinity (before and after the all-reduce).
    pub check_finite: bool,
}

impl Default for ReduceOptions {
    fn default() -> Self {
        Self {
            weight: 1.0,
            op: ReduceOp::Avg,
            clip_norm: None,
            check_finite: false,
        }
    }
}

/// What [`Reducer::reduce_with`] produced.
#[derive(Debug)]
pub struct ReduceOutcome {
    /// The reduced (and possibly clipped) gradients; empty when they are not finite.
    pub grads: GradientsParams,
    /// Some rank's gradients held NaN or infinity (checked on the reduced values, so every rank
    /// agrees).
    pub non_finite: bool,
    /// This rank's own gradients held NaN or infinity before the all-reduce.
    pub local_non_finite: bool,
    /// The global 2-norm of the reduced gradients before clipping, when clipping is on.
    pub grad_norm: Option<f64>,
    /// The factor the gradients were multiplied by, when they were clipped.
    pub clip_scale: Option<f32>,
}

impl ReduceOutcome {
    fn plain(grads: GradientsParams) -> Self {
        Self {
            grads,
            non_finite: false,
            local_non_finite: false,
            grad_norm: None,
            clip_scale: None,
        }
    }
}

/// A one-element tensor that is NaN exactly when `values` holds a NaN or an infinity: the sum of
/// `values * 0`, which a large finite sum cannot overflow.
fn non_finite_probe<B: Backend>(values: Tensor<B, 1>) -> Tensor<B, 1> {
    values.mul_scalar(0.0).sum()
}

/// Removes `spec`'s gradient from `grads` and flattens it to one dimension.
fn take_flat<B: Backend>(
    grads: &mut GradientsParams,
    spec: &TensorSpec,
) -> std::result::Result<Option<Tensor<B, 1>>, String> {
    let unsupported = || {
        format!(
            "parameter `{}` has {} dimensions; gradients of 1 to 8 dimensions are supported",
            spec.path,
            spec.shape.len()
        )
    };
    with_dims!(spec.shape.len(), D => {
        match grads.remove::<B, D>(spec.id) {
            None => Ok(None),
            Some(g) if g.shape().as_slice() != spec.shape.as_slice() => Err(format!(
                "gradient of `{}` has shape {:?}, the parameter has shape {:?}",
                spec.path,
                g.shape().as_slice(),
                spec.shape
            )),
            Some(g) => Ok(Some(g.reshape([spec.numel()]))),
        }
    }, else Err(unsupported()))
}

/// Registers a flat gradient under `spec`'s id with `spec`'s shape.
fn register_shaped<B: Backend>(grads: &mut GradientsParams, spec: &TensorSpec, flat: Tensor<B, 1>) {
    with_dims!(spec.shape.len(), D => {
        let dims: [usize; D] = std::array::from_fn(|i| spec.shape[i]);
        grads.register::<B, D>(spec.id, flat.reshape(dims));
    }, else {
        // `take_flat` rejected this parameter before, so the bucket never holds it.
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::group::ThreadGroup;
    use burn::backend::NdArray;
    use burn::nn::{Linear, LinearConfig};

    type B = NdArray;
    /// Parameters are the tensors that require gradients: those of an autodiff module.
    type AutodiffB = burn::backend::Autodiff<NdArray>;

    /// Gradients of `layer` with `weight[0][0] = w` and `bias[1] = b`, zeros elsewhere.
    fn grads_of(layer: &Linear<AutodiffB>, w: f32, b: f32) -> GradientsParams {
        let device = Default::default();
        let mut grads = GradientsParams::new();
        let weight = Tensor::<B, 2>::from_data([[w, 0.0], [0.0, 0.0], [0.0, 0.0]], &device);
        grads.register::<B, 2>(layer.weight.id, weight);
        let bias = layer.bias.as_ref().unwrap().id;
        grads.register::<B, 1>(bias, Tensor::from_data([0.0, b], &device));
        grads
    }

    /// Reduces rank r's `(w, b)` over `inputs.len()` ranks with `clip_norm`; returns rank 0's
    /// `(weight[0][0], bias[1], grad_norm, clip_scale)`.
    fn clipped(inputs: &[(f32, f32)], clip_norm: f32) -> (f32, f32, Option<f64>, Option<f32>) {
        let layer: Linear<AutodiffB> = LinearConfig::new(3, 2).init(&Default::default());
        let layout = ReplicaLayout::of(&layer);
        assert_eq!(layout.parameters().count(), 2);
        let groups = ThreadGroup::new_group(inputs.len()).unwrap();
        let options = ReduceOptions {
            clip_norm: Some(clip_norm),
            ..ReduceOptions::default()
        };
        let outcomes: Vec<ReduceOutcome> = std::thread::scope(|s| {
            let handles: Vec<_> = groups
                .into_iter()
                .zip(inputs)
                .map(|(group, &(w, b))| {
                    let (layer, layout, options) = (&layer, &layout, &options);
                    s.spawn(move || {
                        let group: Arc<dyn ProcessGroup> = Arc::new(group);
                        let mut reducer =
                            Reducer::new(group, layout, &DdpConfig::default()).unwrap();
                        let grads = grads_of(layer, w, b);
                        reducer
                            .reduce_with::<B>(Some(grads), &Default::default(), options)
                            .unwrap()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let first = &outcomes[0];
        let weight = first.grads.get::<B, 2>(layer.weight.id).unwrap();
        let bias_id = layer.bias.as_ref().unwrap().id;
        let bias = first.grads.get::<B, 1>(bias_id).unwrap();
        let w = weight.into_data().to_vec::<f32>().unwrap()[0];
        let b = bias.into_data().to_vec::<f32>().unwrap()[1];
        (w, b, first.grad_norm, first.clip_scale)
    }

    #[test]
    fn clipping_follows_the_torch_formula_on_the_reduced_gradients() {
        // Averaged over 2 ranks: weight[0][0] = (6 + 0) / 2 = 3, bias[1] = (0 + 8) / 2 = 4, so
        // the global 2-norm is 5; clipping to 1 multiplies by 1 / (5 + 1e-6).
        let coefficient = 1.0 / (5.0 + 1e-6);
        for inputs in [&[(6.0, 0.0), (0.0, 8.0)][..], &[(3.0, 4.0)][..]] {
            let (w, b, norm, scale) = clipped(inputs, 1.0);
            assert_eq!(norm, Some(5.0), "{} ranks", inputs.len());
            let scale = scale.expect("clipped");
            assert!((f64::from(scale) - coefficient).abs() < 1e-7, "{scale}");
            assert!((f64::from(w) - 3.0 * coefficient).abs() < 1e-6, "{w}");
            assert!((f64::from(b) - 4.0 * coefficient).abs() < 1e-6, "{b}");
            // Below the threshold nothing changes (and no scale is reported).
            let (w, b, norm, scale) = clipped(inputs, 10.0);
            assert_eq!((w, b, norm, scale), (3.0, 4.0, Some(5.0), None));
        }
    }

    /// A process group that takes the reducer's device path (NCCL's) on the CPU: it "reduces
    /// device tensors" by reading Flex tensors to the host, all-reducing them with a
    /// [`ThreadGroup`] in `f32`, and putting the result back in the tensor's dtype.
    struct DeviceStaged(ThreadGroup);

    type Dev = burn::backend::Flex;
    type AutodiffDev = burn::backend::Autodiff<Dev>;

    impl ProcessGroup for DeviceStaged {
        fn rank(&self) -> usize {
            self.0.rank()
        }
        fn world_size(&self) -> usize {
            self.0.world_size()
        }
        fn backend(&self) -> &'static str {
            "staged"
        }
        fn all_reduce(&self, bucket: &mut [f32], op: ReduceOp, timeout: Duration) -> Result<()> {
            self.0.all_reduce(bucket, op, timeout)
        }
        fn broadcast(&self, buffer: &mut [f32], root: usize, timeout: Duration) -> Result<()> {
            self.0.broadcast(buffer, root, timeout)
        }
        fn barrier(&self, timeout: Duration) -> Result<()> {
            self.0.barrier(timeout)
        }
        fn all_gather(&self, values: &[u64], timeout: Duration) -> Result<Vec<u64>> {
            self.0.all_gather(values, timeout)
        }
        fn abort(&self, reason: &str) {
            self.0.abort(reason)
        }
        fn reduces_device_tensors(&self) -> bool {
            true
        }
        fn all_reduce_device(
            &self,
            tensor: &mut dyn std::any::Any,
            op: ReduceOp,
            timeout: Duration,
        ) -> Result<bool> {
            let Some(primitive) = tensor.downcast_mut::<burn::tensor::ops::FloatTensor<Dev>>()
            else {
                return Ok(false);
            };
            let bucket =
                Tensor::<Dev, 1>::from_primitive(TensorPrimitive::Float(primitive.clone()));
            let dtype = bucket.dtype();
            let mut values = bucket.into_data().convert::<f32>().to_vec::<f32>().unwrap();
            self.0.all_reduce(&mut values, op, timeout)?;
            let len = values.len();
            let data = TensorData::new(values, [len]).convert_dtype(dtype);
            *primitive = Tensor::<Dev, 1>::from_data(data, &Default::default())
                .into_primitive()
                .tensor();
            Ok(true)
        }
    }

    /// Rank `rank`'s gradients for `layer` (weight `[3, 2]`, bias `[2]`): distinct values on
    /// every element; rank 1 has no bias gradient; `nan` puts a NaN in rank 1's weight.
    fn device_grads(
        layer: &Linear<AutodiffDev>,
        rank: usize,
        nan: bool,
        magnitude: f32,
    ) -> GradientsParams {
        let device = Default::default();
        let mut grads = GradientsParams::new();
        let mut w: Vec<f32> = (0..6)
            .map(|i| (i as f32 + 1.0) * 0.37 * magnitude * if rank == 0 { 1.0 } else { -2.5 })
            .collect();
        if nan && rank == 1 {
            w[3] = f32::NAN;
        }
        let weight = Tensor::<Dev, 2>::from_data(TensorData::new(w, [3, 2]), &device);
        grads.register::<Dev, 2>(layer.weight.id, weight);
        if rank == 0 {
            let bias = layer.bias.as_ref().unwrap().id;
            grads.register::<Dev, 1>(
                bias,
                Tensor::from_data([1.25 * magnitude, -3.5 * magnitude], &device),
            );
        }
        grads
    }

    /// Rank 0's and rank 1's outcomes of one reduce over 2 ranks, through the device path
    /// (`staged`) or the host path.
    fn reduce_two(
        staged: bool,
        config: &DdpConfig,
        options: &ReduceOptions,
        nan: bool,
        magnitude: f32,
    ) -> Vec<(Vec<f32>, Option<Vec<f32>>, ReduceOutcome)> {
        let layer: Linear<AutodiffDev> = LinearConfig::new(3, 2).init(&Default::default());
        let layout = ReplicaLayout::of(&layer);
        let groups = ThreadGroup::new_group(2).unwrap();
        std::thread::scope(|s| {
            let handles: Vec<_> = groups
                .into_iter()
                .enumerate()
                .map(|(rank, group)| {
                    let (layer, layout) = (&layer, &layout);
                    s.spawn(move || {
                        let group: Arc<dyn ProcessGroup> = if staged {
                            Arc::new(DeviceStaged(group))
                        } else {
                            Arc::new(group)
                        };
                        let mut reducer = Reducer::new(group, layout, config).unwrap();
                        let grads = device_grads(layer, rank, nan, magnitude);
                        let outcome = reducer
                            .reduce_with::<Dev>(Some(grads), &Default::default(), options)
                            .unwrap();
                        let weight = outcome
                            .grads
                            .get::<Dev, 2>(layer.weight.id)
                            .map(|w| w.into_data().to_vec::<f32>().unwrap())
                            .unwrap_or_default();
                        let bias = outcome
                            .grads
                            .get::<Dev, 1>(layer.bias.as_ref().unwrap().id)
                            .map(|b| b.into_data().to_vec::<f32>().unwrap());
                        (weight, bias, outcome)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn device_buckets_reduce_exactly_like_host_buckets() {
        let config = DdpConfig::default();
        for options in [
            ReduceOptions::default(),
            ReduceOptions {
                clip_norm: Some(1.0),
                check_finite: true,
                ..ReduceOptions::default()
            },
            ReduceOptions {
                weight: 0.25,
                op: ReduceOp::Sum,
                ..ReduceOptions::default()
            },
            // Join mode's rank without samples: weight 0, but the flags still count.
            ReduceOptions {
                weight: 0.0,
                op: ReduceOp::Sum,
                ..ReduceOptions::default()
            },
        ] {
            let host = reduce_two(false, &config, &options, false, 1.0);
            let device = reduce_two(true, &config, &options, false, 1.0);
            for rank in 0..2 {
                let (hw, hb, ho) = &host[rank];
                let (dw, db, d_o) = &device[rank];
                assert_eq!(hw.len(), 6);
                // Clipping scales by a norm summed in another order (f32 on the device, f64 on
                // the host): equal within a few ulp; without clipping, bit-identical.
                let close = |d: &[f32], h: &[f32]| {
                    d.len() == h.len()
                        && d.iter().zip(h).all(|(d, h)| {
                            if options.clip_norm.is_some() {
                                (d - h).abs() <= 1e-6 * h.abs()
                            } else {
                                d == h
                            }
                        })
                };
                assert!(
                    close(dw, hw),
                    "weight, rank {rank}, {options:?}: {dw:?} vs {hw:?}"
                );
                // Rank 1 had no bias gradient, but rank 0 did: every rank gets the average.
                let (db, hb) = (db.as_ref().expect("bias"), hb.as_ref().expect("bias"));
                assert!(
                    close(db, hb),
                    "bias, rank {rank}, {options:?}: {db:?} vs {hb:?}"
                );
                assert_eq!(d_o.non_finite, ho.non_finite);
                match (d_o.grad_norm, ho.grad_norm) {
                    (Some(d), Some(h)) => assert!((d - h).abs() <= 1e-6 * h, "{d} vs {h}"),
                    (d, h) => assert_eq!(d, h),
                }
                assert_eq!(d_o.clip_scale.is_some(), ho.clip_scale.is_some());
            }
            // Both ranks hold the same result.
            assert_eq!(device[0].0, device[1].0);
        }
    }

    #[test]
    fn device_checks_do_not_overflow_where_the_host_checks_do_not() {
        // Gradients around 1e25: their squares (1e50) overflow f32, their sum does not.
        let options = ReduceOptions {
            clip_norm: Some(1.0),
            check_finite: true,
            ..ReduceOptions::default()
        };
        let config = DdpConfig::default();
        let host = reduce_two(false, &config, &options, false, 1e25);
        let device = reduce_two(true, &config, &options, false, 1e25);
        for rank in 0..2 {
            let (h, d) = (&host[rank].2, &device[rank].2);
            assert!(
                !h.non_finite && !d.non_finite,
                "finite gradients, rank {rank}"
            );
            let (hn, dn) = (h.grad_norm.unwrap(), d.grad_norm.unwrap());
            assert!(hn > 1e25 && hn.is_finite(), "{hn}");
            assert!((dn - hn).abs() <= 1e-6 * hn, "norm {dn} vs {hn}");
            let (hs, ds) = (h.clip_scale.unwrap(), d.clip_scale.unwrap());
            assert!((ds - hs).abs() <= 1e-6 * hs, "scale {ds} vs {hs}");
            assert_eq!(device[rank].0.len(), 6);
        }
    }

    #[test]
    fn device_buckets_report_nan_on_every_rank() {
        let options = ReduceOptions {
            check_finite: true,
            ..ReduceOptions::default()
        };
        let outcomes = reduce_two(true, &DdpConfig::default(), &options, true, 1.0);
        for (rank, (weight, bias, outcome)) in outcomes.iter().enumerate() {
            assert!(outcome.non_finite, "rank {rank}");
            assert_eq!(outcome.local_non_finite, rank == 1, "rank {rank}");
            assert!(
                weight.is_empty() && bias.is_none(),
                "the step must be skipped"
            );
        }
    }

    #[test]
    fn compressed_device_buckets_match_f32_within_16_bit_rounding() {
        let options = ReduceOptions::default();
        let exact = reduce_two(false, &DdpConfig::default(), &options, false, 1.0);
        for (compression, epsilon) in [
            (GradientCompression::Bf16, 2f32.powi(-8)),
            (GradientCompression::F16, 2f32.powi(-11)),
        ] {
            let config = DdpConfig::default().with_gradient_compression(compression);
            let compressed = reduce_two(true, &config, &options, false, 1.0);
            let (ew, eb, _) = &exact[0];
            let (cw, cb, _) = &compressed[0];
            let values = |w: &Vec<f32>, b: &Option<Vec<f32>>| {
                w.iter()
                    .chain(b.iter().flatten())
                    .copied()
                    .collect::<Vec<f32>>()
            };
            let (e, c) = (values(ew, eb), values(cw, cb));
            assert_eq!(e.len(), 8);
            let mut differs = false;
            for (e, c) in e.iter().zip(&c) {
                // Two roundings (each rank's cast, then the sum's): 2 ulp of the 16-bit format.
                assert!(
                    (e - c).abs() <= 2.0 * epsilon * e.abs(),
                    "{compression:?}: {c} vs {e}"
                );
                differs |= e != c;
            }
            assert!(
                differs,
                "{compression:?}: the values went through a 16-bit format"
            );
            assert_eq!(compressed[0].0, compressed[1].0);
        }
    }

    #[test]
    fn buckets_follow_reverse_order_and_caps() {
        // Four parameters of 100, 300, 50 and 400 elements (400, 1200, 200, 1600 bytes).
        let numels = [100, 300, 50, 400];
        let layout = BucketLayout::new(&numels, 1000, 1500);
        let buckets = layout.buckets();
        // Reverse order: 3 (1600 B) closes the first bucket at once (cap 1000);
        // then 2 (200 B) + 1 (1200 B) = 1400 < 1500, + 0 (400 B) = 1800 closes the second.
        assert_eq!(buckets.len(), 2);
        assert_eq!(buckets[0].params, vec![3]);
        assert_eq!(buckets[0].numel, 400);
        assert_eq!(buckets[1].params, vec![2, 1, 0]);
        assert_eq!(buckets[1].offsets, vec![0, 50, 350]);
        assert_eq!(buckets[1].numel, 450);
    }

    #[test]
    fn small_models_fit_one_bucket_with_default_caps() {
        let numels = [160, 16, 4608, 32, 100_352, 64, 640, 10];
        let config = DdpConfig::default();
        let layout = BucketLayout::new(
            &numels,
            config.first_bucket_cap_bytes(),
            config.bucket_cap_bytes(),
        );
        assert_eq!(layout.buckets().len(), 1);
        assert_eq!(layout.buckets()[0].numel, numels.iter().sum::<usize>());
        assert_eq!(layout.buckets()[0].params, (0..8).rev().collect::<Vec<_>>());
    }

    #[test]
    fn every_parameter_lands_in_exactly_one_bucket() {
        let numels: Vec<usize> = (1..40).map(|i| (i * 7919) % 5000 + 1).collect();
        let layout = BucketLayout::new(&numels, 4096, 16384);
        let mut seen: Vec<usize> = layout
            .buckets()
            .iter()
            .flat_map(|b| b.params.clone())
            .collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..numels.len()).collect::<Vec<_>>());
        for b in layout.buckets() {
            let sum: usize = b.params.iter().map(|&p| numels[p]).sum();
            assert_eq!(sum, b.numel);
        }
    }
}
