//! The harness's custom-loop cases: the case's model trained by a loop a user writes with
//! `DistributedDataParallel` (each rank iterating a `DistributedDataLoader` of its own shard with
//! `iter_steps`, micro-batches weighed with `weigh_micro_batch` and summed by Burn's
//! `GradientsAccumulator`, `sync_gradients`, `optimizer_step`, a layer unfrozen by the loop
//! itself, `SyncBatchNorm` entered for the run), against the same loop in plain Burn on one
//! device over Burn's own loader of the global batch. The scheduler steps once per optimizer
//! step, right before it, as burn-train 0.22's loop does, and micro-batches left over at an
//! epoch's end are dropped on both sides.

use std::sync::Arc;

use burn::data::dataloader::DataLoaderBuilder;
use burn::data::dataset::InMemDataset;
use burn::module::Module;
use burn::optim::lr_scheduler::LrScheduler;
use burn::optim::{GradientsAccumulator, GradientsParams, ModuleOptimizer};
use burn::train::{ClassificationOutput, TrainStep};
use burn_ddp::group::ThreadGroup;
use burn_ddp::metrics::CommStats;
use burn_ddp::{
    DdpError, DistributedDataLoader, DistributedDataParallel, DistributedSampler, ProcessGroup,
};
use burn_ddp_tests::{
    Batch, BnCnn, ItemBatcher, Mlp, Permuted, SplitSeen, SyncBnCnn, clip_global_norm,
    deterministic, device, float_tensors, over_tcp, synthetic_dataset, with_values,
};

use super::cases::{Case, Clip, Model, Transport};
use super::parts::{Freezing, Sched, Special, optim};
use super::{CLIP, Observed, settings};

/// The seed of the training data (as `run_training`'s) and of the sampler's order (`Run`'s).
const DATA_SEED: u64 = 99;
const ORDER_SEED: u64 = 7;

/// What a loop does after its optimizer step number `steps` (from 1): fine-tuning's unfreezing.
type AfterStep<M> = fn(M, usize) -> M;

/// One rank's trained tensors and its communication counters.
type RankTrained = (Vec<Vec<f32>>, CommStats);

/// Trains a custom-loop case on one device (`None`) or on `replicas` ranks.
pub(super) fn observe(case: &Case, replicas: Option<usize>) -> Observed {
    fn keep<M>(model: M, _: usize) -> M {
        model
    }
    let freezing = |seed| {
        deterministic(
            Freezing {
                inner: Mlp::new(&device()).with_first_frozen(),
                unfreeze_after: (case.model == Model::Unfrozen).then_some(2),
            },
            seed,
        )
    };
    let unfreeze: AfterStep<Freezing> = |model, steps| match model.unfreeze_after {
        Some(after) if after == steps => Freezing {
            inner: model.inner.unfreeze_first(),
            unfreeze_after: None,
        },
        _ => model,
    };
    let special = |seed| {
        deterministic(
            Special::new(
                &device(),
                case.model == Model::Tied,
                case.model == Model::PartlyUnused,
            ),
            seed,
        )
    };
    match (case.model, replicas) {
        (Model::Plain, _) => drive(
            case,
            replicas,
            |s| deterministic(Mlp::new(&device()), s),
            keep,
        ),
        (Model::Frozen | Model::Unfrozen, _) => drive(case, replicas, freezing, unfreeze),
        (Model::Tied | Model::PartlyUnused, _) => drive(case, replicas, special, keep),
        (Model::SyncBn, Some(_)) => drive(
            case,
            replicas,
            |s| deterministic(SyncBnCnn::new(&device()), s),
            keep,
        ),
        // Burn's own BatchNorm on one device, from the values SyncBatchNorm starts from.
        (Model::SyncBn, None) => drive(
            case,
            None,
            |s| {
                with_values(
                    BnCnn::new(&device()),
                    &float_tensors(&deterministic(SyncBnCnn::new(&device()), s)),
                )
            },
            keep,
        ),
        (model, _) => panic!("no custom-loop case trains {model:?}"),
    }
}

