//! Data-parallel training must match single-device training: N replicas with per-replica batch
//! B/N give the same parameters as plain Burn on one device with batch B (to f32 rounding).

use burn::optim::lr_scheduler::exponential::ExponentialLrSchedulerConfig;
use burn::optim::{AdamConfig, SgdConfig};
use burn_ddp::DdpConfig;
use burn_ddp::config::UnevenInputs;
use burn_ddp_tests::{
    CountingScheduler, Mlp, Run, StopsAtBatch, TrainKind, device, float_tensors, materialized,
    max_relative_difference, over_tcp, run_training,
};

/// Tolerance of the issue: max relative difference 1e-5.
const TOLERANCE: f32 = 1e-5;

fn assert_trained_and_equal(initial: &[Vec<f32>], single: &[Vec<f32>], ddp: &[Vec<f32>]) {
    let moved = max_relative_difference(single, initial);
    assert!(
        moved > 1e-3,
        "training did not change the parameters (moved {moved})"
    );
    let diff = max_relative_difference(ddp, single);
    assert!(
        diff <= TOLERANCE,
        "the replicas differ from 1 device by {diff} (relative), more than {TOLERANCE}"
    );
}

#[test]
fn two_replicas_match_single_device_after_20_sgd_steps() {
    let model = materialized(Mlp::new(&device()));
    let initial = float_tensors(&model);
    let (single, _) = run_training(
        model.clone(),
        SgdConfig::new().init(),
        0.1,
        &Run::new(None, 32, 20 * 32),
    )
    .unwrap();
    let (ddp, report) = run_training(
        model,
        SgdConfig::new().init(),
        0.1,
        &Run::new(Some(2), 32, 20 * 32),
    )
    .unwrap();
    assert_trained_and_equal(&initial, &single, &ddp);
    let report = report.unwrap();
    assert_eq!(report.epochs[0].steps, 20);
    assert_eq!(report.epochs[0].samples, 640);
    for rank in &report.ranks {
        assert_eq!(rank.batches, 20, "rank {}", rank.rank);
        assert_eq!(rank.comm.steps, 20, "rank {}", rank.rank);
    }
}

#[test]
fn two_replicas_match_single_device_after_20_adam_steps() {
    let model = materialized(Mlp::new(&device()));
    let initial = float_tensors(&model);
    let (single, _) = run_training(
        model.clone(),
        AdamConfig::new().init(),
        1e-2,
        &Run::new(None, 32, 20 * 32),
    )
    .unwrap();
    let (ddp, _) = run_training(
        model,
        AdamConfig::new().init(),
        1e-2,
        &Run::new(Some(2), 32, 20 * 32),
    )
    .unwrap();
    assert_trained_and_equal(&initial, &single, &ddp);
}

#[test]
fn four_replicas_match_single_device_over_two_epochs() {
    let model = materialized(Mlp::new(&device()));
    let initial = float_tensors(&model);
    let mut run = Run::new(None, 32, 10 * 32);
    run.epochs = 2;
    let (single, _) = run_training(model.clone(), SgdConfig::new().init(), 0.1, &run).unwrap();
    run.replicas = Some(4);
    let (ddp, report) = run_training(model, SgdConfig::new().init(), 0.1, &run).unwrap();
    assert_trained_and_equal(&initial, &single, &ddp);
    assert_eq!(report.unwrap().epochs.len(), 2);
}

#[test]
fn a_decaying_lr_schedule_steps_once_per_optimizer_step_not_once_per_replica() {
    // A decaying schedule: stepping it twice per step (once per replica on a shared scheduler)
    // would change the result.
    let schedule = || {
        ExponentialLrSchedulerConfig::new(0.2, 0.9)
            .init()
            .expect("valid schedule")
    };
    let model = materialized(Mlp::new(&device()));
    let initial = float_tensors(&model);
    let (single, _) = run_training(
        model.clone(),
        SgdConfig::new().init(),
        schedule(),
        &Run::new(None, 32, 20 * 32),
    )
    .unwrap();
    let (ddp, _) = run_training(
        model,
        SgdConfig::new().init(),
        schedule(),
        &Run::new(Some(2), 32, 20 * 32),
    )
    .unwrap();
    assert_trained_and_equal(&initial, &single, &ddp);
}

