//! The two benchmark models and their synthetic data.

use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn::train::{ClassificationOutput, InferenceStep, TrainOutput, TrainStep};
use fashion_mnist::data::{FashionBatch, FashionItem, PIXELS};

/// Which model a run trains.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum ModelKind {
    /// The Fashion-MNIST example's CNN (105,962 parameters, compute-heavy).
    Cnn,
    /// A 784-2048-2048-10 MLP (5.8 M parameters, 23 MB of gradients: communication-heavy).
    Mlp,
}

impl ModelKind {
    /// Name in tables.
    pub fn name(self) -> &'static str {
        match self {
            ModelKind::Cnn => "CNN 106k",
            ModelKind::Mlp => "MLP 5.8M",
        }
    }

    /// The `--model` argument of worker processes.
    pub fn arg(self) -> &'static str {
        match self {
            ModelKind::Cnn => "cnn",
            ModelKind::Mlp => "mlp",
        }
    }

    /// Parses [`arg`](Self::arg).
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "cnn" => Some(ModelKind::Cnn),
            "mlp" => Some(ModelKind::Mlp),
            _ => None,
        }
    }
}

/// 784 → 2048 → 2048 → 10 with ReLU: gradients of 23 MB per step.
#[derive(Module, Debug)]
pub struct BigMlp<B: Backend> {
    fc1: Linear<B>,
    fc2: Linear<B>,
    fc3: Linear<B>,
    activation: Relu,
}

impl<B: Backend> BigMlp<B> {
    /// A new model on `device`.
    pub fn new(device: &B::Device) -> Self {
        Self {
            fc1: LinearConfig::new(PIXELS, 2048).init(device),
            fc2: LinearConfig::new(2048, 2048).init(device),
            fc3: LinearConfig::new(2048, 10).init(device),
            activation: Relu::new(),
        }
    }

    fn classify(&self, batch: FashionBatch<B>) -> ClassificationOutput<B> {
        let [n, _, _, _] = batch.images.dims();
        let x = batch.images.reshape([n, PIXELS]);
        let x = self.activation.forward(self.fc1.forward(x));
        let x = self.activation.forward(self.fc2.forward(x));
        let logits = self.fc3.forward(x);
        let loss = CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits.clone(), batch.targets.clone());
        ClassificationOutput::new(loss, logits, batch.targets)
    }
}

impl<B: AutodiffBackend> TrainStep for BigMlp<B> {
    type Input = FashionBatch<B>;
    type Output = ClassificationOutput<B>;

    fn step(&self, batch: FashionBatch<B>) -> TrainOutput<ClassificationOutput<B>> {
        let item = self.classify(batch);
        TrainOutput::new(self, item.loss.backward(), item)
    }
}

impl<B: Backend> InferenceStep for BigMlp<B> {
    type Input = FashionBatch<B>;
    type Output = ClassificationOutput<B>;

    fn step(&self, batch: FashionBatch<B>) -> ClassificationOutput<B> {
        self.classify(batch)
    }
}

/// `len` Fashion-MNIST-shaped images with deterministic pixels and labels (speed does not depend
/// on the pixels, and the benchmark needs no dataset).
pub fn synthetic_images(len: usize) -> Vec<FashionItem> {
    (0..len)
        .map(|i| FashionItem {
            pixels: (0..PIXELS)
                .map(|p| ((i * 7919 + p * 31) % 256) as u8)
                .collect(),
            label: (i % 10) as u8,
        })
        .collect()
}
