//! `fashion-mnist gpu-check`: the checks of the CUDA path that need a GPU, as one JSON summary.
//!
//! Built and shipped by `cargo xtask gpu-check` (one stripped binary and a script); run on a
//! machine with one GPU, so NCCL runs with a world size of 1:
//!
//! 1. `exact`: NCCL all-reduce over real burn-cuda bucket tensors (with and without Burn's
//!    fusion, f32 and bf16, sum and average, through `NcclGroup::all_reduce_device` and the
//!    compression helpers) gives exactly the expected values; so do the host-buffer collectives
//!    (all-reduce, broadcast, barrier, all-gather).
//! 2. `steps`: 1000 consecutive out-of-place all-reduces of freshly computed tensors (sizes from
//!    1 to 4 Mi values, at offsets inside larger buffers) into freshly zeroed outputs, each read by
//!    Burn right after: a missed synchronisation reads zeros or stale values, a wrong pointer or
//!    offset reads other values. Counts mismatches.
//! 3. `training`: this binary trains one epoch with `--workers 1` (plain Burn) and with
//!    `--workers 1 --ddp` (DdpStrategy), each in its own process, and reports the ratio of their
//!    step times.

use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::backend::Cuda;
use burn::backend::cuda::CudaDevice;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, FloatDType, Tensor, TensorData, TensorPrimitive};
use burn_ddp::ThreadGroup;
use burn_ddp::group::{ProcessGroup, ReduceOp};
use burn_ddp::nccl::compress::{compress, decompress};
use burn_ddp::nccl::{GradientCompression, NcclGroup, NcclIdSource};

/// burn-cuda without fusion: the other tensor type the group resolves.
type CudaPlain = burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, f32, i32, u8>;

const TIMEOUT: Duration = Duration::from_secs(60);

/// Runs the checks; `args` are the arguments after `gpu-check`. Prints the JSON summary and
/// returns whether every check passed.
pub fn run(args: &[String]) -> Result<bool, String> {
    let value = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let steps: usize =
        value("--steps").map_or(Ok(1000), |s| s.parse().map_err(|e| format!("--steps: {e}")))?;
    let data = value("--data");
    let skip_training = args.iter().any(|a| a == "--skip-training");

    burn_ddp::nccl::check_cuda_driver().map_err(|e| e.to_string())?;
    let host = ThreadGroup::new_group(1)
        .map_err(|e| e.to_string())?
        .remove(0);
    let started = Instant::now();
    let group = NcclGroup::new(Arc::new(host), 0, NcclIdSource::HostGroup, TIMEOUT)
        .map_err(|e| e.to_string())?;
    let init_s = started.elapsed().as_secs_f64();

    let exact = exact_values(&group);
    let steps = consecutive_steps(&group, steps);
    let training = if skip_training {
        serde_json::json!({"skipped": true})
    } else {
        training_ratio(data.as_deref())
    };
    let passed = exact["passed"].as_bool() == Some(true)
        && steps["mismatches"].as_u64() == Some(0)
        && steps["errors"].as_u64() == Some(0)
        && training.get("error").is_none();
    let summary = serde_json::json!({
        "passed": passed,
        "nccl_version": burn_ddp::nccl::api::version_string(group.nccl_version()),
        "nccl_init_s": init_s,
        "exact": exact,
        "steps": steps,
        "training": training,
    });
    println!(
        "{}",
        serde_json::to_string_pretty(&summary).unwrap_or_default()
    );
    Ok(passed)
}

/// Distinct values that bf16 represents exactly (small integers times powers of two), so a sum or
/// average over one rank must return them bit for bit.
fn values(len: usize, salt: usize) -> Vec<f32> {
    (0..len)
        .map(|i| (((i * 7 + salt * 13) % 255) as f32 - 127.0) * 0.125)
        .collect()
}

/// All-reduces a bucket of backend `B` in place through the group's device path and reads it
/// back as f32.
fn reduce_device<B: Backend>(
    group: &NcclGroup,
    bucket: Tensor<B, 1>,
    op: ReduceOp,
) -> Result<Vec<f32>, String> {
    let mut primitive = bucket.into_primitive().tensor();
    if !group
        .all_reduce_device(&mut primitive, op, TIMEOUT)
        .map_err(|e| e.to_string())?
    {
        return Err("the NCCL group did not take a burn-cuda tensor".into());
    }
    let reduced = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(primitive));
    reduced
        .into_data()
        .convert::<f32>()
        .to_vec::<f32>()
        .map_err(|e| format!("{e:?}"))
}

