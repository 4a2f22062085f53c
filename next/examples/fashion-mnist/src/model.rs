//! The "2 Conv + pooling + BatchNorm" CNN of Fashion-MNIST's benchmark table (0.92-0.93 test
//! accuracy there): 105,962 trainable parameters.

use burn::module::Module;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::pool::{MaxPool2d, MaxPool2dConfig};
use burn::nn::{BatchNorm, BatchNormConfig, Linear, LinearConfig, PaddingConfig2d, Relu};
use burn::tensor::{Device, Tensor};
use burn::train::{ClassificationOutput, InferenceStep, TrainOutput, TrainStep};

use crate::data::FashionBatch;

/// conv 3×3 (1→16) + BatchNorm + ReLU + max-pool 2 → conv 3×3 (16→32) + BatchNorm + ReLU +
/// max-pool 2 → linear 1568→64 + ReLU → linear 64→10.
#[derive(Module, Debug)]
pub struct Cnn {
    conv1: Conv2d,
    norm1: BatchNorm,
    conv2: Conv2d,
    norm2: BatchNorm,
    pool: MaxPool2d,
    fc1: Linear,
    fc2: Linear,
    activation: Relu,
}

impl Cnn {
    /// A new, randomly initialised model on `device` (Burn's initialisation, from the device's
    /// seed).
    pub fn new(device: &Device) -> Self {
        let conv = |c_in, c_out| {
            Conv2dConfig::new([c_in, c_out], [3, 3])
                .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
                .init(device)
        };
        Self {
            conv1: conv(1, 16),
            norm1: BatchNormConfig::new(16).init(device),
            conv2: conv(16, 32),
            norm2: BatchNormConfig::new(32).init(device),
            pool: MaxPool2dConfig::new([2, 2]).init(),
            fc1: LinearConfig::new(32 * 7 * 7, 64).init(device),
            fc2: LinearConfig::new(64, 10).init(device),
            activation: Relu::new(),
        }
    }

    /// Logits `[batch, 10]` of images `[batch, 1, 28, 28]`.
    pub fn forward(&self, images: Tensor<4>) -> Tensor<2> {
        let x = self.pool.forward(
            self.activation
                .forward(self.norm1.forward(self.conv1.forward(images))),
        );
        let x = self.pool.forward(
            self.activation
                .forward(self.norm2.forward(self.conv2.forward(x))),
        );
        let [n, c, h, w] = x.dims();
        let x = self
            .activation
            .forward(self.fc1.forward(x.reshape([n, c * h * w])));
        self.fc2.forward(x)
    }

    /// The cross-entropy loss `[1]` of a batch, with its logits and targets.
    pub fn classify(&self, batch: FashionBatch) -> ClassificationOutput {
        let logits = self.forward(batch.images);
        let loss = CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits.clone(), batch.targets.clone());
        ClassificationOutput::new(loss, logits, batch.targets)
    }
}

impl TrainStep for Cnn {
    type Input = FashionBatch;
    type Output = ClassificationOutput;

    fn step(&self, batch: FashionBatch) -> TrainOutput<ClassificationOutput> {
        let item = self.classify(batch);
        TrainOutput::new(self, item.loss.backward(), item)
    }
}

impl InferenceStep for Cnn {
    type Input = FashionBatch;
    type Output = ClassificationOutput;

    fn step(&self, batch: FashionBatch) -> ClassificationOutput {
        self.classify(batch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cnn_has_105962_trainable_parameters_and_10_logits() {
        let device = Device::flex();
        let model = Cnn::new(&device);
        // 160 + 32 + 4,640 + 64 + 100,416 + 650 trainable, + 96 BatchNorm running statistics.
        assert_eq!(model.num_params(), 105_962 + 96);
        let logits = model.forward(Tensor::zeros([2, 1, 28, 28], &device));
        assert_eq!(logits.dims(), [2, 10]);
    }
}
