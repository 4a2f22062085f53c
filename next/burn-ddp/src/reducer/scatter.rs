//! Gradients reduce-scattered by owner, for optimizer-state sharding on separate ranks (ZeRO
//! stage 2; DeepSpeed's `reduce_scatter`, FSDP's `SHARD_GRAD_OP`): under sharding a rank steps
//! only the parameters it owns, so it needs only their reduced gradients. Instead of
//! all-reducing every bucket, each rank lays its gradients out by owner (block `r`: rank `r`'s
//! parameters in registration order), and one
//! [`reduce_scatter`](burn_ddp_comm::group::ExtendedCollectives::reduce_scatter) leaves each rank the
//! reduced block of its own: a ring moves `(N - 1) / N` of the gradients' bytes per rank where an
//! all-reduce moves twice that, and a rank keeps `1 / N` of the reduced gradients.
//!
//! Every block also carries the step's bookkeeping (one presence flag per parameter, then the
//! control words), so every rank receives it reduced with its block. Flags and words are small
//! whole numbers (0 or 1 per rank), whose sums are exact in any order: every rank reads the same
//! values, as from the first host bucket. The checks need every owner's part: each rank
//! observes its own block (NaN or infinity, the sum of squares in `f64`) and one small
//! [`all_gather`](burn_ddp_comm::group::ProcessGroup::all_gather) of those words gives every rank every
//! owner's, summed in rank order, so every rank reaches the same verdict bit for bit.
//!
//! Used for the step's agreed buckets when the reducer knows the owners
//! ([`Reducer::scatter_by`](super::Reducer::scatter_by)), the caller keeps exactly this rank's
//! own gradients ([`ReduceOptions::keep`]) and the buckets are reduced by the built-in
//! all-reduce (no communication hook, no compression). A second phase (tensors unfrozen during
//! the run) is all-reduced as before.

use std::sync::Arc;
use std::time::Instant;

use burn::optim::GradientsParams;
use burn::tensor::{Device, Tensor, TensorData};

use super::checks::{Observed, observe_host};
use super::gradients::{Transfer, Work, register_scaled, register_shaped};
use super::link::Link;
use super::options::{Control, ReduceOptions};
use crate::error::Result;
use crate::replica::TensorSpec;
use burn_ddp_comm::group::ExtendedCollectives;

/// A reducer's reduce-scatter by owner: the owners, the plan of the agreed parameters, and the
/// buffers kept from step to step.
pub(super) struct Scatter {
    /// Each float tensor's owner, registration order (optimizer-state sharding's).
    owners: Arc<[Option<usize>]>,
    /// This rank's own mask, as [`OptimizerShards::own`](crate::mechanism::OptimizerShards::own)
    /// hands it out: a step scatters when its `keep` is this very mask (the same `Arc`), which
    /// only the sharded paths pass, on every rank alike; a mask of the caller's, even with the
    /// same values on some rank, is all-reduced on every rank.
    own: Arc<[bool]>,
    /// The plan of the agreed parameters (built at the first step; dropped when they change).
    plan: Option<Plan>,
    /// This rank's blocks, `world_size * block` values, reused.
    send: Vec<f32>,
    /// The reduced block of this rank's own, `block` values, reused.
    recv: Vec<f32>,
}

/// Where each parameter's gradient and the bookkeeping sit in a block.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Plan {
    /// Values per block: the largest rank's gradients, then the flags, then the control words.
    block: usize,
    /// Per parameter (the agreed order): its owner and its offset in the owner's block.
    slots: Vec<(usize, usize)>,
    /// Per rank: the values of the gradients it owns (its block's gradient part).
    values: Vec<usize>,
    /// Where the presence flags start in every block.
    flags: usize,
    /// Number of parameters (flags).
    count: usize,
}

impl Plan {
    /// The plan of `specs` over `world_size` ranks with `control` words per block; `None` when a
    /// parameter has no owner among the ranks, or when the blocks, padded to the largest owner's,
    /// would send more than an all-reduce (an owner with over twice the average share: one
    /// tensor larger than the others together): the reducer then all-reduces.
    fn new(
        specs: &[TensorSpec],
        owners: &[Option<usize>],
        world_size: usize,
        control: usize,
    ) -> Option<Self> {
        let mut values = vec![0usize; world_size];
        let mut slots = Vec::with_capacity(specs.len());
        for spec in specs {
            let owner = owners.get(spec.index).copied().flatten()?;
            let used = values.get_mut(owner)?;
            slots.push((owner, *used));
            *used += spec.numel();
        }
        let flags = values.iter().copied().max().unwrap_or(0);
        let block = flags + specs.len() + control;
        // A ring reduce-scatter sends (N - 1) / N of N blocks, an all-reduce 2 (N - 1) / N of
        // the gradients, flags and words: scatter only when that sends no more.
        let whole: usize = values.iter().sum::<usize>() + specs.len() + control;
        if world_size * block > 2 * whole {
            return None;
        }
        Some(Self {
            block,
            slots,
            values,
            flags,
            count: specs.len(),
        })
    }
}

