//! On a GPU-class runtime (feature `wgpu`: Burn's wgpu backend through Vulkan; in CI, Mesa's
//! software device): what crosses the replica threads is complete when it crosses, and a run's
//! figures are one device's. The rest of the suite runs on this backend too when the feature is
//! on (`TestBackend`): the harness's core, sharding, short last batches, resume, the NaN guard.

use burn::data::dataloader::batcher::Batcher;
use burn::module::AutodiffModule;
use burn::optim::AdamConfig;
use burn::tensor::ElementConversion;
use burn::train::InferenceStep;
use burn_ddp::DdpConfig;
use burn_ddp_tests::{
    ExampleCnn, Recording, Run, SplitSeen, TestBackend, TestInner, device, run_training_on,
    synthetic_images, with_values,
};

/// Trains the example's CNN (Adam, 1 epoch of `steps` steps of 32 images) on one device
/// (`replicas: None`, plain Burn) or as `replicas` thread replicas, and returns what burn-train
/// saw of training and the trained tensors.
fn cnn_run(replicas: Option<usize>, steps: usize) -> (SplitSeen, Vec<Vec<f32>>) {
    let mut run = Run::new(replicas, 32, steps * 32);
    run.seed = 11;
    run.recording = Some(Recording::default());
    if replicas.is_some() {
        run.config = DdpConfig::default().with_consistency_check_every(10);
    }
    let recording = run.recording.clone().unwrap_or_default();
    let (tensors, _) = run_training_on(
        ExampleCnn::deterministic(&device(), 3),
        AdamConfig::new().init(),
        1e-3,
        synthetic_images(steps * 32, 3),
        synthetic_images(8, 4),
        fashion_mnist::data::FashionBatcher,
        &run,
    )
    .unwrap();
    (recording.seen().0, tensors)
}

#[test]
fn every_joined_training_loss_is_one_devices_on_wgpu() {
    // The other replicas hand rank 0 their step outputs; a tensor whose kernels another thread's
    // stream has not run yet reads as garbage or zero there (11 of 93 losses once, half the loss
    // at a step here). Every step's joined loss must be one device's. (The example's CNN has
    // plain BatchNorm, normalised per replica as with PyTorch's DDP without SyncBatchNorm: a few
    // parts in ten thousand over these steps; a garbage value is off by tens of percent.)
    let steps = 40;
    let (one, _) = cnn_run(None, steps);
    let (ddp, _) = cnn_run(Some(2), steps);
    let losses = |seen: &SplitSeen| seen.values("Loss");
    let (one_losses, ddp_losses) = (losses(&one), losses(&ddp));
    assert_eq!(one_losses.len(), steps, "one device's items");
    assert_eq!(ddp_losses.len(), steps, "burn-ddp's items");
    let wrong: Vec<(usize, f64, f64)> = one_losses
        .iter()
        .zip(&ddp_losses)
        .enumerate()
        .filter(|(_, (a, b))| (*a - *b).abs() > 1e-2 * a.abs().max(1e-3))
        .map(|(i, (a, b))| (i, *a, *b))
        .collect();
    assert!(
        wrong.is_empty(),
        "{} of {steps} joined losses differ from one device's (step, one device, burn-ddp): \
         {wrong:?}",
        wrong.len()
    );
}

#[test]
fn gradients_move_once_each_way_per_bucket_on_wgpu() {
    // Host groups read every gradient to the host on its own (one synchronising transfer per
    // tensor per step); on a device they move once each way per bucket. A bucket per tensor of
    // the MLP's 4 (4-byte caps), 6 steps, threads.
    let mut run = Run::new(Some(2), 16, 6 * 16);
    run.config = DdpConfig::default()
        .with_first_bucket_cap_bytes(4)
        .with_bucket_cap_bytes(4);
    let (_, report) = burn_ddp_tests::run_training(
        burn_ddp_tests::deterministic_mlp(),
        burn::optim::SgdConfig::new().init(),
        0.1,
        &run,
    )
    .unwrap();
    let report = report.expect("a DdpStrategy report");
    assert_eq!(report.ranks.len(), 2);
    for rank in &report.ranks {
        let comm = &rank.comm;
        assert_eq!(comm.steps, 6, "rank {}", rank.rank);
        assert!(
            comm.buckets == 4 * comm.steps,
            "rank {}: several buckets per step: {comm:?}",
            rank.rank
        );
        assert_eq!(
            (comm.transfers_to_host, comm.transfers_to_device),
            (comm.buckets, comm.buckets),
            "rank {}: one transfer each way per bucket: {comm:?}",
            rank.rank
        );
    }
    assert!(
        report.to_string().contains("transfers per step"),
        "shown in the summary:\n{report}"
    );
}