fn exact_case<B: Backend>(
    group: &NcclGroup,
    device: &B::Device,
    dtype: Option<FloatDType>,
    op: ReduceOp,
) -> serde_json::Value {
    let expected = values(100_003, 1);
    // Computed on the device (pending work when the all-reduce starts).
    let bucket =
        Tensor::<B, 1>::from_data(TensorData::new(expected.clone(), [expected.len()]), device)
            .mul_scalar(2.0)
            .div_scalar(2.0);
    let bucket = match dtype {
        Some(dtype) => bucket.cast(dtype),
        None => bucket,
    };
    let wire = format!("{:?}", bucket.dtype());
    let result = reduce_device(group, bucket, op);
    let mismatches = match &result {
        Ok(got) => got.iter().zip(&expected).filter(|(g, e)| g != e).count(),
        Err(_) => expected.len(),
    };
    serde_json::json!({
        "dtype": wire,
        "op": op.to_string(),
        "values": expected.len(),
        "mismatches": mismatches,
        "error": result.err(),
    })
}

fn exact_values(group: &NcclGroup) -> serde_json::Value {
    let device = CudaDevice::new(0);
    let mut cases = Vec::new();
    for op in [ReduceOp::Sum, ReduceOp::Avg] {
        for dtype in [None, Some(FloatDType::BF16)] {
            let mut case = exact_case::<Cuda>(group, &device, dtype, op);
            case["fusion"] = true.into();
            cases.push(case);
            let mut case = exact_case::<CudaPlain>(group, &device, dtype, op);
            case["fusion"] = false.into();
            cases.push(case);
        }
    }
    // The compression helpers around the all-reduce, as the reducer uses them.
    for compression in [GradientCompression::Bf16, GradientCompression::F16] {
        let expected = values(4097, 3);
        let bucket = Tensor::<Cuda, 1>::from_data(
            TensorData::new(expected.clone(), [expected.len()]),
            &device,
        );
        let (wire, op) = compress(bucket, ReduceOp::Avg, 1, compression);
        let dtype = wire.dtype();
        let result = reduce_device(group, wire.clone(), op).and_then(|_| {
            decompress(wire, compression)
                .into_data()
                .to_vec::<f32>()
                .map_err(|e| format!("{e:?}"))
        });
        let mismatches = match &result {
            Ok(got) => got.iter().zip(&expected).filter(|(g, e)| g != e).count(),
            Err(_) => expected.len(),
        };
        cases.push(serde_json::json!({
            "dtype": format!("{dtype:?}"),
            "op": "avg (compressed)",
            "values": expected.len(),
            "mismatches": mismatches,
            "error": result.err(),
        }));
        debug_assert!(matches!(dtype, DType::BF16 | DType::F16));
    }
    // Host-buffer collectives.
    let mut host = Vec::new();
    let mut buffer = values(1000, 5);
    let expected = buffer.clone();
    let check = |name: &str, result: burn_ddp::Result<bool>| serde_json::json!({"op": name, "ok": result.as_ref().is_ok_and(|ok| *ok), "error": result.err().map(|e| e.to_string())});
    host.push(check(
        "all_reduce",
        group
            .all_reduce(&mut buffer, ReduceOp::Avg, TIMEOUT)
            .map(|()| buffer == expected),
    ));
    host.push(check(
        "broadcast",
        group
            .broadcast(&mut buffer, 0, TIMEOUT)
            .map(|()| buffer == expected),
    ));
    host.push(check("barrier", group.barrier(TIMEOUT).map(|()| true)));
    host.push(check(
        "all_gather",
        group
            .all_gather(&[7, u64::MAX, 42], TIMEOUT)
            .map(|all| all == [7, u64::MAX, 42]),
    ));
    let passed = cases
        .iter()
        .all(|c| c["mismatches"].as_u64() == Some(0) && c["error"].is_null())
        && host.iter().all(|h| h["ok"].as_bool() == Some(true));
    serde_json::json!({"passed": passed, "device": cases, "host": host})
}

