//! The reducer: averages a replica's gradients across ranks, bucket by bucket.
//!
//! Following PyTorch DDP's `Reducer`:
//! - parameters are assigned to buckets in **reverse registration order** (the last layers'
//!   gradients come first out of the backward pass), with a size cap per bucket: 1 MiB for the
//!   first, 25 MiB for the others by default ([`DdpConfig`]); a bucket closes once it reaches its
//!   cap, so a parameter larger than the cap gets a bucket of its own ([`layout`]);
//! - the layout depends only on shapes and order, so it is the same on every rank (checked at
//!   start-up by [`ReplicaLayout::verify_across`]);
//! - each step, each bucket's gradients are flattened into one contiguous buffer, all-reduced
//!   with [`ReduceOp::Avg`] (sum in rank order, divided by the world size), and split back into
//!   gradients: host buffers for the CPU process groups ([`host`]), device tensors for NCCL
//!   ([`device`]), optionally 16-bit on the wire ([`compress`]);
//! - after the all-reduce, one implementation of the post-reduction steps ([`checks`]): the
//!   NaN/infinity verdict and clipping by the global norm, from values every rank shares.
//!
//! A parameter that got no gradient on a rank (unused in that rank's forward pass) contributes
//! zeros. Each bucket carries one extra element per parameter, 1.0 where the rank has a gradient,
//! so after the all-reduce every rank knows whether any rank had one: a parameter without a
//! gradient on every rank is left out of the result, exactly as single-device training would leave
//! it out of the optimizer step.
//!
//! **The trained tensors may change.** Every step the reducer compares the model's
//! [fingerprints](crate::replica::LayoutFingerprints) with the layout the ranks agreed on (no
//! tensor data is read), and the first bucket carries two control words: how many ranks saw
//! their trainable tensors change (a layer frozen or unfrozen) and how many saw the model's
//! tensors themselves change (added, removed, replaced) or hold gradients for tensors it does not
//! train. After the all-reduce every rank reads the same words, so all take the same path in the
//! same step: a freeze or unfreeze on every rank is followed (the ranks compare their new layouts,
//! the newly trainable tensors are reduced at once, and the buckets are rebuilt); a change on
//! some ranks only, or a change of the tensors, is a [`DdpError::ModelChanged`] on every rank,
//! naming the tensor. A weight reachable from two places of the module tree (one `ParamId`) is
//! reduced once, as Burn's optimizer updates it once.

mod changes;
mod checks;
use changes::Changes;
pub mod compress;
mod device;
mod gradients;
mod host;
pub mod layout;
mod options;

pub use compress::GradientCompression;
pub use layout::{Bucket, BucketLayout};
pub use options::{ReduceOptions, ReduceOutcome};

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::optim::GradientsParams;
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

use crate::config::DdpConfig;
use crate::error::{DdpError, Result};
use crate::group::{HalfFloat, ProcessGroup, ReduceOp};
use crate::hooks::CommHook;
use crate::metrics::CommStats;
use crate::replica::{LayoutFingerprints, ReplicaLayout, ReplicaView, TensorSpec};
use checks::{Observed, Verdict};
use device::{DevicePhase, DeviceRead, observe_device};
use gradients::{has_gradient, numels, register_shaped, take_flat, with_dims};
use host::HostPhase;
use layout::trainable;
use options::Control;

/// Per bucket, per parameter of the bucket: this rank's flattened gradient, if it has one.
type Gradients<B> = Vec<Vec<Option<Tensor<B, 1>>>>;

