//! [`DistributedDataParallel`]: the lower-level API for custom training loops, the counterpart of
//! PyTorch's `torch.nn.parallel.DistributedDataParallel` wrapper.

use std::marker::PhantomData;
use std::sync::Arc;

use burn::module::AutodiffModule;
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;

use crate::group::ProcessGroup;
use crate::metrics::CommStats;
use crate::reducer::{BucketLayout, ReduceOptions, ReduceOutcome, Reducer};
use crate::replica::{
    Replica, ReplicaLayout, average_selected, broadcast_module, broadcast_selected,
    verify_values_across,
};
use crate::{DdpConfig, DdpError, Result};

/// Gradient synchronisation for one replica of a model, for training loops you write yourself.
///
/// Every rank creates one with the same model architecture; [`DistributedDataParallel::new`]
/// checks that the replicas match and broadcasts rank 0's parameters and buffers, then each step
/// [`sync_gradients`](Self::sync_gradients) averages the gradients across ranks before the
/// optimizer step, so every replica applies the same update:
///
/// ```
/// use std::sync::Arc;
/// use burn::backend::{Autodiff, NdArray};
/// use burn::nn::{Linear, LinearConfig};
/// use burn::optim::{GradientsParams, Optimizer, SgdConfig};
/// use burn::tensor::{Distribution, Tensor};
/// use burn_ddp::{DdpConfig, DistributedDataParallel, ProcessGroup, ThreadGroup};
///
/// type B = Autodiff<NdArray>;
///
/// # fn main() -> Result<(), burn_ddp::DdpError> {
/// let groups = ThreadGroup::new_group(2)?;
/// std::thread::scope(|s| {
///     for group in groups {
///         s.spawn(move || -> Result<(), burn_ddp::DdpError> {
///             let device = Default::default();
///             let group: Arc<dyn ProcessGroup> = Arc::new(group);
///             let model: Linear<B> = LinearConfig::new(4, 2).init(&device);
///             // Checks the replicas and copies rank 0's parameters to every rank.
///             let (mut ddp, mut model) =
///                 DistributedDataParallel::new(group, model, &device, DdpConfig::default())?;
///             let mut optim = SgdConfig::new().init();
///             for _ in 0..3 {
///                 // Each rank computes the loss of its own shard of the batch.
///                 let x = Tensor::<B, 2>::random([8, 4], Distribution::Default, &device);
///                 let loss = model.forward(x).mean();
///                 let grads = GradientsParams::from_grads(loss.backward(), &model);
///                 let grads = ddp.sync_gradients(&model, grads)?; // averaged over ranks
///                 model = optim.step(0.1, model, grads);
///             }
///             Ok(())
///         });
///     }
/// });
/// # Ok(())
/// # }
/// ```
///
/// Gradient accumulation (PyTorch's `no_sync`): sum the micro-batches' gradients with Burn's
/// `GradientsAccumulator` and call `sync_gradients` once per optimizer step, on the sum.
///
/// The model may change between steps the way fine-tuning changes it: a layer frozen
/// (`Module::no_grad`) or unfrozen (`set_require_grad(true)`) on every rank at the same step is
/// followed at that step (PyTorch DDP needs a new wrapper for that). A change on some ranks
/// only, or layers added, removed or replaced after `new`, is a [`DdpError::ModelChanged`] on
/// every rank naming the tensor. A weight shared by two layers (one `Param` in two places) is
/// reduced once. Frozen weights are broadcast by `new` and then left alone, as PyTorch leaves
/// parameters without `requires_grad`.
pub struct DistributedDataParallel<B: AutodiffBackend> {
    reducer: Reducer,
    device: B::Device,
    config: DdpConfig,
    _backend: PhantomData<B>,
}

impl<B: AutodiffBackend> DistributedDataParallel<B> {
    /// Prepares `module` for data-parallel training on `device`: checks with every other rank that
    /// the replicas have the same parameters and buffers (count, kind, shape, order), then
    /// broadcasts rank 0's values. Returns the synchronisation handle and the module holding rank
    /// 0's values. Every rank of `group` must call it.
    ///
    /// # Errors
    /// [`DdpError::ReplicaMismatch`] on every rank when the replicas differ (before any
    /// all-reduce); the collectives' errors ([`DdpError::Timeout`], [`DdpError::PeerLeft`], ...);
    /// [`DdpError::InvalidConfig`] for an invalid `config`.
    pub fn new<M: AutodiffModule<B>>(
        group: Arc<dyn ProcessGroup>,
        module: M,
        device: &B::Device,
        config: DdpConfig,
    ) -> Result<(Self, M)> {
        let layout = ReplicaLayout::of(&module);
        let reducer = Reducer::new(group.clone(), &layout, &config)?;
        let module = broadcast_module(module, group.as_ref(), 0, config.timeout())?;
        Ok((
            Self {
                reducer,
                device: device.clone(),
                config,
                _backend: PhantomData,
            },
            module,
        ))
    }

