//! A dataset that the global batch does not divide: by default every step, the last one included,
//! trains exactly one device's batch, split across the ranks (a rank may get one sample fewer, or
//! none), each rank's gradient weighted by its samples. Compared with plain Burn on one device.

use std::sync::Arc;

use burn::data::dataloader::DataLoader;
use burn::data::dataset::{Dataset, InMemDataset};
use burn::optim::{AdamWConfig, GradientsParams, ModuleOptimizer, SgdConfig};
use burn::tensor::Device;
use burn::train::TrainStep;
use burn_ddp::{
    DdpConfig, DistributedDataLoader, DistributedDataParallel, DistributedSampler, ProcessGroup,
    group::ThreadGroup,
};
use burn_ddp_tests::{
    ItemBatcher, Mlp, Run, device, float_tensors, materialized, max_relative_difference, over_tcp,
    run_training, synthetic_dataset,
};

/// Relative difference allowed between burn-ddp and one device: the rounding of sums taken in
/// another order (a wrong weighting or a duplicated sample is 1e-3 to 1e-2 off).
const TOLERANCE: f32 = 1e-5;

fn adamw() -> ModuleOptimizer {
    AdamWConfig::new().with_weight_decay(1e-2).init()
}

fn assert_as_one_device(what: &str, initial: &[Vec<f32>], one: &[Vec<f32>], ddp: &[Vec<f32>]) {
    let moved = max_relative_difference(one, initial);
    assert!(
        moved > 1e-3,
        "{what}: training moved the parameters by {moved} only"
    );
    let diff = max_relative_difference(ddp, one);
    assert!(
        diff <= TOLERANCE,
        "{what}: {diff} away from plain Burn on one device (relative; tolerance {TOLERANCE})"
    );
}

#[test]
fn eighty_nine_samples_on_three_ranks_train_as_on_one_device() {
    // 89 = 7 x 12 + 5: the last step has 5 samples, 2 + 2 + 1 over the ranks. The sampler used
    // to pad it to 6 (a sample trained twice) and weigh the ranks alike.
    let model = materialized(Mlp::new(&device()));
    let initial = float_tensors(&model);
    let (one, _) = run_training(model.clone(), adamw(), 5e-3, &Run::new(None, 12, 89)).unwrap();
    let (ddp, report) = run_training(model, adamw(), 5e-3, &Run::new(Some(3), 12, 89)).unwrap();
    assert_as_one_device("89 samples, 3 thread ranks", &initial, &one, &ddp);
    let report = report.unwrap();
    assert_eq!(report.epochs[0].samples, 89, "samples trained in the epoch");
    assert_eq!(report.epochs[0].steps, 8, "optimizer steps");
}

#[test]
fn a_rank_without_a_sample_in_the_last_step_takes_part_in_it() {
    // 86 = 7 x 12 + 2: ranks 0 and 1 have one sample in the last step, rank 2 none. Two epochs,
    // gradient accumulation over 2 micro-batches (4 optimizer steps per epoch).
    let model = materialized(Mlp::new(&device()));
    let initial = float_tensors(&model);
    let mut run = Run::new(None, 12, 86);
    run.epochs = 2;
    run.grad_accumulation = Some(2);
    let (one, _) = run_training(model.clone(), adamw(), 5e-3, &run).unwrap();
    for shard in [false, true] {
        run.replicas = Some(3);
        run.config = DdpConfig::default()
            .with_optimizer_sharding(shard)
            .with_consistency_check_every(1);
        let (ddp, report) = run_training(model.clone(), adamw(), 5e-3, &run).unwrap();
        assert_as_one_device(
            &format!("86 samples, 3 thread ranks, accumulation 2, sharded: {shard}"),
            &initial,
            &one,
            &ddp,
        );
        let report = report.unwrap();
        let samples: Vec<u64> = report.epochs.iter().map(|e| e.samples).collect();
        assert_eq!(samples, vec![86, 86], "samples trained per epoch");
        let steps: Vec<u64> = report.epochs.iter().map(|e| e.steps).collect();
        assert_eq!(steps, vec![4, 4], "optimizer steps per epoch");
        let batches: Vec<u64> = report.ranks.iter().map(|r| r.batches).collect();
        assert_eq!(batches, vec![16, 16, 14], "batches each rank trained on");
    }
}

