//! The replicas' outputs of one step, joined into the output of the global batch, so that
//! burn-train's metrics, renderer and loggers see one item per step covering every rank's
//! samples (as single-device training on the global batch would), and moved between processes.
//!
//! burn-train's own outputs implement [`DistributedOutput`]: `ClassificationOutput`,
//! `MultiLabelClassificationOutput` and `RegressionOutput`. For another output
//! type the strategy cannot join items: in thread mode each replica's item is reported on its own
//! (every sample is counted, but the renderer sees one item per replica and step), in process
//! mode only rank 0's, and validation runs on rank 0 alone; a warning says so.

use std::any::{Any, TypeId};

use burn::tensor::kind::Basic;
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn::train::{ClassificationOutput, MultiLabelClassificationOutput, RegressionOutput};

/// An output of a training or validation step that burn-ddp can join across replicas and send
/// between processes.
///
/// Joining concatenates along the batch dimension (dimension 0 of every tensor), so the joined
/// output is the output of the global batch. A loss of shape `[1]` (a mean over the replica's
/// batch) becomes the mean over the global batch, still of shape `[1]` (the replicas' means
/// weighted by their samples): burn-train's `LossMetric` counts a `[1]` loss once per item, as it
/// counts one device's batch once, so the epoch's loss equals one device's. A per-sample loss is
/// concatenated.
///
/// Burn 0.22 has no backend type parameter: an output names no device type, and
/// [`join`](Self::join) and [`decode`](Self::decode) take Burn's runtime [`Device`].
pub trait DistributedOutput: Sized + Send + 'static {
    /// Samples in this output (the batch dimension).
    fn samples(&self) -> usize;

    /// The outputs of one step, in rank order, moved to `device` and joined (see the trait docs).
    /// `parts` is never empty.
    fn join(parts: Vec<Self>, device: &Device) -> Self;

    /// Appends the output as host words (reads the tensors), for [`decode`](Self::decode) in
    /// another process. Float tensors travel as `f32` (exact for `f32`, `f16` and `bf16`
    /// outputs), integer tensors as `i64`.
    ///
    /// # Errors
    /// A message when a tensor cannot be read from its device (nothing is appended then).
    fn encode(&self, words: &mut Vec<u64>) -> Result<(), String>;

    /// The output [`encode`](Self::encode) wrote, from the front of `words` (advanced past it),
    /// on `device`.
    ///
    /// # Errors
    /// A message when the words do not hold such an output (too few words, another tensor rank,
    /// dimensions whose product overflows).
    fn decode(words: &mut &[u64], device: &Device) -> Result<Self, String>;

    /// The output's loss as one number (the mean of its loss tensor; reads it), for the metrics
    /// file ([`DdpConfig::with_metrics_file`](crate::DdpConfig::with_metrics_file)). Default:
    /// `None` (no loss to tell); also `None` when the loss cannot be read.
    fn loss(&self) -> Option<f64> {
        None
    }
}

/// Joins losses: `[1]`-shaped means into the `[1]`-shaped mean over all the parts' samples,
/// anything else concatenated.
fn join_loss(parts: Vec<(Tensor<1>, usize)>, device: &Device) -> Tensor<1> {
    let per_batch = parts.iter().all(|(loss, _)| loss.dims() == [1]);
    if !per_batch {
        return cat(parts.into_iter().map(|(loss, _)| loss).collect(), device);
    }
    // A part without samples (a rank without a batch in a short step) weighs nothing; its loss,
    // the mean of nothing, may be NaN, which a weight of 0 would not cancel.
    let total: usize = parts.iter().map(|(_, samples)| samples).sum();
    let parts = match total {
        0 => parts,
        _ => parts
            .into_iter()
            .filter(|(_, samples)| *samples > 0)
            .collect(),
    };
    let weighted: Vec<Tensor<1>> = parts
        .into_iter()
        .map(|(loss, samples)| loss.to_device(device).mul_scalar(samples as f64))
        .collect();
    Tensor::cat(weighted, 0)
        .sum()
        .div_scalar(total.max(1) as f64)
}

fn cat<const D: usize, K: Basic>(parts: Vec<Tensor<D, K>>, device: &Device) -> Tensor<D, K> {
    Tensor::cat(parts.into_iter().map(|t| t.to_device(device)).collect(), 0)
}

