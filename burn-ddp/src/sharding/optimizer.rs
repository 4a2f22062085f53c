//! [`ShardedOptimizer`]: the optimizer of optimizer-state sharding, PyTorch's
//! `ZeroRedundancyOptimizer`. It wraps one of Burn's per-parameter optimizers; inside a step of a
//! sharded run it steps this rank's own parameters and all-gathers every rank's before it returns,
//! so the model that `optim.step` hands back to a model's `optimize` is already whole on every
//! rank, whatever that code does next (freeze a layer, update a teacher copy from the student).

use std::cell::RefCell;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use burn::module::{AutodiffModule, ModuleVisitor, Param};
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::{GradientsParams, MultiGradientsParams, Optimizer, SimpleOptimizer};
use burn::tensor::Tensor;
use burn::tensor::backend::{AutodiffBackend, Backend};

use super::OptimizerShards;
use crate::error::{DdpError, Result};
use burn_ddp_comm::group::ProcessGroup;

/// The optimizer of a run with
/// [`DdpConfig::with_optimizer_sharding`](crate::DdpConfig::with_optimizer_sharding): one of
/// Burn's per-parameter optimizers (`SgdConfig::init()`, `AdamConfig::init()`,
/// `AdamWConfig::init()`, ...: an `OptimizerAdaptor`), wrapped.
///
/// ```
/// use burn::backend::{Autodiff, NdArray};
/// use burn::nn::{Linear, LinearConfig};
/// use burn::optim::{AdamConfig, GradientsParams, Optimizer};
/// use burn::tensor::Tensor;
/// use burn_ddp::ShardedOptimizer;
///
/// type B = Autodiff<NdArray>;
/// let device = Default::default();
/// let model: Linear<B> = LinearConfig::new(4, 2).init(&device);
/// // What `Learner::new(model, optimizer, lr)` takes, for burn-train's `SupervisedTraining`.
/// let mut optimizer = ShardedOptimizer::new(AdamConfig::new().init());
/// // Outside a sharded run it is Burn's Adam.
/// let loss = model.forward(Tensor::<B, 2>::ones([3, 4], &device)).sum();
/// let grads = GradientsParams::from_grads(loss.backward(), &model);
/// let model = optimizer.step(1e-3, model, grads);
/// # let _ = model;
/// ```
///
/// In a sharded run each rank keeps the optimizer state of its own parameters only (about
/// `1 / world_size` of it); a step updates them and all-gathers every rank's updated parameters
/// before `step` returns, so the model it returns is whole and bit-identical on every rank, as
/// without sharding. Code in a model's `TrainStep::optimize` around `optim.step` sees exactly
/// what one device sees: the whole averaged gradients before, the whole updated model after.
///
/// Exact for per-parameter optimizers, whose update of a parameter reads that parameter's
/// gradient and state only: every optimizer Burn builds as an `OptimizerAdaptor` (SGD with or
/// without momentum, Adam, AdamW, RMSProp, AdaGrad, ..., with their per-parameter gradient
/// clipping). An optimizer that looks at several parameters at once (clipping by the global
/// norm, logging the gradient norm) belongs outside this wrapper, where it sees every gradient:
/// for clipping by the global norm use
/// [`DdpConfig::with_clip_grad_norm`](crate::DdpConfig::with_clip_grad_norm).
///
/// Without sharding (one device, or a run without the setting) it is the wrapped optimizer,
/// step for step and record for record: a checkpoint written with it loads without it, and the
/// other way round.
#[derive(Clone)]
pub struct ShardedOptimizer<O, M, B>
where
    O: SimpleOptimizer<B::InnerBackend>,
    M: AutodiffModule<B>,
    B: AutodiffBackend,
{
    inner: OptimizerAdaptor<O, M, B>,
}

impl<O, M, B> ShardedOptimizer<O, M, B>
where
    O: SimpleOptimizer<B::InnerBackend>,
    M: AutodiffModule<B>,
    B: AutodiffBackend,
{
    /// Wraps `inner` (what `AdamConfig::new().init()` and the other optimizer configurations of
    /// Burn return).
    pub fn new(inner: OptimizerAdaptor<O, M, B>) -> Self {
        Self { inner }
    }

    /// The wrapped optimizer.
    pub fn into_inner(self) -> OptimizerAdaptor<O, M, B> {
        self.inner
    }
}

