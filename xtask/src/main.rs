//! Project chores, run with `cargo xtask <command>` (an alias in `.cargo/config.toml`), so they
//! need nothing but cargo.
//!
//! - `cargo xtask example fashion-mnist [--bin custom-loop] [--features cuda] -- [ARGS]`: builds
//!   the example in release mode and runs it (its binary of the same name, or `--bin`) with ARGS;
//!   with `--device cuda` or `--device wgpu` in ARGS (or xtask's own `cuda` feature) the example
//!   is built with its `cuda` or `wgpu` feature.
//! - `cargo xtask bench [--features mpi] [-- --long --out DIR]`: the benchmark, in release mode.
//! - `cargo xtask gpu-check [--out DIR]`: builds the `gpu-check` binary and the Fashion-MNIST
//!   example with CUDA (release, stripped, gzipped) and writes them to DIR (default
//!   `target/gpu-check`) with `run.sh`, the script that runs the GPU checks on a machine with a
//!   GPU and no Rust toolchain (see README).
//! - `cargo xtask loss-curves [--workers N] [--out DIR] [-- ARGS]`: the example's training loss
//!   on one device and on N replicas from the same seed, drawn into `DIR/loss.svg`.
//! - `cargo xtask launch [LAUNCHER OPTIONS] -- PROGRAM [ARGS]`: builds the `burn-ddp` launcher in
//!   release mode and runs `burn-ddp run LAUNCHER OPTIONS -- PROGRAM ARGS`; when PROGRAM is an
//!   example's binary (`fashion-mnist`, `custom-loop`), builds it too and runs that binary (with
//!   its `cuda` or `wgpu` feature when the program's arguments say `--device cuda` or `wgpu`).

mod loss_curves;