/// The tensor's values, read from its device, as `E`.
fn read<const D: usize, K: Basic, E: burn::tensor::Element>(
    tensor: &Tensor<D, K>,
) -> Result<Vec<E>, String> {
    tensor
        .clone()
        .try_into_data()
        .map_err(|e| format!("reading an output tensor: {e:?}"))?
        .convert::<E>()
        .try_to_vec::<E>()
        .map_err(|e| format!("reading an output tensor: {e:?}"))
}

/// Appends a tensor's rank, its dims, then its values (already packed as words).
fn put(words: &mut Vec<u64>, dims: &[usize], values: impl Iterator<Item = u64>) {
    words.push(dims.len() as u64);
    words.extend(dims.iter().map(|&d| d as u64));
    words.extend(values);
}

/// A float tensor: rank, dims, then its values as `f32`, two per word.
fn float_words<const D: usize>(tensor: &Tensor<D>) -> Result<Vec<u64>, String> {
    let values = read::<D, _, f32>(tensor)?;
    let mut words = Vec::with_capacity(1 + D + values.len().div_ceil(2));
    let packed = values.chunks(2).map(|pair| {
        let low = u64::from(pair[0].to_bits());
        let high = pair.get(1).map_or(0, |v| u64::from(v.to_bits()));
        low | (high << 32)
    });
    put(&mut words, &tensor.dims(), packed);
    Ok(words)
}

/// An integer tensor: rank, dims, then its values as `i64`, one per word.
fn int_words<const D: usize>(tensor: &Tensor<D, Int>) -> Result<Vec<u64>, String> {
    let values = read::<D, _, i64>(tensor)?;
    let mut words = Vec::with_capacity(1 + D + values.len());
    put(&mut words, &tensor.dims(), values.iter().map(|&v| v as u64));
    Ok(words)
}

/// Reads the dims written by `put`, checking the rank; with their number of values.
fn take_dims<const D: usize>(words: &mut &[u64]) -> Result<([usize; D], usize), String> {
    let (&rank, rest) = words.split_first().ok_or("the words end before a tensor")?;
    if rank != D as u64 {
        return Err(format!("expected a tensor of rank {D}, found rank {rank}"));
    }
    if rest.len() < D {
        return Err(format!(
            "the words end inside the dimensions of a tensor of rank {D}"
        ));
    }
    let mut dims = [0usize; D];
    let mut count = 1usize;
    for (dim, &word) in dims.iter_mut().zip(rest) {
        *dim = usize::try_from(word).map_err(|_| format!("a dimension of {word}"))?;
        count = count
            .checked_mul(*dim)
            .ok_or_else(|| format!("dimensions {:?} overflow", &rest[..D]))?;
    }
    *words = &rest[D..];
    Ok((dims, count))
}

fn take_float<const D: usize>(words: &mut &[u64], device: &Device) -> Result<Tensor<D>, String> {
    let (dims, count) = take_dims::<D>(words)?;
    let packed = count.div_ceil(2);
    if words.len() < packed {
        return Err(format!(
            "{count} values announced, {} words left",
            words.len()
        ));
    }
    let values: Vec<f32> = (0..count)
        .map(|i| f32::from_bits((words[i / 2] >> (32 * (i % 2))) as u32))
        .collect();
    *words = &words[packed..];
    Ok(Tensor::from_data(TensorData::new(values, dims), device))
}

fn take_int<const D: usize>(words: &mut &[u64], device: &Device) -> Result<Tensor<D, Int>, String> {
    let (dims, count) = take_dims::<D>(words)?;
    if words.len() < count {
        return Err(format!(
            "{count} values announced, {} words left",
            words.len()
        ));
    }
    let values: Vec<i64> = words[..count].iter().map(|&w| w as i64).collect();
    *words = &words[count..];
    Ok(Tensor::from_data(TensorData::new(values, dims), device))
}

/// Whether a decoded output's parts belong together: as many targets as outputs, and a loss of
/// one value (the batch's mean) or one per sample.
fn fits(losses: usize, outputs: usize, targets: usize) -> Result<(), String> {
    if targets != outputs {
        return Err(format!("{outputs} outputs but {targets} targets"));
    }
    if losses != 1 && losses != outputs {
        return Err(format!("{losses} losses for {outputs} samples"));
    }
    Ok(())
}

