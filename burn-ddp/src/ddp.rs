//! [`DistributedDataParallel`]: the lower-level API for custom training loops, the counterpart of
//! PyTorch's `torch.nn.parallel.DistributedDataParallel` wrapper.

use std::marker::PhantomData;
use std::sync::Arc;

use burn::module::AutodiffModule;
use burn::optim::{GradientsParams, Optimizer};
use burn::record::Record;
use burn::tensor::backend::AutodiffBackend;

use crate::config::{DdpConfig, NonFinite};
use crate::context::RankHold;
use crate::error::{DdpError, Result};
use crate::lockstep::{Position, Probe};
use crate::metrics::CommStats;
use crate::reducer::{BucketLayout, ReduceOptions, ReduceOutcome, Reducer, ReducerOptions};
use crate::replica::{
    Replica, ReplicaLayout, average_selected, broadcast_autodiff_module, broadcast_selected,
    verify_values_across,
};
use crate::sharding::OptimizerShards;
use crate::sharding::state::{Keys, gather_record, own_record};
use burn_ddp_comm::group::ProcessGroup;

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
/// use burn_ddp::{DdpConfig, DistributedDataParallel, ProcessGroup, group::ThreadGroup};
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
/// With [`DdpConfig::with_optimizer_sharding`], step with
/// [`ddp.optimizer_step(&mut optim, lr, model, grads)`](Self::optimizer_step) instead of
/// `optim.step(lr, model, grads)`: each rank steps its own parameters and the others' arrive by
/// all-gather; save [`gather_optimizer_record`](Self::gather_optimizer_record)'s whole state.
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
    /// Gradient synchronisations so far (the lockstep check's and the consistency check's count).
    syncs: u64,
    /// What shows a different optimizer in the first steps.
    probe: Probe,
    /// Who owns which parameters, with [`DdpConfig::with_optimizer_sharding`].
    shards: Option<OptimizerShards>,
    /// The sampler epoch and steps drawn at the last synchronisation (how many micro-batches a
    /// synchronisation covers).
    last_drawn: Option<(u64, u64)>,
    /// The step (sampler epoch, steps drawn) whose micro-batch [`weigh_micro_batch`] weighed.
    ///
    /// [`weigh_micro_batch`]: Self::weigh_micro_batch
    weighed: Option<(u64, u64)>,
    /// `burn_ddp::rank()` on the thread that built this wrapper.
    _rank: RankHold,
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
    /// all-reduce); the collectives' errors ([`CommError::Timeout`](crate::comm::CommError::Timeout), [`CommError::PeerLeft`](crate::comm::CommError::PeerLeft), ...);
    /// [`DdpError::InvalidConfig`] for an invalid `config`.
    pub fn new<M: AutodiffModule<B>>(
        group: Arc<dyn ProcessGroup>,
        module: M,
        device: &B::Device,
        config: DdpConfig,
    ) -> Result<(Self, M)> {
        if let Err(err) = custom_loop_settings(&config) {
            // Every rank has the same configuration; the abort covers one that does not.
            group.abort(&err.to_string());
            return Err(err);
        }
        Self::for_replica(group, module, device, config)
    }

    /// [`new`](Self::new) with every setting of `config` accepted: the strategy's, which uses
    /// the settings that belong to a training run itself.
    pub(crate) fn for_replica<M: AutodiffModule<B>>(
        group: Arc<dyn ProcessGroup>,
        module: M,
        device: &B::Device,
        config: DdpConfig,
    ) -> Result<(Self, M)> {
        config.validate()?;
        let rank = crate::context::hold_rank(group.rank(), group.world_size());
        let layout = ReplicaLayout::of(&module);
        let mut reducer = Reducer::new(group.clone(), &layout, &ReducerOptions::of(&config))?;
        let shards = config.optimizer_sharding().then(|| {
            OptimizerShards::new(&layout, group.rank(), group.world_size())
                .sharing(config.shared_memory_reduction())
                .gradients_sharded(config.gradient_sharding())
        });
        if let Some(shards) = &shards {
            // ZeRO stage 2: each rank receives its own parameters' reduced gradients only.
            reducer.scatter_by(shards.owners().into(), shards.own());
        }
        let module = broadcast_autodiff_module(module, group.as_ref(), 0, config.timeout())?;
        Ok((
            Self {
                reducer,
                device: device.clone(),
                syncs: 0,
                probe: Probe::new(&layout),
                shards,
                last_drawn: None,
                weighed: None,
                _rank: rank,
                config,
                _backend: PhantomData,
            },
            module,
        ))
    }

    /// Averages `grads` (from `GradientsParams::from_grads(loss.backward(), model)`) across all
    /// ranks, bucket by bucket; every rank must call it once per optimizer step, with the model
    /// the gradients come from. The result is bit-identical on every rank; with
    /// [`DdpConfig::with_optimizer_sharding`] it holds every parameter's reduced gradient (clip
    /// or log them here), and with [`DdpConfig::with_gradient_sharding`] too (ZeRO-2) only this
    /// rank's own parameters' (reduce-scattered, on the CPU groups); either way step with
    /// [`optimizer_step`](Self::optimizer_step), not `optim.step` (which would not share the
    /// step between the ranks).
    ///
    /// The configuration's step settings apply: clipping by the global norm
    /// ([`DdpConfig::with_clip_grad_norm`]); non-finite gradients
    /// ([`DdpConfig::with_non_finite`]): by default the result is then empty, so the optimizer
    /// step that follows changes nothing, or
    /// [`DdpError::NonFinite`]; the consistency check every `k` synchronisations
    /// ([`DdpConfig::with_consistency_check_every`]).
    ///
    /// The ranks must be in step: when this thread draws its batches from a
    /// [`DistributedDataLoader`](crate::DistributedDataLoader), every synchronisation also
    /// compares the ranks' epochs, batch counts and batch sizes (a rank that skipped a
    /// synchronisation, or whose loader was built with another batch size, is found at once;
    /// the loader compared is the last one iterated on this thread, so iterate another one, a
    /// validation loader say, between a batch and its synchronisation on every rank or on none),
    /// and the first synchronisations compare the parameters after the optimizer's first steps
    /// (another optimizer or hyper-parameters). All of it rides in the gradient reduction. With
    /// another loader only the parameters are compared.
    ///
    /// # Errors
    /// The reducer's errors: [`DdpError::Bucket`] for a gradient of the wrong shape,
    /// [`DdpError::ModelChanged`] when `model`'s tensors changed in a way the ranks cannot follow
    /// together, the all-reduce's errors ([`CommError::Timeout`](crate::comm::CommError::Timeout), [`CommError::PeerLeft`](crate::comm::CommError::PeerLeft), ...);
    /// [`DdpError::OutOfStep`] when the ranks are not at the same point of training;
    /// [`DdpError::NonFinite`] with [`NonFinite::Error`](crate::config::NonFinite::Error);
    /// [`DdpError::ReplicasDiverged`] from the consistency check.
    pub fn sync_gradients<M: AutodiffModule<B>>(
        &mut self,
        model: &M,
        grads: GradientsParams,
    ) -> Result<GradientsParams> {
        let options = ReduceOptions {
            weight: self.step_weight()?,
            clip_norm: self.config.clip_grad_norm(),
            check_finite: self.config.non_finite() != NonFinite::Ignore,
            ..ReduceOptions::default()
        };
        let outcome = self.sync_gradients_with(model, Some(grads), &options)?;
        if !outcome.non_finite {
            return Ok(outcome.grads);
        }
        match self.config.non_finite() {
            NonFinite::Error => {
                let flags = self.group().all_gather(
                    &[u64::from(outcome.local_non_finite)],
                    self.config.timeout(),
                )?;
                Err(DdpError::NonFinite {
                    rank: self.rank(),
                    epoch: crate::sampler::drawn_on_this_thread().map_or(0, |d| d.epoch as usize),
                    step: self.syncs - 1,
                    ranks: (0..flags.len()).filter(|&r| flags[r] != 0).collect(),
                })
            }
            NonFinite::SkipStep | NonFinite::Ignore => {
                burn_ddp_comm::log::warn_console(&format!(
                    "rank {}: gradient synchronisation #{} skipped: the gradients are \
                     not finite",
                    self.rank(),
                    self.syncs - 1
                ));
                Ok(GradientsParams::new())
            }
        }
    }

    /// The factor of this rank's gradients in the synchronisation about to happen: its share of
    /// the step's samples when this thread draws its batches from a
    /// [`DistributedDataLoader`](crate::DistributedDataLoader) and the synchronisation covers
    /// one batch (1 but in a short last step); 1 for micro-batches, which
    /// [`weigh_micro_batch`](Self::weigh_micro_batch) weighed one by one.
    ///
    /// # Errors
    /// [`DdpError::InvalidConfig`] (after aborting the group) when the micro-batches of a
    /// synchronisation include a short one that was not weighed.
    fn step_weight(&mut self) -> Result<f32> {
        let Some(drawn) = crate::sampler::drawn_on_this_thread() else {
            return Ok(1.0);
        };
        let covered = match self.last_drawn {
            Some((epoch, batches)) if epoch == drawn.epoch => drawn.batches.saturating_sub(batches),
            _ => drawn.batches,
        };
        self.last_drawn = Some((drawn.epoch, drawn.batches));
        if covered <= 1 {
            return Ok(drawn.weight());
        }
        if drawn.short_step() && self.weighed != Some((drawn.epoch, drawn.batches)) {
            let err = DdpError::InvalidConfig(format!(
                "rank {}: gradient synchronisation #{} covers {covered} micro-batches, the last \
                 of them the epoch's short last step ({} samples over all ranks instead of {}): \
                 pass each micro-batch's gradients through ddp.weigh_micro_batch(&model, grads) \
                 before accumulating them, so that each rank counts by its samples",
                self.rank(),
                self.syncs,
                drawn.global_samples,
                drawn.full_step_samples
            ));
            self.group().abort(&err.to_string());
            return Err(err);
        }
        Ok(1.0)
    }

    /// A micro-batch's gradients weighed by this rank's share of the micro-batch's samples over
    /// all ranks, for gradient accumulation in a loop of your own: identity but in an epoch's
    /// short last step, where ranks hold different numbers of samples. Call it on each
    /// micro-batch's gradients (right after the batch is drawn from a
    /// [`DistributedDataLoader`](crate::DistributedDataLoader)) before adding them to the
    /// accumulator; [`sync_gradients`](Self::sync_gradients) then averages the sum as it is.
    /// Without accumulation `sync_gradients` weighs the batch itself.
    pub fn weigh_micro_batch<M: AutodiffModule<B>>(
        &mut self,
        model: &M,
        mut grads: GradientsParams,
    ) -> GradientsParams {
        if let Some(drawn) = crate::sampler::drawn_on_this_thread() {
            let weight = drawn.weight();
            if weight != 1.0 {
                crate::reducer::scale_gradients(model, &mut grads, weight);
            }
            self.weighed = Some((drawn.epoch, drawn.batches));
        }
        grads
    }

    /// [`sync_gradients`](Self::sync_gradients) with options (see [`Reducer::reduce_with`]):
    /// weighting, global-norm clipping, a NaN/infinity check, words of your own; `None`
    /// contributes zeros (a rank without a batch in join mode). The options are used as given
    /// (the configuration's clipping and non-finite policy are not added), the lockstep and
    /// consistency checks run as in `sync_gradients`.
    ///
    /// # Errors
    /// As [`sync_gradients`](Self::sync_gradients), but non-finite gradients are reported in the
    /// outcome, not as an error.
    pub fn sync_gradients_with<M: AutodiffModule<B>>(
        &mut self,
        model: &M,
        grads: Option<GradientsParams>,
        options: &ReduceOptions,
    ) -> Result<ReduceOutcome> {
        let every = self.config.consistency_check_every();
        if every > 0 && self.syncs > 0 && self.syncs.is_multiple_of(every) {
            // The model after `syncs` optimizer steps.
            self.check_consistency(model, self.syncs)?;
        }
        let drawn = crate::sampler::drawn_on_this_thread().unwrap_or_default();
        let position = Position {
            epoch: drawn.epoch,
            batches: drawn.batches,
            samples: drawn.global_samples,
            ..Position::default()
        };
        let mut options = options.clone();
        if let (Some(shards), None, true) =
            (&self.shards, &options.keep, self.config.gradient_sharding())
        {
            // ZeRO stage 2: only this rank's parameters are stepped (`optimizer_step`), and
            // only their reduced gradients come back. Under optimizer-state sharding alone every
            // gradient does, as the setting promises (a loop may clip or log them first).
            options.keep = Some(shards.own());
        }
        let (outcome, in_step) = self.sync_at(model, grads, options, position)?;
        in_step?;
        Ok(outcome)
    }

    /// One gradient synchronisation at `position` (the probe of the first steps is added here):
    /// the reduction with `options` (the caller's words first, the position's after them, which
    /// are taken off the outcome again), and whether the ranks were in step. A rank out of step is
    /// reported by every rank; the strategy decides which failure to report first (an end of data
    /// makes the ranks' positions differ too).
    pub(crate) fn sync_at<M: AutodiffModule<B>>(
        &mut self,
        model: &M,
        grads: Option<GradientsParams>,
        mut options: ReduceOptions,
        mut position: Position,
    ) -> Result<(ReduceOutcome, Result<()>)> {
        let sync = self.syncs;
        position.probe = self.probe.at(model, sync);
        let caller = options.words.len();
        let room = ReduceOptions::MAX_WORDS - Position::WORDS;
        if caller > room {
            let err = DdpError::InvalidConfig(format!(
                "{caller} words in ReduceOptions::words; DistributedDataParallel leaves room for \
                 {room} (it sends {} of its own)",
                Position::WORDS
            ));
            // Every rank passes the same options; the abort covers one that does not.
            self.group().abort(&err.to_string());
            return Err(err);
        }
        options.words.extend(position.words());
        let mut outcome = self.reducer.reduce_with::<B::InnerBackend>(
            &Replica::<B, M>::new(model),
            grads,
            &self.device,
            &options,
        )?;
        self.syncs += 1;
        let lockstep = outcome.words.split_off(caller.min(outcome.words.len()));
        let in_step = crate::lockstep::check(
            &lockstep,
            &position,
            self.reducer.group().as_ref(),
            sync,
            self.config.timeout(),
        );
        Ok((outcome, in_step))
    }

    /// The last synchronisation was an end-of-data check (every rank out of data): not counted as
    /// a gradient synchronisation.
    pub(crate) fn uncount_step(&mut self) {
        self.reducer.uncount_step();
        self.syncs = self.syncs.saturating_sub(1);
    }

    /// Copies rank 0's parameters and buffers into every rank's `module` again (one broadcast).
    ///
    /// # Errors
    /// The broadcast's errors.
    pub fn broadcast_module<M: AutodiffModule<B>>(&self, module: M) -> Result<M> {
        broadcast_autodiff_module(
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

    /// Folds the pending buffer updates of thread replicas whose models are clones of one module
    /// (the strategy's threads), and so share Burn's `RunningState` (BatchNorm's statistics),
    /// into its value on rank 0's thread, complete before any replica reads it. Every rank must
    /// call it at the same point, after its own updates (one per forward pass).
    ///
    /// `RunningState` keeps each thread's update apart until some thread folds them all into
    /// one value: left to Burn, whichever replica reads first folds them, on its own stream, and
    /// the others read that value before the device has computed it (an asynchronous runtime:
    /// wgpu, CUDA), so a replica validated with garbage statistics now and then. Here every
    /// replica finishes its own work, rank 0 folds and waits for the device, and no replica
    /// reads before. Nothing happens when the model has no buffers.
    ///
    /// # Errors
    /// The barriers' errors ([`CommError::Timeout`](crate::comm::CommError::Timeout), [`CommError::PeerLeft`](crate::comm::CommError::PeerLeft)); [`DdpError::Device`]
    /// when the device reports a failed kernel.
    pub(crate) fn settle_shared_buffers<M: AutodiffModule<B>>(&self, module: &M) -> Result<()> {
        if !self.reducer.replica().buffer_mask().contains(&true) {
            return Ok(());
        }
        let group = self.reducer.group();
        let (rank, timeout) = (group.rank(), self.config.timeout());
        crate::replica::sync_device::<B>(rank, &self.device, "this replica's buffer updates")?;
        group.barrier(timeout)?;
        if rank == 0 {
            // `valid()` folds every thread's pending update into the shared value.
            let _ = module.valid();
            crate::replica::sync_device::<B>(
                rank,
                &self.device,
                "folding the replicas' buffer updates",
            )?;
        }
        Ok(group.barrier(timeout)?)
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

    /// Checks that every rank's `module` holds bit-identical parameters and buffers (every
    /// tensor's value fingerprint compared with rank 0's); `step` labels the error.
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

    /// The optimizer step on the synchronised `grads`: `optim.step(lr, module, grads)`, or,
    /// with [`DdpConfig::with_optimizer_sharding`], the step of this rank's own parameters
    /// followed by the all-gather of every rank's ([`OptimizerShards`]: the optimizer keeps
    /// state for this rank's parameters only). Every rank must call it once per
    /// [`sync_gradients`](Self::sync_gradients), with the module the gradients are of.
    ///
    /// # Errors
    /// With sharding, the all-gather's ([`CommError::Timeout`](crate::comm::CommError::Timeout), [`CommError::PeerLeft`](crate::comm::CommError::PeerLeft), ...).
    pub fn optimizer_step<M: AutodiffModule<B>, O: Optimizer<M, B>>(
        &self,
        optim: &mut O,
        lr: f64,
        module: M,
        mut grads: GradientsParams,
    ) -> Result<M> {
        let Some(shards) = &self.shards else {
            return Ok(optim.step(lr, module, grads));
        };
        // What the owners step: the trainable tensors before the step.
        let stepped = crate::sharding::trainable_places(&module);
        shards.keep_own(&module, &mut grads);
        let module = optim.step(lr, module, grads);
        let (module, gathered) = shards.exchange_stepped(
            module,
            &stepped,
            self.reducer.group().as_ref(),
            self.config.timeout(),
        );
        gathered.map(|()| module)
    }

    /// Who owns which parameters, with [`DdpConfig::with_optimizer_sharding`].
    pub fn optimizer_shards(&self) -> Option<&OptimizerShards> {
        self.shards.as_ref()
    }

    /// The whole optimizer state for a checkpoint: with sharding, every rank's share joined on
    /// rank 0 (`Some` there, `None` elsewhere; every rank must call it), each entry filed under
    /// rank 0's parameter ids (replicas in separate processes draw their own); without, `record`
    /// itself on rank 0. `module` is this rank's model now. Save what rank 0 gets, with rank 0's
    /// model: any world size, with or without sharding, resumes from the two
    /// ([`own_optimizer_record`](Self::own_optimizer_record)).
    ///
    /// # Errors
    /// [`DdpError::InvalidConfig`] when the optimizer's record is not kept per parameter (Burn's
    /// `OptimizerAdaptor` is); the collectives' errors.
    pub fn gather_optimizer_record<M: AutodiffModule<B>, R: Record<B>>(
        &self,
        module: &M,
        record: R,
    ) -> Result<Option<R>> {
        match &self.shards {
            Some(shards) => gather_record(
                shards,
                &Keys::of(module),
                record,
                self.reducer.group().as_ref(),
                self.config.timeout(),
                &self.device,
            ),
            None => Ok((self.rank() == 0).then_some(record)),
        }
    }

    /// This rank's share of a whole optimizer `record` (one loaded from a checkpoint), with
    /// sharding; `record` itself without. `module` is this rank's model with the checkpoint's
    /// model loaded (its parameter ids are the record's keys). Load the result into the optimizer
    /// before the first step.
    ///
    /// # Errors
    /// As [`gather_optimizer_record`](Self::gather_optimizer_record), without the collectives'.
    pub fn own_optimizer_record<M: AutodiffModule<B>, R: Record<B>>(
        &self,
        module: &M,
        record: R,
    ) -> Result<R> {
        match &self.shards {
            Some(shards) => own_record(shards, &Keys::of(module), record, &self.device),
            None => Ok(record),
        }
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

/// The settings of a [`DdpConfig`] that belong to a training run (checkpoints, resume,
/// validation, burn-train's metrics, uneven data, buffers): [`DistributedDataParallel::new`]
/// refuses them set to anything but their default, since a loop of your own does those things
/// itself, rather than accept them and do nothing. (`with_stop_on_signal(false)` and
/// `with_summary(false)` are what a custom loop does anyway: no handlers, no summary.)
///
/// # Errors
/// [`DdpError::InvalidConfig`] naming the first such setting and what to do instead.
fn custom_loop_settings(config: &DdpConfig) -> Result<()> {
    let default = DdpConfig::default();
    let refused: [(bool, &str, &str); 10] = [
        (
            config.checkpoint_dir().is_some(),
            "with_checkpoint_dir",
            "save your model and optimizer records yourself",
        ),
        (
            config.resume(),
            "with_resume",
            "load your records before building the wrapper",
        ),
        (
            config.checkpoint_every() != 0,
            "with_checkpoint_every",
            "save your records every k steps yourself",
        ),
        (
            config.validation() != default.validation(),
            "with_validation",
            "validate in your loop (shard the validation set with DistributedSampler::with_rank)",
        ),
        (
            config.metrics_every() != default.metrics_every(),
            "with_metrics_every",
            "report metrics from your loop",
        ),
        (
            config.uneven_inputs() != default.uneven_inputs(),
            "with_uneven_inputs",
            "pass None to sync_gradients_with for a rank without a batch, with weights in \
             ReduceOptions",
        ),
        (
            config.buffer_sync() != default.buffer_sync(),
            "with_buffer_sync",
            "call sync_buffers or average_buffers after your optimizer step",
        ),
        (
            config.epoch_end_timeout() != default.epoch_end_timeout(),
            "with_epoch_end_timeout",
            "a custom loop has no end-of-epoch meeting of burn-ddp's",
        ),
        (
            config.metrics_file().is_some(),
            "with_metrics_file",
            "write your loop's figures yourself",
        ),
        (
            config.spike_factor().to_bits() != default.spike_factor().to_bits(),
            "with_spike_factor",
            "time sync_gradients in your loop (DdpStrategy's report does it for its runs)",
        ),
    ];
    match refused.iter().find(|(set, _, _)| *set) {
        Some((_, setting, instead)) => Err(DdpError::InvalidConfig(format!(
            "DdpConfig::{setting} is a setting of DdpStrategy's training runs, which \
             DistributedDataParallel does not do: {instead}"
        ))),
        None => Ok(()),
    }
}
