//! The optimizer's record under sharding: each rank's holds its own parameters' entries; a
//! checkpoint holds every rank's, joined on rank 0 ([`gather_record`]); a run that resumes from a
//! whole record keeps its own share ([`own_record`]), whatever the world size that wrote it.
//!
//! Burn's `OptimizerAdaptor` keeps one entry per parameter (a map from `ParamId` to that
//! parameter's state), and its record's item is a map from `ParamId::serialize` to the entry's
//! item. Records are split and joined at that map, as MessagePack (Burn's own checkpoint format):
//! an entry's bytes are moved, never decoded, so any optimizer whose record is such a map works.
//!
//! A `ParamId` is drawn per process (replicas in separate processes hold the same values under
//! different ids, until a checkpoint's ids are loaded everywhere), so an entry travels under its
//! parameter's position in the model ([`Keys`]) and rank 0 files it under its own id.

use std::time::Duration;

use std::collections::HashMap;

use burn::module::{Module, ModuleVisitor, Param};
use burn::record::{FullPrecisionSettings, Record};
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use serde::Deserialize;

use super::OptimizerShards;
use crate::error::{DdpError, Result};
use burn_ddp_comm::group::{ExtendedCollectives, ProcessGroup};

/// One entry of a record's top-level map: the parameter's key and its value as MessagePack.
type Entry = (String, Vec<u8>);

/// The entries of `record`'s top-level map.
///
/// # Errors
/// [`DdpError::InvalidConfig`] when the record is not a map keyed by parameter (an optimizer
/// that is not Burn's `OptimizerAdaptor` and keeps its state otherwise).
fn entries<B: Backend, R: Record<B>>(record: R) -> Result<Vec<Entry>> {
    split(&encoded(record)?).map_err(not_a_map)
}

fn not_a_map(detail: String) -> DdpError {
    DdpError::InvalidConfig(format!(
        "optimizer sharding needs an optimizer whose record is a map keyed by parameter \
         (Burn's OptimizerAdaptor: Sgd, Adam, AdamW, ...); this optimizer's record is not \
         ({detail}): turn sharding off (DdpConfig::with_optimizer_sharding(false))"
    ))
}

/// The entries of the MessagePack map `bytes`: each key and where its value lies in `bytes`.
fn split_ranges(
    bytes: &[u8],
) -> std::result::Result<Vec<(String, std::ops::Range<usize>)>, String> {
    let mut rest = bytes;
    let len = rmp::decode::read_map_len(&mut rest).map_err(|e| format!("not a map: {e}"))?;
    let mut entries = Vec::with_capacity(len as usize);
    for _ in 0..len {
        let key_len = rmp::decode::read_str_len(&mut rest)
            .map_err(|e| format!("a key that is not a string: {e}"))?
            as usize;
        if rest.len() < key_len {
            return Err("a truncated key".into());
        }
        let key = std::str::from_utf8(&rest[..key_len])
            .map_err(|e| format!("a key that is not UTF-8: {e}"))?
            .to_string();
        rest = &rest[key_len..];
        let start = bytes.len() - rest.len();
        serde::de::IgnoredAny::deserialize(&mut rmp_serde::Deserializer::new(&mut rest))
            .map_err(|e| format!("entry {key}: {e}"))?;
        entries.push((key, start..bytes.len() - rest.len()));
    }
    Ok(entries)
}

/// The entries of the MessagePack map `bytes`.
fn split(bytes: &[u8]) -> std::result::Result<Vec<Entry>, String> {
    Ok(split_ranges(bytes)?
        .into_iter()
        .map(|(key, range)| (key, bytes[range].to_vec()))
        .collect())
}

/// `record` as MessagePack (its item at full precision).
fn encoded<B: Backend, R: Record<B>>(record: R) -> Result<Vec<u8>> {
    let item = record.into_item::<FullPrecisionSettings>();
    rmp_serde::to_vec_named(&item).map_err(|e| not_a_map(e.to_string()))
}

/// The MessagePack map of `entries`.
fn join<'a>(entries: impl ExactSizeIterator<Item = &'a Entry>) -> Vec<u8> {
    let mut out = Vec::new();
    // Writing to a Vec cannot fail.
    let _ = rmp::encode::write_map_len(&mut out, entries.len() as u32);
    for (key, value) in entries {
        let _ = rmp::encode::write_str(&mut out, key);
        out.extend_from_slice(value);
    }
    out
}

