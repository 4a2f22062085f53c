//! Project chores, run with `cargo xtask <command>` (an alias in `.cargo/config.toml`), so they
//! need nothing but cargo.
//!
//! - `cargo xtask example fashion-mnist [--features cuda] -- [ARGS]`: builds the example in
//!   release mode and runs it with ARGS.
//! - `cargo xtask bench [-- --long --out DIR]`: the benchmark, in release mode.
//! - `cargo xtask launch [LAUNCHER OPTIONS] -- PROGRAM [ARGS]`: builds the `burn-ddp` launcher in
//!   release mode and runs `burn-ddp run LAUNCHER OPTIONS -- PROGRAM ARGS`; when PROGRAM is an
//!   example's name (`fashion-mnist`), builds it too and runs that binary.

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
        /// Arguments for the benchmark, after `--` (e.g. `--long`, `--out DIR`).
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// Build an example in release mode and run it.
    Example {
        /// The example: `fashion-mnist`.
        name: String,
        /// Cargo features of the example (e.g. `cuda`).
        #[arg(long)]
        features: Option<String>,
        /// Arguments for the example, after `--`.
        #[arg(last = true)]
        args: Vec<String>,
    },
}

const EXAMPLES: &[&str] = &["fashion-mnist"];

fn main() -> ExitCode {
    // `launch` passes its options through to the launcher untouched, so it bypasses clap.
    let raw: Vec<String> = std::env::args().skip(1).collect();
    if raw.first().map(String::as_str) == Some("launch") {
        return launch(&raw[1..]);
    }
    match Cli::parse().command {
        Task::Bench { args } => {
            let mut cargo = cargo();
            cargo
                .args(["run", "--release", "--package", "ddp-bench", "--"])
                .args(&args);
            run(cargo)
        }
        Task::Example {
            name,
            features,
            args,
        } => {
            if !EXAMPLES.contains(&name.as_str()) {
                eprintln!(
                    "unknown example `{name}`; examples: {}",
                    EXAMPLES.join(", ")
                );
                return ExitCode::FAILURE;
            }
            let mut cargo = cargo();
            cargo.args(["run", "--release", "--package", &name]);
            if let Some(features) = features {
                cargo.args(["--features", &features]);
            }
            cargo.arg("--").args(&args);
            run(cargo)
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
    build.args(["build", "--release", "--package", "burn-ddp"]);
    let example = EXAMPLES.contains(&program.as_str());
    if example {
        build.args(["--package", program]);
        if let Some(features) = &features {
            build.args(["--features", &format!("{program}/{features}")]);
        }
    }
    let built = run(build);
    if built != ExitCode::SUCCESS {
        return built;
    }
    let release = target_dir().join("release");
    let mut launcher = Command::new(release.join("burn-ddp"));
    launcher.arg("run").args(&options).arg("--");
    if example {
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