/// Averages gradients across the ranks of a process group.
///
/// Build one per replica with [`Reducer::new`] (every rank at the same time: it checks that the
/// replicas match), then call [`Reducer::reduce`] once per optimizer step.
pub struct Reducer {
    group: Arc<dyn ProcessGroup>,
    timeout: Duration,
    stats: CommStats,
    /// The dtype of device buckets on the wire.
    compression: GradientCompression,
    first_cap_bytes: usize,
    cap_bytes: usize,
    /// The layout the ranks agreed on last (at start-up, or when the trainable tensors changed).
    agreed: ReplicaLayout,
    /// This rank's fingerprints of `agreed`.
    agreed_fingerprints: LayoutFingerprints,
    /// The parameters reduced every step (`agreed`'s trainable tensors, each id once).
    params: Vec<TensorSpec>,
    layout: BucketLayout,
    /// One host buffer per bucket (gradients, presence flags, control words), allocated at the
    /// first multi-rank step and reused: `4 * (numel + params)` bytes each, plus the control words.
    buffers: Vec<Vec<f32>>,
    /// Buckets whose compression fallback was already reported (device buckets).
    warned: BTreeSet<usize>,
    /// How host buckets are reduced.
    hook: Arc<dyn CommHook>,
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
        // Every rank has the same configuration and kind of group, so every rank fails here
        // alike; the abort covers a peer that does not.
        let hook = hook_for(config, group.as_ref()).inspect_err(|e| group.abort(&e.to_string()))?;
        replica.verify_across(group.as_ref(), config.timeout())?;
        let params = trainable(replica);
        let layout = BucketLayout::at_least_one(
            &numels(&params),
            config.first_bucket_cap_bytes(),
            config.bucket_cap_bytes(),
        );
        Ok(Self {
            group,
            timeout: config.timeout(),
            stats: CommStats::default(),
            compression: config.gradient_compression(),
            first_cap_bytes: config.first_bucket_cap_bytes(),
            cap_bytes: config.bucket_cap_bytes(),
            agreed_fingerprints: replica.fingerprints(),
            agreed: replica.clone(),
            params,
            layout,
            buffers: Vec::new(),
            warned: BTreeSet::new(),
            hook,
        })
    }

    /// The bucket layout.
    pub fn layout(&self) -> &BucketLayout {
        &self.layout
    }

    /// The parameters whose gradients are reduced, in registration order (a shared weight once).
    pub fn parameters(&self) -> &[TensorSpec] {
        &self.params
    }

    /// The replica layout the ranks agreed on last: at start-up, or at the step where their
    /// trainable tensors changed.
    pub fn replica(&self) -> &ReplicaLayout {
        &self.agreed
    }

    /// Takes the last reduction out of the step count: it was the end-of-data check, not a
    /// gradient synchronisation.
    pub(crate) fn uncount_step(&mut self) {
        self.stats.steps = self.stats.steps.saturating_sub(1);
        let buckets = self.layout.buckets().len() as u64;
        self.stats.buckets = self.stats.buckets.saturating_sub(buckets);
    }

    /// Communication counters since the reducer was built.
    pub fn stats(&self) -> &CommStats {
        &self.stats
    }

    /// The process group.
    pub fn group(&self) -> &Arc<dyn ProcessGroup> {
        &self.group
    }

    /// Replaces every parameter's gradient in `grads` by its average over all ranks. `replica` is
    /// the model the gradients come from (see [`Replica`](crate::replica::Replica)), `B` the
    /// backend the gradients live on (the inner backend of the autodiff backend), `device` the
    /// rank's device, where the reduced gradients are put.
    ///
    /// With a world size of 1 the gradients are returned as they are (the average of one rank).
    ///
    /// # Errors
    /// [`DdpError::Bucket`] when a gradient's shape differs from its parameter's;
    /// [`DdpError::ModelChanged`] (on every rank) when the model's tensors changed since the
    /// layout was agreed, or its trainable tensors changed on some ranks only; the all-reduce's
    /// errors ([`DdpError::Timeout`], [`DdpError::PeerLeft`], [`DdpError::Mismatch`], ...). After
    /// an error the gradients are lost and the process group is aborted.
    pub fn reduce<B: Backend>(
        &mut self,
        replica: &dyn ReplicaView,
        grads: GradientsParams,
        device: &B::Device,
    ) -> Result<GradientsParams> {
        self.reduce_with::<B>(replica, Some(grads), device, &ReduceOptions::default())
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
        replica: &dyn ReplicaView,
        grads: Option<GradientsParams>,
        device: &B::Device,
        options: &ReduceOptions,
    ) -> Result<ReduceOutcome> {
        let step = self.stats.steps;
        self.stats.steps += 1;
        let seen = replica.fingerprints();
        let structure_changed = seen.structure != self.agreed_fingerprints.structure;
        let trainable_changed =
            !structure_changed && seen.trainable != self.agreed_fingerprints.trainable;
        let proposed = trainable_changed.then(|| self.agreed.with_trainable(&replica.scan()));

        if self.group.world_size() == 1
            && options.weight == 1.0
            && let Some(grads) = grads
        {
            // One rank: nothing to reduce, and no host copy of the gradients either.
            if structure_changed {
                return Err(self.structure_error(step, replica, 0)?);
            }
            // As on several ranks: the gradients of the agreed trainable tensors and of those
            // trainable since (a tensor frozen after the backward pass still has its gradient).
            let mut known = self
                .params
                .iter()
                .filter(|spec| has_gradient::<B>(&grads, spec))
                .count();
            if let Some(proposed) = proposed {
                let before: HashSet<usize> = self.params.iter().map(|p| p.index).collect();
                known += trainable(&proposed)
                    .iter()
                    .filter(|spec| !before.contains(&spec.index) && has_gradient::<B>(&grads, spec))
                    .count();
                self.adopt(proposed, seen, step);
            }
            if known != grads.len() {
                return Err(self.structure_error(step, replica, grads.len() - known)?);
            }
            let mut outcome = self.local_checks::<B>(grads, options);
            outcome.words = options.words.clone();
            return Ok(outcome);
        }

        // The agreed layout is moved out for the step (the paths borrow it), then put back.
        let layout = std::mem::replace(&mut self.layout, BucketLayout::new(&[], 1, 1));
        let params = std::mem::take(&mut self.params);
        let changes = Changes {
            step,
            structure_changed,
            trainable_changed,
            proposed,
        };
        let result = self.reduce_step::<B>(
            &layout,
            &params,
            replica,
            grads.unwrap_or_default(),
            changes,
            device,
            options,
        );
        self.layout = layout;
        self.params = params;
        let (outcome, adopted) = result?;
        if let Some(adopted) = adopted {
            self.adopt(adopted, seen, step);
        }
        Ok(outcome)
    }

    /// One multi-rank step: the agreed buckets (phase 1), then, when the ranks' trainable tensors
    /// changed together, the newly trainable tensors (phase 2); then the checks and the
    /// gradients. Returns the layout to adopt when the trainable tensors changed.
    #[allow(clippy::too_many_arguments)]
    fn reduce_step<B: Backend>(
        &mut self,
        layout: &BucketLayout,
        params: &[TensorSpec],
        replica: &dyn ReplicaView,
        mut grads: GradientsParams,
        changes: Changes,
        device: &B::Device,
        options: &ReduceOptions,
    ) -> Result<(ReduceOutcome, Option<ReplicaLayout>)> {
        let rank = self.group.rank();
        let taken = if changes.structure_changed {
            // This rank's tensors no longer match the agreed layout (a gradient may not even fit
            // its slot): contribute nothing, and let the structure word bring every rank to the
            // same `ModelChanged` error below.
            layout
                .buckets()
                .iter()
                .map(|b| b.params.iter().map(|_| None).collect())
                .collect()
        } else {
            self.take::<B>(&mut grads, params, layout)?
        };
        // This rank's gradients of the tensors it made trainable since the agreed layout.
        let mut extra: HashMap<usize, Option<Tensor<B, 1>>> = HashMap::new();
        if let Some(proposed) = &changes.proposed {
            for spec in trainable(proposed) {
                if !params.iter().any(|p| p.index == spec.index) {
                    let grad = take_flat::<B>(&mut grads, &spec)
                        .map_err(|detail| self.fail_bucket(0, detail))?;
                    extra.insert(spec.index, grad);
                }
            }
        }
        // Whatever is left belongs to no tensor this rank's model trains.
        let unknown = grads.len();
        if options.words.len() > ReduceOptions::MAX_WORDS {
            return Err(self.fail_bucket(
                0,
                format!(
                    "{} words of the caller's, more than ReduceOptions::MAX_WORDS ({})",
                    options.words.len(),
                    ReduceOptions::MAX_WORDS
                ),
            ));
        }
        // Always the same number of words, whatever a rank passes: the buckets stay alike.
        let mut words = options.words.clone();
        words.resize(ReduceOptions::MAX_WORDS, 0.0);
        let control = Control {
            trainable_changed: f32::from(u8::from(changes.trainable_changed)),
            structure_changed: f32::from(u8::from(changes.structure_changed || unknown > 0)),
            words,
        };
        let on_device = self.group.reduces_device_tensors();

        let first = if on_device {
            let phase =
                self.reduce_device::<B>(layout, params, taken, Some(&control), options, device)?;
            let read = phase.read(layout, options, rank)?;
            Phase::Device(phase, read)
        } else {
            let buffers = std::mem::take(&mut self.buffers);
            Phase::Host(self.reduce_host::<B>(
                layout,
                params,
                taken,
                buffers,
                Some(&control),
                options,
            )?)
        };
        let mut reduced_control = first
            .control(layout, ReduceOptions::MAX_WORDS)
            .unwrap_or_default();
        reduced_control.words.truncate(options.words.len());
        if reduced_control.structure_changed > 0.0 {
            return Err(self.structure_error(changes.step, replica, unknown)?);
        }

        let mut second: Option<(BucketLayout, Vec<TensorSpec>, Phase<B>)> = None;
        let mut adopted = None;
        if reduced_control.trainable_changed > 0.0 {
            let proposal = changes.proposed.unwrap_or_else(|| self.agreed.clone());
            proposal
                .verify_across(self.group.as_ref(), self.timeout)
                .map_err(|err| match err {
                    DdpError::ReplicaMismatch { detail, .. } => DdpError::ModelChanged {
                        rank,
                        step: changes.step,
                        detail: format!(
                            "the ranks' trainable tensors changed differently (frozen or \
                             unfrozen on some ranks only?): {detail}"
                        ),
                    },
                    other => other,
                })?;
            let specs: Vec<TensorSpec> = trainable(&proposal)
                .into_iter()
                .filter(|spec| !params.iter().any(|p| p.index == spec.index))
                .collect();
            let extra_layout =
                BucketLayout::new(&numels(&specs), self.first_cap_bytes, self.cap_bytes);
            let taken: Gradients<B> = extra_layout
                .buckets()
                .iter()
                .map(|b| {
                    b.params
                        .iter()
                        .map(|&p| extra.remove(&specs[p].index).flatten())
                        .collect()
                })
                .collect();
            let phase = if on_device {
                let phase =
                    self.reduce_device::<B>(&extra_layout, &specs, taken, None, options, device)?;
                let read = phase.read(&extra_layout, options, rank)?;
                Phase::Device(phase, read)
            } else {
                Phase::Host(self.reduce_host::<B>(
                    &extra_layout,
                    &specs,
                    taken,
                    Vec::new(),
                    None,
                    options,
                )?)
            };
            self.stats.layout_changes += 1;
            tracing::info!(
                "burn-ddp: rank {rank}: the trainable tensors changed on every rank at gradient \
                 synchronisation #{}: {} tensor(s) more to reduce now, {} in all",
                changes.step,
                specs.len(),
                trainable(&proposal).len()
            );
            second = Some((extra_layout, specs, phase));
            adopted = Some(proposal);
        }

        // The checks, over both phases, in bucket order.
        let started = Instant::now();
        let mut observed = Observed::default();
        let mut local_non_finite = false;
        let mut device_checks: Vec<(Vec<f32>, usize)> = Vec::new();
        for (phase, phase_layout) in
            std::iter::once((&first, layout)).chain(second.as_ref().map(|(l, _, p)| (p, l)))
        {
            match phase {
                Phase::Host(host) => {
                    let o = host.observe(phase_layout, options);
                    observed.non_finite |= o.non_finite;
                    observed.sum_of_squares += o.sum_of_squares;
                    local_non_finite |= host.local_non_finite;
                }
                Phase::Device(_, read) => {
                    device_checks.push((read.checks.clone(), phase_layout.buckets().len()));
                    local_non_finite |= read.local_non_finite;
                }
            }
        }
        if !device_checks.is_empty() {
            // Device reductions need not be deterministic: every rank decides on the average.
            let mut all: Vec<f32> = device_checks.iter().flat_map(|(c, _)| c.clone()).collect();
            if !all.is_empty() {
                self.group
                    .all_reduce(&mut all, ReduceOp::Avg, self.timeout)?;
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
        let verdict = Verdict::of(observed, options);
        let mut outcome = ReduceOutcome {
            words: reduced_control.words,
            local_non_finite: options.check_finite && local_non_finite,
            non_finite: verdict.non_finite,
            grad_norm: verdict.norm,
            clip_scale: verdict.clip_scale(),
            grads: GradientsParams::new(),
        };
        let keep_buffers = adopted.is_none();
        if verdict.non_finite {
            if let (Phase::Host(host), true) = (first, keep_buffers) {
                self.buffers = host.buffers;
            }
            self.stats.unflatten += started.elapsed();
            return Ok((outcome, adopted));
        }
        let mut reduced = GradientsParams::new();
        self.unflatten_phase::<B>(
            first,
            layout,
            params,
            &mut reduced,
            &verdict,
            device,
            keep_buffers,
        )?;
        if let Some((extra_layout, specs, phase)) = second {
            self.unflatten_phase::<B>(
                phase,
                &extra_layout,
                &specs,
                &mut reduced,
                &verdict,
                device,
                false,
            )?;
        }
        self.stats.unflatten += started.elapsed();
        outcome.grads = reduced;
        Ok((outcome, adopted))
    }

    /// Writes one phase's reduced gradients into `grads`; keeps a host phase's buffers for the
    /// next step when `keep`.
    #[allow(clippy::too_many_arguments)]
    fn unflatten_phase<B: Backend>(
        &mut self,
        phase: Phase<B>,
        layout: &BucketLayout,
        specs: &[TensorSpec],
        grads: &mut GradientsParams,
        verdict: &Verdict,
        device: &B::Device,
        keep: bool,
    ) -> Result<()> {
        match phase {
            Phase::Host(host) => {
                let rank = self.group.rank();
                let buffers =
                    host.unflatten::<B>(layout, specs, grads, verdict.scale, device, rank)?;
                if keep {
                    self.buffers = buffers;
                }
            }
            Phase::Device(phase, read) => {
                phase.unflatten(layout, specs, grads, &read.flags, verdict.scale);
            }
        }
        Ok(())
    }

    /// Removes `specs`' gradients from `grads`, flattened, per bucket of `layout`.
    fn take<B: Backend>(
        &self,
        grads: &mut GradientsParams,
        specs: &[TensorSpec],
        layout: &BucketLayout,
    ) -> Result<Gradients<B>> {
        layout
            .buckets()
            .iter()
            .enumerate()
            .map(|(bucket_index, bucket)| {
                bucket
                    .params
                    .iter()
                    .map(|&p| {
                        take_flat::<B>(grads, &specs[p])
                            .map_err(|detail| self.fail_bucket(bucket_index, detail))
                    })
                    .collect()
            })
            .collect()
    }

    /// A [`DdpError::Bucket`] for this rank, after aborting the group: the peers must not wait
    /// for this rank's all-reduce.
    fn fail_bucket(&self, bucket: usize, detail: String) -> DdpError {
        let err = DdpError::Bucket {
            rank: self.group.rank(),
            bucket,
            detail,
        };
        self.group.abort(&err.to_string());
        err
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
        let observed = Observed {
            non_finite: values.iter().any(|v| !v.is_finite()),
            sum_of_squares: values.iter().sum(),
        };
        let verdict = Verdict::of(observed, options);
        if verdict.non_finite {
            outcome.non_finite = true;
            outcome.local_non_finite = true;
            return outcome;
        }
        outcome.grad_norm = verdict.norm;
        outcome.clip_scale = verdict.clip_scale();
        if let Some(scale) = outcome.clip_scale {
            for spec in &self.params {
                with_dims!(spec.shape.len(), D => {
                    if let Some(g) = grads.remove::<B, D>(spec.id) {
                        grads.register::<B, D>(spec.id, g.mul_scalar(scale));
                    }
                }, else {});
            }
        }
        outcome.grads = grads;
        outcome
    }
}

/// One phase's reduced buckets.
enum Phase<B: Backend> {
    Host(HostPhase),
    Device(DevicePhase<B>, DeviceRead),
}

impl<B: Backend> Phase<B> {
    /// The reduced control words, with `caller` words of the caller's.
    fn control(&self, layout: &BucketLayout, caller: usize) -> Option<Control> {
        match self {
            Phase::Host(host) => host.control(layout, caller),
            Phase::Device(_, read) => read.control.clone(),
        }
    }
}

/// The hook a configuration asks for, checked against `group`: a user's, compression, or the
/// default all-reduce.
///
/// # Errors
/// [`DdpError::InvalidConfig`] for a user's hook on a group that reduces device buckets (NCCL).
fn hook_for(config: &DdpConfig, group: &dyn ProcessGroup) -> Result<Arc<dyn CommHook>> {
    if let Some(hook) = config.comm_hook() {
        if group.reduces_device_tensors() {
            return Err(DdpError::InvalidConfig(format!(
                "the communication hook `{}` reduces host buckets, but the {} process group \
                 reduces gradient buckets in device memory; use the built-in all-reduce or \
                 DdpConfig::with_gradient_compression with it",
                hook.name(),
                group.backend()
            )));
        }
        return Ok(hook.clone());
    }
    use crate::hooks::{AllReduce, Compress16};
    Ok(match config.gradient_compression() {
        GradientCompression::None => Arc::new(AllReduce),
        GradientCompression::Bf16 => Arc::new(Compress16::new(HalfFloat::Bf16)),
        GradientCompression::F16 => Arc::new(Compress16::new(HalfFloat::F16)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::group::ThreadGroup;
    use crate::replica::Replica;
    use burn::backend::NdArray;
    use burn::nn::{Linear, LinearConfig};
    use burn::tensor::{TensorData, TensorPrimitive};

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
                            .reduce_with::<B>(
                                &Replica::<AutodiffB, _>::new(layer),
                                Some(grads),
                                &Default::default(),
                                options,
                            )
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
        reduce_two_with(staged, config, options, |layer, rank| {
            device_grads(layer, rank, nan, magnitude)
        })
        .into_iter()
        .map(|(w, b, o, _)| (w, b, o))
        .collect()
    }

    /// One rank's reduced weight and bias gradients, outcome and counters.
    type RankResult = (Vec<f32>, Option<Vec<f32>>, ReduceOutcome, CommStats);

    /// [`reduce_two`] with rank `r`'s gradients from `grads(layer, r)`; also returns each rank's
    /// communication counters.
    fn reduce_two_with(
        staged: bool,
        config: &DdpConfig,
        options: &ReduceOptions,
        grads: impl Fn(&Linear<AutodiffDev>, usize) -> GradientsParams + Sync,
    ) -> Vec<RankResult> {
        let layer: Linear<AutodiffDev> = LinearConfig::new(3, 2).init(&Default::default());
        let layout = ReplicaLayout::of(&layer);
        let groups = ThreadGroup::new_group(2).unwrap();
        std::thread::scope(|s| {
            let handles: Vec<_> = groups
                .into_iter()
                .enumerate()
                .map(|(rank, group)| {
                    let (layer, layout, grads) = (&layer, &layout, &grads);
                    s.spawn(move || {
                        let group: Arc<dyn ProcessGroup> = if staged {
                            Arc::new(DeviceStaged(group))
                        } else {
                            Arc::new(group)
                        };
                        let mut reducer = Reducer::new(group, layout, config).unwrap();
                        let outcome = reducer
                            .reduce_with::<Dev>(
                                &Replica::<AutodiffDev, _>::new(layer),
                                Some(grads(layer, rank)),
                                &Default::default(),
                                options,
                            )
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
                        (weight, bias, outcome, reducer.stats().clone())
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

    /// Rank `rank`'s gradients for `layer`: every element of both tensors around
    /// `magnitudes[rank]`, of mixed signs.
    fn scaled_grads(
        layer: &Linear<AutodiffDev>,
        rank: usize,
        magnitudes: [f32; 2],
    ) -> GradientsParams {
        let device = Default::default();
        let m = magnitudes[rank];
        let value = |i: usize| {
            let sign = if (i + rank).is_multiple_of(2) {
                1.0
            } else {
                -1.0
            };
            sign * m * (0.25 + 0.125 * i as f32 + 0.05 * rank as f32)
        };
        let mut grads = GradientsParams::new();
        let w: Vec<f32> = (0..6).map(value).collect();
        grads.register::<Dev, 2>(
            layer.weight.id,
            Tensor::from_data(TensorData::new(w, [3, 2]), &device),
        );
        let b: Vec<f32> = (6..8).map(value).collect();
        grads.register::<Dev, 1>(
            layer.bias.as_ref().unwrap().id,
            Tensor::from_data(TensorData::new(b, [2]), &device),
        );
        grads
    }

    #[test]
    fn compression_keeps_huge_and_tiny_gradients_within_16_bit_rounding_per_element() {
        // f16 overflows above 65,504 (2e5 after pre-division is 1e5) and flushes 1e-9 to zero;
        // bf16 keeps f32's range. Per element, through the device path's stand-in.
        let options = ReduceOptions {
            check_finite: true,
            ..ReduceOptions::default()
        };
        for (compression, eps) in [
            (GradientCompression::F16, 2f32.powi(-11)),
            (GradientCompression::Bf16, 2f32.powi(-8)),
        ] {
            for magnitude in [2e5f32, 1e-9] {
                let magnitudes = [magnitude, magnitude * 1.5];
                let exact = reduce_two_with(false, &DdpConfig::default(), &options, |l, r| {
                    scaled_grads(l, r, magnitudes)
                });
                let config = DdpConfig::default().with_gradient_compression(compression);
                let compressed = reduce_two_with(true, &config, &options, |l, r| {
                    scaled_grads(l, r, magnitudes)
                });
                for rank in 0..2 {
                    let (cw, cb, co, stats) = &compressed[rank];
                    let (ew, eb, _, _) = &exact[rank];
                    assert!(!co.non_finite, "{compression:?} {magnitude:e}: not finite");
                    assert_eq!(
                        stats.uncompressed_buckets, 0,
                        "{compression:?} {magnitude:e}"
                    );
                    let c: Vec<f32> = cw.iter().chain(cb.iter().flatten()).copied().collect();
                    let e: Vec<f32> = ew.iter().chain(eb.iter().flatten()).copied().collect();
                    assert_eq!(c.len(), 8);
                    for (i, (c, e)) in c.iter().zip(&e).enumerate() {
                        // Each rank's value rounded once, the sum once (the stand-in sums in f32),
                        // relative to the magnitudes summed.
                        let bound = 4.0 * eps * magnitude * 2.0;
                        assert!(
                            (c - e).abs() <= bound && *c != 0.0,
                            "{compression:?} {magnitude:e} rank {rank} element {i}: {c} vs {e}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn a_bucket_wider_than_f16_goes_as_f32_counted_on_every_rank() {
        // Rank 0 near 2e5, rank 1 near 1e-9: one bucket spanning 14 orders of magnitude.
        let magnitudes = [2e5f32, 1e-9];
        let options = ReduceOptions::default();
        let exact = reduce_two_with(false, &DdpConfig::default(), &options, |l, r| {
            scaled_grads(l, r, magnitudes)
        });
        let config = DdpConfig::default().with_gradient_compression(GradientCompression::F16);
        let compressed = reduce_two_with(true, &config, &options, |l, r| {
            scaled_grads(l, r, magnitudes)
        });
        for rank in 0..2 {
            let (cw, cb, _, stats) = &compressed[rank];
            assert_eq!(stats.uncompressed_buckets, 1, "rank {rank}");
            // Sent as f32: exactly the f32 result.
            assert_eq!(cw, &exact[rank].0, "rank {rank}");
            assert_eq!(cb, &exact[rank].1, "rank {rank}");
        }
    }

    #[test]
    fn a_nan_under_compression_is_named_on_the_rank_that_had_it() {
        let options = ReduceOptions {
            check_finite: true,
            ..ReduceOptions::default()
        };
        for compression in [GradientCompression::F16, GradientCompression::Bf16] {
            let config = DdpConfig::default().with_gradient_compression(compression);
            let outcomes = reduce_two(true, &config, &options, true, 2e5);
            for (rank, (_, _, outcome)) in outcomes.iter().enumerate() {
                assert!(outcome.non_finite, "{compression:?} rank {rank}");
                assert_eq!(
                    outcome.local_non_finite,
                    rank == 1,
                    "{compression:?} rank {rank}"
                );
            }
        }
    }
}
