//! What a model replica holds, in the order Burn registers it: parameters (float tensors that
//! require gradients), frozen weights (parameters that do not, e.g. after `Module::no_grad`) and
//! buffers (state updated by the forward pass, e.g. BatchNorm's running mean and variance, which
//! Burn keeps in `RunningState`).
//!
//! This module owns the replica-wide operations that do not touch gradients:
//! - [`ReplicaLayout`]: kinds, shapes and paths of every float tensor, and its fingerprint;
//! - [`ReplicaLayout::verify_across`]: every rank compares layouts before the first all-reduce and
//!   fails with the first difference if the replicas differ;
//! - [`broadcast_autodiff_module`]: copies one rank's parameters and buffers to every rank, so all
//!   replicas start bit-identical (Burn initialises parameters lazily and randomly per replica);
//!   [`broadcast_selected`] does the same for buffers only;
//! - [`verify_values_across`]: checks that the replicas still hold bit-identical values.
//!
//! It may call a [`ProcessGroup`]; it knows nothing of buckets or of burn-train. This file holds
//! the layout (kinds, specs, fingerprints, shared-state detection); `values.rs` moves the values
//! (packing, broadcasts, averages, snapshots, value fingerprints).

use std::fmt;
use std::time::Duration;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::tensor::{Device, Tensor};

use crate::error::{DdpError, Result};
use burn_ddp_comm::group::ProcessGroup;

/// What a float tensor of a module is to data-parallel training.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TensorKind {
    /// A float tensor that requires gradients: its gradients are all-reduced every step.
    Parameter,
    /// A weight that does not require gradients (`Module::no_grad`, `set_require_grad(false)`):
    /// broadcast at start-up, then left alone, as PyTorch DDP leaves parameters with
    /// `requires_grad=False`. It becomes a [`Parameter`](Self::Parameter) again when unfrozen.
    Frozen,
    /// State the forward pass updates (Burn's `RunningState`: BatchNorm's running mean and
    /// variance), PyTorch's buffers: kept identical across replicas after every step
    /// ([`BufferSync`](crate::config::BufferSync)).
    Buffer,
}

impl TensorKind {
    fn code(self) -> u64 {
        match self {
            TensorKind::Frozen => 0,
            TensorKind::Parameter => 1,
            TensorKind::Buffer => 2,
        }
    }

    fn from_code(code: u64) -> Option<Self> {
        match code {
            0 => Some(TensorKind::Frozen),
            1 => Some(TensorKind::Parameter),
            2 => Some(TensorKind::Buffer),
            _ => None,
        }
    }
}

impl fmt::Display for TensorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TensorKind::Parameter => "parameter",
            TensorKind::Frozen => "frozen weight",
            TensorKind::Buffer => "buffer",
        })
    }
}

/// One float tensor of a module.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    /// Position among the module's float tensors, in registration (visit) order, from 0.
    pub index: usize,
    /// Dotted path of the tensor in the module, e.g. `conv1.weight`.
    pub path: String,
    /// Parameter, frozen weight or buffer.
    pub kind: TensorKind,
    /// Shape, outermost dimension first.
    pub shape: Vec<usize>,
    /// Bytes per element (4 for `f32`).
    pub element_bytes: usize,
    /// Burn's parameter id (the key of `GradientsParams`). A tensor reachable from two places of
    /// the module tree (a shared weight) appears twice with the same id.
    pub id: ParamId,
}

impl TensorSpec {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// The float tensors of one replica, in registration order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaLayout {
    tensors: Vec<TensorSpec>,
}

/// Words per tensor in the layout exchange of [`ReplicaLayout::verify_across`]:
/// kind, number of dimensions, number of elements, bytes per element, the first 8 dimensions.
const WORDS_PER_TENSOR: usize = 12;
const MAX_ENCODED_DIMS: usize = 8;
const ABSENT: u64 = u64::MAX;

/// Two hashes of a module's float tensors, cheap to take every step (no tensor data is read):
/// `structure` covers their number, shapes, element sizes and ids; `trainable` which of them
/// require gradients. The [`Reducer`](crate::mechanism::Reducer) compares them with the layout the ranks
/// agreed on to notice layers frozen, unfrozen, added or replaced during training.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayoutFingerprints {
    /// FNV-1a over the tensors' count, shapes, element sizes and ids, in registration order.
    pub structure: u64,
    /// FNV-1a over which tensors require gradients, in registration order.
    pub trainable: u64,
}

