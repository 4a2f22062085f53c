//! The optimizer's record under sharding: each rank's holds its own parameters' entries; a
//! checkpoint holds every rank's, joined on rank 0 ([`gather_record`]); a run that resumes from a
//! whole record keeps its own share ([`own_record`]), whatever the world size that wrote it.
//!
//! Burn 0.22's `OptimizerRecord` is a burnpack container keyed per parameter: every tensor is
//! named `"{param_id}.{field}"` (and carries the id), every scalar is keyed `"{param_id}.{field}"`
//! (`"{param_id}.__rank"` among them), and the metadata maps `"{param_id}"` to the parameter's
//! path (`burn-optim-0.22.1/src/optim/module/{module_optimizer.rs, record/mod.rs}`). Records are
//! split and joined at those keys with Burn's own burnpack reader and writer: an entry's bytes
//! are moved, never decoded, so every optimizer a `ModuleOptimizer` holds (groups included) works.
//!
//! A `ParamId` is drawn per process (replicas in separate processes hold the same values under
//! different ids, until a checkpoint's ids are loaded everywhere), so a rank files its entries
//! under rank 0's ids of the same places ([`Keys`]) before they travel.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::OptimizerRecord;
use burn::tensor::{Bytes, Tensor};
use burn_pack::{Reader, Scalar, Writer};

use super::OptimizerShards;
use crate::error::{DdpError, Result};
use burn_ddp_comm::group::{ExtendedCollectives, ProcessGroup};

/// The optimizer-record keys of a model's parameters on this rank: the `ParamId` of each float
/// tensor, and back (a shared weight's id maps to its first place).
pub(crate) struct Keys {
    /// The id of each float tensor, registration order.
    of_index: Vec<u64>,
    /// The first float tensor of each id.
    index_of: HashMap<u64, usize>,
}

impl Keys {
    /// The keys of `module` now.
    pub fn of<M: Module>(module: &M) -> Self {
        struct Ids(Vec<u64>);
        impl ModuleVisitor for Ids {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                self.0.push(param.id.val());
            }
        }
        let mut ids = Ids(Vec::new());
        module.visit(&mut ids);
        let mut index_of = HashMap::new();
        for (index, id) in ids.0.iter().enumerate() {
            index_of.entry(*id).or_insert(index);
        }
        Self {
            of_index: ids.0,
            index_of,
        }
    }

    /// Whether `rank` keeps the entries of parameter `id`: their owner does; an entry of no
    /// parameter of the model stays on rank 0 (kept, not lost).
    fn kept_by(&self, shards: &OptimizerShards, id: u64, rank: usize) -> bool {
        self.index_of
            .get(&id)
            .and_then(|&index| shards.owner(index))
            .map_or(rank == 0, |owner| owner == rank)
    }
}

/// An optimizer record taken apart: its tensors, scalars and paths, each under the parameter id
/// its key starts with.
#[derive(Default)]
struct Entries {
    tensors: Vec<burn_pack::Tensor>,
    scalars: BTreeMap<String, Scalar>,
    paths: BTreeMap<String, String>,
}

/// The parameter id a record key starts with (`"{param_id}"` or `"{param_id}.{field}"`).
fn id_of(key: &str) -> Option<u64> {
    key.split('.').next().and_then(|id| id.parse().ok())
}

/// `key` filed under `id` instead of the id it starts with.
fn renamed(key: &str, id: u64) -> String {
    match key.split_once('.') {
        Some((_, field)) => format!("{id}.{field}"),
        None => id.to_string(),
    }
}

fn unreadable(what: &str, err: impl std::fmt::Display) -> DdpError {
    DdpError::Checkpoint {
        path: String::new(),
        detail: format!("{what} is not a readable optimizer record (burnpack): {err}"),
    }
}

impl Entries {
    /// The entries of `bytes` (a burnpack `OptimizerRecord`).
    fn read(bytes: Bytes, what: &str) -> Result<Self> {
        let reader = Reader::from_bytes(bytes).map_err(|e| unreadable(what, e))?;
        let scalars = reader.scalars().clone();
        let paths = reader.metadata().clone();
        let tensors = reader.into_tensors().map_err(|e| unreadable(what, e))?;
        Ok(Self {
            tensors,
            scalars,
            paths,
        })
    }

    /// The entries of `record`.
    fn of(record: OptimizerRecord, what: &str) -> Result<Self> {
        Self::read(record.into_bytes().map_err(|e| unreadable(what, e))?, what)
    }