/// The record of the MessagePack map `bytes`, on `device`.
fn record_of<B: Backend, R: Record<B>>(bytes: &[u8], device: &B::Device) -> Result<R> {
    let item: R::Item<FullPrecisionSettings> =
        rmp_serde::from_slice(bytes).map_err(|e| not_a_map(e.to_string()))?;
    Ok(R::from_item(item, device))
}

/// The optimizer-record keys of a model's parameters on this rank: `ParamId::serialize` of each
/// float tensor, and back (a shared weight's id maps to its first place).
pub(crate) struct Keys {
    /// The key of each float tensor, registration order.
    of_index: Vec<String>,
    /// The first float tensor of each key.
    index_of: HashMap<String, usize>,
}

impl Keys {
    /// The keys of `module` now.
    pub fn of<B: Backend, M: Module<B>>(module: &M) -> Self {
        struct Ids(Vec<String>);
        impl<B: Backend> ModuleVisitor<B> for Ids {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
                self.0.push(param.id.serialize());
            }
        }
        let mut ids = Ids(Vec::new());
        module.visit(&mut ids);
        let mut index_of = HashMap::new();
        for (index, key) in ids.0.iter().enumerate() {
            index_of.entry(key.clone()).or_insert(index);
        }
        Self {
            of_index: ids.0,
            index_of,
        }
    }
}

/// The entries of `record` this rank keeps: its own parameters', and on rank 0 those of no
/// parameter of the model (kept, not lost).
fn own_entries<B: Backend, R: Record<B>>(
    shards: &OptimizerShards,
    keys: &Keys,
    record: R,
) -> Result<Vec<Entry>> {
    Ok(entries(record)?
        .into_iter()
        .filter(|(key, _)| {
            keys.index_of
                .get(key)
                .and_then(|&index| shards.owner(index))
                .map_or(shards.rank() == 0, |owner| owner == shards.rank())
        })
        .collect())
}

/// `record` with this rank's entries only: what a rank keeps after loading a whole record
/// (a checkpoint written with or without sharding, by any world size). `keys` are the model's
/// now (after the checkpoint's model was loaded: its ids are the record's).
///
/// # Errors
/// As [`gather_record`], without the collectives'.
pub(crate) fn own_record<B: Backend, R: Record<B>>(
    shards: &OptimizerShards,
    keys: &Keys,
    record: R,
    device: &B::Device,
) -> Result<R> {
    let own = own_entries(shards, keys, record)?;
    record_of(&join(own.iter()), device)
}

/// An entry's key on the wire: `#` and its parameter's position, or the key itself for an entry
/// of no parameter of the model.
fn wire_key(keys: &Keys, key: String) -> String {
    match keys.index_of.get(&key) {
        Some(index) => format!("#{index}"),
        None => key,
    }
}

/// A wire key as this rank's key.
fn local_key(keys: &Keys, key: String) -> String {
    key.strip_prefix('#')
        .and_then(|index| index.parse::<usize>().ok())
        .and_then(|index| keys.of_index.get(index).cloned())
        .unwrap_or(key)
}

