//! [`DistributedDataParallel`]: the lower-level API for custom training loops, the counterpart of
//! PyTorch's `torch.nn.parallel.DistributedDataParallel` wrapper.

use std::sync::Arc;

use burn::module::Module;
use burn::optim::lr_scheduler::module_lr_scheduler::ModuleLearningRate;
use burn::optim::{GradientsParams, ModuleOptimizer, OptimizerRecord};
use burn::tensor::Device;

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
use crate::sharding::state::{Keys, gather_record, own_record};
use crate::sharding::{OptimizerShards, sharded_step};
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
/// use burn::nn::{Linear, LinearConfig};
/// use burn::optim::{GradientsParams, ModuleOptimizer, SgdConfig};
/// use burn::tensor::{Device, Distribution, Tensor};
/// use burn_ddp::{DdpConfig, DistributedDataParallel, ProcessGroup, comm::group::ThreadGroup};
///
/// # fn main() -> Result<(), burn_ddp::DdpError> {
/// let groups = ThreadGroup::new_group(2)?;
/// std::thread::scope(|s| {
///     for group in groups {
///         s.spawn(move || -> Result<(), burn_ddp::DdpError> {
///             let device = Device::flex().autodiff();
///             let group: Arc<dyn ProcessGroup> = Arc::new(group);
///             let model: Linear = LinearConfig::new(4, 2).init(&device);
///             // Checks the replicas and copies rank 0's parameters to every rank.
///             let (mut ddp, mut model) =
///                 DistributedDataParallel::new(group, model, &device, DdpConfig::default())?;
///             let mut optim: ModuleOptimizer = SgdConfig::new().init();
///             for _ in 0..3 {
///                 // Each rank computes the loss of its own shard of the batch.
///                 let x = Tensor::<2>::random([8, 4], Distribution::Default, &device);
///                 let loss = model.forward(x).mean();
///                 let grads = GradientsParams::from_grads(loss.backward(), &model);
///                 let grads = ddp.sync_gradients(&model, grads)?; // averaged over ranks
///                 model = ddp.optimizer_step(&mut optim, 0.1, model, grads)?;
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
pub struct DistributedDataParallel {
    reducer: Reducer,
    /// The replica's device (with autodiff, as the model's).
    device: Device,
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
}

