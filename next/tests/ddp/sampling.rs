//! Which samples each rank trains on: disjoint shards that cover the data, a new order every
//! epoch, and the same number of batches on every rank.

use std::collections::BTreeSet;
use std::sync::Arc;

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::{DataLoader, DataLoaderBuilder};
use burn::data::dataset::{DatasetError, InMemDataset};
use burn::optim::SgdConfig;
use burn::tensor::Device;
use burn_ddp::{DistributedDataLoader, DistributedSampler};
use burn_ddp_tests::{Item, Mlp, Run, device, materialized, run_training};

/// A batcher that keeps the sample ids, to see which samples each rank got.
#[derive(Clone)]
struct Ids;

impl Batcher<usize, Vec<usize>> for Ids {
    fn batch(&self, items: Vec<usize>, _device: &Device) -> Vec<usize> {
        items
    }
}

/// Every batch of one pass over `loader`, each read.
fn read(loader: &Arc<dyn DataLoader<Vec<usize>>>) -> Vec<Vec<usize>> {
    loader.iter().map(|batch| batch.expect("a batch")).collect()
}

/// What a sampler does with a dataset the world size does not divide.
#[derive(Clone, Copy)]
enum Tail {
    /// Every sample once (the default).
    Exact,
    /// PyTorch's padding.
    Padded,
    /// `drop_last`.
    Dropped,
}

fn loader(
    len: usize,
    world_size: usize,
    batch: usize,
    tail: Tail,
) -> Arc<dyn DataLoader<Vec<usize>>> {
    let sampler = DistributedSampler::new(len, world_size)
        .unwrap()
        .with_seed(11);
    let sampler = match tail {
        Tail::Exact => sampler,
        Tail::Padded => sampler.with_duplicate_padding(),
        Tail::Dropped => sampler.with_drop_last(true).unwrap(),
    };
    Arc::new(
        DistributedDataLoader::new(
            Arc::new(InMemDataset::new((0..len).collect::<Vec<usize>>())),
            Ids,
            sampler,
            batch,
            Device::flex(),
        )
        .unwrap(),
    )
}

/// Splits like DdpStrategy does a DistributedDataLoader: contiguous slices differing by at most
/// one item, the larger first (the sampler's shards).
fn shards(
    loader: &Arc<dyn DataLoader<Vec<usize>>>,
    n: usize,
) -> Vec<Arc<dyn DataLoader<Vec<usize>>>> {
    let (base, extra) = (loader.num_items() / n, loader.num_items() % n);
    (0..n)
        .map(|r| {
            let start = r * base + r.min(extra);
            loader.slice(start, start + base + usize::from(r < extra))
        })
        .collect()
}

#[test]
fn rank_shards_are_disjoint_and_cover_the_dataset() {
    let shards = shards(&loader(100, 4, 8, Tail::Exact), 4);
    let mut seen = BTreeSet::new();
    for shard in &shards {
        for batch in read(shard) {
            for id in batch {
                assert!(seen.insert(id), "sample {id} on two ranks");
            }
        }
    }
    assert_eq!(seen, (0..100).collect());
}

#[test]
fn every_epoch_has_a_new_order() {
    let shards = shards(&loader(64, 2, 8, Tail::Exact), 2);
    let epoch1: Vec<usize> = read(&shards[0]).into_iter().flatten().collect();
    let epoch2: Vec<usize> = read(&shards[0]).into_iter().flatten().collect();
    assert_eq!(epoch1.len(), 32);
    assert_ne!(epoch1, epoch2, "epoch 2 must not repeat epoch 1's order");
    // Same samples per epoch? Not required (shards change), but both are 32 distinct ids.
    assert_eq!(epoch2.iter().collect::<BTreeSet<_>>().len(), 32);
}