/// One step's reduce-scattered gradients: this rank's reduced block and what every rank saw.
pub(super) struct ScatterPhase {
    /// The reduced block of this rank's own parameters, flags and control words.
    recv: Vec<f32>,
    /// This rank's own gradient storage per parameter, refilled with the reduced values
    /// ([`Transfer::PerTensor`]).
    datas: Vec<Option<TensorData>>,
    transfer: Transfer,
    /// Where the control words start in `recv`.
    control_at: usize,
    /// The checks over every owner's block, the same on every rank.
    pub observed: Observed,
    /// This rank's own gradients held NaN or infinity.
    pub local_non_finite: bool,
}

impl ScatterPhase {
    /// The reduced control words, with `caller` words of the caller's.
    pub fn control(&self, caller: usize) -> Option<Control> {
        Control::from_words(self.recv.get(self.control_at..)?, caller)
    }
}

impl Scatter {
    pub fn new(owners: Arc<[Option<usize>]>, own: Arc<[bool]>) -> Self {
        Self {
            owners,
            own,
            plan: None,
            send: Vec::new(),
            recv: Vec::new(),
        }
    }

    /// Forgets the plan (the agreed parameters changed).
    pub fn clear(&mut self) {
        self.plan = None;
    }

    /// Whether `work` is reduce-scattered: the step's agreed buckets, with the control words,
    /// on several ranks, every parameter owned, the blocks no larger than an all-reduce, and
    /// `options` keeping this rank's own mask (the `Arc` of [`Scatter::new`]). Every rank
    /// answers alike (the same owners and parameters; the sharded paths pass the mask on every
    /// rank).
    pub fn takes(&mut self, link: &Link, work: &Work<'_>, options: &ReduceOptions) -> bool {
        let world_size = link.group.world_size();
        let Some(control) = work.control else {
            return false;
        };
        if !work.agreed || world_size < 2 {
            return false;
        }
        let Some(keep) = options.keep.as_ref() else {
            return false;
        };
        if !Arc::ptr_eq(keep, &self.own) {
            return false;
        }
        if self.plan.is_none() {
            self.plan = Plan::new(work.specs, &self.owners, world_size, control.len());
        }
        self.plan
            .as_ref()
            .is_some_and(|p| p.count == work.specs.len())
    }

