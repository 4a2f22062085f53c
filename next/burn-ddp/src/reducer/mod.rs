//! The reducer: averages a replica's gradients across ranks, bucket by bucket.
//!
//! Following PyTorch DDP's `Reducer`:
//! - parameters are assigned to buckets in **reverse registration order** (the last layers'
//!   gradients come first out of the backward pass), with a size cap per bucket: 1 MiB for the
//!   first, 25 MiB for the others by default ([`ReducerOptions`]); a bucket closes once it reaches its
//!   cap, so a parameter larger than the cap gets a bucket of its own ([`layout`]);
//! - the layout depends only on shapes and order, so it is the same on every rank (checked at
//!   start-up by [`ReplicaLayout::verify_across`]);
//! - each step, each bucket's gradients are flattened into one contiguous buffer, all-reduced
//!   with [`ReduceOp::Avg`] (sum in rank order, divided by the world size), and split back into
//!   gradients: host buffers for the CPU process groups ([`host`]), device tensors for NCCL
//!   ([`device`]), optionally 16-bit on the wire ([`compress`](crate::compress));
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
mod device;
mod gradients;
mod host;
pub mod layout;
mod link;
mod options;
mod phase;
mod scatter;
mod shared;

use crate::compress::GradientCompression;
#[allow(unused_imports)] // for the custom loop's `weigh_micro_batch` (stage 3)
pub(crate) use gradients::scale as scale_gradients;
#[allow(unused_imports)] // for `mechanism` (stage 3)
pub use layout::{Bucket, BucketLayout};
pub use options::{ReduceOptions, ReduceOutcome, ReducerOptions};

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use burn::optim::GradientsParams;
use burn::tensor::{Device, Tensor};

use crate::error::{DdpError, Result};
use crate::hooks::CommHook;
use crate::metrics::CommStats;
use crate::replica::{ReplicaLayout, ReplicaView, TensorSpec};
use burn_ddp_comm::group::{ExtendedCollectives, HalfFloat, ProcessGroup};
use changes::{Agreed, Changes};
use checks::{Observed, Verdict};
use device::DeviceBuckets;
use gradients::Work;
use gradients::{has_gradient, take_flat, with_dims};
use host::HostBuckets;
use layout::trainable;
use link::Link;
use options::Control;
use phase::{Buckets, Phase};
use shared::SharedBuckets;

/// Averages gradients across the ranks of a process group.
///
/// Build one per replica with [`Reducer::new`] (every rank at the same time: it checks that the
/// replicas match), then call [`Reducer::reduce`] once per optimizer step.
///
/// It coordinates three parts that own their state: the process group and counters (`Link`),
/// the layout the ranks agreed on (`Agreed`), and the buckets that reduce on the host or on the
/// device (`Buckets`).
pub struct Reducer {
    link: Link,
    agreed: Agreed,
    buckets: Buckets,
    /// The buckets reduced and the transfers to the host and to the device of the last
    /// reduction.
    last_counts: (u64, u64, u64),
    /// The buckets are reduced by the built-in all-reduce (no hook of the user's, no
    /// compression), so they may be reduce-scattered by owner ([`scatter_by`](Self::scatter_by)).
    scatterable: bool,
}

/// The second phase of a step: the tensors trainable since the agreed layout, reduced in buckets
/// of their own; the layout to adopt after the step.
struct NewlyTrainable {
    layout: BucketLayout,
    specs: Vec<TensorSpec>,
    phase: Phase,
    adopted: ReplicaLayout,
}

/// This rank's contribution to a multi-rank step, taken out of its gradients.
struct Taken {
    /// The agreed parameters' gradients, per bucket.
    agreed: gradients::Gradients,
    /// The gradients of the tensors this rank made trainable since the agreed layout.
    extra: HashMap<usize, Option<Tensor<1>>>,
    /// Gradients that belong to no tensor this rank's model trains.
    unknown: usize,
    /// The control words of the first bucket.
    control: Control,
}

impl Reducer {
    /// Builds the bucket layout of `replica`'s parameters and checks, with every other rank, that
    /// all replicas have the same layout. Every rank must call it.
    ///
    /// # Errors
    /// [`DdpError::ReplicaMismatch`] (on every rank) when the replicas differ; the collective's
    /// errors; [`DdpError::InvalidConfig`] for a zero timeout or bucket cap, or a hook on a group
    /// that reduces device buckets (NCCL).
    pub fn new(
        group: Arc<dyn ProcessGroup>,
        replica: &ReplicaLayout,
        config: &ReducerOptions,
    ) -> Result<Self> {
        config.validate()?;
        // Every rank has the same configuration and kind of group, so every rank fails here
        // alike; the abort covers a peer that does not.
        let hook = hook_for(config, group.as_ref()).inspect_err(|e| group.abort(&e.to_string()))?;
        replica.verify_across(group.as_ref(), config.timeout)?;
        let scatterable =
            config.comm_hook.is_none() && config.gradient_compression == GradientCompression::None;
        let shareable = config.shared_memory_reduction && scatterable;
        let buckets = if group.reduces_device_tensors() {
            Buckets::Device(DeviceBuckets::new(config.gradient_compression))
        } else if shareable {
            // Thread replicas on one device share tensors; other ranks find out at the first
            // step and use the host buckets.
            Buckets::Shared(SharedBuckets {
                host: Some(HostBuckets::new(hook)),
            })
        } else {
            Buckets::Host(HostBuckets::new(hook))
        };
        Ok(Self {
            link: Link {
                group,
                timeout: config.timeout,
                stats: CommStats::default(),
            },
            agreed: Agreed::new(
                replica,
                config.first_bucket_cap_bytes,
                config.bucket_cap_bytes,
            ),
            buckets,
            last_counts: (0, 0, 0),
            scatterable,
        })
    }