#[test]
fn eleven_items_two_ranks_batch_five_train_every_item_once_unless_padded_or_dropped() {
    let batches = |tail| -> Vec<Vec<usize>> {
        shards(&loader(11, 2, 5, tail), 2)
            .iter()
            .map(|s| read(s).iter().map(|b| b.len()).collect())
            .collect()
    };
    // The default: 6 and 5 items, one device's batches of 10 and 1.
    assert_eq!(batches(Tail::Exact), vec![vec![5, 1], vec![5]]);
    // PyTorch's padding: 12 items, 6 per rank (one item twice).
    assert_eq!(batches(Tail::Padded), vec![vec![5, 1], vec![5, 1]]);
    // drop_last: 10 items, 5 per rank.
    assert_eq!(batches(Tail::Dropped), vec![vec![5], vec![5]]);
}

#[test]
fn the_strategy_takes_every_rank_through_every_step_with_or_without_a_sample() {
    // Through DdpStrategy: 11 samples, 2 ranks, batch 5 per rank: 2 steps, the second with one
    // sample, on rank 0.
    let model = materialized(Mlp::new(&device()));
    let (_, report) = run_training(
        model,
        SgdConfig::new().init(),
        0.05,
        &Run::new(Some(2), 10, 11),
    )
    .unwrap();
    let report = report.unwrap();
    assert_eq!(report.epochs[0].steps, 2);
    assert_eq!(report.epochs[0].samples, 11);
    assert_eq!(report.ranks[0].batches, 2);
    assert_eq!(report.ranks[1].batches, 1);
    assert_eq!(
        report.ranks[1].comm.steps, 2,
        "rank 1 takes part in both steps"
    );
}

#[test]
fn a_plain_burn_loader_is_dealt_to_thread_ranks_and_sliced_into_equal_shards_between_processes() {
    // Burn's own loader with 11 items and batch 5. Thread ranks read it as one device does
    // (batches of 5, 5 and 1) and take its batches in turn: nothing is dropped, rank 1 has no
    // batch in the last step. Processes each take an equal contiguous slice of 5 items (one
    // batch each; the odd item is dropped so that no rank waits for a batch).
    use burn::train::logger::InMemoryMetricLogger;
    use burn::train::{Learner, SupervisedTraining};
    use burn_ddp::{DdpStrategy, DdpTraining};
    use burn_ddp_tests::{ItemBatcher, SilentRenderer, over_tcp, synthetic_dataset};

    let items: Vec<Item> = synthetic_dataset(11, 4);
    let model = materialized(Mlp::new(&device()));
    let train = |strategy: DdpStrategy, dir: &str| {
        let loader = DataLoaderBuilder::new(ItemBatcher)
            .batch_size(5)
            .shuffle(3)
            .build(InMemDataset::new(items.clone()));
        let valid = DataLoaderBuilder::new(ItemBatcher)
            .batch_size(5)
            .build(InMemDataset::new(items.clone()));
        let learner = Learner::new(model.clone(), SgdConfig::new().init(), 0.05);
        let handle = strategy.clone();
        SupervisedTraining::new(std::env::temp_dir().join(dir), loader, valid)
            .renderer(Box::new(SilentRenderer))
            .with_metric_logger(InMemoryMetricLogger::new())
            .with_application_logger(None)
            .launch_ddp(learner, strategy)
            .map(|_| handle.report())
    };
    let report = train(
        DdpStrategy::new(vec![device(); 2]),
        "burn-ddp-tests-plain-dealt",
    )
    .unwrap();
    assert_eq!(report.epochs[0].steps, 2);
    assert_eq!(report.epochs[0].samples, 11, "every item trained");
    assert_eq!(report.ranks[0].batches, 2);
    assert_eq!(report.ranks[1].batches, 1);
    assert_eq!(report.ranks[1].comm.steps, 2, "rank 1 takes part in both");
    let reports = over_tcp(2, |rank, group| {
        train(
            DdpStrategy::with_process_group(device(), group),
            &format!("burn-ddp-tests-plain-sliced-{rank}"),
        )
    });
    let report = reports.into_iter().next().unwrap().unwrap().unwrap();
    assert_eq!(report.epochs[0].steps, 1);
    assert_eq!(report.epochs[0].samples, 10, "the odd item is dropped");
    assert_eq!(report.ranks.len(), 2);
    assert!(report.ranks.iter().all(|r| r.batches == 1));
}