impl DistributedDataParallel {
    /// Prepares `module` for data-parallel training on `device`: checks with every other rank that
    /// the replicas have the same parameters and buffers (count, kind, shape, order), then
    /// broadcasts rank 0's values. Returns the synchronisation handle and the module holding rank
    /// 0's values. Every rank of `group` must call it.
    ///
    /// # Errors
    /// [`DdpError::ReplicaMismatch`] on every rank when the replicas differ (before any
    /// all-reduce); the collectives' errors ([`CommError::Timeout`](crate::comm::CommError::Timeout), [`CommError::PeerLeft`](crate::comm::CommError::PeerLeft), ...);
    /// [`DdpError::InvalidConfig`] for an invalid `config`.
    pub fn new<M: Module>(
        group: Arc<dyn ProcessGroup>,
        module: M,
        device: &Device,
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
    pub(crate) fn for_replica<M: Module>(
        group: Arc<dyn ProcessGroup>,
        module: M,
        device: &Device,
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
    pub fn sync_gradients<M: Module>(
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
    pub fn weigh_micro_batch<M: Module>(
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
    pub fn sync_gradients_with<M: Module>(
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
    pub(crate) fn sync_at<M: Module>(
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
        let mut outcome =
            self.reducer
                .reduce_with(&Replica::new(model), grads, &self.device, &options)?;
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
    pub fn broadcast_module<M: Module>(&self, module: M) -> Result<M> {
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
    pub fn sync_buffers<M: Module>(&self, module: M) -> Result<M> {
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
    pub(crate) fn settle_shared_buffers<M: Module>(&self, module: &M) -> Result<()> {
        if !self.reducer.replica().buffer_mask().contains(&true) {
            return Ok(());
        }
        let group = self.reducer.group();
        let (rank, timeout) = (group.rank(), self.config.timeout());
        crate::replica::sync_device(rank, &self.device, "this replica's buffer updates")?;
        group.barrier(timeout)?;
        if rank == 0 {
            // `valid()` folds every thread's pending update into the shared value.
            let _ = module.valid();
            crate::replica::sync_device(
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
    pub fn average_buffers<M: Module>(&self, module: M) -> Result<M> {
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
    pub fn check_consistency<M: Module>(&self, module: &M, step: u64) -> Result<()> {
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
    /// state for this rank's parameters only; Burn's `ModuleOptimizer` leaves a parameter
    /// without a gradient alone). Every rank must call it once per
    /// [`sync_gradients`](Self::sync_gradients), with the module the gradients are of. `lr` is
    /// what `ModuleOptimizer::step` takes: an `f64`, or a `ModuleLearningRate` of parameter groups.
    ///
    /// The optimizer's own gradient clipping (`with_grad_clipping`: by value, or each tensor by
    /// its own norm) is exact under sharding, since each tensor is stepped whole by its owner;
    /// clipping by the global norm is [`DdpConfig::with_clip_grad_norm`].
    ///
    /// # Errors
    /// With sharding, the all-gathers' ([`CommError::Timeout`](crate::comm::CommError::Timeout), [`CommError::PeerLeft`](crate::comm::CommError::PeerLeft), ...).
    pub fn optimizer_step<M: Module>(
        &self,
        optim: &mut ModuleOptimizer,
        lr: impl Into<ModuleLearningRate>,
        module: M,
        grads: GradientsParams,
    ) -> Result<M> {
        let lr = lr.into();
        let Some(shards) = &self.shards else {
            return Ok(optim.step(lr, module, grads));
        };
        sharded_step(
            shards,
            module,
            grads,
            self.reducer.group().as_ref(),
            self.config.timeout(),
            |module, grads, _| optim.step(lr, module, grads),
        )
    }

    /// Who owns which parameters, with [`DdpConfig::with_optimizer_sharding`].
    pub fn optimizer_shards(&self) -> Option<&OptimizerShards> {
        self.shards.as_ref()
    }

    /// The whole optimizer state for a checkpoint (`optim.to_record()` on every rank): with
    /// sharding, every rank's share joined on rank 0 (`Some` there, `None` elsewhere; every rank
    /// must call it), each entry filed under rank 0's parameter ids (replicas in separate
    /// processes draw their own); without, `record` itself on rank 0. `module` is this rank's
    /// model now. Save what rank 0 gets, with rank 0's model: any world size, with or without
    /// sharding, resumes from the two ([`own_optimizer_record`](Self::own_optimizer_record)).
    ///
    /// # Errors
    /// [`DdpError::Checkpoint`] when a share cannot be read or written as burnpack; the
    /// collectives' errors.
    pub fn gather_optimizer_record<M: Module>(
        &self,
        module: &M,
        record: OptimizerRecord,
    ) -> Result<Option<OptimizerRecord>> {
        match &self.shards {
            Some(shards) => gather_record(
                shards,
                &Keys::of(module),
                record,
                self.reducer.group().as_ref(),
                self.config.timeout(),
            ),
            None => Ok((self.rank() == 0).then_some(record)),
        }
    }

    /// This rank's share of a whole optimizer `record` (one loaded from a checkpoint), with
    /// sharding; `record` itself without. `module` is this rank's model with the checkpoint's
    /// model loaded (its parameter ids are the record's keys). Load the result into the optimizer
    /// (`optim.load_record(..)`) before the first step.
    ///
    /// # Errors
    /// [`DdpError::Checkpoint`] when the record cannot be read or written as burnpack.
    pub fn own_optimizer_record<M: Module>(
        &self,
        module: &M,
        record: OptimizerRecord,
    ) -> Result<OptimizerRecord> {
        match &self.shards {
            Some(shards) => own_record(shards, &Keys::of(module), record),
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use burn::nn::{Linear, LinearConfig};
    use burn::optim::AdamConfig;
    use burn::tensor::{Tensor, TensorData};

    use super::*;
    use crate::replica::tensor_fingerprints;
    use crate::replica::tests::test_device;
    use burn_ddp_comm::group::ThreadGroup;

    #[derive(Module, Debug)]
    struct Net {
        a: Linear,
        b: Linear,
    }

    /// Samples of every step: 12 rows (2 ranks take 6 each, 3 take 4).
    const ROWS: usize = 12;

    fn net() -> Net {
        net_on(&test_device())
    }

    fn net_on(device: &Device) -> Net {
        Net {
            a: LinearConfig::new(4, 5).init(device),
            b: LinearConfig::new(5, 2).init(device),
        }
    }

    /// Step `step`'s inputs and targets, rows `rows` of them.
    fn batch(step: usize, rows: std::ops::Range<usize>, device: &Device) -> (Tensor<2>, Tensor<2>) {
        let value = |row: usize, col: usize, salt: usize| {
            (((row * 7 + col * 3 + step * 11 + salt) % 17) as f32 - 8.0) / 8.0
        };
        let n = rows.len();
        let x: Vec<f32> = rows
            .clone()
            .flat_map(|r| (0..4).map(move |c| value(r, c, 0)))
            .collect();
        let y: Vec<f32> = rows
            .flat_map(|r| (0..2).map(move |c| value(r, c, 5)))
            .collect();
        (
            Tensor::from_data(TensorData::new(x, [n, 4]), device),
            Tensor::from_data(TensorData::new(y, [n, 2]), device),
        )
    }

    /// The mean squared error of `model` on step `step`'s rows `rows` (on the model's device).
    fn loss(model: &Net, step: usize, rows: std::ops::Range<usize>) -> Tensor<1> {
        let (x, y) = batch(step, rows, &model.a.weight.device());
        let out = model.b.forward(model.a.forward(x).tanh());
        (out - y).powi_scalar(2).mean()
    }

    /// Plain Burn on one device: steps `steps` on the whole batches, Adam at 1e-2.
    fn plain(
        mut model: Net,
        mut optim: ModuleOptimizer,
        steps: std::ops::Range<usize>,
    ) -> (Net, ModuleOptimizer) {
        for step in steps {
            let grads = GradientsParams::from_grads(loss(&model, step, 0..ROWS).backward(), &model);
            model = optim.step(1e-2, model, grads);
        }
        (model, optim)
    }

    /// burn-ddp on `world` thread ranks, each on its shard of every batch, from `model` (on its
    /// device) and each rank's optimizer `optim(ddp, model)`: every rank's model after `steps`
    /// and bytes of optimizer state, and rank 0's whole optimizer record.
    fn ddp(
        model: &Net,
        world: usize,
        config: &DdpConfig,
        steps: std::ops::Range<usize>,
        optim: impl Fn(&DistributedDataParallel, &Net) -> ModuleOptimizer + Sync,
    ) -> (Vec<Net>, Vec<u64>, Option<OptimizerRecord>) {
        let groups = ThreadGroup::new_group(world).unwrap();
        let per = ROWS / world;
        let device = model.a.weight.device();
        let results: Vec<(Net, u64, Option<OptimizerRecord>)> = std::thread::scope(|s| {
            let handles: Vec<_> = groups
                .into_iter()
                .enumerate()
                .map(|(rank, group)| {
                    let (model, config, steps, optim, device) = (
                        model.clone(),
                        config.clone(),
                        steps.clone(),
                        &optim,
                        device.clone(),
                    );
                    s.spawn(move || {
                        let group: Arc<dyn ProcessGroup> = Arc::new(group);
                        let (mut ddp, mut model) =
                            DistributedDataParallel::new(group, model, &device, config).unwrap();
                        let mut optim = optim(&ddp, &model);
                        for step in steps {
                            let rows = rank * per..(rank + 1) * per;
                            let grads = GradientsParams::from_grads(
                                loss(&model, step, rows).backward(),
                                &model,
                            );
                            let grads = ddp.sync_gradients(&model, grads).unwrap();
                            model = ddp.optimizer_step(&mut optim, 1e-2, model, grads).unwrap();
                        }
                        let state =
                            crate::sharding::state::optimizer_state_bytes(optim.to_record())
                                .unwrap();
                        let record = ddp
                            .gather_optimizer_record(&model, optim.to_record())
                            .unwrap();
                        (model, state, record)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let (mut models, mut states, mut record) = (Vec::new(), Vec::new(), None);
        for (model, state, r) in results {
            models.push(model);
            states.push(state);
            record = record.take().or(r);
        }
        (models, states, record)
    }

    /// Every parameter of `model` as `f32` values, registration order.
    fn values(model: &Net) -> Vec<Vec<f32>> {
        [
            model.a.weight.val().into_data(),
            model.a.bias.as_ref().unwrap().val().into_data(),
            model.b.weight.val().into_data(),
            model.b.bias.as_ref().unwrap().val().into_data(),
        ]
        .into_iter()
        .map(|d| d.try_to_vec::<f32>().unwrap())
        .collect()
    }

    /// Every rank bit-identical, and within float rounding of plain Burn.
    fn assert_as_plain(models: &[Net], reference: &Net, case: &str) {
        let expected = values(reference);
        for (rank, model) in models.iter().enumerate() {
            assert_eq!(
                tensor_fingerprints(model),
                tensor_fingerprints(&models[0]),
                "{case}: rank {rank} differs from rank 0"
            );
            for (tensor, (got, want)) in values(model).iter().zip(&expected).enumerate() {
                for (g, w) in got.iter().zip(want) {
                    assert!(
                        (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
                        "{case}: rank {rank}, tensor {tensor}: {g} against plain Burn's {w}"
                    );
                }
            }
        }
    }

    fn adam() -> ModuleOptimizer {
        AdamConfig::new().init()
    }

    #[test]
    fn every_rank_trains_as_plain_burn_on_the_whole_batch_with_and_without_sharding() {
        // On Burn's default autodiff device, and on one that checkpoints the gradients (which
        // the parameters taken from other ranks must keep, as their inputs have it).
        for device in [test_device(), test_device().gradient_checkpointing()] {
            trains_as_plain_burn_on(&device);
        }
    }

    fn trains_as_plain_burn_on(device: &Device) {
        let start = net_on(device);
        let layout = crate::replica::ReplicaLayout::of(&start);
        let (reference, _) = plain(start.clone(), adam(), 0..4);
        let settings = [
            ("no sharding", DdpConfig::default()),
            ("ZeRO-1", DdpConfig::default().with_optimizer_sharding(true)),
            (
                "ZeRO-2",
                DdpConfig::default()
                    .with_optimizer_sharding(true)
                    .with_gradient_sharding(true),
            ),
            (
                "ZeRO-1 through host memory",
                DdpConfig::default()
                    .with_optimizer_sharding(true)
                    .with_shared_memory_reduction(false),
            ),
        ];
        for world in [2, 3] {
            for (name, config) in &settings {
                let config = config.clone().with_timeout(Duration::from_secs(30));
                let case = format!("{name}, {world} ranks, {device:?}");
                let (models, states, _) = ddp(&start, world, &config, 0..4, |_, _| adam());
                assert_as_plain(&models, &reference, &case);
                // Adam's two moments of the parameters each rank steps: its own under sharding.
                for (rank, state) in states.iter().enumerate() {
                    let stepped = match config.optimizer_sharding() {
                        true => OptimizerShards::new(&layout, rank, world).bytes_per_rank()[rank],
                        false => layout.parameters().map(|t| (t.numel() * 4) as u64).sum(),
                    };
                    assert_eq!(*state, 2 * stepped, "{case}: rank {rank}'s optimizer state");
                }
            }
        }
    }

    #[test]
    fn a_sharded_run_resumes_plain_burns_optimizer_state_and_gathers_it_back_whole() {
        // Burn 0.22's `ModuleOptimizer::load_record` puts the state on `Device::default()`:
        // CUDA in a build with the `cuda` feature (on a machine without a GPU cudarc panics),
        // the CPU with `BURN_DEVICE=flex` (which `.ci/run` and docs/development.md's command set).
        assert!(
            crate::replica::shares_plain_values(&Device::default()),
            "run the tests with BURN_DEVICE=flex: Burn's default device is {:?}",
            Device::default()
        );
        // Plain Burn trains two steps and saves; it goes on for two more.
        let (saved_model, saved_optim) = plain(net(), adam(), 0..2);
        let saved = saved_optim.to_record().into_bytes().unwrap();
        let (reference, reference_optim) = plain(saved_model.clone(), saved_optim, 2..4);
        for world in [2, 3] {
            let config = DdpConfig::default()
                .with_optimizer_sharding(true)
                .with_gradient_sharding(true)
                .with_timeout(Duration::from_secs(30));
            // Each rank resumes its own share of the saved state.
            let (models, _, record) = ddp(&saved_model, world, &config, 2..4, |ddp, model| {
                let whole = OptimizerRecord::from_bytes(saved.clone()).unwrap();
                let own = ddp.own_optimizer_record(model, whole).unwrap();
                adam().load_record(own)
            });
            assert_as_plain(&models, &reference, &format!("resumed on {world} ranks"));
            // The state gathered on rank 0 is plain Burn's: one more step from each agrees.
            let record = record.expect("rank 0 gets the whole record");
            let (from_gathered, _) = plain(models[0].clone(), adam().load_record(record), 4..5);
            let (from_plain, _) = plain(reference.clone(), reference_optim.clone(), 4..5);
            assert_as_plain(
                &[from_gathered],
                &from_plain,
                &format!("gathered on {world} ranks"),
            );
        }
    }

    #[test]
    fn the_custom_loop_refuses_a_setting_of_training_runs_naming_it() {
        let groups = ThreadGroup::new_group(1).unwrap();
        let group: Arc<dyn ProcessGroup> = Arc::new(groups.into_iter().next().unwrap());
        let config = DdpConfig::default().with_checkpoint_every(5);
        let err = DistributedDataParallel::new(group, net(), &test_device(), config)
            .err()
            .expect("a run's setting is refused");
        assert!(err.to_string().contains("with_checkpoint_every"), "{err}");
    }
}
