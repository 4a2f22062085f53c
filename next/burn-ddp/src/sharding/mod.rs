//! Optimizer-state sharding (ZeRO stage 1; PyTorch's `ZeroRedundancyOptimizer`): which rank owns
//! which parameters, the gradients a rank keeps for its optimizer step, and the all-gather of the
//! updated parameters. How the optimizer's record is split and joined for checkpoints is in
//! [`state`].
//!
//! A step under sharding ([`sharded_step`]): the gradients are all-reduced as without it (the
//! reducer, its checks, clipping and hooks see them whole; under ZeRO-2 each rank receives its
//! own parameters' only); each rank drops the gradients of the parameters it does not own
//! ([`OptimizerShards::keep_own`]), so Burn 0.22's `ModuleOptimizer` steps its own parameters only
//! and keeps state for those only (it leaves a parameter without a gradient alone); then every
//! rank's updated parameters go to every rank in one
//! [`all_gather_f32`](burn_ddp_comm::group::ExtendedCollectives::all_gather_f32)
//! ([`OptimizerShards::gather_stepped`]), as raw bytes, so the replicas stay bit-identical
//! before the step returns.

mod share;
pub(crate) mod state;
mod step;

pub(crate) use step::sharded_step;

use std::collections::HashMap;
use std::time::Duration;

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;

use crate::error::Result;
use crate::replica::{ReplicaLayout, TensorKind, restore_selected, snapshot_selected_into};
use burn_ddp_comm::group::{ExtendedCollectives, ProcessGroup};

/// Which rank owns which parameters under optimizer-state sharding.
///
/// The assignment: every tensor the optimizer may step is taken whole, grouped by Burn's
/// `ParamId` (a shared weight's places go together), largest first (ties in registration order),
/// each to the rank that owns the fewest bytes so far (ties to the lower rank): the greedy
/// "longest processing time" rule, within one tensor of even and 4/3 of the best balance, and
/// computed by every rank from the layout alone (no communication). The trainable parameters are
/// balanced first, on their own, so fine-tuning a model whose weights are mostly frozen spreads
/// the optimizer state evenly; the frozen weights, which may be unfrozen later, get owners too
/// (balanced among themselves), so owners never change during a run. Buffers are not owned: every
/// rank keeps its own.
#[derive(Debug, Clone)]
pub struct OptimizerShards {
    rank: usize,
    world_size: usize,
    /// For each float tensor (registration order), its owner; `None` for buffers.
    owners: Vec<Option<usize>>,
    /// 4-byte words of each tensor packed raw (registration order).
    words: Vec<usize>,
    /// Bytes of trainable parameters owned by each rank (at the start).
    bytes: Vec<u64>,
    /// For each float tensor, whether this rank owns it.
    own: std::sync::Arc<[bool]>,
    /// The all-gather's send and receive buffers, reused (clones share them).
    buffers: std::sync::Arc<std::sync::Mutex<(Vec<f32>, Vec<f32>)>>,
    /// Thread replicas on one device may take each other's stepped tensors by reference
    /// ([`DdpConfig::with_shared_memory_reduction`](crate::DdpConfig::with_shared_memory_reduction)).
    share: bool,
    /// The ranks found at a step that they cannot share (clones share it).
    apart: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// The reduced gradients are sharded too (ZeRO-2): a rank holds its own parameters'
    /// gradients only ([`DdpConfig::with_gradient_sharding`](crate::DdpConfig::with_gradient_sharding)).
    grads_sharded: bool,
}

impl PartialEq for OptimizerShards {
    /// The same assignment seen from the same rank.
    fn eq(&self, other: &Self) -> bool {
        self.rank == other.rank
            && self.world_size == other.world_size
            && self.owners == other.owners
    }
}

impl Eq for OptimizerShards {}

