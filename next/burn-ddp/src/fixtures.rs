//! What the unit tests of the Learner's parts train: a small regression model burn-train can
//! drive, its batches, and a run of burn-train's `SupervisedTraining` whose strategy is a test's
//! closure (burn-train builds what it hands a strategy, its event store among them, only there).

use std::sync::{Arc, Mutex};

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::{DataLoader, DataLoaderBuilder};
use burn::data::dataset::InMemDataset;
use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::{Device, Tensor, TensorData};
use burn::train::metric::store::EventStoreClient;
use burn::train::{
    InferenceStep, Learner, RegressionOutput, SupervisedLearningStrategy, SupervisedTraining,
    SupervisedTrainingEventProcessor, TrainLoader, TrainOutput, TrainStep, TrainingComponents,
    TrainingStrategy, ValidLoader,
};

/// One training step of `learner` on step `step`'s batch of 4 rows, as burn-train's epoch takes
/// it (the learning rate's step, forward and backward, the optimizer step).
pub(crate) fn train_step(learner: &mut Learner<Regressor>, step: usize, device: &Device) {
    learner.lr_step();
    let output = learner.train_step(batch(step, 4, device));
    learner.optimizer_step(output.grads);
}

/// A batch: inputs `[n, 4]` and targets `[n, 2]`.
pub(crate) type Batch = (Tensor<2>, Tensor<2>);

/// Two linear layers with a tanh between, trained on the mean squared error.
#[derive(Module, Debug)]
pub(crate) struct Regressor {
    a: Linear,
    b: Linear,
}

impl Regressor {
    /// A new model on `device`, Burn's initialisation.
    pub fn new(device: &Device) -> Self {
        Self {
            a: LinearConfig::new(4, 5).init(device),
            b: LinearConfig::new(5, 2).init(device),
        }
    }

    /// Every parameter value, in order (weights and biases of both layers).
    pub fn values(&self) -> Vec<f32> {
        let mut values = Vec::new();
        for linear in [&self.a, &self.b] {
            values.extend(linear.weight.val().into_data().iter::<f32>());
            if let Some(bias) = &linear.bias {
                values.extend(bias.val().into_data().iter::<f32>());
            }
        }
        values
    }

    fn regression(&self, (x, y): Batch) -> RegressionOutput {
        let out = self.b.forward(self.a.forward(x).tanh());
        let loss = (out.clone() - y.clone()).powi_scalar(2).mean();
        RegressionOutput::new(loss, out, y)
    }
}

impl TrainStep for Regressor {
    type Input = Batch;
    type Output = RegressionOutput;

    fn step(&self, batch: Batch) -> TrainOutput<RegressionOutput> {
        let output = self.regression(batch);
        TrainOutput::new(self, output.loss.backward(), output)
    }
}

impl InferenceStep for Regressor {
    type Input = Batch;
    type Output = RegressionOutput;

    fn step(&self, batch: Batch) -> RegressionOutput {
        self.regression(batch)
    }
}

/// Step `step`'s batch of `rows` rows, on `device`.
pub(crate) fn batch(step: usize, rows: usize, device: &Device) -> Batch {
    let value = |row: usize, col: usize, salt: usize| {
        (((row * 7 + col * 3 + step * 11 + salt) % 17) as f32 - 8.0) / 8.0
    };
    let x: Vec<f32> = (0..rows)
        .flat_map(|r| (0..4).map(move |c| value(r, c, 0)))
        .collect();
    let y: Vec<f32> = (0..rows)
        .flat_map(|r| (0..2).map(move |c| value(r, c, 5)))
        .collect();
    (
        Tensor::from_data(TensorData::new(x, [rows, 4]), device),
        Tensor::from_data(TensorData::new(y, [rows, 2]), device),
    )
}

/// Item `i`'s row: its inputs and targets depend on the item alone, so a batch of items is the
/// rows of its items, however the items are batched.
#[derive(Clone)]
struct ByItem;

impl Batcher<usize, Batch> for ByItem {
    fn batch(&self, items: Vec<usize>, device: &Device) -> Batch {
        let value = |item: usize, col: usize, salt: usize| {
            (((item * 7 + col * 3 + salt) % 17) as f32 - 8.0) / 8.0
        };
        let rows = items.len();
        let x: Vec<f32> = items
            .iter()
            .flat_map(|&i| (0..4).map(move |c| value(i, c, 0)))
            .collect();
        let y: Vec<f32> = items
            .iter()
            .flat_map(|&i| (0..2).map(move |c| value(i, c, 5)))
            .collect();
        (
            Tensor::from_data(TensorData::new(x, [rows, 4]), device),
            Tensor::from_data(TensorData::new(y, [rows, 2]), device),
        )
    }
}

