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

use burn::prelude::*;
use burn::tensor::TensorData;
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
pub trait DistributedOutput: Sized + Send + 'static {
    /// The device type of the output's tensors.
    type Device: Clone + Send + Sync;

    /// Samples in this output (the batch dimension).
    fn samples(&self) -> usize;

    /// The outputs of one step, in rank order, moved to `device` and joined (see the trait docs).
    /// `parts` is never empty.
    fn join(parts: Vec<Self>, device: &Self::Device) -> Self;

    /// The output as host words (reads the tensors), for [`decode`](Self::decode) in another
    /// process.
    fn encode(&self, words: &mut Vec<u64>);

    /// The output [`encode`](Self::encode) wrote, from the front of `words` (advanced past it),
    /// on `device`.
    ///
    /// # Errors
    /// A message when the words do not hold such an output.
    fn decode(words: &mut &[u64], device: &Self::Device) -> Result<Self, String>;

    /// The output's loss as one number (the mean of its loss tensor; reads it), for the metrics
    /// file ([`DdpConfig::with_metrics_file`](crate::DdpConfig::with_metrics_file)). Default:
    /// `None` (no loss to tell).
    fn loss(&self) -> Option<f64> {
        None
    }
}

/// Joins losses: `[1]`-shaped means into the `[1]`-shaped mean over all the parts' samples,
/// anything else concatenated.
fn join_loss<B: Backend>(parts: Vec<(Tensor<B, 1>, usize)>, device: &B::Device) -> Tensor<B, 1> {
    let per_batch = parts.iter().all(|(loss, _)| loss.dims() == [1]);
    if !per_batch {
        return Tensor::cat(
            parts
                .into_iter()
                .map(|(l, _)| l.to_device(device))
                .collect(),
            0,
        );
    }
    let total: usize = parts.iter().map(|(_, samples)| samples).sum();
    let weighted: Vec<Tensor<B, 1>> = parts
        .into_iter()
        .map(|(loss, samples)| loss.to_device(device).mul_scalar(samples as f64))
        .collect();
    Tensor::cat(weighted, 0)
        .sum()
        .div_scalar(total.max(1) as f64)
}

fn cat<B: Backend, const D: usize, K>(
    parts: Vec<Tensor<B, D, K>>,
    device: &B::Device,
) -> Tensor<B, D, K>
where
    K: burn::tensor::TensorKind<B> + burn::tensor::BasicOps<B>,
{
    Tensor::cat(parts.into_iter().map(|t| t.to_device(device)).collect(), 0)
}

/// Writes a float tensor: its rank, its dims, then its values as `f32`, two per word.
fn put_float<B: Backend, const D: usize>(words: &mut Vec<u64>, tensor: &Tensor<B, D>) {
    let values: Vec<f32> = tensor
        .clone()
        .into_data()
        .convert::<f32>()
        .to_vec()
        .unwrap_or_default();
    words.push(D as u64);
    words.extend(tensor.dims().iter().map(|&d| d as u64));
    words.extend(values.chunks(2).map(|pair| {
        let low = u64::from(pair[0].to_bits());
        let high = pair.get(1).map_or(0, |v| u64::from(v.to_bits()));
        low | (high << 32)
    }));
}

/// Writes an integer tensor: its rank, its dims, then its values as `i64`, one per word.
fn put_int<B: Backend, const D: usize>(words: &mut Vec<u64>, tensor: &Tensor<B, D, Int>) {
    let values: Vec<i64> = tensor
        .clone()
        .into_data()
        .convert::<i64>()
        .to_vec()
        .unwrap_or_default();
    words.push(D as u64);
    words.extend(tensor.dims().iter().map(|&d| d as u64));
    words.extend(values.iter().map(|&v| v as u64));
}

/// Reads the dims written by `put_*`, checking the rank.
fn take_dims<const D: usize>(words: &mut &[u64]) -> Result<[usize; D], String> {
    let (&rank, rest) = words.split_first().ok_or("the words end before a tensor")?;
    if rank != D as u64 || rest.len() < D {
        return Err(format!("expected a tensor of rank {D}, found rank {rank}"));
    }
    let dims: [usize; D] = std::array::from_fn(|i| rest[i] as usize);
    *words = &rest[D..];
    Ok(dims)
}

