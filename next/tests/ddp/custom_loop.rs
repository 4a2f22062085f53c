//! The lower-level API in a training loop the user writes (`DistributedDataParallel`), compared
//! with the same loop in plain Burn on one device, and its misuse: what the strategy guarantees
//! must hold here too, or be refused with a message.

use std::sync::Arc;

use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::{GradientsParams, ModuleOptimizer, SgdConfig};
use burn::tensor::{Device, Tensor};
use burn_ddp::{DdpConfig, DistributedDataParallel, ProcessGroup, group::ThreadGroup};
use burn_ddp_tests::{
    CLASSES, FEATURES, Item, ItemBatcher, device, float_tensors, materialized,
    max_relative_difference, synthetic_dataset,
};

use burn::data::dataloader::batcher::Batcher;

/// An MLP whose second layer reads the first layer's weight (one `Param` in two places).
#[derive(Module, Debug)]
struct TiedMlp {
    first: Linear,
    second: Linear,
    head: Linear,
    activation: Relu,
}

impl TiedMlp {
    fn new(device: &Device) -> Self {
        let first: Linear = LinearConfig::new(FEATURES, FEATURES).init(device);
        // Materialised first: clones of a lazy parameter initialise separately (no tie).
        let _ = first.weight.val();
        let mut second = LinearConfig::new(FEATURES, FEATURES)
            .with_bias(false)
            .init(device);
        second.weight = first.weight.clone();
        Self {
            first,
            second,
            head: LinearConfig::new(FEATURES, CLASSES).init(device),
            activation: Relu::new(),
        }
    }

    fn forward(&self, inputs: Tensor<2>) -> Tensor<2> {
        let x = self.activation.forward(self.first.forward(inputs));
        let x = self.activation.forward(self.second.forward(x));
        self.head.forward(x)
    }
}

/// The mean cross-entropy of `model` on `items`.
fn loss(model: &TiedMlp, items: &[Item]) -> Tensor<1> {
    let batch = ItemBatcher.batch(items.to_vec(), &device());
    let logits = model.forward(batch.inputs);
    CrossEntropyLossConfig::new()
        .init(&logits.device())
        .forward(logits, batch.targets)
}

const STEPS: usize = 3;
const PER_RANK: usize = 8;
const LR: f64 = 0.5;

/// SGD with momentum (state per parameter, which sharding splits between the ranks).
fn sgd() -> SgdConfig {
    SgdConfig::new().with_momentum(Some(burn::optim::momentum::MomentumConfig::new()))
}

/// Plain Burn on one device: `STEPS` SGD steps on batches of `world_size * PER_RANK` items.
fn one_device(model: TiedMlp, items: &[Item], world_size: usize) -> Vec<Vec<f32>> {
    let mut model = model;
    let mut optim: ModuleOptimizer = sgd().init();
    for batch in items.chunks(world_size * PER_RANK).take(STEPS) {
        let grads = GradientsParams::from_grads(loss(&model, batch).backward(), &model);
        model = optim.step(LR, model, grads);
    }
    float_tensors(&model)
}