/// Every batch of every rank's shard over `epochs` epochs, in order.
fn batches_of(
    loader: &Arc<dyn DataLoader<Vec<usize>>>,
    world_size: usize,
    epochs: usize,
) -> Vec<Vec<usize>> {
    let shards = shards(loader, world_size);
    (0..epochs)
        .flat_map(|_| shards.iter().flat_map(read).collect::<Vec<_>>())
        .collect()
}

fn prefetching_loader(
    len: usize,
    world_size: usize,
    batch: usize,
    workers: usize,
    prefetch: usize,
) -> Arc<dyn DataLoader<Vec<usize>>> {
    let sampler = DistributedSampler::new(len, world_size)
        .unwrap()
        .with_seed(11);
    Arc::new(
        DistributedDataLoader::new(
            Arc::new(InMemDataset::new((0..len).collect::<Vec<usize>>())),
            Ids,
            sampler,
            batch,
            Device::flex(),
        )
        .unwrap()
        .with_num_workers(workers)
        .with_prefetch_factor(prefetch),
    )
}

#[test]
fn prefetching_workers_keep_the_samplers_exact_order() {
    // 53 samples on 2 ranks, batches of 4 (a short last batch), 3 epochs.
    let reference = batches_of(&prefetching_loader(53, 2, 4, 0, 2), 2, 3);
    assert_eq!(reference.len(), 3 * 2 * 7);
    for (workers, prefetch) in [(1, 1), (2, 2), (3, 1), (8, 4)] {
        let got = batches_of(&prefetching_loader(53, 2, 4, workers, prefetch), 2, 3);
        assert_eq!(
            got, reference,
            "{workers} workers (prefetch {prefetch}) changed the order"
        );
    }
    // An iterator dropped half-way (a run stopped early) leaves the next epoch intact.
    let loader = prefetching_loader(53, 1, 4, 2, 2);
    let plain = prefetching_loader(53, 1, 4, 0, 2);
    let mut first = loader.iter();
    assert_eq!(
        first.next().map(|b| b.expect("a batch")),
        plain.iter().next().map(|b| b.expect("a batch"))
    );
    drop(first);
    assert_eq!(read(&loader), read(&plain));
}

/// Items `0..len`; `get(bad)` panics, as a corrupt file would in a decoding dataset.
struct Corrupt {
    len: usize,
    bad: usize,
}

impl burn::data::dataset::Dataset<usize> for Corrupt {
    fn get(&self, index: usize) -> Result<usize, DatasetError> {
        assert_ne!(index, self.bad, "sample {index} is corrupt");
        assert!(index < self.len, "index {index} >= {}", self.len);
        Ok(index)
    }

    fn len(&self) -> usize {
        self.len
    }
}

#[test]
fn a_panicking_get_in_a_loader_worker_is_the_iterators_error_naming_the_rank_and_the_sample() {
    let sampler = DistributedSampler::new(40, 2).unwrap().with_seed(5);
    let bad = sampler.indices(0, 1)[6];
    let loader: Arc<dyn DataLoader<Vec<usize>>> = Arc::new(
        DistributedDataLoader::new(
            Arc::new(Corrupt { len: 40, bad }),
            Ids,
            sampler,
            4,
            Device::flex(),
        )
        .unwrap()
        .with_num_workers(2),
    );
    let rank1 = loader.slice(20, 40);
    // Bounded: the failure must arrive, not hang the training thread.
    let (sender, receiver) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        // Burn 0.22's loaders yield `Result`: the panic is the batch's error, not the thread's.
        let result: Result<Vec<usize>, String> = rank1
            .iter()
            .map(|batch| batch.map(|b| b.len()).map_err(|e| e.to_string()))
            .collect();
        let _ = sender.send(result);
    });
    let result = receiver
        .recv_timeout(std::time::Duration::from_secs(60))
        .expect("the loader hung after a worker's panic");
    let message = result.expect_err("a corrupt sample must fail the epoch");
    assert!(message.contains("rank 1"), "{message}");
    assert!(message.contains(&format!("get({bad})")), "{message}");
    assert!(message.contains("batch 1"), "{message}");
}

