//! The optimizer step of a sharded run (ZeRO-1 and ZeRO-2): each rank steps the parameters it
//! owns, then every rank's updated parameters reach every rank before the step returns.
//!
//! Burn 0.21 let burn-ddp wrap the optimizer (`ShardedOptimizer`); Burn 0.22's
//! `ModuleOptimizer` is one concrete type, so the sharding wraps the step instead: the
//! gradients handed to Burn's step hold this rank's parameters only, and Burn's optimizer, which
//! leaves a parameter without a gradient alone (`ModuleOptimizer`'s mapper), steps and keeps
//! state for those only.

use std::time::Duration;

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;

use super::OptimizerShards;
use crate::error::Result;
use burn_ddp_comm::group::ProcessGroup;

/// Steps `module` with `step` (Burn's optimizer step: `optim.step(lr, module, grads)`, or a
/// Learner's) on this rank's own parameters' gradients of `grads`, then all-gathers every rank's
/// stepped parameters into `module` (by reference between thread replicas on one CPU device,
/// else as raw bytes through host memory), so the module returned is whole and bit-identical on
/// every rank, as without sharding. Every rank must call it once per synchronisation.
///
/// Which parameters are gathered is what each owner stepped: its parameters with a gradient in
/// `grads` (none after a skipped step), agreed in one all-gather of one bit per tensor, so a rank
/// whose gradients lack some its peers hold (sharded gradients, or a loop that removed one)
/// cannot make the ranks' all-gathers differ. (That is one small collective per step more than
/// the 0.21 custom loop ran, which gathered every trainable tensor: a skipped step now gathers
/// nothing.)
///
/// # Errors
/// The all-gathers' ([`CommError::Timeout`](crate::comm::CommError::Timeout),
/// [`CommError::PeerLeft`](crate::comm::CommError::PeerLeft), ...); the process group is then
/// aborted and the module lost.
pub(crate) fn sharded_step<M: Module>(
    shards: &OptimizerShards,
    module: M,
    mut grads: GradientsParams,
    group: &dyn ProcessGroup,
    timeout: Duration,
    step: impl FnOnce(M, GradientsParams, &[bool]) -> M,
) -> Result<M> {
    let with = with_gradients(&module, &grads);
    let stepped = shards.agree_stepped(&with, group, timeout)?;
    shards.keep_own(&module, &mut grads);
    let module = step(module, grads, &stepped);
    let (module, gathered) = shards.exchange_stepped(module, &stepped, group, timeout);
    gathered.map(|()| module)
}

/// Whether each float tensor of `module` (registration order) has a gradient in `grads`.
fn with_gradients<M: Module>(module: &M, grads: &GradientsParams) -> Vec<bool> {
    struct Present<'a> {
        grads: &'a GradientsParams,
        places: Vec<bool>,
    }
    impl ModuleVisitor for Present<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let present = self.grads.get::<D>(param.id).is_some();
            self.places.push(present);
        }
    }
    let mut present = Present {
        grads,
        places: Vec::new(),
    };
    module.visit(&mut present);
    present.places
}
