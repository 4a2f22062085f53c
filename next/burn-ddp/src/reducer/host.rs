//! Host buckets, for the CPU process groups: each bucket's gradients are copied into one
//! contiguous `f32` buffer, the first bucket also carrying the step's bookkeeping (one presence
//! flag per parameter of every bucket, then the control words); the buckets are reduced by the
//! [communication hook](crate::hooks) and copied back into each gradient's own storage.
//!
//! How a gradient reaches its buffer is a [`Transfer`]: on Burn's CPU backends each gradient is
//! copied on its own (a copy in memory, into and out of its own storage); on every other backend
//! (wgpu, CUDA with a host group) each bucket is concatenated on the device with the code the
//! device buckets use, read to the host in one transfer, and written back in one, then sliced on
//! the device: one synchronising transfer each way per bucket, where a read per gradient was one
//! per tensor. The reduction and its checks (NaN guard, clipping norm) run on the host buffers
//! either way, so both give the same bits and a step stays one collective.
//!
//! The buffers live as long as the reducer (PyTorch keeps its bucket tensors too): a fresh
//! bucket-sized allocation every step is returned to the system and faulted in again, which cost
//! more than the all-reduce itself (`cargo xtask bench`, bucket sweep). On backends whose
//! `into_data` and `from_data` move the storage (Flex, NdArray), a step allocates nothing.

use std::sync::Arc;
use std::time::Instant;

use burn::optim::GradientsParams;
use burn::tensor::{Device, Tensor, TensorData};

use super::checks::{Observed, observe_host};
use super::gradients::{Gradients, Transfer, Work, concat_bucket, register_scaled, slice_bucket};
use super::layout::BucketLayout;
use super::link::Link;
use super::options::{Control, ReduceOptions};
use super::scatter::Scatter;
use crate::error::Result;
use crate::hooks::{CommHook, HookStats, HostBucket};
use crate::replica::TensorSpec;

/// The host buckets of a reducer: the hook that reduces them, and the agreed layout's buffers.
pub(super) struct HostBuckets {
    /// How host buckets are reduced.
    hook: Arc<dyn CommHook>,
    /// One buffer per bucket of the agreed layout (gradients, presence flags, control words),
    /// allocated at the first multi-rank step and reused: `4 * (numel + params)` bytes each, plus
    /// the control words.
    buffers: Vec<Vec<f32>>,
    /// The transfer, when not the backend's ([`Transfer::of`]); tests set it.
    forced: Option<Transfer>,
    /// The agreed buckets reduce-scattered by owner under optimizer-state sharding
    /// ([`Scatter`]); `None` without sharding, or with a hook of the user's or compression.
    pub scatter: Option<Scatter>,
}

/// One phase's buckets, flattened and then reduced.
pub(super) struct HostPhase {
    /// Per bucket: values; the first bucket then holds the flags and control words.
    pub buffers: Vec<Vec<f32>>,
    /// Per bucket and parameter: this rank's gradient storage, refilled with the reduced values
    /// ([`Transfer::PerTensor`]; `None` per bucket).
    datas: Vec<Vec<Option<TensorData>>>,
    /// How the buckets came from the device, and go back.
    transfer: Transfer,
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

impl HostBuckets {
    pub fn new(hook: Arc<dyn CommHook>) -> Self {
        Self {
            hook,
            buffers: Vec::new(),
            forced: None,
            scatter: None,
        }
    }

    /// The transfer for tensors on `device` (or the one tests forced).
    pub fn transfer(&self, device: &Device) -> Transfer {
        self.forced.unwrap_or_else(|| Transfer::of(device))
    }

    /// Moves gradients by `transfer` whatever the backend (tests: the per-bucket transfer on a
    /// CPU backend).
    #[cfg(test)]
    pub fn force_transfer(&mut self, transfer: Transfer) {
        self.forced = Some(transfer);
    }

    /// Forgets the buffers (the agreed layout changed).
    pub fn clear(&mut self) {
        self.buffers.clear();
        self.scatter.iter_mut().for_each(Scatter::clear);
    }