impl ReplicaLayout {
    /// Reads the layout of `module`, telling parameters, frozen weights and buffers apart.
    /// Initialises lazily created parameters (their values are needed for the start-up broadcast
    /// anyway).
    ///
    /// Buffers are found by what Burn's `RunningState` does and a frozen weight does not: clones
    /// of a module share one `RunningState`. The probe changes each tensor without gradients in a
    /// clone of `module` to a marker and restores it at once; a tensor whose change shows in
    /// `module` itself is a buffer. Probes are serialised process-wide: do not train another
    /// clone of `module` on another thread while it runs (every rank builds its layout before its
    /// first collective, so the ranks of one job never do).
    pub fn of<M: Module>(module: &M) -> Self {
        // A probe marks state shared by clones: no other thread may read the tensors meanwhile
        // (another rank's layout of a clone would see the marker).
        let _serialised = PROBE
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let mut layout = Self::scan(module);
        let candidates: Vec<bool> = layout
            .tensors
            .iter()
            .map(|t| t.kind != TensorKind::Parameter)
            .collect();
        if candidates.contains(&true) {
            let shared = shared_state(module, &candidates);
            for (tensor, shared) in layout.tensors.iter_mut().zip(shared) {
                if shared {
                    tensor.kind = TensorKind::Buffer;
                }
            }
        }
        layout
    }

    /// The layout of `module` without the buffer probe of [`of`](Self::of): every tensor without
    /// gradients is [`TensorKind::Frozen`]. For comparing structures and naming tensors.
    pub fn scan<M: Module>(module: &M) -> Self {
        let mut collector = SpecCollector {
            path: Vec::new(),
            tensors: Vec::new(),
        };
        module.visit(&mut collector);
        Self {
            tensors: collector.tensors,
        }
    }

    /// This layout with the tensors' kinds as `now` (a [`scan`](Self::scan) of the same module
    /// later) has them: a [`TensorKind::Buffer`] stays a buffer, every other tensor is a
    /// parameter when it requires gradients and frozen otherwise. `now` must have this layout's
    /// structure.
    pub fn with_trainable(&self, now: &ReplicaLayout) -> Self {
        let tensors = self
            .tensors
            .iter()
            .zip(&now.tensors)
            .map(|(agreed, now)| TensorSpec {
                kind: if agreed.kind == TensorKind::Buffer {
                    TensorKind::Buffer
                } else {
                    now.kind
                },
                ..now.clone()
            })
            .collect();
        Self { tensors }
    }

    /// All float tensors, in registration order.
    pub fn tensors(&self) -> &[TensorSpec] {
        &self.tensors
    }

    /// The parameters (tensors that require gradients), in registration order.
    pub fn parameters(&self) -> impl Iterator<Item = &TensorSpec> {
        self.tensors
            .iter()
            .filter(|t| t.kind == TensorKind::Parameter)
    }

    /// The buffers (state the forward pass updates), in registration order.
    pub fn buffers(&self) -> impl Iterator<Item = &TensorSpec> {
        self.tensors.iter().filter(|t| t.kind == TensorKind::Buffer)
    }

    /// For each float tensor in registration order, whether it is a buffer.
    pub fn buffer_mask(&self) -> Vec<bool> {
        self.tensors
            .iter()
            .map(|t| t.kind == TensorKind::Buffer)
            .collect()
    }

    /// Total number of elements of all float tensors (the length of a full broadcast).
    pub fn numel(&self) -> usize {
        self.tensors.iter().map(TensorSpec::numel).sum()
    }

    /// A 64-bit FNV-1a hash of the tensors' kinds, shapes and element sizes in order (not of their values, paths or
    /// ids, which legitimately differ between processes).
    pub fn fingerprint(&self) -> u64 {
        let words = self.tensors.iter().flat_map(|t| {
            [t.kind.code(), t.shape.len() as u64, t.element_bytes as u64]
                .into_iter()
                .chain(t.shape.iter().map(|&d| d as u64))
        });
        fnv(std::iter::once(self.tensors.len() as u64).chain(words))
    }

    /// The [`LayoutFingerprints`] of this layout (as [`fingerprints_of`] gives them for the module
    /// it was read from).
    pub(crate) fn fingerprints(&self) -> LayoutFingerprints {
        let mut hashes = Hashes::default();
        for t in &self.tensors {
            hashes.add(
                &t.shape,
                t.element_bytes,
                t.id,
                t.kind == TensorKind::Parameter,
            );
        }
        hashes.finish()
    }

