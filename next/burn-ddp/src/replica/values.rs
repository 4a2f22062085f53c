//! Moving a replica's values: packing its tensors into `f32` words and back, the broadcasts
//! and averages that keep replicas identical (parameters, frozen weights, buffers), snapshots
//! of buffers, and value fingerprints with the cross-rank check. The layout these walk (which
//! tensors, of which kind) is in the parent module.

use std::any::Any;
use std::collections::HashMap;
use std::time::Duration;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::{Tensor, TensorData};

use super::ties::{NO_TIES, Ties};
use super::*;
use crate::error::{DdpError, Result};
use burn_ddp_comm::group::ProcessGroup;

/// How [`Pack`] turns tensors into the `f32` words a collective moves.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Encoding {
    /// The tensor's raw bytes in 4-byte words, each tensor padded to a whole word: exact for
    /// every dtype, for broadcasts (which only copy the words).
    Bytes,
    /// The tensor's values converted to `f32`: for all-reduces, which do arithmetic.
    Values,
}

/// Which float tensors (registration order) an operation touches: `None`, all of them.
type Selection<'a> = Option<&'a [bool]>;

fn selected(select: Selection<'_>, index: usize) -> bool {
    select.is_none_or(|select| select.get(index).copied().unwrap_or(false))
}

/// Packs the selected float tensors in registration order into `f32` words.
struct Pack<'a> {
    words: Vec<f32>,
    encoding: Encoding,
    select: Selection<'a>,
    visited: usize,
    error: Option<String>,
}

impl<'a> Pack<'a> {
    fn new(encoding: Encoding, select: Selection<'a>) -> Self {
        Self {
            words: Vec::new(),
            encoding,
            select,
            visited: 0,
            error: None,
        }
    }
}

impl ModuleVisitor for Pack<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let index = self.visited;
        self.visited += 1;
        if !selected(self.select, index) {
            return;
        }
        let data = param.val().into_data();
        match self.encoding {
            Encoding::Bytes => {
                let bytes = data.as_bytes();
                let whole = bytes.len() / 4 * 4;
                // Whole words in one copy when the bytes are aligned (they are for every
                // backend's f32 storage), else word by word.
                match bytemuck::try_cast_slice::<u8, f32>(&bytes[..whole]) {
                    Ok(words) => self.words.extend_from_slice(words),
                    Err(_) => self.words.extend(
                        bytes[..whole]
                            .chunks_exact(4)
                            .map(|c| f32::from_bits(bytemuck::pod_read_unaligned(c))),
                    ),
                }
                if whole < bytes.len() {
                    let mut word = [0u8; 4];
                    word[..bytes.len() - whole].copy_from_slice(&bytes[whole..]);
                    self.words.push(f32::from_bits(u32::from_ne_bytes(word)));
                }
            }
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

/// Replaces the selected float tensors by the next words of `words` (as packed by [`Pack`] with
/// the same encoding and selection), keeping shape, device, dtype and whether it requires
/// gradients.
/// A place that shares an earlier place's tensor ([`Ties`]) gets the tensor written there, so the
/// tie survives (its words are still consumed: the sender packs every place).
struct Unpack<'a> {
    words: &'a [f32],
    offset: usize,
    encoding: Encoding,
    select: Selection<'a>,
    visited: usize,
    ties: &'a Ties,
    /// The tensors written at places that a later place shares (a `Tensor<D>`, boxed).
    written: HashMap<usize, Box<dyn Any>>,
}

impl<'a> Unpack<'a> {
    fn new(words: &'a [f32], encoding: Encoding, select: Selection<'a>, ties: &'a Ties) -> Self {
        Self {
            words,
            offset: 0,
            encoding,
            select,
            visited: 0,
            ties,
            written: HashMap::new(),
        }
    }
}

impl ModuleMapper for Unpack<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let index = self.visited;
        self.visited += 1;
        if !selected(self.select, index) {
            return param;
        }
        let (id, tensor, mapper) = param.consume();
        let shape = tensor.shape();
        let dtype = tensor.dtype();
        let numel = shape.num_elements();
        let data = match self.encoding {
            Encoding::Bytes => {
                let len = numel * dtype.size();
                let words = len.div_ceil(4);
                // One copy of the words' bytes (native order, as `Pack` read them).
                let mut bytes: Vec<u8> =
                    bytemuck::cast_slice::<f32, u8>(&self.words[self.offset..self.offset + words])
                        .to_vec();
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
        if let Some(earlier) = self.ties.of_place(index)
            && let Some(shared) = self
                .written
                .get(&earlier)
                .and_then(|t| t.downcast_ref::<Tensor<D>>())
        {
            return Param::from_mapped_value(id, shared.clone(), mapper);
        }
        let mut value = Tensor::<D>::from_data(data, &tensor.device());
        if tensor.is_require_grad() {
            value = value.require_grad();
        }
        if self.ties.any() {
            self.written.insert(index, Box::new(value.clone()));
        }
        Param::from_mapped_value(id, value, mapper)
    }
}