#[test]
fn ranks_in_separate_processes_split_a_short_last_batch_as_one_device() {
    // 37 = 4 x 8 + 5 on 3 TCP ranks of 3 samples each: the last step has 2 + 2 + 1.
    let model = materialized(Mlp::new(&device()));
    let initial = float_tensors(&model);
    let mut run = Run::new(None, 9, 37);
    run.epochs = 2;
    let (one, _) = run_training(model.clone(), SgdConfig::new().init(), 0.2, &run).unwrap();
    let ranks = over_tcp(3, |_, group| {
        let mut run = run.clone();
        run.group = Some(group);
        run_training(model.clone(), SgdConfig::new().init(), 0.2, &run)
    });
    for (rank, trained) in ranks.into_iter().enumerate() {
        let (ddp, _) = trained.unwrap().unwrap();
        assert_as_one_device(
            &format!("37 samples, TCP rank {rank}"),
            &initial,
            &one,
            &ddp,
        );
    }
}

#[test]
fn fewer_samples_than_ranks_train_as_on_one_device() {
    // 3 samples on 4 ranks, per-rank batch 2: one step of 3 samples, rank 3 without one.
    let model = materialized(Mlp::new(&device()));
    let initial = float_tensors(&model);
    let mut run = Run::new(None, 8, 3);
    run.epochs = 3;
    let (one, _) = run_training(model.clone(), SgdConfig::new().init(), 0.5, &run).unwrap();
    run.replicas = Some(4);
    let (ddp, report) = run_training(model, SgdConfig::new().init(), 0.5, &run).unwrap();
    assert_as_one_device("3 samples, 4 thread ranks", &initial, &one, &ddp);
    let batches: Vec<u64> = report.unwrap().ranks.iter().map(|r| r.batches).collect();
    assert_eq!(batches, vec![3, 3, 3, 0]);
}

#[test]
fn padding_stays_available_as_pytorchs_explicit_choice() {
    // With PyTorch's padding, 89 samples become 90: one sample trains twice, and the report
    // counts the padded sample.
    let model = materialized(Mlp::new(&device()));
    let mut run = Run::new(Some(3), 12, 89);
    run.padded = true;
    let (_, report) = run_training(model, SgdConfig::new().init(), 0.1, &run).unwrap();
    let report = report.unwrap();
    assert_eq!(report.epochs[0].samples, 90);
    let batches: Vec<u64> = report.ranks.iter().map(|r| r.batches).collect();
    assert_eq!(batches, vec![8, 8, 8]);
}

/// Plain Burn on one device: SGD over `items` in order, batches of `global` items, `epochs`
/// times.
fn one_device_loop(
    model: Mlp,
    items: &[burn_ddp_tests::Item],
    global: usize,
    epochs: usize,
) -> Vec<Vec<f32>> {
    use burn::data::dataloader::batcher::Batcher;
    let mut model = model;
    let mut optim: ModuleOptimizer = SgdConfig::new().init();
    for _ in 0..epochs {
        for chunk in items.chunks(global) {
            let batch = ItemBatcher.batch(chunk.to_vec(), &device());
            let output = TrainStep::step(&model, batch);
            model = optim.step(0.3, model, output.grads);
        }
    }
    float_tensors(&model)
}

