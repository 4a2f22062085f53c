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

/// `model` trained on 2 ranks through host buckets (threads with shared tensors turned off, as
/// processes would) with `config`, clipped to the global norm 0.05: its trained tensors, and
/// the bytes rank 0 sent per step.
fn host_bucket_run(model: Mlp<TestBackend>, config: DdpConfig) -> (Vec<Vec<f32>>, f64) {
    let mut run = run(Some(2));
    run.config = config
        .with_shared_memory_reduction(false)
        .with_clip_grad_norm(0.05);
    let (tensors, report) = run_training(model, ShardedOptimizer::new(adam()), 1e-2, &run).unwrap();
    let report = report.expect("a DdpStrategy report");
    (tensors, report.ranks[0].bus_bytes_per_step())
}

#[test]
fn reduce_scattered_gradients_train_as_one_device_and_move_a_third_less() {
    let model = materialized(Mlp::new(&device()));
    let model_for_layout = model.clone();
    let initial = float_tensors(&model);
    // One device clips in a wrapper around Burn's optimizer: the same global norm.
    let clipped = GlobalNormClipped {
        inner: adam(),
        max_norm: 0.05,
    };
    let (one, _) = run_training(model.clone(), clipped, 1e-2, &run(None)).unwrap();
    let (plain, plain_bytes) = host_bucket_run(model.clone(), DdpConfig::default());
    let zero1 = DdpConfig::default().with_optimizer_sharding(true);
    let (zero1, zero1_bytes) = host_bucket_run(model.clone(), zero1);
    let (zero2, zero2_bytes) = host_bucket_run(
        model,
        DdpConfig::default()
            .with_optimizer_sharding(true)
            .with_gradient_sharding(true),
    );
    assert_as_one_device("plain DDP", &one, &plain, &initial);
    assert_as_one_device("ZeRO-1", &one, &zero1, &initial);
    assert_as_one_device("ZeRO-2", &one, &zero2, &initial);
    // On 2 ranks (bus bytes, see RankReport::step_bus_bytes) an all-reduce of the gradients
    // sends their bytes G; the parameters' all-gather sends the larger owner's share S (whole
    // tensors: S = G / 2 only for a model that splits evenly); the gradients' reduce-scatter
    // the larger block, S too. Around them: the bookkeeping every bucket carries, the checks'
    // and the stepped tensors' small all-gathers (under 64 bytes a step), and each epoch's
    // end-of-data check, one more reduction that is not a step (so within a fifth).
    let layout = burn_ddp::mechanism::ReplicaLayout::of(&model_for_layout);
    let shards = burn_ddp::mechanism::OptimizerShards::new(&layout, 0, 2);
    let share = *shards.bytes_per_rank().iter().max().unwrap() as f64;
    let gradients = 4.0 * initial.iter().map(Vec::len).sum::<usize>() as f64;
    let report = format!(
        "G {gradients} B, S {share} B; bytes per step: plain {plain_bytes:.0}, ZeRO-1 \
         {zero1_bytes:.0}, ZeRO-2 {zero2_bytes:.0}"
    );
    // ZeRO-1 adds the all-gather to plain DDP's all-reduce.
    assert!(
        (zero1_bytes - plain_bytes - share).abs() < 64.0 + 0.2 * share,
        "{report}"
    );
    // ZeRO-2 sends the reduce-scatter instead of the all-reduce: G - S less.
    assert!(
        (zero1_bytes - zero2_bytes - (gradients - share)).abs() < 64.0 + 0.2 * (gradients - share),
        "{report}"
    );
}

#[test]
fn gradient_sharding_without_optimizer_sharding_is_refused() {
    let model = materialized(Mlp::new(&device()));
    let mut run = run(Some(2));
    run.config = DdpConfig::default().with_gradient_sharding(true);
    let err = run_training(model, adam(), 1e-2, &run).unwrap_err();
    assert!(
        matches!(&err, DdpError::InvalidConfig(m) if m.contains("with_optimizer_sharding")),
        "{err}"
    );
}
