//! [`SyncBatchNorm`]: batch normalisation over the global batch.
//!
//! On Burn 0.22 a tensor's backend is chosen at run time (`Dispatch`), so the one collective the
//! layer needs, a sum of per-channel statistics over the ranks whose gradient is the sum over
//! the ranks of the gradients, is a backend extension ([`SyncBatchNormBackend`], through Burn's
//! `#[backend_extension]`): the same host all-reduce on every concrete backend, and a
//! hand-written backward on `Autodiff`. Everything it needs to communicate (the group, the
//! timeout, this rank's weight in the step) is taken when the layer's forward pass runs and
//! carried by the operation ([`StatsLink`]), not read from the thread when it executes.

use std::cell::RefCell;
use std::sync::Arc;
use std::time::Duration;

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, unary};
use burn::backend::{
    Autodiff, Backend, Dispatch, TensorMetadata, backend_extension, tensor::FloatTensor,
};
use burn::config::Config;
use burn::module::{Flag, Module, Param, RunningState};
use burn::tensor::{Device, Tensor};

use burn_ddp_comm::group::{ProcessGroup, ReduceOp};

thread_local! {
    static CURRENT: RefCell<Option<(Arc<dyn ProcessGroup>, Duration)>> = const { RefCell::new(None) };
    static USED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether a SyncBatchNorm layer ran a training forward pass on this thread (the strategy refuses
/// to combine it with join mode).
pub(crate) fn used_on_this_thread() -> bool {
    USED.with(std::cell::Cell::get)
}

/// Makes `group` the current process group of this thread (for [`SyncBatchNorm`]) until the
/// returned guard is dropped; collectives time out after `timeout`.
pub(crate) fn enter_process_group(
    group: Arc<dyn ProcessGroup>,
    timeout: Duration,
) -> SyncBatchNormGuard {
    let previous = CURRENT.with(|c| c.replace(Some((group, timeout))));
    SyncBatchNormGuard {
        previous,
        _not_send: std::marker::PhantomData,
    }
}

/// Restores the previous current process group when dropped (on the thread that entered it).
pub struct SyncBatchNormGuard {
    previous: Option<(Arc<dyn ProcessGroup>, Duration)>,
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Drop for SyncBatchNormGuard {
    fn drop(&mut self) {
        let previous = self.previous.take();
        CURRENT.with(|c| *c.borrow_mut() = previous);
    }
}

/// What one sum of statistics over the ranks communicates with: the calling thread's current
/// process group (of more than one rank), its timeout, and this rank's weight in the step (its
/// share of the step's samples times the world size: 1 but in a short last step), all taken
/// when the layer's forward pass runs.
#[derive(Clone)]
pub struct StatsLink {
    group: Arc<dyn ProcessGroup>,
    timeout: Duration,
    weight: f64,
}

impl std::fmt::Debug for StatsLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StatsLink")
            .field("rank", &self.group.rank())
            .field("world_size", &self.group.world_size())
            .field("timeout", &self.timeout)
            .field("weight", &self.weight)
            .finish()
    }
}

impl StatsLink {
    /// The link of the calling thread's current group; `None` without one or with one rank.
    fn current() -> Option<Self> {
        let (group, timeout) = CURRENT.with(|c| c.borrow().clone())?;
        (group.world_size() > 1).then(|| Self {
            group,
            timeout,
            weight: crate::sampler::drawn_on_this_thread().map_or(1.0, |d| f64::from(d.weight())),
        })
    }

    /// Sums `values` over the ranks in place.
    ///
    /// # Panics
    /// With the collective's [`DdpError`](crate::DdpError) as payload when it fails (see
    /// [`raise`]).
    fn all_reduce(&self, values: &mut [f32]) {
        if let Err(err) = self.group.all_reduce(values, ReduceOp::Sum, self.timeout) {
            raise(err.into());
        }
    }
}

/// Backends on which [`SyncBatchNorm`] can sum statistics across ranks: Burn's Flex (feature
/// `flex`, on by default), NdArray (`ndarray`) and CubeCL (`cuda`: Burn 0.22's one backend of
/// every CubeCL runtime, so wgpu too once this build has it) backends, and `Autodiff` over them.
/// On a backend this build does not list, a training forward pass with a group of more than one
/// rank fails before any collective with [`DdpError::InvalidConfig`](crate::DdpError) naming
/// the device (as the panic payload, see [`SyncBatchNorm`]).
#[backend_extension(
    Flex: cfg(feature = "flex"),
    NdArray: cfg(feature = "ndarray"),
    Cube: cfg(feature = "cuda"),
    Autodiff
)]
pub trait SyncBatchNormBackend: Backend {
    /// `tensor` (1-D, `[channels]`) summed over the ranks of `link`'s group, on the host (read,
    /// all-reduced as `f32`, written back in its dtype on its device). On autodiff backends its
    /// gradient is summed over the ranks the same way, weighed by the ranks' shares of the step.
    fn sync_sum(tensor: FloatTensor<Self>, link: StatsLink) -> FloatTensor<Self>;
}

