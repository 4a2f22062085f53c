//! [`SyncBatchNorm`]: batch normalisation over the global batch.

use std::cell::RefCell;
use std::sync::Arc;
use std::time::Duration;

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, unary};
use burn::config::Config;
use burn::module::{Module, Param, RunningState};
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorPrimitive};

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

fn current() -> Option<(Arc<dyn ProcessGroup>, Duration)> {
    CURRENT.with(|c| c.borrow().clone())
}

/// Sums a 1-D float tensor over the ranks of the current process group, on the host.
#[cfg_attr(
    not(any(
        feature = "ndarray",
        feature = "flex",
        feature = "cuda",
        feature = "wgpu"
    )),
    allow(dead_code)
)]
fn host_sync_sum<B: Backend>(tensor: FloatTensor<B>) -> FloatTensor<B> {
    let Some((group, timeout)) = current().filter(|(g, _)| g.world_size() > 1) else {
        return tensor;
    };
    let tensor = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(tensor));
    let device = tensor.device();
    let dtype = tensor.dtype();
    let mut data = tensor.into_data().convert::<f32>();
    let summed = match data.as_mut_slice::<f32>() {
        Ok(values) => group
            .all_reduce(values, ReduceOp::Sum, timeout)
            .map_err(crate::error::DdpError::from),
        Err(e) => Err(crate::error::DdpError::InvalidConfig(format!(
            "SyncBatchNorm: statistics are not f32: {e:?}"
        ))),
    };
    if let Err(err) = summed {
        raise(err);
    }
    Tensor::<B, 1>::from_data(data.convert_dtype(dtype), &device)
        .into_primitive()
        .tensor()
}

/// Backends on which [`SyncBatchNorm`] can sum statistics across ranks.
pub trait SyncBatchNormBackend: Backend {
    /// Sums the 1-D tensor over the ranks of the current process group (the identity without
    /// one). On autodiff backends its gradient is summed over the ranks the same way.
    fn sync_sum(tensor: FloatTensor<Self>) -> FloatTensor<Self>;
}

#[cfg_attr(
    not(any(
        feature = "ndarray",
        feature = "flex",
        feature = "cuda",
        feature = "wgpu"
    )),
    allow(unused_macros)
)]
macro_rules! host_backend {
    ($($backend:ty),*) => {$(
        impl SyncBatchNormBackend for $backend {
            fn sync_sum(tensor: FloatTensor<Self>) -> FloatTensor<Self> {
                host_sync_sum::<Self>(tensor)
            }
        }
    )*};
}

#[cfg(feature = "ndarray")]
host_backend!(burn::backend::NdArray);
#[cfg(feature = "flex")]
host_backend!(burn::backend::Flex);
#[cfg(feature = "cuda")]
host_backend!(burn::backend::Cuda);
#[cfg(feature = "wgpu")]
host_backend!(burn::backend::Wgpu);

/// The backward step of [`SyncBatchNormBackend::sync_sum`]: the gradient of a sum over ranks is
/// the sum over ranks of the gradients.
#[derive(Debug)]
struct SyncSum;

impl<B: SyncBatchNormBackend> Backward<B, 1> for SyncSum {
    type State = ();

    /// The ranks' gradients summed, each weighed by its rank's share of the step's samples and
    /// the sum divided by this rank's (1 and 1 but in a short last step): after the reduction
    /// weighs this rank's gradients by its share, every rank's path through the statistics
    /// carries the weight of the rank whose loss it comes from, as on one device.
    fn backward(self, ops: Ops<(), 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let weight = crate::sampler::drawn_on_this_thread().map_or(1.0, |d| d.weight());
        unary::<B, _>(ops.parents, ops.node, grads, |grad| {
            if weight == 1.0 || weight == 0.0 {
                return B::sync_sum(grad);
            }
            let weighed = B::float_mul_scalar(grad, weight.into());
            B::float_div_scalar(B::sync_sum(weighed), weight.into())
        });
    }
}

