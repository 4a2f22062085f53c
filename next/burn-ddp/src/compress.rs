//! Gradient compression for the wire: buckets all-reduced as `bf16` or `f16` instead of `f32`,
//! as PyTorch DDP's `bf16_compress_hook` / `fp16_compress_hook` do, without their silent
//! overflow and underflow.
//!
//! Each step, before a bucket is all-reduced, the ranks agree on the bucket's largest magnitude
//! `M` and smallest non-zero magnitude `m` (one all-gather of two words per bucket). The bucket
//! is multiplied by a power of two `s` (exact) chosen so that the sum of `N` ranks' values,
//! `N * M * s`, stays below half the format's largest value, then cast; the reduced values are
//! cast back to `f32` and divided by `s`. Averaging divides by `N` in `f32` first. Every value then
//! keeps the format's relative rounding (`2^-8` for `bf16`, `2^-11` for `f16`, per rounding)
//! as long as `m * s` is a normal number of the format: `f16`'s normal range covers `2^30 / N`
//! (about 10^8 at 8 ranks), `bf16`'s that of `f32`. A bucket whose values span more than that
//! goes as `f32` for that step, counted in
//! [`CommStats::uncompressed_buckets`](crate::metrics::CommStats::uncompressed_buckets) and
//! named in a warning (bucket, rank, magnitudes) the first time. Non-finite values also go as
//! `f32`, so the NaN/infinity check names the ranks that had them.

use burn::tensor::{FloatDType, Tensor};
use serde::{Deserialize, Serialize};

use burn_ddp_comm::group::ReduceOp;

/// The dtype gradient buckets travel in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub enum GradientCompression {
    /// `f32`: exact (the default).
    #[default]
    None,
    /// `bf16`: `f32`'s range, 8 bits of mantissa.
    Bf16,
    /// `f16`: 11 bits of mantissa, normal numbers from `2^-14` to 65,504 (scaled per bucket).
    F16,
}

impl GradientCompression {
    /// The dtype on the wire (`None` for `f32`, which needs no cast).
    pub fn wire_dtype(self) -> Option<FloatDType> {
        match self {
            GradientCompression::None => None,
            GradientCompression::Bf16 => Some(FloatDType::BF16),
            GradientCompression::F16 => Some(FloatDType::F16),
        }
    }

    /// Bytes per gradient element on the wire.
    pub fn element_bytes(self) -> usize {
        match self {
            GradientCompression::None => 4,
            GradientCompression::Bf16 | GradientCompression::F16 => 2,
        }
    }

    /// The format's largest finite value and smallest normal value (`None` for `f32`).
    fn range(self) -> Option<(f64, f64)> {
        match self {
            GradientCompression::None => None,
            // bf16: 2^127 * (2 - 2^-7); smallest normal 2^-126, as f32.
            GradientCompression::Bf16 => Some((3.389_531_389_251_535_5e38, 2f64.powi(-126))),
            GradientCompression::F16 => Some((65_504.0, 2f64.powi(-14))),
        }
    }
}

/// How one bucket travels in one step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Wire {
    /// As `f32`, with the caller's reduction.
    F32,
    /// Cast to the 16-bit format after multiplying the values by `factor` (the scale `s`,
    /// divided by the world size for an average); summed; then divided by `scale`.
    Half {
        /// `s`, a power of two.
        scale: f32,
        /// What the values are multiplied by before the cast: `s / N` for an average, `s` for a
        /// sum.
        factor: f32,
    },
}

/// Why a bucket goes as `f32` despite compression.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Fallback {
    /// Its non-zero magnitudes span more than the format's normal range at this world size.
    Range,
    /// It holds NaN or infinity (the non-finite check reports it).
    NonFinite,
}

/// The wire of a bucket whose values span `max_abs` (largest magnitude over all ranks) down to
/// `min_nonzero` (smallest non-zero magnitude over all ranks; infinity when all are zero), reduced
/// with `op` over `world_size` ranks. See the [module docs](self).
pub(crate) fn choose_wire(
    compression: GradientCompression,
    op: ReduceOp,
    world_size: usize,
    max_abs: f32,
    min_nonzero: f32,
) -> Result<Wire, Fallback> {
    let Some((largest, smallest_normal)) = compression.range() else {
        return Ok(Wire::F32);
    };
    if !max_abs.is_finite() || min_nonzero.is_nan() {
        return Err(Fallback::NonFinite);
    }
    let n = world_size.max(1) as f64;
    let divide = if op == ReduceOp::Avg { n } else { 1.0 };
    let factor_for = |scale: f64| (scale / divide) as f32;
    if max_abs == 0.0 {
        return Ok(Wire::Half {
            scale: 1.0,
            factor: factor_for(1.0),
        });
    }
    // The partial sums of a ring reach n * (max / divide) * s: keep them below half the format's
    // largest value (one bit of room for the roundings).
    let bound = n * f64::from(max_abs) / divide;
    let exponent = (largest / (2.0 * bound))
        .log2()
        .floor()
        .clamp(-126.0, 127.0) as i32;
    let scale = 2f64.powi(exponent);
    if min_nonzero.is_finite() && f64::from(min_nonzero) / divide * scale < smallest_normal {
        return Err(Fallback::Range);
    }
    Ok(Wire::Half {
        scale: scale as f32,
        factor: factor_for(scale),
    })
}

