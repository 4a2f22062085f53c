//! The updated parameters of a sharded step handed between thread replicas on one device by
//! reference: each rank shares the tensors it owns and stepped
//! ([`all_gather_shared`](burn_ddp_comm::group::ExtendedCollectives::all_gather_shared)) and takes the
//! others' as they are, with no copy through host memory. Each taken tensor becomes a fresh leaf
//! of this replica's autodiff graph (the tensor without autodiff, shared; a new node of its own),
//! with the parameter's id, whether it requires gradients, its gradient-checkpointing strategy
//! and whether it is distributed. Every place takes its owner's
//! tensor of that place: a weight reachable from two places is stepped at its first place only
//! by Burn's optimizer (the gradient is taken there), so its places may differ after a step on
//! one device too, and the replicas take them as the owner has them.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::{Device, Tensor};

use crate::error::{DdpError, Result};
use burn_ddp_comm::group::{ExtendedCollectives, ProcessGroup, SharedValue};

/// One rank's stepped parameters, shared.
struct Stepped {
    /// The device of the rank's replica (its first float tensor's).
    device: Option<Device>,
    /// Per float place this rank owns and stepped (registration index): the new value
    /// (without autodiff), flattened.
    tensors: Vec<(usize, Tensor<1>)>,
}

/// Shares this rank's tensors of `select` (registration order) with every rank and writes the
/// others' (`owners`, per place) into `module`. Returns `None`, with the module untouched, when
/// the ranks cannot share them (not threads of one process, or on different devices: every rank
/// finds the same), so the caller gathers through host memory instead.
///
/// # Errors
/// The exchange's; [`DdpError::InvalidConfig`] when a rank shared another kind of value.
pub(super) fn share_stepped<M: Module>(
    module: M,
    own: &[bool],
    takes: &[bool],
    group: &dyn ProcessGroup,
    timeout: Duration,
) -> (M, Option<Result<()>>) {
    let mut collect = Collect {
        select: own,
        visited: 0,
        device: None,
        tensors: Vec::new(),
    };
    // No device sync: the backends that get here compute as they are called.
    module.visit(&mut collect);
    if !collect
        .device
        .as_ref()
        .is_some_and(crate::replica::shares_plain_values)
    {
        // As the reducer's shared buckets: device handles stay on their thread. (Every rank
        // finds the same: the replicas' devices are of one backend.)
        return (module, None);
    }
    let mine = Arc::new(Stepped {
        device: collect.device,
        tensors: collect.tensors,
    });
    let shared: SharedValue = mine.clone();
    let all = match group.all_gather_shared(shared, None, timeout) {
        Ok(Some((all, _))) => all,
        Ok(None) => return (module, None),
        Err(err) => return (module, Some(Err(err.into()))),
    };
    let mut parts = Vec::with_capacity(all.len());
    for (peer, value) in all.into_iter().enumerate() {
        match value.downcast::<Stepped>() {
            Ok(part) => parts.push(part),
            Err(_) => {
                let err = DdpError::InvalidConfig(format!(
                    "rank {peer} shared another kind of value in the parameters' exchange"
                ));
                group.abort(&err.to_string());
                return (module, Some(Err(err)));
            }
        }
    }
    if parts
        .iter()
        .any(|p| p.device.is_some() && p.device != mine.device)
    {
        return (module, None);
    }
    let mut taken: HashMap<usize, Tensor<1>> = HashMap::new();
    for part in &parts {
        for (index, tensor) in &part.tensors {
            if takes.get(*index).copied().unwrap_or(false) {
                taken.insert(*index, tensor.clone());
            }
        }
    }
    let mut put = Put { taken, visited: 0 };
    (module.map(&mut put), Some(Ok(())))
}

/// Collects the flattened inner tensors of the selected places, and the module's device.
struct Collect<'a> {
    select: &'a [bool],
    visited: usize,
    device: Option<Device>,
    tensors: Vec<(usize, Tensor<1>)>,
}

impl ModuleVisitor for Collect<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let index = self.visited;
        self.visited += 1;
        let tensor = param.val();
        if self.device.is_none() {
            self.device = Some(tensor.device().inner());
        }
        if self.select.get(index).copied().unwrap_or(false) {
            let numel = tensor.shape().num_elements();
            self.tensors.push((index, tensor.inner().reshape([numel])));
        }
    }
}

/// Writes the taken tensors into their places, each a fresh leaf.
struct Put {
    taken: HashMap<usize, Tensor<1>>,
    visited: usize,
}

impl ModuleMapper for Put {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let index = self.visited;
        self.visited += 1;
        let Some(flat) = self.taken.remove(&index) else {
            return param;
        };
        let (id, tensor, mapper) = param.consume();
        let dims: [usize; D] = tensor.shape().dims();
        let mut value = flat.reshape(dims);
        // What the place's tensor carries besides its values, as Burn's optimizer keeps it
        // (`ParameterContext`): `autodiff()` alone would lift the value with the default
        // gradient-checkpointing strategy, and a parameter whose strategy differs from its
        // inputs' is refused at the next forward pass.
        if tensor.is_autodiff() {
            value = value.autodiff();
            if let Some(strategy) = tensor.gradient_checkpointing_strategy() {
                value = value.with_gradient_checkpointing_strategy(strategy);
            }
        }
        if tensor.is_require_grad() {
            value = value.require_grad();
        }
        if tensor.is_distributed() {
            value = value.set_distributed(id);
        }
        Param::from_mapped_value(id, value, mapper)
    }
}