/// burn-ddp's loader of `items` items for `world_size` ranks, `batch_size` a rank, in order
/// (no shuffle), each item its own row ([`ByItem`]).
pub(crate) fn distributed_loader(
    items: usize,
    batch_size: usize,
    world_size: usize,
    device: &Device,
) -> Arc<dyn DataLoader<Batch>> {
    let sampler = crate::DistributedSampler::new(items, world_size)
        .unwrap()
        .without_shuffle();
    distributed_loader_of(sampler, batch_size, device)
}

/// burn-ddp's loader over `sampler`'s items, `batch_size` a rank, each item its own row.
pub(crate) fn distributed_loader_of(
    sampler: crate::DistributedSampler,
    batch_size: usize,
    device: &Device,
) -> Arc<dyn DataLoader<Batch>> {
    let items = sampler.dataset_len();
    Arc::new(
        crate::DistributedDataLoader::new(
            Arc::new(InMemDataset::new((0..items).collect())),
            ByItem,
            sampler,
            batch_size,
            device.clone(),
        )
        .unwrap(),
    )
}

/// Burn's shuffled loader (its guide's `.shuffle(seed)`) of `items` items in batches of
/// `batch_size`, each item its own row ([`ByItem`]).
pub(crate) fn shuffled_loader(
    items: usize,
    batch_size: usize,
    seed: u64,
) -> Arc<dyn DataLoader<Batch>> {
    DataLoaderBuilder::new(ByItem)
        .batch_size(batch_size)
        .shuffle(seed)
        .build(InMemDataset::new((0..items).collect()))
}

/// A loader of `items` items in batches of `batch_size`, each item its own row ([`ByItem`]).
pub(crate) fn item_loader(items: usize, batch_size: usize) -> Arc<dyn DataLoader<Batch>> {
    DataLoaderBuilder::new(ByItem)
        .batch_size(batch_size)
        .build(InMemDataset::new((0..items).collect()))
}

#[derive(Clone)]
struct Rows;

impl Batcher<usize, Batch> for Rows {
    fn batch(&self, items: Vec<usize>, device: &Device) -> Batch {
        batch(items.first().copied().unwrap_or(0), items.len(), device)
    }
}

/// A loader of `items` items in batches of 4.
pub(crate) fn loader(items: usize) -> Arc<dyn DataLoader<Batch>> {
    DataLoaderBuilder::new(Rows)
        .batch_size(4)
        .build(InMemDataset::new((0..items).collect()))
}

/// What a test's strategy is given: the learner, and what burn-train hands a strategy.
type Probe = Box<dyn FnOnce(&mut Learner<Regressor>, &mut TrainingComponents<Regressor>) + Send>;

/// A strategy that runs a test's closure instead of training.
struct Probing(Mutex<Option<Probe>>);

impl SupervisedLearningStrategy<Regressor> for Probing {
    fn fit(
        &self,
        mut components: TrainingComponents<Regressor>,
        mut learner: Learner<Regressor>,
        _: TrainLoader<Regressor>,
        _: ValidLoader<Regressor>,
        _: usize,
    ) -> (Regressor, SupervisedTrainingEventProcessor<Regressor>) {
        let probe = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        if let Some(probe) = probe {
            probe(&mut learner, &mut components);
        }
        (learner.model(), components.event_processor)
    }
}

/// Runs `probe` inside burn-train's `SupervisedTraining::launch` of `learner`, artifacts in
/// `dir` (no application logger: tests share the process).
pub(crate) fn inside_burn_train(
    dir: &std::path::Path,
    learner: Learner<Regressor>,
    probe: impl FnOnce(&mut Learner<Regressor>, &EventStoreClient) + Send + 'static,
) {
    inside_burn_train_with(
        dir,
        learner,
        |training| training,
        |learner, components| probe(learner, &components.event_store),
    );
}

/// [`inside_burn_train`] with the training configured by `configure` first, the probe given all
/// that burn-train hands the strategy.
pub(crate) fn inside_burn_train_with(
    dir: &std::path::Path,
    learner: Learner<Regressor>,
    configure: impl FnOnce(SupervisedTraining<Regressor>) -> SupervisedTraining<Regressor>,
    probe: impl FnOnce(&mut Learner<Regressor>, &mut TrainingComponents<Regressor>) + Send + 'static,
) {
    let strategy = Probing(Mutex::new(Some(Box::new(probe))));
    let training = SupervisedTraining::new(dir, loader(8), loader(4))
        .with_application_logger(None)
        .with_training_strategy(TrainingStrategy::Custom(Arc::new(strategy)));
    let result = configure(training).launch(learner);
    assert!(
        result.error.is_none(),
        "burn-train failed: {:?}",
        result.error
    );
}