/// The mean of a loss tensor, read; `None` when it cannot be read.
fn mean_loss(loss: &Tensor<1>) -> Option<f64> {
    read::<1, _, f64>(&loss.clone().mean())
        .ok()?
        .first()
        .copied()
}

/// `DistributedOutput` for burn-train's outputs: a loss, an output and targets, all with the
/// batch first.
macro_rules! distributed_output {
    ($ty:ident, $output:ident: $out_dims:literal, $targets:ident: $tgt_dims:literal, $put:ident, $take:ident) => {
        impl DistributedOutput for $ty {
            fn samples(&self) -> usize {
                self.$output.dims()[0]
            }

            fn join(parts: Vec<Self>, device: &Device) -> Self {
                let mut losses = Vec::with_capacity(parts.len());
                let mut outputs = Vec::with_capacity(parts.len());
                let mut targets = Vec::with_capacity(parts.len());
                for part in parts {
                    let samples = part.samples();
                    losses.push((part.loss, samples));
                    outputs.push(part.$output);
                    targets.push(part.$targets);
                }
                Self {
                    loss: join_loss(losses, device),
                    $output: cat(outputs, device),
                    $targets: cat(targets, device),
                }
            }

            fn encode(&self, words: &mut Vec<u64>) -> Result<(), String> {
                // Every tensor read before anything is appended: a failed read leaves `words`.
                let loss = float_words(&self.loss)?;
                let output = float_words(&self.$output)?;
                let targets = $put(&self.$targets)?;
                words.extend(loss.into_iter().chain(output).chain(targets));
                Ok(())
            }

            fn decode(words: &mut &[u64], device: &Device) -> Result<Self, String> {
                let decoded = Self {
                    loss: take_float::<1>(words, device)?,
                    $output: take_float::<$out_dims>(words, device)?,
                    $targets: $take::<$tgt_dims>(words, device)?,
                };
                fits(
                    decoded.loss.dims()[0],
                    decoded.$output.dims()[0],
                    decoded.$targets.dims()[0],
                )?;
                Ok(decoded)
            }

            fn loss(&self) -> Option<f64> {
                mean_loss(&self.loss)
            }
        }
    };
}

distributed_output!(ClassificationOutput, output: 2, targets: 1, int_words, take_int);
distributed_output!(MultiLabelClassificationOutput, output: 2, targets: 2, int_words, take_int);
distributed_output!(RegressionOutput, output: 2, targets: 2, float_words, take_float);

/// [`DistributedOutput`]'s functions for an output type `O` only known as a type parameter,
/// found by its `TypeId` among burn-train's outputs.
pub(crate) struct Codec<O> {
    pub join: fn(Vec<O>, &Device) -> O,
    pub encode: fn(&O, &mut Vec<u64>) -> Result<(), String>,
    pub decode: fn(&mut &[u64], &Device) -> Result<O, String>,
    pub loss: fn(&O) -> Option<f64>,
    pub samples: fn(&O) -> usize,
}

impl<O> Clone for Codec<O> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<O> Copy for Codec<O> {}

/// `O` as `T` (the same type, checked by the caller through `TypeId`).
fn cast<O: 'static, T: 'static>(value: O) -> T {
    match (Box::new(value) as Box<dyn Any>).downcast::<T>() {
        Ok(value) => *value,
        // Impossible: `cast` is only reached through a `Codec` that `codec_of` built after
        // checking `TypeId::of::<T>() == TypeId::of::<O>()`, so the downcast cannot fail.
        Err(_) => unreachable!("cast between types with different TypeIds"),
    }
}

fn join_as<T: DistributedOutput, O: 'static>(parts: Vec<O>, device: &Device) -> O {
    cast::<T, O>(T::join(
        parts.into_iter().map(cast::<O, T>).collect(),
        device,
    ))
}

fn encode_as<T: DistributedOutput, O: 'static>(
    output: &O,
    words: &mut Vec<u64>,
) -> Result<(), String> {
    match (output as &dyn Any).downcast_ref::<T>() {
        Some(output) => output.encode(words),
        // Unreachable through `codec_of` (same TypeId), but an error rather than nothing sent.
        None => Err("an output of another type than its codec's".into()),
    }
}

fn samples_as<T: DistributedOutput, O: 'static>(output: &O) -> usize {
    (output as &dyn Any)
        .downcast_ref::<T>()
        .map_or(0, DistributedOutput::samples)
}