/// [`SyncBatchNormBackend::sync_sum`] on a concrete backend.
fn host_sync_sum<B: Backend>(tensor: FloatTensor<B>, link: &StatsLink) -> FloatTensor<B> {
    let device = tensor.device();
    let dtype = tensor.dtype();
    let data = match burn::tensor::try_read_sync(B::float_into_data(tensor)) {
        Some(Ok(data)) => data,
        Some(Err(e)) => raise(crate::error::DdpError::InvalidConfig(format!(
            "SyncBatchNorm: the statistics could not be read from their device: {e:?}"
        ))),
        None => raise(crate::error::DdpError::InvalidConfig(
            "SyncBatchNorm: this platform cannot wait for a tensor read".into(),
        )),
    };
    let mut data = data.convert::<f32>();
    match data.as_mut_slice::<f32>() {
        Ok(values) => link.all_reduce(values),
        Err(e) => raise(crate::error::DdpError::InvalidConfig(format!(
            "SyncBatchNorm: statistics are not f32: {e:?}"
        ))),
    }
    B::float_from_data(data.convert_dtype(dtype), &device)
}

macro_rules! host_backend {
    ($($backend:ty),*) => {$(
        impl SyncBatchNormBackend for $backend {
            fn sync_sum(tensor: FloatTensor<Self>, link: StatsLink) -> FloatTensor<Self> {
                host_sync_sum::<Self>(tensor, &link)
            }
        }
    )*};
}

#[cfg(feature = "flex")]
host_backend!(burn::backend::Flex);
#[cfg(feature = "ndarray")]
host_backend!(burn::backend::NdArray);
#[cfg(feature = "cuda")]
host_backend!(burn::backend::Cuda);

/// The backward step of [`SyncBatchNormBackend::sync_sum`]: the gradient of a sum over ranks is
/// the sum over ranks of the gradients.
#[derive(Debug)]
struct SyncSum;

impl<B: SyncBatchNormBackend> Backward<B, 1> for SyncSum {
    type State = StatsLink;

    /// The ranks' gradients summed, each weighed by its rank's share of the step's samples and
    /// the sum divided by this rank's (1 and 1 but in a short last step): after the reduction
    /// weighs this rank's gradients by its share, every rank's path through the statistics
    /// carries the weight of the rank whose loss it comes from, as on one device.
    fn backward(self, ops: Ops<StatsLink, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let link = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |grad| {
            let weight = link.weight;
            if weight == 0.0 {
                // A rank without a sample in the step adds nothing (its gradient, of an empty
                // batch's loss, may be NaN).
                let zeros = B::float_zeros(grad.shape(), &grad.device(), grad.dtype().into());
                return B::sync_sum(zeros, link);
            }
            if weight == 1.0 {
                return B::sync_sum(grad, link);
            }
            let weighed = B::float_mul_scalar(grad, weight.into());
            B::float_div_scalar(B::sync_sum(weighed, link), weight.into())
        });
    }
}

