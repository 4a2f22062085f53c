//! Host buckets, for the CPU process groups: each bucket's gradients are copied into one
//! contiguous `f32` buffer (then one presence flag per parameter, then, in the first bucket, the
//! step's control words), all-reduced, and copied back into each gradient's own storage.
//!
//! The buffers live as long as the reducer (PyTorch keeps its bucket tensors too): a fresh
//! bucket-sized allocation every step is returned to the system and faulted in again, which cost
//! more than the all-reduce itself (`cargo xtask bench`, bucket sweep). On backends whose
//! `into_data` and `from_data` move the storage (Flex, NdArray), a step allocates nothing.

use std::time::Instant;

use burn::optim::GradientsParams;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

use super::checks::{Observed, observe_host};
use super::layout::{BucketLayout, ELEMENT_BYTES};
use super::{Control, Gradients, ReduceOptions, Reducer, register_shaped};
use crate::replica::TensorSpec;
use crate::{DdpError, Result};

/// One phase's buckets after the all-reduce.
pub(super) struct HostPhase {
    /// Per bucket: reduced values, then flags, then (first bucket) control words.
    pub buffers: Vec<Vec<f32>>,
    /// Per bucket and parameter: this rank's gradient storage, refilled with the reduced values.
    datas: Vec<Vec<Option<TensorData>>>,
    /// This rank's own gradients held NaN or infinity (checked with `check_finite`).
    pub local_non_finite: bool,
}

impl Reducer {
    /// All-reduces `taken` (per bucket of `layout`, per parameter: this rank's flat gradient) in
    /// host buffers, reusing `buffers` when their sizes fit. `control` goes into the first bucket.
    pub(super) fn reduce_host<B: Backend>(
        &mut self,
        layout: &BucketLayout,
        specs: &[TensorSpec],
        taken: Gradients<B>,
        mut buffers: Vec<Vec<f32>>,
        control: Option<Control>,
        options: &ReduceOptions,
    ) -> Result<HostPhase> {
        let sizes: Vec<usize> = layout
            .buckets()
            .iter()
            .enumerate()
            .map(|(i, b)| b.numel + b.params.len() + control_len(i, control))
            .collect();
        if buffers.len() != sizes.len() || buffers.iter().zip(&sizes).any(|(b, &s)| b.len() != s) {
            buffers = sizes.iter().map(|&s| vec![0.0; s]).collect();
        }
        let mut local_non_finite = false;
        let mut datas = Vec::with_capacity(sizes.len());
        for (bucket_index, (bucket, grads)) in layout.buckets().iter().zip(taken).enumerate() {
            let started = Instant::now();
            let buffer = &mut buffers[bucket_index];
            let mut bucket_datas = Vec::with_capacity(bucket.params.len());
            for (j, (&p, grad)) in bucket.params.iter().zip(grads).enumerate() {
                let spec = &specs[p];
                let range = bucket.offsets[j]..bucket.offsets[j] + spec.numel();
                let data = match grad {
                    Some(grad) => {
                        let data = grad.into_data().convert::<f32>();
                        let values = data.as_slice::<f32>().map_err(|e| {
                            self.fail_bucket(
                                bucket_index,
                                format!(
                                    "gradient of `{}` is not readable as f32: {e:?}",
                                    spec.path
                                ),
                            )
                        })?;
                        if values.len() != range.len() {
                            return Err(self.fail_bucket(
                                bucket_index,
                                format!(
                                    "gradient of `{}` has {} values, the parameter {}",
                                    spec.path,
                                    values.len(),
                                    range.len()
                                ),
                            ));
                        }
                        buffer[range].copy_from_slice(values);
                        buffer[bucket.numel + j] = 1.0;
                        Some(data)
                    }
                    None => {
                        buffer[range].fill(0.0);
                        buffer[bucket.numel + j] = 0.0;
                        None
                    }
                };
                bucket_datas.push(data);
            }
            if let (0, Some(control)) = (bucket_index, control) {
                let at = bucket.numel + bucket.params.len();
                buffer[at..at + control.len()].copy_from_slice(&control.words());
            }
            let flattened = Instant::now();
            let values = &mut buffer[..bucket.numel];
            if options.check_finite {
                local_non_finite |= values.iter().any(|v| !v.is_finite());
            }
            if options.weight != 1.0 {
                values.iter_mut().for_each(|v| *v *= options.weight);
            }
            self.group.all_reduce(buffer, options.op, self.timeout)?;
            self.stats.flatten += flattened - started;
            self.stats.all_reduce += flattened.elapsed();
            self.stats.buckets += 1;
            self.stats.bytes += buffer.len() * ELEMENT_BYTES;
            datas.push(bucket_datas);
        }
        Ok(HostPhase {
            buffers,
            datas,
            local_non_finite,
        })
    }
}

/// Control words in bucket `index` of a phase that carries `control`.
fn control_len(index: usize, control: Option<Control>) -> usize {
    match (index, control) {
        (0, Some(control)) => control.len(),
        _ => 0,
    }
}

impl HostPhase {
    /// The reduced control words of the phase's first bucket.
    pub fn control(&self, layout: &BucketLayout) -> Option<Control> {
        let bucket = layout.buckets().first()?;
        let at = bucket.numel + bucket.params.len();
        Control::from_words(self.buffers.first()?.get(at..)?)
    }

    /// What the reduced values look like, bucket by bucket.
    pub fn observe(&self, layout: &BucketLayout, options: &ReduceOptions) -> Observed {
        observe_host(
            layout
                .buckets()
                .iter()
                .zip(&self.buffers)
                .map(|(b, buffer)| &buffer[..b.numel]),
            options,
        )
    }

    /// Writes the reduced gradients (times `scale`) into `grads`, leaving out the parameters no
    /// rank had a gradient for.
    pub fn unflatten<B: Backend>(
        self,
        layout: &BucketLayout,
        specs: &[TensorSpec],
        grads: &mut GradientsParams,
        scale: f32,
        device: &B::Device,
        rank: usize,
    ) -> Result<Vec<Vec<f32>>> {
        let buckets = layout.buckets().iter().zip(&self.buffers).zip(self.datas);
        for (bucket_index, ((bucket, buffer), datas)) in buckets.enumerate() {
            for ((j, &p), data) in bucket.params.iter().enumerate().zip(datas) {
                // The flag's all-reduce: positive when any rank had a gradient.
                if buffer[bucket.numel + j] <= 0.0 {
                    continue;
                }
                let spec = &specs[p];
                let source = &buffer[bucket.offsets[j]..bucket.offsets[j] + spec.numel()];
                // This rank's own gradient storage when it had one (no allocation), else new.
                let mut data = data
                    .unwrap_or_else(|| TensorData::new(vec![0.0f32; spec.numel()], [spec.numel()]));
                // Readable as f32 above, so writable now; an error here would leave this rank
                // with other gradients than its peers, so it is reported, never skipped.
                let target = data.as_mut_slice::<f32>().map_err(|e| DdpError::Bucket {
                    rank,
                    bucket: bucket_index,
                    detail: format!("cannot write the reduced `{}`: {e:?}", spec.path),
                })?;
                if scale == 1.0 {
                    target.copy_from_slice(source);
                } else {
                    target
                        .iter_mut()
                        .zip(source)
                        .for_each(|(t, &s)| *t = s * scale);
                }
                let flat = Tensor::<B, 1>::from_data(data, device);
                register_shaped::<B>(grads, spec, flat);
            }
        }
        Ok(self.buffers)
    }
}
