//! The synthetic data of the tests: a small classification dataset (16 features, 4 classes), its
//! batcher, synthetic Fashion-MNIST-shaped images, the test device, and the reference side's data
//! order ([`Permuted`]).

use burn::data::dataloader::batcher::Batcher;
use burn::tensor::{Device, Int, Tensor, TensorData};

/// Features per sample.
pub const FEATURES: usize = 16;

/// Classes.
pub const CLASSES: usize = 4;

/// One sample: 16 features and a class in `0..4`.
#[derive(Clone, Debug)]
pub struct Item {
    /// Input features.
    pub features: [f32; FEATURES],
    /// Class index.
    pub label: usize,
}

/// A batch: inputs `[batch, 16]`, targets `[batch]`.
#[derive(Clone, Debug)]
pub struct Batch {
    /// Inputs.
    pub inputs: Tensor<2>,
    /// Class indices.
    pub targets: Tensor<1, Int>,
}

/// Builds batches on the requested device.
#[derive(Clone, Default)]
pub struct ItemBatcher;

impl Batcher<Item, Batch> for ItemBatcher {
    fn batch(&self, items: Vec<Item>, device: &Device) -> Batch {
        let n = items.len();
        let features: Vec<f32> = items.iter().flat_map(|i| i.features).collect();
        let labels: Vec<i64> = items.iter().map(|i| i.label as i64).collect();
        Batch {
            inputs: Tensor::from_data(TensorData::new(features, [n, FEATURES]), device),
            targets: Tensor::from_data(TensorData::new(labels, [n]), device),
        }
    }
}

/// A deterministic, learnable dataset of `len` samples (the class is the argmax of a fixed linear
/// map of the features).
pub fn synthetic_dataset(len: usize, seed: u64) -> Vec<Item> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut next = move || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((state >> 33) as f64 / (1u64 << 31) as f64) as f32 * 2.0 - 1.0
    };
    (0..len)
        .map(|_| {
            let mut features = [0f32; FEATURES];
            features.iter_mut().for_each(|f| *f = next());
            let score = |c: usize| -> f32 {
                features
                    .iter()
                    .enumerate()
                    .map(|(i, f)| f * (((i * 7 + c * 3) % 5) as f32 - 2.0))
                    .sum()
            };
            let label = (0..CLASSES)
                .max_by(|&a, &b| score(a).total_cmp(&score(b)))
                .unwrap_or(0);
            Item { features, label }
        })
        .collect()
}

/// The tests' device: Burn's CPU backend (Flex, Burn 0.22's and 0.23's) with autodiff, as
/// burn-train trains; one thread per replica.
pub fn device() -> Device {
    Device::flex().autodiff()
}

/// `len` synthetic Fashion-MNIST-shaped images (deterministic pixels and labels).
pub fn synthetic_images(len: usize, seed: u64) -> Vec<fashion_mnist::data::FashionItem> {
    (0..len)
        .map(|i| {
            let base = (seed as usize).wrapping_mul(131).wrapping_add(i * 7919);
            fashion_mnist::data::FashionItem {
                pixels: (0..fashion_mnist::data::PIXELS)
                    .map(|p| ((base + p * 31) % 256) as u8)
                    .collect(),
                label: ((base / 7) % 10) as u8,
            }
        })
        .collect()
}

/// `items` in the order one device sees them when it iterates what a `DistributedSampler` of world
/// size 1 gives: each epoch `e` a permutation drawn by a generator seeded with `seed + e` (PyTorch's
/// `DistributedSampler` semantics; `shuffle: false`, the items' own order), read by Burn's own
/// loader from the first index to the last once per epoch. The reference side of the
/// differential tests, written without burn-ddp: the epoch is the number of reads so far divided
/// by the length, starting at `first_epoch` (a resumed run's).
pub struct Permuted<I> {
    items: Vec<I>,
    seed: u64,
    shuffle: bool,
    first_epoch: u64,
    reads: std::sync::atomic::AtomicUsize,
    /// The epoch whose permutation is cached, and the permutation.
    order: std::sync::Mutex<Option<(u64, Vec<usize>)>>,
}

impl<I> Permuted<I> {
    /// `items`, permuted each epoch by a generator seeded with `seed + epoch` when `shuffle`.
    pub fn new(items: Vec<I>, seed: u64, shuffle: bool, first_epoch: u64) -> Self {
        Self {
            items,
            seed,
            shuffle,
            first_epoch,
            reads: Default::default(),
            order: Default::default(),
        }
    }
}

impl<I: Clone + Send + Sync> burn::data::dataset::Dataset<I> for Permuted<I> {
    /// # Panics
    /// When `index` is not below the length, as Burn 0.22's datasets do.
    fn get(&self, index: usize) -> Result<I, burn::data::dataset::DatasetError> {
        use rand::SeedableRng;
        use rand::seq::SliceRandom;
        let len = self.items.len();
        assert!(index < len, "Permuted: index {index} >= {len}");
        if !self.shuffle {
            return Ok(self.items[index].clone());
        }
        let read = self
            .reads
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let epoch = self.first_epoch + (read / len) as u64;
        let mut cached = self.order.lock().unwrap_or_else(|e| e.into_inner());
        let order = match cached.as_mut() {
            Some((e, order)) if *e == epoch => order,
            _ => {
                let mut order: Vec<usize> = (0..len).collect();
                let mut rng = rand::rngs::StdRng::seed_from_u64(self.seed.wrapping_add(epoch));
                order.shuffle(&mut rng);
                &mut cached.insert((epoch, order)).1
            }
        };
        Ok(self.items[order[index]].clone())
    }

    fn len(&self) -> usize {
        self.items.len()
    }
}