    /// Reduce-scatters the step's gradients by owner from now on (ZeRO stage 2) where the
    /// buckets are host buckets reduced by the built-in all-reduce: `owners` gives each float
    /// tensor's owner (registration order, as
    /// [`OptimizerShards::owners`](crate::mechanism::OptimizerShards::owners)), `own` this rank's
    /// mask as [`OptimizerShards::own`](crate::mechanism::OptimizerShards::own) hands it out, and
    /// a step whose [`ReduceOptions::keep`] is that very mask receives only this rank's own
    /// gradients (see [`scatter`]). Every rank must call it alike.
    pub(crate) fn scatter_by(&mut self, owners: Arc<[Option<usize>]>, own: Arc<[bool]>) {
        if !self.scatterable {
            return;
        }
        let host = match &mut self.buckets {
            Buckets::Host(host) => Some(host),
            Buckets::Shared(shared) => shared.host.as_mut(),
            Buckets::Device(_) => None,
        };
        if let Some(host) = host {
            host.scatter = Some(scatter::Scatter::new(owners, own));
        }
    }

    /// Moves host buckets' gradients by `transfer` whatever the backend (tests: the per-bucket
    /// transfer on a CPU backend).
    #[cfg(test)]
    fn force_host_transfer(&mut self, transfer: gradients::Transfer) {
        if let Buckets::Host(host) = &mut self.buckets {
            host.force_transfer(transfer);
        }
    }

    /// The bucket layout.
    pub fn layout(&self) -> &BucketLayout {
        &self.agreed.layout
    }

    /// The parameters whose gradients are reduced, in registration order (a shared weight once).
    pub fn parameters(&self) -> &[TensorSpec] {
        &self.agreed.params
    }

    /// The replica layout the ranks agreed on last: at start-up, or at the step where their
    /// trainable tensors changed.
    pub fn replica(&self) -> &ReplicaLayout {
        &self.agreed.replica
    }

    /// Takes the last reduction out of the step count: it was the end-of-data check, not a
    /// gradient synchronisation.
    pub(crate) fn uncount_step(&mut self) {
        let stats = &mut self.link.stats;
        stats.steps = stats.steps.saturating_sub(1);
        // Its buckets and transfers too (the host path moves nothing for a rank without
        // gradients, but a device path reads its flags).
        let (buckets, to_host, to_device) = self.last_counts;
        stats.buckets -= buckets;
        stats.transfers_to_host -= to_host;
        stats.transfers_to_device -= to_device;
    }

    /// Communication counters since the reducer was built.
    pub fn stats(&self) -> &CommStats {
        &self.link.stats
    }

    /// The process group.
    pub fn group(&self) -> &Arc<dyn ProcessGroup> {
        &self.link.group
    }

    /// Replaces every parameter's gradient in `grads` by its average over all ranks. `replica` is
    /// the model the gradients come from (its layout and trainable set), `device` the rank's
    /// device, where the reduced gradients are put (without its autodiff association, as the
    /// gradients a backward pass gives).
    ///
    /// With a world size of 1 the gradients are returned as they are (the average of one rank).
    ///
    /// # Errors
    /// [`DdpError::Bucket`] when a gradient's shape differs from its parameter's;
    /// [`DdpError::ModelChanged`] (on every rank) when the model's tensors changed since the
    /// layout was agreed, or its trainable tensors changed on some ranks only; the all-reduce's
    /// errors ([`CommError::Timeout`](crate::comm::CommError::Timeout), [`CommError::PeerLeft`](crate::comm::CommError::PeerLeft), [`CommError::Mismatch`](crate::comm::CommError::Mismatch), ...). After
    /// an error the gradients are lost and the process group is aborted.
    pub fn reduce(
        &mut self,
        replica: &dyn ReplicaView,
        grads: GradientsParams,
        device: &Device,
    ) -> Result<GradientsParams> {
        self.reduce_with(replica, Some(grads), device, &ReduceOptions::default())
            .map(|outcome| outcome.grads)
    }

    /// [`reduce`](Self::reduce) with options: a weight for this rank's contribution (join mode),
    /// clipping by the global norm of the reduced gradients, and a check for NaN and infinity.
    /// `grads: None` contributes zeros (a rank without a batch in join mode); the result then
    /// holds the other ranks' reduced gradients.
    ///
    /// Every rank must call it with the same `options.op`, `clip_norm` and `check_finite`, and
    /// with `keep` alike (none, a mask of the caller's, or on every rank the mask
    /// [`OptimizerShards::own`](crate::mechanism::OptimizerShards::own) hands out, which
    /// reduce-scatters under sharding). The
    /// verdicts of the outcome (non-finite, norm, clipping) are computed from the reduced values,
    /// so they are the same on every rank. When the reduced gradients are not finite, the
    /// outcome's gradients are empty: the step must be skipped (or reported).
    ///
    /// # Errors
    /// As [`reduce`](Self::reduce).
    pub fn reduce_with(
        &mut self,
        replica: &dyn ReplicaView,
        grads: Option<GradientsParams>,
        device: &Device,
        options: &ReduceOptions,
    ) -> Result<ReduceOutcome> {
        // Gradients live on the device without autodiff: zeros and buckets made on a model's
        // autodiff device would not mix with them.
        let device = &device.clone().inner();
        let step = self.link.stats.steps;
        self.link.stats.steps += 1;
        let changes = self.agreed.changes(replica, step);
        let before = (
            self.link.stats.buckets,
            self.link.stats.transfers_to_host,
            self.link.stats.transfers_to_device,
        );
        let outcome = match grads {
            Some(grads) if self.link.group.world_size() == 1 && options.weight == 1.0 => {
                self.reduce_alone(replica, grads, changes, options)
            }
            grads => {
                let seen = changes.seen;
                let (outcome, adopted) =
                    self.reduce_step(replica, grads.unwrap_or_default(), changes, device, options)?;
                if let Some(adopted) = adopted {
                    self.adopt(adopted, seen, step);
                }
                Ok(outcome)
            }
        };
        self.last_counts = (
            self.link.stats.buckets - before.0,
            self.link.stats.transfers_to_host - before.1,
            self.link.stats.transfers_to_device - before.2,
        );
        outcome
    }