impl OptimizerShards {
    /// The assignment of `layout`'s parameters to `world_size` ranks, seen from `rank`.
    pub fn new(layout: &ReplicaLayout, rank: usize, world_size: usize) -> Self {
        let world_size = world_size.max(1);
        let tensors = layout.tensors();
        // One entry per id: its bytes, its first place, whether it is trainable now.
        let mut ids: Vec<(ParamId, u64, usize, bool)> = Vec::new();
        let mut seen: HashMap<ParamId, usize> = HashMap::new();
        for t in tensors.iter().filter(|t| t.kind != TensorKind::Buffer) {
            if let std::collections::hash_map::Entry::Vacant(e) = seen.entry(t.id) {
                e.insert(ids.len());
                ids.push((
                    t.id,
                    (t.numel() * t.element_bytes) as u64,
                    t.index,
                    t.kind == TensorKind::Parameter,
                ));
            }
        }
        let mut owner_of: HashMap<ParamId, usize> = HashMap::new();
        let mut bytes = vec![0u64; world_size];
        for trainable in [true, false] {
            // In registration order (first places), so `balance` breaks ties by it.
            let group: Vec<usize> = (0..ids.len()).filter(|&i| ids[i].3 == trainable).collect();
            let sizes: Vec<u64> = group.iter().map(|&i| ids[i].1).collect();
            let (owners, load) = crate::partition::balance(&sizes, world_size);
            for (&i, owner) in group.iter().zip(owners) {
                owner_of.insert(ids[i].0, owner);
            }
            if trainable {
                bytes = load;
            }
        }
        let owners: Vec<Option<usize>> = tensors
            .iter()
            .map(|t| {
                (t.kind != TensorKind::Buffer)
                    .then(|| owner_of.get(&t.id).copied())
                    .flatten()
            })
            .collect();
        let own = owners.iter().map(|o| *o == Some(rank)).collect();
        let words = tensors
            .iter()
            .map(|t| (t.numel() * t.element_bytes).div_ceil(4))
            .collect();
        Self {
            rank,
            world_size,
            owners,
            words,
            bytes,
            own,
            buffers: Default::default(),
            share: true,
            apart: Default::default(),
            grads_sharded: false,
        }
    }

    /// Whether the reduced gradients are sharded too (default `false`; every rank must choose
    /// alike).
    pub(crate) fn gradients_sharded(mut self, sharded: bool) -> Self {
        self.grads_sharded = sharded;
        self
    }

    /// Whether a rank holds its own parameters' reduced gradients only.
    pub(crate) fn grads_sharded(&self) -> bool {
        self.grads_sharded
    }

    /// Which float tensors (registration order) their owners stepped, on every rank: each rank
    /// knows it of its own parameters only (`stepped`, from the gradients it holds) when the
    /// gradients are sharded, so the owners' bits go to every rank in one small all-gather.
    ///
    /// # Errors
    /// The all-gather's.
    pub(crate) fn agree_stepped(
        &self,
        stepped: &[bool],
        group: &dyn ProcessGroup,
        timeout: Duration,
    ) -> Result<Vec<bool>> {
        let words = self.owners.len().div_ceil(64).max(1);
        let mut mine = vec![0u64; words];
        for (i, owner) in self.owners.iter().enumerate() {
            if *owner == Some(self.rank) && stepped.get(i).copied().unwrap_or(false) {
                mine[i / 64] |= 1 << (i % 64);
            }
        }
        let all = group.all_gather(&mine, timeout)?;
        Ok(self
            .owners
            .iter()
            .enumerate()
            .map(|(i, owner)| {
                owner.is_some_and(|o| {
                    all.get(o * words + i / 64)
                        .is_some_and(|word| word >> (i % 64) & 1 == 1)
                })
            })
            .collect())
    }

    /// Whether thread replicas on one device take each other's stepped tensors by reference
    /// (default `true`; every rank must choose alike).
    pub(crate) fn sharing(mut self, share: bool) -> Self {
        self.share = share;
        self
    }

    /// For each float tensor (registration order), whether this rank owns it: the
    /// [`ReduceOptions::keep`](crate::mechanism::ReduceOptions::keep) of a sharded step.
    pub fn own(&self) -> std::sync::Arc<[bool]> {
        self.own.clone()
    }

    /// The owner of each float tensor in registration order (`None`: a buffer).
    pub fn owners(&self) -> &[Option<usize>] {
        &self.owners
    }