#[test]
fn gradient_accumulation_syncs_once_per_optimizer_step() {
    let model = materialized(Mlp::new(&device()));
    let initial = float_tensors(&model);
    let mut run = Run::new(None, 32, 20 * 32);
    run.grad_accumulation = Some(2);
    let plain_scheduler = CountingScheduler::new(0.1);
    let (single, _) = run_training(
        model.clone(),
        SgdConfig::new().init(),
        plain_scheduler.clone(),
        &run,
    )
    .unwrap();
    run.replicas = Some(2);
    let scheduler = CountingScheduler::new(0.1);
    let (ddp, report) =
        run_training(model, SgdConfig::new().init(), scheduler.clone(), &run).unwrap();
    assert_trained_and_equal(&initial, &single, &ddp);
    // burn-train 0.22 steps the scheduler once per optimizer step, right before it: 20 batches
    // accumulated by 2 are 10 steps on one device, and 10 on each of the 2 replicas.
    assert_eq!(
        plain_scheduler.count(),
        10,
        "plain Burn's LR scheduler steps"
    );
    assert_eq!(
        scheduler.count(),
        2 * 10,
        "LR scheduler steps of 2 replicas"
    );
    let report = report.unwrap();
    assert_eq!(report.epochs[0].steps, 10, "20 batches, accumulated by 2");
    for rank in &report.ranks {
        assert_eq!(rank.batches, 20);
        assert_eq!(rank.comm.steps, 10, "one gradient sync per optimizer step");
    }
}

#[test]
fn an_interrupt_inside_an_accumulation_window_takes_as_many_optimizer_steps_as_plain_burn() {
    // Micro-batches accumulated by 2. Plain Burn's loop checks the interrupter after every
    // micro-batch and stops there: interrupted during micro-batch 3 (inside the second window) it
    // has taken 1 optimizer step; during micro-batch 4 (the window's last) it steps, then stops.
    let mlp = materialized(Mlp::new(&device()));
    let initial = float_tensors(&mlp);
    for (at, steps) in [(3, 1), (4, 2), (5, 2)] {
        let mut trained = Vec::new();
        for replicas in [None, Some(2)] {
            let mut run = Run::new(replicas, 32, 20 * 32);
            run.grad_accumulation = Some(2);
            let model = StopsAtBatch::new(mlp.clone(), at);
            run.interrupter = Some(model.slot());
            let (tensors, report) =
                run_training(model, SgdConfig::new().init(), 0.1, &run).unwrap();
            if let Some(report) = report {
                assert_eq!(report.epochs.len(), 1, "interrupted at micro-batch {at}");
                assert_eq!(
                    report.epochs[0].steps, steps,
                    "optimizer steps, interrupted at micro-batch {at}"
                );
            }
            trained.push(tensors);
        }
        assert_trained_and_equal(&initial, &trained[0], &trained[1]);
    }
}

#[test]
fn an_interrupt_of_one_process_inside_an_accumulation_window_stops_every_process_before_the_step() {
    // Processes have an interrupter each: here only rank 0's is called, during micro-batch 3
    // (inside the second window of 2). Every rank stops without that window's step, as plain
    // Burn interrupted at the same batch.
    let mlp = materialized(Mlp::new(&device()));
    let initial = float_tensors(&mlp);
    let train = |replicas: Option<usize>, group, at| {
        let mut run = Run::new(replicas, 32, 20 * 32);
        run.grad_accumulation = Some(2);
        run.group = group;
        let model = StopsAtBatch::new(mlp.clone(), at);
        run.interrupter = Some(model.slot());
        run_training(model, SgdConfig::new().init(), 0.1, &run).unwrap()
    };
    let (single, _) = train(None, None, 3);
    let ranks = over_tcp(2, |rank, group| {
        train(None, Some(group), if rank == 0 { 3 } else { usize::MAX })
    });
    for (rank, trained) in ranks.into_iter().enumerate() {
        let (tensors, report) = trained.unwrap();
        assert_trained_and_equal(&initial, &single, &tensors);
        if rank == 0 {
            // Rank 0 reports the epochs.
            assert_eq!(report.unwrap().epochs[0].steps, 1, "optimizer steps");
        }
    }
}

#[test]
fn a_burn_training_loader_trains_as_one_device_step_for_step() {
    // Burn's own loader (`DataLoaderBuilder::new(batcher).batch_size(b).shuffle(seed)`, per
    // replica), not a DistributedDataLoader: step k of N thread ranks is one device's batch k of
    // N * b from the same loader, also when the last step is short or leaves a rank without a
    // batch (100 samples in batches of 8 over 3 ranks: 13 batches, the last of 4 samples).
    let model = materialized(Mlp::new(&device()));
    let initial = float_tensors(&model);
    for (replicas, global_batch, samples, epochs) in [(2, 32, 10 * 32, 2), (3, 24, 100, 2)] {
        let mut run = Run::new(None, global_batch, samples);
        run.train = TrainKind::Burn;
        run.epochs = epochs;
        let (single, _) = run_training(model.clone(), SgdConfig::new().init(), 0.1, &run).unwrap();
        run.replicas = Some(replicas);
        let (ddp, report) =
            run_training(model.clone(), SgdConfig::new().init(), 0.1, &run).unwrap();
        assert_trained_and_equal(&initial, &single, &ddp);
        let steps = samples.div_ceil(global_batch) as u64;
        let trained: Vec<u64> = report.unwrap().epochs.iter().map(|e| e.steps).collect();
        assert_eq!(
            trained,
            vec![steps; epochs],
            "{replicas} ranks: optimizer steps per epoch"
        );
    }
}