/// `values` (an `f32` bucket's gradients) prepared for the wire: multiplied by the factor and
/// cast. `rest` (presence flags and control words, which only need to stay positive) is appended
/// uncast-then-cast without scaling; for an average it is divided by the world size like the
/// values (`divide`).
pub(crate) fn to_wire(
    values: Tensor<1>,
    rest: Tensor<1>,
    wire: Wire,
    compression: GradientCompression,
    divide: f32,
) -> Tensor<1> {
    match (wire, compression.wire_dtype()) {
        (Wire::Half { factor, .. }, Some(dtype)) => {
            let rest = if divide == 1.0 {
                rest
            } else {
                rest.div_scalar(divide)
            };
            Tensor::cat(vec![values.mul_scalar(factor), rest], 0).cast(dtype)
        }
        _ => Tensor::cat(vec![values, rest], 0),
    }
}

/// A reduced wire tensor back as `f32`: the first `numel` elements divided by the scale.
pub(crate) fn from_wire(wire_tensor: Tensor<1>, wire: Wire, numel: usize) -> Tensor<1> {
    match wire {
        Wire::F32 => wire_tensor,
        Wire::Half { scale, .. } => {
            let reduced = wire_tensor.cast(FloatDType::F32);
            if scale == 1.0 || numel == 0 {
                return reduced;
            }
            let len = reduced.dims()[0];
            let values = reduced.clone().slice(0..numel).div_scalar(scale);
            if len == numel {
                values
            } else {
                Tensor::cat(vec![values, reduced.slice(numel..len)], 0)
            }
        }
    }
}