use std::process::{Command, ExitCode};

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(about = "burn-ddp project tasks")]
struct Cli {
    #[command(subcommand)]
    command: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Run the benchmark (release mode): throughput, collectives, bucket caps, projection.
    Bench {
        /// Cargo features of the benchmark (`mpi`: MpiGroup in the sweeps, needs Open MPI).
        #[arg(long)]
        features: Option<String>,
        /// Arguments for the benchmark, after `--` (e.g. `--long`, `--out DIR`).
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// Prepare the GPU checks: stripped release builds of `gpu-check` and the example with CUDA,
    /// and the script that runs `gpu-check` on the GPU machine.
    GpuCheck {
        /// Directory for the binary and the script.
        #[arg(long, default_value = "target/gpu-check")]
        out: std::path::PathBuf,
    },
    /// Train the Fashion-MNIST example on one device (plain Burn) and on N replicas (burn-ddp)
    /// from the same seed and draw both training-loss curves into one SVG.
    LossCurves {
        /// Replicas of the burn-ddp run.
        #[arg(long, default_value_t = 2)]
        workers: usize,
        /// Directory for both runs' artifacts and `loss.svg`.
        #[arg(long, default_value = "target/loss-curves")]
        out: std::path::PathBuf,
        /// Arguments for both runs of the example, after `--` (e.g. `--epochs 2`).
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// Build an example in release mode and run it.
    Example {
        /// The example: `fashion-mnist`.
        name: String,
        /// The example's binary to run (default: the one named after the example;
        /// `custom-loop`: the Fashion-MNIST training loop written by hand).
        #[arg(long)]
        bin: Option<String>,
        /// Cargo features of the example (e.g. `cuda`).
        #[arg(long)]
        features: Option<String>,
        /// Arguments for the example, after `--`.
        #[arg(last = true)]
        args: Vec<String>,
    },
}

/// The examples' packages and the binaries a user runs (the package's namesake first).
const EXAMPLES: &[(&str, &[&str])] = &[("fashion-mnist", &["fashion-mnist", "custom-loop"])];

/// The example package that holds binary `program`.
fn package_of(program: &str) -> Option<&'static str> {
    EXAMPLES
        .iter()
        .find(|(_, bins)| bins.contains(&program))
        .map(|(package, _)| *package)
}

fn main() -> ExitCode {
    // `launch` passes its options through to the launcher untouched, so it bypasses clap.
    let raw: Vec<String> = std::env::args().skip(1).collect();
    if raw.first().map(String::as_str) == Some("launch") {
        return launch(&raw[1..]);
    }
    match Cli::parse().command {
        Task::Bench { features, args } => {
            let mut cargo = cargo();
            cargo.args(["run", "--release", "--package", "ddp-bench"]);
            if let Some(features) = features {
                cargo.args(["--features", &features]);
            }
            cargo.arg("--").args(&args);
            run(cargo)
        }
        Task::GpuCheck { out } => gpu_check(&out),
        Task::LossCurves { workers, out, args } => loss_curves::loss_curves(workers, &out, &args),
        Task::Example {
            name,
            bin,
            features,
            args,
        } => {
            let bin = bin.unwrap_or_else(|| name.clone());
            let Some(bins) = EXAMPLES.iter().find(|(p, _)| *p == name).map(|(_, b)| b) else {
                let names: Vec<&str> = EXAMPLES.iter().map(|(p, _)| *p).collect();
                eprintln!("unknown example `{name}`; examples: {}", names.join(", "));
                return ExitCode::FAILURE;
            };
            if !bins.contains(&bin.as_str()) {
                eprintln!(
                    "example `{name}` has no binary `{bin}`; binaries: {}",
                    bins.join(", ")
                );
                return ExitCode::FAILURE;
            }
            let mut cargo = cargo();
            // `--bin`: an example package holds several binaries (`custom-loop`, `gpu-check`
            // beside `fashion-mnist`).
            cargo.args(["run", "--release", "--package", &name, "--bin", &bin]);
            // burn-ddp with the features `cargo xtask launch` builds it with, so switching
            // between the two commands does not rebuild burn-ddp and the example each time.
            let mut wanted = vec!["burn-ddp/launcher".to_string()];
            match features {
                Some(features) => wanted.push(features),
                // `--device cuda` or `wgpu` needs the example's feature of that name: added when
                // not given (`cuda` always, when xtask itself is built with its `cuda` feature).
                None => wanted.extend(device_feature(&args).map(str::to_string)),
            }
            cargo.args(["--features", &wanted.join(",")]);
            cargo.arg("--").args(&args);
            run(cargo)
        }
    }
}

/// The feature a program's arguments need for their devices: `cuda` for `--device cuda` (or
/// always, when xtask is built with its `cuda` feature), `wgpu` for `--device wgpu` (also
/// written `--device=...`).
fn device_feature(args: &[String]) -> Option<&'static str> {
    let asks = |kind: &str| {
        args.iter().any(|a| *a == format!("--device={kind}"))
            || args.windows(2).any(|w| w[0] == "--device" && w[1] == kind)
    };
    if cfg!(feature = "cuda") || asks("cuda") {
        Some("cuda")
    } else if asks("wgpu") {
        Some("wgpu")
    } else {
        None
    }
}

