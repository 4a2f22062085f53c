//! What a model replica holds, in the order Burn registers it: parameters (float tensors that
//! require gradients) and buffers (every other float tensor, e.g. BatchNorm's running mean and
//! variance, which Burn keeps in `RunningState`).
//!
//! This module owns the replica-wide operations that do not touch gradients:
//! - [`ReplicaLayout`]: kinds, shapes and paths of every float tensor, and its fingerprint;
//! - [`ReplicaLayout::verify_across`]: every rank compares layouts before the first all-reduce and
//!   fails with the first difference if the replicas differ;
//! - [`broadcast_module`]: copies one rank's parameters and buffers to every rank, so all replicas
//!   start bit-identical (Burn initialises parameters lazily and randomly per replica);
//!   [`broadcast_buffers`] does the same for buffers only;
//! - [`verify_values_across`]: checks that the replicas still hold bit-identical values.
//!
//! It may call a [`ProcessGroup`]; it knows nothing of buckets or of burn-train.

use std::fmt;
use std::time::Duration;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

use crate::group::ProcessGroup;
use crate::{DdpError, Result};

/// Whether a float tensor of a module is trained or only carried along.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TensorKind {
    /// A float tensor that requires gradients: gradients are all-reduced every step.
    Parameter,
    /// A float tensor without gradients (BatchNorm running statistics, frozen weights): kept
    /// identical across replicas by broadcast.
    Buffer,
}

impl fmt::Display for TensorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TensorKind::Parameter => "parameter",
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
    /// Parameter or buffer.
    pub kind: TensorKind,
    /// Shape, outermost dimension first.
    pub shape: Vec<usize>,
    /// Bytes per element (4 for `f32`).
    pub element_bytes: usize,
    /// Burn's parameter id (the key of `GradientsParams`).
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

