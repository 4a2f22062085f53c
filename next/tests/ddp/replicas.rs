//! Replicas stay bit-identical: rank 0's values are broadcast at start, every step's averaged
//! gradients are the same bits on every rank, and buffers are kept in sync.

use std::sync::Arc;
use std::time::Duration;

use burn::data::dataloader::batcher::Batcher;
use burn::module::{Module, ModuleMapper, Param};
use burn::optim::lr_scheduler::module_lr_scheduler::ModuleLearningRate;
use burn::optim::{AdamConfig, GradientsParams, ModuleOptimizer, SgdConfig};
use burn::tensor::Tensor;
use burn::train::{ClassificationOutput, InferenceStep, TrainOutput, TrainStep};
use burn_ddp::mechanism::value_fingerprint;
use burn_ddp::{DdpConfig, DdpError, DistributedDataParallel, ProcessGroup, group::ThreadGroup};
use burn_ddp_tests::{
    Batch, BnCnn, ItemBatcher, Mlp, Run, device, float_tensors, materialized, run_training,
    synthetic_dataset,
};

const TIMEOUT: Duration = Duration::from_secs(30);

#[test]
fn independently_built_replicas_hold_identical_parameters_and_buffers_after_every_step() {
    // Each thread builds its own model (different random initial values, separate BatchNorm
    // state); DistributedDataParallel must make and keep them bit-identical.
    let groups = ThreadGroup::new_group(2).unwrap();
    let data = synthetic_dataset(20 * 16, 3);
    let fingerprints: Vec<Vec<u64>> = std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .map(|group| {
                let data = &data;
                s.spawn(move || {
                    let rank = group.rank();
                    let group: Arc<dyn ProcessGroup> = Arc::new(group);
                    let model = BnCnn::new(&device());
                    let before = value_fingerprint(&model);
                    let (mut ddp, mut model) = DistributedDataParallel::new(
                        group.clone(),
                        model,
                        &device(),
                        DdpConfig::default(),
                    )
                    .unwrap();
                    let mut optim: ModuleOptimizer = AdamConfig::new().init();
                    let mut seen = vec![before, value_fingerprint(&model)];
                    for step in 0..20 {
                        // Rank r's shard: the r-th half of this step's 16 samples.
                        let shard = data[step * 16 + rank * 8..step * 16 + rank * 8 + 8].to_vec();
                        let batch: Batch = ItemBatcher.batch(shard, &device());
                        let output = TrainStep::step(&model, batch);
                        let grads = ddp.sync_gradients(&model, output.grads).unwrap();
                        model = optim.step(1e-2, model, grads);
                        model = ddp.sync_buffers(model).unwrap();
                        let fingerprint = value_fingerprint(&model);
                        // Every rank must hold the same bits after every step.
                        let all = group.all_gather(&[fingerprint], TIMEOUT).unwrap();
                        assert_eq!(all[0], all[1], "step {step}: replicas differ");
                        ddp.check_consistency(&model, step as u64).unwrap();
                        seen.push(fingerprint);
                    }
                    seen
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    // The replicas started different, and training changed them.
    assert_ne!(
        fingerprints[0][0], fingerprints[1][0],
        "initial replicas should differ"
    );
    assert_eq!(
        fingerprints[0][1], fingerprints[1][1],
        "broadcast must equalise them"
    );
    assert_ne!(
        fingerprints[0][1], fingerprints[0][21],
        "training must change the values"
    );
}

#[test]
fn the_strategy_keeps_replicas_identical_at_every_step() {
    // The consistency check runs after every optimizer step and fails on any difference.
    let mut run = Run::new(Some(2), 16, 20 * 16);
    run.config = DdpConfig::default().with_consistency_check_every(1);
    let model = materialized(BnCnn::new(&device()));
    let (_, report) = run_training(model, SgdConfig::new().init(), 0.05, &run).unwrap();
    assert_eq!(report.unwrap().epochs[0].steps, 20);
}

/// An MLP whose optimizer step adds 1e-3 to its first weight on rank 1 only: a replica that
/// drifts, which the consistency check must catch.
#[derive(Module, Debug)]
pub struct Drifting {
    inner: Mlp,
}

struct AddToFirst(bool);

impl ModuleMapper for AddToFirst {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let (id, tensor, mapper) = param.consume();
        let tensor = if std::mem::take(&mut self.0) {
            let grad = tensor.is_require_grad();
            let data = tensor.clone().add_scalar(1e-3).into_data();
            let t = Tensor::from_data(data, &tensor.device());
            if grad { t.require_grad() } else { t }
        } else {
            tensor
        };
        Param::from_mapped_value(id, tensor, mapper)
    }
}

impl TrainStep for Drifting {
    type Input = Batch;
    type Output = ClassificationOutput;

    fn step(&self, batch: Batch) -> TrainOutput<ClassificationOutput> {
        TrainStep::step(&self.inner, batch)
    }

    fn optimize(
        self,
        optim: &mut ModuleOptimizer,
        lr: ModuleLearningRate,
        grads: GradientsParams,
    ) -> Self {
        let model = optim.step(lr, self, grads);
        let on_rank_1 = std::thread::current().name() == Some("burn-ddp-rank-1");
        model.map(&mut AddToFirst(on_rank_1))
    }
}

impl InferenceStep for Drifting {
    type Input = Batch;
    type Output = ClassificationOutput;

    fn step(&self, batch: Batch) -> ClassificationOutput {
        InferenceStep::step(&self.inner, batch)
    }
}

#[test]
fn a_drifting_replica_is_named_by_the_consistency_check() {
    let mut run = Run::new(Some(2), 16, 20 * 16);
    run.config = DdpConfig::default().with_consistency_check_every(5);
    let model = materialized(Drifting {
        inner: Mlp::new(&device()),
    });
    let err = run_training(model, SgdConfig::new().init(), 0.05, &run).unwrap_err();
    match err {
        DdpError::ReplicasDiverged {
            step,
            tensor,
            ranks,
            ..
        } => {
            assert_eq!(step, 5, "the first check runs after step 5");
            assert_eq!(ranks, vec![1]);
            assert!(tensor.contains("inner.fc1.weight"), "{tensor}");
        }
        other => panic!("expected ReplicasDiverged, got {other}"),
    }
}

#[test]
fn the_consistency_check_counts_steps_across_epochs() {
    // 3 steps per epoch and a check every 5 steps: the first check falls in the second epoch
    // (a per-epoch counter would never reach 5).
    let mut run = Run::new(Some(2), 16, 3 * 16);
    run.epochs = 2;
    run.config = DdpConfig::default().with_consistency_check_every(5);
    let model = materialized(Drifting {
        inner: Mlp::new(&device()),
    });
    match run_training(model, SgdConfig::new().init(), 0.05, &run).unwrap_err() {
        DdpError::ReplicasDiverged { step, ranks, .. } => {
            assert_eq!(step, 5, "the check after the 5th step, the 2nd of epoch 2");
            assert_eq!(ranks, vec![1]);
        }
        other => panic!("expected ReplicasDiverged, got {other}"),
    }
}

#[test]
fn buffer_sync_averages_the_ranks_statistics_or_copies_rank_0s() {
    // Two replicas see different batches, so their BatchNorm running statistics differ; then
    // `average_buffers` must give every rank the mean of the two, and `sync_buffers` (PyTorch's
    // broadcast_buffers) rank 0's.
    let data = synthetic_dataset(16, 8);
    // Per rank: every float tensor before and after the buffer sync.
    type BeforeAfter = (Vec<Vec<f32>>, Vec<Vec<f32>>);
    let run = |average: bool| -> Vec<BeforeAfter> {
        let groups = ThreadGroup::new_group(2).unwrap();
        std::thread::scope(|s| {
            let handles: Vec<_> = groups
                .into_iter()
                .map(|group| {
                    let data = &data;
                    s.spawn(move || {
                        let rank = group.rank();
                        let group: Arc<dyn ProcessGroup> = Arc::new(group);
                        let model = BnCnn::new(&device());
                        let (ddp, model) = DistributedDataParallel::new(
                            group,
                            model,
                            &device(),
                            DdpConfig::default(),
                        )
                        .unwrap();
                        let shard = data[rank * 8..rank * 8 + 8].to_vec();
                        let batch: Batch = ItemBatcher.batch(shard, &device());
                        let _ = TrainStep::step(&model, batch);
                        let before = float_tensors(&model.valid());
                        let model = if average {
                            ddp.average_buffers(model).unwrap()
                        } else {
                            ddp.sync_buffers(model).unwrap()
                        };
                        (before, float_tensors(&model.valid()))
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    };
    // The buffers: BatchNorm's running mean and variance (tensors 4 and 5 of conv, norm, fc).
    let buffers = [4usize, 5];
    let averaged = run(true);
    let (before0, before1) = (&averaged[0].0, &averaged[1].0);
    for &b in &buffers {
        assert_ne!(
            before0[b], before1[b],
            "tensor {b}: the ranks saw different batches"
        );
        let mean: Vec<f32> = before0[b]
            .iter()
            .zip(&before1[b])
            .map(|(x, y)| (x + y) / 2.0)
            .collect();
        for (rank, (_, after)) in averaged.iter().enumerate() {
            assert_eq!(
                after[b], mean,
                "rank {rank}, tensor {b}: the mean of the ranks"
            );
        }
    }
    let broadcast = run(false);
    for &b in &buffers {
        for (rank, (_, after)) in broadcast.iter().enumerate() {
            assert_eq!(
                after[b], broadcast[0].0[b],
                "rank {rank}, tensor {b}: rank 0's"
            );
        }
        assert_ne!(broadcast[1].0[b], broadcast[0].0[b]);
    }
    // Parameters are not buffers: untouched.
    for (before, after) in averaged.iter().chain(&broadcast) {
        assert_eq!(before[0], after[0]);
    }
}

#[test]
fn a_short_last_accumulation_window_leaves_processes_with_the_same_buffers() {
    // 5 batches an epoch accumulated by 2: the fifth is a window of its own, stepped at the
    // epoch's end (burn-train 0.22), and every forward pass moved each rank's BatchNorm
    // statistics by its own samples. Processes (which do not share Burn's RunningState) must
    // still end with the same buffers, as one device has one set.
    let model = burn_ddp_tests::deterministic(BnCnn::new(&device()), 5);
    let ranks = burn_ddp_tests::over_tcp(2, |_, group| {
        let mut run = Run::new(None, 8, 5 * 8);
        run.group = Some(group);
        run.epochs = 2;
        run.grad_accumulation = Some(2);
        run_training(
            burn_ddp_tests::copy_of(&model),
            SgdConfig::new().init(),
            0.1,
            &run,
        )
        .map(|(tensors, _)| tensors)
    });
    let ranks: Vec<Vec<Vec<f32>>> = ranks.into_iter().map(|r| r.unwrap().unwrap()).collect();
    assert_eq!(
        ranks[1], ranks[0],
        "rank 1's tensors (buffers included) differ from rank 0's"
    );
}