/// The same with `DistributedDataParallel` on `world_size` thread ranks, each iterating
/// `DistributedDataLoader::iter_steps` (every rank one entry per step of the epoch, `None` in a
/// step where it has no sample). Returns every rank's trained tensors.
fn custom_loop(
    model: &Mlp,
    items: &[burn_ddp_tests::Item],
    world_size: usize,
    per_rank: usize,
    epochs: usize,
) -> Vec<Vec<Vec<f32>>> {
    let groups = ThreadGroup::new_group(world_size).unwrap();
    let dataset = Arc::new(InMemDataset::new(items.to_vec()));
    std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .enumerate()
            .map(|(rank, group)| {
                let (dataset, model) = (dataset.clone(), model.clone());
                s.spawn(move || {
                    let group: Arc<dyn ProcessGroup> = Arc::new(group);
                    let config = DdpConfig::default().with_consistency_check_every(1);
                    let (mut ddp, mut model) =
                        DistributedDataParallel::new(group, model, &device(), config).unwrap();
                    let sampler = DistributedSampler::new(dataset.len(), world_size)
                        .unwrap()
                        .without_shuffle()
                        .with_rank(rank)
                        .unwrap();
                    let loader = DistributedDataLoader::new(
                        dataset,
                        ItemBatcher,
                        sampler,
                        per_rank,
                        device(),
                    )
                    .unwrap();
                    let mut optim: ModuleOptimizer = SgdConfig::new().init();
                    for _ in 0..epochs {
                        for batch in loader.iter_steps() {
                            let grads = match batch.expect("a batch") {
                                Some(batch) => TrainStep::step(&model, batch).grads,
                                None => GradientsParams::new(),
                            };
                            let grads = ddp.sync_gradients(&model, grads).unwrap();
                            model = optim.step(0.3, model, grads);
                        }
                    }
                    float_tensors(&model)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn a_custom_loop_trains_short_last_batches_as_on_one_device() {
    // 29 = 3 x 8 + 5 on 4 ranks (2 + 1 + 1 + 1) and 26 = 3 x 8 + 2 (1 + 1 + 0 + 0).
    for samples in [29, 26] {
        let model = materialized(Mlp::new(&device()));
        let initial = float_tensors(&model);
        let items = synthetic_dataset(samples, 17);
        let one = one_device_loop(model.clone(), &items, 8, 2);
        let ranks = custom_loop(&model, &items, 4, 2, 2);
        for (rank, trained) in ranks.iter().enumerate() {
            assert_as_one_device(
                &format!("custom loop, {samples} samples, rank {rank}"),
                &initial,
                &one,
                trained,
            );
            assert_eq!(trained, &ranks[0], "rank {rank} differs from rank 0");
        }
    }
}

#[test]
fn every_rank_iterates_as_many_steps_each_with_its_part_of_one_devices_batch() {
    // 11 items, 2 ranks, 5 per rank: steps of 10 and 1; rank 1 has no sample in the second.
    let dataset = Arc::new(InMemDataset::new((0..11).collect::<Vec<usize>>()));
    let steps: Vec<Vec<Option<Vec<usize>>>> = (0..2)
        .map(|rank| {
            let sampler = DistributedSampler::new(11, 2)
                .unwrap()
                .without_shuffle()
                .with_rank(rank)
                .unwrap();
            let loader = DistributedDataLoader::new(
                dataset.clone() as Arc<dyn Dataset<usize>>,
                Ids,
                sampler,
                5,
                Device::flex(),
            )
            .unwrap();
            loader
                .iter_steps()
                .map(|batch| batch.expect("a batch"))
                .collect()
        })
        .collect();
    assert_eq!(steps[0], vec![Some(vec![0, 2, 4, 6, 8]), Some(vec![10])]);
    assert_eq!(steps[1], vec![Some(vec![1, 3, 5, 7, 9]), None]);
    // The plain Burn iterator of each rank gives its batches only.
    let sampler = DistributedSampler::new(11, 2).unwrap().without_shuffle();
    let whole = DistributedDataLoader::new(dataset, Ids, sampler, 5, Device::flex()).unwrap();
    assert_eq!(whole.num_items(), 11, "nothing padded, nothing dropped");
}

/// A batcher that keeps the sample ids.
#[derive(Clone)]
struct Ids;

impl burn::data::dataloader::batcher::Batcher<usize, Vec<usize>> for Ids {
    fn batch(&self, items: Vec<usize>, _device: &Device) -> Vec<usize> {
        items
    }
}

/// Plain Burn on one device with gradient accumulation: SGD steps on the sum of every 2
/// consecutive batches' gradients of `global` items (a micro-batch left over at the end is
/// dropped, as burn-train drops it), `epochs` times.
fn one_device_accumulating(
    model: Mlp,
    items: &[burn_ddp_tests::Item],
    global: usize,
    epochs: usize,
) -> Vec<Vec<f32>> {
    use burn::data::dataloader::batcher::Batcher;
    use burn::optim::GradientsAccumulator;
    let mut model = model;
    let mut optim: ModuleOptimizer = SgdConfig::new().init();
    for _ in 0..epochs {
        let chunks: Vec<_> = items.chunks(global).collect();
        for pair in chunks.chunks_exact(2) {
            let mut accumulator = GradientsAccumulator::new();
            for chunk in pair {
                let batch = ItemBatcher.batch(chunk.to_vec(), &device());
                accumulator.accumulate(&model, TrainStep::step(&model, batch).grads);
            }
            model = optim.step(0.3, model, accumulator.grads());
        }
    }
    float_tensors(&model)
}

/// A custom loop accumulating 2 micro-batches per step on `world_size` thread ranks; each
/// micro-batch weighed through `weigh_micro_batch` when `weigh`. Every rank's result.
fn accumulating_loop(
    model: &Mlp,
    items: &[burn_ddp_tests::Item],
    world_size: usize,
    per_rank: usize,
    weigh: bool,
) -> Vec<Result<Vec<Vec<f32>>, burn_ddp::DdpError>> {
    use burn::optim::GradientsAccumulator;
    let groups = ThreadGroup::new_group(world_size).unwrap();
    let dataset = Arc::new(InMemDataset::new(items.to_vec()));
    std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .enumerate()
            .map(|(rank, group)| {
                let (dataset, model) = (dataset.clone(), model.clone());
                s.spawn(move || -> Result<Vec<Vec<f32>>, burn_ddp::DdpError> {
                    let group: Arc<dyn ProcessGroup> = Arc::new(group);
                    let (mut ddp, mut model) = DistributedDataParallel::new(
                        group,
                        model,
                        &device(),
                        DdpConfig::default(),
                    )?;
                    let sampler = DistributedSampler::new(dataset.len(), world_size)?
                        .without_shuffle()
                        .with_rank(rank)?;
                    let loader = DistributedDataLoader::new(
                        dataset,
                        ItemBatcher,
                        sampler,
                        per_rank,
                        device(),
                    )?;
                    let mut optim: ModuleOptimizer = SgdConfig::new().init();
                    let mut accumulator = GradientsAccumulator::new();
                    for (k, batch) in loader.iter_steps().enumerate() {
                        let batch = batch.map_err(|e| {
                            burn_ddp::DdpError::InvalidConfig(format!("the loader: {e}"))
                        })?;
                        let grads = match batch {
                            Some(batch) => TrainStep::step(&model, batch).grads,
                            None => GradientsParams::new(),
                        };
                        let grads = match weigh {
                            true => ddp.weigh_micro_batch(&model, grads),
                            false => grads,
                        };
                        accumulator.accumulate(&model, grads);
                        if k % 2 == 1 {
                            let grads = ddp.sync_gradients(&model, accumulator.grads())?;
                            model = optim.step(0.3, model, grads);
                        }
                    }
                    Ok(float_tensors(&model))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn a_custom_loop_weighs_each_micro_batch_under_accumulation() {
    // 30 = 3 x 8 + 6 on 4 ranks of 2: 4 micro-batches, the last 2 + 2 + 1 + 1.
    let model = materialized(Mlp::new(&device()));
    let initial = float_tensors(&model);
    let items = synthetic_dataset(30, 19);
    let one = one_device_accumulating(model.clone(), &items, 8, 1);
    let ranks = accumulating_loop(&model, &items, 4, 2, true);
    for (rank, trained) in ranks.into_iter().enumerate() {
        let trained = trained.unwrap();
        assert_as_one_device(
            &format!("accumulation, rank {rank}"),
            &initial,
            &one,
            &trained,
        );
    }
    // Without weighing the short micro-batch, the synchronisation refuses (not a wrong result).
    for (rank, result) in accumulating_loop(&model, &items, 4, 2, false)
        .into_iter()
        .enumerate()
    {
        match result {
            Err(burn_ddp::DdpError::InvalidConfig(message)) => {
                assert!(
                    message.contains("weigh_micro_batch"),
                    "rank {rank}: {message}"
                )
            }
            Err(burn_ddp::DdpError::Comm(burn_ddp::comm::CommError::Aborted { .. })) => {}
            other => panic!(
                "rank {rank}: expected the refusal, got {:?}",
                other.map(|_| ())
            ),
        }
    }
}