/// Every rank's share of the optimizer state joined into one record on rank 0 (the others get
/// `None`), for a checkpoint that any world size, with or without sharding, can resume from.
/// `keys` are this rank's model's. Each rank sends its own entries under their parameters'
/// positions (one all-gather of their lengths, one of the bytes, padded to the longest: every
/// rank briefly holds every share in host memory); rank 0 files them under its own ids. Every
/// rank must call it.
///
/// # Errors
/// [`DdpError::InvalidConfig`] when the optimizer's record is not a map keyed by parameter; the
/// collectives' errors.
pub(crate) fn gather_record<B: Backend, R: Record<B>>(
    shards: &OptimizerShards,
    keys: &Keys,
    record: R,
    group: &dyn ProcessGroup,
    timeout: Duration,
    device: &B::Device,
) -> Result<Option<R>> {
    let own: Vec<Entry> = own_entries(shards, keys, record)?
        .into_iter()
        .map(|(key, value)| (wire_key(keys, key), value))
        .collect();
    let bytes = join(own.iter());
    let lengths = group.all_gather(&[bytes.len() as u64], timeout)?;
    let longest = lengths.iter().copied().max().unwrap_or(0) as usize;
    let mut words: Vec<f32> = bytes
        .chunks(4)
        .map(|c| {
            let mut w = [0u8; 4];
            w[..c.len()].copy_from_slice(c);
            f32::from_bits(u32::from_le_bytes(w))
        })
        .collect();
    let block = longest.div_ceil(4);
    words.resize(block, 0.0);
    let mut all = vec![0.0f32; block * group.world_size()];
    group.all_gather_f32(&words, &mut all, timeout)?;
    if group.rank() != 0 {
        return Ok(None);
    }
    let mut whole: Vec<Entry> = Vec::new();
    for (rank, length) in lengths.iter().enumerate() {
        let share: Vec<u8> = all[rank * block..(rank + 1) * block]
            .iter()
            .flat_map(|w| w.to_bits().to_le_bytes())
            .take(*length as usize)
            .collect();
        let entries = split(&share).map_err(|why| DdpError::Checkpoint {
            path: String::new(),
            detail: format!("rank {rank}'s share of the optimizer state is unreadable: {why}"),
        })?;
        whole.extend(
            entries
                .into_iter()
                .map(|(key, value)| (local_key(keys, key), value)),
        );
    }
    whole.sort_by(|a, b| a.0.cmp(&b.0));
    record_of(&join(whole.iter()), device).map(Some)
}

/// `record` itself when it can be split by parameter: a map whose every key is the id of one of
/// the model's parameters (`keys`; an empty map, an optimizer without state yet, passes).
///
/// # Errors
/// [`DdpError::InvalidConfig`] naming `optimizer` (its type) and the first key that is not a
/// parameter's (a wrapper's own fields, a param-groups record of several maps), or saying that
/// the record is not a map.
pub(crate) fn checked_record<B: Backend, R: Record<B>>(
    record: R,
    keys: &Keys,
    optimizer: &str,
    device: &B::Device,
) -> Result<R> {
    let refused = |detail: String| {
        DdpError::InvalidConfig(format!(
            "optimizer sharding splits the optimizer's record by parameter, and the record of \
             {optimizer} is not a map keyed by parameter ({detail}): wrap one of Burn's \
             per-parameter optimizers in burn_ddp::ShardedOptimizer directly, or turn sharding \
             off (DdpConfig::with_optimizer_sharding(false))"
        ))
    };
    let bytes = encoded(record)?;
    if bytes == [rmp::Marker::Null.to_u8()] {
        // A unit record: the optimizer keeps no state that a checkpoint would hold.
        return record_of(&bytes, device);
    }
    let entries = split_ranges(&bytes).map_err(refused)?;
    if let Some((key, _)) = entries
        .iter()
        .find(|(key, _)| !keys.index_of.contains_key(key))
    {
        return Err(refused(format!(
            "its entry `{key}` is no parameter of the model"
        )));
    }
    record_of(&bytes, device)
}

/// Bytes of optimizer state in `record`: the sizes of its entries' values in MessagePack at full
/// precision (the tensors' bytes and a few of their shapes' and counters'). Reads the record into
/// host memory once, and its encoding once more: for reports, not for every step.
///
/// # Errors
/// [`DdpError::InvalidConfig`] when the record is not a map keyed by parameter.
pub fn optimizer_state_bytes<B: Backend, R: Record<B>>(record: R) -> Result<u64> {
    let bytes = encoded(record)?;
    Ok(split_ranges(&bytes)
        .map_err(not_a_map)?
        .iter()
        .map(|(_, range)| range.len() as u64)
        .sum())
}

#[cfg(test)]
mod tests {
    use burn::backend::{Autodiff, NdArray};
    use burn::module::Module;
    use burn::nn::{Linear, LinearConfig};
    use burn::optim::{AdamConfig, GradientsParams, Optimizer};
    use burn::tensor::Tensor;

    use super::*;
    use crate::replica::ReplicaLayout;
    use burn_ddp_comm::group::ThreadGroup;

    type B = Autodiff<NdArray>;

    #[derive(Module, Debug)]
    struct Net<B: Backend> {
        a: Linear<B>,
        b: Linear<B>,
    }

