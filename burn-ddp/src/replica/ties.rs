//! Shared (tied) weights: which places of a module's tree hold one tensor.
//!
//! A weight shared by two layers is one `Param` whose clones share the tensor and its autodiff
//! node, so autodiff adds both uses into one gradient. A mapper that rebuilds every place of a
//! parameter on its own (a broadcast that writes rank 0's values) would give each place its own
//! node: the tie would be broken on the ranks that received the values and kept on rank 0, and
//! their gradients would differ. [`Ties`] records, for every float tensor in registration order,
//! the earlier place whose tensor it shares, so the writers can give both places one new tensor.
//!
//! Places with one `ParamId` are not always tied: Burn's own `fork` and record loading rebuild
//! every place separately (the tie is then gone in plain Burn too, and must stay gone on every
//! rank). Which it is can only be seen through autodiff: a backward pass of the first place's sum
//! gives a gradient to the other places exactly when they are the same node.

use burn::module::{AutodiffModule, ModuleVisitor, Param, ParamId};
use burn::tensor::Tensor;
use burn::tensor::backend::AutodiffBackend;

/// For every float tensor of a module (registration order), the index of the earlier place whose
/// tensor (and autodiff node) it shares, if any.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Ties(Vec<Option<usize>>);

/// No place shares its tensor (for writers of tensors without autodiff nodes: buffers, averages).
pub(crate) static NO_TIES: Ties = Ties(Vec::new());

impl Ties {
    /// No place shares its tensor.
    pub(crate) fn none() -> Self {
        Self(Vec::new())
    }

    /// The ties of `module` now. Costs one visit when no `ParamId` appears twice among the
    /// trainable tensors; otherwise also one backward pass over the sums of the repeated ones.
    pub(crate) fn of<B: AutodiffBackend, M: AutodiffModule<B>>(module: &M) -> Self {
        let mut places = Places::default();
        module.visit(&mut places);
        let mut first: std::collections::HashMap<ParamId, usize> = Default::default();
        let mut candidates: Vec<(usize, usize)> = Vec::new();
        for (index, (id, trainable)) in places.ids.iter().enumerate() {
            if !trainable {
                continue;
            }
            match first.get(id) {
                Some(&earlier) => candidates.push((index, earlier)),
                None => {
                    first.insert(*id, index);
                }
            }
        }
        if candidates.is_empty() {
            return Self::none();
        }
        // One backward pass over the sum of every first place that has a candidate.
        let firsts: std::collections::HashSet<usize> = candidates.iter().map(|c| c.1).collect();
        let mut sum = SumOf {
            wanted: &firsts,
            visited: 0,
            total: None,
        };
        module.visit(&mut sum);
        let Some(total) = sum.total else {
            return Self::none();
        };
        let grads = total.backward();
        let wanted: std::collections::HashSet<usize> = candidates.iter().map(|c| c.0).collect();
        let mut probe = HasGradient {
            wanted: &wanted,
            grads: &grads,
            visited: 0,
            found: Default::default(),
        };
        module.visit(&mut probe);
        let mut ties = vec![None; places.ids.len()];
        for (index, earlier) in candidates {
            if probe.found.contains(&index) {
                ties[index] = Some(earlier);
            }
        }
        Self(ties)
    }

    /// The earlier place whose tensor place `index` shares.
    pub(crate) fn of_place(&self, index: usize) -> Option<usize> {
        self.0.get(index).copied().flatten()
    }

    /// Whether any place shares its tensor.
    pub(crate) fn any(&self) -> bool {
        self.0.iter().any(Option::is_some)
    }
}

/// Every float tensor's id and whether it requires gradients.
#[derive(Default)]
struct Places {
    ids: Vec<(ParamId, bool)>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Places {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        self.ids.push((param.id, param.val().is_require_grad()));
    }
}

/// The sum of the values of the `wanted` places.
struct SumOf<'a, B: AutodiffBackend> {
    wanted: &'a std::collections::HashSet<usize>,
    visited: usize,
    total: Option<Tensor<B, 1>>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for SumOf<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let index = self.visited;
        self.visited += 1;
        if !self.wanted.contains(&index) {
            return;
        }
        let sum = param.val().sum();
        self.total = Some(match self.total.take() {
            Some(total) => total + sum,
            None => sum,
        });
    }
}

/// Which of the `wanted` places received a gradient.
struct HasGradient<'a, B: AutodiffBackend> {
    wanted: &'a std::collections::HashSet<usize>,
    grads: &'a B::Gradients,
    visited: usize,
    found: std::collections::HashSet<usize>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for HasGradient<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let index = self.visited;
        self.visited += 1;
        if self.wanted.contains(&index) && param.val().grad(self.grads).is_some() {
            self.found.insert(index);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::{Autodiff, NdArray};
    use burn::module::Module;
    use burn::nn::{Linear, LinearConfig};

    type B = Autodiff<NdArray>;

    #[derive(Module, Debug)]
    struct Two<B: burn::tensor::backend::Backend> {
        a: Linear<B>,
        b: Linear<B>,
    }

    fn tied() -> Two<B> {
        let device = Default::default();
        let a: Linear<B> = LinearConfig::new(3, 3).init(&device);
        // Materialised first: clones of a lazy parameter initialise separately.
        let _ = a.weight.val();
        let mut b: Linear<B> = LinearConfig::new(3, 3).init(&device);
        b.weight = a.weight.clone();
        Two { a, b }
    }

    #[test]
    fn a_param_in_two_places_is_one_tie_and_a_fork_breaks_it_as_burn_does() {
        let model = tied();
        // a.weight, a.bias, b.weight (tied to #0), b.bias.
        assert_eq!(Ties::of(&model).0, vec![None, None, Some(0), None]);
        // Burn's `fork` rebuilds every place: one id, two nodes, no tie.
        let forked = model.fork(&Default::default());
        assert!(!Ties::of(&forked).any());
        // A model without shared weights costs no backward pass and has none.
        let plain = Two::<B> {
            a: LinearConfig::new(3, 3).init(&Default::default()),
            b: LinearConfig::new(3, 3).init(&Default::default()),
        };
        assert_eq!(Ties::of(&plain), Ties::none());
    }
}