fn loss_as<T: DistributedOutput, O: 'static>(output: &O) -> Option<f64> {
    (output as &dyn Any).downcast_ref::<T>()?.loss()
}

fn decode_as<T: DistributedOutput, O: 'static>(
    words: &mut &[u64],
    device: &Device,
) -> Result<O, String> {
    T::decode(words, device).map(cast::<T, O>)
}

fn codec_of<T: DistributedOutput, O: 'static>() -> Option<Codec<O>> {
    (TypeId::of::<T>() == TypeId::of::<O>()).then_some(Codec {
        join: join_as::<T, O>,
        encode: encode_as::<T, O>,
        decode: decode_as::<T, O>,
        loss: loss_as::<T, O>,
        samples: samples_as::<T, O>,
    })
}

/// The codec of `O` if it is one of burn-train's outputs.
pub(crate) fn codec<O: 'static>() -> Option<Codec<O>> {
    codec_of::<ClassificationOutput, O>()
        .or_else(codec_of::<MultiLabelClassificationOutput, O>)
        .or_else(codec_of::<RegressionOutput, O>)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn device() -> Device {
        crate::replica::tests::test_device()
    }

    fn classification(loss: f32, rows: &[[f32; 3]], targets: &[i64]) -> ClassificationOutput {
        let device = device();
        let flat: Vec<f32> = rows.iter().flatten().copied().collect();
        ClassificationOutput {
            loss: Tensor::from_data([loss], &device),
            output: Tensor::from_data(TensorData::new(flat, [rows.len(), 3]), &device),
            targets: Tensor::from_data(TensorData::new(targets.to_vec(), [targets.len()]), &device),
        }
    }

    fn values<const D: usize, K: Basic, E: burn::tensor::Element>(t: &Tensor<D, K>) -> Vec<E> {
        read::<D, K, E>(t).unwrap()
    }

    #[test]
    fn joining_concatenates_and_takes_the_mean_loss_of_the_global_batch() {
        let a = classification(1.0, &[[1.0, 2.0, 3.0]], &[2]);
        let b = classification(
            4.0,
            &[[4.0, 5.0, 6.0], [7.0, 8.0, 9.0], [0.5, 0.0, 1.5]],
            &[0, 1, 2],
        );
        let joined = ClassificationOutput::join(vec![a, b], &device());
        assert_eq!(joined.samples(), 4);
        // Mean over the 4 samples: (1 * 1 + 4 * 3) / 4, as one batch of 4 would have it, and
        // of shape [1], so burn-train counts the joined item once, as one device's batch.
        assert_eq!(joined.loss.dims(), [1]);
        assert_eq!(values::<1, _, f32>(&joined.loss), vec![3.25]);
        assert_eq!(joined.loss(), Some(3.25));
        assert_eq!(values::<1, _, i64>(&joined.targets), vec![2, 0, 1, 2]);
        assert_eq!(joined.output.dims(), [4, 3]);
        assert_eq!(
            values::<2, _, f32>(&joined.output)[3..6],
            [4.0, 5.0, 6.0],
            "rank 1's rows follow rank 0's"
        );
        // Per-sample losses are concatenated, not averaged.
        let per_sample = |losses: &[f32], rows: usize| RegressionOutput {
            loss: Tensor::from_data(TensorData::new(losses.to_vec(), [rows]), &device()),
            output: Tensor::zeros([rows, 1], &device()),
            targets: Tensor::zeros([rows, 1], &device()),
        };
        let joined = RegressionOutput::join(
            vec![per_sample(&[1.0], 1), per_sample(&[2.0, 3.0], 2)],
            &device(),
        );
        assert_eq!(values::<1, _, f32>(&joined.loss), vec![1.0, 2.0, 3.0]);
    }

    #[test]
    fn encoding_round_trips_through_the_codec_of_an_unnamed_type() {
        fn through<O: 'static>(output: O) -> O {
            let codec = codec::<O>().expect("a burn-train output has a codec");
            let mut words = Vec::new();
            (codec.encode)(&output, &mut words).unwrap();
            (codec.encode)(&output, &mut words).unwrap();
            let mut rest = words.as_slice();
            let first = (codec.decode)(&mut rest, &device()).unwrap();
            let _second = (codec.decode)(&mut rest, &device()).unwrap();
            assert!(rest.is_empty(), "{} words left", rest.len());
            assert_eq!((codec.samples)(&first), (codec.samples)(&output));
            first
        }
        let make = || classification(0.75, &[[1.5, -2.0, 3.25], [0.1, 0.2, 0.3]], &[7, -1]);
        let (original, copy) = (make(), through(make()));
        assert_eq!(
            values::<1, _, f32>(&copy.loss),
            values::<1, _, f32>(&original.loss)
        );
        assert_eq!(
            values::<2, _, f32>(&copy.output),
            values::<2, _, f32>(&original.output)
        );
        assert_eq!(values::<1, _, i64>(&copy.targets), vec![7, -1]);

        let make = || MultiLabelClassificationOutput {
            loss: Tensor::from_data([0.25], &device()),
            output: Tensor::from_data([[0.5, -0.5, 1.0]], &device()),
            targets: Tensor::from_data([[1i64, 0, 1]], &device()),
        };
        let copy = through(make());
        assert_eq!(values::<2, _, i64>(&copy.targets), vec![1, 0, 1]);

        let make = || RegressionOutput {
            loss: Tensor::from_data([0.5], &device()),
            output: Tensor::from_data([[1.0, 2.0], [3.0, 4.0]], &device()),
            targets: Tensor::from_data([[1.5, 2.5], [3.5, 4.5]], &device()),
        };
        let (regression, copy) = (make(), through(make()));
        assert_eq!(
            values::<2, _, f32>(&copy.targets),
            values::<2, _, f32>(&regression.targets)
        );
        // Not one of burn-train's outputs: no codec.
        assert!(codec::<String>().is_none());
    }

    #[test]
    fn words_that_hold_no_such_output_are_an_error_not_a_panic() {
        let regression = RegressionOutput {
            loss: Tensor::from_data([0.5], &device()),
            output: Tensor::from_data([[1.0, 2.0], [3.0, 4.0]], &device()),
            targets: Tensor::from_data([[1.5, 2.5], [3.5, 4.5]], &device()),
        };
        let mut words = Vec::new();
        regression.encode(&mut words).unwrap();
        // Truncated.
        for cut in [0, 1, 3, words.len() - 1] {
            let mut short = &words[..cut];
            assert!(
                RegressionOutput::decode(&mut short, &device()).is_err(),
                "cut at {cut}"
            );
        }
        // A classification's words read as a regression: the targets' rank differs.
        let mut classification_words = Vec::new();
        classification(1.0, &[[1.0, 2.0, 3.0]], &[0])
            .encode(&mut classification_words)
            .unwrap();
        let mut rest = classification_words.as_slice();
        let Err(err) = RegressionOutput::decode(&mut rest, &device()) else {
            panic!("a classification's words decoded as a regression");
        };
        assert!(err.contains("rank 2, found rank 1"), "{err}");
        // Dimensions whose product overflows: an error before any allocation.
        let mut hostile: &[u64] = &[2, u64::MAX, 3];
        let Err(err) = take_float::<2>(&mut hostile, &device()) else {
            panic!("dimensions of u64::MAX decoded");
        };
        assert!(
            err.contains("overflow") || err.contains("dimension"),
            "{err}"
        );
        // Parts that do not belong together: 2 outputs, 1 target.
        let mut words = Vec::new();
        put(&mut words, &[1], [0.5f32.to_bits() as u64].into_iter());
        // Two f32 values packed in one word.
        put(&mut words, &[2, 1], [0u64].into_iter());
        put(&mut words, &[1], [3u64].into_iter());
        let mut rest = words.as_slice();
        let Err(err) = ClassificationOutput::decode(&mut rest, &device()) else {
            panic!("2 outputs with 1 target decoded");
        };
        assert!(err.contains("2 outputs but 1 targets"), "{err}");
        let mut cut: &[u64] = &[2, 5];
        let err = take_dims::<2>(&mut cut).unwrap_err();
        assert!(err.contains("end inside the dimensions"), "{err}");
        let mut hostile: &[u64] = &[2, 1 << 40, 1 << 40];
        let Err(err) = take_int::<2>(&mut hostile, &device()) else {
            panic!("dimensions whose product overflows decoded");
        };
        assert!(err.contains("overflow"), "{err}");
    }
}