    /// Checks that every rank of `group` has the same layout; every rank must call it.
    ///
    /// Costs one all-gather of 2 `u64` when the layouts match, and a second one (12 `u64` per
    /// tensor) to find the first difference when they do not.
    ///
    /// # Errors
    /// [`DdpError::ReplicaMismatch`] on every rank when the layouts differ, naming the first
    /// tensor (index in registration order, kind, shape on each side, and this rank's path for
    /// it); the collective's errors when the exchange itself fails.
    pub fn verify_across(&self, group: &dyn ProcessGroup, timeout: Duration) -> Result<()> {
        let mine = [self.tensors.len() as u64, self.fingerprint()];
        let all = group.all_gather(&mine, timeout)?;
        let summaries: Vec<&[u64]> = all.chunks(2).collect();
        if summaries.iter().all(|s| *s == summaries[0]) {
            return Ok(());
        }
        let counts: Vec<usize> = summaries.iter().map(|s| s[0] as usize).collect();
        let max_count = counts.iter().copied().max().unwrap_or(0);
        let encoded = group.all_gather(&self.encode(max_count), timeout)?;
        let per_rank = max_count * WORDS_PER_TENSOR;
        let ranks: Vec<&[u64]> = encoded.chunks(per_rank.max(1)).collect();
        let me = group.rank();
        let detail = (0..max_count)
            .find_map(|index| {
                let entry = |r: usize| &ranks[r][index * WORDS_PER_TENSOR..][..WORDS_PER_TENSOR];
                let peer = (1..ranks.len()).find(|&r| entry(r) != entry(0))?;
                let here = self
                    .tensors
                    .get(index)
                    .map(|t| format!("; on this rank (rank {me}) it is `{}`", t.path))
                    .unwrap_or_default();
                Some(format!(
                    "tensor #{index} in registration order: rank 0 has {} ({} float tensors in all) \
                     but rank {peer} has {} ({} float tensors in all){here}",
                    describe(entry(0)),
                    counts[0],
                    describe(entry(peer)),
                    counts[peer],
                ))
            })
            .unwrap_or_else(|| {
                // Same kinds and shapes but different fingerprints: only dimensions beyond the
                // eighth can differ.
                "tensors agree in their first 8 dimensions but their fingerprints differ".into()
            });
        Err(DdpError::ReplicaMismatch { rank: me, detail })
    }

    fn encode(&self, count: usize) -> Vec<u64> {
        let mut out = vec![ABSENT; count * WORDS_PER_TENSOR];
        for (t, words) in self.tensors.iter().zip(out.chunks_mut(WORDS_PER_TENSOR)) {
            words[0] = t.kind.code();
            words[1] = t.shape.len() as u64;
            words[2] = t.numel() as u64;
            words[3] = t.element_bytes as u64;
            for (slot, d) in words[4..]
                .iter_mut()
                .zip(t.shape.iter().chain(std::iter::repeat(&0)))
                .take(MAX_ENCODED_DIMS)
            {
                *slot = *d as u64;
            }
        }
        out
    }
}

/// The [`LayoutFingerprints`] of `module` now (no tensor data is read).
pub fn fingerprints_of<M: Module>(module: &M) -> LayoutFingerprints {
    struct Visit(Hashes);
    impl ModuleVisitor for Visit {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let tensor = param.val();
            self.0.add(
                tensor.shape().as_slice(),
                tensor.dtype().size(),
                param.id,
                tensor.is_require_grad(),
            );
        }
    }
    let mut visit = Visit(Hashes::default());
    module.visit(&mut visit);
    visit.0.finish()
}

/// Accumulates [`LayoutFingerprints`].
#[derive(Default)]
struct Hashes {
    structure: Vec<u64>,
    trainable: Vec<u64>,
}

impl Hashes {
    fn add(&mut self, shape: &[usize], element_bytes: usize, id: ParamId, trainable: bool) {
        self.structure.push(shape.len() as u64);
        self.structure.extend(shape.iter().map(|&d| d as u64));
        self.structure.push(element_bytes as u64);
        self.structure.push(id.val());
        self.trainable.push(u64::from(trainable));
    }

    fn finish(self) -> LayoutFingerprints {
        let count = self.trainable.len() as u64;
        LayoutFingerprints {
            structure: fnv(std::iter::once(count).chain(self.structure)),
            trainable: fnv(std::iter::once(count).chain(self.trainable)),
        }
    }
}

