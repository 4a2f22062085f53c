//! `gpu-check`: the checks of the CUDA path that need a GPU, as one JSON summary.
//!
//! Built and shipped by `cargo xtask gpu-check` (this binary and the example's, stripped, with a
//! script); run on a
//! machine with one GPU, so NCCL runs with a world size of 1. Over one rank an in-place sum is a
//! no-op for NCCL, so the value checks run **out of place**, from a bucket into a zeroed output
//! (a real copy through the pointers the group computed), and look at the output's neighbours:
//!
//! 1. `exact`: NCCL all-reduce over real burn-cuda bucket tensors (with and without Burn's
//!    fusion; f32, bf16 and f16; sum and average) gives exactly the expected values in the output
//!    slice and leaves the zeros around it alone; the in-place path (an average, which NCCL runs
//!    as a scaling kernel) keeps the values; the host-buffer collectives (all-reduce, broadcast,
//!    barrier, all-gather) return the expected values.
//! 2. `steps`: 1000 consecutive out-of-place all-reduces of freshly computed tensors and of bare
//!    slices of a larger buffer (sizes from 1 to 4 Mi values, at varying offsets) into slices of
//!    a freshly zeroed buffer, each read by Burn right after: a missed synchronisation reads zeros
//!    or stale values, a wrong pointer or offset reads or writes the wrong place.
//! 3. `training`: one epoch of the example (the `fashion-mnist` binary beside this one, or
//!    `--example PATH`) with `--workers 1` (plain Burn) and with
//!    `--workers 1 --ddp` (DdpStrategy), each in its own process, after a short warm-up run (kernel
//!    compilation and autotune caches), in the order plain, ddp, ddp, plain; the ratio of their
//!    mean step times.
//!
//! With `--out FILE` the summary is rewritten after every phase, so a run cut short keeps what
//! finished.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::backend::Cuda;
use burn::backend::cuda::CudaDevice;
use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Tensor, TensorData, TensorPrimitive};
use burn_ddp::comm::group::nccl::{NcclGroup, NcclIdSource};
use burn_ddp::comm::group::{ExtendedCollectives, ProcessGroup, ReduceOp};
use burn_ddp::config::GradientCompression;
use burn_ddp::group::ThreadGroup;
use clap::Parser;
use serde_json::{Value, json};

/// The checks of burn-ddp's CUDA path that need a GPU (NCCL with a world size of 1, the reducer,
/// a training-step ratio against plain Burn); prints one JSON summary.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// Fashion-MNIST's four IDX files, for the training phase (default: the example's search).
    #[arg(long)]
    data: Option<String>,
    /// Also write the summary here, rewritten after every phase.
    #[arg(long)]
    out: Option<String>,
    /// Consecutive all-reduces in the `steps` phase.
    #[arg(long, default_value_t = 1000)]
    steps: usize,
    /// Skip the training phase.
    #[arg(long)]
    skip_training: bool,
    /// The example binary the training phase runs (default: `fashion-mnist` beside this one).
    #[arg(long)]
    example: Option<PathBuf>,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,burn_ddp=info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    match run(&Args::parse()) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(message) => {
            eprintln!("error: {message}");
            ExitCode::FAILURE
        }
    }
}

/// burn-cuda without fusion: the other tensor type the group resolves.
type CudaPlain = burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, f32, i32, u8>;

const TIMEOUT: Duration = Duration::from_secs(60);