    /// The burnpack bytes of these entries.
    fn bytes(self) -> Result<Bytes> {
        let mut writer = Writer::new(self.tensors);
        for (key, value) in &self.scalars {
            writer = writer.with_scalar(key, *value);
        }
        for (key, value) in &self.paths {
            writer = writer.with_metadata(key, value);
        }
        writer
            .into_bytes()
            .map_err(|e| unreadable("the joined optimizer state", e))
    }

    /// These entries as a record.
    fn record(self) -> Result<OptimizerRecord> {
        OptimizerRecord::from_bytes(self.bytes()?)
            .map_err(|e| unreadable("the joined optimizer state", e))
    }

    /// Keeps the entries whose parameter id `keep` accepts (`None`: a key of no id).
    fn retain(&mut self, keep: impl Fn(Option<u64>) -> bool) {
        self.tensors.retain(|t| keep(t.param_id.or(id_of(&t.name))));
        self.scalars.retain(|key, _| keep(id_of(key)));
        self.paths.retain(|key, _| keep(id_of(key)));
    }

    /// Files every entry of id `from` under `to(from)` (an id `to` maps to `None` keeps its key).
    fn rekey(&mut self, to: impl Fn(u64) -> Option<u64>) {
        let target = |key: &str| id_of(key).and_then(&to);
        for tensor in &mut self.tensors {
            if let Some(id) = tensor.param_id.or(id_of(&tensor.name)).and_then(&to) {
                tensor.name = renamed(&tensor.name, id);
                tensor.param_id = Some(id);
            }
        }
        fn moved<V>(
            map: BTreeMap<String, V>,
            target: impl Fn(&str) -> Option<u64>,
        ) -> BTreeMap<String, V> {
            map.into_iter()
                .map(|(key, value)| match target(&key) {
                    Some(id) => (renamed(&key, id), value),
                    None => (key, value),
                })
                .collect()
        }
        self.scalars = moved(std::mem::take(&mut self.scalars), target);
        self.paths = moved(std::mem::take(&mut self.paths), target);
    }

    /// Adds `other`'s entries (their keys are disjoint: each parameter has one owner).
    fn extend(&mut self, other: Self) {
        self.tensors.extend(other.tensors);
        self.scalars.extend(other.scalars);
        self.paths.extend(other.paths);
    }
}

/// `record` with this rank's entries only: what a rank keeps after loading a whole record
/// (a checkpoint written with or without sharding, by any world size). `keys` are the model's
/// now (after the checkpoint's model was loaded: its ids are the record's).
///
/// # Errors
/// [`DdpError::Checkpoint`] when the record cannot be read or written back as burnpack.
pub(crate) fn own_record(
    shards: &OptimizerShards,
    keys: &Keys,
    record: OptimizerRecord,
) -> Result<OptimizerRecord> {
    let mut entries = Entries::of(record, "the optimizer state")?;
    let rank = shards.rank();
    entries.retain(|id| id.map_or(rank == 0, |id| keys.kept_by(shards, id, rank)));
    entries.record()
}

