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

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::tensor::{Gradients, Tensor};

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
    /// trainable tensors; otherwise also one backward pass per round: each round takes, for
    /// every id, the first place not yet placed as the representative, and the places of that
    /// id that receive its sum's gradient share its node (so a weight reached three times, two of
    /// them one node, is told apart right).
    pub(crate) fn of<M: Module>(module: &M) -> Self {
        let mut places = Places::default();
        module.visit(&mut places);
        // The trainable places of every id that has several.
        let mut by_id: std::collections::HashMap<ParamId, Vec<usize>> = Default::default();
        for (index, (id, trainable)) in places.ids.iter().enumerate() {
            if *trainable {
                by_id.entry(*id).or_default().push(index);
            }
        }
        let mut open: Vec<Vec<usize>> = by_id.into_values().filter(|p| p.len() > 1).collect();
        let mut ties = vec![None; places.ids.len()];
        while !open.is_empty() {
            let representatives: std::collections::HashSet<usize> =
                open.iter().map(|places| places[0]).collect();
            let mut sum = SumOf {
                wanted: &representatives,
                visited: 0,
                total: None,
            };
            module.visit(&mut sum);
            let Some(total) = sum.total else {
                break;
            };
            let grads = total.backward();
            let others: std::collections::HashSet<usize> = open
                .iter()
                .flat_map(|places| places[1..].iter().copied())
                .collect();
            let mut probe = HasGradient {
                wanted: &others,
                grads: &grads,
                visited: 0,
                found: Default::default(),
            };
            module.visit(&mut probe);
            for places in &mut open {
                let representative = places[0];
                for &place in &places[1..] {
                    if probe.found.contains(&place) {
                        ties[place] = Some(representative);
                    }
                }
                places.retain(|p| *p != representative && !probe.found.contains(p));
            }
            open.retain(|places| places.len() > 1);
        }
        if ties.iter().all(Option::is_none) {
            return Self::none();
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

impl ModuleVisitor for Places {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        self.ids.push((param.id, param.val().is_require_grad()));
    }
}

/// The sum of the values of the `wanted` places.
struct SumOf<'a> {
    wanted: &'a std::collections::HashSet<usize>,
    visited: usize,
    total: Option<Tensor<1>>,
}

impl ModuleVisitor for SumOf<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
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
struct HasGradient<'a> {
    wanted: &'a std::collections::HashSet<usize>,
    grads: &'a Gradients,
    visited: usize,
    found: std::collections::HashSet<usize>,
}

impl ModuleVisitor for HasGradient<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
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
    use crate::replica::tests::test_device;
    use burn::module::Module;
    use burn::nn::{Linear, LinearConfig};

    #[derive(Module, Debug)]
    struct Two {
        a: Linear,
        b: Linear,
    }

    #[derive(Module, Debug)]
    struct Three {
        a: Linear,
        b: Linear,
        c: Linear,
    }

    fn tied() -> Two {
        let device = test_device();
        let a: Linear = LinearConfig::new(3, 3).init(&device);
        // Materialised first: clones of a lazy parameter initialise separately.
        let _ = a.weight.val();
        let mut b: Linear = LinearConfig::new(3, 3).init(&device);
        b.weight = a.weight.clone();
        Two { a, b }
    }

    #[test]
    fn a_param_in_two_places_is_one_tie_and_a_fork_breaks_it_as_burn_does() {
        let model = tied();
        // a.weight, a.bias, b.weight (tied to #0), b.bias.
        assert_eq!(Ties::of(&model).0, vec![None, None, Some(0), None]);
        // Burn's `fork` rebuilds every place: one id, two nodes, no tie.
        let forked = model.fork(&test_device());
        assert!(!Ties::of(&forked).any());
        // Three places of one id, the last two one node (the first rebuilt, as a Burn optimizer
        // step leaves a tied weight): the last two are tied to each other only.
        let one = tied();
        let three = Three {
            a: one.a.clone(),
            b: one.b.clone(),
            c: one.b,
        };
        // b.weight (2) and c.weight (4) share a.weight's node.
        let ties = Ties::of(&three).0;
        assert_eq!((ties[2], ties[4]), (Some(0), Some(0)));
        let mut rebuilt = three.clone();
        rebuilt.a = rebuilt.a.fork(&test_device());
        let ties = Ties::of(&rebuilt).0;
        // a.weight (0), a.bias (1), b.weight (2), b.bias (3), c.weight (4), c.bias (5): after the
        // rebuild b.weight and c.weight share one node, which is not a.weight's.
        assert_eq!(ties[2], None);
        assert_eq!(ties[4], Some(2));
        // A model without shared weights costs no backward pass and has none.
        let plain = Two {
            a: LinearConfig::new(3, 3).init(&test_device()),
            b: LinearConfig::new(3, 3).init(&test_device()),
        };
        assert_eq!(Ties::of(&plain), Ties::none());
    }
}