impl<O, M, B> Optimizer<M, B> for ShardedOptimizer<O, M, B>
where
    O: SimpleOptimizer<B::InnerBackend>,
    M: AutodiffModule<B>,
    B: AutodiffBackend,
{
    type Record = <OptimizerAdaptor<O, M, B> as Optimizer<M, B>>::Record;

    fn step(&mut self, lr: f64, module: M, mut grads: GradientsParams) -> M {
        let Some(mut step) = ShardedStep::take() else {
            return self.inner.step(lr, module, grads);
        };
        // What the owners step: every parameter with a gradient (the averaged gradients are
        // whole and alike on every rank), chosen before the step and any code after it.
        let mut stepped = with_gradients::<B, M>(&module, &grads);
        if step.shards.grads_sharded() {
            // This rank holds its own parameters' gradients only: the owners tell.
            match step
                .shards
                .agree_stepped(&stepped, step.group.as_ref(), step.timeout)
            {
                Ok(agreed) => stepped = agreed,
                Err(err) => {
                    step.error.get_or_insert(err);
                    step.ran = true;
                    step.put_back();
                    return module;
                }
            }
        }
        step.shards.keep_own(&module, &mut grads);
        let module = self.inner.step(lr, module, grads);
        let (module, gathered) =
            step.shards
                .exchange_stepped(module, &stepped, step.group.as_ref(), step.timeout);
        step.ran = true;
        if let Err(err) = gathered {
            step.error.get_or_insert(err);
        }
        step.put_back();
        module
    }

    fn step_multi(&mut self, lr: f64, module: M, grads: MultiGradientsParams) -> M {
        // Burn's multi-device gradients (MultiDevice strategies): not a sharded run's.
        self.inner.step_multi(lr, module, grads)
    }

    fn to_record(&self) -> Self::Record {
        self.inner.to_record()
    }

    fn load_record(self, record: Self::Record) -> Self {
        Self {
            inner: self.inner.load_record(record),
        }
    }
}

/// A sharded optimizer step in progress on this thread: what [`ShardedOptimizer::step`] needs,
/// and what it reports.
struct ShardedStep {
    shards: OptimizerShards,
    group: Arc<dyn ProcessGroup>,
    timeout: Duration,
    /// A `ShardedOptimizer` stepped.
    ran: bool,
    /// The all-gather's failure.
    error: Option<DdpError>,
}

thread_local! {
    static STEP: RefCell<Option<ShardedStep>> = const { RefCell::new(None) };
}

impl ShardedStep {
    /// The step in progress, taken (a nested optimizer step does not see it).
    fn take() -> Option<Self> {
        STEP.with(|s| s.borrow_mut().take())
    }

    fn put_back(self) {
        STEP.with(|s| *s.borrow_mut() = Some(self));
    }
}

/// Runs `optimizer_step` (which calls a model's `optimize`, and through it the optimizer) as a
/// sharded step: a [`ShardedOptimizer`] inside steps this rank's parameters of `shards` and
/// all-gathers every rank's. Returns whether a `ShardedOptimizer` stepped.
///
/// # Errors
/// The all-gather's ([`CommError::Timeout`](crate::comm::CommError::Timeout), [`CommError::PeerLeft`](crate::comm::CommError::PeerLeft), ...).
pub(crate) fn sharded_step(
    shards: &OptimizerShards,
    group: Arc<dyn ProcessGroup>,
    timeout: Duration,
    optimizer_step: impl FnOnce(),
) -> Result<bool> {
    STEP.with(|s| {
        *s.borrow_mut() = Some(ShardedStep {
            shards: shards.clone(),
            group,
            timeout,
            ran: false,
            error: None,
        })
    });
    optimizer_step();
    let step = STEP.with(|s| s.borrow_mut().take());
    match step {
        Some(ShardedStep {
            error: Some(err), ..
        }) => Err(err),
        Some(step) => Ok(step.ran),
        // The optimizer step unwound before putting it back: the panic is reported elsewhere.
        None => Ok(false),
    }
}

/// The error of a sharded run whose optimizer is not a [`ShardedOptimizer`], naming its type.
pub(crate) fn not_sharded(optimizer: &str) -> DdpError {
    DdpError::InvalidConfig(format!(
        "optimizer-state sharding (DdpConfig::with_optimizer_sharding) needs the learner's \
         optimizer wrapped in burn_ddp::ShardedOptimizer, which steps each rank's parameters and \
         gathers the others' inside the optimizer step: Learner::new(model, \
         ShardedOptimizer::new(AdamConfig::new().init()), lr); this optimizer is {optimizer}"
    ))
}

/// Whether each float tensor of `module` (registration order) has a gradient in `grads`.
fn with_gradients<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    grads: &GradientsParams,
) -> Vec<bool> {
    struct Present<'a, B: Backend> {
        grads: &'a GradientsParams,
        places: Vec<bool>,
        backend: PhantomData<B>,
    }
    impl<AB: AutodiffBackend> ModuleVisitor<AB> for Present<'_, AB::InnerBackend> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
            let present = self.grads.get::<AB::InnerBackend, D>(param.id).is_some();
            self.places.push(present);
        }
    }
    let mut present = Present::<B::InnerBackend> {
        grads,
        places: Vec::new(),
        backend: PhantomData,
    };
    module.visit(&mut present);
    present.places
}