/// A model as the [`Reducer`](crate::mechanism::Reducer) looks at it every step: its
/// [fingerprints](LayoutFingerprints), and its tensors when they changed.
pub trait ReplicaView {
    /// The model's [`LayoutFingerprints`] now.
    fn fingerprints(&self) -> LayoutFingerprints;
    /// The model's tensors now ([`ReplicaLayout::scan`]: no buffer probe).
    fn scan(&self) -> ReplicaLayout;
}

/// A layout as a model that never changes (for driving a [`Reducer`](crate::mechanism::Reducer) without a
/// module, e.g. in benchmarks).
impl ReplicaView for ReplicaLayout {
    fn fingerprints(&self) -> LayoutFingerprints {
        ReplicaLayout::fingerprints(self)
    }

    fn scan(&self) -> ReplicaLayout {
        self.clone()
    }
}

/// A [`ReplicaView`] of a Burn module.
pub struct Replica<'a, M: Module> {
    module: &'a M,
}

impl<'a, M: Module> Replica<'a, M> {
    /// Views `module`.
    pub fn new(module: &'a M) -> Self {
        Self { module }
    }
}

impl<M: Module> ReplicaView for Replica<'_, M> {
    fn fingerprints(&self) -> LayoutFingerprints {
        fingerprints_of(self.module)
    }

    fn scan(&self) -> ReplicaLayout {
        ReplicaLayout::scan(self.module)
    }
}

/// Serialises the buffer probes of [`ReplicaLayout::of`] in this process.
static PROBE: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// For each float tensor of `module` (registration order) with `candidates[i]`, whether its
/// state is shared by clones of `module` (Burn's `RunningState`); see [`ReplicaLayout::of`],
/// which holds [`PROBE`] around it.
fn shared_state<M: Module>(module: &M, candidates: &[bool]) -> Vec<bool> {
    use std::any::Any;

    /// A marked tensor's shape and value (a `Tensor<D>`, boxed: `D` varies).
    type Original = (Vec<usize>, Box<dyn Any + Send>);
    /// Replaces each candidate by a marker of another shape, keeping the original. A tensor
    /// reachable from two places (one id; a `RunningState` shared by two fields) is marked at
    /// its first place only: marking the second would take the first marker for the original.
    struct Mark<'a> {
        candidates: &'a [bool],
        index: usize,
        originals: Vec<Option<Original>>,
        seen: std::collections::HashSet<ParamId>,
    }
    impl ModuleMapper for Mark<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let index = self.index;
            self.index += 1;
            if !self.candidates.get(index).copied().unwrap_or(false) || !self.seen.insert(param.id)
            {
                self.originals.push(None);
                return param;
            }
            let (id, tensor, mapper) = param.consume();
            let shape = tensor.shape().to_vec();
            let mut dims = [1usize; D];
            if shape.as_slice() == dims.as_slice() {
                dims[0] = 2;
            }
            let marker = Tensor::<D>::zeros(dims, &tensor.device());
            self.originals.push(Some((shape, Box::new(tensor))));
            Param::from_mapped_value(id, marker, mapper)
        }
    }
    /// Puts the originals back (through the clone, so shared state gets them too).
    struct Restore {
        index: usize,
        originals: Vec<Option<Original>>,
    }
    impl ModuleMapper for Restore {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let index = self.index;
            self.index += 1;
            let Some(Some((_, original))) = self.originals.get_mut(index).map(Option::take) else {
                return param;
            };
            match original.downcast::<Tensor<D>>() {
                Ok(original) => {
                    let (id, _, mapper) = param.consume();
                    Param::from_mapped_value(id, *original, mapper)
                }
                Err(_) => param,
            }
        }
    }
    /// Whether each tensor now has another shape than its original (a tensor marked at an
    /// earlier place counts for every place of its id).
    struct Changed<'a> {
        shapes: &'a [Option<Vec<usize>>],
        index: usize,
        changed: Vec<bool>,
        by_id: std::collections::HashMap<ParamId, bool>,
    }
    impl ModuleVisitor for Changed<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let changed = match self.shapes.get(self.index) {
                Some(Some(shape)) => {
                    let changed = param.val().shape().as_slice() != shape.as_slice();
                    self.by_id.insert(param.id, changed);
                    changed
                }
                _ => self.by_id.get(&param.id).copied().unwrap_or(false),
            };
            self.index += 1;
            self.changed.push(changed);
        }
    }

    let mut mark = Mark {
        candidates,
        index: 0,
        originals: Vec::new(),
        seen: std::collections::HashSet::new(),
    };
    let marked = module.clone().map(&mut mark);
    let shapes: Vec<Option<Vec<usize>>> = mark
        .originals
        .iter()
        .map(|o| o.as_ref().map(|(shape, _)| shape.clone()))
        .collect();
    let mut changed = Changed {
        shapes: &shapes,
        index: 0,
        changed: Vec::new(),
        by_id: std::collections::HashMap::new(),
    };
    module.visit(&mut changed);
    let _restored = marked.map(&mut Restore {
        index: 0,
        originals: mark.originals,
    });
    changed.changed
}