    /// Keeps `buffers` for the next step of the agreed layout.
    pub fn keep(&mut self, buffers: Vec<Vec<f32>>) {
        self.buffers = buffers;
    }

    /// Reduces `work` with the hook: the agreed layout's buffers are reused when their sizes fit
    /// (another layout's phase gets buffers of its own); the control words go into the first
    /// bucket, after the flags.
    pub fn reduce(
        &mut self,
        link: &mut Link,
        work: Work<'_>,
        options: &ReduceOptions,
        device: &Device,
    ) -> Result<HostPhase> {
        let started = Instant::now();
        let Work {
            layout,
            specs,
            taken,
            agreed,
            control,
        } = work;
        let buffers = if agreed {
            std::mem::take(&mut self.buffers)
        } else {
            Vec::new()
        };
        let bucketed = Bucketed {
            layout,
            specs,
            control,
            transfer: self.transfer(device),
        };
        let mut phase = flatten(link, &bucketed, taken, buffers, options, device)?;
        let flattened = Instant::now();
        let stats = self.run_hook(link, layout, &mut phase.buffers, options)?;
        link.stats.flatten += flattened - started;
        link.stats.all_reduce += flattened.elapsed();
        link.stats.buckets += layout.buckets().len() as u64;
        link.stats.bytes += stats.bytes;
        link.stats.uncompressed_buckets += stats.uncompressed_buckets;
        Ok(phase)
    }

    /// Runs the hook over the flattened `buffers`; the reducer reduces the first bucket's
    /// bookkeeping itself, exactly, when the hook does not.
    fn run_hook(
        &self,
        link: &Link,
        layout: &BucketLayout,
        buffers: &mut [Vec<f32>],
        options: &ReduceOptions,
    ) -> Result<HookStats> {
        let mut stats = HookStats::default();
        let whole = self.hook.reduces_bookkeeping();
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
        self.hook.reduce(
            link.group.as_ref(),
            &mut buckets,
            options.op,
            link.timeout,
            &mut stats,
        )?;
        drop(buckets);
        if !whole && let Some(first) = buffers.first_mut() {
            let tail = &mut first[Tail::of(layout).flags..];
            if !tail.is_empty() {
                link.group.all_reduce(tail, options.op, link.timeout)?;
                stats.bytes += tail.len() * 4;
            }
        }
        Ok(stats)
    }
}

/// What a phase's buckets hold and how they move: the layout, the parameters, the control words
/// (first phase only) and the transfer.
#[derive(Clone, Copy)]
struct Bucketed<'a> {
    layout: &'a BucketLayout,
    specs: &'a [TensorSpec],
    control: Option<&'a Control>,
    transfer: Transfer,
}