    /// Reduce-scatters `work` (which [`takes`](Self::takes) took): this rank's gradients laid out
    /// by owner, weighted, with the flags and control words in every block; then the checks
    /// gathered from every owner.
    ///
    /// # Errors
    /// [`DdpError::Bucket`] (after aborting the group) for a gradient that is not readable as
    /// `f32`; the collectives' errors.
    pub fn reduce(
        &mut self,
        link: &mut Link,
        work: Work<'_>,
        options: &ReduceOptions,
        transfer: Transfer,
        device: &Device,
    ) -> Result<ScatterPhase> {
        let started = Instant::now();
        let Some(plan) = self.plan.clone() else {
            return Err(link.fail_bucket(0, "reduce-scatter without a plan".into()));
        };
        let world_size = plan.values.len();
        let rank = link.rank();
        // Per parameter (the agreed order): this rank's gradient.
        let mut grads: Vec<Option<Tensor<1>>> = vec![None; plan.count];
        for (bucket, taken) in work.layout.buckets().iter().zip(work.taken) {
            for (&p, grad) in bucket.params.iter().zip(taken) {
                grads[p] = grad;
            }
        }
        let mut send = std::mem::take(&mut self.send);
        send.resize(world_size * plan.block, 0.0);
        let present: Vec<f32> = grads
            .iter()
            .map(|g| f32::from(u8::from(g.is_some())))
            .collect();
        let mut datas: Vec<Option<TensorData>> = vec![None; plan.count];
        match transfer {
            Transfer::PerTensor => {
                for (p, grad) in grads.into_iter().enumerate() {
                    let (owner, offset) = plan.slots[p];
                    let at = owner * plan.block + offset;
                    let target = &mut send[at..at + work.specs[p].numel()];
                    let Some(grad) = grad else {
                        target.fill(0.0);
                        continue;
                    };
                    link.stats.transfers_to_host += 1;
                    let data = grad.into_data().convert::<f32>();
                    copy_values(link, &work.specs[p], &data, target)?;
                    if owner == rank {
                        datas[p] = Some(data);
                    }
                }
            }
            Transfer::PerBucket => {
                // One transfer per owner's block: its gradients concatenated on the device.
                for owner in 0..world_size {
                    let at = owner * plan.block;
                    let target = &mut send[at..at + plan.values[owner]];
                    let mine: Vec<usize> = (0..plan.count)
                        .filter(|&p| plan.slots[p].0 == owner)
                        .collect();
                    if mine.iter().all(|&p| grads[p].is_none()) {
                        target.fill(0.0);
                        continue;
                    }
                    let parts: Vec<Tensor<1>> = mine
                        .iter()
                        .map(|&p| {
                            grads[p]
                                .take()
                                .unwrap_or_else(|| Tensor::zeros([work.specs[p].numel()], device))
                        })
                        .collect();
                    link.stats.transfers_to_host += 1;
                    let data = Tensor::cat(parts, 0).into_data().convert::<f32>();
                    let values = data.as_slice::<f32>().map_err(|e| {
                        link.fail_bucket(0, format!("bucket is not readable as f32: {e:?}"))
                    })?;
                    target.copy_from_slice(values);
                }
            }
        }
        let words = work.control.map(Control::words).unwrap_or_default();
        let mut local_non_finite = false;
        for owner in 0..world_size {
            let block = &mut send[owner * plan.block..(owner + 1) * plan.block];
            block[plan.values[owner]..plan.flags].fill(0.0);
            let (values, tail) = block.split_at_mut(plan.flags);
            let values = &mut values[..plan.values[owner]];
            if options.check_finite {
                local_non_finite |= values.iter().any(|v| !v.is_finite());
            }
            if options.weight != 1.0 {
                values.iter_mut().for_each(|v| *v *= options.weight);
            }
            let (flags, control) = tail.split_at_mut(plan.count);
            flags.copy_from_slice(&present);
            control.copy_from_slice(&words);
        }
        let flattened = Instant::now();
        let mut recv = std::mem::take(&mut self.recv);
        recv.resize(plan.block, 0.0);
        link.group
            .reduce_scatter(&send, &mut recv, options.op, link.timeout)?;
        let observed = agree(
            link,
            observe_host(std::iter::once(&recv[..plan.values[rank]]), options),
            options,
        )?;
        self.send = send;
        link.stats.flatten += flattened - started;
        link.stats.all_reduce += flattened.elapsed();
        link.stats.buckets += 1;
        link.stats.bytes += plan.block * world_size * 4;
        Ok(ScatterPhase {
            recv,
            datas,
            transfer,
            control_at: plan.flags + plan.count,
            observed,
            local_non_finite,
        })
    }

    /// Keeps `phase`'s buffer for the next step (its gradients are not used).
    pub fn keep(&mut self, phase: ScatterPhase) {
        self.recv = phase.recv;
    }

    /// Writes this rank's own reduced gradients (times `scale`) into `grads`: those some rank
    /// had a gradient for and `keep` keeps. Returns the transfers to the device.
    ///
    /// # Errors
    /// [`DdpError::Bucket`] when this rank's own gradient storage cannot be written.
    #[allow(clippy::too_many_arguments)]
    pub fn unflatten(
        &mut self,
        phase: ScatterPhase,
        specs: &[TensorSpec],
        grads: &mut GradientsParams,
        scale: f32,
        keep: Option<&[bool]>,
        device: &Device,
        rank: usize,
    ) -> Result<u64> {
        let Some(plan) = self.plan.as_ref() else {
            return Ok(0);
        };
        let ScatterPhase {
            recv,
            datas,
            transfer,
            ..
        } = phase;
        let flags = &recv[plan.flags..plan.flags + plan.count];
        let kept = |p: usize| {
            let spec = &specs[p];
            plan.slots[p].0 == rank
                && flags[p] > 0.0
                && keep.is_none_or(|k| k.get(spec.index).copied().unwrap_or(true))
        };
        let mut written = 0;
        if transfer == Transfer::PerBucket {
            let own = &recv[..plan.values[rank]];
            if (0..plan.count).any(kept) {
                let values: Vec<f32> = own.iter().map(|&v| v * scale).collect();
                let len = values.len();
                let reduced = Tensor::<1>::from_data(TensorData::new(values, [len]), device);
                written += 1;
                for p in (0..plan.count).filter(|&p| kept(p)) {
                    let offset = plan.slots[p].1;
                    let flat = reduced.clone().slice(offset..offset + specs[p].numel());
                    register_shaped(grads, &specs[p], flat);
                }
            }
        } else {
            for (p, data) in datas.into_iter().enumerate() {
                if !kept(p) {
                    continue;
                }
                let spec = &specs[p];
                let offset = plan.slots[p].1;
                let source = &recv[offset..offset + spec.numel()];
                register_scaled(grads, spec, data, source, scale, device, rank, 0)?;
                written += 1;
            }
        }
        self.recv = recv;
        Ok(written)
    }
}

