//! Gradient compression for the wire: buckets all-reduced as `bf16` or `f16` instead of `f32`,
//! as PyTorch DDP's `bf16_compress_hook` / `fp16_compress_hook` do.
//!
//! Averaging divides by the world size **before** the cast (in `f32`), then sums the 16-bit
//! values and casts the result back to `f32`: dividing first keeps the sum of N gradients inside
//! the 16-bit range (`f16` overflows at 65,504), and the averaged result differs from the `f32`
//! average by the rounding of the 16-bit format only (relative `2^-8` for `bf16`, `2^-11` for
//! `f16`, per addition). Half the bytes travel, which matters where the link, not the device,
//! limits the step.

use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Tensor};
use serde::{Deserialize, Serialize};

use crate::group::ReduceOp;

/// The dtype gradient buckets travel in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub enum GradientCompression {
    /// `f32`: exact (the default).
    #[default]
    None,
    /// `bf16`: `f32`'s range, 8 bits of mantissa.
    Bf16,
    /// `f16`: 11 bits of mantissa, range up to 65,504.
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
}

/// Prepares a flat `f32` bucket for an all-reduce in `compression`'s dtype: for
/// [`ReduceOp::Avg`] it divides by `world_size` first (in `f32`), then casts. Returns the wire
/// tensor and the reduction to run on it ([`ReduceOp::Sum`] after a pre-division).
pub fn compress<B: Backend>(
    bucket: Tensor<B, 1>,
    op: ReduceOp,
    world_size: usize,
    compression: GradientCompression,
) -> (Tensor<B, 1>, ReduceOp) {
    let Some(dtype) = compression.wire_dtype() else {
        return (bucket, op);
    };
    let bucket = match op {
        ReduceOp::Avg if world_size > 1 => bucket.div_scalar(world_size as f32),
        _ => bucket,
    };
    (bucket.cast(dtype), ReduceOp::Sum)
}

