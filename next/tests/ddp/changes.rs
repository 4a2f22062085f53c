//! The set of trained tensors is not fixed: layers frozen or unfrozen during training, tensors
//! shared between two places of the module tree, modules added after the wrapper was built. Each
//! case is either reduced exactly like single-device training on the global batch, or an error
//! on every rank in the same step naming the tensor; never a silent divergence, never a hang.

use std::sync::Arc;
use std::time::Duration;

use burn::data::dataloader::batcher::Batcher;
use burn::module::{Module, ModuleMapper, Param};
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::lr_scheduler::module_lr_scheduler::ModuleLearningRate;
use burn::optim::{GradientsParams, ModuleOptimizer, SgdConfig};
use burn::tensor::{Device, Tensor};
use burn::train::{ClassificationOutput, InferenceStep, TrainOutput, TrainStep};
use burn_ddp::{DdpConfig, DdpError, DistributedDataParallel, ProcessGroup, group::ThreadGroup};
use burn_ddp_tests::{
    Batch, CLASSES, FEATURES, GlobalNormClipped, ItemBatcher, Run, copy_of, device, float_tensors,
    max_relative_difference, run_training, synthetic_dataset,
};

const TIMEOUT: Duration = Duration::from_secs(30);

/// Two layers; `a` can be frozen and unfrozen, `extra` is absent until a test adds it.
#[derive(Module, Debug)]
pub struct TwoLayers {
    a: Linear,
    b: Linear,
    extra: Option<Linear>,
    activation: Relu,
}

impl TwoLayers {
    fn new(device: &Device) -> Self {
        let model = Self {
            a: LinearConfig::new(FEATURES, 32).init(device),
            b: LinearConfig::new(32, CLASSES).init(device),
            extra: None,
            activation: Relu::new(),
        };
        // Materialise the lazily created parameters, so clones share their values.
        let _ = burn_ddp::mechanism::value_fingerprint(&model);
        model
    }

    fn forward(&self, inputs: Tensor<2>) -> Tensor<2> {
        let hidden = self.activation.forward(self.a.forward(inputs));
        let logits = self.b.forward(hidden);
        match &self.extra {
            Some(extra) => extra.forward(logits),
            None => logits,
        }
    }
}

/// Sets `require_grad` on every float tensor it maps.
struct RequireGrad(bool);

impl ModuleMapper for RequireGrad {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        param.set_require_grad(self.0)
    }
}

fn frozen_a(model: TwoLayers) -> TwoLayers {
    TwoLayers {
        a: model.a.no_grad(),
        ..model
    }
}

fn unfrozen_a(model: TwoLayers) -> TwoLayers {
    TwoLayers {
        a: model.a.map(&mut RequireGrad(true)),
        ..model
    }
}

fn loss_grads(model: &TwoLayers, items: Vec<burn_ddp_tests::Item>) -> GradientsParams {
    let batch: Batch = ItemBatcher.batch(items, &device());
    let logits = model.forward(batch.inputs);
    let loss = burn::nn::loss::CrossEntropyLossConfig::new()
        .init(&device())
        .forward(logits, batch.targets);
    GradientsParams::from_grads(loss.backward(), model)
}

/// What a rank does to its model before step `step` (0-based).
type Schedule = fn(usize, usize, TwoLayers) -> TwoLayers;