/// Runs the checks, prints the JSON summary and returns whether every check passed.
fn run(args: &Args) -> Result<bool, String> {
    let (steps, data, out) = (args.steps, args.data.clone(), args.out.clone());
    let skip_training = args.skip_training;

    let mut summary = json!({"passed": false});
    let save = |summary: &Value| {
        if let Some(out) = &out {
            let text = serde_json::to_string_pretty(summary).unwrap_or_default();
            if let Err(e) = std::fs::write(out, text + "\n") {
                eprintln!("warning: cannot write {out}: {e}");
            }
        }
    };
    let started = Instant::now();
    let built = burn_ddp::comm::group::nccl::check_cuda_driver()
        .and_then(|()| ThreadGroup::new_group(1))
        .and_then(|mut host| {
            NcclGroup::new(
                Arc::new(host.remove(0)),
                0,
                NcclIdSource::HostGroup,
                TIMEOUT,
            )
        });
    let group = match built {
        Ok(group) => group,
        Err(e) => {
            summary["error"] = e.to_string().into();
            save(&summary);
            return Err(e.to_string());
        }
    };
    summary["nccl_version"] =
        burn_ddp::comm::group::nccl::version_string(group.nccl_version()).into();
    summary["nccl_init_s"] = started.elapsed().as_secs_f64().into();
    save(&summary);

    let exact = exact_values(&group);
    let exact_ok = exact["passed"].as_bool() == Some(true);
    summary["exact"] = exact;
    save(&summary);
    let steps = consecutive_steps(&group, steps);
    let steps_ok = steps["mismatches"].as_u64() == Some(0) && steps["errors"].as_u64() == Some(0);
    summary["steps"] = steps;
    save(&summary);
    let group = Arc::new(group);
    let reducer = reducer_steps(group.clone(), 200);
    let reducer_ok = reducer["mismatches"].as_u64() == Some(0) && reducer["error"].is_null();
    summary["reducer"] = reducer;
    save(&summary);
    drop(group);
    let training = if skip_training {
        json!({"skipped": true})
    } else {
        match &args.example {
            Some(example) => training_ratio(example, data.as_deref()),
            None => match std::env::current_exe() {
                Ok(exe) => training_ratio(&exe.with_file_name("fashion-mnist"), data.as_deref()),
                Err(e) => json!({"error": e.to_string()}),
            },
        }
    };
    let training_ok = training.get("error").is_none();
    summary["training"] = training;
    let passed = exact_ok && steps_ok && reducer_ok && training_ok;
    summary["passed"] = passed.into();
    save(&summary);
    println!(
        "{}",
        serde_json::to_string_pretty(&summary).unwrap_or_default()
    );
    Ok(passed)
}

/// Distinct values that bf16 and f16 represent exactly (small integers times 1/8), so a sum or
/// average over one rank must return them bit for bit.
fn values(len: usize, salt: usize) -> Vec<f32> {
    (0..len)
        .map(|i| (((i * 7 + salt * 13) % 255) as f32 - 127.0) * 0.125)
        .collect()
}

fn read<B: Backend>(tensor: Tensor<B, 1>) -> Result<Vec<f32>, String> {
    tensor
        .into_data()
        .convert::<f32>()
        .to_vec::<f32>()
        .map_err(|e| format!("{e:?}"))
}

fn primitive<B: Backend>(tensor: &Tensor<B, 1>) -> B::FloatTensorPrimitive {
    tensor.clone().into_primitive().tensor()
}

/// One value check: `expected` computed on the device in `dtype`, all-reduced out of place into
/// a slice of a zeroed buffer with `GUARD` zeros on each side (or in place when `in_place`).
fn exact_case<B: Backend>(
    group: &NcclGroup,
    device: &B::Device,
    dtype: Option<FloatDType>,
    op: ReduceOp,
    in_place: bool,
) -> Value {
    const GUARD: usize = 4096;
    let expected = values(100_003, 1);
    let len = expected.len();
    // Computed on the device: pending work when the all-reduce starts.
    let bucket = Tensor::<B, 1>::from_data(TensorData::new(expected.clone(), [len]), device)
        .mul_scalar(2.0)
        .div_scalar(2.0);
    let bucket = match dtype {
        Some(dtype) => bucket.cast(dtype),
        None => bucket,
    };
    let wire = format!("{:?}", bucket.dtype());
    let result: Result<(Vec<f32>, f32), String> = (|| {
        if in_place {
            let mut p = primitive(&bucket);
            if !group
                .all_reduce_device(&mut p, op, TIMEOUT)
                .map_err(|e| e.to_string())?
            {
                return Err("the NCCL group did not take a burn-cuda tensor".into());
            }
            let reduced = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(p));
            return Ok((read(reduced)?, 0.0));
        }
        let zeros = Tensor::<B, 1>::zeros([len + 2 * GUARD], device);
        let zeros = match dtype {
            Some(dtype) => zeros.cast(dtype),
            None => zeros,
        };
        let output = zeros.clone().slice(GUARD..GUARD + len);
        group
            .all_reduce_into(&primitive(&bucket), &primitive(&output), op, TIMEOUT)
            .map_err(|e| e.to_string())?;
        let guards = zeros.clone().slice(0..GUARD).abs().sum()
            + zeros.slice(GUARD + len..len + 2 * GUARD).abs().sum();
        Ok((read(output)?, read(guards)?[0]))
    })();
    let (mismatches, guards) = match &result {
        Ok((got, guards)) => (
            got.iter().zip(&expected).filter(|(g, e)| g != e).count()
                + got.len().abs_diff(expected.len()),
            *guards,
        ),
        Err(_) => (len, 0.0),
    };
    json!({
        "dtype": wire,
        "op": op.to_string(),
        "in_place": in_place,
        "values": len,
        "mismatches": mismatches,
        "guard_sum": guards,
        "error": result.err(),
    })
}

