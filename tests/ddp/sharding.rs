//! Optimizer-state sharding gives one device's result whatever a model's `optimize` does around
//! the optimizer step, or refuses what it cannot split: each case compared with plain Burn on one
//! device (the same model, the same `optimize`, Burn's own optimizer).

use burn::module::AutodiffModule;
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::{Adam, AdamConfig, GradientsParams, Optimizer};
use burn_ddp::{DdpConfig, DdpError, ShardedOptimizer};
use burn_ddp_tests::{
    BnCnn, FreezesAfterTwoSteps, GlobalNormClipped, Mlp, Run, TestBackend, WithTeacher, device,
    float_tensors, materialized, max_relative_difference, run_training,
};

/// Adam's rounding between a sum over ranks and one device's (see the harness).
const TOLERANCE: f32 = 1e-3;

/// A run of `replicas` ranks (`None`: one device), 6 steps of 16 samples, with the optimizer
/// state sharded on the ranks.
fn run(replicas: Option<usize>) -> Run {
    let mut run = Run::new(replicas, 16, 6 * 16);
    run.epochs = 2;
    if replicas.is_some() {
        run.config = DdpConfig::default()
            .with_optimizer_sharding(true)
            .with_consistency_check_every(1);
    }
    run
}

fn adam<M: AutodiffModule<TestBackend>>() -> OptimizerAdaptor<Adam, M, TestBackend> {
    AdamConfig::new().init()
}

fn assert_as_one_device(what: &str, one: &[Vec<f32>], ddp: &[Vec<f32>], initial: &[Vec<f32>]) {
    let moved = max_relative_difference(one, initial);
    assert!(
        moved > 1e-3,
        "{what}: training moved the parameters by {moved} only"
    );
    let diff = max_relative_difference(ddp, one);
    assert!(
        diff <= TOLERANCE,
        "{what}: {diff} away from plain Burn on one device (tolerance {TOLERANCE})"
    );
}

#[test]
fn a_layer_frozen_in_optimize_after_the_step_is_gathered_first() {
    let model = materialized(FreezesAfterTwoSteps::new(&device()));
    let initial = float_tensors(&model);
    let (one, _) = run_training(model.clone(), adam(), 1e-2, &run(None)).unwrap();
    let (ddp, _) = run_training(model, ShardedOptimizer::new(adam()), 1e-2, &run(Some(2))).unwrap();
    assert_as_one_device("fc1 frozen after step 2", &one, &ddp, &initial);
}

#[test]
fn a_teacher_updated_in_optimize_sees_the_whole_updated_student() {
    let model = materialized(WithTeacher::new(&device()));
    let initial = float_tensors(&model);
    let (one, _) = run_training(model.clone(), adam(), 1e-2, &run(None)).unwrap();
    for replicas in [2, 4] {
        let (ddp, _) = run_training(
            model.clone(),
            ShardedOptimizer::new(adam()),
            1e-2,
            &run(Some(replicas)),
        )
        .unwrap();
        assert_as_one_device(
            &format!("teacher by EMA, {replicas} ranks"),
            &one,
            &ddp,
            &initial,
        );
    }
}

#[test]
fn an_optimizer_that_clips_by_the_global_norm_sees_every_gradient() {
    // A user's wrapper around the sharded optimizer: the global norm is over every gradient.
    let model = materialized(Mlp::new(&device()));
    let initial = float_tensors(&model);
    fn clipped<O>(inner: O) -> GlobalNormClipped<O> {
        GlobalNormClipped {
            inner,
            max_norm: 0.05,
        }
    }
    let (one, _) = run_training(model.clone(), clipped(adam()), 1e-2, &run(None)).unwrap();
    let (ddp, _) = run_training(
        model,
        clipped(ShardedOptimizer::new(adam())),
        1e-2,
        &run(Some(2)),
    )
    .unwrap();
    assert_as_one_device("clipped by the global norm", &one, &ddp, &initial);
}

/// Plain BatchNorm on thread replicas (which share Burn's `RunningState`): the trained tensors,
/// running statistics included, of 2 ranks with or without sharding.
fn batch_norm_run(shard: bool) -> Vec<Vec<f32>> {
    let model = burn_ddp_tests::deterministic(BnCnn::new(&device()), 9);
    let mut run = run(Some(2));
    run.config = DdpConfig::default().with_optimizer_sharding(shard);
    run_training(model, ShardedOptimizer::new(adam()), 1e-2, &run)
        .unwrap()
        .0
}