    /// Bytes of trainable parameters each rank owns (and keeps optimizer state for), by rank, as
    /// the model was at the start.
    pub fn bytes_per_rank(&self) -> &[u64] {
        &self.bytes
    }

    /// The owner of float tensor `index` (registration order); `None` for a buffer or an index
    /// past the model's tensors.
    pub fn owner(&self, index: usize) -> Option<usize> {
        self.owners.get(index).copied().flatten()
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Removes from `grads` the gradients of the parameters this rank does not own, so the
    /// optimizer steps (and keeps state for) its own only. `module` is the model the gradients
    /// are of (its parameters' ids and ranks).
    pub fn keep_own<M: Module>(&self, module: &M, grads: &mut GradientsParams) {
        let mut dropper = DropOthers {
            shards: self,
            grads,
            visited: 0,
        };
        module.visit(&mut dropper);
    }

    /// Every rank's updated parameters to every rank: the tensors each rank owns and stepped
    /// (`stepped`, registration order, the same on every rank), packed as raw bytes (exact for
    /// every dtype) and padded to the largest share, in one all-gather; each rank writes the
    /// others' into `module`. Every rank must call it after its optimizer step. Returns the
    /// module, with the others' parameters unless the all-gather failed.
    ///
    /// # Errors
    /// The all-gather's ([`ExtendedCollectives::all_gather_f32`]).
    pub(crate) fn gather_stepped<M: Module>(
        &self,
        module: M,
        stepped: &[bool],
        group: &dyn ProcessGroup,
        timeout: Duration,
    ) -> (M, Result<()>) {
        if self.world_size == 1 {
            return (module, Ok(()));
        }
        let select = |owner: usize| -> Vec<bool> {
            self.owners
                .iter()
                .enumerate()
                .map(|(i, o)| *o == Some(owner) && stepped.get(i).copied().unwrap_or(false))
                .collect()
        };
        let share = |select: &[bool]| -> usize {
            self.words
                .iter()
                .zip(select)
                .filter(|(_, s)| **s)
                .map(|(w, _)| w)
                .sum()
        };
        let selections: Vec<Vec<bool>> = (0..self.world_size).map(select).collect();
        let block = selections.iter().map(|s| share(s)).max().unwrap_or(0);
        if block == 0 {
            return (module, Ok(()));
        }
        // Buffers kept from step to step: a fresh 2 x 11 MB a step (the benchmark's MLP on 2
        // ranks) cost more in page faults than the copies themselves.
        let mut buffers = self
            .buffers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let (mine, all) = &mut *buffers;
        *mine = snapshot_selected_into(&module, &selections[self.rank], std::mem::take(mine));
        mine.resize(block, 0.0);
        all.resize(block * self.world_size, 0.0);
        if let Err(err) = group.all_gather_f32(mine, all, timeout) {
            return (module, Err(err.into()));
        }
        let mut module = module;
        for (owner, select) in selections.iter().enumerate() {
            if owner != self.rank && select.contains(&true) {
                module = restore_selected(module, &all[owner * block..], select);
            }
        }
        (module, Ok(()))
    }

    /// Every rank's updated parameters to every rank, as [`gather_stepped`](Self::gather_stepped),
    /// by reference between thread replicas on one device (no copy: each rank takes the owners'
    /// tensors as they are), else through host memory. Every rank must call it after its
    /// optimizer step.
    pub(crate) fn exchange_stepped<M: Module>(
        &self,
        module: M,
        stepped: &[bool],
        group: &dyn ProcessGroup,
        timeout: Duration,
    ) -> (M, Result<()>) {
        use std::sync::atomic::Ordering;
        if self.world_size == 1 || !self.share || self.apart.load(Ordering::Relaxed) {
            return self.gather_stepped(module, stepped, group, timeout);
        }
        let pick = |mine: bool| -> Vec<bool> {
            self.owners
                .iter()
                .enumerate()
                .map(|(i, o)| {
                    o.is_some_and(|o| (o == self.rank) == mine)
                        && stepped.get(i).copied().unwrap_or(false)
                })
                .collect()
        };
        match share::share_stepped(module, &pick(true), &pick(false), group, timeout) {
            (module, Some(result)) => (module, result),
            (module, None) => {
                // Every rank found the same: host memory from now on.
                self.apart.store(true, Ordering::Relaxed);
                self.gather_stepped(module, stepped, group, timeout)
            }
        }
    }

    /// Every rank's updated parameters to every rank: the tensors each rank owns and that are
    /// trainable in `module` now, packed as raw bytes and all-gathered; each rank writes the
    /// others' into `module`. Every rank must call it after its optimizer step.
    ///
    /// # Errors
    /// The all-gather's.
    pub fn gather<M: Module>(
        &self,
        module: M,
        group: &dyn ProcessGroup,
        timeout: Duration,
    ) -> Result<M> {
        let trainable = trainable_places(&module);
        let (module, gathered) = self.gather_stepped(module, &trainable, group, timeout);
        gathered.map(|()| module)
    }
}

/// Whether each float tensor (registration order) requires gradients now.
pub(crate) fn trainable_places<M: Module>(module: &M) -> Vec<bool> {
    struct Trainable(Vec<bool>);
    impl ModuleVisitor for Trainable {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0.push(param.is_require_grad());
        }
    }
    let mut visitor = Trainable(Vec::new());
    module.visit(&mut visitor);
    visitor.0
}

