//! Host buckets, for the CPU process groups: each bucket's gradients are copied into one
//! contiguous `f32` buffer, the first bucket also carrying the step's bookkeeping (one presence
//! flag per parameter of every bucket, then the control words); the buckets are reduced by the
//! [communication hook](crate::hooks) and copied back into each gradient's own storage.
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
use super::layout::BucketLayout;
use super::{Control, Gradients, ReduceOptions, Reducer, register_shaped};
use crate::error::{DdpError, Result};
use crate::hooks::{HookReport, HostBucket};
use crate::replica::TensorSpec;

/// One phase's buckets after the reduction.
pub(super) struct HostPhase {
    /// Per bucket: reduced values; the first bucket then holds the flags and control words.
    pub buffers: Vec<Vec<f32>>,
    /// Per bucket and parameter: this rank's gradient storage, refilled with the reduced values.
    datas: Vec<Vec<Option<TensorData>>>,
    /// This rank's own gradients held NaN or infinity (checked with `check_finite`).
    pub local_non_finite: bool,
}

/// Where the bookkeeping of a phase sits in its first bucket's buffer.
struct Tail {
    /// Index of the first presence flag (the first bucket's gradient count).
    flags: usize,
    /// Number of flags (parameters of every bucket).
    count: usize,
}

impl Tail {
    fn of(layout: &BucketLayout) -> Self {
        Self {
            flags: layout.buckets().first().map_or(0, |b| b.numel),
            count: layout.buckets().iter().map(|b| b.params.len()).sum(),
        }
    }

    fn control(&self) -> usize {
        self.flags + self.count
    }
}

impl Reducer {
    /// Reduces `taken` (per bucket of `layout`, per parameter: this rank's flat gradient) in
    /// host buckets with the reducer's hook, reusing `buffers` when their sizes fit. `control`
    /// goes into the first bucket, after the flags.
    pub(super) fn reduce_host<B: Backend>(
        &mut self,
        layout: &BucketLayout,
        specs: &[TensorSpec],
        taken: Gradients<B>,
        mut buffers: Vec<Vec<f32>>,
        control: Option<&Control>,
        options: &ReduceOptions,
    ) -> Result<HostPhase> {
        let started = Instant::now();
        let tail = Tail::of(layout);
        let control_len = control.map_or(0, |c| c.len());
        let sizes: Vec<usize> = layout
            .buckets()
            .iter()
            .enumerate()
            .map(|(i, b)| b.numel + if i == 0 { tail.count + control_len } else { 0 })
            .collect();
        if buffers.len() != sizes.len() || buffers.iter().zip(&sizes).any(|(b, &s)| b.len() != s) {
            buffers = sizes.iter().map(|&s| vec![0.0; s]).collect();
        }
        let mut local_non_finite = false;
        let mut datas = Vec::with_capacity(sizes.len());
        let mut flag = tail.flags;
        for (bucket_index, (bucket, grads)) in layout.buckets().iter().zip(taken).enumerate() {
            let mut bucket_datas = Vec::with_capacity(bucket.params.len());
            for (j, (&p, grad)) in bucket.params.iter().zip(grads).enumerate() {
                let spec = &specs[p];
                let range = bucket.offsets[j]..bucket.offsets[j] + spec.numel();
                let (present, data) = match grad {
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
                        buffers[bucket_index][range].copy_from_slice(values);
                        (1.0, Some(data))
                    }
                    None => {
                        buffers[bucket_index][range].fill(0.0);
                        (0.0, None)
                    }
                };
                buffers[0][flag] = present;
                flag += 1;
                bucket_datas.push(data);
            }
            let values = &mut buffers[bucket_index][..bucket.numel];
            if options.check_finite {
                local_non_finite |= values.iter().any(|v| !v.is_finite());
            }
            if options.weight != 1.0 {
                values.iter_mut().for_each(|v| *v *= options.weight);
            }
            datas.push(bucket_datas);
        }
        if let Some(control) = control {
            let at = tail.control();
            buffers[0][at..at + control_len].copy_from_slice(&control.words());
        }
        let flattened = Instant::now();
        let mut report = HookReport::default();
        {
            let hook = self.hook.clone();
            // A hook that does not reduce the bookkeeping sees the gradients only; the reducer
            // reduces the first bucket's bookkeeping itself, exactly.
            let whole = hook.reduces_bookkeeping();
            let mut buckets: Vec<HostBucket<'_>> = buffers
                .iter_mut()
                .zip(layout.buckets())
                .enumerate()
                .map(|(index, (buffer, bucket))| HostBucket {
                    index,
                    buffer: if whole {
                        &mut buffer[..]
                    } else {
                        &mut buffer[..bucket.numel]
                    },
                    gradients: bucket.numel,
                })
                .collect();
            hook.reduce(
                self.group.as_ref(),
                &mut buckets,
                options.op,
                self.timeout,
                &mut report,
            )?;
            drop(buckets);
            if !whole && let Some(first) = buffers.first_mut() {
                let tail = &mut first[tail.flags..];
                if !tail.is_empty() {
                    self.group.all_reduce(tail, options.op, self.timeout)?;
                    report.bytes += tail.len() * 4;
                }
            }
        }
        self.stats.flatten += flattened - started;
        self.stats.all_reduce += flattened.elapsed();
        self.stats.buckets += layout.buckets().len() as u64;
        self.stats.bytes += report.bytes;
        self.stats.uncompressed_buckets += report.uncompressed_buckets;
        Ok(HostPhase {
            buffers,
            datas,
            local_non_finite,
        })
    }
}

impl HostPhase {
    /// The reduced control words, with `caller` words of the caller's.
    pub fn control(&self, layout: &BucketLayout, caller: usize) -> Option<Control> {
        let at = Tail::of(layout).control();
        Control::from_words(self.buffers.first()?.get(at..)?, caller)
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
    /// rank had a gradient for. Returns the buffers, for the next step.
    pub fn unflatten<B: Backend>(
        self,
        layout: &BucketLayout,
        specs: &[TensorSpec],
        grads: &mut GradientsParams,
        scale: f32,
        device: &B::Device,
        rank: usize,
    ) -> Result<Vec<Vec<f32>>> {
        let tail = Tail::of(layout);
        let flags: Vec<f32> = self
            .buffers
            .first()
            .map(|b| b[tail.flags..tail.flags + tail.count].to_vec())
            .unwrap_or_default();
        let mut flags = flags.into_iter();
        let buckets = layout.buckets().iter().zip(&self.buffers).zip(self.datas);
        for (bucket_index, ((bucket, buffer), datas)) in buckets.enumerate() {
            for ((j, &p), data) in bucket.params.iter().enumerate().zip(datas) {
                // The flag's reduction: positive when any rank had a gradient.
                if flags.next().is_none_or(|f| f <= 0.0) {
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