/// The reduced wire tensor back as `f32`.
pub fn decompress<B: Backend>(
    wire: Tensor<B, 1>,
    compression: GradientCompression,
) -> Tensor<B, 1> {
    match compression {
        GradientCompression::None => wire,
        _ => wire.cast(FloatDType::F32),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::tensor::DType;

    type B = Flex;

    /// Rank `r`'s gradients: values of mixed sign and magnitude.
    fn gradients(rank: usize, len: usize) -> Vec<f32> {
        (0..len)
            .map(|i| ((i * 37 + rank * 101) % 211) as f32 / 13.0 - 8.0 + rank as f32 * 0.01)
            .collect()
    }

    /// An all-reduce on the wire: the ranks' compressed tensors summed in the wire dtype, one
    /// rank after the other (each addition rounded, as a ring does).
    fn all_reduce(
        n: usize,
        len: usize,
        op: ReduceOp,
        compression: GradientCompression,
    ) -> Vec<f32> {
        let device = Default::default();
        let mut acc: Option<Tensor<B, 1>> = None;
        let mut wire_op = op;
        for rank in 0..n {
            let bucket = Tensor::<B, 1>::from_floats(gradients(rank, len).as_slice(), &device);
            let (wire, on_wire) = compress(bucket, op, n, compression);
            if let Some(dtype) = compression.wire_dtype() {
                assert_eq!(wire.dtype(), DType::from(dtype));
            }
            wire_op = on_wire;
            acc = Some(match acc {
                None => wire,
                Some(acc) => acc + wire,
            });
        }
        let mut reduced = acc.unwrap();
        if wire_op == ReduceOp::Avg {
            reduced = reduced.div_scalar(n as f32);
        }
        let out = decompress(reduced, compression);
        assert_eq!(out.dtype(), DType::F32);
        out.into_data().to_vec::<f32>().unwrap()
    }

    fn reference(n: usize, len: usize, op: ReduceOp) -> Vec<f64> {
        (0..len)
            .map(|i| {
                let sum: f64 = (0..n).map(|r| f64::from(gradients(r, len)[i])).sum();
                if op == ReduceOp::Avg {
                    sum / n as f64
                } else {
                    sum
                }
            })
            .collect()
    }

    #[test]
    fn compressed_averages_match_f32_within_the_wire_rounding() {
        let len = 1000;
        for n in [2usize, 4, 8] {
            let exact = reference(n, len, ReduceOp::Avg);
            for (compression, eps) in [
                (GradientCompression::Bf16, 2f64.powi(-8)),
                (GradientCompression::F16, 2f64.powi(-11)),
            ] {
                let got = all_reduce(n, len, ReduceOp::Avg, compression);
                // One rounding of each input and one per addition, each at most eps of the
                // largest partial sum (|x| <= 8.2, pre-divided by n: partial sums <= 8.2).
                let bound = (2 * n) as f64 * eps * 8.2;
                let worst = got
                    .iter()
                    .zip(&exact)
                    .map(|(&g, &e)| (f64::from(g) - e).abs())
                    .fold(0.0, f64::max);
                assert!(worst <= bound, "{compression:?} n={n}: {worst} > {bound}");
                // And the compression does round: not bit-equal to the f32 path.
                let plain = all_reduce(n, len, ReduceOp::Avg, GradientCompression::None);
                assert_ne!(got, plain, "{compression:?} n={n}");
            }
        }
    }

    #[test]
    fn pre_division_keeps_f16_sums_in_range() {
        // 8 ranks of 10,000: the f16 sum would reach 80,000 (> 65,504, infinity); divided first,
        // the average 10,000 is representable.
        let device = Default::default();
        let n = 8;
        let mut acc: Option<Tensor<B, 1>> = None;
        for _ in 0..n {
            let bucket = Tensor::<B, 1>::from_floats([10_000.0f32, -10_000.0], &device);
            let (wire, op) = compress(bucket, ReduceOp::Avg, n, GradientCompression::F16);
            assert_eq!(op, ReduceOp::Sum);
            acc = Some(match acc {
                None => wire,
                Some(acc) => acc + wire,
            });
        }
        let out = decompress(acc.unwrap(), GradientCompression::F16)
            .into_data()
            .to_vec::<f32>()
            .unwrap();
        // Within f16's rounding of the additions (the partial sums above 4,096 are rounded).
        let bound = (2 * n) as f32 * 2f32.powi(-11) * 10_000.0;
        assert!((out[0] - 10_000.0).abs() <= bound, "{out:?}");
        assert!((out[1] + 10_000.0).abs() <= bound, "{out:?}");
        // Without the division the f16 sum overflows.
        let wire = Tensor::<B, 1>::from_floats([10_000.0f32], &device).cast(FloatDType::F16);
        let mut sum = wire.clone();
        for _ in 1..n {
            sum = sum + wire.clone();
        }
        let overflowed = sum
            .cast(FloatDType::F32)
            .into_data()
            .to_vec::<f32>()
            .unwrap();
        assert!(overflowed[0].is_infinite());
    }

    #[test]
    fn no_compression_leaves_the_bucket_and_the_op_alone() {
        let device = Default::default();
        let bucket = Tensor::<B, 1>::from_floats([1.5f32, -2.0], &device);
        let (wire, op) = compress(bucket, ReduceOp::Avg, 4, GradientCompression::None);
        assert_eq!(op, ReduceOp::Avg);
        assert_eq!(wire.into_data().to_vec::<f32>().unwrap(), vec![1.5, -2.0]);
        assert_eq!(GradientCompression::Bf16.element_bytes(), 2);
        // Sums are not pre-divided.
        let bucket = Tensor::<B, 1>::from_floats([3.0f32], &device);
        let (wire, op) = compress(bucket, ReduceOp::Sum, 4, GradientCompression::Bf16);
        assert_eq!(op, ReduceOp::Sum);
        let back = decompress(wire, GradientCompression::Bf16);
        assert_eq!(back.into_data().to_vec::<f32>().unwrap(), vec![3.0]);
    }
}