/// The script that runs on the GPU machine, beside the binary.
const GPU_CHECK_SCRIPT: &str = r#"#!/usr/bin/env bash
# burn-ddp GPU checks (written by `cargo xtask gpu-check`). Runs beside the `gpu-check` and
# `fashion-mnist` binaries on a machine with an NVIDIA GPU; needs no Rust toolchain and no network. Prints one JSON
# summary and writes it to $OUT/gpu-check.json (or ./gpu-check.json).
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:-$here}"
# CubeCL compiles kernels with NVRTC (libnvrtc.so.13 and its builtins): a CUDA toolkit's
# lib64, or the nvidia-* wheels that PyTorch installs.
nvidia_root="$(python3 -c 'import nvidia; print(list(nvidia.__path__)[0])' 2>/dev/null)"
wheel_libs=()
if [ -n "$nvidia_root" ] && [ -d "$nvidia_root" ]; then
  wheel_libs=("$nvidia_root"/*/lib)
fi
for dir in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib "${wheel_libs[@]}"; do
  if [ -d "$dir" ]; then LD_LIBRARY_PATH="$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; fi
done
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}"
# CubeCL's kernels include cuda_runtime.h from $CUDA_PATH/include (default /usr/local/cuda):
# without a toolkit, take the headers of an nvidia-* wheel.
if [ -z "${CUDA_PATH:-}" ] && [ ! -d /usr/local/cuda ] && [ ! -d /opt/cuda ]; then
  for header in "${wheel_libs[@]/%\/lib//include/cuda_runtime.h}"; do
    if [ -f "$header" ]; then export CUDA_PATH="${header%/include/cuda_runtime.h}"; break; fi
  done
fi
echo "CUDA_PATH: ${CUDA_PATH:-<CubeCL default: /usr/local/cuda>}" >&2
# NCCL: the nvidia-nccl-cu* wheel, unless BURN_DDP_NCCL_LIB is set.
if [ -z "${BURN_DDP_NCCL_LIB:-}" ]; then
  dir="$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null)"
  for candidate in ${dir:+"$dir/lib/libnccl.so.2"} "${wheel_libs[@]/%//libnccl.so.2}"; do
    if [ -f "$candidate" ]; then export BURN_DDP_NCCL_LIB="$candidate"; break; fi
  done
fi
echo "NCCL: ${BURN_DDP_NCCL_LIB:-<dynamic linker search>}" >&2
echo "NVRTC: $( (ldconfig -p 2>/dev/null | grep -o '/[^ ]*libnvrtc.so[^ ]*'; \
  for d in ${LD_LIBRARY_PATH//:/ }; do ls "$d"/libnvrtc.so* 2>/dev/null; done) | head -n 3 | tr '\n' ' ')" >&2
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >&2 || true
# Fashion-MNIST when installed, else synthetic images of the same shape (the check measures
# step times, not accuracy).
data=/usr/share/datasets/fashion-mnist
if [ ! -f "$data/train-images-idx3-ubyte.gz" ]; then
  data=/tmp/burn-ddp-gpu-check-data
  python3 - "$data" <<'PY'
import os, struct, sys
d = sys.argv[1]
os.makedirs(d, exist_ok=True)
for prefix, n in (("train", 60000), ("t10k", 10000)):
    with open(os.path.join(d, prefix + "-images-idx3-ubyte"), "wb") as f:
        f.write(struct.pack(">IIII", 0x803, n, 28, 28) + os.urandom(n * 784))
    with open(os.path.join(d, prefix + "-labels-idx1-ubyte"), "wb") as f:
        f.write(struct.pack(">II", 0x801, n) + bytes(i % 10 for i in range(n)))
PY
  echo "data: synthetic ($data)" >&2
fi
# The summary goes to a file, rewritten after each phase (NCCL_DEBUG output on stdout cannot
# corrupt it, and a run cut short keeps the finished phases).
# The binaries travel gzipped.
bin=/tmp/burn-ddp-gpu-check-bin
mkdir -p "$bin"
for name in gpu-check fashion-mnist; do
  gunzip -c "$here/$name.gz" > "$bin/$name" && chmod +x "$bin/$name" || exit 1
done
"$bin/gpu-check" --example "$bin/fashion-mnist" --data "$data" --out "$out/gpu-check.json" "$@" >&2
status=$?
cat "$out/gpu-check.json" 2>/dev/null
exit "$status"
"#;

fn gpu_check(out: &std::path::Path) -> ExitCode {
    let mut build = cargo();
    build.args([
        "build",
        "--release",
        "--package",
        "fashion-mnist",
        "--features",
        "cuda",
    ]);
    if run(build) != ExitCode::SUCCESS {
        return ExitCode::FAILURE;
    }
    let written = (|| -> std::io::Result<u64> {
        std::fs::create_dir_all(out)?;
        let mut bytes = 0;
        for name in ["gpu-check", "fashion-mnist"] {
            let binary = out.join(name);
            std::fs::copy(target_dir().join("release").join(name), &binary)?;
            // Keep what travels small: no symbols, and gzip (about a third of the size); run.sh
            // unpacks them.
            let stripped = Command::new("strip").arg(&binary).status();
            if !stripped.is_ok_and(|s| s.success()) {
                eprintln!("warning: `strip` failed or is missing; {name} travels unstripped");
            }
            let packed = out.join(format!("{name}.gz"));
            {
                let mut reader = std::fs::File::open(&binary)?;
                let file = std::fs::File::create(&packed)?;
                let mut encoder =
                    flate2::write::GzEncoder::new(file, flate2::Compression::default());
                std::io::copy(&mut reader, &mut encoder)?;
                encoder.finish()?.sync_all()?;
            }
            std::fs::remove_file(&binary)?;
            bytes += std::fs::metadata(&packed)?.len();
        }
        let script = out.join("run.sh");
        std::fs::write(&script, GPU_CHECK_SCRIPT)?;
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755))?;
        }
        Ok(bytes)
    })();
    match written {
        Ok(bytes) => {
            println!(
                "GPU check ready in {dir}: gpu-check.gz and fashion-mnist.gz ({:.1} MiB) and \
                 run.sh.\n\
                 On the GPU machine: bash {dir}/run.sh (prints and writes gpu-check.json)",
                bytes as f64 / (1024.0 * 1024.0),
                dir = out.display()
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: cannot write {}: {e}", out.display());
            ExitCode::FAILURE
        }
    }
}

/// The workspace's target directory.
fn target_dir() -> std::path::PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) => dir.into(),
        None => std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join("target"),
    }
}

fn cargo() -> Command {
    Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
}

fn launch(args: &[String]) -> ExitCode {
    let Some(split) = args.iter().position(|a| a == "--") else {
        eprintln!(
            "usage: cargo xtask launch [--features F] [LAUNCHER OPTIONS] -- PROGRAM [ARGS]\n\
             e.g.  cargo xtask launch --nproc-per-node 2 -- fashion-mnist --epochs 1"
        );
        return ExitCode::FAILURE;
    };
    let (mut options, rest) = (args[..split].to_vec(), &args[split + 1..]);
    let mut features = None;
    if let Some(at) = options.iter().position(|o| o == "--features") {
        if at + 1 < options.len() {
            features = Some(options.remove(at + 1));
        }
        options.remove(at);
    }
    let Some((program, program_args)) = rest.split_first() else {
        eprintln!("cargo xtask launch: no program after `--`");
        return ExitCode::FAILURE;
    };
    let mut build = cargo();
    // All binaries of the packages (`--bin` would also filter the example's out).
    build.args([
        "build",
        "--release",
        "--package",
        "burn-ddp",
        "--features",
        "burn-ddp/launcher",
    ]);
    let example = package_of(program);
    if features.is_none() {
        features = device_feature(program_args).map(str::to_string);
    }
    if let Some(package) = example {
        build.args(["--package", package]);
        if let Some(features) = &features {
            build.args(["--features", &format!("{package}/{features}")]);
        }
    }
    let built = run(build);
    if built != ExitCode::SUCCESS {
        return built;
    }
    let release = target_dir().join("release");
    let mut launcher = Command::new(release.join("burn-ddp"));
    launcher.arg("run").args(&options).arg("--");
    if example.is_some() {
        launcher.arg(release.join(program));
    } else {
        launcher.arg(program);
    }
    launcher.args(program_args);
    run(launcher)
}

fn run(mut command: Command) -> ExitCode {
    // `cargo xtask` runs this binary through `cargo run`, which sets the xtask package's
    // CARGO_PKG_*/CARGO_MANIFEST_* variables. Build scripts that watch them (ring's does) would
    // then rebuild on every switch between `cargo xtask` and plain cargo: drop them.
    for (key, _) in std::env::vars_os() {
        let key = key.to_string_lossy().into_owned();
        if key.starts_with("CARGO_PKG_")
            || key.starts_with("CARGO_MANIFEST_")
            || [
                "CARGO_CRATE_NAME",
                "CARGO_BIN_NAME",
                "CARGO_PRIMARY_PACKAGE",
                "OUT_DIR",
            ]
            .contains(&key.as_str())
        {
            command.env_remove(key);
        }
    }
    let shown = std::iter::once(command.get_program())
        .chain(command.get_args())
        .map(|a| a.to_string_lossy())
        .collect::<Vec<_>>()
        .join(" ");
    match command.status() {
        Ok(status) if status.success() => ExitCode::SUCCESS,
        Ok(status) => ExitCode::from(status.code().unwrap_or(1).clamp(1, 255) as u8),
        Err(e) => {
            eprintln!("xtask: could not run `{shown}`: {e}");
            ExitCode::FAILURE
        }
    }
}
