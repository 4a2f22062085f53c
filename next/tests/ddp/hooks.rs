//! Communication hooks (PyTorch's `register_comm_hook`): the strategy reduces every bucket
//! through the configured hook, and the checks run on what it returns.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use burn::optim::SgdConfig;
use burn_ddp::config::GradientCompression;
use burn_ddp::group::ReduceOp;
use burn_ddp::hooks::{CommHook, HookStats, HostBucket};
use burn_ddp::{DdpConfig, ProcessGroup};
use burn_ddp_tests::{
    Mlp, Run, copy_of, device, float_tensors, materialized, max_relative_difference, over_tcp,
    run_training,
};

/// A user's hook: sums the gradients instead of averaging them (the bookkeeping after them is
/// reduced with `op`, as the contract asks), and counts its calls.
#[derive(Debug, Default)]
struct SumHook {
    calls: AtomicU64,
}

impl CommHook for SumHook {
    fn name(&self) -> String {
        "sum".into()
    }

    fn reduce(
        &self,
        group: &dyn ProcessGroup,
        buckets: &mut [HostBucket<'_>],
        op: ReduceOp,
        timeout: Duration,
        stats: &mut HookStats,
    ) -> burn_ddp::Result<()> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        for bucket in buckets.iter_mut() {
            group.all_reduce(bucket.buffer, ReduceOp::Sum, timeout)?;
            if op == ReduceOp::Avg {
                let n = group.world_size() as f32;
                bucket.buffer[bucket.gradients..]
                    .iter_mut()
                    .for_each(|v| *v /= n);
            }
            stats.bytes += 4 * bucket.buffer.len();
        }
        Ok(())
    }
}

#[test]
fn a_user_hook_that_sums_is_what_the_replicas_train_with() {
    let model = materialized(Mlp::new(&device()));
    let steps = 20;
    let mut run = Run::new(Some(2), 32, steps * 32);
    // Averaged gradients at learning rate 0.2 ...
    let (averaged, _) = run_training(model.clone(), SgdConfig::new().init(), 0.2, &run).unwrap();
    let (plain, _) = run_training(model.clone(), SgdConfig::new().init(), 0.1, &run).unwrap();
    // ... are summed gradients (of 2 replicas) at 0.1.
    let hook = Arc::new(SumHook::default());
    run.config = DdpConfig::default().with_comm_hook(hook.clone());
    let (summed, report) = run_training(model, SgdConfig::new().init(), 0.1, &run).unwrap();
    let diff = max_relative_difference(&summed, &averaged);
    assert!(
        diff <= 1e-6,
        "sum at lr 0.1 differs from average at lr 0.2 by {diff}"
    );
    let effect = max_relative_difference(&summed, &plain);
    assert!(effect > 1e-3, "the hook changed nothing ({effect})");
    // One call per rank and step (the two thread replicas share the hook), and one for the
    // end-of-data reduction.
    assert_eq!(hook.calls.load(Ordering::Relaxed), 2 * (steps as u64 + 1));
    for rank in &report.unwrap().ranks {
        assert_eq!(rank.comm.steps, steps as u64);
    }
}

#[test]
fn sixteen_bit_compression_trains_within_its_rounding_on_host_groups() {
    // The reference is plain Burn on one device. A 16-bit wire rounds each reduced gradient by at
    // most the format's unit roundoff u per value (bf16 2^-8, f16 2^-11; the bucket is scaled
    // into range first), so 20 SGD steps move the parameters away from one device's by at most
    // about u times the distance they travel: held to 4u of it, on threads and on TCP ranks.
    let model = materialized(Mlp::new(&device()));
    let initial = float_tensors(&model);
    let run = Run::new(None, 32, 20 * 32);
    let (one, _) = run_training(copy_of(&model), SgdConfig::new().init(), 0.1, &run).unwrap();
    let moved = max_relative_difference(&one, &initial);
    let train = |compression, tcp: bool| {
        // The host buckets on threads too (thread replicas on one device would otherwise share
        // their f32 tensors, and send no bytes to compare with).
        let config = DdpConfig::default()
            .with_gradient_compression(compression)
            .with_shared_memory_reduction(false);
        if tcp {
            let mut ranks = over_tcp(2, |_, group| {
                let mut run = Run::new(None, 32, 20 * 32);
                run.group = Some(group);
                run.config = config.clone();
                run_training(copy_of(&model), SgdConfig::new().init(), 0.1, &run).unwrap()
            });
            ranks.remove(0).unwrap()
        } else {
            let mut run = Run::new(Some(2), 32, 20 * 32);
            run.config = config;
            run_training(copy_of(&model), SgdConfig::new().init(), 0.1, &run).unwrap()
        }
    };
    for tcp in [false, true] {
        let (exact, exact_report) = train(GradientCompression::None, tcp);
        assert!(
            max_relative_difference(&exact, &one) <= 1e-5,
            "tcp {tcp}: f32 wire"
        );
        for (compression, unit_roundoff) in [
            (GradientCompression::Bf16, 2f32.powi(-8)),
            (GradientCompression::F16, 2f32.powi(-11)),
        ] {
            let (compressed, report) = train(compression, tcp);
            let diff = max_relative_difference(&compressed, &one);
            let bound = 4.0 * unit_roundoff * moved;
            assert!(
                diff > 0.0 && diff <= bound,
                "{compression:?}, tcp {tcp}: {diff} from one device, bound {bound} (4 u of the \
                 distance trained, {moved})"
            );
            let (bytes, exact_bytes) = (
                report.unwrap().ranks[0].comm.bytes,
                exact_report.as_ref().unwrap().ranks[0].comm.bytes,
            );
            // Half the gradients' bytes; on this tiny model (676 values) a step's bookkeeping,
            // sent in f32 (a presence flag per parameter, 50 control words), is a tenth of it.
            assert!(
                (bytes as f64) < 0.65 * exact_bytes as f64,
                "{compression:?}, tcp {tcp}: {bytes} bytes sent, {exact_bytes} in f32"
            );
        }
    }
}