/// Removes the gradients of other ranks' parameters.
struct DropOthers<'a> {
    shards: &'a OptimizerShards,
    grads: &'a mut GradientsParams,
    visited: usize,
}

impl ModuleVisitor for DropOthers<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let index = self.visited;
        self.visited += 1;
        let owner = self.shards.owners.get(index).copied().flatten();
        if owner.is_some_and(|o| o != self.shards.rank) {
            let _ = self.grads.remove::<D>(param.id);
        }
    }
}

#[cfg(test)]
mod tests {
    use burn::nn::{Linear, LinearConfig};

    use super::*;
    use crate::replica::tests::test_device;

    #[derive(Module, Debug)]
    struct Net {
        big: Linear,
        mid: Linear,
        small: Linear,
    }

    fn net() -> Net {
        let device = test_device();
        Net {
            big: LinearConfig::new(16, 16).init(&device),
            mid: LinearConfig::new(8, 8).init(&device),
            small: LinearConfig::new(2, 2).init(&device),
        }
    }

    #[test]
    fn whole_tensors_go_largest_first_to_the_rank_with_the_fewest_bytes() {
        let layout = ReplicaLayout::of(&net());
        // Tensors (registration order): big.weight 1024 B, big.bias 64, mid.weight 256,
        // mid.bias 32, small.weight 16, small.bias 8.
        let shards = OptimizerShards::new(&layout, 0, 2);
        // 1024 -> 0; 256 -> 1; 64 -> 1; 32 -> 1; 16 -> 1; 8 -> 1.
        assert_eq!(
            shards.owners(),
            &[Some(0), Some(1), Some(1), Some(1), Some(1), Some(1)]
        );
        assert_eq!(shards.bytes_per_rank(), &[1024, 376]);
        let three = OptimizerShards::new(&layout, 2, 3);
        // 1024 -> 0; 256 -> 1; 64 -> 2; 32 -> 2; 16 -> 2; 8 -> 2.
        assert_eq!(three.bytes_per_rank(), &[1024, 256, 120]);
        // Every rank computes the same assignment.
        assert_eq!(OptimizerShards::new(&layout, 0, 3).owners(), three.owners());
        assert_eq!(
            OptimizerShards::new(&layout, 0, 1).bytes_per_rank(),
            &[1400]
        );
    }

    /// A model being fine-tuned: a large frozen backbone, a few small trainable layers.
    #[derive(Module, Debug)]
    struct FineTuned {
        backbone: Linear,
        head: Linear,
        adapter: Linear,
        extra: Linear,
    }