/// `steps` SGD steps of the global batch `16`, on one device (`world_size` 1, plain Burn: no
/// wrapper) or on `world_size` ranks with `DistributedDataParallel`, each rank taking its share
/// of every step's samples. `schedule(rank, step, model)` changes the model before a step.
/// Returns every rank's final tensors, or its error.
fn custom_loop(
    start: &TwoLayers,
    world_size: usize,
    steps: usize,
    schedule: Schedule,
) -> Vec<Result<Vec<Vec<f32>>, DdpError>> {
    // Copies that share nothing with each other.
    let copy = |m: &TwoLayers| frozen_a(m.valid().train());
    let start = copy(start);
    let data = synthetic_dataset(steps * 16, 21);
    if world_size == 1 {
        let mut model = start.clone();
        let mut optim: ModuleOptimizer = SgdConfig::new().init();
        for step in 0..steps {
            model = schedule(0, step, model);
            let grads = loss_grads(&model, data[step * 16..step * 16 + 16].to_vec());
            model = optim.step(0.1, model, grads);
        }
        return vec![Ok(float_tensors(&model))];
    }
    let groups = ThreadGroup::new_group(world_size).unwrap();
    let per_rank = 16 / world_size;
    std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .map(|group| {
                let (data, start) = (&data, &start);
                s.spawn(move || -> Result<Vec<Vec<f32>>, DdpError> {
                    let rank = group.rank();
                    let group: Arc<dyn ProcessGroup> = Arc::new(group);
                    let config = DdpConfig::default().with_timeout(TIMEOUT);
                    let model = copy(start);
                    let (mut ddp, mut model) =
                        DistributedDataParallel::new(group, model, &device(), config)?;
                    let mut optim: ModuleOptimizer = SgdConfig::new().init();
                    for step in 0..steps {
                        model = schedule(rank, step, model);
                        let first = step * 16 + rank * per_rank;
                        let grads = loss_grads(&model, data[first..first + per_rank].to_vec());
                        let grads = ddp.sync_gradients(&model, grads)?;
                        model = optim.step(0.1, model, grads);
                    }
                    Ok(float_tensors(&model))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn a_layer_unfrozen_at_step_3_trains_like_on_one_device() {
    let schedule: Schedule = |_, step, model| if step == 3 { unfrozen_a(model) } else { model };
    let start = TwoLayers::new(&device());
    let single = custom_loop(&start, 1, 6, schedule).remove(0).unwrap();
    let ranks: Vec<Vec<Vec<f32>>> = custom_loop(&start, 2, 6, schedule)
        .into_iter()
        .map(Result::unwrap)
        .collect();
    // `a` (tensors 0 and 1) moved after it was unfrozen.
    let initial = float_tensors(&start);
    assert_eq!(ranks[0].len(), initial.len());
    assert!(max_relative_difference(&single[..2], &initial[..2]) > 1e-4);
    assert_eq!(ranks[0], ranks[1], "the replicas diverged");
    let diff = max_relative_difference(&ranks[0], &single);
    assert!(diff <= 1e-5, "2 ranks differ from one device by {diff}");
}

#[test]
fn a_layer_frozen_again_and_unfrozen_on_every_rank_trains_like_on_one_device() {
    // Unfrozen at step 1, frozen at 3, unfrozen at 5: every change is taken together.
    let schedule: Schedule = |_, step, model| match step {
        1 | 5 => unfrozen_a(model),
        3 => frozen_a(model),
        _ => model,
    };
    let start = TwoLayers::new(&device());
    let single = custom_loop(&start, 1, 7, schedule).remove(0).unwrap();
    let ranks: Vec<Vec<Vec<f32>>> = custom_loop(&start, 4, 7, schedule)
        .into_iter()
        .map(Result::unwrap)
        .collect();
    for rank in &ranks[1..] {
        assert_eq!(&ranks[0], rank, "the replicas diverged");
    }
    let diff = max_relative_difference(&ranks[0], &single);
    assert!(diff <= 1e-5, "4 ranks differ from one device by {diff}");
}

#[test]
fn a_layer_unfrozen_on_one_rank_only_is_an_error_on_every_rank_naming_it() {
    let schedule: Schedule = |rank, step, model| {
        if step == 2 && rank == 1 {
            unfrozen_a(model)
        } else {
            model
        }
    };
    let start = TwoLayers::new(&device());
    for (rank, result) in custom_loop(&start, 2, 4, schedule).into_iter().enumerate() {
        match result {
            Err(DdpError::ModelChanged { detail, step, .. }) => {
                assert_eq!(step, 2, "rank {rank}: the step it happened");
                assert!(detail.contains("a.weight"), "rank {rank}: {detail}");
                assert!(
                    detail.contains("rank 0 has a frozen weight")
                        && detail.contains("rank 1 has a parameter"),
                    "rank {rank}: {detail}"
                );
            }
            other => panic!("rank {rank}: expected ModelChanged, got {other:?}"),
        }
    }
}

#[test]
fn a_layer_added_after_the_wrapper_was_built_is_an_error_on_every_rank_naming_it() {
    let schedule: Schedule = |_, step, model| {
        if step == 2 {
            TwoLayers {
                extra: Some(LinearConfig::new(CLASSES, CLASSES).init(&device())),
                ..model
            }
        } else {
            model
        }
    };
    let start = TwoLayers::new(&device());
    for (rank, result) in custom_loop(&start, 2, 4, schedule).into_iter().enumerate() {
        match result {
            Err(DdpError::ModelChanged { detail, step, .. }) => {
                assert_eq!(step, 2, "rank {rank}");
                assert!(detail.contains("extra.weight"), "rank {rank}: {detail}");
                assert!(detail.contains("appeared"), "rank {rank}: {detail}");
            }
            other => panic!("rank {rank}: expected ModelChanged, got {other:?}"),
        }
    }
}

/// Widens the hidden layer from 32 to 48 units in place: every dimension of 32 gets 16 zeros more,
/// the parameters keep their ids (a "net2net" widening). Forward still works.
struct Widen;

impl ModuleMapper for Widen {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        param.map(|mut tensor| {
            let require_grad = tensor.is_require_grad();
            for dim in 0..D {
                let mut shape = tensor.dims();
                if shape[dim] == 32 {
                    shape[dim] = 16;
                    let zeros = Tensor::zeros(shape, &tensor.device());
                    tensor = Tensor::cat(vec![tensor, zeros], dim);
                }
            }
            // A leaf again, so that it gets a gradient.
            tensor.detach().set_require_grad(require_grad)
        })
    }
}

#[test]
fn a_layer_reshaped_on_one_rank_only_is_an_error_on_every_rank_naming_it() {
    // Same parameter ids, other shapes: the gradient no longer fits its slot in the bucket. The
    // rank that changed must not fail alone (its peers would see only "aborted"): every rank
    // gets the same ModelChanged error in the same step.
    let schedule: Schedule = |rank, step, model| {
        if step == 2 && rank == 1 {
            TwoLayers {
                a: model.a.map(&mut Widen),
                b: model.b.map(&mut Widen),
                ..model
            }
        } else {
            model
        }
    };
    let start = TwoLayers::new(&device());
    for (rank, result) in custom_loop(&start, 2, 4, schedule).into_iter().enumerate() {
        match result {
            Err(DdpError::ModelChanged { detail, step, .. }) => {
                assert_eq!(step, 2, "rank {rank}: the step it happened");
                // Named as the rank that changed it has it, on every rank.
                assert!(detail.contains("rank(s) [1]"), "rank {rank}: {detail}");
                assert!(
                    detail
                        .contains("`a.weight` of shape [16, 32], now `a.weight` of shape [16, 48]"),
                    "rank {rank}: {detail}"
                );
            }
            other => panic!("rank {rank}: expected ModelChanged, got {other:?}"),
        }
    }
}

/// An MLP whose two layers share one weight (the same `Param`, reachable from two fields): the
/// second layer reads the first layer's weight. Burn's optimizer updates it once per step.
#[derive(Module, Debug)]
pub struct Tied {
    first: Linear,
    second: Linear,
    head: Linear,
    activation: Relu,
}

impl Tied {
    fn new(device: &Device) -> Self {
        let first: Linear = LinearConfig::new(FEATURES, FEATURES).init(device);
        // Materialised first: clones of a lazy parameter initialise separately (no tie).
        let _ = first.weight.val();
        let mut second = LinearConfig::new(FEATURES, FEATURES)
            .with_bias(false)
            .init(device);
        second.weight = first.weight.clone();
        let model = Self {
            first,
            second,
            head: LinearConfig::new(FEATURES, CLASSES).init(device),
            activation: Relu::new(),
        };
        let _ = burn_ddp::mechanism::value_fingerprint(&model);
        model
    }

    fn forward(&self, inputs: Tensor<2>) -> Tensor<2> {
        let x = self.activation.forward(self.first.forward(inputs));
        let x = self.activation.forward(self.second.forward(x));
        self.head.forward(x)
    }
}

impl TrainStep for Tied {
    type Input = Batch;
    type Output = ClassificationOutput;

    fn step(&self, batch: Batch) -> TrainOutput<ClassificationOutput> {
        let logits = self.forward(batch.inputs);
        let loss = burn::nn::loss::CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits.clone(), batch.targets.clone());
        let item = ClassificationOutput::new(loss, logits, batch.targets);
        TrainOutput::new(self, item.loss.backward(), item)
    }
}

impl InferenceStep for Tied {
    type Input = Batch;
    type Output = ClassificationOutput;

    fn step(&self, batch: Batch) -> ClassificationOutput {
        let logits = self.forward(batch.inputs);
        let loss = burn::nn::loss::CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits.clone(), batch.targets.clone());
        ClassificationOutput::new(loss, logits, batch.targets)
    }
}

#[test]
fn a_weight_shared_by_two_layers_is_reduced_and_clipped_once() {
    // The reference is plain Burn on one device with PyTorch's global-norm clipping in its
    // optimizer (every `ParamId` once); burn-ddp on 2 replicas clips the reduced gradients.
    let model = Tied::new(&device());
    let run = Run::new(None, 16, 8 * 16);
    let (one, _) = run_training(
        GlobalNormClipped::new(copy_of(&model), 0.02),
        SgdConfig::new().init(),
        0.5,
        &run,
    )
    .unwrap();
    let mut ddp = Run::new(Some(2), 16, 8 * 16);
    ddp.config = DdpConfig::default().with_clip_grad_norm(0.02);
    let (two, report) = run_training(copy_of(&model), SgdConfig::new().init(), 0.5, &ddp).unwrap();
    assert_eq!(report.unwrap().epochs[0].steps, 8);
    let diff = max_relative_difference(&two, &one);
    assert!(diff <= 1e-5, "2 replicas differ from one device by {diff}");
    // Without clipping the result differs: the clipping is active.
    ddp.config = DdpConfig::default();
    let (unclipped, _) = run_training(model, SgdConfig::new().init(), 0.5, &ddp).unwrap();
    assert!(max_relative_difference(&unclipped, &two) > 1e-3);
}

/// An MLP whose `optimize` unfreezes layer `a` after the optimizer step `unfreeze_after`: the
/// strategy must follow the change on every rank.
#[derive(Module, Debug)]
pub struct Unfreezing {
    inner: TwoLayers,
}

thread_local! {
    static STEPS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

impl TrainStep for Unfreezing {
    type Input = Batch;
    type Output = ClassificationOutput;

    fn step(&self, batch: Batch) -> TrainOutput<ClassificationOutput> {
        let logits = self.inner.forward(batch.inputs);
        let loss = burn::nn::loss::CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits.clone(), batch.targets.clone());
        let item = ClassificationOutput::new(loss, logits, batch.targets);
        TrainOutput::new(self, item.loss.backward(), item)
    }

    fn optimize(
        self,
        optim: &mut ModuleOptimizer,
        lr: ModuleLearningRate,
        grads: GradientsParams,
    ) -> Self {
        let model = optim.step(lr, self, grads);
        let steps = STEPS.with(|s| {
            s.set(s.get() + 1);
            s.get()
        });
        if steps == 2 {
            Unfreezing {
                inner: TwoLayers {
                    a: model.inner.a.map(&mut RequireGrad(true)),
                    ..model.inner
                },
            }
        } else {
            model
        }
    }
}

impl InferenceStep for Unfreezing {
    type Input = Batch;
    type Output = ClassificationOutput;

    fn step(&self, batch: Batch) -> ClassificationOutput {
        let logits = self.inner.forward(batch.inputs);
        let loss = burn::nn::loss::CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits.clone(), batch.targets.clone());
        ClassificationOutput::new(loss, logits, batch.targets)
    }
}

#[test]
fn the_strategy_follows_a_layer_unfrozen_during_training() {
    let start = || {
        let model = TwoLayers::new(&device());
        Unfreezing {
            inner: TwoLayers {
                a: model.a.no_grad(),
                ..model
            },
        }
    };
    let model = start();
    let initial = float_tensors(&model);
    // Every run starts from the same values (a fresh copy each time), counting its own steps.
    let copy = |m: &Unfreezing| m.valid().train();
    let fresh = |m: &Unfreezing| {
        let m = copy(m);
        Unfreezing {
            inner: TwoLayers {
                a: m.inner.a.no_grad(),
                ..m.inner
            },
        }
    };
    let mut run = Run::new(None, 16, 6 * 16);
    run.config = DdpConfig::default().with_consistency_check_every(1);
    let (single, _) = run_training(fresh(&model), SgdConfig::new().init(), 0.1, &run).unwrap();
    run.replicas = Some(2);
    let (two, _) = run_training(fresh(&model), SgdConfig::new().init(), 0.1, &run).unwrap();
    // `a.weight` moved: it was trained after it was unfrozen.
    assert!(max_relative_difference(&single[..1], &initial[..1]) > 1e-4);
    let diff = max_relative_difference(&two, &single);
    assert!(diff <= 1e-5, "2 replicas differ from one device by {diff}");
}