fn exact_values(group: &NcclGroup) -> Value {
    let device = CudaDevice::new(0);
    let mut cases = Vec::new();
    for op in [ReduceOp::Sum, ReduceOp::Avg] {
        for dtype in [None, Some(FloatDType::BF16), Some(FloatDType::F16)] {
            let mut case = exact_case::<Cuda>(group, &device, dtype, op, false);
            case["fusion"] = true.into();
            cases.push(case);
            let mut case = exact_case::<CudaPlain>(group, &device, dtype, op, false);
            case["fusion"] = false.into();
            cases.push(case);
        }
    }
    for dtype in [None, Some(FloatDType::BF16)] {
        let mut case = exact_case::<Cuda>(group, &device, dtype, ReduceOp::Avg, true);
        case["fusion"] = true.into();
        cases.push(case);
    }
    // Host-buffer collectives.
    let mut host = Vec::new();
    let mut buffer = values(1000, 5);
    let expected = buffer.clone();
    let check = |name: &str, result: burn_ddp::comm::Result<bool>| {
        json!({
            "op": name,
            "ok": result.as_ref().is_ok_and(|ok| *ok),
            "error": result.err().map(|e| e.to_string()),
        })
    };
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
    let passed = cases.iter().all(|c| {
        c["mismatches"].as_u64() == Some(0)
            && c["guard_sum"].as_f64() == Some(0.0)
            && c["error"].is_null()
    }) && host.iter().all(|h| h["ok"].as_bool() == Some(true));
    json!({"passed": passed, "device": cases, "host": host})
}

fn consecutive_steps(group: &NcclGroup, steps: usize) -> Value {
    let device = CudaDevice::new(0);
    let sizes = [1usize, 3, 1000, 65_537, 1 << 20, 4 << 20];
    let big = 5 << 20;
    let base = Tensor::<Cuda, 1>::from_data(TensorData::new(values(big, 9), [big]), &device);
    let mut mismatches = 0u64;
    let mut errors = 0u64;
    let mut first_error = None;
    let mut first_mismatch = None;
    let started = Instant::now();
    for step in 0..steps {
        let len = sizes[step % sizes.len()];
        // burn-cubecl slices without copying (a view at a pointer offset) only at offsets that
        // are multiples of 512 bytes, and copies otherwise: 3 steps in 4 use such offsets (128
        // f32), so the offset path NCCL gets is really the view's; the 4th is unaligned.
        let align = if step % 4 == 3 { 1 } else { 128 };
        let offset = ((step * 4099) % ((big - len) / align)) * align;
        // Even steps: a freshly computed input (pending in Burn's queues); odd steps: a bare
        // slice of `base` (a buffer at an offset, when CubeCL slices without copying).
        let src = if step % 2 == 0 {
            base.clone()
                .slice(offset..offset + len)
                .mul_scalar((step % 7) as f32 + 1.0)
        } else {
            base.clone().slice(offset..offset + len)
        };
        // A freshly zeroed buffer; the output is a slice of it, with zeros on both sides.
        let out_at = ((step * 31) % (1024 / align) + 1) * align;
        let zeros = Tensor::<Cuda, 1>::zeros([len + out_at + 1024], &device);
        let dst = zeros.clone().slice(out_at..out_at + len);
        if let Err(e) =
            group.all_reduce_into(&primitive(&src), &primitive(&dst), ReduceOp::Sum, TIMEOUT)
        {
            errors += 1;
            first_error.get_or_insert(e.to_string());
            continue;
        }
        // Read by Burn right after: over one rank the sum is the input, and nothing else moved.
        let wrong = (dst - src).abs().max()
            + zeros.clone().slice(0..out_at).abs().sum()
            + zeros.slice(out_at + len..len + out_at + 1024).abs().sum();
        let wrong: f32 = wrong.into_scalar();
        if wrong != 0.0 {
            mismatches += 1;
            first_mismatch
                .get_or_insert(json!({"step": step, "len": len, "offset": offset, "error": wrong}));
        }
    }
    json!({
        "steps": steps,
        "mismatches": mismatches,
        "first_mismatch": first_mismatch,
        "errors": errors,
        "first_error": first_error,
        "seconds": started.elapsed().as_secs_f64(),
    })
}