    #[test]
    fn the_trainable_bytes_are_balanced_when_most_weights_are_frozen() {
        let device = test_device();
        let model = FineTuned {
            backbone: LinearConfig::new(64, 64).init(&device).no_grad(),
            head: LinearConfig::new(16, 8).init(&device),
            adapter: LinearConfig::new(16, 8).init(&device),
            extra: LinearConfig::new(8, 8).init(&device),
        };
        let layout = ReplicaLayout::of(&model);
        for world_size in [2, 3] {
            let shards = OptimizerShards::new(&layout, 0, world_size);
            let mut trainable = vec![0usize; world_size];
            let mut largest = 0;
            for t in layout.tensors() {
                if t.kind == TensorKind::Parameter {
                    let bytes = t.numel() * t.element_bytes;
                    trainable[shards.owner(t.index).unwrap()] += bytes;
                    largest = largest.max(bytes);
                }
            }
            let spread = trainable.iter().max().unwrap() - trainable.iter().min().unwrap();
            assert!(
                spread <= largest,
                "world size {world_size}: trainable bytes per rank {trainable:?} (largest tensor \
                 {largest} bytes)"
            );
            // The frozen backbone has an owner too (it may be unfrozen later).
            assert!(shards.owner(0).is_some());
        }
    }

    #[test]
    fn a_rank_keeps_the_gradients_of_its_own_parameters_only() {
        let model = net();
        let device = test_device();
        let layout = ReplicaLayout::of(&model);
        let x = Tensor::<2>::ones([1, 16], &device);
        let y = model.big.forward(x).sum()
            + model.mid.forward(Tensor::<2>::ones([1, 8], &device)).sum()
            + model
                .small
                .forward(Tensor::<2>::ones([1, 2], &device))
                .sum();
        let all = GradientsParams::from_grads(y.backward(), &model);
        for rank in 0..2 {
            let shards = OptimizerShards::new(&layout, rank, 2);
            let mut grads = all_grads_clone(&all, &model);
            shards.keep_own(&model, &mut grads);
            let kept: Vec<bool> = layout
                .tensors()
                .iter()
                .map(|t| match t.shape.len() {
                    1 => grads.get::<1>(t.id).is_some(),
                    _ => grads.get::<2>(t.id).is_some(),
                })
                .collect();
            let expected: Vec<bool> = shards.owners().iter().map(|o| *o == Some(rank)).collect();
            assert_eq!(kept, expected, "rank {rank}");
        }
    }

    #[test]
    fn after_the_gather_every_rank_holds_each_owners_values_bit_for_bit() {
        use crate::replica::tensor_fingerprints;
        use burn_ddp_comm::group::ThreadGroup;
        // Rank r's model: its own random draw (as if each had stepped differently).
        let models: Vec<Net> = (0..3).map(|_| net()).collect();
        let layout = ReplicaLayout::of(&models[0]);
        let shards = OptimizerShards::new(&layout, 0, 3);
        // What every rank must hold: each tensor from its owner's model.
        let expected: Vec<u64> = shards
            .owners()
            .iter()
            .enumerate()
            .map(|(i, owner)| tensor_fingerprints(&models[owner.unwrap()])[i])
            .collect();
        let groups = ThreadGroup::new_group(3).unwrap();
        let gathered: Vec<Vec<u64>> = std::thread::scope(|s| {
            let handles: Vec<_> = groups
                .into_iter()
                .zip(models.iter().cloned())
                .enumerate()
                .map(|(rank, (group, model))| {
                    let layout = layout.clone();
                    s.spawn(move || {
                        let shards = OptimizerShards::new(&layout, rank, 3);
                        let model = shards
                            .gather(model, &group, Duration::from_secs(20))
                            .unwrap();
                        tensor_fingerprints(&model)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (rank, got) in gathered.iter().enumerate() {
            assert_eq!(got, &expected, "rank {rank}");
        }
    }

    /// A copy of `grads` (GradientsParams is not `Clone`).
    fn all_grads_clone(grads: &GradientsParams, model: &Net) -> GradientsParams {
        let layout = ReplicaLayout::of(model);
        let mut copy = GradientsParams::new();
        for t in layout.tensors() {
            match t.shape.len() {
                1 => {
                    if let Some(g) = grads.get::<1>(t.id) {
                        copy.register::<1>(t.id, g);
                    }
                }
                _ => {
                    if let Some(g) = grads.get::<2>(t.id) {
                        copy.register::<2>(t.id, g);
                    }
                }
            }
        }
        copy
    }
}