#[test]
fn plain_batch_norm_in_threads_trains_alike_with_and_without_sharding() {
    let unsharded = batch_norm_run(false);
    for attempt in 0..3 {
        assert_eq!(
            batch_norm_run(true),
            unsharded,
            "attempt {attempt}: sharded thread replicas differ from unsharded ones"
        );
    }
}

/// An optimizer whose record keeps two groups of parameters' state side by side (a struct of two
/// maps, as a param-groups wrapper has): a record sharding cannot split by parameter.
#[derive(Clone)]
struct TwoGroups<M: AutodiffModule<TestBackend>> {
    first: ShardedOptimizer<Adam, M, TestBackend>,
    second: ShardedOptimizer<Adam, M, TestBackend>,
}

type AdamRecord<M> = <OptimizerAdaptor<Adam, M, TestBackend> as Optimizer<M, TestBackend>>::Record;

/// The two groups' records side by side: it serialises as a map with the keys `first` and
/// `second`.
struct TwoGroupsRecord<M: AutodiffModule<TestBackend>> {
    first: AdamRecord<M>,
    second: AdamRecord<M>,
}

#[derive(serde::Serialize, serde::Deserialize)]
#[serde(bound = "")]
#[allow(clippy::type_complexity)]
struct TwoGroupsItem<M: AutodiffModule<TestBackend>, S: burn::record::PrecisionSettings> {
    first: <AdamRecord<M> as burn::record::Record<TestBackend>>::Item<S>,
    second: <AdamRecord<M> as burn::record::Record<TestBackend>>::Item<S>,
}

impl<M: AutodiffModule<TestBackend>, S: burn::record::PrecisionSettings> Clone
    for TwoGroupsItem<M, S>
{
    fn clone(&self) -> Self {
        Self {
            first: self.first.clone(),
            second: self.second.clone(),
        }
    }
}

impl<M: AutodiffModule<TestBackend>> burn::record::Record<TestBackend> for TwoGroupsRecord<M> {
    type Item<S: burn::record::PrecisionSettings> = TwoGroupsItem<M, S>;

    fn into_item<S: burn::record::PrecisionSettings>(self) -> Self::Item<S> {
        TwoGroupsItem {
            first: self.first.into_item(),
            second: self.second.into_item(),
        }
    }

    fn from_item<S: burn::record::PrecisionSettings>(
        item: Self::Item<S>,
        device: &burn::tensor::Device<TestBackend>,
    ) -> Self {
        Self {
            first: burn::record::Record::from_item(item.first, device),
            second: burn::record::Record::from_item(item.second, device),
        }
    }
}

impl<M: AutodiffModule<TestBackend>> Optimizer<M, TestBackend> for TwoGroups<M> {
    type Record = TwoGroupsRecord<M>;

    fn step(&mut self, lr: f64, module: M, grads: GradientsParams) -> M {
        self.first.step(lr, module, grads)
    }

    fn step_multi(&mut self, lr: f64, module: M, grads: burn::optim::MultiGradientsParams) -> M {
        self.first.step_multi(lr, module, grads)
    }

    fn to_record(&self) -> Self::Record {
        TwoGroupsRecord {
            first: self.first.to_record(),
            second: self.second.to_record(),
        }
    }

    fn load_record(self, record: Self::Record) -> Self {
        Self {
            first: self.first.load_record(record.first),
            second: self.second.load_record(record.second),
        }
    }
}

#[test]
fn an_optimizer_record_not_kept_by_parameter_is_refused_naming_the_optimizer() {
    let model = materialized(Mlp::new(&device()));
    let optimizer = TwoGroups {
        first: ShardedOptimizer::new(adam()),
        second: ShardedOptimizer::new(adam()),
    };
    match run_training(model, optimizer, 1e-2, &run(Some(2))) {
        Err(DdpError::InvalidConfig(message)) => {
            assert!(message.contains("TwoGroups"), "{message}");
            assert!(
                message.contains("not a map keyed by parameter"),
                "{message}"
            );
        }
        other => panic!("expected the refusal, got {:?}", other.map(|_| ())),
    }
}

#[test]
fn an_optimizer_not_wrapped_for_sharding_is_refused_at_the_first_step() {
    let model = materialized(Mlp::new(&device()));
    match run_training(model, adam(), 1e-2, &run(Some(2))) {
        Err(DdpError::InvalidConfig(message)) => {
            assert!(message.contains("ShardedOptimizer::new"), "{message}");
            assert!(message.contains("OptimizerAdaptor"), "{message}");
        }
        other => panic!("expected the refusal, got {:?}", other.map(|_| ())),
    }
}
