//! `cargo xtask loss-curves [--workers N] [--out DIR] [-- EXAMPLE ARGS]`: the Fashion-MNIST
//! example trained twice from the same seed, on one device with plain Burn (`--workers 1`) and
//! on N replicas with burn-ddp, and the training loss of every step of both (burn-train's own
//! `train/epoch-*/Loss.log`) drawn into one SVG: convergence "like single-GPU", as a picture.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use plotters::prelude::*;

use crate::{run, target_dir};

/// The training losses of one run, step by step over its epochs.
struct Curve {
    label: String,
    losses: Vec<f64>,
}

/// Builds the example, trains it both ways into `out`, draws `out/loss.svg`. `args` go to both
/// runs; `--workers` and `--artifacts` are this command's own (refused in `args`).
pub fn loss_curves(workers: usize, out: &Path, args: &[String]) -> ExitCode {
    if let Some(own) = args.iter().find(|a| {
        ["--workers", "--artifacts"]
            .iter()
            .any(|f| a.split('=').next() == Some(f))
    }) {
        eprintln!(
            "cargo xtask loss-curves: `{own}` is set by the command itself (use \
             `cargo xtask loss-curves --workers N --out DIR -- ARGS`)"
        );
        return ExitCode::FAILURE;
    }
    let mut build = crate::cargo();
    // The features `cargo xtask example` builds the example with (CUDA or wgpu when ARGS ask).
    let features = match crate::device_feature(args) {
        Some(device) => format!("burn-ddp/launcher,{device}"),
        None => "burn-ddp/launcher".to_string(),
    };
    build.args([
        "build",
        "--release",
        "--package",
        "fashion-mnist",
        "--bin",
        "fashion-mnist",
        "--features",
        &features,
    ]);
    let built = run(build);
    if built != ExitCode::SUCCESS {
        return built;
    }
    let binary = target_dir().join("release").join("fashion-mnist");
    let mut curves = Vec::new();
    for (n, label) in [
        (1, "one device (plain Burn)".to_string()),
        (workers, format!("{workers} replicas (burn-ddp)")),
    ] {
        let artifacts = out.join(format!("workers-{n}"));
        // burn-train appends to its logs: a fresh directory per run.
        let _ = std::fs::remove_dir_all(&artifacts);
        let mut example = Command::new(&binary);
        example
            .args(["--workers", &n.to_string(), "--artifacts"])
            .arg(&artifacts)
            .args(args);
        let status = run(example);
        if status != ExitCode::SUCCESS {
            return status;
        }
        match losses(&artifacts) {
            Ok(losses) if !losses.is_empty() => curves.push(Curve { label, losses }),
            Ok(_) => {
                eprintln!("xtask: no training loss in {}", artifacts.display());
                return ExitCode::FAILURE;
            }
            Err(e) => {
                eprintln!(
                    "xtask: cannot read the losses in {}: {e}",
                    artifacts.display()
                );
                return ExitCode::FAILURE;
            }
        }
    }
    let svg = out.join("loss.svg");
    if let Err(e) = draw(&curves, &svg) {
        eprintln!("xtask: cannot draw {}: {e}", svg.display());
        return ExitCode::FAILURE;
    }
    let last = |c: &Curve| c.losses.last().copied().unwrap_or(f64::NAN);
    println!(
        "loss curves: {} ({} steps each; last training loss {:.4} on one device, {:.4} with {} replicas)",
        svg.display(),
        curves[0].losses.len(),
        last(&curves[0]),
        last(&curves[1]),
        workers
    );
    ExitCode::SUCCESS
}

/// The per-step training losses burn-train logged under `artifacts`, epoch after epoch (the
/// first field of each line of `train/epoch-E/Loss.log`).
fn losses(artifacts: &Path) -> std::io::Result<Vec<f64>> {
    let mut losses = Vec::new();
    for epoch in 1.. {
        let log: PathBuf = artifacts
            .join("train")
            .join(format!("epoch-{epoch}"))
            .join("Loss.log");
        if !log.is_file() {
            break;
        }
        for line in std::fs::read_to_string(&log)?.lines() {
            if let Some(value) = line.split(',').next().and_then(|v| v.trim().parse().ok()) {
                losses.push(value);
            }
        }
    }
    Ok(losses)
}

/// Both curves into one SVG: loss against step.
fn draw(curves: &[Curve], path: &Path) -> Result<(), Box<dyn std::error::Error>> {
    let steps = curves.iter().map(|c| c.losses.len()).max().unwrap_or(1);
    let top = curves
        .iter()
        .flat_map(|c| c.losses.iter().copied())
        .filter(|v| v.is_finite())
        .fold(0.0f64, f64::max)
        * 1.05;
    let root = SVGBackend::new(path, (900, 480)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "Fashion-MNIST training loss, same seed and global batch",
            ("sans-serif", 20),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(55)
        .build_cartesian_2d(0usize..steps, 0f64..top.max(1e-6))?;
    chart
        .configure_mesh()
        .x_desc("optimizer step")
        .y_desc("training loss")
        .draw()?;
    for (curve, color) in curves.iter().zip([BLUE, RED]) {
        chart
            .draw_series(LineSeries::new(
                curve.losses.iter().enumerate().map(|(i, v)| (i, *v)),
                color.stroke_width(2),
            ))?
            .label(curve.label.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn losses_are_read_epoch_after_epoch_and_drawn() {
        let dir = std::env::temp_dir().join(format!("xtask-loss-{}", std::process::id()));
        for (epoch, text) in [(1, "2.5,1\n2.0,1\n"), (2, "1.5,1\n")] {
            let d = dir.join("train").join(format!("epoch-{epoch}"));
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("Loss.log"), text).unwrap();
        }
        let losses = losses(&dir).unwrap();
        assert_eq!(losses, vec![2.5, 2.0, 1.5]);
        let svg = dir.join("loss.svg");
        let curves = [
            Curve {
                label: "a".into(),
                losses: losses.clone(),
            },
            Curve {
                label: "b".into(),
                losses,
            },
        ];
        draw(&curves, &svg).unwrap();
        assert!(std::fs::read_to_string(&svg).unwrap().contains("<svg"));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