/// Broadcasts the selected tensors of `module` from `root` and writes them into the other
/// ranks' modules.
fn broadcast_tensors<M: Module>(
    module: M,
    group: &dyn ProcessGroup,
    root: usize,
    timeout: Duration,
    select: Selection<'_>,
    ties: &Ties,
) -> Result<M> {
    let mut pack = Pack::new(Encoding::Bytes, select);
    module.visit(&mut pack);
    let mut words = pack.words;
    group.broadcast(&mut words, root, timeout)?;
    if group.rank() == root {
        return Ok(module);
    }
    let mut unpack = Unpack::new(&words, Encoding::Bytes, select, ties);
    Ok(module.map(&mut unpack))
}

/// Replaces the tensors `select` marks (registration order; buffers, the state the forward pass
/// updates, e.g. BatchNorm's running statistics) that differ between ranks by their average over
/// the ranks; every rank must call it. For BatchNorm's running statistics this is the average of the
/// replicas' statistics, which is what Burn's `RunningState` computes for replicas that are
/// threads sharing one module. Buffers already identical on every rank are left alone: averaging
/// N equal values can change their last bit. Costs one all-gather of one `u64` per buffer, and
/// one all-reduce of the differing buffers as `f32`. Flush `RunningState`'s pending updates first
/// (`Module::valid` does).
///
/// # Errors
/// The collectives' errors; [`DdpError::Bucket`] when a buffer cannot be read as `f32`.
pub(crate) fn average_selected<M: Module>(
    module: M,
    group: &dyn ProcessGroup,
    timeout: Duration,
    select: &[bool],
) -> Result<M> {
    if !select.contains(&true) {
        // Every rank has the same layout, so every rank skips the collectives together.
        return Ok(module);
    }
    let mut hashes = Fingerprints {
        hashes: Vec::new(),
        select: Some(select),
        visited: 0,
    };
    module.visit(&mut hashes);
    let count = hashes.hashes.len();
    let all = group.all_gather(&hashes.hashes, timeout)?;
    let differs: Vec<bool> = (0..count)
        .map(|i| all.chunks(count).any(|rank| rank[i] != all[i]))
        .collect();
    if !differs.contains(&true) {
        return Ok(module);
    }
    // The selection among all tensors: selected and differing.
    let mut differing = differs.into_iter();
    let chosen: Vec<bool> = select
        .iter()
        .map(|&s| s && differing.next().unwrap_or(false))
        .collect();
    let mut pack = Pack::new(Encoding::Values, Some(&chosen));
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
    group.all_reduce(&mut words, burn_ddp_comm::group::ReduceOp::Avg, timeout)?;
    let mut unpack = Unpack::new(&words, Encoding::Values, Some(&chosen), &NO_TIES);
    Ok(module.map(&mut unpack))
}

/// Copies `root`'s parameters and buffers into every rank's `module`, bit-exact whatever their
/// dtype (one broadcast of the tensors' bytes, as 4-byte words), keeping its shared weights
/// shared: a place that holds the same tensor (autodiff node) as an earlier one on this rank gets
/// the same new tensor, so autodiff still adds the gradients of both uses, as on rank 0. Every
/// rank must call it; on the root the module is returned unchanged. Call
/// [`ReplicaLayout::verify_across`] first: the broadcast relies on every rank having the same
/// layout.
///
/// # Errors
/// The broadcast's errors ([`CommError::Timeout`](crate::comm::CommError::Timeout),
/// [`CommError::PeerLeft`](crate::comm::CommError::PeerLeft),
/// [`CommError::Mismatch`](crate::comm::CommError::Mismatch) when the ranks' tensors differ in
/// size, ...).
pub(crate) fn broadcast_autodiff_module<M: Module>(
    module: M,
    group: &dyn ProcessGroup,
    root: usize,
    timeout: Duration,
) -> Result<M> {
    let ties = if group.rank() == root {
        Ties::none()
    } else {
        Ties::of(&module)
    };
    broadcast_tensors(module, group, root, timeout, None, &ties)
}