/// Every rank's share of the optimizer state joined into one record on rank 0 (the others get
/// `None`), for a checkpoint that any world size, with or without sharding, can resume from.
/// `keys` are this rank's model's. Each rank files its own entries under rank 0's ids (one
/// all-gather of the ids), then sends them as burnpack bytes (one all-gather of their lengths,
/// one of the bytes, padded to the longest: every rank briefly holds every share in host
/// memory). Every rank must call it.
///
/// # Errors
/// [`DdpError::Checkpoint`] when a share cannot be read or written as burnpack (this rank's
/// aborts the group); the collectives' errors.
pub(crate) fn gather_record(
    shards: &OptimizerShards,
    keys: &Keys,
    record: OptimizerRecord,
    group: &dyn ProcessGroup,
    timeout: Duration,
) -> Result<Option<OptimizerRecord>> {
    let (rank, world_size) = (group.rank(), group.world_size());
    // The ranks' models have one layout (agreed when the wrapper was built), so the id lists
    // have one length; a different one is the all-gather's `CommError::Mismatch`.
    let ids = group.all_gather(&keys.of_index, timeout)?;
    let rank0 = &ids[..keys.of_index.len().min(ids.len())];
    let share = Entries::of(record, "this rank's optimizer state").and_then(|mut own| {
        own.retain(|id| id.map_or(rank == 0, |id| keys.kept_by(shards, id, rank)));
        own.rekey(|id| {
            keys.index_of
                .get(&id)
                .and_then(|&index| rank0.get(index).copied())
        });
        own.bytes()
    });
    let bytes = match share {
        Ok(bytes) => bytes,
        Err(err) => {
            // The others are about to wait for this rank's share: they fail now, with the cause.
            group.abort(&err.to_string());
            return Err(err);
        }
    };
    let lengths = group.all_gather(&[bytes.len() as u64], timeout)?;
    let longest = lengths.iter().copied().max().unwrap_or(0) as usize;
    let block = longest.div_ceil(4);
    let mut words: Vec<f32> = bytes
        .chunks(4)
        .map(|c| {
            let mut w = [0u8; 4];
            w[..c.len()].copy_from_slice(c);
            f32::from_bits(u32::from_le_bytes(w))
        })
        .collect();
    words.resize(block, 0.0);
    let mut all = vec![0.0f32; block * world_size];
    group.all_gather_f32(&words, &mut all, timeout)?;
    if rank != 0 {
        return Ok(None);
    }
    let mut whole = Entries::default();
    for (peer, length) in lengths.iter().enumerate() {
        let share: Vec<u8> = all[peer * block..(peer + 1) * block]
            .iter()
            .flat_map(|w| w.to_bits().to_le_bytes())
            .take(*length as usize)
            .collect();
        whole.extend(Entries::read(
            Bytes::from_bytes_vec(share),
            &format!("rank {peer}'s share of the optimizer state"),
        )?);
    }
    whole.record().map(Some)
}

/// Bytes of optimizer state in `record`: its tensors' bytes (the scalars, a few per parameter,
/// not counted). Writes the record into host memory once: for reports, not for every step.
///
/// # Errors
/// [`DdpError::Checkpoint`] when the record cannot be read as burnpack.
pub fn optimizer_state_bytes(record: OptimizerRecord) -> Result<u64> {
    let entries = Entries::of(record, "the optimizer state")?;
    Ok(entries.tensors.iter().map(|t| t.byte_len() as u64).sum())
}

#[cfg(test)]
mod tests {
    use burn::module::Module;
    use burn::nn::{Linear, LinearConfig};
    use burn::optim::{AdamConfig, GradientsParams, ModuleOptimizer};
    use burn::tensor::Tensor;

    use super::*;
    use crate::replica::ReplicaLayout;
    use crate::replica::tests::test_device;
    use burn_ddp_comm::group::ThreadGroup;

    #[derive(Module, Debug)]
    struct Net {
        a: Linear,
        b: Linear,
    }

    fn adam_after_one_step() -> (Net, OptimizerRecord) {
        let device = test_device();
        let net = Net {
            a: LinearConfig::new(4, 3).init(&device),
            b: LinearConfig::new(3, 2).init(&device),
        };
        let y = net
            .b
            .forward(net.a.forward(Tensor::<2>::ones([2, 4], &device)))
            .sum();
        let grads = GradientsParams::from_grads(y.backward(), &net);
        let mut optim: ModuleOptimizer = AdamConfig::new().init();
        let net = optim.step(1e-2, net, grads);
        (net, optim.to_record())
    }

    /// `record`'s tensors by name, as bytes, and its scalars by key; each tensor's parameter id
    /// is the one its name starts with, and each parameter keeps its path.
    fn contents(record: OptimizerRecord) -> (BTreeMap<String, Vec<u8>>, BTreeMap<String, Scalar>) {
        let entries = Entries::of(record, "a test record").unwrap();
        let mut with_path: Vec<u64> = entries.paths.keys().map(|k| id_of(k).unwrap()).collect();
        let mut with_state: Vec<u64> = Vec::new();
        let tensors = entries
            .tensors
            .into_iter()
            .map(|t| {
                assert_eq!(t.param_id, id_of(&t.name), "{}", t.name);
                with_state.extend(t.param_id);
                (t.name.clone(), t.into_bytes().unwrap().to_vec())
            })
            .collect();
        with_path.sort();
        with_state.sort();
        with_state.dedup();
        assert_eq!(
            with_path, with_state,
            "every parameter with state has its path"
        );
        (tensors, entries.scalars)
    }