/// Rank `rank`'s test gradients: `len` values of mixed sign around `magnitude` (from 1/16 to 1
/// times it), different on every rank. For the crate's unit tests.
#[cfg(test)]
pub(crate) fn test_gradients(rank: usize, len: usize, magnitude: f32) -> Vec<f32> {
    (0..len)
        .map(|i| {
            let x = ((i * 37 + rank * 101) % 211) as f32 / 211.0;
            let sign = if (i + rank).is_multiple_of(3) {
                -1.0
            } else {
                1.0
            };
            sign * magnitude * (0.0625 + 0.9375 * x)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{DType, Device};

    use super::test_gradients as gradients;

    /// An all-reduce on the wire: every rank's bucket prepared with the wire the ranks agree on,
    /// summed in the wire dtype one rank after the other (each addition rounded, as a ring
    /// does), and brought back. `Err` when the bucket goes as `f32`.
    fn all_reduce(
        inputs: &[Vec<f32>],
        op: ReduceOp,
        compression: GradientCompression,
    ) -> Result<Vec<f32>, Fallback> {
        let device = Device::flex();
        let n = inputs.len();
        let max = inputs.iter().flatten().fold(0f32, |m, v| m.max(v.abs()));
        let min = inputs
            .iter()
            .flatten()
            .filter(|v| **v != 0.0)
            .fold(f32::INFINITY, |m, v| m.min(v.abs()));
        let wire = choose_wire(compression, op, n, max, min)?;
        let divide = if op == ReduceOp::Avg { n as f32 } else { 1.0 };
        let mut acc: Option<Tensor<1>> = None;
        for values in inputs {
            let bucket = Tensor::<1>::from_floats(values.as_slice(), &device);
            let flag = Tensor::<1>::from_floats([1.0f32], &device);
            let on_wire = to_wire(bucket, flag, wire, compression, divide);
            if let Some(dtype) = compression.wire_dtype() {
                assert_eq!(on_wire.dtype(), DType::from(dtype));
            }
            acc = Some(match acc {
                None => on_wire,
                Some(acc) => acc + on_wire,
            });
        }
        let len = inputs[0].len();
        let out = from_wire(acc.unwrap(), wire, len);
        assert_eq!(out.dtype(), DType::F32);
        let out = out.into_data().try_to_vec::<f32>().unwrap();
        // The flag (the ranks' presence) stays positive.
        assert!(out[len] > 0.0, "{}", out[len]);
        Ok(out[..len].to_vec())
    }

    /// Every element within `roundings` roundings of `eps` of the exact result, relative to the
    /// magnitudes that were summed (a sum of values of both signs is not known better than that).
    fn assert_within(got: &[f32], inputs: &[Vec<f32>], op: ReduceOp, eps: f64, what: &str) {
        let n = inputs.len() as f64;
        for (i, &g) in got.iter().enumerate() {
            let exact: f64 = inputs.iter().map(|r| f64::from(r[i])).sum();
            let magnitude: f64 = inputs.iter().map(|r| f64::from(r[i]).abs()).sum();
            let (exact, magnitude) = if op == ReduceOp::Avg {
                (exact / n, magnitude / n)
            } else {
                (exact, magnitude)
            };
            let roundings = 2.0 * n;
            assert!(
                (f64::from(g) - exact).abs() <= roundings * eps * magnitude,
                "{what}: element {i}: {g} vs {exact} (magnitude {magnitude})"
            );
        }
    }

    #[test]
    fn compressed_averages_match_f32_within_the_wire_rounding() {
        for n in [2usize, 4, 8] {
            let inputs: Vec<Vec<f32>> = (0..n).map(|r| gradients(r, 1000, 8.0)).collect();
            for (compression, eps) in [
                (GradientCompression::Bf16, 2f64.powi(-8)),
                (GradientCompression::F16, 2f64.powi(-11)),
            ] {
                let got = all_reduce(&inputs, ReduceOp::Avg, compression).unwrap();
                assert_within(
                    &got,
                    &inputs,
                    ReduceOp::Avg,
                    eps,
                    &format!("{compression:?}"),
                );
                // And the compression does round: not bit-equal to the f32 path.
                let plain = all_reduce(&inputs, ReduceOp::Avg, GradientCompression::None).unwrap();
                assert_ne!(got, plain, "{compression:?} n={n}");
            }
        }
    }

    #[test]
    fn large_and_tiny_buckets_keep_the_16_bit_rounding_per_element() {
        // 2e5 overflows f16 (65,504), 1e-9 is below its smallest subnormal (6e-8); 1e-38 is
        // near f32's and bf16's smallest normal, 3e38 near their largest value.
        let cases = [
            (GradientCompression::F16, 2e5f32, 2f64.powi(-11)),
            (GradientCompression::F16, 1e-9, 2f64.powi(-11)),
            (GradientCompression::Bf16, 3e37, 2f64.powi(-8)),
            (GradientCompression::Bf16, 1e-36, 2f64.powi(-8)),
        ];
        for (compression, magnitude, eps) in cases {
            for n in [2usize, 8] {
                for op in [ReduceOp::Avg, ReduceOp::Sum] {
                    let inputs: Vec<Vec<f32>> =
                        (0..n).map(|r| gradients(r, 500, magnitude)).collect();
                    let got = all_reduce(&inputs, op, compression).unwrap();
                    let what = format!("{compression:?} {magnitude:e} n={n} {op}");
                    assert!(got.iter().all(|v| v.is_finite() && *v != 0.0), "{what}");
                    assert_within(&got, &inputs, op, eps, &what);
                }
            }
        }
    }

    #[test]
    fn a_bucket_wider_than_the_format_goes_as_f32_and_non_finite_values_too() {
        // 1e-9 and 2e5 in one bucket: 2e14 apart, more than f16's normal range.
        let inputs = vec![gradients(0, 100, 2e5), gradients(1, 100, 1e-9)];
        assert_eq!(
            all_reduce(&inputs, ReduceOp::Avg, GradientCompression::F16),
            Err(Fallback::Range)
        );
        // bf16 covers it.
        let got = all_reduce(&inputs, ReduceOp::Avg, GradientCompression::Bf16).unwrap();
        assert_within(&got, &inputs, ReduceOp::Avg, 2f64.powi(-8), "bf16 wide");
        for compression in [GradientCompression::F16, GradientCompression::Bf16] {
            let max = f32::NAN;
            assert_eq!(
                choose_wire(compression, ReduceOp::Avg, 2, max, 1.0),
                Err(Fallback::NonFinite)
            );
            assert_eq!(
                choose_wire(compression, ReduceOp::Avg, 2, f32::INFINITY, 1.0),
                Err(Fallback::NonFinite)
            );
        }
        // Zeros alone are fine.
        assert!(matches!(
            choose_wire(
                GradientCompression::F16,
                ReduceOp::Avg,
                4,
                0.0,
                f32::INFINITY
            ),
            Ok(Wire::Half { scale: 1.0, .. })
        ));
    }

    #[test]
    fn no_compression_leaves_the_bucket_alone() {
        let inputs = vec![vec![1.5f32, -2.0], vec![0.5, 4.0]];
        assert_eq!(
            choose_wire(GradientCompression::None, ReduceOp::Avg, 2, 4.0, 0.5),
            Ok(Wire::F32)
        );
        let got = all_reduce(&inputs, ReduceOp::Sum, GradientCompression::None).unwrap();
        assert_eq!(got, vec![2.0, 2.0]);
        assert_eq!(GradientCompression::Bf16.element_bytes(), 2);
        // The scale is a power of two and the factor folds in the average.
        let Ok(Wire::Half { scale, factor }) =
            choose_wire(GradientCompression::F16, ReduceOp::Avg, 4, 3.0, 0.5)
        else {
            panic!("expected a half wire");
        };
        assert_eq!(scale.log2().fract(), 0.0);
        assert_eq!(factor, scale / 4.0);
        // 4 ranks of 3.0 / 4 * scale must sum to at most half of 65,504, and not much less.
        let sum = 4.0 * 3.0 / 4.0 * f64::from(scale);
        assert!(sum <= 65_504.0 / 2.0 && sum > 65_504.0 / 4.0, "{sum}");
    }
}