/// Copies `root`'s tensors that `select` marks (registration order; buffers for PyTorch DDP's
/// `broadcast_buffers`) into every rank's `module`; the others are left alone. Every rank must
/// call it.
///
/// # Errors
/// As [`broadcast_autodiff_module`].
pub(crate) fn broadcast_selected<M: Module>(
    module: M,
    group: &dyn ProcessGroup,
    root: usize,
    timeout: Duration,
    select: &[bool],
) -> Result<M> {
    if !select.contains(&true) {
        return Ok(module);
    }
    broadcast_tensors(module, group, root, timeout, Some(select), &Ties::none())
}

/// The tensors of `module` that `select` marks (registration order), as raw words: what
/// [`restore_selected`] puts back. Flush `RunningState`'s pending updates first if they must
/// count (`Module::valid` does).
pub(crate) fn snapshot_selected<M: Module>(module: &M, select: &[bool]) -> Vec<f32> {
    snapshot_selected_into(module, select, Vec::new())
}

/// [`snapshot_selected`] into `words` (cleared first; its allocation is reused).
pub(crate) fn snapshot_selected_into<M: Module>(
    module: &M,
    select: &[bool],
    mut words: Vec<f32>,
) -> Vec<f32> {
    words.clear();
    let mut pack = Pack::new(Encoding::Bytes, Some(select));
    pack.words = words;
    module.visit(&mut pack);
    pack.words
}

/// Writes a [`snapshot_selected`] snapshot back into `module`.
pub(crate) fn restore_selected<M: Module>(module: M, snapshot: &[f32], select: &[bool]) -> M {
    let mut unpack = Unpack::new(snapshot, Encoding::Bytes, Some(select), &NO_TIES);
    module.map(&mut unpack)
}

/// One 64-bit FNV-1a hash per float tensor of `module` (parameters and buffers, registration
/// order) over the bits of its values. Two replicas hold bit-identical values exactly when the
/// hashes agree (up to hash collisions).
pub fn tensor_fingerprints<M: Module>(module: &M) -> Vec<u64> {
    let mut hasher = Fingerprints {
        hashes: Vec::new(),
        select: None,
        visited: 0,
    };
    module.visit(&mut hasher);
    hasher.hashes
}

/// The [`tensor_fingerprints`] entry of the float tensor at registration index `index` alone
/// (reads that tensor only).
pub(crate) fn fingerprint_of<M: Module>(module: &M, index: usize) -> Option<u64> {
    let mut select = vec![false; index + 1];
    select[index] = true;
    let mut hasher = Fingerprints {
        hashes: Vec::new(),
        select: Some(&select),
        visited: 0,
    };
    module.visit(&mut hasher);
    hasher.hashes.first().copied()
}

/// One hash of all float tensors of `module` (parameters and buffers, registration order): a
/// 64-bit FNV-1a hash per tensor over the bits of its values, combined. Two replicas hold
/// bit-identical values exactly when the hashes agree (up to hash collisions).
pub fn value_fingerprint<M: Module>(module: &M) -> u64 {
    fnv(tensor_fingerprints(module).into_iter())
}

/// Checks that every rank's `module` holds bit-identical parameters and buffers; every rank must
/// call it. Costs one all-gather of one `u64` when they agree, and one more (one `u64` per
/// tensor) to name the first difference when they do not. `step` only labels the error.
///
/// # Errors
/// [`DdpError::ReplicasDiverged`] on every rank, naming the first tensor (registration order) that
/// differs and the ranks whose values differ from rank 0's; the collectives' errors.
pub fn verify_values_across<M: Module>(
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
    let layout = ReplicaLayout::scan(module);
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

pub(crate) fn fnv(words: impl Iterator<Item = u64>) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for word in words {
        for byte in word.to_le_bytes() {
            hash ^= u64::from(byte);
            hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    hash
}

struct Fingerprints<'a> {
    hashes: Vec<u64>,
    select: Selection<'a>,
    visited: usize,
}

impl ModuleVisitor for Fingerprints<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let index = self.visited;
        self.visited += 1;
        if !selected(self.select, index) {
            return;
        }
        let data = param.val().into_data();
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