/// This rank's buckets, not yet reduced: `taken` copied into `buffers` (reused when their sizes
/// fit), weighted, with the presence flags and `control` in the first bucket.
fn flatten(
    link: &mut Link,
    bucketed: &Bucketed<'_>,
    taken: Gradients,
    mut buffers: Vec<Vec<f32>>,
    options: &ReduceOptions,
    device: &Device,
) -> Result<HostPhase> {
    let Bucketed {
        layout,
        specs,
        control,
        transfer,
    } = *bucketed;
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
        if transfer == Transfer::PerBucket {
            let buffer = &mut buffers[bucket_index][..bucket.numel];
            let present = if grads.iter().all(Option::is_none) {
                // Nothing of this rank's to move (a rank without a sample, the end-of-data
                // check): zeros, without a transfer.
                buffer.fill(0.0);
                vec![0.0; bucket.params.len()]
            } else {
                let (values, present) = concat_bucket(bucket, specs, grads, device);
                if let Some(values) = values {
                    read_bucket(link, bucket_index, values, buffer)?;
                }
                present
            };
            for present in present {
                buffers[0][flag] = present;
                flag += 1;
            }
        } else {
            for (j, (&p, grad)) in bucket.params.iter().zip(grads).enumerate() {
                let spec = &specs[p];
                let range = bucket.offsets[j]..bucket.offsets[j] + spec.numel();
                let (present, data) = match grad {
                    Some(grad) => {
                        link.stats.transfers_to_host += 1;
                        let data = grad.into_data().convert::<f32>();
                        let values = data.as_slice::<f32>().map_err(|e| {
                            link.fail_bucket(
                                bucket_index,
                                format!(
                                    "gradient of `{}` is not readable as f32: {e:?}",
                                    spec.path
                                ),
                            )
                        })?;
                        if values.len() != range.len() {
                            return Err(link.fail_bucket(
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
    Ok(HostPhase {
        buffers,
        datas,
        transfer,
        local_non_finite,
    })
}

/// Reads one bucket's concatenated `values` to the host in one transfer, into `buffer`.
///
/// # Errors
/// [`DdpError::Bucket`] (after aborting the group) when the values are not readable as `f32`
/// or not as many as the bucket's.
fn read_bucket(
    link: &mut Link,
    bucket_index: usize,
    values: Tensor<1>,
    buffer: &mut [f32],
) -> Result<()> {
    link.stats.transfers_to_host += 1;
    let data = values.into_data().convert::<f32>();
    let values = data.as_slice::<f32>().map_err(|e| {
        link.fail_bucket(
            bucket_index,
            format!("bucket is not readable as f32: {e:?}"),
        )
    })?;
    if values.len() != buffer.len() {
        return Err(link.fail_bucket(
            bucket_index,
            format!(
                "bucket has {} values, its parameters {}",
                values.len(),
                buffer.len()
            ),
        ));
    }
    buffer.copy_from_slice(values);
    Ok(())
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
    /// rank had a gradient for and those `keep` leaves out. Returns the buffers, for the next
    /// step.
    #[allow(clippy::too_many_arguments)]
    pub fn unflatten(
        self,
        layout: &BucketLayout,
        specs: &[TensorSpec],
        grads: &mut GradientsParams,
        scale: f32,
        keep: Option<&[bool]>,
        device: &Device,
        rank: usize,
    ) -> Result<(Vec<Vec<f32>>, u64)> {
        let tail = Tail::of(layout);
        let mut written = 0;
        let flags: Vec<f32> = self
            .buffers
            .first()
            .map(|b| b[tail.flags..tail.flags + tail.count].to_vec())
            .unwrap_or_default();
        let mut flags = flags.into_iter();
        let buckets = layout.buckets().iter().zip(&self.buffers).zip(self.datas);
        for (bucket_index, ((bucket, buffer), datas)) in buckets.enumerate() {
            if self.transfer == Transfer::PerBucket {
                let bucket_flags: Vec<f32> = flags.by_ref().take(bucket.params.len()).collect();
                if bucket.numel == 0 || bucket_flags.iter().all(|&f| f <= 0.0) {
                    continue;
                }
                let values: Vec<f32> = buffer[..bucket.numel].iter().map(|&v| v * scale).collect();
                let reduced =
                    Tensor::<1>::from_data(TensorData::new(values, [bucket.numel]), device);
                written += 1;
                let mut bucket_flags = bucket_flags.into_iter();
                slice_bucket(bucket, specs, &reduced, &mut bucket_flags, keep, grads);
                continue;
            }
            for ((j, &p), data) in bucket.params.iter().enumerate().zip(datas) {
                // The flag's reduction: positive when any rank had a gradient.
                if flags.next().is_none_or(|f| f <= 0.0) {
                    continue;
                }
                let spec = &specs[p];
                if keep.is_some_and(|keep| !keep.get(spec.index).copied().unwrap_or(true)) {
                    continue;
                }
                let source = &buffer[bucket.offsets[j]..bucket.offsets[j] + spec.numel()];
                register_scaled(grads, spec, data, source, scale, device, rank, bucket_index)?;
                written += 1;
            }
        }
        Ok((self.buffers, written))
    }
}
