//! Which samples each rank trains on: disjoint shards that cover the data, a new order every
//! epoch, and the same number of batches on every rank.

use std::collections::BTreeSet;
use std::sync::Arc;

use burn::backend::NdArray;
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::{DataLoader, DataLoaderBuilder};
use burn::data::dataset::InMemDataset;
use burn::optim::SgdConfig;
use burn_ddp::{DistributedDataLoader, DistributedSampler};
use burn_ddp_tests::{Item, Mlp, Run, device, materialized, run_training};

/// A batcher that keeps the sample ids, to see which samples each rank got.
#[derive(Clone)]
struct Ids;

impl Batcher<NdArray, usize, Vec<usize>> for Ids {
    fn batch(&self, items: Vec<usize>, _device: &burn::tensor::Device<NdArray>) -> Vec<usize> {
        items
    }
}

fn loader(
    len: usize,
    world_size: usize,
    batch: usize,
    drop_last: bool,
) -> Arc<dyn DataLoader<NdArray, Vec<usize>>> {
    let sampler = DistributedSampler::new(len, world_size)
        .unwrap()
        .with_seed(11)
        .with_drop_last(drop_last)
        .unwrap();
    Arc::new(
        DistributedDataLoader::new(
            Arc::new(InMemDataset::new((0..len).collect::<Vec<usize>>())),
            Ids,
            sampler,
            batch,
            Default::default(),
        )
        .unwrap(),
    )
}

/// Splits like DdpStrategy does: equal contiguous slices.
fn shards(
    loader: &Arc<dyn DataLoader<NdArray, Vec<usize>>>,
    n: usize,
) -> Vec<Arc<dyn DataLoader<NdArray, Vec<usize>>>> {
    let per_rank = loader.num_items() / n;
    (0..n)
        .map(|r| loader.slice(r * per_rank, (r + 1) * per_rank))
        .collect()
}

#[test]
fn rank_shards_are_disjoint_and_cover_the_dataset() {
    let shards = shards(&loader(100, 4, 8, false), 4);
    let mut seen = BTreeSet::new();
    for shard in &shards {
        for batch in shard.iter() {
            for id in batch {
                assert!(seen.insert(id), "sample {id} on two ranks");
            }
        }
    }
    assert_eq!(seen, (0..100).collect());
}

#[test]
fn every_epoch_has_a_new_order() {
    let shards = shards(&loader(64, 2, 8, false), 2);
    let epoch1: Vec<usize> = shards[0].iter().flatten().collect();
    let epoch2: Vec<usize> = shards[0].iter().flatten().collect();
    assert_eq!(epoch1.len(), 32);
    assert_ne!(epoch1, epoch2, "epoch 2 must not repeat epoch 1's order");
    // Same samples per epoch? Not required (shards change), but both are 32 distinct ids.
    assert_eq!(epoch2.iter().collect::<BTreeSet<_>>().len(), 32);
}

#[test]
fn eleven_items_two_ranks_batch_five_give_both_ranks_the_same_number_of_batches() {
    // Padding by wrapping: 12 samples, 6 per rank: batches of 5 and 1.
    let padded = shards(&loader(11, 2, 5, false), 2);
    let counts: Vec<Vec<usize>> = padded
        .iter()
        .map(|s| s.iter().map(|b| b.len()).collect())
        .collect();
    assert_eq!(counts, vec![vec![5, 1], vec![5, 1]]);
    // drop_last: 10 samples, 5 per rank: one batch each.
    let dropped = shards(&loader(11, 2, 5, true), 2);
    let counts: Vec<usize> = dropped.iter().map(|s| s.iter().count()).collect();
    assert_eq!(counts, vec![1, 1]);
}

#[test]
fn the_strategy_gives_every_rank_the_same_number_of_batches() {
    // Through DdpStrategy with the padded DistributedDataLoader: 11 samples, 2 ranks, batch 5
    // per rank: 2 steps on each rank.
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
    assert_eq!(report.ranks[0].batches, 2);
    assert_eq!(report.ranks[1].batches, 2);
}

#[test]
fn a_plain_burn_loader_is_split_into_equal_shards() {
    // Burn's own loader with 11 items and batch 5: the strategy drops the odd item so both
    // ranks get 5 items, one batch each, instead of 5 and 6 (one rank waiting for a batch).
    use burn::train::logger::InMemoryMetricLogger;
    use burn::train::{Learner, SupervisedTraining};
    use burn_ddp::{DdpStrategy, DdpTraining};
    use burn_ddp_tests::{ItemBatcher, SilentRenderer, synthetic_dataset};

    let items: Vec<Item> = synthetic_dataset(11, 4);
    let train = DataLoaderBuilder::new(ItemBatcher)
        .batch_size(5)
        .shuffle(3)
        .build(InMemDataset::new(items.clone()));
    let valid = DataLoaderBuilder::new(ItemBatcher)
        .batch_size(5)
        .build(InMemDataset::new(items));
    let model = materialized(Mlp::new(&device()));
    let learner = Learner::new(model, SgdConfig::new().init(), 0.05);
    let strategy = DdpStrategy::new(vec![device(); 2]);
    let handle = strategy.clone();
    SupervisedTraining::new(
        std::env::temp_dir().join("burn-ddp-tests-plain"),
        train,
        valid,
    )
    .renderer(SilentRenderer)
    .with_metric_logger(InMemoryMetricLogger::new())
    .with_application_logger(None)
    .launch_ddp(learner, strategy)
    .unwrap();
    let report = handle.report();
    assert_eq!(report.ranks[0].batches, 1);
    assert_eq!(report.ranks[1].batches, 1);
}