    /// The record of Burn's Adam on [`Net`].
    type AdamRecord =
        <burn::optim::adaptor::OptimizerAdaptor<burn::optim::Adam, Net<B>, B> as Optimizer<
            Net<B>,
            B,
        >>::Record;

    fn adam_after_one_step() -> (Net<B>, AdamRecord) {
        let device = Default::default();
        let net = Net {
            a: LinearConfig::new(4, 3).init::<B>(&device),
            b: LinearConfig::new(3, 2).init::<B>(&device),
        };
        let y = net
            .b
            .forward(net.a.forward(Tensor::<B, 2>::ones([2, 4], &device)))
            .sum();
        let grads = GradientsParams::from_grads(y.backward(), &net);
        let mut optim = AdamConfig::new().init::<B, Net<B>>();
        let net = optim.step(1e-2, net, grads);
        (net, optim.to_record())
    }

    fn keys<R: Record<B> + Clone>(record: &R) -> Vec<String> {
        let mut keys: Vec<String> = entries::<B, _>(record.clone())
            .unwrap()
            .into_iter()
            .map(|(k, _)| k)
            .collect();
        keys.sort();
        keys
    }

    /// `record`'s entries by key.
    fn by_key<R: Record<B>>(record: R) -> HashMap<String, Vec<u8>> {
        entries::<B, _>(record).unwrap().into_iter().collect()
    }

    #[test]
    fn shares_kept_per_rank_join_back_into_the_whole_record() {
        let (net, record) = adam_after_one_step();
        let layout = ReplicaLayout::of(&net);
        let keys = Keys::of(&net);
        let whole_keys = self::keys(&record);
        assert_eq!(whole_keys.len(), 4);
        let whole_bytes = optimizer_state_bytes::<B, _>(record.clone()).unwrap();
        let device = Default::default();
        // Each rank keeps its own entries only, and their bytes add up to the whole.
        let mut bytes = 0;
        for rank in 0..2 {
            let shards = OptimizerShards::new(&layout, rank, 2);
            let own = own_record::<B, _>(&shards, &keys, record.clone(), &device).unwrap();
            bytes += optimizer_state_bytes::<B, _>(own.clone()).unwrap();
            for key in self::keys(&own) {
                assert_eq!(shards.owner(keys.index_of[&key]), Some(rank));
            }
        }
        assert_eq!(bytes, whole_bytes);
    }

    #[test]
    fn shares_under_other_ids_are_filed_under_rank_0s_ids_by_position() {
        // Two processes: the same model under ids each process drew for itself.
        let (net0, record0) = adam_after_one_step();
        let (net1, record1) = adam_after_one_step();
        let (keys0, keys1) = (Keys::of(&net0), Keys::of(&net1));
        assert!(
            keys0
                .of_index
                .iter()
                .all(|k| !keys1.index_of.contains_key(k))
        );
        let layout = ReplicaLayout::of(&net0);
        let groups = ThreadGroup::new_group(2).unwrap();
        let gathered: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = groups
                .into_iter()
                .zip([(&keys0, record0.clone()), (&keys1, record1.clone())])
                .enumerate()
                .map(|(rank, (group, (keys, record)))| {
                    let layout = layout.clone();
                    s.spawn(move || {
                        let shards = OptimizerShards::new(&layout, rank, 2);
                        gather_record::<B, _>(
                            &shards,
                            keys,
                            record,
                            &group,
                            Duration::from_secs(20),
                            &Default::default(),
                        )
                        .unwrap()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(gathered[1].is_none());
        let whole = by_key(gathered[0].clone().unwrap());
        let (entries0, entries1) = (by_key(record0), by_key(record1));
        let shards = OptimizerShards::new(&layout, 0, 2);
        assert_eq!(
            whole.len(),
            4,
            "every parameter's state, under rank 0's ids"
        );
        for (index, key0) in keys0.of_index.iter().enumerate() {
            let expected = match shards.owner(index) {
                Some(0) => &entries0[key0],
                _ => &entries1[&keys1.of_index[index]],
            };
            assert_eq!(&whole[key0], expected, "tensor {index}: its owner's state");
        }
    }

    #[test]
    fn a_record_that_is_not_a_map_by_parameter_is_refused_naming_the_setting() {
        let err = optimizer_state_bytes::<B, _>(()).unwrap_err();
        assert!(err.to_string().contains("with_optimizer_sharding"), "{err}");
    }
}