impl ReplicaLayout {
    /// Reads the layout of `module`. Initialises lazily created parameters (their values are needed
    /// for the start-up broadcast anyway).
    pub fn of<B: Backend, M: Module<B>>(module: &M) -> Self {
        let mut collector = SpecCollector {
            path: Vec::new(),
            tensors: Vec::new(),
        };
        module.visit(&mut collector);
        Self {
            tensors: collector.tensors,
        }
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

    /// The buffers (float tensors without gradients), in registration order.
    pub fn buffers(&self) -> impl Iterator<Item = &TensorSpec> {
        self.tensors.iter().filter(|t| t.kind == TensorKind::Buffer)
    }

    /// Total number of elements of all float tensors (the length of a full broadcast).
    pub fn numel(&self) -> usize {
        self.tensors.iter().map(TensorSpec::numel).sum()
    }

    /// A 64-bit FNV-1a hash of the tensors' kinds, shapes and element sizes in order (not of their values, paths or
    /// ids, which legitimately differ between processes).
    pub fn fingerprint(&self) -> u64 {
        let words = self.tensors.iter().flat_map(|t| {
            [
                matches!(t.kind, TensorKind::Parameter) as u64,
                t.shape.len() as u64,
                t.element_bytes as u64,
            ]
            .into_iter()
            .chain(t.shape.iter().map(|&d| d as u64))
        });
        fnv(std::iter::once(self.tensors.len() as u64).chain(words))
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
            words[0] = matches!(t.kind, TensorKind::Parameter) as u64;
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

fn describe(words: &[u64]) -> String {
    if words[0] == ABSENT {
        return "no such tensor".into();
    }
    let kind = if words[0] == 1 {
        TensorKind::Parameter
    } else {
        TensorKind::Buffer
    };
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

impl<B: Backend> ModuleVisitor<B> for SpecCollector {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let tensor = param.val();
        let kind = if tensor.is_require_grad() {
            TensorKind::Parameter
        } else {
            TensorKind::Buffer
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

/// How [`Pack`] turns tensors into the `f32` words a collective moves.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Encoding {
    /// The tensor's raw bytes in 4-byte words, each tensor padded to a whole word: exact for
    /// every dtype, for broadcasts (which only copy the words).
    Bytes,
    /// The tensor's values converted to `f32`: for all-reduces, which do arithmetic.
    Values,
}

/// Packs every float tensor (only buffers, tensors without gradients, with `buffers_only`) in
/// registration order into `f32` words. `select`, when set, says for each visited tensor (in
/// the same order) whether to pack it.
struct Pack {
    words: Vec<f32>,
    buffers_only: bool,
    encoding: Encoding,
    select: Option<Vec<bool>>,
    visited: usize,
    error: Option<String>,
}

impl Pack {
    fn new(buffers_only: bool, encoding: Encoding, select: Option<Vec<bool>>) -> Self {
        Self {
            words: Vec::new(),
            buffers_only,
            encoding,
            select,
            visited: 0,
            error: None,
        }
    }

    /// Whether the next visited tensor is selected (and counts it).
    fn take(&mut self) -> bool {
        let index = self.visited;
        self.visited += 1;
        self.select
            .as_ref()
            .is_none_or(|select| select.get(index).copied().unwrap_or(false))
    }
}

impl<B: Backend> ModuleVisitor<B> for Pack {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let tensor = param.val();
        if (self.buffers_only && tensor.is_require_grad()) || !self.take() {
            return;
        }
        let data = tensor.into_data();
        match self.encoding {
            Encoding::Bytes => self.words.extend(data.as_bytes().chunks(4).map(|chunk| {
                let mut word = [0u8; 4];
                word[..chunk.len()].copy_from_slice(chunk);
                f32::from_bits(u32::from_le_bytes(word))
            })),
            Encoding::Values => {
                let data = data.convert::<f32>();
                match data.as_slice::<f32>() {
                    Ok(values) => self.words.extend_from_slice(values),
                    Err(e) => {
                        self.error
                            .get_or_insert_with(|| format!("tensor {}: {e:?}", param.id));
                    }
                }
            }
        }
    }
}

/// Replaces every float tensor (only buffers with `buffers_only`) by the next words of `words`
/// (as packed by [`Pack`] with the same encoding), keeping shape, device, dtype and whether it
/// requires gradients.
struct Unpack<'a> {
    words: &'a [f32],
    offset: usize,
    buffers_only: bool,
    encoding: Encoding,
    select: Option<Vec<bool>>,
    visited: usize,
}

impl<'a> Unpack<'a> {
    fn new(
        words: &'a [f32],
        buffers_only: bool,
        encoding: Encoding,
        select: Option<Vec<bool>>,
    ) -> Self {
        Self {
            words,
            offset: 0,
            buffers_only,
            encoding,
            select,
            visited: 0,
        }
    }
}

impl<B: Backend> ModuleMapper<B> for Unpack<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        if self.buffers_only && tensor.is_require_grad() {
            return Param::from_mapped_value(id, tensor, mapper);
        }
        let index = self.visited;
        self.visited += 1;
        if let Some(select) = &self.select
            && !select.get(index).copied().unwrap_or(false)
        {
            return Param::from_mapped_value(id, tensor, mapper);
        }
        let shape = tensor.shape();
        let dtype = tensor.dtype();
        let numel = shape.num_elements();
        let data = match self.encoding {
            Encoding::Bytes => {
                let len = numel * dtype.size();
                let words = len.div_ceil(4);
                let mut bytes: Vec<u8> = self.words[self.offset..self.offset + words]
                    .iter()
                    .flat_map(|w| w.to_bits().to_le_bytes())
                    .collect();
                bytes.truncate(len);
                self.offset += words;
                TensorData::from_bytes_vec(bytes, shape, dtype)
            }
            Encoding::Values => {
                let values = self.words[self.offset..self.offset + numel].to_vec();
                self.offset += numel;
                TensorData::new(values, shape).convert_dtype(dtype)
            }
        };
        let mut value = Tensor::<B, D>::from_data(data, &tensor.device());
        if tensor.is_require_grad() {
            value = value.require_grad();
        }
        Param::from_mapped_value(id, value, mapper)
    }
}

/// Broadcasts the packed tensors of `module` from `root` and writes them into the other ranks'
/// modules.
fn broadcast_tensors<B: Backend, M: Module<B>>(
    module: M,
    group: &dyn ProcessGroup,
    root: usize,
    timeout: Duration,
    buffers_only: bool,
) -> Result<M> {
    let mut pack = Pack::new(buffers_only, Encoding::Bytes, None);
    module.visit(&mut pack);
    let mut words = pack.words;
    group.broadcast(&mut words, root, timeout)?;
    if group.rank() == root {
        return Ok(module);
    }
    let mut unpack = Unpack::new(&words, buffers_only, Encoding::Bytes, None);
    Ok(module.map(&mut unpack))
}

/// Replaces every rank's buffers (float tensors without gradients) that differ between ranks by
/// their average over the ranks; every rank must call it. For BatchNorm's running statistics this
/// is the average of the replicas' statistics, which is what Burn's `RunningState` computes for
/// replicas that are threads sharing one module. Buffers already identical on every rank (frozen
/// weights) are left alone: averaging N equal values can change their last bit. Costs one
/// all-gather of one `u64` per buffer, and one all-reduce of the differing buffers as `f32`.
/// Flush `RunningState`'s pending updates first (`AutodiffModule::valid` does).
///
/// # Errors
/// The collectives' errors; [`DdpError::Bucket`] when a buffer cannot be read as `f32`.
pub fn average_buffers<B: Backend, M: Module<B>>(
    module: M,
    group: &dyn ProcessGroup,
    timeout: Duration,
) -> Result<M> {
    let mut hashes = Fingerprints {
        hashes: Vec::new(),
        buffers_only: true,
    };
    module.visit(&mut hashes);
    if hashes.hashes.is_empty() {
        // Every rank has the same layout, so every rank skips the collectives together.
        return Ok(module);
    }
    let count = hashes.hashes.len();
    let all = group.all_gather(&hashes.hashes, timeout)?;
    let differs: Vec<bool> = (0..count)
        .map(|i| all.chunks(count).any(|rank| rank[i] != all[i]))
        .collect();
    if !differs.contains(&true) {
        return Ok(module);
    }
    let mut pack = Pack::new(true, Encoding::Values, Some(differs.clone()));
    module.visit(&mut pack);
    if let Some(detail) = pack.error {
        group.abort(&detail);
        return Err(DdpError::Bucket {
            rank: group.rank(),
            bucket: 0,
            detail: format!("cannot read a buffer as f32 to average it: {detail}"),
        });
    }
    let mut words = pack.words;
    group.all_reduce(&mut words, crate::group::ReduceOp::Avg, timeout)?;
    let mut unpack = Unpack::new(&words, true, Encoding::Values, Some(differs));
    Ok(module.map(&mut unpack))
}

/// Copies `root`'s parameters and buffers into every rank's `module`, bit-exact whatever their
/// dtype (one broadcast of the tensors' bytes, as 4-byte words); every rank must call it. Returns
/// the module with the root's values; on the root it is returned unchanged.
///
/// Call [`ReplicaLayout::verify_across`] first: the broadcast relies on every rank having the same
/// layout.
///
/// # Errors
/// The broadcast's errors ([`DdpError::Timeout`], [`DdpError::PeerLeft`], [`DdpError::Mismatch`]
/// when the ranks' tensors differ in size, ...).
pub fn broadcast_module<B: Backend, M: Module<B>>(
    module: M,
    group: &dyn ProcessGroup,
    root: usize,
    timeout: Duration,
) -> Result<M> {
    broadcast_tensors(module, group, root, timeout, false)
}

/// Copies `root`'s buffers (float tensors without gradients, e.g. BatchNorm running statistics)
/// into every rank's `module`; parameters are left alone. Every rank must call it. This is PyTorch
/// DDP's `broadcast_buffers`.
///
/// # Errors
/// As [`broadcast_module`].
pub fn broadcast_buffers<B: Backend, M: Module<B>>(
    module: M,
    group: &dyn ProcessGroup,
    root: usize,
    timeout: Duration,
) -> Result<M> {
    broadcast_tensors(module, group, root, timeout, true)
}

/// The buffers of `module` (float tensors without gradients), as raw words: what
/// [`restore_buffers`] puts back. Flush `RunningState`'s pending updates first if they must count
/// (`AutodiffModule::valid` does).
pub fn snapshot_buffers<B: Backend, M: Module<B>>(module: &M) -> Vec<f32> {
    let mut pack = Pack::new(true, Encoding::Bytes, None);
    module.visit(&mut pack);
    pack.words
}

/// Writes a [`snapshot_buffers`] snapshot back into `module`'s buffers.
pub fn restore_buffers<B: Backend, M: Module<B>>(module: M, snapshot: &[f32]) -> M {
    let mut unpack = Unpack::new(snapshot, true, Encoding::Bytes, None);
    module.map(&mut unpack)
}

/// One 64-bit FNV-1a hash per float tensor of `module` (parameters and buffers, registration
/// order) over the bits of its values. Two replicas hold bit-identical values exactly when the
/// hashes agree (up to hash collisions).
pub fn tensor_fingerprints<B: Backend, M: Module<B>>(module: &M) -> Vec<u64> {
    let mut hasher = Fingerprints {
        hashes: Vec::new(),
        buffers_only: false,
    };
    module.visit(&mut hasher);
    hasher.hashes
}

/// One hash of all float tensors of `module`: the fingerprints of [`tensor_fingerprints`] combined.
pub fn value_fingerprint<B: Backend, M: Module<B>>(module: &M) -> u64 {
    fnv(tensor_fingerprints(module).into_iter())
}

/// Checks that every rank's `module` holds bit-identical parameters and buffers; every rank must
/// call it. Costs one all-gather of one `u64` when they agree, and one more (one `u64` per
/// tensor) to name the first difference when they do not. `step` only labels the error.
///
/// # Errors
/// [`DdpError::ReplicasDiverged`] on every rank, naming the first tensor (registration order) that
/// differs and the ranks whose values differ from rank 0's; the collectives' errors.
pub fn verify_values_across<B: Backend, M: Module<B>>(
    module: &M,
    group: &dyn ProcessGroup,
    step: u64,
    timeout: Duration,
) -> Result<()> {
    let hashes = tensor_fingerprints(module);
    let combined = fnv(hashes.iter().copied());
    let all = group.all_gather(&[combined], timeout)?;
    if all.iter().all(|&h| h == all[0]) {
        return Ok(());
    }
    let per_rank = group.all_gather(&hashes, timeout)?;
    let count = hashes.len().max(1);
    let ranks: Vec<&[u64]> = per_rank.chunks(count).collect();
    let layout = ReplicaLayout::of(module);
    let (index, diverged) = (0..hashes.len())
        .find_map(|i| {
            let differing: Vec<usize> = (1..ranks.len())
                .filter(|&r| ranks[r][i] != ranks[0][i])
                .collect();
            (!differing.is_empty()).then_some((i, differing))
        })
        .unwrap_or((0, (1..ranks.len()).collect()));
    let tensor = layout
        .tensors()
        .get(index)
        .map(|t| format!("#{index} `{}` ({} of shape {:?})", t.path, t.kind, t.shape))
        .unwrap_or_else(|| format!("#{index}"));
    Err(DdpError::ReplicasDiverged {
        rank: group.rank(),
        step,
        tensor,
        ranks: diverged,
    })
}

fn fnv(words: impl Iterator<Item = u64>) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for word in words {
        for byte in word.to_le_bytes() {
            hash ^= u64::from(byte);
            hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    hash
}

struct Fingerprints {
    hashes: Vec<u64>,
    buffers_only: bool,
}

impl<B: Backend> ModuleVisitor<B> for Fingerprints {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let tensor = param.val();
        if self.buffers_only && tensor.is_require_grad() {
            return;
        }
        let data = tensor.into_data();
        // Hash the raw bytes: exact for every dtype.
        let bytes = data.as_bytes();
        let words = bytes.chunks(8).map(|c| {
            let mut word = [0u8; 8];
            word[..c.len()].copy_from_slice(c);
            u64::from_le_bytes(word)
        });
        self.hashes
            .push(fnv(words.chain(std::iter::once(bytes.len() as u64))));
    }
}
