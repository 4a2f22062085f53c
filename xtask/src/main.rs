//! Project chores, run with `cargo xtask <command>` (an alias in `.cargo/config.toml`), so they
//! need nothing but cargo.
//!
//! - `cargo xtask example fashion-mnist [--features cuda] -- [ARGS]`: builds the example in
//!   release mode and runs it with ARGS.

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
    match Cli::parse().command {
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
            let mut cargo = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
            cargo.args(["run", "--release", "--package", &name]);
            if let Some(features) = features {
                cargo.args(["--features", &features]);
            }
            cargo.arg("--").args(&args);
            run(cargo)
        }
    }
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