fn describe(words: &[u64]) -> String {
    if words[0] == ABSENT {
        return "no such tensor".into();
    }
    let kind = TensorKind::from_code(words[0])
        .map(|k| k.to_string())
        .unwrap_or_else(|| "tensor".into());
    let ndims = words[1] as usize;
    let mut dims: Vec<String> = words[4..4 + ndims.min(MAX_ENCODED_DIMS)]
        .iter()
        .map(u64::to_string)
        .collect();
    if ndims > MAX_ENCODED_DIMS {
        dims.push("..".into());
    }
    format!(
        "a {kind} of shape [{}] ({}-byte elements)",
        dims.join(", "),
        words[3]
    )
}

struct SpecCollector {
    path: Vec<String>,
    tensors: Vec<TensorSpec>,
}

impl ModuleVisitor for SpecCollector {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let tensor = param.val();
        let kind = if tensor.is_require_grad() {
            TensorKind::Parameter
        } else {
            TensorKind::Frozen
        };
        self.tensors.push(TensorSpec {
            index: self.tensors.len(),
            path: self.path.join("."),
            kind,
            shape: tensor.shape().to_vec(),
            element_bytes: tensor.dtype().size(),
            id: param.id,
        });
    }
}

mod ties;
mod values;

pub(crate) use values::tensor_fingerprints;
// Until the reducer, the strategy and the custom loop that use them are ported.
#[allow(unused_imports)]
pub use values::value_fingerprint;
#[allow(unused_imports)]
pub(crate) use values::{
    average_selected, broadcast_autodiff_module, broadcast_selected, fingerprint_of, fnv,
    restore_selected, snapshot_selected, snapshot_selected_into, verify_values_across,
};

/// Whether tensors on `device` are plain values that any thread may read and reuse: those of
/// Burn's CPU backends (Flex, NdArray), which compute as they are called. On every other backend
/// (wgpu, CUDA) a tensor is a handle into the calling thread's stream, and Burn 0.21's fusion kept
/// each handle's reference count and in-place status per stream: a handle used by another
/// thread corrupted the fusion server ("Should have handle for tensor", measured on wgpu), even
/// after a device sync. Thread replicas share tensors by reference only on these backends.
pub(crate) fn shares_plain_values(device: &Device) -> bool {
    use burn::backend::DispatchDevice;
    #[allow(unreachable_patterns)]
    match device.clone().inner().as_dispatch() {
        #[cfg(feature = "flex")]
        DispatchDevice::Flex(_) => true,
        #[cfg(feature = "ndarray")]
        DispatchDevice::NdArray(_) => true,
        _ => false,
    }
}