#[test]
fn a_step_is_one_collective_unless_ranks_may_run_out_at_different_steps() {
    let model = materialized(Mlp::new(&device()));
    let mut run = Run::new(Some(2), 32, 10 * 32);
    run.epochs = 2;
    let (_, report) = run_training(model.clone(), SgdConfig::new().init(), 0.1, &run).unwrap();
    for rank in &report.unwrap().ranks {
        // The stop votes ride in the one gradient bucket; at the end of each epoch's data one
        // more reduction (no gradients, "out of data") and one all-gather of the batch counts.
        assert_eq!(
            (rank.comm.steps, rank.comm.buckets),
            (20, 20),
            "rank {}",
            rank.rank
        );
        assert_eq!(rank.step_collectives, 20 + 2 * 2, "rank {}", rank.rank);
        assert!((rank.collectives_per_step() - 1.2).abs() < 1e-9);
    }
    // Join mode agrees on who has a batch before every step, and once more when none has.
    run.config = DdpConfig::default().with_uneven_inputs(UnevenInputs::Join);
    let (_, report) = run_training(model, SgdConfig::new().init(), 0.1, &run).unwrap();
    for rank in &report.unwrap().ranks {
        assert_eq!(rank.step_collectives, 2 * 20 + 2, "rank {}", rank.rank);
    }
}

#[test]
fn an_epochs_short_last_accumulation_window_is_stepped_as_on_one_device() {
    // 21 batches per epoch accumulated by 2: burn-train 0.22 steps the 21st micro-batch alone at
    // the end of the epoch (burn-train 0.21 dropped it); the next epoch starts a fresh window.
    let model = materialized(Mlp::new(&device()));
    let initial = float_tensors(&model);
    let mut run = Run::new(None, 32, 21 * 32);
    run.epochs = 2;
    run.grad_accumulation = Some(2);
    let (single, _) = run_training(model.clone(), SgdConfig::new().init(), 0.1, &run).unwrap();
    run.replicas = Some(2);
    let (ddp, report) = run_training(model, SgdConfig::new().init(), 0.1, &run).unwrap();
    assert_trained_and_equal(&initial, &single, &ddp);
    let report = report.unwrap();
    let steps: Vec<u64> = report.epochs.iter().map(|e| e.steps).collect();
    assert_eq!(steps, vec![11, 11], "optimizer steps per epoch");
}

#[test]
fn an_interrupt_on_one_rank_stops_every_rank_at_the_same_step() {
    let model = materialized(burn_ddp_tests::interrupting(&device()));
    let mut run = Run::new(Some(2), 16, 20 * 16);
    run.epochs = 2;
    run.interrupt_after = Some(3);
    let (_, report) = run_training(model, SgdConfig::new().init(), 0.05, &run).unwrap();
    let report = report.unwrap();
    assert_eq!(report.epochs.len(), 1, "training stops in the first epoch");
    assert_eq!(report.epochs[0].steps, 3);
    for rank in &report.ranks {
        assert_eq!(rank.batches, 3, "rank {}", rank.rank);
    }
}

#[test]
fn results_that_are_not_finite_never_compare_as_equal() {
    let nan = vec![vec![f32::NAN, 1.0]];
    assert!(max_relative_difference(&nan, &nan).is_infinite());
    let inf = vec![vec![f32::INFINITY]];
    assert!(max_relative_difference(&inf, &[vec![1.0]]).is_infinite());
    assert!(max_relative_difference(&[vec![1.0]], &inf).is_infinite());
    // Finite values: the largest difference relative to each tensor's largest magnitude.
    let diff = max_relative_difference(&[vec![1.0, 2.5], vec![0.0]], &[vec![1.0, 2.0], vec![0.0]]);
    assert_eq!(diff, 0.25);
}

#[test]
fn many_small_buckets_match_single_device_training() {
    // Caps of 16 bytes for the first bucket and 100 after split the MLP's 4 parameters into 4
    // buckets (fc2.bias, fc2.weight, fc1.bias, fc1.weight): flatten and unflatten across
    // buckets, as for any model over 1 MiB with the default caps.
    let model = materialized(Mlp::new(&device()));
    let initial = float_tensors(&model);
    let mut run = Run::new(None, 32, 20 * 32);
    let (single, _) = run_training(model.clone(), AdamConfig::new().init(), 1e-2, &run).unwrap();
    run.replicas = Some(2);
    run.config = DdpConfig::default()
        .with_first_bucket_cap_bytes(16)
        .with_bucket_cap_bytes(100);
    let (ddp, report) = run_training(model, AdamConfig::new().init(), 1e-2, &run).unwrap();
    assert_trained_and_equal(&initial, &single, &ddp);
    for rank in report.unwrap().ranks {
        assert_eq!(rank.comm.buckets, 4 * 20, "rank {}", rank.rank);
    }
}