#[test]
fn the_strategy_reports_a_loader_workers_failure_as_the_ranks_error() {
    use burn::train::logger::InMemoryMetricLogger;
    use burn::train::{Learner, SupervisedTraining};
    use burn_ddp::{DdpError, DdpStrategy, DdpTraining};
    use burn_ddp_tests::{ItemBatcher, SilentRenderer, synthetic_dataset};

    /// The synthetic items; `get(bad)` panics.
    struct CorruptItems {
        items: Vec<Item>,
        bad: usize,
    }
    impl burn::data::dataset::Dataset<Item> for CorruptItems {
        fn get(&self, index: usize) -> Result<Item, DatasetError> {
            assert_ne!(index, self.bad, "sample {index} is corrupt");
            Ok(self.items[index].clone())
        }
        fn len(&self) -> usize {
            self.items.len()
        }
    }

    let items = synthetic_dataset(40, 4);
    let sampler = DistributedSampler::new(40, 2).unwrap().with_seed(2);
    let bad = sampler.indices(0, 1)[9];
    let train = Arc::new(
        DistributedDataLoader::new(
            Arc::new(CorruptItems {
                items: items.clone(),
                bad,
            }),
            ItemBatcher,
            sampler,
            4,
            device(),
        )
        .unwrap()
        .with_num_workers(2),
    );
    let valid = DataLoaderBuilder::new(ItemBatcher)
        .batch_size(8)
        .build(InMemDataset::new(items));
    let model = materialized(Mlp::new(&device()));
    let learner = Learner::new(model, SgdConfig::new().init(), 0.05);
    let (sender, receiver) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let result = SupervisedTraining::new(
            std::env::temp_dir().join(format!("burn-ddp-tests-corrupt-{}", std::process::id())),
            train,
            valid,
        )
        .renderer(Box::new(SilentRenderer))
        .with_metric_logger(InMemoryMetricLogger::new())
        .with_application_logger(None)
        .launch_ddp(learner, DdpStrategy::new(vec![device(); 2]))
        .map(|_| ());
        let _ = sender.send(result);
    });
    let result = receiver
        .recv_timeout(std::time::Duration::from_secs(120))
        .expect("training hung after a loader worker's panic");
    match result {
        Err(DdpError::WorkerPanicked { rank: 1, message }) => {
            assert!(message.contains(&format!("get({bad})")), "{message}");
        }
        other => panic!("expected rank 1's loader failure, got {other:?}"),
    }
}

#[test]
fn training_with_prefetching_workers_equals_training_without() {
    let model = materialized(Mlp::new(&device()));
    let run = Run {
        epochs: 2,
        ..Run::new(Some(2), 8, 48)
    };
    let (inline, _) = run_training(model.clone(), SgdConfig::new().init(), 0.1, &run).unwrap();
    let (prefetched, _) = run_training(
        model,
        SgdConfig::new().init(),
        0.1,
        &Run {
            loader_workers: 2,
            ..run
        },
    )
    .unwrap();
    assert_eq!(prefetched, inline, "prefetching changed what was trained");
}