    /// Averages `grads` (from `GradientsParams::from_grads(loss.backward(), model)`) across all
    /// ranks, bucket by bucket; every rank must call it once per optimizer step, with the model
    /// the gradients come from. The result is bit-identical on every rank.
    ///
    /// # Errors
    /// The reducer's errors: [`DdpError::Bucket`] for a gradient of the wrong shape,
    /// [`DdpError::ModelChanged`] when `model`'s tensors changed in a way the ranks cannot follow
    /// together, the all-reduce's errors ([`DdpError::Timeout`], [`DdpError::PeerLeft`], ...).
    pub fn sync_gradients<M: AutodiffModule<B>>(
        &mut self,
        model: &M,
        grads: GradientsParams,
    ) -> Result<GradientsParams> {
        self.reducer
            .reduce::<B::InnerBackend>(&Replica::<B, M>::new(model), grads, &self.device)
    }

    /// [`sync_gradients`](Self::sync_gradients) with options (see [`Reducer::reduce_with`]):
    /// weighting, global-norm clipping, a NaN/infinity check; `None` contributes zeros (a rank
    /// without a batch in join mode).
    ///
    /// # Errors
    /// As [`sync_gradients`](Self::sync_gradients).
    pub fn sync_gradients_with<M: AutodiffModule<B>>(
        &mut self,
        model: &M,
        grads: Option<GradientsParams>,
        options: &ReduceOptions,
    ) -> Result<ReduceOutcome> {
        self.reducer.reduce_with::<B::InnerBackend>(
            &Replica::<B, M>::new(model),
            grads,
            &self.device,
            options,
        )
    }

    /// The last [`sync_gradients_with`](Self::sync_gradients_with) was an end-of-data check
    /// (every rank out of data): not counted as a gradient synchronisation.
    pub(crate) fn uncount_step(&mut self) {
        self.reducer.uncount_step();
    }

    /// Copies rank 0's parameters and buffers into every rank's `module` again (one broadcast).
    ///
    /// # Errors
    /// The broadcast's errors.
    pub fn broadcast_module<M: AutodiffModule<B>>(&self, module: M) -> Result<M> {
        broadcast_module(
            module,
            self.reducer.group().as_ref(),
            0,
            self.config.timeout(),
        )
    }

    /// Copies rank 0's buffers (BatchNorm running statistics; not frozen weights, which do not
    /// change) into every rank's `module`: PyTorch DDP's `broadcast_buffers`, which it does
    /// before every forward pass. Call it once per step when replicas are separate models
    /// (threads with independently built models, or processes) and their buffers must stay
    /// identical.
    ///
    /// # Errors
    /// The broadcast's errors.
    pub fn sync_buffers<M: AutodiffModule<B>>(&self, module: M) -> Result<M> {
        // `valid()` folds RunningState's pending updates into its value first; left pending,
        // they would overwrite the broadcast values at the next read.
        let _ = module.valid();
        broadcast_selected(
            module,
            self.reducer.group().as_ref(),
            0,
            self.config.timeout(),
            &self.reducer.replica().buffer_mask(),
        )
    }

    /// Replaces every rank's buffers by their average over the ranks (one all-reduce of the
    /// buffers): what Burn's shared `RunningState` does for replicas that are threads, for
    /// replicas that are separate models (processes). Pending BatchNorm updates are flushed first.
    ///
    /// # Errors
    /// The all-reduce's errors.
    pub fn average_buffers<M: AutodiffModule<B>>(&self, module: M) -> Result<M> {
        // `valid()` folds RunningState's per-thread pending updates into its value.
        let _ = module.valid();
        average_selected(
            module,
            self.reducer.group().as_ref(),
            self.config.timeout(),
            &self.reducer.replica().buffer_mask(),
        )
    }

    /// Makes this wrapper's process group the one [`SyncBatchNorm`](crate::SyncBatchNorm) layers
    /// synchronise with on the calling thread, until the returned guard is dropped (the
    /// strategy does this for every replica). Without it, `SyncBatchNorm` is Burn's `BatchNorm`.
    pub fn enter_sync_batch_norm(&self) -> crate::sync_bn::SyncBatchNormGuard {
        crate::sync_bn::enter_process_group(self.reducer.group().clone(), self.config.timeout())
    }

    /// Checks that every rank's `module` holds bit-identical parameters and buffers (see
    /// [`verify_values_across`]); `step` labels the error.
    ///
    /// # Errors
    /// [`DdpError::ReplicasDiverged`] naming the first differing tensor and ranks.
    pub fn check_consistency<M: AutodiffModule<B>>(&self, module: &M, step: u64) -> Result<()> {
        verify_values_across(
            module,
            self.reducer.group().as_ref(),
            step,
            self.config.timeout(),
        )
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.reducer.group().rank()
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.reducer.group().world_size()
    }

    /// The process group.
    pub fn group(&self) -> &Arc<dyn ProcessGroup> {
        self.reducer.group()
    }

    /// The gradient bucket layout.
    pub fn bucket_layout(&self) -> &BucketLayout {
        self.reducer.layout()
    }

    /// The replica layout the ranks agreed on last (kinds of every float tensor: parameter,
    /// frozen weight, buffer).
    pub fn replica_layout(&self) -> &ReplicaLayout {
        self.reducer.replica()
    }

    /// Communication counters since creation.
    pub fn comm_stats(&self) -> &CommStats {
        self.reducer.stats()
    }

    /// The configuration.
    pub fn config(&self) -> &DdpConfig {
        &self.config
    }

    /// Aborts the process group with `error`, so every other rank fails at once instead of
    /// waiting for this rank. Call it when this rank fails outside a collective.
    pub fn abort(&self, error: &DdpError) {
        self.reducer.group().abort(&error.to_string());
    }
}