/// Copies `data` (a gradient of `spec`, as `f32`) into `target`.
///
/// # Errors
/// [`DdpError::Bucket`] (after aborting the group) when it is not readable as `f32` or not as
/// many values as the parameter's.
fn copy_values(
    link: &Link,
    spec: &TensorSpec,
    data: &TensorData,
    target: &mut [f32],
) -> Result<()> {
    let values = data.as_slice::<f32>().map_err(|e| {
        link.fail_bucket(
            0,
            format!("gradient of `{}` is not readable as f32: {e:?}", spec.path),
        )
    })?;
    if values.len() != target.len() {
        return Err(link.fail_bucket(
            0,
            format!(
                "gradient of `{}` has {} values, the parameter {}",
                spec.path,
                values.len(),
                target.len()
            ),
        ));
    }
    target.copy_from_slice(values);
    Ok(())
}

/// Every owner's checks to every rank: this rank's `mine`, gathered (one small all-gather of
/// two words, when the options check anything) and summed in rank order, so every rank holds
/// the same [`Observed`].
///
/// # Errors
/// The all-gather's.
fn agree(link: &Link, mine: Observed, options: &ReduceOptions) -> Result<Observed> {
    if !options.check_finite && options.clip_norm.is_none() {
        return Ok(mine);
    }
    let words = [u64::from(mine.non_finite), mine.sum_of_squares.to_bits()];
    let all = link.group.all_gather(&words, link.timeout)?;
    let mut observed = Observed::default();
    for owner in all.chunks_exact(2) {
        observed.non_finite |= owner[0] != 0;
        observed.sum_of_squares += f64::from_bits(owner[1]);
    }
    Ok(observed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replica::TensorKind;

    fn specs(numels: &[usize]) -> Vec<TensorSpec> {
        numels
            .iter()
            .enumerate()
            .map(|(index, &n)| TensorSpec {
                index,
                path: format!("p{index}"),
                kind: TensorKind::Parameter,
                shape: vec![n],
                element_bytes: 4,
                id: burn::module::ParamId::new(),
            })
            .collect()
    }

    #[test]
    fn blocks_hold_each_owners_gradients_then_the_bookkeeping() {
        let specs = specs(&[100, 30, 50, 20]);
        let owners = [Some(0), Some(1), Some(1), Some(0)];
        let plan = Plan::new(&specs, &owners, 2, 3).expect("a plan");
        // Rank 0: 100 + 20 values; rank 1: 30 + 50; blocks padded to 120, then 4 flags and 3
        // control words.
        assert_eq!(plan.values, [120, 80]);
        assert_eq!(plan.slots, [(0, 0), (1, 0), (1, 30), (0, 100)]);
        assert_eq!((plan.flags, plan.count, plan.block), (120, 4, 127));
        // A parameter without an owner among the ranks: no plan.
        assert!(Plan::new(&specs, &[Some(0), Some(2), Some(1), Some(0)], 2, 3).is_none());
        assert!(Plan::new(&specs, &[Some(0), None, Some(1), Some(0)], 2, 3).is_none());
    }

    #[test]
    fn no_plan_when_the_padded_blocks_would_send_more_than_an_all_reduce() {
        // One tensor larger than the others together, on 4 ranks: blocks of 1000 values, 4000
        // sent in all, against an all-reduce's 2 x 1300.
        let specs = specs(&[1000, 100, 100, 100]);
        let owners = [Some(0), Some(1), Some(2), Some(3)];
        assert!(Plan::new(&specs, &owners, 4, 0).is_none());
        // On 2 ranks the same model pads to 1000 + 1000 = 2000 < 2 x 1300: scattered.
        let two = [Some(0), Some(1), Some(1), Some(1)];
        assert!(Plan::new(&specs, &two, 2, 0).is_some());
    }
}