/// Waits until the work queued on `device` by this thread has run (a no-op on the CPU backends).
///
/// # Errors
/// [`DdpError::Device`] naming the rank and `operation` when the backend reports that it failed.
pub(crate) fn sync_device(
    rank: usize,
    device: &Device,
    operation: &str,
) -> crate::error::Result<()> {
    device.sync().map_err(|e| crate::error::DdpError::Device {
        rank,
        operation: operation.to_string(),
        detail: format!("{e:?}"),
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use burn::module::Module;
    use burn::nn::{BatchNorm, BatchNormConfig, Linear, LinearConfig};

    /// Burn's CPU backend (of 0.22 and 0.23) with autodiff.
    pub(crate) fn test_device() -> Device {
        Device::flex().autodiff()
    }

    #[derive(Module, Debug)]
    struct Net {
        trained: Linear,
        frozen: Linear,
        norm: BatchNorm,
    }

    fn net() -> Net {
        let device = test_device();
        Net {
            trained: LinearConfig::new(3, 4).init(&device),
            frozen: LinearConfig::new(4, 4).init(&device).no_grad(),
            norm: BatchNormConfig::new(4).init(&device),
        }
    }

    #[test]
    fn frozen_weights_and_running_statistics_are_told_apart() {
        let model = net();
        let before = tensor_fingerprints(&model);
        let layout = ReplicaLayout::of(&model);
        let kinds: Vec<(String, TensorKind)> = layout
            .tensors()
            .iter()
            .map(|t| (t.path.clone(), t.kind))
            .collect();
        let expect = |path: &str, kind| (path.to_string(), kind);
        assert_eq!(
            kinds,
            vec![
                expect("trained.weight", TensorKind::Parameter),
                expect("trained.bias", TensorKind::Parameter),
                expect("frozen.weight", TensorKind::Frozen),
                expect("frozen.bias", TensorKind::Frozen),
                expect("norm.gamma", TensorKind::Parameter),
                expect("norm.beta", TensorKind::Parameter),
                expect("norm.running_mean", TensorKind::Buffer),
                expect("norm.running_var", TensorKind::Buffer),
            ]
        );
        // The probe leaves the model as it found it (values and shapes).
        assert_eq!(tensor_fingerprints(&model), before);
        assert_eq!(ReplicaLayout::scan(&model).tensors()[6].shape, vec![4]);
    }

    #[test]
    fn fingerprints_notice_unfreezing_and_new_ids_but_not_values() {
        let model = net();
        let agreed = ReplicaLayout::of(&model);
        assert_eq!(fingerprints_of(&model), agreed.fingerprints());
        // New values, same tensors: same fingerprints.
        let moved = Net {
            trained: LinearConfig::new(3, 4).init(&test_device()),
            ..model.clone()
        };
        let ids_changed = fingerprints_of(&moved);
        assert_eq!(ids_changed.trainable, agreed.fingerprints().trainable);
        assert_ne!(ids_changed.structure, agreed.fingerprints().structure);
        // Unfrozen: the trainable hash changes, the structure does not.
        let unfrozen = Net {
            frozen: model.frozen.clone().map(&mut Trainable),
            ..model.clone()
        };
        let now = fingerprints_of(&unfrozen);
        assert_eq!(now.structure, agreed.fingerprints().structure);
        assert_ne!(now.trainable, agreed.fingerprints().trainable);
        let kinds: Vec<TensorKind> = agreed
            .with_trainable(&ReplicaLayout::scan(&unfrozen))
            .tensors()
            .iter()
            .map(|t| t.kind)
            .collect();
        assert_eq!(kinds[2..4], [TensorKind::Parameter; 2]);
        assert_eq!(kinds[6..8], [TensorKind::Buffer; 2]);
    }

    /// One `BatchNorm` reachable from two fields (a clone shares its `RunningState`s).
    #[derive(Module, Debug)]
    struct TwoNorms {
        first: BatchNorm,
        second: BatchNorm,
    }

    #[test]
    fn running_statistics_shared_by_two_fields_are_probed_intact() {
        let norm: BatchNorm = BatchNormConfig::new(4).init(&test_device());
        let model = TwoNorms {
            first: norm.clone(),
            second: norm,
        };
        let before = tensor_fingerprints(&model);
        let layout = ReplicaLayout::of(&model);
        let kinds: Vec<(&str, TensorKind)> = layout
            .tensors()
            .iter()
            .map(|t| (t.path.as_str(), t.kind))
            .collect();
        assert_eq!(
            kinds,
            vec![
                ("first.gamma", TensorKind::Parameter),
                ("first.beta", TensorKind::Parameter),
                ("first.running_mean", TensorKind::Buffer),
                ("first.running_var", TensorKind::Buffer),
                ("second.gamma", TensorKind::Parameter),
                ("second.beta", TensorKind::Parameter),
                ("second.running_mean", TensorKind::Buffer),
                ("second.running_var", TensorKind::Buffer),
            ]
        );
        // Neither field's statistics were left as a marker (or swapped for another's value).
        assert_eq!(tensor_fingerprints(&model), before);
        let shapes: Vec<Vec<usize>> = ReplicaLayout::scan(&model)
            .tensors()
            .iter()
            .map(|t| t.shape.clone())
            .collect();
        assert_eq!(shapes, vec![vec![4]; 8]);
    }

    struct Trainable;
    impl ModuleMapper for Trainable {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            param.set_require_grad(true)
        }
    }
}
