//! A model's values: read out, compared, set, and made deterministic.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::tensor::{Tensor, TensorData};

/// Every float tensor of a module, flattened, in registration order.
pub fn float_tensors<M: Module>(module: &M) -> Vec<Vec<f32>> {
    struct Collect(Vec<Vec<f32>>);
    impl ModuleVisitor for Collect {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0.push(param.val().into_data().iter::<f32>().collect());
        }
    }
    let mut collect = Collect(Vec::new());
    module.visit(&mut collect);
    collect.0
}

/// Largest difference between two sets of tensors, relative to each tensor's largest magnitude:
/// `max over tensors of max_i |a_i - b_i| / max_i |b_i|`. A value that is not finite on either
/// side makes it infinite (`f32::max` would drop a NaN, and two runs that both ended in NaN
/// would compare as equal).
pub fn max_relative_difference(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len(), "different number of tensors");
    let differences = a.iter().zip(b).map(|(x, y)| {
        assert_eq!(x.len(), y.len(), "tensors of different sizes");
        if x.iter().chain(y).any(|v| !v.is_finite()) {
            return f32::INFINITY;
        }
        let scale = y
            .iter()
            .fold(0f32, |m, v| m.max(v.abs()))
            .max(f32::MIN_POSITIVE);
        x.iter().zip(y).fold(0f32, |m, (p, q)| m.max((p - q).abs())) / scale
    });
    differences.fold(0f32, f32::max)
}

/// `model` with its float tensors (registration order) set to `values`, shapes checked: the same
/// starting point for two models of the same layout (e.g. `BatchNorm` and `SyncBatchNorm`).
pub fn with_values<M: Module>(model: M, values: &[Vec<f32>]) -> M {
    struct Set<'a> {
        values: &'a [Vec<f32>],
        next: usize,
    }
    impl ModuleMapper for Set<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let (id, tensor, mapper) = param.consume();
            let shape = tensor.shape();
            let values = self.values[self.next].clone();
            self.next += 1;
            assert_eq!(
                values.len(),
                shape.num_elements(),
                "tensor #{}",
                self.next - 1
            );
            let value = Tensor::<D>::from_data(
                TensorData::new(values, shape).convert_dtype(tensor.dtype()),
                &tensor.device(),
            );
            let value = if tensor.is_require_grad() {
                value.require_grad()
            } else {
                value
            };
            Param::from_mapped_value(id, value, mapper)
        }
    }
    let mut set = Set { values, next: 0 };
    let model = model.map(&mut set);
    assert_eq!(set.next, values.len(), "number of tensors");
    model
}

/// `model` with every parameter and frozen weight set to values that depend only on `seed` and
/// the tensor's place (buffers, e.g. BatchNorm's statistics, keep their initial values): two
/// models of one type built anywhere start alike, without sharing a random generator. Places with
/// one `ParamId` get one tensor (a shared weight stays shared).
pub fn deterministic<M: Module>(model: M, seed: u64) -> M {
    use std::any::Any;
    use std::collections::HashMap;
    struct Fill {
        seed: u64,
        buffers: Vec<bool>,
        index: usize,
        by_id: HashMap<ParamId, Box<dyn Any>>,
    }
    impl ModuleMapper for Fill {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let index = self.index;
            self.index += 1;
            if self.buffers.get(index).copied().unwrap_or(false) {
                return param;
            }
            let (id, tensor, mapper) = param.consume();
            if let Some(shared) = self
                .by_id
                .get(&id)
                .and_then(|t| t.downcast_ref::<Tensor<D>>())
            {
                return Param::from_mapped_value(id, shared.clone(), mapper);
            }
            let shape = tensor.shape();
            let n = shape.num_elements();
            let fan = (n as f32).sqrt().max(1.0);
            let values: Vec<f32> = (0..n)
                .map(|j| {
                    let x = (self.seed ^ ((index as u64) << 40) ^ j as u64)
                        .wrapping_mul(0x9E37_79B9_7F4A_7C15);
                    ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0 / fan
                })
                .collect();
            let mut value = Tensor::<D>::from_data(
                TensorData::new(values, shape).convert_dtype(tensor.dtype()),
                &tensor.device(),
            );
            if tensor.is_require_grad() {
                value = value.require_grad();
            }
            self.by_id.insert(id, Box::new(value.clone()));
            Param::from_mapped_value(id, value, mapper)
        }
    }
    let buffers = burn_ddp::mechanism::ReplicaLayout::of(&model).buffer_mask();
    model.map(&mut Fill {
        seed,
        buffers,
        index: 0,
        by_id: HashMap::new(),
    })
}

/// A freshly initialised model whose lazily created parameters are materialised, so clones share
/// the same values (Burn initialises parameters lazily, per clone).
pub fn materialized<M: Module>(model: M) -> M {
    let _ = burn_ddp::mechanism::value_fingerprint(&model);
    model
}

/// A copy of `model` that shares nothing with it: clones of a Burn module share their
/// `RunningState` (BatchNorm statistics), so two trainings from clones would update the same
/// statistics. Burn 0.22's `valid` makes new running states; `train` gives autodiff back.
pub fn copy_of<M: Module>(model: &M) -> M {
    model.valid().train()
}