impl<B: SyncBatchNormBackend, C: CheckpointStrategy> SyncBatchNormBackend for Autodiff<B, C> {
    fn sync_sum(tensor: FloatTensor<Self>, link: StatsLink) -> FloatTensor<Self> {
        let output = B::sync_sum(tensor.primitive().clone(), link.clone());
        match SyncSum
            .prepare::<C>([tensor.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(link, output),
            OpsKind::UnTracked(prep) => prep.finish(output),
        }
    }
}

/// `tensor` summed over the ranks of `link`.
fn sync_sum(tensor: Tensor<1>, link: &StatsLink) -> Tensor<1> {
    Tensor::from_dispatch(<Dispatch as SyncBatchNormBackend>::sync_sum(
        tensor.into_dispatch(),
        link.clone(),
    ))
}

/// Configuration of [`SyncBatchNorm`] (the same fields and defaults as Burn's `BatchNormConfig`).
#[derive(Config, Debug)]
pub struct SyncBatchNormConfig {
    /// The number of features (channels).
    pub num_features: usize,
    /// Added to the variance for numerical stability. Default: 1e-5.
    #[config(default = 1e-5)]
    pub epsilon: f64,
    /// Weight of the new batch statistics in the running statistics. Default: 0.1.
    #[config(default = 0.1)]
    pub momentum: f64,
}

impl SyncBatchNormConfig {
    /// A new layer on `device`: scale 1, shift 0, running mean 0, running variance 1, training
    /// on (as Burn's `BatchNormConfig::init`).
    ///
    /// # Panics
    /// As Burn's `BatchNormConfig::init`: `num_features` zero, `epsilon` not finite and
    /// positive, or `momentum` not finite and within `[0, 1]` (a model's shape, not user input).
    pub fn init(&self, device: &Device) -> SyncBatchNorm {
        assert!(
            self.num_features > 0,
            "num_features must be greater than zero."
        );
        assert!(
            self.epsilon.is_finite() && self.epsilon > 0.0,
            "epsilon must be finite and positive."
        );
        assert!(
            self.momentum.is_finite() && (0.0..=1.0).contains(&self.momentum),
            "momentum must be finite and within [0, 1]."
        );
        SyncBatchNorm {
            gamma: Param::from_tensor(Tensor::ones([self.num_features], device)),
            beta: Param::from_tensor(Tensor::zeros([self.num_features], device)),
            training: Param::from_bool(true),
            running_mean: RunningState::new(Tensor::zeros([self.num_features], device)),
            running_var: RunningState::new(Tensor::ones([self.num_features], device)),
            momentum: self.momentum,
            epsilon: self.epsilon,
        }
    }
}

/// Batch normalisation whose batch statistics are computed over the global batch (every
/// replica's shard), the counterpart of `torch.nn.SyncBatchNorm`.
///
/// With plain BatchNorm each replica normalises with the mean and variance of its own shard, so
/// N replicas with batch B/N do not compute what one device with batch B does. `SyncBatchNorm`
/// sums the per-channel statistics over the ranks in the forward pass, and its gradients in the
/// backward pass, so training matches single-device BatchNorm on the whole batch.
///
/// The ranks it synchronises with are the *current process group* of the calling thread when
/// the forward pass runs: with
/// [`DistributedDataParallel`](crate::DistributedDataParallel), enter it with
/// [`DistributedDataParallel::enter_sync_batch_norm`](crate::DistributedDataParallel::enter_sync_batch_norm).
/// Without one (plain single-device training) it is exactly Burn's `BatchNorm`.
///
/// It trains (batch statistics) when its input's device has autodiff and its `training` flag is
/// on, as Burn 0.22's `BatchNorm`; otherwise it normalises with the running statistics. Its
/// backend must implement [`SyncBatchNormBackend`] (Flex, NdArray, CUDA, with or without
/// autodiff). Every replica must run the same SyncBatchNorm layers in the same order (it issues
/// collectives); it cannot be combined with
/// [`UnevenInputs::Join`](crate::config::UnevenInputs::Join), where a rank without a batch skips
/// its forward pass. A collective that fails inside a forward or backward pass panics (those
/// cannot return errors) with the collective's [`DdpError`](crate::DdpError) as the payload, and
/// the process group is aborted, so the other ranks stop.
///
/// Input `[batch, channels, ...]`, output of the same shape.
#[derive(Module, Debug)]
pub struct SyncBatchNorm {
    /// Per-channel scale.
    pub gamma: Param<Tensor<1>>,
    /// Per-channel shift.
    pub beta: Param<Tensor<1>>,
    /// Whether training behaviour (batch statistics) is on for this layer (Burn 0.22's
    /// `BatchNorm` has the same flag: frozen layers normalise with the running statistics).
    pub training: Param<Flag>,
    /// Running mean (for inference).
    pub running_mean: RunningState<Tensor<1>>,
    /// Running variance (for inference).
    pub running_var: RunningState<Tensor<1>>,
    /// Weight of the new batch statistics in the running statistics.
    pub momentum: f64,
    /// Added to the variance for numerical stability.
    pub epsilon: f64,
}

impl SyncBatchNorm {
    /// Normalises `input` (`[batch, channels, ...]`, at least 2 dimensions): with the global
    /// batch's statistics when training, with the running statistics otherwise.
    ///
    /// # Panics
    /// As Burn's `BatchNorm`, when `input` has fewer than 2 dimensions or another number of
    /// channels than the layer (checked before any collective, so that no rank waits on one).
    pub fn forward<const D: usize>(&self, input: Tensor<D>) -> Tensor<D> {
        let [num_features] = self.gamma.shape().dims();
        burn::tensor::assert_shape!(input, [_, num_features, ..]);
        let device = input.device();
        let dims = input.dims();
        let channels = dims[1];
        let mut per_channel = [1; D];
        per_channel[1] = channels;
        if !(device.is_autodiff() && self.training.is_enabled()) {
            let mean = self.running_mean.value().to_device(&device);
            let var = self.running_var.value().to_device(&device);
            return self.normalize(input, mean.reshape(per_channel), var.reshape(per_channel));
        }
        USED.with(|used| used.set(true));
        let link = StatsLink::current();
        if link.is_some() && !supported(&device) {
            raise(crate::error::DdpError::InvalidConfig(format!(
                "SyncBatchNorm: no sum over ranks on {device:?} in this build (Flex, NdArray and \
                 CUDA with burn-ddp's features `flex`, `ndarray`, `cuda`)"
            )));
        }
        let local: usize = dims
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != 1)
            .map(|(_, d)| d)
            .product();
        let count = global_count(local, link.as_ref()) as f64;
        let over_ranks = |sum: Tensor<1>| match &link {
            Some(link) => sync_sum(sum, link),
            None => sum,
        };
        let flat = |x: Tensor<D>| x.swap_dims(0, 1).reshape([channels, local]);