/// The reducer's device path over the NCCL group, as training runs it: a weight of 0.5 (join
/// mode's weighting) makes it reduce even with one rank. `steps` reductions of a linear layer's
/// gradients (f32, then bf16 on the wire every other step) against the host's `0.5 * g`.
fn reducer_steps(group: Arc<NcclGroup>, steps: usize) -> Value {
    use burn::nn::{Linear, LinearConfig};
    use burn::optim::GradientsParams;
    use burn_ddp::mechanism::{ReduceOptions, Reducer, ReducerOptions, ReplicaLayout};
    type Ad = burn::backend::Autodiff<Cuda>;
    let device = CudaDevice::new(0);
    let layer: Linear<Ad> = LinearConfig::new(300, 200).init(&device);
    let layout = ReplicaLayout::of(&layer);
    let make = |compression| {
        Reducer::new(
            group.clone() as Arc<dyn ProcessGroup>,
            &layout,
            &ReducerOptions {
                gradient_compression: compression,
                ..ReducerOptions::default()
            },
        )
    };
    // f32, bf16 and f16 on the wire in turn (the 16-bit wires are scaled per bucket; the
    // values below are exact in both formats at any power-of-two scale).
    let mut reducers = Vec::new();
    for compression in [
        GradientCompression::None,
        GradientCompression::Bf16,
        GradientCompression::F16,
    ] {
        match make(compression) {
            Ok(reducer) => reducers.push(reducer),
            Err(e) => return json!({"error": e.to_string()}),
        }
    }
    let options = ReduceOptions {
        weight: 0.5,
        op: ReduceOp::Sum,
        ..ReduceOptions::default()
    };
    let weight_id = layer.weight.id;
    let bias_id = layer.bias.as_ref().map(|b| b.id);
    let started = Instant::now();
    let mut mismatches = 0u64;
    let mut first_mismatch = None;
    for step in 0..steps {
        // bf16-exact values (small integers / 8), different every step.
        let w = values(300 * 200, step);
        let b = values(200, step + 1);
        let mut grads = GradientsParams::new();
        grads.register::<Cuda, 2>(
            weight_id,
            Tensor::from_data(TensorData::new(w.clone(), [300, 200]), &device).mul_scalar(1.0),
        );
        if let Some(bias_id) = bias_id {
            grads.register::<Cuda, 1>(
                bias_id,
                Tensor::from_data(TensorData::new(b.clone(), [200]), &device),
            );
        }
        let reducer = &mut reducers[step % 3];
        let outcome = match reducer.reduce_with::<Cuda>(&layout, Some(grads), &device, &options) {
            Ok(outcome) => outcome,
            Err(e) => return json!({"error": e.to_string(), "step": step}),
        };
        let got_w = outcome
            .grads
            .get::<Cuda, 2>(weight_id)
            .map(|t| read(t.reshape([300 * 200])));
        let got_b = bias_id
            .and_then(|id| outcome.grads.get::<Cuda, 1>(id))
            .map(read);
        let ok = |got: Option<Result<Vec<f32>, String>>, expected: &[f32]| {
            got.and_then(|r| r.ok()).is_some_and(|got| {
                got.len() == expected.len() && got.iter().zip(expected).all(|(g, e)| *g == 0.5 * e)
            })
        };
        if !(ok(got_w, &w) && ok(got_b, &b)) {
            mismatches += 1;
            first_mismatch.get_or_insert(step);
        }
    }
    json!({
        "steps": steps,
        "mismatches": mismatches,
        "first_mismatch": first_mismatch,
        "error": Value::Null,
        "bytes_all_reduced": reducers.iter().map(|r| r.stats().bytes).sum::<usize>(),
        "uncompressed_buckets": reducers.iter().map(|r| r.stats().uncompressed_buckets).sum::<u64>(),
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
    let rate = line.split(", ").find(|p| p.contains(" samples/s"))?;
    let rate = rate.split_whitespace().next()?.parse().ok()?;
    Some((rate, loss))
}

/// Bound on one training run of the check (one epoch of Fashion-MNIST takes well under a minute
/// on a recent GPU).
const RUN_TIMEOUT: Duration = Duration::from_secs(300);

/// `command`'s output, killing it when it runs longer than `timeout`.
fn output_within(mut command: Command, timeout: Duration) -> std::io::Result<std::process::Output> {
    use std::process::Stdio;
    let mut child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    // Read both pipes on threads so a chatty child cannot block on a full pipe.
    let mut stdout = child.stdout.take().expect("piped");
    let mut stderr = child.stderr.take().expect("piped");
    let out = std::thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = std::io::Read::read_to_end(&mut stdout, &mut buf);
        buf
    });
    let err = std::thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = std::io::Read::read_to_end(&mut stderr, &mut buf);
        buf
    });
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("killed after {} s", timeout.as_secs()),
            ));
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    Ok(std::process::Output {
        status,
        stdout: out.join().unwrap_or_default(),
        stderr: err.join().unwrap_or_default(),
    })
}