#[test]
fn training_in_threads_leaves_the_callers_model_as_it_was_and_repeats_bit_for_bit() {
    // Burn 0.21's fusion decides whether an operation may write a tensor in place from a count
    // that threads share: a replica that kept the caller's tensors could overwrite them while
    // another thread's queued work still read them (the caller's model changed under it, and a
    // second run from it trained from other values: a resumed run 1e-3 off the uninterrupted
    // one). Every replica must train tensors of its own.
    use burn_ddp_tests::{Mlp, float_tensors, materialized, run_training};
    let model = materialized(Mlp::new(&device()));
    let before = float_tensors(&model);
    let mut run = Run::new(Some(2), 16, 6 * 16);
    run.epochs = 2;
    let runs: Vec<Vec<Vec<f32>>> = (0..4)
        .map(|i| {
            // With checkpoints (their records are read on burn-train's threads) or without.
            run.artifacts = (i % 2 == 1).then(|| {
                let dir = std::env::temp_dir()
                    .join(format!("burn-ddp-wgpu-repeat-{}-{i}", std::process::id()));
                let _ = std::fs::remove_dir_all(&dir);
                dir
            });
            run_training(model.clone(), AdamConfig::new().init(), 1e-2, &run)
                .unwrap()
                .0
        })
        .collect();
    assert_eq!(float_tensors(&model), before, "the caller's model changed");
    assert_ne!(runs[0], before, "the runs trained");
    for (i, again) in runs.iter().enumerate().skip(1) {
        assert_eq!(
            again, &runs[0],
            "run {i} from the same model differs from run 0"
        );
    }
}

/// The places (registration order) and paths of `model`'s buffers: BatchNorm's statistics.
fn buffers_of(model: &ExampleCnn<TestBackend>) -> Vec<(usize, String)> {
    use burn_ddp::mechanism::{ReplicaLayout, TensorKind};
    let layout = ReplicaLayout::of(model);
    let places = layout.tensors().iter().enumerate();
    places
        .filter(|(_, spec)| spec.kind == TensorKind::Buffer)
        .map(|(place, spec)| (place, spec.path.clone()))
        .collect()
}

/// The example's CNN with deterministic weights and BatchNorm's statistics as Burn starts them
/// (means 0, variances 1: a negative variance would make every validation loss NaN).
fn cnn_with_fresh_statistics() -> ExampleCnn<TestBackend> {
    let model = ExampleCnn::<TestBackend>::deterministic(&device(), 3);
    let mut values = burn_ddp_tests::float_tensors(&model);
    for (place, path) in buffers_of(&model) {
        let start = if path.ends_with("running_var") {
            1.0
        } else {
            0.0
        };
        values[place].fill(start);
    }
    with_values(model, &values)
}

#[test]
fn thread_replicas_validate_with_the_batchnorm_statistics_of_the_model_they_return_on_wgpu() {
    // BatchNorm's running statistics live in Burn's `RunningState`, which the clones of a model
    // share: with thread replicas, one thread averaged the others' pending statistics on its own
    // stream and the next thread read that average before it had run (the example's test
    // accuracy in threads 75.08% in one run and 75.99% in the next, at the same training loss).
    // Each validation batch's loss must be the one plain Burn computes with the trained model
    // (the one `fit` returns, evaluated on one device), over two epochs.
    let (steps, valid_batches) = (8, 6);
    let mut run = Run::new(Some(2), 32, steps * 32);
    run.seed = 11;
    run.epochs = 2;
    run.recording = Some(Recording::default());
    let recording = run.recording.clone().unwrap_or_default();
    let valid = synthetic_images(valid_batches * 32, 4);
    let (tensors, _) = run_training_on(
        cnn_with_fresh_statistics(),
        AdamConfig::new().init(),
        1e-2,
        synthetic_images(steps * 32, 3),
        valid.clone(),
        fashion_mnist::data::FashionBatcher,
        &run,
    )
    .unwrap();
    let losses = recording.seen().1.values("Loss");
    assert_eq!(losses.len(), 2 * valid_batches, "validation items");
    // Plain Burn: the trained model on one device, the validation set in the loader's order.
    let trained = with_values(
        ExampleCnn::<TestBackend>::deterministic(&device(), 3),
        &tensors,
    )
    .valid();
    let inner_device = device();
    let wrong: Vec<(usize, f64, f64)> = valid
        .chunks(32)
        .enumerate()
        .filter_map(|(i, items)| {
            let batch: fashion_mnist::data::FashionBatch<TestInner> =
                fashion_mnist::data::FashionBatcher.batch(items.to_vec(), &inner_device);
            let expected = InferenceStep::step(&trained, batch)
                .loss
                .into_scalar()
                .elem::<f64>();
            let got = losses[valid_batches + i];
            assert!(
                got.is_finite() && expected.is_finite(),
                "batch {i}: burn-ddp {got}, plain Burn {expected}: a loss that compares nothing"
            );
            ((got - expected).abs() > 1e-4 * expected.abs().max(1e-3)).then_some((i, expected, got))
        })
        .collect();
    assert!(
        wrong.is_empty(),
        "{} of {valid_batches} validation losses of the last epoch differ from plain Burn's \
         evaluation of the trained model (batch, plain Burn, burn-ddp): {wrong:?}",
        wrong.len()
    );
}