/// The same loop with `DistributedDataParallel` on `world_size` thread ranks; rank `r` takes the
/// `r`-th `PER_RANK` items of every global batch and starts from a model of its own (rank 0's
/// is `model`), with the optimizer state sharded or not. Returns every rank's trained tensors.
fn data_parallel(
    model: TiedMlp,
    items: &[Item],
    world_size: usize,
    shard: bool,
) -> Vec<Vec<Vec<f32>>> {
    let groups = ThreadGroup::new_group(world_size).unwrap();
    std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .enumerate()
            .map(|(rank, group)| {
                let mine = if rank == 0 {
                    model.clone()
                } else {
                    materialized(TiedMlp::new(&device()))
                };
                s.spawn(move || {
                    let group: Arc<dyn ProcessGroup> = Arc::new(group);
                    let config = DdpConfig::default().with_optimizer_sharding(shard);
                    let (mut ddp, mut model) =
                        DistributedDataParallel::new(group, mine, &device(), config).unwrap();
                    let mut optim: ModuleOptimizer = sgd().init();
                    for batch in items.chunks(world_size * PER_RANK).take(STEPS) {
                        let mine = &batch[rank * PER_RANK..(rank + 1) * PER_RANK];
                        let grads =
                            GradientsParams::from_grads(loss(&model, mine).backward(), &model);
                        let grads = ddp.sync_gradients(&model, grads).unwrap();
                        model = ddp.optimizer_step(&mut optim, LR, model, grads).unwrap();
                    }
                    float_tensors(&model)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn a_weight_shared_by_two_layers_trains_as_on_one_device_in_a_custom_loop() {
    for (world_size, shard) in [(2, false), (3, false), (2, true), (3, true)] {
        let model = materialized(TiedMlp::new(&device()));
        let items = synthetic_dataset(STEPS * world_size * PER_RANK, 21);
        let reference = one_device(model.clone(), &items, world_size);
        let ranks = data_parallel(model.clone(), &items, world_size, shard);
        let moved = max_relative_difference(&reference, &float_tensors(&model));
        assert!(
            moved > 1e-3,
            "training moved the parameters by {moved} only"
        );
        for (rank, trained) in ranks.iter().enumerate() {
            let diff = max_relative_difference(trained, &reference);
            assert!(
                diff <= 1e-5,
                "world size {world_size} (sharded: {shard}), rank {rank}: {diff} away from plain \
                 Burn on one device"
            );
            assert_eq!(trained, &ranks[0], "rank {rank} differs from rank 0");
        }
    }
}

/// How one rank of [`custom_loop`] misbehaves, if at all.
#[derive(Clone, Copy, Default)]
struct Misuse {
    /// This rank's per-rank batch, when not the job's.
    batch: Option<usize>,
    /// This rank skips the gradient synchronisation of this step (a condition in the loop).
    skip_sync_at: Option<usize>,
    /// This rank adds 1 to its first parameter after this optimizer step (a replica that drifts).
    drift_after: Option<usize>,
}

/// What a rank of [`custom_loop`] ends with: its trained tensors and its synchronisations.
type LoopEnd = Result<(Vec<Vec<f32>>, usize), burn_ddp::DdpError>;

/// A loop of one's own on `world_size` thread ranks over a `DistributedDataLoader` of
/// `DistributedSampler::with_rank`, SGD on the MLP; `misuse(rank)` says how a rank misbehaves.
/// Returns every rank's result: its trained tensors and the number of synchronisations done.
fn custom_loop(
    world_size: usize,
    batch: usize,
    config: DdpConfig,
    misuse: impl Fn(usize) -> Misuse + Sync,
) -> Vec<LoopEnd> {
    use burn::data::dataset::{Dataset, InMemDataset};
    use burn::train::TrainStep;
    use burn_ddp::{DistributedDataLoader, DistributedSampler};
    let groups = ThreadGroup::new_group(world_size).unwrap();
    let dataset = Arc::new(InMemDataset::new(synthetic_dataset(
        world_size * batch * 6,
        3,
    )));
    let model = materialized(burn_ddp_tests::Mlp::new(&device()));
    let misuse = &misuse;
    std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .enumerate()
            .map(|(rank, group)| {
                let (dataset, model, config) = (dataset.clone(), model.clone(), config.clone());
                s.spawn(move || -> Result<_, burn_ddp::DdpError> {
                    let how = misuse(rank);
                    let group: Arc<dyn ProcessGroup> = Arc::new(group);
                    let (mut ddp, mut model) =
                        DistributedDataParallel::new(group, model, &device(), config)?;
                    let sampler = DistributedSampler::new(dataset.len(), world_size)?
                        .with_seed(5)
                        .with_rank(rank)?;
                    let loader = DistributedDataLoader::new(
                        dataset,
                        ItemBatcher,
                        sampler,
                        how.batch.unwrap_or(batch),
                        device(),
                    )?;
                    let mut optim: ModuleOptimizer = SgdConfig::new().init();
                    let mut syncs = 0;
                    for (step, batch) in
                        burn::data::dataloader::DataLoader::iter(&loader).enumerate()
                    {
                        let batch = batch.map_err(|e| {
                            burn_ddp::DdpError::InvalidConfig(format!("the loader: {e}"))
                        })?;
                        let output = TrainStep::step(&model, batch);
                        if how.skip_sync_at == Some(step) {
                            continue;
                        }
                        let grads = ddp.sync_gradients(&model, output.grads)?;
                        syncs += 1;
                        model = optim.step(0.1, model, grads);
                        if how.drift_after == Some(step) {
                            let mut tensors = float_tensors(&model);
                            tensors[0][0] += 1.0;
                            model = burn_ddp_tests::with_values(model, &tensors);
                        }
                    }
                    Ok((float_tensors(&model), syncs))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn a_rank_that_skips_a_gradient_synchronisation_is_out_of_step_at_the_next_one() {
    let results = custom_loop(2, 8, DdpConfig::default(), |rank| Misuse {
        skip_sync_at: (rank == 1).then_some(2),
        ..Misuse::default()
    });
    for (rank, result) in results.into_iter().enumerate() {
        match result {
            Err(burn_ddp::DdpError::OutOfStep { sync, detail, .. }) => {
                assert_eq!(sync, 2, "rank {rank}: {detail}");
                assert!(
                    detail.contains("rank 0 is at batch 3 of epoch 0 but rank 1 at batch 4"),
                    "rank {rank}: {detail}"
                );
            }
            other => panic!("rank {rank}: expected OutOfStep, got {other:?}"),
        }
    }
}

#[test]
fn a_rank_built_with_another_batch_size_is_out_of_step_at_the_first_synchronisation() {
    let results = custom_loop(2, 32, DdpConfig::default(), |rank| Misuse {
        batch: (rank == 1).then_some(48),
        ..Misuse::default()
    });
    for (rank, result) in results.into_iter().enumerate() {
        match result {
            Err(burn_ddp::DdpError::OutOfStep { sync, detail, .. }) => {
                assert_eq!(sync, 0, "rank {rank}: {detail}");
                assert!(
                    detail.contains("64 samples over all ranks but rank 1's 96"),
                    "rank {rank}: {detail}"
                );
            }
            other => panic!("rank {rank}: expected OutOfStep, got {other:?}"),
        }
    }
}

#[test]
fn the_consistency_check_runs_in_a_custom_loop_and_names_the_drifting_rank() {
    // Without the check the drift goes unnoticed; with it, every rank fails at the check after
    // the drift (every 2 synchronisations: before synchronisation #2).
    let unchecked = custom_loop(2, 8, DdpConfig::default(), |rank| Misuse {
        drift_after: (rank == 1).then_some(0),
        ..Misuse::default()
    });
    assert!(unchecked.iter().all(Result::is_ok), "{unchecked:?}");
    let config = DdpConfig::default().with_consistency_check_every(2);
    let results = custom_loop(2, 8, config, |rank| Misuse {
        drift_after: (rank == 1).then_some(0),
        ..Misuse::default()
    });
    for (rank, result) in results.into_iter().enumerate() {
        match result {
            Err(burn_ddp::DdpError::ReplicasDiverged { ranks, step, .. }) => {
                assert_eq!((ranks, step), (vec![1], 2), "rank {rank}");
            }
            other => panic!("rank {rank}: expected ReplicasDiverged, got {other:?}"),
        }
    }
}

#[test]
fn a_custom_loop_in_step_trains_every_rank_alike_and_each_reads_its_own_shard() {
    let results = custom_loop(3, 4, DdpConfig::default(), |_| Misuse::default());
    let trained: Vec<_> = results.into_iter().map(Result::unwrap).collect();
    // 3 ranks * 4 samples * 6 steps of data: each rank reads its own shard (6 batches), not the
    // whole dataset (18).
    for (rank, (tensors, syncs)) in trained.iter().enumerate() {
        assert_eq!(*syncs, 6, "rank {rank}");
        assert_eq!(tensors, &trained[0].0, "rank {rank} differs from rank 0");
    }
}

#[test]
fn rank_and_world_size_answer_on_every_thread_that_holds_a_wrapper() {
    let groups = ThreadGroup::new_group(3).unwrap();
    let model = materialized(burn_ddp_tests::Mlp::new(&device()));
    // Per rank: (rank, world size, main process) while holding the wrapper, then (rank, world
    // size) after dropping it.
    type Seen = ((usize, usize, bool), (usize, usize));
    let seen: Vec<Seen> = std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .map(|group| {
                let model = model.clone();
                s.spawn(move || {
                    let group: Arc<dyn ProcessGroup> = Arc::new(group);
                    let (ddp, _model) =
                        DistributedDataParallel::new(group, model, &device(), DdpConfig::default())
                            .unwrap();
                    let held = (
                        burn_ddp::rank(),
                        burn_ddp::world_size(),
                        burn_ddp::is_main_process(),
                    );
                    drop(ddp);
                    (held, (burn_ddp::rank(), burn_ddp::world_size()))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (rank, (held, after)) in seen.into_iter().enumerate() {
        assert_eq!(
            held,
            (rank, 3, rank == 0),
            "rank {rank} while holding the wrapper"
        );
        // Dropped: the thread is no rank of that job any more (the process's answer: this test
        // process is no job, or the job the tests run in).
        assert_ne!(
            after.1, 3,
            "rank {rank} after the wrapper was dropped: {after:?}"
        );
    }
}

#[test]
fn the_strategy_settings_are_refused_by_the_wrapper_naming_them() {
    let cases: Vec<(DdpConfig, &str)> = vec![
        (
            DdpConfig::default().with_checkpoint_every(5),
            "with_checkpoint_every",
        ),
        (DdpConfig::default().with_resume(true), "with_resume"),
        (
            DdpConfig::default().with_validation(burn_ddp::config::Validation::Rank0),
            "with_validation",
        ),
        (
            DdpConfig::default().with_buffer_sync(burn_ddp::config::BufferSync::Broadcast),
            "with_buffer_sync",
        ),
        (
            DdpConfig::default().with_spike_factor(5.0),
            "with_spike_factor",
        ),
    ];
    for (config, setting) in cases {
        let group: Arc<dyn ProcessGroup> = Arc::new(ThreadGroup::new_group(1).unwrap().remove(0));
        let model = burn_ddp_tests::Mlp::new(&device());
        match DistributedDataParallel::new(group, model, &device(), config) {
            Err(burn_ddp::DdpError::InvalidConfig(message)) => {
                assert!(message.contains(setting), "{setting}: {message}")
            }
            other => panic!(
                "{setting}: expected InvalidConfig, got {:?}",
                other.map(|_| ())
            ),
        }
    }
}

#[test]
fn optimizer_sharding_alone_leaves_every_rank_every_reduced_gradient() {
    // ZeRO-1 (`with_optimizer_sharding`) all-reduces the gradients, as the setting says: a loop
    // that reads them between `sync_gradients` and `optimizer_step` (clipping by the global
    // norm, logging) sees every parameter's, on thread ranks sharing tensors and through host
    // buckets. Only `with_gradient_sharding` (ZeRO-2) leaves each rank its own parameters'.
    let items = synthetic_dataset(2 * PER_RANK, 5);
    for (shared, grads_sharded) in [(true, false), (false, false), (false, true)] {
        let model = materialized(TiedMlp::new(&device()));
        let params = burn_ddp::mechanism::ReplicaLayout::of(&model)
            .parameters()
            .map(|p| p.id)
            .collect::<std::collections::HashSet<_>>()
            .len();
        let groups = ThreadGroup::new_group(2).unwrap();
        let seen: Vec<(usize, u64)> = std::thread::scope(|s| {
            let handles: Vec<_> = groups
                .into_iter()
                .enumerate()
                .map(|(rank, group)| {
                    let (model, items) = (model.clone(), &items);
                    s.spawn(move || {
                        let config = DdpConfig::default()
                            .with_optimizer_sharding(true)
                            .with_gradient_sharding(grads_sharded)
                            .with_shared_memory_reduction(shared);
                        let (mut ddp, model) =
                            DistributedDataParallel::new(Arc::new(group), model, &device(), config)
                                .unwrap();
                        let mine = &items[rank * PER_RANK..(rank + 1) * PER_RANK];
                        let grads =
                            GradientsParams::from_grads(loss(&model, mine).backward(), &model);
                        let grads = ddp.sync_gradients(&model, grads).unwrap();
                        (grads.len(), ddp.comm_stats().scattered_phases)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (rank, (held, scattered)) in seen.into_iter().enumerate() {
            if grads_sharded {
                assert!(
                    held < params,
                    "ZeRO-2, rank {rank}: {held} of {params} gradients"
                );
                assert_eq!(scattered, 1, "ZeRO-2, rank {rank}: reduce-scattered");
            } else {
                assert_eq!(
                    held, params,
                    "ZeRO-1 (tensors shared: {shared}), rank {rank}: gradients held"
                );
                assert_eq!(
                    scattered, 0,
                    "ZeRO-1 (tensors shared: {shared}), rank {rank}"
                );
            }
        }
    }
}