    /// The parameter ids of `record`'s tensors and scalars.
    fn ids(record: OptimizerRecord) -> Vec<u64> {
        let (tensors, scalars) = contents(record);
        let mut ids: Vec<u64> = tensors
            .keys()
            .chain(scalars.keys())
            .map(|k| id_of(k).unwrap())
            .collect();
        ids.sort();
        ids.dedup();
        ids
    }

    /// A copy of the record whose burnpack bytes are `bytes`.
    fn again(bytes: &Bytes) -> OptimizerRecord {
        OptimizerRecord::from_bytes(bytes.clone()).unwrap()
    }

    #[test]
    fn shares_kept_per_rank_join_back_into_the_whole_record() {
        let (net, record) = adam_after_one_step();
        let layout = ReplicaLayout::of(&net);
        let keys = Keys::of(&net);
        let bytes = record.into_bytes().unwrap();
        let (whole_tensors, whole_scalars) = contents(again(&bytes));
        // Adam's two moments of each of the 4 parameters.
        assert_eq!(whole_tensors.len(), 8, "{:?}", whole_tensors.keys());
        assert_eq!(ids(again(&bytes)).len(), 4);
        let whole_bytes = optimizer_state_bytes(again(&bytes)).unwrap();
        assert!(whole_bytes > 0);
        // Each rank keeps its own entries only, and together they are the whole.
        let (mut tensors, mut scalars, mut state_bytes) = (BTreeMap::new(), BTreeMap::new(), 0);
        for rank in 0..2 {
            let shards = OptimizerShards::new(&layout, rank, 2);
            let own = own_record(&shards, &keys, again(&bytes)).unwrap();
            let own_bytes = own.into_bytes().unwrap();
            state_bytes += optimizer_state_bytes(again(&own_bytes)).unwrap();
            for id in ids(again(&own_bytes)) {
                assert_eq!(shards.owner(keys.index_of[&id]), Some(rank), "rank {rank}");
            }
            let (t, s) = contents(again(&own_bytes));
            tensors.extend(t);
            scalars.extend(s);
        }
        assert_eq!(tensors, whole_tensors);
        assert_eq!(scalars, whole_scalars);
        assert_eq!(state_bytes, whole_bytes);
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
        let (bytes0, bytes1) = (record0.into_bytes().unwrap(), record1.into_bytes().unwrap());
        let layout = ReplicaLayout::of(&net0);
        let groups = ThreadGroup::new_group(2).unwrap();
        let gathered: Vec<Option<OptimizerRecord>> = std::thread::scope(|s| {
            let handles: Vec<_> = groups
                .into_iter()
                .zip([(&keys0, again(&bytes0)), (&keys1, again(&bytes1))])
                .enumerate()
                .map(|(rank, (group, (keys, record)))| {
                    let layout = layout.clone();
                    s.spawn(move || {
                        let shards = OptimizerShards::new(&layout, rank, 2);
                        gather_record(&shards, keys, record, &group, Duration::from_secs(20))
                            .unwrap()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let mut gathered = gathered.into_iter();
        let whole = gathered
            .next()
            .flatten()
            .expect("rank 0 gets the whole record");
        assert!(gathered.next().flatten().is_none(), "rank 1 gets none");
        let (whole, whole_scalars) = contents(whole);
        let ((tensors0, scalars0), (tensors1, scalars1)) =
            (contents(again(&bytes0)), contents(again(&bytes1)));
        assert_eq!(
            whole.len(),
            8,
            "every parameter's state, under rank 0's ids"
        );
        let shards = OptimizerShards::new(&layout, 0, 2);
        for (name, value) in &whole {
            let index = keys0.index_of[&id_of(name).unwrap()];
            let expected = match shards.owner(index) {
                Some(0) => &tensors0[name],
                _ => &tensors1[&renamed(name, keys1.of_index[index])],
            };
            assert_eq!(value, expected, "{name}: its owner's state");
        }
        for (key, value) in &whole_scalars {
            let index = keys0.index_of[&id_of(key).unwrap()];
            let expected = match shards.owner(index) {
                Some(0) => scalars0[key],
                _ => scalars1[&renamed(key, keys1.of_index[index])],
            };
            assert_eq!(*value, expected, "{key}: its owner's scalar");
        }
    }

    #[test]
    fn an_unreadable_record_is_an_error_naming_it() {
        let err = Entries::read(Bytes::from_bytes_vec(vec![1, 2, 3]), "rank 1's share")
            .err()
            .expect("three bytes are no burnpack");
        assert!(err.to_string().contains("rank 1's share"), "{err}");
    }
}