    /// One rank: nothing to reduce, and no host copy of the gradients either; the changes of the
    /// model are checked as on several ranks.
    fn reduce_alone(
        &mut self,
        replica: &dyn ReplicaView,
        grads: GradientsParams,
        changes: Changes,
        options: &ReduceOptions,
    ) -> Result<ReduceOutcome> {
        let step = changes.step;
        if changes.structure_changed {
            return Err(self.agreed.structure_error(&self.link, step, replica, 0)?);
        }
        // As on several ranks: the gradients of the agreed trainable tensors and of those
        // trainable since (a tensor frozen after the backward pass still has its gradient).
        let mut known = self
            .agreed
            .params
            .iter()
            .filter(|spec| has_gradient(&grads, spec))
            .count();
        if let Some(proposed) = changes.proposed {
            let before: HashSet<usize> = self.agreed.params.iter().map(|p| p.index).collect();
            known += trainable(&proposed)
                .iter()
                .filter(|spec| !before.contains(&spec.index) && has_gradient(&grads, spec))
                .count();
            self.adopt(proposed, changes.seen, step);
        }
        if known != grads.len() {
            return Err(self.agreed.structure_error(
                &self.link,
                step,
                replica,
                grads.len() - known,
            )?);
        }
        let mut outcome = self.local_checks(grads, options);
        outcome.words = options.words.clone();
        Ok(outcome)
    }

    /// Makes `layout` the agreed one and forgets the buckets of the previous one.
    fn adopt(
        &mut self,
        layout: ReplicaLayout,
        fingerprints: crate::replica::LayoutFingerprints,
        step: u64,
    ) {
        self.agreed
            .adopt(layout, fingerprints, step, self.link.rank());
        self.buckets.clear();
    }

    /// One multi-rank step: the agreed buckets (phase 1), then, when the ranks' trainable tensors
    /// changed together, the newly trainable tensors (phase 2); then the checks and the
    /// gradients. Returns the layout to adopt when the trainable tensors changed.
    fn reduce_step(
        &mut self,
        replica: &dyn ReplicaView,
        grads: GradientsParams,
        changes: Changes,
        device: &Device,
        options: &ReduceOptions,
    ) -> Result<(ReduceOutcome, Option<ReplicaLayout>)> {
        let Taken {
            agreed: taken,
            mut extra,
            unknown,
            control,
        } = self.take(grads, &changes, options)?;
        let Self {
            link,
            agreed,
            buckets,
            ..
        } = self;
        let first_work = Work {
            layout: &agreed.layout,
            specs: &agreed.params,
            taken,
            agreed: true,
            control: Some(&control),
        };
        let first = buckets.reduce(link, first_work, options, device)?;
        let mut reduced_control = first
            .control(&agreed.layout, ReduceOptions::MAX_WORDS)
            .unwrap_or_default();
        reduced_control.words.truncate(options.words.len());
        if reduced_control.structure_changed > 0.0 {
            return Err(agreed.structure_error(link, changes.step, replica, unknown)?);
        }
        let second = if reduced_control.trainable_changed > 0.0 {
            Some(newly_trainable(
                link, agreed, buckets, changes, &mut extra, options, device,
            )?)
        } else {
            None
        };

        let started = Instant::now();
        let mut phases = vec![(&first, &agreed.layout)];
        phases.extend(second.as_ref().map(|s| (&s.phase, &s.layout)));
        let (verdict, local_non_finite) = phase::verdict(link, &phases, options)?;
        let mut outcome = ReduceOutcome {
            words: reduced_control.words,
            local_non_finite: options.check_finite && local_non_finite,
            non_finite: verdict.non_finite,
            grad_norm: verdict.norm,
            clip_scale: verdict.clip_scale(),
            grads: GradientsParams::new(),
        };
        // The agreed buffers are kept for the next step unless the layout changes now.
        let keep = second.is_none();
        if verdict.non_finite {
            if keep {
                buckets.keep(first);
            }
            link.stats.unflatten += started.elapsed();
            return Ok((outcome, second.map(|s| s.adopted)));
        }
        let work = (&agreed.layout, agreed.params.as_slice(), keep);
        let keep = options.keep.as_deref();
        buckets.unflatten(
            link,
            first,
            work,
            &mut outcome.grads,
            verdict.scale,
            keep,
            device,
        )?;
        let adopted = match second {
            Some(s) => {
                let work = (&s.layout, s.specs.as_slice(), false);
                buckets.unflatten(
                    link,
                    s.phase,
                    work,
                    &mut outcome.grads,
                    verdict.scale,
                    keep,
                    device,
                )?;
                Some(s.adopted)
            }
            None => None,
        };
        link.stats.unflatten += started.elapsed();
        Ok((outcome, adopted))
    }

    /// Takes this rank's contribution out of `grads`: the agreed parameters' gradients (none
    /// when the model's tensors changed), those of the tensors it made trainable since, and the
    /// control words.
    ///
    /// # Errors
    /// [`DdpError::Bucket`] (after aborting the group) for a gradient that does not fit its
    /// parameter, or more than [`ReduceOptions::MAX_WORDS`] words of the caller's.
    fn take(
        &self,
        mut grads: GradientsParams,
        changes: &Changes,
        options: &ReduceOptions,
    ) -> Result<Taken> {
        let (link, agreed) = (&self.link, &self.agreed);
        let taken = if changes.structure_changed {
            // This rank's tensors no longer match the agreed layout (a gradient may not even fit
            // its slot): contribute nothing, and let the structure word bring every rank to the
            // same `ModelChanged` error.
            gradients::none(&agreed.layout)
        } else {
            gradients::take(link, &mut grads, &agreed.params, &agreed.layout)?
        };
        let mut extra = HashMap::new();
        if let Some(proposed) = &changes.proposed {
            for spec in trainable(proposed) {
                if !agreed.params.iter().any(|p| p.index == spec.index) {
                    let grad = take_flat(&mut grads, &spec)
                        .map_err(|detail| link.fail_bucket(0, detail))?;
                    extra.insert(spec.index, grad);
                }
            }
        }
        if options.words.len() > ReduceOptions::MAX_WORDS {
            return Err(link.fail_bucket(
                0,
                format!(
                    "{} words of the caller's, more than ReduceOptions::MAX_WORDS ({})",
                    options.words.len(),
                    ReduceOptions::MAX_WORDS
                ),
            ));
        }
        // Whatever is left belongs to no tensor this rank's model trains.
        let unknown = grads.len();
        // Always the same number of words, whatever a rank passes: the buckets stay alike.
        let mut words = options.words.clone();
        words.resize(ReduceOptions::MAX_WORDS, 0.0);
        Ok(Taken {
            agreed: taken,
            extra,
            unknown,
            control: Control {
                trainable_changed: f32::from(u8::from(changes.trainable_changed)),
                structure_changed: f32::from(u8::from(changes.structure_changed || unknown > 0)),
                words,
            },
        })
    }