fn consecutive_steps(group: &NcclGroup, steps: usize) -> serde_json::Value {
    let device = CudaDevice::new(0);
    let sizes = [1usize, 3, 1000, 65_537, 1 << 20, 4 << 20];
    let big = 5 << 20;
    let base = Tensor::<Cuda, 1>::from_data(TensorData::new(values(big, 9), [big]), &device);
    let mut mismatches = 0u64;
    let mut errors = 0u64;
    let mut first_error = None;
    let started = Instant::now();
    for step in 0..steps {
        let len = sizes[step % sizes.len()];
        let offset = (step * 4099) % (big - len);
        let scale = (step % 7) as f32 + 1.0;
        // Freshly computed input (pending in Burn's queues) and a freshly zeroed output.
        let src = base.clone().slice(offset..offset + len).mul_scalar(scale);
        let dst = Tensor::<Cuda, 1>::zeros([len], &device);
        let src_p = src.clone().into_primitive().tensor();
        let dst_p = dst.clone().into_primitive().tensor();
        if let Err(e) = group.all_reduce_into(&src_p, &dst_p, ReduceOp::Sum, TIMEOUT) {
            errors += 1;
            first_error.get_or_insert(e.to_string());
            continue;
        }
        drop((src_p, dst_p));
        // Read by Burn right after: over one rank the sum is the input.
        let wrong: f32 = (dst - src).abs().max().into_scalar();
        if wrong != 0.0 {
            mismatches += 1;
        }
    }
    serde_json::json!({
        "steps": steps,
        "mismatches": mismatches,
        "errors": errors,
        "first_error": first_error,
        "seconds": started.elapsed().as_secs_f64(),
    })
}

/// `samples/s` and the train loss from the example's epoch line.
fn parse_epoch(stdout: &str) -> Option<(f64, f64)> {
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.starts_with("epoch ") && l.contains("samples/s"))?;
    let loss = line
        .split("train loss ")
        .nth(1)?
        .split(',')
        .next()?
        .trim()
        .parse()
        .ok()?;
    let rate = line
        .split(", ")
        .find(|p| p.ends_with("samples/s") || p.contains(" samples/s"))?;
    let rate = rate.split_whitespace().next()?.parse().ok()?;
    Some((rate, loss))
}

fn training_ratio(data: Option<&str>) -> serde_json::Value {
    let exe = match std::env::current_exe() {
        Ok(exe) => exe,
        Err(e) => return serde_json::json!({"error": e.to_string()}),
    };
    let mut runs = serde_json::Map::new();
    let mut rates = Vec::new();
    for (name, ddp) in [("plain_burn", false), ("ddp_world_size_1", true)] {
        let mut command = Command::new(&exe);
        command.args(["--device", "cuda", "--workers", "1", "--epochs", "1"]);
        command.args(["--artifacts", &format!("/tmp/gpu-check-{name}")]);
        if ddp {
            command.arg("--ddp");
        }
        if let Some(data) = data {
            command.args(["--data", data]);
        }
        let output = match command.output() {
            Ok(output) => output,
            Err(e) => return serde_json::json!({"error": format!("{name}: {e}")}),
        };
        let stdout = String::from_utf8_lossy(&output.stdout);
        match parse_epoch(&stdout) {
            Some((rate, loss)) if output.status.success() => {
                rates.push(rate);
                runs.insert(
                    name.into(),
                    serde_json::json!({"samples_per_s": rate, "train_loss": loss}),
                );
            }
            _ => {
                let stderr = String::from_utf8_lossy(&output.stderr);
                let tail: String = stderr
                    .chars()
                    .rev()
                    .take(1500)
                    .collect::<Vec<_>>()
                    .into_iter()
                    .rev()
                    .collect();
                return serde_json::json!({"error": format!("{name} failed ({}): {tail}", output.status)});
            }
        }
    }
    // Same global batch, so the step-time ratio is the inverse of the throughput ratio.
    runs.insert(
        "step_time_ratio_ddp_over_plain".into(),
        (rates[0] / rates[1]).into(),
    );
    serde_json::Value::Object(runs)
}
