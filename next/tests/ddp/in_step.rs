//! What every process of a job builds for itself must agree: compared at start-up (where the run
//! starts, the data: training and validation items, the training sampler and batch size) or, for
//! what only shows once training runs (the learning rate, the optimizer), at every gradient
//! synchronisation (the one after the step that used them). In thread mode the ranks share one of each; these jobs are TCP ranks, each
//! with its own `SupervisedTraining`, as processes have.

use burn::optim::{AdamConfig, SgdConfig};
use burn_ddp::DdpError;
use burn_ddp_tests::{Mlp, Run, device, materialized, over_tcp, run_training};

/// Runs a 2-rank TCP job whose rank `r` trains with `Run` `tweak(r, run)`, SGD or Adam as
/// `adam(r)` says, at learning rate `lr(r)`; returns each rank's error.
fn job(
    tweak: impl Fn(usize, &mut Run) + Sync,
    adam: impl Fn(usize) -> bool + Sync,
    lr: impl Fn(usize) -> f64 + Sync,
) -> Vec<DdpError> {
    let model = materialized(Mlp::new(&device()));
    over_tcp(2, |rank, group| {
        let mut run = Run::new(None, 16, 8 * 16);
        run.group = Some(group);
        tweak(rank, &mut run);
        let trained = if adam(rank) {
            run_training(model.clone(), AdamConfig::new().init(), lr(rank), &run)
        } else {
            run_training(model.clone(), SgdConfig::new().init(), lr(rank), &run)
        };
        trained.err()
    })
    .into_iter()
    .enumerate()
    .map(|(rank, result)| {
        result
            .unwrap()
            .unwrap_or_else(|| panic!("rank {rank} trained without an error"))
    })
    .collect()
}

fn start_up_refusal(errors: Vec<DdpError>, expected: &str) {
    for (rank, err) in errors.into_iter().enumerate() {
        match err {
            DdpError::ReplicaMismatch { detail, .. } => {
                assert!(detail.contains(expected), "rank {rank}: {detail}")
            }
            other => panic!("rank {rank}: expected ReplicaMismatch, got {other}"),
        }
    }
}

fn out_of_step(errors: Vec<DdpError>, at: u64, expected: &str) {
    for (rank, err) in errors.into_iter().enumerate() {
        match err {
            DdpError::OutOfStep { sync, detail, .. } => {
                assert_eq!(sync, at, "rank {rank}: {detail}");
                assert!(detail.contains(expected), "rank {rank}: {detail}");
            }
            other => panic!("rank {rank}: expected OutOfStep, got {other}"),
        }
    }
}

#[test]
fn processes_with_different_sampler_seeds_are_refused_at_start_up() {
    let errors = job(|rank, run| run.seed = 7 + rank as u64, |_| false, |_| 0.1);
    start_up_refusal(errors, "training DistributedDataLoaders differ");
}

#[test]
fn processes_with_different_batch_sizes_are_refused_at_start_up() {
    let errors = job(
        |rank, run| run.global_batch = 16 + 8 * rank,
        |_| false,
        |_| 0.1,
    );
    start_up_refusal(errors, "or batch size");
}

#[test]
fn processes_with_different_validation_sets_are_refused_at_start_up() {
    let errors = job(
        |rank, run| run.valid_samples = Some(10 + 2 * rank),
        |_| false,
        |_| 0.1,
    );
    start_up_refusal(errors, "validation loader has 10 items but rank 1's 12");
}

#[test]
fn a_process_with_another_learning_rate_is_out_of_step_after_its_first_step() {
    // Burn 0.22's loop steps the scheduler right before the optimizer step, after the gradient
    // synchronisation (0.21 stepped it before the batch, and the first synchronisation saw both
    // rates): a synchronisation carries the rate of the step before it, so the second one sees
    // both rates, as it sees two optimizers' results.
    let errors = job(|_, _| {}, |_| false, |rank| [0.1, 0.2][rank]);
    out_of_step(errors, 1, "learning rate is 0.1 but rank 1's 0.2");
}

#[test]
fn a_process_with_another_optimizer_is_out_of_step_after_its_first_step() {
    let errors = job(|_, _| {}, |rank| rank == 1, |_| 0.01);
    out_of_step(errors, 1, "different optimizers or hyper-parameters");
}