#[test]
fn a_loader_built_for_another_world_size_or_padding_validation_is_refused() {
    use burn::train::logger::InMemoryMetricLogger;
    use burn::train::{Learner, SupervisedTraining};
    use burn_ddp::{DdpError, DdpStrategy, DdpTraining};
    use burn_ddp_tests::{Batch, ItemBatcher, SilentRenderer, synthetic_dataset};

    let items = synthetic_dataset(22, 4);
    let plain = DataLoaderBuilder::new(ItemBatcher)
        .batch_size(8)
        .build(InMemDataset::new(items.clone()));
    let launch = |train: Arc<dyn DataLoader<Batch>>, valid: Arc<dyn DataLoader<Batch>>| {
        let learner = Learner::new(
            materialized(Mlp::new(&device())),
            SgdConfig::new().init(),
            0.05,
        );
        SupervisedTraining::new(
            std::env::temp_dir().join(format!("burn-ddp-tests-refused-{}", std::process::id())),
            train,
            valid,
        )
        .renderer(Box::new(SilentRenderer))
        .with_metric_logger(InMemoryMetricLogger::new())
        .with_application_logger(None)
        .launch_ddp(learner, DdpStrategy::new(vec![device(); 2]))
        .map(|_| ())
    };
    // Built for 3 replicas, trained on 2: every rank would take a third of the data.
    let train3 = Arc::new(
        DistributedDataLoader::new(
            Arc::new(InMemDataset::new(items.clone())),
            ItemBatcher,
            DistributedSampler::new(22, 3).unwrap(),
            4,
            device(),
        )
        .unwrap(),
    );
    match launch(train3, plain.clone()) {
        Err(DdpError::InvalidConfig(message)) => {
            assert!(message.contains("world size 3"), "{message}");
            assert!(message.contains("has 2 replicas"), "{message}");
        }
        other => panic!("expected the world-size refusal, got {other:?}"),
    }
    // A padded validation loader (21 items on 2 ranks: one repeated) would count it twice.
    let train2 = Arc::new(
        DistributedDataLoader::new(
            Arc::new(InMemDataset::new(items.clone())),
            ItemBatcher,
            DistributedSampler::new(22, 2).unwrap(),
            4,
            device(),
        )
        .unwrap(),
    );
    let odd: Vec<Item> = items[..21].to_vec();
    let padded_valid = Arc::new(
        DistributedDataLoader::new(
            Arc::new(InMemDataset::new(odd.clone())),
            ItemBatcher,
            DistributedSampler::new(21, 2)
                .unwrap()
                .with_duplicate_padding(),
            8,
            device().inner(),
        )
        .unwrap(),
    );
    match launch(train2.clone(), padded_valid) {
        Err(DdpError::InvalidConfig(message)) => {
            assert!(message.contains("count 1 item(s) twice"), "{message}");
        }
        other => panic!("expected the padded-validation refusal, got {other:?}"),
    }
    // One rank's shard (`with_rank`) would be validated as the whole set.
    let one_rank_valid = Arc::new(
        DistributedDataLoader::new(
            Arc::new(InMemDataset::new(odd.clone())),
            ItemBatcher,
            DistributedSampler::new(21, 2)
                .unwrap()
                .with_uneven_shards()
                .with_rank(1)
                .unwrap(),
            8,
            device().inner(),
        )
        .unwrap(),
    );
    match launch(train2.clone(), one_rank_valid) {
        Err(DdpError::InvalidConfig(message)) => {
            assert!(message.contains("rank 1's shard only"), "{message}");
        }
        other => panic!("expected the one-rank validation refusal, got {other:?}"),
    }
    // The same items with uneven shards (each once) are accepted.
    let uneven_valid = Arc::new(
        DistributedDataLoader::new(
            Arc::new(InMemDataset::new(odd)),
            ItemBatcher,
            DistributedSampler::new(21, 2).unwrap().with_uneven_shards(),
            8,
            device().inner(),
        )
        .unwrap(),
    );
    launch(train2, uneven_valid).unwrap();
}