/// One device's loop, or every rank's (each from a model of its own seed: rank 0's is one
/// device's, which `DistributedDataParallel::new` broadcasts).
fn drive<M>(
    case: &Case,
    replicas: Option<usize>,
    model: impl Fn(u64) -> M + Sync,
    after_step: AfterStep<M>,
) -> Observed
where
    M: TrainStep<Input = Batch, Output = ClassificationOutput> + Module + Send + 'static,
{
    let seed = |rank: usize| 41 + 1000 * rank as u64;
    let Some(world) = replicas else {
        return observed(
            vec![one_device(case, model(seed(0)), after_step)],
            Vec::new(),
        );
    };
    let train = |rank: usize, group: Arc<dyn ProcessGroup>| {
        rank_loop(case, group, model(seed(rank)), after_step)
    };
    let ranks: Vec<Result<RankTrained, DdpError>> = match case.transport {
        Transport::Tcp => over_tcp(world, train)
            .into_iter()
            .map(|joined| joined.and_then(|trained| trained))
            .collect(),
        Transport::Threads | Transport::ThreadBuckets => {
            let groups = ThreadGroup::new_group(world).expect("thread groups");
            std::thread::scope(|s| {
                let handles: Vec<_> = groups
                    .into_iter()
                    .enumerate()
                    .map(|(rank, group)| {
                        let train = &train;
                        s.spawn(move || train(rank, Arc::new(group)))
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|h| h.join().expect("a rank's thread"))
                    .collect()
            })
        }
    };
    let (tensors, comm): (Vec<_>, Vec<_>) = ranks
        .into_iter()
        .enumerate()
        .map(|(rank, trained)| trained.unwrap_or_else(|err| panic!("{case:?}, rank {rank}: {err}")))
        .unzip();
    observed(tensors, comm)
}

/// Rank 0's tensors (or one device's), the others', and every rank's counters.
fn observed(mut tensors: Vec<Vec<Vec<f32>>>, comm: Vec<CommStats>) -> Observed {
    let others = tensors.split_off(1);
    Observed {
        tensors: tensors.remove(0),
        others,
        train: SplitSeen::default(),
        valid: SplitSeen::default(),
        report: None,
        comm,
    }
}

/// The micro-batches of one optimizer step: with accumulation, summed by Burn's
/// `GradientsAccumulator` until the window is full.
struct Window<M> {
    every: Option<usize>,
    taken: usize,
    sum: GradientsAccumulator<M>,
}

impl<M: Module> Window<M> {
    fn new(every: Option<usize>) -> Self {
        Self {
            every,
            taken: 0,
            sum: GradientsAccumulator::new(),
        }
    }

    /// The gradients of the step this micro-batch ends, if it ends one.
    fn add(&mut self, model: &M, grads: GradientsParams) -> Option<GradientsParams> {
        let Some(every) = self.every else {
            return Some(grads);
        };
        self.sum.accumulate(model, grads);
        self.taken += 1;
        self.taken.is_multiple_of(every).then(|| self.sum.grads())
    }
}

/// Plain Burn: the loop over Burn's loader of the global batch, in the order a world-size-1
/// sampler gives (`Permuted`), clipping by the global norm before the step when the case clips.
fn one_device<M>(case: &Case, mut model: M, after_step: AfterStep<M>) -> Vec<Vec<f32>>
where
    M: TrainStep<Input = Batch, Output = ClassificationOutput> + Module + 'static,
{
    let loader = DataLoaderBuilder::new(ItemBatcher)
        .batch_size(case.global_batch)
        .build(Permuted::new(
            synthetic_dataset(case.samples, DATA_SEED),
            ORDER_SEED,
            case.shuffle,
            0,
        ));
    let clip = (case.clip != Clip::Off).then_some(CLIP);
    let mut optim: ModuleOptimizer = optim(case.opt);
    let mut lr = Sched::build(case);
    let mut steps = 0;
    for _ in 0..case.epochs {
        let mut window = Window::new(case.accumulation);
        for batch in loader.iter() {
            let batch = batch.expect("a batch of Burn's loader");
            let grads = TrainStep::step(&model, batch).grads;
            let Some(grads) = window.add(&model, grads) else {
                continue;
            };
            let grads = match clip {
                Some(max_norm) => clip_global_norm(&model, grads, max_norm),
                None => grads,
            };
            let rate = lr.step();
            model = optim.step(rate, model, grads);
            steps += 1;
            model = after_step(model, steps);
        }
    }
    float_tensors(&model)
}

/// One rank's loop, as a user writes it.
fn rank_loop<M>(
    case: &Case,
    group: Arc<dyn ProcessGroup>,
    model: M,
    after_step: AfterStep<M>,
) -> Result<RankTrained, DdpError>
where
    M: TrainStep<Input = Batch, Output = ClassificationOutput> + Module + 'static,
{
    let (world, rank) = (group.world_size(), group.rank());
    let config = settings(case, case.shard);
    let (mut ddp, mut model) = DistributedDataParallel::new(group, model, &device(), config)?;
    let mut sampler = DistributedSampler::new(case.samples, world)?
        .with_seed(ORDER_SEED)
        .with_rank(rank)?;
    if !case.shuffle {
        sampler = sampler.without_shuffle();
    }
    let loader = DistributedDataLoader::new(
        Arc::new(InMemDataset::new(synthetic_dataset(
            case.samples,
            DATA_SEED,
        ))),
        ItemBatcher,
        sampler,
        case.global_batch / world,
        device(),
    )?;
    // burn-ddp clips with its setting, or the loop clips the synchronised gradients by their
    // global norm before the step (`Clip::Wrapper`: every reduced gradient is there but under
    // ZeRO-2, which the cases do not draw with it).
    let mut optim: ModuleOptimizer = optim(case.opt);
    let mut lr = Sched::build(case);
    let _sync_bn = ddp.enter_sync_batch_norm();
    let mut steps = 0;
    for _ in 0..case.epochs {
        let mut window = Window::new(case.accumulation);
        for batch in loader.iter_steps() {
            let grads =
                match batch.map_err(|e| DdpError::InvalidConfig(format!("the loader: {e}")))? {
                    Some(batch) => TrainStep::step(&model, batch).grads,
                    // No sample of this rank in this step: it takes part without gradients.
                    None => GradientsParams::new(),
                };
            let grads = match case.accumulation {
                Some(_) => ddp.weigh_micro_batch(&model, grads),
                None => grads,
            };
            let Some(grads) = window.add(&model, grads) else {
                continue;
            };
            let grads = ddp.sync_gradients(&model, grads)?;
            let grads = match case.clip {
                Clip::Wrapper => clip_global_norm(&model, grads, CLIP),
                Clip::Off | Clip::Setting => grads,
            };
            let rate = lr.step();
            model = ddp.optimizer_step(&mut optim, rate, model, grads)?;
            steps += 1;
            model = after_step(model, steps);
        }
    }
    Ok((float_tensors(&model), ddp.comm_stats().clone()))
}