#[test]
fn thread_replicas_fold_the_batchnorm_statistics_of_every_step_as_plain_burn_on_wgpu() {
    // Thread replicas share BatchNorm's statistics in Burn's `RunningState`: each thread's
    // update is kept apart until some thread folds them all into one value. Left to Burn, the
    // first replica to read folded them on its own stream and the other read the fold before the
    // device had computed it: the example's test accuracy in threads varied from run to run.
    // With the learning rate 0 the weights stay, and the statistics must follow plain Burn
    // exactly: at every step each replica's forward pass on its own shard of the step, from the
    // statistics of the step before, then the mean of the replicas' statistics.
    use burn::optim::SgdConfig;
    use burn::train::TrainStep;
    use burn_ddp::DistributedSampler;
    use burn_ddp_tests::float_tensors;
    let (steps, per_rank) = (24, 16);
    let train = synthetic_images(steps * 2 * per_rank, 5);
    let mut run = Run::new(Some(2), 2 * per_rank, train.len());
    run.shuffle = false;
    let initial = || ExampleCnn::<TestBackend>::deterministic(&device(), 3);
    let (ddp, _) = run_training_on(
        initial(),
        SgdConfig::new().init(),
        0.0,
        train.clone(),
        synthetic_images(8, 4),
        fashion_mnist::data::FashionBatcher,
        &run,
    )
    .unwrap();
    // Plain Burn: every replica's forward pass on a model of its own.
    let buffers = buffers_of(&initial());
    assert_eq!(
        buffers.len(),
        4,
        "the CNN's two BatchNorms' mean and variance"
    );
    let sampler = DistributedSampler::new(train.len(), 2)
        .unwrap()
        .without_shuffle();
    let shards: Vec<Vec<usize>> = (0..2).map(|rank| sampler.indices(0, rank)).collect();
    let mut values = float_tensors(&initial());
    for step in 0..steps {
        let folded: Vec<Vec<Vec<f32>>> = shards
            .iter()
            .map(|shard| {
                let items: Vec<_> = shard[step * per_rank..(step + 1) * per_rank]
                    .iter()
                    .map(|&i| train[i].clone())
                    .collect();
                let replica = with_values(initial(), &values);
                let batch = fashion_mnist::data::FashionBatcher.batch(items, &device());
                let _ = TrainStep::step(&replica, batch);
                float_tensors(&replica.valid())
            })
            .collect();
        for &(b, _) in &buffers {
            values[b] = folded[0][b]
                .iter()
                .zip(&folded[1][b])
                .map(|(x, y)| (x + y) / 2.0)
                .collect();
        }
    }
    for (b, path) in &buffers {
        let b = *b;
        let worst = ddp[b]
            .iter()
            .zip(&values[b])
            .map(|(a, e)| (a - e).abs() / e.abs().max(1e-3))
            .fold(0.0f32, f32::max);
        assert!(
            worst <= 1e-4,
            "`{}` after {steps} steps: off plain Burn's by {worst} (relative)\nburn-ddp: {:?}\n\
             plain Burn: {:?}",
            path,
            &ddp[b][..4.min(ddp[b].len())],
            &values[b][..4.min(values[b].len())]
        );
    }
    assert_eq!(
        ddp[0],
        float_tensors(&initial())[0],
        "the weights stayed (learning rate 0)"
    );
}
