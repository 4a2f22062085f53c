//! The synthetic data of the tests: a small classification dataset (16 features, 4 classes), its batcher, synthetic Fashion-MNIST-shaped images, and the test backend and device.

use burn::backend::{Autodiff, NdArray};

use burn::data::dataloader::batcher::Batcher;

use burn::prelude::*;

/// The test backend: CPU, one thread per replica.
pub type TestBackend = Autodiff<NdArray>;

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
pub struct Batch<B: Backend> {
    /// Inputs.
    pub inputs: Tensor<B, 2>,
    /// Class indices.
    pub targets: Tensor<B, 1, Int>,
}

/// Builds batches on the requested device.
#[derive(Clone, Default)]
pub struct ItemBatcher;

impl<B: Backend> Batcher<B, Item, Batch<B>> for ItemBatcher {
    fn batch(&self, items: Vec<Item>, device: &B::Device) -> Batch<B> {
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

/// The default device of the test backend.
pub fn device() -> burn::tensor::Device<TestBackend> {
    Default::default()
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