        let sum = flat(input.clone()).sum_dim(1).reshape([channels]);
        let mean = over_ranks(sum).div_scalar(count).reshape(per_channel);
        let centered = input.clone().sub(mean.clone());
        let squares = flat(centered.square()).sum_dim(1).reshape([channels]);
        let var = over_ranks(squares).div_scalar(count).reshape(per_channel);

        let running_mean = self.running_mean.value_sync().to_device(&device);
        let running_var = self.running_var.value_sync().to_device(&device);
        let running = |old: Tensor<1>, new: &Tensor<D>| {
            old.mul_scalar(1.0 - self.momentum)
                .add(
                    new.clone()
                        .detach()
                        .mul_scalar(self.momentum)
                        .reshape([channels]),
                )
                .detach()
        };
        self.running_mean.update(running(running_mean, &mean));
        self.running_var.update(running(running_var, &var));
        self.normalize(input, mean, var)
    }

    fn normalize<const D: usize>(
        &self,
        x: Tensor<D>,
        mean: Tensor<D>,
        var: Tensor<D>,
    ) -> Tensor<D> {
        let channels = x.dims()[1];
        let mut shape = [1; D];
        shape[1] = channels;
        let std = var.add_scalar(self.epsilon).sqrt();
        x.sub(mean)
            .div(std)
            .mul(self.gamma.val().reshape(shape))
            .add(self.beta.val().reshape(shape))
    }
}