fn take_float<B: Backend, const D: usize>(
    words: &mut &[u64],
    device: &B::Device,
) -> Result<Tensor<B, D>, String> {
    let dims = take_dims::<D>(words)?;
    let count: usize = dims.iter().product();
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

fn take_int<B: Backend, const D: usize>(
    words: &mut &[u64],
    device: &B::Device,
) -> Result<Tensor<B, D, Int>, String> {
    let dims = take_dims::<D>(words)?;
    let count: usize = dims.iter().product();
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

/// `DistributedOutput` for burn-train's outputs: a loss, an output and targets, all with the
/// batch first.
macro_rules! distributed_output {
    ($ty:ident, $output:ident: $out_dims:literal, $targets:ident: $tgt_dims:literal $(, $int:ident)?) => {
        impl<B: Backend> DistributedOutput for $ty<B> {
            type Device = B::Device;

            fn samples(&self) -> usize {
                self.$output.dims()[0]
            }

            fn join(parts: Vec<Self>, device: &B::Device) -> Self {
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

            fn encode(&self, words: &mut Vec<u64>) {
                put_float(words, &self.loss);
                put_float(words, &self.$output);
                distributed_output!(@put words, &self.$targets $(, $int)?);
            }

            fn loss(&self) -> Option<f64> {
                use burn::tensor::ElementConversion;
                Some(self.loss.clone().mean().into_scalar().elem::<f64>())
            }

            fn decode(words: &mut &[u64], device: &B::Device) -> Result<Self, String> {
                Ok(Self {
                    loss: take_float::<B, 1>(words, device)?,
                    $output: take_float::<B, $out_dims>(words, device)?,
                    $targets: distributed_output!(@take words, device, $tgt_dims $(, $int)?),
                })
            }
        }
    };
    (@put $words:ident, $t:expr) => { put_float($words, $t) };
    (@put $words:ident, $t:expr, int) => { put_int($words, $t) };
    (@take $words:ident, $device:ident, $d:literal) => { take_float::<B, $d>($words, $device)? };
    (@take $words:ident, $device:ident, $d:literal, int) => { take_int::<B, $d>($words, $device)? };
}

distributed_output!(ClassificationOutput, output: 2, targets: 1, int);
distributed_output!(MultiLabelClassificationOutput, output: 2, targets: 2, int);
distributed_output!(RegressionOutput, output: 2, targets: 2);

/// [`DistributedOutput`]'s functions for an output type `O` only known as a type parameter,
/// found by its `TypeId` among burn-train's outputs on backend `B`.
pub(crate) struct Codec<O, B: Backend> {
    pub join: fn(Vec<O>, &B::Device) -> O,
    pub encode: fn(&O, &mut Vec<u64>),
    pub decode: fn(&mut &[u64], &B::Device) -> Result<O, String>,
    pub loss: fn(&O) -> Option<f64>,
    pub samples: fn(&O) -> usize,
}

impl<O, B: Backend> Clone for Codec<O, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<O, B: Backend> Copy for Codec<O, B> {}

/// `O` as `T` (the same type, checked by the caller through `TypeId`).
fn cast<O: 'static, T: 'static>(value: O) -> T {
    match (Box::new(value) as Box<dyn Any>).downcast::<T>() {
        Ok(value) => *value,
        // Impossible: `cast` is only reached through a `Codec` that `codec_of` built after
        // checking `TypeId::of::<T>() == TypeId::of::<O>()`, so the downcast cannot fail.
        Err(_) => unreachable!("cast between types with different TypeIds"),
    }
}

fn join_as<T: DistributedOutput, O: 'static>(parts: Vec<O>, device: &T::Device) -> O {
    cast::<T, O>(T::join(
        parts.into_iter().map(cast::<O, T>).collect(),
        device,
    ))
}

fn encode_as<T: DistributedOutput, O: 'static>(output: &O, words: &mut Vec<u64>) {
    if let Some(output) = (output as &dyn Any).downcast_ref::<T>() {
        output.encode(words);
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
    device: &T::Device,
) -> Result<O, String> {
    T::decode(words, device).map(cast::<T, O>)
}

fn codec_of<T, O, B>() -> Option<Codec<O, B>>
where
    T: DistributedOutput<Device = B::Device>,
    O: 'static,
    B: Backend,
{
    (TypeId::of::<T>() == TypeId::of::<O>()).then_some(Codec {
        join: join_as::<T, O>,
        encode: encode_as::<T, O>,
        decode: decode_as::<T, O>,
        loss: loss_as::<T, O>,
        samples: samples_as::<T, O>,
    })
}

/// The codec of `O` if it is one of burn-train's outputs on backend `B`.
pub(crate) fn codec<O: 'static, B: Backend>() -> Option<Codec<O, B>> {
    codec_of::<ClassificationOutput<B>, O, B>()
        .or_else(codec_of::<MultiLabelClassificationOutput<B>, O, B>)
        .or_else(codec_of::<RegressionOutput<B>, O, B>)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::NdArray;

    type B = NdArray;

    fn classification(losses: f32, rows: &[[f32; 3]], targets: &[i64]) -> ClassificationOutput<B> {
        let device = Default::default();
        let flat: Vec<f32> = rows.iter().flatten().copied().collect();
        ClassificationOutput {
            loss: Tensor::from_data([losses], &device),
            output: Tensor::from_data(TensorData::new(flat, [rows.len(), 3]), &device),
            targets: Tensor::from_data(TensorData::new(targets.to_vec(), [targets.len()]), &device),
        }
    }

    #[test]
    fn joining_concatenates_and_takes_the_mean_loss_of_the_global_batch() {
        let a = classification(1.0, &[[1.0, 2.0, 3.0]], &[2]);
        let b = classification(
            4.0,
            &[[4.0, 5.0, 6.0], [7.0, 8.0, 9.0], [0.5, 0.0, 1.5]],
            &[0, 1, 2],
        );
        let joined = ClassificationOutput::join(vec![a, b], &Default::default());
        assert_eq!(joined.samples(), 4);
        // Mean over the 4 samples: (1 * 1 + 4 * 3) / 4, as one batch of 4 would have it, and
        // of shape [1], so burn-train counts the joined item once, as one device's batch.
        let loss: Vec<f32> = joined.loss.clone().into_data().to_vec().unwrap();
        assert_eq!(loss, vec![3.25]);
        let targets: Vec<i64> = joined
            .targets
            .into_data()
            .convert::<i64>()
            .to_vec()
            .unwrap();
        assert_eq!(targets, vec![2, 0, 1, 2]);
        assert_eq!(joined.output.dims(), [4, 3]);
    }

    #[test]
    fn encoding_round_trips_through_the_codec_of_an_unnamed_type() {
        fn through<O: 'static>(output: O) -> O {
            let codec = codec::<O, B>().expect("a burn-train output has a codec");
            let mut words = Vec::new();
            (codec.encode)(&output, &mut words);
            (codec.encode)(&output, &mut words);
            let mut rest = words.as_slice();
            let first = (codec.decode)(&mut rest, &Default::default()).unwrap();
            let _second = (codec.decode)(&mut rest, &Default::default()).unwrap();
            assert!(rest.is_empty(), "{} words left", rest.len());
            first
        }
        let make = || classification(0.75, &[[1.5, -2.0, 3.25], [0.1, 0.2, 0.3]], &[7, -1]);
        let (original, copy) = (make(), through(make()));
        for (a, b) in [
            (
                original.loss.clone().into_data(),
                copy.loss.clone().into_data(),
            ),
            (
                original.output.clone().into_data(),
                copy.output.clone().into_data(),
            ),
            (
                original.targets.clone().into_data().convert::<i64>(),
                copy.targets.clone().into_data().convert::<i64>(),
            ),
        ] {
            assert_eq!(a, b);
        }
        let make = || RegressionOutput::<B> {
            loss: Tensor::from_data([0.5], &Default::default()),
            output: Tensor::from_data([[1.0, 2.0], [3.0, 4.0]], &Default::default()),
            targets: Tensor::from_data([[1.5, 2.5], [3.5, 4.5]], &Default::default()),
        };
        let (regression, copy) = (make(), through(make()));
        assert_eq!(
            copy.targets.into_data(),
            regression.targets.clone().into_data()
        );
        // Truncated words are an error, not a panic.
        let mut words = Vec::new();
        regression.encode(&mut words);
        let mut short = &words[..words.len() - 1];
        assert!(RegressionOutput::<B>::decode(&mut short, &Default::default()).is_err());
        // Not one of burn-train's outputs: no codec.
        assert!(codec::<String, B>().is_none());
    }
}
