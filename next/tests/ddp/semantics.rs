//! Training semantics and safety: NaN/infinity, global-norm clipping, buffers across processes,
//! checkpoint/resume, uneven data (join), SyncBatchNorm, each against plain Burn or an
//! independent reference.

use burn::module::Module;
use burn::optim::{AdamConfig, SgdConfig};
use burn::train::{InferenceStep, TrainOutput, TrainStep};
use burn_ddp::config::{BufferSync, NonFinite, UnevenInputs};
use burn_ddp::{DdpConfig, DdpError};
use burn_ddp_tests::{
    Batch, BnCnn, CountingScheduler, GlobalNormClipped, Mlp, Recording, Run, ValidKind, copy_of,
    deterministic_mlp, device, float_tensors, materialized, max_relative_difference, over_tcp,
    run_training, with_values,
};

/// `M` (the MLP, or the BatchNorm CNN, whose forward pass then writes NaN into the replica's
/// running statistics) with NaN inputs, so NaN logits, at rank 1's 3rd batch.
#[derive(Module, Debug)]
pub struct NanOnRank1<M> {
    inner: M,
}

thread_local! {
    static BATCHES: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

impl<M: TrainStep<Input = Batch>> TrainStep for NanOnRank1<M> {
    type Input = Batch;
    type Output = M::Output;

    fn step(&self, batch: Batch) -> TrainOutput<M::Output> {
        let n = BATCHES.with(|b| {
            b.set(b.get() + 1);
            b.get()
        });
        let mut batch = batch;
        if n == 3 && std::thread::current().name() == Some("burn-ddp-rank-1") {
            batch.inputs = batch.inputs.mul_scalar(f32::NAN);
        }
        TrainStep::step(&self.inner, batch)
    }
}

impl<M: InferenceStep> InferenceStep for NanOnRank1<M> {
    type Input = M::Input;
    type Output = M::Output;

    fn step(&self, batch: M::Input) -> M::Output {
        InferenceStep::step(&self.inner, batch)
    }
}

fn nan_run(policy: NonFinite) -> Result<burn_ddp_tests::Trained, DdpError> {
    nan_run_with(policy, CountingScheduler::new(0.1), false)
}

/// Two thread replicas, rank 1's third batch NaN, the replicas compared after every step;
/// `shard`: with the optimizer state sharded.
fn nan_run_with(
    policy: NonFinite,
    scheduler: CountingScheduler,
    shard: bool,
) -> Result<burn_ddp_tests::Trained, DdpError> {
    let model = materialized(NanOnRank1 {
        inner: Mlp::new(&device()),
    });
    let mut run = Run::new(Some(2), 16, 8 * 16);
    run.config = DdpConfig::default()
        .with_non_finite(policy)
        .with_consistency_check_every(1)
        .with_optimizer_sharding(shard);
    run_training(model, SgdConfig::new().init(), scheduler, &run)
}

#[test]
fn a_nan_on_one_rank_skips_the_step_on_every_rank() {
    // With the optimizer state sharded too: no rank steps or gathers its share.
    for shard in [false, true] {
        let scheduler = CountingScheduler::new(0.1);
        let (params, report) = nan_run_with(NonFinite::SkipStep, scheduler.clone(), shard).unwrap();
        // Once per optimizer step, right before it, as burn-train 0.22 steps it (a skipped step
        // spends its learning rate): 8 batches on each of the 2 replicas.
        assert_eq!(
            scheduler.count(),
            2 * 8,
            "LR scheduler steps (sharded: {shard})"
        );
        assert!(
            params.iter().flatten().all(|v| v.is_finite()),
            "a NaN reached the parameters (sharded: {shard})"
        );
        let report = report.unwrap();
        assert_eq!(report.epochs[0].steps, 7, "8 batches, one step skipped");
        for rank in &report.ranks {
            assert_eq!(
                rank.skipped_steps, 1,
                "rank {} (sharded: {shard})",
                rank.rank
            );
        }
    }
}

#[test]
fn without_the_guard_the_nan_reaches_the_parameters() {
    let (params, _) = nan_run(NonFinite::Ignore).unwrap();
    assert!(params.iter().flatten().any(|v| v.is_nan()));
}

#[test]
fn the_error_policy_names_the_step_and_the_rank() {
    match nan_run(NonFinite::Error).unwrap_err() {
        DdpError::NonFinite { step, ranks, .. } => {
            assert_eq!(step, 2, "the third optimizer step (0-based)");
            assert_eq!(ranks, vec![1]);
        }
        other => panic!("expected NonFinite, got {other}"),
    }
}

#[test]
fn global_norm_clipping_matches_plain_burn_clipped_the_same_way_and_changes_the_result() {
    let model = materialized(Mlp::new(&device()));
    let mut run = Run::new(Some(2), 32, 10 * 32);
    run.config = DdpConfig::default().with_clip_grad_norm(0.05);
    let (two, _) = run_training(model.clone(), SgdConfig::new().init(), 0.5, &run).unwrap();
    // The reference: plain Burn on one device with the whole batch, its gradients clipped by
    // their global norm (PyTorch's `clip_grad_norm_`, written in the test library).
    let (one, _) = run_training(
        GlobalNormClipped::new(model.clone(), 0.05),
        SgdConfig::new().init(),
        0.5,
        &Run::new(None, 32, 10 * 32),
    )
    .unwrap();
    let diff = max_relative_difference(&two, &one);
    assert!(diff <= 1e-5, "clipped runs differ by {diff}");
    // And the clipping is active: without it the result is different.
    run.config = DdpConfig::default();
    let (unclipped, _) = run_training(model, SgdConfig::new().init(), 0.5, &run).unwrap();
    assert!(max_relative_difference(&unclipped, &two) > 1e-3);
}

/// Trains the BatchNorm CNN as two "processes": threads of this test, each with its own model
/// (so they do not share Burn's RunningState) and a TcpGroup over loopback; `nan`: with rank
/// 1's third batch NaN ([`NanOnRank1`]).
fn two_process_run_of(
    buffers: BufferSync,
    nan: bool,
) -> Vec<Result<burn_ddp_tests::Trained, DdpError>> {
    over_tcp(2, |_, group| {
        let mut run = Run::new(None, 16, 10 * 16);
        run.group = Some(group);
        run.config = DdpConfig::default()
            .with_buffer_sync(buffers)
            .with_consistency_check_every(1);
        let model = materialized(BnCnn::new(&device()));
        if nan {
            run_training(
                NanOnRank1 { inner: model },
                SgdConfig::new().init(),
                0.05,
                &run,
            )
        } else {
            run_training(model, SgdConfig::new().init(), 0.05, &run)
        }
    })
    .into_iter()
    .map(|result| result.and_then(|trained| trained))
    .collect()
}

#[test]
fn buffers_stay_identical_across_processes_by_averaging_or_broadcast() {
    let mut finals = Vec::new();
    for mode in [BufferSync::Average, BufferSync::Broadcast] {
        let results = two_process_run_of(mode, false);
        let (rank0, _) = results[0].as_ref().unwrap();
        let (rank1, _) = results[1].as_ref().unwrap();
        assert_eq!(rank0, rank1, "{mode:?}: the replicas differ");
        finals.push(rank0.clone());
    }
    // Averaging and broadcasting are different operations: their running statistics differ.
    assert_ne!(
        finals[0][4], finals[1][4],
        "running means of Average and Broadcast"
    );
}

#[test]
fn a_skipped_step_also_rolls_back_the_running_statistics() {
    // Rank 1's NaN batch poisons its BatchNorm statistics during the forward pass; the step is
    // skipped, and the statistics must be restored, or averaging spreads the NaN to every rank.
    let results = two_process_run_of(BufferSync::Average, true);
    let (rank0, report) = results[0].as_ref().unwrap();
    let (rank1, _) = results[1].as_ref().unwrap();
    assert_eq!(rank0, rank1, "the replicas differ");
    assert_eq!(
        rank0.len(),
        8,
        "conv, norm (with its 2 running statistics) and fc"
    );
    assert!(
        rank0.iter().flatten().all(|v| v.is_finite()),
        "a NaN reached the parameters or the running statistics"
    );
    let report = report.as_ref().unwrap();
    assert_eq!(report.epochs[0].steps, 9, "10 batches, one step skipped");
}

#[test]
fn without_buffer_sync_separate_processes_drift_apart() {
    for result in two_process_run_of(BufferSync::None, false) {
        match result {
            Err(DdpError::ReplicasDiverged { tensor, .. }) => {
                assert!(tensor.contains("norm.running"), "{tensor}")
            }
            other => panic!("expected the consistency check to fail, got {other:?}"),
        }
    }
}

#[test]
fn resuming_from_a_checkpoint_gives_the_parameters_of_the_uninterrupted_run() {
    let model = materialized(Mlp::new(&device()));
    let straight_dir = tempfile::tempdir().unwrap();
    let mut run = Run::new(Some(2), 16, 6 * 16);
    run.epochs = 2;
    run.artifacts = Some(straight_dir.path().to_path_buf());
    let (straight, _) = run_training(model.clone(), AdamConfig::new().init(), 1e-2, &run).unwrap();
    // The reference: plain Burn, uninterrupted, to f32 rounding.
    let mut plain = Run::new(None, 16, 6 * 16);
    plain.epochs = 2;
    let (reference, _) =
        run_training(model.clone(), AdamConfig::new().init(), 1e-2, &plain).unwrap();
    let diff = max_relative_difference(&straight, &reference);
    assert!(diff <= 1e-5, "2 ranks differ from one device by {diff}");

    // The same job, stopped after epoch 1 ...
    let dir = tempfile::tempdir().unwrap();
    run.artifacts = Some(dir.path().to_path_buf());
    run.epochs = 1;
    run_training(model.clone(), AdamConfig::new().init(), 1e-2, &run).unwrap();
    assert!(dir.path().join("checkpoint/ddp-state-1.json").is_file());
    // ... and resumed from its checkpoint (a fresh model: every value comes from the file).
    run.epochs = 2;
    run.resume_after = Some(1);
    let (resumed, _) = run_training(
        materialized(Mlp::new(&device())),
        AdamConfig::new().init(),
        1e-2,
        &run,
    )
    .unwrap();
    assert_eq!(resumed, straight, "the resumed run must match bit for bit");

    // Resuming with another world size at an epoch boundary re-shards: with the same global
    // batch, DistributedSampler gives every step the same samples, so the run continues as the
    // uninterrupted one, to f32 rounding (the sums are grouped differently).
    run.replicas = Some(4);
    let (resharded, _) = run_training(
        materialized(Mlp::new(&device())),
        AdamConfig::new().init(),
        1e-2,
        &run,
    )
    .unwrap();
    let diff = max_relative_difference(&resharded, &straight);
    assert!(diff <= 1e-5, "4 ranks after 2 differ by {diff}");
    assert_ne!(resharded, straight, "a real re-shard rounds differently");
}

#[test]
fn a_sharded_run_checkpoints_the_whole_optimizer_state_and_resumes_with_any_world_size() {
    let model = materialized(Mlp::new(&device()));
    let adam = || AdamConfig::new().init();
    // The reference: plain Burn on one device, two epochs of batches of 16.
    let mut single = Run::new(None, 16, 6 * 16);
    single.epochs = 2;
    let (reference, _) = run_training(model.clone(), adam(), 1e-2, &single).unwrap();
    // Two ranks with the optimizer state sharded, uninterrupted.
    let straight_dir = tempfile::tempdir().unwrap();
    let mut run = Run::new(Some(2), 16, 6 * 16);
    run.epochs = 2;
    run.config = DdpConfig::default().with_optimizer_sharding(true);
    run.artifacts = Some(straight_dir.path().to_path_buf());
    let (straight, _) = run_training(model.clone(), adam(), 1e-2, &run).unwrap();
    let diff = max_relative_difference(&straight, &reference);
    assert!(
        diff <= 1e-3,
        "sharded 2 ranks differ from one device by {diff}"
    );
    // Stopped after epoch 1: rank 0's checkpoint must hold every rank's Adam moments ...
    let dir = tempfile::tempdir().unwrap();
    run.artifacts = Some(dir.path().to_path_buf());
    run.epochs = 1;
    run_training(model.clone(), adam(), 1e-2, &run).unwrap();
    run.epochs = 2;
    run.resume_after = Some(1);
    // ... so the run resumes bit for bit on 2 sharded ranks, and as one device's (Adam's
    // rounding: 1e-3) on 4 sharded ranks and on 2 without sharding. A checkpoint with rank 0's
    // share only would restart the other parameters' moments: a step of the learning rate's
    // size, far outside the tolerance.
    let resumed = |replicas: usize, shard: bool| {
        let mut run = run.clone();
        run.replicas = Some(replicas);
        run.config = DdpConfig::default().with_optimizer_sharding(shard);
        run_training(materialized(Mlp::new(&device())), adam(), 1e-2, &run)
            .unwrap()
            .0
    };
    assert_eq!(
        resumed(2, true),
        straight,
        "resumed on the same 2 sharded ranks"
    );
    for (replicas, shard) in [(4, true), (2, false)] {
        let diff = max_relative_difference(&resumed(replicas, shard), &reference);
        assert!(
            diff <= 1e-3,
            "resumed on {replicas} ranks (sharding {shard}) differs from one device by {diff}"
        );
    }
}

#[test]
fn a_sharded_job_of_processes_resumes_every_ranks_optimizer_state() {
    // Every rank builds its own model, as separate processes do: the same values (the start-up
    // broadcast makes sure of it) under parameter ids of its own, until a checkpoint's are
    // loaded everywhere.
    let train = |run: &Run| -> Vec<Vec<f32>> {
        let results = over_tcp(2, |_, group| {
            let run = Run {
                group: Some(group),
                replicas: None,
                ..run.clone()
            };
            run_training(deterministic_mlp(), AdamConfig::new().init(), 1e-2, &run).map(|r| r.0)
        });
        let mut results = results.into_iter().map(|r| r.unwrap().unwrap());
        let rank0 = results.next().unwrap();
        assert!(results.all(|other| other == rank0), "the ranks differ");
        rank0
    };
    let straight_dir = tempfile::tempdir().unwrap();
    let mut run = Run::new(None, 16, 6 * 16);
    run.config = DdpConfig::default().with_optimizer_sharding(true);
    run.epochs = 2;
    run.artifacts = Some(straight_dir.path().to_path_buf());
    let straight = train(&run);
    let dir = tempfile::tempdir().unwrap();
    run.artifacts = Some(dir.path().to_path_buf());
    run.epochs = 1;
    train(&run);
    run.epochs = 2;
    run.resume_after = Some(1);
    // Rank 1's share must reach the checkpoint under rank 0's ids, or its parameters restart
    // their Adam moments.
    assert_eq!(
        train(&run),
        straight,
        "the resumed job must match the uninterrupted one bit for bit"
    );
}

#[test]
fn join_mode_with_11_samples_2_ranks_batch_5_equals_single_device_training() {
    let model = materialized(Mlp::new(&device()));
    // Reference: one device, batches of 10 (the two ranks' 5 + 5), then 1.
    let (single, _) = run_training(
        model.clone(),
        SgdConfig::new().init(),
        0.2,
        &Run::new(None, 10, 11),
    )
    .unwrap();
    // Join: rank 0 has 6 samples (5 + 1), rank 1 has 5; at the second step rank 1 has none and
    // contributes zeros while rank 0's single sample carries the step.
    let mut run = Run::new(Some(2), 10, 11);
    run.config = DdpConfig::default().with_uneven_inputs(UnevenInputs::Join);
    let (joined, report) = run_training(model.clone(), SgdConfig::new().init(), 0.2, &run).unwrap();
    let diff = max_relative_difference(&joined, &single);
    assert!(
        diff <= 1e-5,
        "join differs from single-device training by {diff}"
    );
    let report = report.unwrap();
    assert_eq!(report.epochs[0].steps, 2);
    assert_eq!(report.ranks[0].batches, 2);
    assert_eq!(report.ranks[1].batches, 1);
    let initial = float_tensors(&model);
    assert!(
        max_relative_difference(&single, &initial) > 1e-3,
        "training must move"
    );

    // Without join mode a DistributedDataLoader says the same (the default: the same shards,
    // rank 1 without a sample in the second step); PyTorch's padding gives both ranks 2 batches
    // (12 samples, one of them twice).
    let (exact, report) = run_training(
        model.clone(),
        SgdConfig::new().init(),
        0.2,
        &Run::new(Some(2), 10, 11),
    )
    .unwrap();
    assert!(max_relative_difference(&exact, &single) <= 1e-5);
    let report = report.unwrap();
    assert_eq!((report.ranks[0].batches, report.ranks[1].batches), (2, 1));
    let mut padded = Run::new(Some(2), 10, 11);
    padded.padded = true;
    let (_, report) = run_training(model, SgdConfig::new().init(), 0.2, &padded).unwrap();
    let report = report.unwrap();
    assert_eq!((report.ranks[0].batches, report.ranks[1].batches), (2, 2));
}

#[test]
fn join_weights_unequal_partial_batches_by_their_samples() {
    // 11 samples, 2 ranks, 4 per rank: the second step has 2 samples on rank 0 and 1 on rank 1,
    // weighted 2/3 and 1/3. The reference: one device with batches of 8 and 3.
    let model = materialized(Mlp::new(&device()));
    let (single, _) = run_training(
        model.clone(),
        SgdConfig::new().init(),
        0.2,
        &Run::new(None, 8, 11),
    )
    .unwrap();
    let mut run = Run::new(Some(2), 8, 11);
    run.config = DdpConfig::default().with_uneven_inputs(UnevenInputs::Join);
    let (joined, report) = run_training(model, SgdConfig::new().init(), 0.2, &run).unwrap();
    let diff = max_relative_difference(&joined, &single);
    assert!(diff <= 1e-5, "join differs from one device by {diff}");
    let report = report.unwrap();
    assert_eq!((report.ranks[0].batches, report.ranks[1].batches), (2, 2));
    assert_eq!(report.epochs[0].samples, 11);
}

#[test]
fn sync_batch_norm_over_2_replicas_matches_batch_norm_on_one_device() {
    use burn_ddp_tests::SyncBnCnn;
    let model = materialized(SyncBnCnn::new(&device()));
    // The reference is Burn's own BatchNorm, with the same values, on one device with the
    // whole batch of 16 (a fresh model: clones of a module share Burn's RunningState).
    let reference = with_values(materialized(BnCnn::new(&device())), &float_tensors(&model));
    let (single, _) = run_training(
        reference,
        SgdConfig::new().init(),
        0.1,
        &Run::new(None, 16, 10 * 16),
    )
    .unwrap();
    let mut run = Run::new(Some(2), 16, 10 * 16);
    run.config = DdpConfig::default().with_consistency_check_every(1);
    let (synced, _) = run_training(copy_of(&model), SgdConfig::new().init(), 0.1, &run).unwrap();
    let diff = max_relative_difference(&synced, &single);
    assert!(
        diff <= 1e-4,
        "SyncBatchNorm differs from one device by {diff}"
    );
    assert!(max_relative_difference(&single, &float_tensors(&model)) > 1e-3);

    // Plain BatchNorm normalises each replica's 8 samples on their own: not the same training.
    let plain = materialized(BnCnn::new(&device()));
    let (one, _) = run_training(
        copy_of(&plain),
        SgdConfig::new().init(),
        0.1,
        &Run::new(None, 16, 160),
    )
    .unwrap();
    let (two, _) = run_training(
        plain,
        SgdConfig::new().init(),
        0.1,
        &Run::new(Some(2), 16, 160),
    )
    .unwrap();
    assert!(
        max_relative_difference(&two, &one) > 10.0 * diff.max(1e-6),
        "the per-replica statistics should make plain BatchNorm differ"
    );
}

#[test]
fn a_resumed_run_validates_on_the_batches_of_the_uninterrupted_run() {
    // A shuffled validation DistributedDataLoader: its order follows burn-train's epoch during
    // validation too, so a run resumed after epoch 1 validates epoch 2 on the same batches.
    let model = materialized(Mlp::new(&device()));
    let mut run = Run::new(Some(2), 16, 4 * 16);
    run.epochs = 2;
    run.valid = ValidKind::Shuffled;
    run.valid_samples = Some(24);
    run.valid_batch = 4;
    let epoch_2 = |recording: &Recording| -> Vec<Vec<(String, f64, usize)>> {
        let (_, valid) = recording.seen();
        valid
            .items
            .into_iter()
            .filter(|item| item.epoch == 2)
            .map(|item| item.metrics)
            .collect()
    };
    let straight_dir = tempfile::tempdir().unwrap();
    run.artifacts = Some(straight_dir.path().to_path_buf());
    let straight = Recording::default();
    run.recording = Some(straight.clone());
    run_training(model.clone(), SgdConfig::new().init(), 0.1, &run).unwrap();

    let dir = tempfile::tempdir().unwrap();
    run.artifacts = Some(dir.path().to_path_buf());
    run.epochs = 1;
    run.recording = Some(Recording::default());
    run_training(model.clone(), SgdConfig::new().init(), 0.1, &run).unwrap();
    run.epochs = 2;
    run.resume_after = Some(1);
    let resumed = Recording::default();
    run.recording = Some(resumed.clone());
    run_training(
        materialized(Mlp::new(&device())),
        SgdConfig::new().init(),
        0.1,
        &run,
    )
    .unwrap();
    let expected = epoch_2(&straight);
    assert_eq!(expected.len(), 6, "24 items in batches of 4");
    assert_eq!(epoch_2(&resumed), expected);
}

#[test]
fn a_truncated_newest_checkpoint_is_passed_over_and_the_run_resumes_from_the_one_before() {
    let model = materialized(Mlp::new(&device()));
    let straight_dir = tempfile::tempdir().unwrap();
    let mut run = Run::new(Some(2), 16, 6 * 16);
    run.epochs = 3;
    run.artifacts = Some(straight_dir.path().to_path_buf());
    let (straight, _) = run_training(model.clone(), AdamConfig::new().init(), 1e-2, &run).unwrap();

    // The same job, stopped after epoch 2 ...
    let dir = tempfile::tempdir().unwrap();
    run.artifacts = Some(dir.path().to_path_buf());
    run.epochs = 2;
    run_training(model.clone(), AdamConfig::new().init(), 1e-2, &run).unwrap();
    // ... whose newest checkpoint lost its end (a crash while it was copied, a full disk).
    let newest = dir.path().join("checkpoint/model-2.bpk");
    let bytes = std::fs::read(&newest).unwrap();
    std::fs::write(&newest, &bytes[..bytes.len() / 2]).unwrap();
    // Resumed from the newest complete checkpoint: epoch 1's, so epochs 2 and 3 are trained
    // again, and end exactly where the uninterrupted run did.
    run.epochs = 3;
    run.config = DdpConfig::default().with_resume(true);
    let (resumed, report) = run_training(
        materialized(Mlp::new(&device())),
        AdamConfig::new().init(),
        1e-2,
        &run,
    )
    .unwrap();
    let epochs: Vec<usize> = report.unwrap().epochs.iter().map(|e| e.epoch).collect();
    assert_eq!(epochs, vec![2, 3], "resumed after epoch 1");
    assert_eq!(resumed, straight, "bit for bit");
}

#[test]
fn a_model_whose_optimize_moves_a_teacher_is_refused_under_optimizer_sharding_naming_it() {
    use burn_ddp_tests::WithTeacher;
    // Under optimizer sharding burn-train 0.22's Learner runs the model's `optimize` on this
    // rank's share before the other ranks' parameters arrive: a teacher moved towards the
    // student there would differ between the ranks, silently (the consistency check is off by
    // default). It is refused at the first step, on every rank, naming the tensor.
    let model = materialized(WithTeacher::new(&device()));
    let mut run = Run::new(Some(2), 16, 4 * 16);
    run.config = DdpConfig::default().with_optimizer_sharding(true);
    match run_training(model.clone(), SgdConfig::new().init(), 0.1, &run) {
        Err(DdpError::InvalidConfig(message)) => {
            assert!(message.contains("teacher.fc1.weight"), "{message}");
            assert!(message.contains("optimize"), "{message}");
            assert!(message.contains("with_optimizer_sharding"), "{message}");
        }
        other => panic!("expected the refusal, got {:?}", other.map(|_| ())),
    }
    // Without sharding it trains as plain Burn on one device.
    run.config = DdpConfig::default();
    let (two, _) = run_training(model.clone(), SgdConfig::new().init(), 0.1, &run).unwrap();
    let (one, _) = run_training(
        model,
        SgdConfig::new().init(),
        0.1,
        &Run::new(None, 16, 4 * 16),
    )
    .unwrap();
    let diff = max_relative_difference(&two, &one);
    assert!(diff <= 1e-5, "2 replicas differ from one device by {diff}");
}

/// The MLP whose `optimize` shrinks every parameter by 1% after the step (weight decay written
/// by hand): under sharding it changes the tensors the other ranks own too, which their owners'
/// values then replace.
#[derive(Module, Debug)]
pub struct DecaysInOptimize {
    inner: Mlp,
}

impl TrainStep for DecaysInOptimize {
    type Input = Batch;
    type Output = burn::train::ClassificationOutput;

    fn step(&self, batch: Batch) -> TrainOutput<Self::Output> {
        TrainStep::step(&self.inner, batch)
    }

    fn optimize(
        self,
        optim: &mut burn::optim::ModuleOptimizer,
        lr: burn::optim::lr_scheduler::module_lr_scheduler::ModuleLearningRate,
        grads: burn::optim::GradientsParams,
    ) -> Self {
        let model = optim.step(lr, self, grads);
        let shrunk: Vec<Vec<f32>> = float_tensors(&model)
            .into_iter()
            .map(|t| t.into_iter().map(|v| v * 0.99).collect())
            .collect();
        with_values(model, &shrunk)
    }
}

impl InferenceStep for DecaysInOptimize {
    type Input = Batch;
    type Output = burn::train::ClassificationOutput;

    fn step(&self, batch: Batch) -> Self::Output {
        InferenceStep::step(&self.inner, batch)
    }
}

#[test]
fn a_model_whose_optimize_changes_every_parameter_trains_sharded_as_on_one_device() {
    // Not refused: every tensor it changes is stepped by some rank, whose value every rank
    // then takes.
    let model = materialized(DecaysInOptimize {
        inner: Mlp::new(&device()),
    });
    let (one, _) = run_training(
        model.clone(),
        SgdConfig::new().init(),
        0.1,
        &Run::new(None, 16, 4 * 16),
    )
    .unwrap();
    let mut run = Run::new(Some(2), 16, 4 * 16);
    run.config = DdpConfig::default().with_optimizer_sharding(true);
    let (two, _) = run_training(model, SgdConfig::new().init(), 0.1, &run).unwrap();
    let diff = max_relative_difference(&two, &one);
    assert!(
        diff <= 1e-5,
        "2 sharded replicas differ from one device by {diff}"
    );
}