/// Whether [`SyncBatchNormBackend`] has an implementation for `device`'s backend in this build:
/// the extension's selectors and `host_backend!`'s list, which it must follow (the generated
/// dispatch has no question to ask, only a panic on an unlisted backend).
fn supported(device: &Device) -> bool {
    use burn::backend::DispatchDevice;
    #[allow(unreachable_patterns)]
    match device.clone().inner().as_dispatch() {
        #[cfg(feature = "flex")]
        DispatchDevice::Flex(_) => true,
        #[cfg(feature = "ndarray")]
        DispatchDevice::NdArray(_) => true,
        #[cfg(feature = "cuda")]
        DispatchDevice::Cube(_) => true,
        _ => false,
    }
}

/// Elements per channel over all ranks (an exact all-gather of the local counts).
fn global_count(local: usize, link: Option<&StatsLink>) -> u64 {
    match link {
        None => local as u64,
        Some(link) => match link.group.all_gather(&[local as u64], link.timeout) {
            Ok(counts) => counts.iter().sum(),
            Err(err) => raise(err.into()),
        },
    }
}

/// Forward and backward passes cannot return errors: a failed collective unwinds with the
/// [`DdpError`](crate::DdpError) itself as the panic payload, which the strategy turns back into
/// the error. The group is aborted already, so every other rank stops too.
fn raise(err: crate::error::DdpError) -> ! {
    std::panic::panic_any(err)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::nn::{BatchNorm, BatchNormConfig, Linear, LinearConfig};
    use burn::optim::{GradientsParams, SgdConfig};
    use burn::tensor::TensorData;
    use burn_ddp_comm::group::ThreadGroup;

    use crate::replica::tests::test_device;

    /// A linear layer, then batch normalisation (Burn's or ours), then a loss over its output.
    #[derive(Module, Debug)]
    struct Net<N> {
        linear: Linear,
        norm: N,
    }

    trait Norm {
        fn norm<const D: usize>(&self, x: Tensor<D>) -> Tensor<D>;
    }
    impl Norm for BatchNorm {
        fn norm<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
            self.forward(x)
        }
    }
    impl Norm for SyncBatchNorm {
        fn norm<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
            self.forward(x)
        }
    }

    const ROWS: usize = 12;

    fn inputs(step: usize, rows: std::ops::Range<usize>, device: &Device) -> Tensor<2> {
        let values: Vec<f32> = rows
            .clone()
            .flat_map(|r| (0..3).map(move |c| ((r * 5 + c * 7 + step * 3) % 11) as f32 / 4.0 - 1.0))
            .collect();
        Tensor::from_data(TensorData::new(values, [rows.len(), 3]), device)
    }

    /// A loss that is not the mean of independent per-sample terms of the normalised output
    /// alone: its gradient through the statistics is what the backward's sum must carry. The
    /// mean over the rows given (so the ranks' average is the whole batch's loss).
    fn loss<N: Norm + Module>(
        model: &Net<N>,
        step: usize,
        rows: std::ops::Range<usize>,
    ) -> Tensor<1> {
        let n = rows.len();
        let x = inputs(step, rows, &model.linear.weight.device());
        let out = model.norm.norm(model.linear.forward(x));
        let weights = Tensor::<1>::from_data(
            TensorData::new((0..4).map(|c| c as f32 + 1.0).collect::<Vec<_>>(), [4]),
            &out.device(),
        );
        (out.powi_scalar(3) * weights.reshape([1, 4]))
            .sum()
            .div_scalar(n as f64)
    }

    fn linear(device: &Device) -> Linear {
        LinearConfig::new(3, 4).init(device)
    }

    fn values(t: Tensor<1>) -> Vec<f32> {
        t.into_data().convert::<f32>().try_to_vec::<f32>().unwrap()
    }

    #[test]
    fn sync_batch_norm_over_thread_ranks_trains_as_burns_batch_norm_on_the_whole_batch() {
        let device = test_device();
        let linear = linear(&device);
        let steps = 4;

        // Plain Burn: BatchNorm on one device with every row of each step.
        let mut plain = Net {
            linear: linear.clone(),
            norm: BatchNormConfig::new(4).init(&device),
        };
        let mut optim = SgdConfig::new().init();
        for step in 0..steps {
            let grads = GradientsParams::from_grads(loss(&plain, step, 0..ROWS).backward(), &plain);
            plain = optim.step(0.05, plain, grads);
        }

        for world in [2, 3] {
            let per = ROWS / world;
            let groups = ThreadGroup::new_group(world).unwrap();
            let trained: Vec<Net<SyncBatchNorm>> = std::thread::scope(|s| {
                let handles: Vec<_> = groups
                    .into_iter()
                    .enumerate()
                    .map(|(rank, group)| {
                        let (linear, device) = (linear.clone(), device.clone());
                        s.spawn(move || {
                            let group: Arc<dyn ProcessGroup> = Arc::new(group);
                            let model = Net {
                                linear,
                                norm: SyncBatchNormConfig::new(4).init(&device),
                            };
                            let (mut ddp, mut model) = crate::DistributedDataParallel::new(
                                group,
                                model,
                                &device,
                                crate::DdpConfig::default(),
                            )
                            .unwrap();
                            let _sync = ddp.enter_sync_batch_norm();
                            let mut optim = SgdConfig::new().init();
                            for step in 0..steps {
                                let rows = rank * per..(rank + 1) * per;
                                let grads = GradientsParams::from_grads(
                                    loss(&model, step, rows).backward(),
                                    &model,
                                );
                                let grads = ddp.sync_gradients(&model, grads).unwrap();
                                model = optim.step(0.05, model, grads);
                            }
                            assert!(used_on_this_thread());
                            model
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            });
            let want = [
                values(plain.linear.weight.val().flatten(0, 1)),
                values(plain.norm.gamma.val()),
                values(plain.norm.beta.val()),
                values(plain.norm.running_mean.value()),
                values(plain.norm.running_var.value()),
            ];
            for (rank, model) in trained.iter().enumerate() {
                let got = [
                    values(model.linear.weight.val().flatten(0, 1)),
                    values(model.norm.gamma.val()),
                    values(model.norm.beta.val()),
                    values(model.norm.running_mean.value()),
                    values(model.norm.running_var.value()),
                ];
                for (what, (got, want)) in
                    ["weight", "gamma", "beta", "running mean", "running var"]
                        .iter()
                        .zip(got.iter().zip(&want))
                {
                    for (g, w) in got.iter().zip(want) {
                        assert!(
                            (g - w).abs() <= 1e-4 * w.abs().max(1.0),
                            "{world} ranks, rank {rank}, {what}: {got:?} against {want:?}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn without_a_group_it_is_burns_batch_norm_and_frozen_it_uses_the_running_statistics() {
        let device = test_device();
        let x = inputs(0, 0..ROWS, &device);
        let burn = BatchNormConfig::new(3).init(&device);
        let ours = SyncBatchNormConfig::new(3).init(&device);
        let (a, b) = (burn.forward(x.clone()), ours.forward(x.clone()));
        let (a, b) = (values(a.flatten(0, 1)), values(b.flatten(0, 1)));
        for (a, b) in a.iter().zip(&b) {
            assert!((a - b).abs() <= 1e-5, "{a} against {b}");
        }
        assert_eq!(
            values(burn.running_mean.value()),
            values(ours.running_mean.value())
        );
        // Frozen (or on a device without autodiff): the running statistics, nothing updated.
        let frozen = SyncBatchNorm {
            training: Param::from_bool(false),
            ..SyncBatchNormConfig::new(3).init(&device)
        };
        let before = values(frozen.running_mean.value());
        let out = values(frozen.forward(x.clone()).flatten(0, 1));
        let expected: Vec<f32> = values(x.clone().flatten(0, 1))
            .iter()
            .map(|v| v / (1.0f32 + 1e-5).sqrt())
            .collect();
        for (o, e) in out.iter().zip(&expected) {
            assert!((o - e).abs() <= 1e-5, "{o} against {e}");
        }
        assert_eq!(values(frozen.running_mean.value()), before);
        let plain = Device::flex();
        let evaluated = SyncBatchNormConfig::new(3).init(&plain);
        // (`to_device` keeps a tensor's autodiff context: the input is made on the device.)
        let out = values(evaluated.forward(inputs(0, 0..ROWS, &plain)).flatten(0, 1));
        for (o, e) in out.iter().zip(&expected) {
            assert!((o - e).abs() <= 1e-5, "{o} against {e}");
        }
    }
}