    /// The NaN/infinity check and clipping of [`reduce_with`](Self::reduce_with) for a world
    /// size of 1, on the device: one sum (or sum of squares, when clipping) per parameter, read
    /// back together; clipping multiplies each gradient on the device.
    fn local_checks(&self, mut grads: GradientsParams, options: &ReduceOptions) -> ReduceOutcome {
        let params = &self.agreed.params;
        if options.clip_norm.is_none() && !options.check_finite {
            return ReduceOutcome::plain(grads);
        }
        let squares = options.clip_norm.is_some();
        let mut parts: Vec<Tensor<1>> = Vec::with_capacity(params.len());
        for spec in params {
            let part: Option<Tensor<1>> = with_dims!(spec.shape.len(), D => {
                grads.get::<D>(spec.id).map(|g| {
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
            .try_to_vec::<f64>()
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
            for spec in params {
                with_dims!(spec.shape.len(), D => {
                    if let Some(g) = grads.remove::<D>(spec.id) {
                        grads.register::<D>(spec.id, g.mul_scalar(scale));
                    }
                }, else {});
            }
        }
        outcome.grads = grads;
        outcome
    }
}

/// Phase 2 of a step whose trainable tensors changed on every rank: the ranks compare their new
/// layouts, and the tensors trainable since the agreed layout are reduced in buckets of their
/// own (this rank's gradients of them in `extra`).
///
/// # Errors
/// [`DdpError::ModelChanged`] when the ranks' trainable tensors changed differently; the
/// collectives' errors.
fn newly_trainable(
    link: &mut Link,
    agreed: &Agreed,
    buckets: &mut Buckets,
    changes: Changes,
    extra: &mut HashMap<usize, Option<Tensor<1>>>,
    options: &ReduceOptions,
    device: &Device,
) -> Result<NewlyTrainable> {
    let rank = link.rank();
    let proposal = changes.proposed.unwrap_or_else(|| agreed.replica.clone());
    proposal
        .verify_across(link.group.as_ref(), link.timeout)
        .map_err(|err| match err {
            DdpError::ReplicaMismatch { detail, .. } => DdpError::ModelChanged {
                rank,
                step: changes.step,
                detail: format!(
                    "the ranks' trainable tensors changed differently (frozen or unfrozen on \
                     some ranks only?): {detail}"
                ),
            },
            other => other,
        })?;
    let specs: Vec<TensorSpec> = trainable(&proposal)
        .into_iter()
        .filter(|spec| !agreed.params.iter().any(|p| p.index == spec.index))
        .collect();
    let layout = agreed.buckets_of(&specs);
    let taken = layout
        .buckets()
        .iter()
        .map(|b| {
            b.params
                .iter()
                .map(|&p| extra.remove(&specs[p].index).flatten())
                .collect()
        })
        .collect();
    let work = Work {
        layout: &layout,
        specs: &specs,
        taken,
        agreed: false,
        control: None,
    };
    let phase = buckets.reduce(link, work, options, device)?;
    link.stats.layout_changes += 1;
    tracing::info!(
        "burn-ddp: rank {rank}: the trainable tensors changed on every rank at gradient \
         synchronisation #{}: {} tensor(s) more to reduce now, {} in all",
        changes.step,
        specs.len(),
        trainable(&proposal).len()
    );
    Ok(NewlyTrainable {
        layout,
        specs,
        phase,
        adopted: proposal,
    })
}

/// The hook a configuration asks for, checked against `group`: a user's, compression, or the
/// default all-reduce.
///
/// # Errors
/// [`DdpError::InvalidConfig`] for a user's hook on a group that reduces device buckets (NCCL).
fn hook_for(config: &ReducerOptions, group: &dyn ProcessGroup) -> Result<Arc<dyn CommHook>> {
    if let Some(hook) = &config.comm_hook {
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
    Ok(match config.gradient_compression {
        GradientCompression::None => Arc::new(AllReduce),
        GradientCompression::Bf16 => Arc::new(Compress16::new(HalfFloat::Bf16)),
        GradientCompression::F16 => Arc::new(Compress16::new(HalfFloat::F16)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::DdpConfig;
    use crate::replica::Replica;
    use crate::replica::tests::test_device;
    use burn::nn::{Linear, LinearConfig};
    use burn::tensor::TensorData;
    use burn_ddp_comm::group::ThreadGroup;
    use burn_ddp_comm::group::{Native, ReduceOp};
    use std::time::Duration;

    /// Gradients of `layer` with `weight[0][0] = w` and `bias[1] = b`, zeros elsewhere.
    fn grads_of(layer: &Linear, w: f32, b: f32) -> GradientsParams {
        let device = Device::flex();
        let mut grads = GradientsParams::new();
        let weight = Tensor::<2>::from_data([[w, 0.0], [0.0, 0.0], [0.0, 0.0]], &device);
        grads.register::<2>(layer.weight.id, weight);
        let bias = layer.bias.as_ref().unwrap().id;
        grads.register::<1>(bias, Tensor::from_data([0.0, b], &device));
        grads
    }

    /// Reduces rank r's `(w, b)` over `inputs.len()` ranks with `clip_norm`; returns rank 0's
    /// `(weight[0][0], bias[1], grad_norm, clip_scale)`.
    fn clipped(inputs: &[(f32, f32)], clip_norm: f32) -> (f32, f32, Option<f64>, Option<f32>) {
        let layer: Linear = LinearConfig::new(3, 2).init(&test_device());
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
                            Reducer::new(group, layout, &ReducerOptions::default()).unwrap();
                        let grads = grads_of(layer, w, b);
                        reducer
                            .reduce_with(
                                &Replica::new(layer),
                                Some(grads),
                                // The model's device (with autodiff), as a training loop has it.
                                &test_device(),
                                options,
                            )
                            .unwrap()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let first = &outcomes[0];
        let weight = first.grads.get::<2>(layer.weight.id).unwrap();
        let bias_id = layer.bias.as_ref().unwrap().id;
        let bias = first.grads.get::<1>(bias_id).unwrap();
        let w = weight.into_data().try_to_vec::<f32>().unwrap()[0];
        let b = bias.into_data().try_to_vec::<f32>().unwrap()[1];
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

    type Flex = burn::backend::Flex;

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
        fn all_reduce(
            &self,
            bucket: &mut [f32],
            op: ReduceOp,
            timeout: Duration,
        ) -> burn_ddp_comm::Result<()> {
            self.0.all_reduce(bucket, op, timeout)
        }
        fn broadcast(
            &self,
            buffer: &mut [f32],
            root: usize,
            timeout: Duration,
        ) -> burn_ddp_comm::Result<()> {
            self.0.broadcast(buffer, root, timeout)
        }
        fn barrier(&self, timeout: Duration) -> burn_ddp_comm::Result<()> {
            self.0.barrier(timeout)
        }
        fn all_gather(&self, values: &[u64], timeout: Duration) -> burn_ddp_comm::Result<Vec<u64>> {
            self.0.all_gather(values, timeout)
        }
        fn abort(&self, reason: &str) {
            self.0.abort(reason)
        }

        fn native(&self) -> Option<&dyn Native> {
            Some(self)
        }
    }

    impl burn_ddp_comm::group::TestSealed for DeviceStaged {}

    impl Native for DeviceStaged {
        fn reduces_device_tensors(&self) -> bool {
            true
        }

        fn all_reduce_device(
            &self,
            tensor: &mut dyn std::any::Any,
            op: ReduceOp,
            timeout: Duration,
        ) -> burn_ddp_comm::Result<bool> {
            type Primitive = <Flex as burn::backend::BackendTypes>::FloatTensorPrimitive;
            let Some(primitive) = tensor.downcast_mut::<Primitive>() else {
                return Ok(false);
            };
            let bucket = Tensor::<1>::from_primitive::<Flex>(primitive.clone());
            let dtype = bucket.dtype();
            let mut values = bucket
                .into_data()
                .convert::<f32>()
                .try_to_vec::<f32>()
                .unwrap();
            self.0.all_reduce(&mut values, op, timeout)?;
            let len = values.len();
            let data = TensorData::new(values, [len]).convert_dtype(dtype);
            *primitive = Tensor::<1>::from_data(data, &Device::flex())
                .try_into_primitive::<Flex>()
                .unwrap();
            Ok(true)
        }
    }

    /// Rank `rank`'s gradients for `layer` (weight `[3, 2]`, bias `[2]`): distinct values on
    /// every element; rank 1 has no bias gradient; `nan` puts a NaN in rank 1's weight.
    fn device_grads(layer: &Linear, rank: usize, nan: bool, magnitude: f32) -> GradientsParams {
        let device = Device::flex();
        let mut grads = GradientsParams::new();
        let mut w: Vec<f32> = (0..6)
            .map(|i| (i as f32 + 1.0) * 0.37 * magnitude * if rank == 0 { 1.0 } else { -2.5 })
            .collect();
        if nan && rank == 1 {
            w[3] = f32::NAN;
        }
        let weight = Tensor::<2>::from_data(TensorData::new(w, [3, 2]), &device);
        grads.register::<2>(layer.weight.id, weight);
        if rank == 0 {
            let bias = layer.bias.as_ref().unwrap().id;
            grads.register::<1>(
                bias,
                Tensor::from_data([1.25 * magnitude, -3.5 * magnitude], &device),
            );
        }
        grads
    }

    /// Which path a test's reduction takes.
    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Path {
        /// Host buckets, each gradient read on its own (the CPU backends').
        Host,
        /// Host buckets, each bucket concatenated on the device and read once (wgpu's).
        HostPerBucket,
        /// Device buckets, through a group that reduces device tensors (NCCL's).
        Device,
        /// Tensors shared between the thread ranks (the default on a `ThreadGroup`).
        Shared,
        /// Shared buckets asked for, on a group whose ranks cannot share (a wrapper without
        /// `native`, as a process group would answer): host buckets after the first exchange.
        SharedRefused,
        /// Host buckets reduce-scattered by owner ([`SCATTER_OWNERS`]), each rank keeping its
        /// own gradients (optimizer-state sharding on separate ranks).
        Scatter,
        /// [`Path::Scatter`], each owner's block concatenated on the device and read once.
        ScatterPerBucket,
        /// [`Path::Scatter`]'s owners, but a `keep` of the caller's: this rank's own mask as a
        /// fresh value on rank 0, every gradient on rank 1 (all-reduced on both ranks).
        ScatterForeignKeep,
    }

    /// The owners of the test layer's weight and bias on the [`Path::Scatter`] path.
    const SCATTER_OWNERS: [Option<usize>; 2] = [Some(1), Some(0)];

    /// A `ThreadGroup` behind a wrapper that forwards the public collectives only.
    struct Separate(ThreadGroup);

    impl ProcessGroup for Separate {
        fn rank(&self) -> usize {
            self.0.rank()
        }
        fn world_size(&self) -> usize {
            self.0.world_size()
        }
        fn backend(&self) -> &'static str {
            "separate"
        }
        fn all_reduce(
            &self,
            bucket: &mut [f32],
            op: ReduceOp,
            timeout: Duration,
        ) -> burn_ddp_comm::Result<()> {
            self.0.all_reduce(bucket, op, timeout)
        }
        fn broadcast(
            &self,
            buffer: &mut [f32],
            root: usize,
            timeout: Duration,
        ) -> burn_ddp_comm::Result<()> {
            self.0.broadcast(buffer, root, timeout)
        }
        fn barrier(&self, timeout: Duration) -> burn_ddp_comm::Result<()> {
            self.0.barrier(timeout)
        }
        fn all_gather(&self, values: &[u64], timeout: Duration) -> burn_ddp_comm::Result<Vec<u64>> {
            self.0.all_gather(values, timeout)
        }
        fn abort(&self, reason: &str) {
            self.0.abort(reason)
        }
    }

    /// Rank 0's and rank 1's outcomes of one reduce over 2 ranks, through `path`.
    fn reduce_two(
        path: Path,
        config: &DdpConfig,
        options: &ReduceOptions,
        nan: bool,
        magnitude: f32,
    ) -> Vec<(Vec<f32>, Option<Vec<f32>>, ReduceOutcome)> {
        reduce_two_with(path, config, options, |layer, rank| {
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
        path: Path,
        config: &DdpConfig,
        options: &ReduceOptions,
        grads: impl Fn(&Linear, usize) -> GradientsParams + Sync,
    ) -> Vec<RankResult> {
        let layer: Linear = LinearConfig::new(3, 2).init(&test_device());
        let layout = ReplicaLayout::of(&layer);
        let groups = ThreadGroup::new_group(2).unwrap();
        std::thread::scope(|s| {
            let handles: Vec<_> = groups
                .into_iter()
                .enumerate()
                .map(|(rank, group)| {
                    let (layer, layout, grads) = (&layer, &layout, &grads);
                    s.spawn(move || {
                        let group: Arc<dyn ProcessGroup> = match path {
                            Path::Device => Arc::new(DeviceStaged(group)),
                            Path::SharedRefused => Arc::new(Separate(group)),
                            _ => Arc::new(group),
                        };
                        let scatter = matches!(
                            path,
                            Path::Scatter | Path::ScatterPerBucket | Path::ScatterForeignKeep
                        );
                        let host = scatter || matches!(path, Path::Host | Path::HostPerBucket);
                        let config = config.clone().with_shared_memory_reduction(!host);
                        let mut reducer =
                            Reducer::new(group, layout, &ReducerOptions::of(&config)).unwrap();
                        if matches!(path, Path::HostPerBucket | Path::ScatterPerBucket) {
                            reducer.force_host_transfer(gradients::Transfer::PerBucket);
                        }
                        let mut options = options.clone();
                        if scatter {
                            let own: Arc<[bool]> =
                                SCATTER_OWNERS.iter().map(|o| *o == Some(rank)).collect();
                            reducer.scatter_by(SCATTER_OWNERS.to_vec().into(), own.clone());
                            options.keep = Some(own);
                            if path == Path::ScatterForeignKeep {
                                let mask = [rank == 1, rank == 0 || rank == 1];
                                options.keep = Some(mask.to_vec().into());
                            }
                        }
                        let options = &options;
                        let outcome = reducer
                            .reduce_with(
                                &Replica::new(layer),
                                Some(grads(layer, rank)),
                                &Device::flex(),
                                options,
                            )
                            .unwrap();
                        let weight = outcome
                            .grads
                            .get::<2>(layer.weight.id)
                            .map(|w| w.into_data().try_to_vec::<f32>().unwrap())
                            .unwrap_or_default();
                        let bias = outcome
                            .grads
                            .get::<1>(layer.bias.as_ref().unwrap().id)
                            .map(|b| b.into_data().try_to_vec::<f32>().unwrap());
                        (weight, bias, outcome, reducer.stats().clone())
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn every_path_counts_its_reductions_and_no_other() {
        // One reduction through each path: its own counter says 1, the others 0 (a refused
        // shared exchange falls back to host buckets, and counts there).
        let config = DdpConfig::default();
        let options = ReduceOptions::default();
        let counts = |c: &CommStats| {
            [
                c.host_phases,
                c.scattered_phases,
                c.device_phases,
                c.shared_phases,
            ]
        };
        for (path, expected) in [
            (Path::Host, [1, 0, 0, 0]),
            (Path::HostPerBucket, [1, 0, 0, 0]),
            (Path::Scatter, [0, 1, 0, 0]),
            (Path::ScatterPerBucket, [0, 1, 0, 0]),
            // A keep that is not the owners' own: all-reduced after all.
            (Path::ScatterForeignKeep, [1, 0, 0, 0]),
            (Path::Device, [0, 0, 1, 0]),
            (Path::Shared, [0, 0, 0, 1]),
            (Path::SharedRefused, [1, 0, 0, 0]),
        ] {
            let ranks = reduce_two_with(path, &config, &options, |layer, rank| {
                device_grads(layer, rank, false, 1.0)
            });
            for (rank, (_, _, _, stats)) in ranks.iter().enumerate() {
                assert_eq!(counts(stats), expected, "{path:?}, rank {rank}");
            }
        }
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
            let host = reduce_two(Path::Host, &config, &options, false, 1.0);
            let device = reduce_two(Path::Device, &config, &options, false, 1.0);
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
    fn host_buckets_move_once_each_way_per_bucket_off_the_cpu_and_give_the_same_bits() {
        // Per-tensor reads (CPU backends) against one read and one write per bucket (wgpu):
        // the same bits, the same checks, and 2 buckets (the bias in a bucket of its own) moved
        // once each way where the weight and the bias moved once each.
        let config = DdpConfig::default()
            .with_bucket_cap_bytes(4)
            .with_first_bucket_cap_bytes(4);
        for options in [
            ReduceOptions::default(),
            ReduceOptions {
                clip_norm: Some(1.0),
                check_finite: true,
                weight: 0.5,
                ..ReduceOptions::default()
            },
        ] {
            let grads = |layer: &Linear, rank: usize| device_grads(layer, rank, false, 1.0);
            let tensor = reduce_two_with(Path::Host, &config, &options, grads);
            let bucket = reduce_two_with(Path::HostPerBucket, &config, &options, grads);
            for rank in 0..2 {
                let (tw, tb, to, ts) = &tensor[rank];
                let (bw, bb, bo, bs) = &bucket[rank];
                assert_eq!(bw, tw, "weight, rank {rank}, {options:?}");
                assert_eq!(bb, tb, "bias, rank {rank}, {options:?}");
                assert_eq!(bo.grad_norm, to.grad_norm);
                assert_eq!(bo.clip_scale, to.clip_scale);
                assert_eq!(bs.buckets, 2, "{options:?}");
                // Rank 1 has no bias gradient, so no bias bucket to read: it reads one tensor
                // or one bucket; both ranks write both back (rank 0's bias is the average).
                assert_eq!(
                    ts.transfers_to_host,
                    2 - rank as u64,
                    "per tensor, rank {rank}"
                );
                assert_eq!(ts.transfers_to_device, 2, "per tensor, rank {rank}");
                assert_eq!(
                    (bs.transfers_to_host, bs.transfers_to_device),
                    (bs.buckets - rank as u64, bs.buckets),
                    "per bucket, rank {rank}"
                );
            }
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
        let host = reduce_two(Path::Host, &config, &options, false, 1e25);
        let device = reduce_two(Path::Device, &config, &options, false, 1e25);
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
        let outcomes = reduce_two(Path::Device, &DdpConfig::default(), &options, true, 1.0);
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
        let exact = reduce_two(Path::Host, &DdpConfig::default(), &options, false, 1.0);
        for (compression, epsilon) in [
            (GradientCompression::Bf16, 2f32.powi(-8)),
            (GradientCompression::F16, 2f32.powi(-11)),
        ] {
            let config = DdpConfig::default().with_gradient_compression(compression);
            let compressed = reduce_two(Path::Device, &config, &options, false, 1.0);
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
    fn scaled_grads(layer: &Linear, rank: usize, magnitudes: [f32; 2]) -> GradientsParams {
        let device = Device::flex();
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
        grads.register::<2>(
            layer.weight.id,
            Tensor::from_data(TensorData::new(w, [3, 2]), &device),
        );
        let b: Vec<f32> = (6..8).map(value).collect();
        grads.register::<1>(
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
                let exact = reduce_two_with(Path::Host, &DdpConfig::default(), &options, |l, r| {
                    scaled_grads(l, r, magnitudes)
                });
                let config = DdpConfig::default().with_gradient_compression(compression);
                let compressed = reduce_two_with(Path::Device, &config, &options, |l, r| {
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
        let exact = reduce_two_with(Path::Host, &DdpConfig::default(), &options, |l, r| {
            scaled_grads(l, r, magnitudes)
        });
        let config = DdpConfig::default().with_gradient_compression(GradientCompression::F16);
        let compressed = reduce_two_with(Path::Device, &config, &options, |l, r| {
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
            let outcomes = reduce_two(Path::Device, &config, &options, true, 2e5);
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

    #[test]
    fn shared_tensors_reduce_like_host_buckets_without_a_copy_to_the_host() {
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
            ReduceOptions {
                weight: 0.0,
                op: ReduceOp::Sum,
                ..ReduceOptions::default()
            },
            ReduceOptions {
                keep: Some(vec![true, false].into()),
                ..ReduceOptions::default()
            },
        ] {
            let grads = |layer: &Linear, rank: usize| device_grads(layer, rank, false, 1.0);
            let host = reduce_two_with(Path::Host, &config, &options, grads);
            for path in [Path::Shared, Path::SharedRefused] {
                let other = reduce_two_with(path, &config, &options, grads);
                for rank in 0..2 {
                    let (hw, hb, ho, hs) = &host[rank];
                    let (sw, sb, so, ss) = &other[rank];
                    // Two ranks' sums are the same in either order; clipping's norm is summed
                    // in another order (f64 either way).
                    let close = |s: &[f32], h: &[f32]| {
                        s.len() == h.len()
                            && s.iter()
                                .zip(h)
                                .all(|(s, h)| (s - h).abs() <= 1e-6 * h.abs())
                    };
                    assert!(
                        close(sw, hw),
                        "{path:?} weight, rank {rank}: {sw:?} vs {hw:?}"
                    );
                    // The bias: rank 0's gradient only, averaged over both; left out by `keep`.
                    match (sb, hb) {
                        (Some(s), Some(h)) => assert!(close(s, h), "{path:?} bias: {s:?} vs {h:?}"),
                        (s, h) => assert_eq!(s, h, "{path:?} bias, {options:?}"),
                    }
                    assert_eq!(hb.is_some(), options.keep.is_none(), "{options:?}");
                    assert_eq!(so.non_finite, ho.non_finite);
                    match (so.grad_norm, ho.grad_norm) {
                        (Some(s), Some(h)) => assert!((s - h).abs() <= 1e-6 * h, "{s} vs {h}"),
                        (s, h) => assert_eq!(s, h),
                    }
                    assert_eq!(so.clip_scale.is_some(), ho.clip_scale.is_some());
                    if path == Path::Shared {
                        // Nothing flattened, nothing copied back: at most one read of the
                        // checks of the gradients the rank owns.
                        let checks = u64::from(options.check_finite);
                        assert!(ss.transfers_to_host <= checks, "{options:?}: {ss:?}");
                        assert_eq!(ss.transfers_to_device, 0, "{options:?}");
                        assert_eq!(ss.bytes, 0);
                    } else {
                        // The ranks could not share: host buckets, as the host path's.
                        assert_eq!(ss.transfers_to_host, hs.transfers_to_host, "{path:?}");
                        assert_eq!(ss.bytes, hs.bytes);
                    }
                }
                assert_eq!(other[0].0, other[1].0, "{path:?}: both ranks hold the same");
            }
        }
    }

    #[test]
    fn reduce_scattered_gradients_reach_their_owners_as_the_all_reduce_gives_them() {
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
            ReduceOptions {
                weight: 0.0,
                op: ReduceOp::Sum,
                ..ReduceOptions::default()
            },
        ] {
            let grads = |layer: &Linear, rank: usize| device_grads(layer, rank, false, 1.0);
            let host = reduce_two_with(Path::Host, &config, &options, grads);
            for path in [Path::Scatter, Path::ScatterPerBucket] {
                let scattered = reduce_two_with(path, &config, &options, grads);
                for rank in 0..2 {
                    let (hw, hb, ho, _) = &host[rank];
                    let (sw, sb, so, ss) = &scattered[rank];
                    // Rank 1 owns the weight, rank 0 the bias: each receives its own only, with
                    // the all-reduce's bits (two ranks' sums are the same in either order).
                    if rank == 1 {
                        assert_eq!(sw, hw, "weight, {options:?}");
                        assert_eq!(sb, &None);
                    } else {
                        assert!(sw.is_empty(), "rank 0 got the weight: {sw:?}");
                        assert_eq!(sb, hb, "bias, {options:?}");
                    }
                    assert_eq!(so.non_finite, ho.non_finite);
                    assert_eq!(so.words, ho.words);
                    // The norm from both owners' parts, summed in another order.
                    match (so.grad_norm, ho.grad_norm) {
                        (Some(s), Some(h)) => assert!((s - h).abs() <= 1e-12 * h, "{s} vs {h}"),
                        (s, h) => assert_eq!(s, h),
                    }
                    assert_eq!(so.clip_scale.is_some(), ho.clip_scale.is_some());
                    // One reduce-scatter of both blocks (gradients, 2 flags, the control words).
                    assert_eq!(ss.buckets, 1, "{ss:?}");
                    let block = 6 + 2 + Control::len_with(ReduceOptions::MAX_WORDS);
                    assert_eq!(ss.bytes, 2 * block * 4, "{ss:?}");
                    // Read once per gradient, or once per owner's block with a gradient in it
                    // (one each here; rank 1 has no bias gradient).
                    let reads = 2 - rank as u64;
                    assert_eq!(ss.transfers_to_host, reads, "{path:?} rank {rank}");
                }
            }
        }
        // A keep of the caller's is all-reduced on every rank, whatever its values on each.
        let foreign = reduce_two_with(
            Path::ScatterForeignKeep,
            &config,
            &ReduceOptions::default(),
            |layer: &Linear, rank: usize| device_grads(layer, rank, false, 1.0),
        );
        let host = reduce_two_with(
            Path::Host,
            &config,
            &ReduceOptions::default(),
            |layer: &Linear, rank: usize| device_grads(layer, rank, false, 1.0),
        );
        for rank in 0..2 {
            assert_eq!(foreign[rank].3.bytes, host[rank].3.bytes, "rank {rank}");
            // Rank 0 kept what its mask keeps (the bias), rank 1 both.
            assert_eq!(foreign[rank].1, host[rank].1);
            assert_eq!(foreign[rank].0.is_empty(), rank == 0);
        }
        // NaN on rank 1 (the weight's owner): every rank skips, rank 1 names itself; the words
        // and the flags still reach every rank.
        let check = ReduceOptions {
            check_finite: true,
            words: vec![0.0, 1.0],
            ..ReduceOptions::default()
        };
        let nan = |layer: &Linear, rank: usize| device_grads(layer, rank, true, 1.0);
        let outcomes = reduce_two_with(Path::Scatter, &config, &check, nan);
        for (rank, (_, _, outcome, _)) in outcomes.iter().enumerate() {
            assert!(outcome.non_finite, "rank {rank}");
            assert_eq!(outcome.local_non_finite, rank == 1, "rank {rank}");
            assert!(outcome.grads.is_empty());
            assert_eq!(outcome.words, vec![0.0, 1.0]);
        }
        // The same gradients overflowing only in their sum, seen by the bias's owner too.
        let huge = |layer: &Linear, rank: usize| {
            let mut grads = GradientsParams::new();
            let device = Device::flex();
            let w = Tensor::<2>::from_data(TensorData::new(vec![3e38f32; 6], [3, 2]), &device);
            grads.register::<2>(layer.weight.id, w);
            let bias = layer.bias.as_ref().unwrap().id;
            grads.register::<1>(bias, Tensor::from_data([1.0f32, 2.0], &device));
            let _ = rank;
            grads
        };
        let sum_only = ReduceOptions {
            check_finite: true,
            op: ReduceOp::Sum,
            ..ReduceOptions::default()
        };
        let outcomes = reduce_two_with(Path::Scatter, &config, &sum_only, huge);
        for (rank, (_, _, outcome, _)) in outcomes.iter().enumerate() {
            assert!(
                outcome.non_finite,
                "rank {rank}: the weight's sum is infinite"
            );
            assert!(!outcome.local_non_finite, "rank {rank}");
        }
    }

    #[test]
    fn shared_tensors_report_nan_on_every_rank_and_name_the_rank_that_had_it() {
        let options = ReduceOptions {
            check_finite: true,
            ..ReduceOptions::default()
        };
        let outcomes = reduce_two(Path::Shared, &DdpConfig::default(), &options, true, 1.0);
        for (rank, (weight, bias, outcome)) in outcomes.iter().enumerate() {
            assert!(outcome.non_finite, "rank {rank}");
            assert_eq!(outcome.local_non_finite, rank == 1, "rank {rank}");
            assert!(weight.is_empty() && bias.is_none(), "the step is skipped");
        }
        // Gradients around 1e25: the squares overflow f32, the norm does not.
        let clip = ReduceOptions {
            clip_norm: Some(1.0),
            ..options.clone()
        };
        // Gradients near f32's largest: their sum overflows, every value is finite.
        let near_max = reduce_two(Path::Shared, &DdpConfig::default(), &options, false, 6e37);
        for (rank, (weight, _, outcome)) in near_max.iter().enumerate() {
            assert!(weight.iter().all(|w| w.is_finite()) && weight.len() == 6);
            assert!(!outcome.non_finite, "rank {rank}: finite values");
        }
        let host = reduce_two(Path::Host, &DdpConfig::default(), &clip, false, 1e25);
        let shared = reduce_two(Path::Shared, &DdpConfig::default(), &clip, false, 1e25);
        for rank in 0..2 {
            let (h, s) = (&host[rank].2, &shared[rank].2);
            assert!(!s.non_finite, "finite gradients, rank {rank}");
            let (hn, sn) = (h.grad_norm.unwrap(), s.grad_norm.unwrap());
            assert!((sn - hn).abs() <= 1e-6 * hn, "norm {sn} vs {hn}");
        }
    }
}