impl<B: SyncBatchNormBackend, C: CheckpointStrategy> SyncBatchNormBackend for Autodiff<B, C> {
    fn sync_sum(tensor: FloatTensor<Self>) -> FloatTensor<Self> {
        let output = B::sync_sum(tensor.primitive.clone());
        SyncSum
            .prepare::<C>([tensor.node.clone()])
            .compute_bound()
            .stateless(output)
    }
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
    /// A new layer on `device`: scale 1, shift 0, running mean 0, running variance 1.
    pub fn init<B: Backend>(&self, device: &B::Device) -> SyncBatchNorm<B> {
        SyncBatchNorm {
            gamma: Param::from_tensor(Tensor::ones([self.num_features], device)),
            beta: Param::from_tensor(Tensor::zeros([self.num_features], device)),
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
/// The ranks it synchronises with are the *current process group* of the calling thread:
/// [`DdpStrategy`](crate::DdpStrategy) sets it on every replica's thread; with
/// [`DistributedDataParallel`](crate::DistributedDataParallel), enter it with
/// [`DistributedDataParallel::enter_sync_batch_norm`](crate::DistributedDataParallel::enter_sync_batch_norm).
/// Without one (plain single-device training) it is exactly Burn's
/// `BatchNorm`.
///
/// It needs a backend that implements [`SyncBatchNormBackend`]: Burn's `Autodiff` over NdArray
/// or Flex (features `ndarray` and `flex`, on by default) or CUDA (feature `cuda`). Every replica
/// must run the same SyncBatchNorm layers in the same order (it issues collectives); it cannot be combined with
/// [`UnevenInputs::Join`](crate::config::UnevenInputs::Join), where a rank without a batch skips its
/// forward pass. A collective that fails inside a forward or backward pass panics (those cannot
/// return errors); `DdpStrategy` reports it as [`DdpError::WorkerPanicked`](crate::DdpError)
/// carrying the collective's error, and the process group is aborted, so the other ranks stop.
///
/// Input `[batch, channels, ...]`, output of the same shape.
#[derive(Module, Debug)]
pub struct SyncBatchNorm<B: Backend> {
    /// Per-channel scale.
    pub gamma: Param<Tensor<B, 1>>,
    /// Per-channel shift.
    pub beta: Param<Tensor<B, 1>>,
    /// Running mean (for inference).
    pub running_mean: RunningState<Tensor<B, 1>>,
    /// Running variance (for inference).
    pub running_var: RunningState<Tensor<B, 1>>,
    /// Weight of the new batch statistics in the running statistics.
    pub momentum: f64,
    /// Added to the variance for numerical stability.
    pub epsilon: f64,
}

impl<B: SyncBatchNormBackend> SyncBatchNorm<B> {
    /// Normalises `input` (`[batch, channels, ...]`, at least 2 dimensions): with the global
    /// batch's statistics when training (autodiff enabled), with the running statistics
    /// otherwise.
    pub fn forward<const D: usize>(&self, input: Tensor<B, D>) -> Tensor<B, D> {
        let device = input.device();
        let dims = input.dims();
        let channels = dims[1];
        let mut per_channel = [1; D];
        per_channel[1] = channels;
        if !B::ad_enabled(&device) {
            let mean = self.running_mean.value().to_device(&device);
            let var = self.running_var.value().to_device(&device);
            return self.normalize(input, mean.reshape(per_channel), var.reshape(per_channel));
        }
        USED.with(|used| used.set(true));
        let local: usize = dims
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != 1)
            .map(|(_, d)| d)
            .product();
        let count = global_count(local) as f64;
        let flat = |x: Tensor<B, D>| x.swap_dims(0, 1).reshape([channels, local]);

        let sum = flat(input.clone()).sum_dim(1).reshape([channels]);
        let mean = sync_sum(sum).div_scalar(count).reshape(per_channel);
        let centered = input.clone().sub(mean.clone());
        let squares = flat(centered.square()).sum_dim(1).reshape([channels]);
        let var = sync_sum(squares).div_scalar(count).reshape(per_channel);

        let running_mean = self.running_mean.value_sync().to_device(&device);
        let running_var = self.running_var.value_sync().to_device(&device);
        self.running_mean.update(
            running_mean
                .mul_scalar(1.0 - self.momentum)
                .add(
                    mean.clone()
                        .detach()
                        .mul_scalar(self.momentum)
                        .reshape([channels]),
                )
                .detach(),
        );
        self.running_var.update(
            running_var
                .mul_scalar(1.0 - self.momentum)
                .add(
                    var.clone()
                        .detach()
                        .mul_scalar(self.momentum)
                        .reshape([channels]),
                )
                .detach(),
        );
        self.normalize(input, mean, var)
    }

    fn normalize<const D: usize>(
        &self,
        x: Tensor<B, D>,
        mean: Tensor<B, D>,
        var: Tensor<B, D>,
    ) -> Tensor<B, D> {
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

fn sync_sum<B: SyncBatchNormBackend>(tensor: Tensor<B, 1>) -> Tensor<B, 1> {
    Tensor::from_primitive(TensorPrimitive::Float(B::sync_sum(
        tensor.into_primitive().tensor(),
    )))
}

/// Elements per channel over all ranks (an exact all-gather of the local counts).
fn global_count(local: usize) -> u64 {
    match current().filter(|(g, _)| g.world_size() > 1) {
        None => local as u64,
        Some((group, timeout)) => match group.all_gather(&[local as u64], timeout) {
            Ok(counts) => counts.iter().sum(),
            Err(err) => raise(err.into()),
        },
    }
}

/// Forward and backward passes cannot return errors: a failed collective unwinds with the
/// [`DdpError`](crate::DdpError) itself as the panic payload, which `DdpStrategy` turns back into
/// the error. The group is aborted already, so every other rank stops too.
fn raise(err: crate::error::DdpError) -> ! {
    std::panic::panic_any(err)
}
