//! The two benchmark models and their synthetic data.

use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{LayerNorm, LayerNormConfig, Linear, LinearConfig, Relu};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn::train::{ClassificationOutput, InferenceStep, TrainOutput, TrainStep};
use fashion_mnist::data::{FashionBatch, FashionItem, PIXELS};

/// Which model a run trains.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum ModelKind {
    /// The Fashion-MNIST example's CNN (105,962 parameters, compute-heavy).
    Cnn,
    /// [`BigMlp`]: residual feed-forward blocks, 5.66 M parameters in 34 tensors, 22.7 MB of
    /// gradients (communication-heavy).
    Mlp,
    /// [`BigMlp`] with its first three blocks frozen (fine-tuning): 3.15 M of its 5.66 M
    /// parameters do not train. Not in the default runs; `--models mlp-frozen`.
    MlpFrozen,
}

impl ModelKind {
    /// Name in tables.
    pub fn name(self) -> &'static str {
        match self {
            ModelKind::Cnn => "CNN 106k",
            ModelKind::Mlp => "MLP 5.7M",
            ModelKind::MlpFrozen => "MLP 5.7M, 56% frozen",
        }
    }

    /// The `--model` argument of worker processes.
    pub fn arg(self) -> &'static str {
        match self {
            ModelKind::Cnn => "cnn",
            ModelKind::Mlp => "mlp",
            ModelKind::MlpFrozen => "mlp-frozen",
        }
    }

    /// Parses [`arg`](Self::arg).
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "cnn" => Some(ModelKind::Cnn),
            "mlp" => Some(ModelKind::Mlp),
            "mlp-frozen" => Some(ModelKind::MlpFrozen),
            _ => None,
        }
    }
}

/// Width of the residual stream of [`BigMlp`].
const WIDTH: usize = 512;
/// Residual feed-forward blocks in [`BigMlp`].
const BLOCKS: usize = 5;

/// A transformer's feed-forward block: `x + W2 relu(W1 LayerNorm(x))`, 512 → 1024 → 512.
#[derive(Module, Debug)]
pub struct Block<B: Backend> {
    norm: LayerNorm<B>,
    up: Linear<B>,
    down: Linear<B>,
    activation: Relu,
}

impl<B: Backend> Block<B> {
    fn new(device: &B::Device) -> Self {
        Self {
            norm: LayerNormConfig::new(WIDTH).init(device),
            up: LinearConfig::new(WIDTH, 2 * WIDTH).init(device),
            down: LinearConfig::new(2 * WIDTH, WIDTH).init(device),
            activation: Relu::new(),
        }
    }

    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let h = self.up.forward(self.norm.forward(x.clone()));
        x + self.down.forward(self.activation.forward(h))
    }
}

/// The communication-heavy model: 784 → 512, five residual feed-forward blocks (as in a
/// transformer, without attention), 512 → 10. 5.66 M parameters in 34 tensors, 22.7 MB of
/// gradients per step: many tensors, as real models have, so bucketing has calls to save.
#[derive(Module, Debug)]
pub struct BigMlp<B: Backend> {
    input: Linear<B>,
    blocks: Vec<Block<B>>,
    head: Linear<B>,
}

impl<B: Backend> BigMlp<B> {
    /// A new model on `device`.
    pub fn new(device: &B::Device) -> Self {
        Self {
            input: LinearConfig::new(PIXELS, WIDTH).init(device),
            blocks: (0..BLOCKS).map(|_| Block::new(device)).collect(),
            head: LinearConfig::new(WIDTH, 10).init(device),
        }
    }

    /// This model with its first three blocks frozen (`Module::no_grad`).
    pub fn frozen_half(self) -> Self {
        let blocks = self
            .blocks
            .into_iter()
            .enumerate()
            .map(|(i, block)| if i < 3 { block.no_grad() } else { block })
            .collect();
        Self { blocks, ..self }
    }

    fn classify(&self, batch: FashionBatch<B>) -> ClassificationOutput<B> {
        let [n, _, _, _] = batch.images.dims();
        let mut x = self.input.forward(batch.images.reshape([n, PIXELS]));
        for block in &self.blocks {
            x = block.forward(x);
        }
        let logits = self.head.forward(x);
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

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;

    #[test]
    fn the_communication_heavy_model_has_the_documented_size() {
        let layout =
            burn_ddp::mechanism::ReplicaLayout::of(&BigMlp::<Flex>::new(&Default::default()));
        // input 784·512 + 512; per block LayerNorm 2·512, 512·1024 + 1024, 1024·512 + 512; head
        // 512·10 + 10.
        let block = 2 * WIDTH + (WIDTH * 2 * WIDTH + 2 * WIDTH) + (2 * WIDTH * WIDTH + WIDTH);
        let expected = PIXELS * WIDTH + WIDTH + BLOCKS * block + WIDTH * 10 + 10;
        assert_eq!(expected, 5_662_730);
        assert_eq!(layout.numel(), expected);
        assert_eq!(layout.tensors().len(), 2 + 6 * BLOCKS + 2);
    }
}