/// One run of the example; `(samples/s, train loss)`.
fn train_once(
    exe: &Path,
    name: &str,
    ddp: bool,
    data: Option<&str>,
    extra: &[&str],
) -> Result<(f64, f64), String> {
    let mut command = Command::new(exe);
    command.args(["--device", "cuda", "--workers", "1", "--epochs", "1"]);
    command.args(["--artifacts", &format!("/tmp/burn-ddp-gpu-check-{name}")]);
    command.args(extra);
    if ddp {
        command.arg("--ddp");
    }
    if let Some(data) = data {
        command.args(["--data", data]);
    }
    let output = output_within(command, RUN_TIMEOUT).map_err(|e| format!("{name}: {e}"))?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    match parse_epoch(&stdout) {
        Some(result) if output.status.success() => Ok(result),
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
            Err(format!("{name} failed ({}): {tail}", output.status))
        }
    }
}

fn training_ratio(exe: &Path, data: Option<&str>) -> Value {
    if !exe.is_file() {
        return json!({"error": format!("no example binary at {} (--example)", exe.display())});
    }
    // Warm-up: CubeCL compiles kernels and fills its autotune cache on first use.
    if let Err(e) = train_once(exe, "warm-up", true, data, &["--train-limit", "6400"]) {
        return json!({"error": e});
    }
    let mut runs = Vec::new();
    let (mut plain, mut ddp) = (Vec::new(), Vec::new());
    for (name, is_ddp) in [
        ("plain-1", false),
        ("ddp-1", true),
        ("ddp-2", true),
        ("plain-2", false),
    ] {
        match train_once(exe, name, is_ddp, data, &[]) {
            Ok((rate, loss)) => {
                runs.push(json!({"run": name, "samples_per_s": rate, "train_loss": loss}));
                if is_ddp { &mut ddp } else { &mut plain }.push(rate);
            }
            Err(e) => return json!({"error": e, "runs": runs}),
        }
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    // Same global batch, so the step-time ratio is the inverse of the throughput ratio.
    json!({
        "runs": runs,
        "plain_samples_per_s": mean(&plain),
        "ddp_samples_per_s": mean(&ddp),
        "step_time_ratio_ddp_over_plain": mean(&plain) / mean(&ddp),
    })
}
