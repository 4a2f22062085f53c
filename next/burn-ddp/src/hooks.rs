//! Communication hooks: how a step's gradient buckets are reduced across the ranks, the seam
//! PyTorch DDP opens with `register_comm_hook`.
//!
//! The [`Reducer`](crate::mechanism::Reducer) flattens a step's gradients into host buckets and
//! hands them all to a [`CommHook`], which must leave every rank with the same reduced values;
//! then the reducer's own steps follow whatever the hook did: the NaN/infinity check and
//! clipping by the global norm, from the reduced values. Two hooks are built in:
//! - [`AllReduce`] (the default): one [`ProcessGroup::all_reduce`] per bucket, exact `f32`;
//! - [`Compress16`]: gradients on the wire as `bf16` or `f16`, half the bytes
//!   ([`DdpConfig::with_gradient_compression`](crate::DdpConfig::with_gradient_compression)
//!   installs it), scaled per bucket so that neither large nor tiny gradients are lost (see
//!   [`CommStats::uncompressed_buckets`](crate::metrics::CommStats::uncompressed_buckets)); a [`TcpGroup`](burn_ddp_comm::group::TcpGroup) sends
//!   the 16-bit values ([`ExtendedCollectives::all_reduce_half`]).
//!
//! A hook of your own ([`DdpConfig::with_comm_hook`](crate::DdpConfig::with_comm_hook)) sees
//! the same buckets: PowerSGD's low-rank approximation is the standard example. Every rank must
//! install the same hook ([`CommHook::name`] is compared at start-up).
//!
//! Hooks reduce host buckets, so they run on the CPU process groups. NCCL's group reduces device
//! buckets in GPU memory with the built-in all-reduce or compression (the same algorithm); a
//! hook of your own with it is refused at start-up.

use std::collections::BTreeSet;
use std::fmt;
use std::sync::Mutex;
use std::time::Duration;

use crate::compress::{Fallback, GradientCompression, Wire, choose_wire};
use crate::error::Result;
use burn_ddp_comm::group::{ExtendedCollectives, HalfFloat, ProcessGroup, ReduceOp};

/// One bucket of a step, as a hook sees it.
#[derive(Debug)]
pub struct HostBucket<'a> {
    /// Its position among the step's buckets (all-reduce order), from 0.
    pub index: usize,
    /// This rank's values: `gradients` `f32` gradients, then, in the first bucket and only for
    /// a hook whose [`reduces_bookkeeping`](CommHook::reduces_bookkeeping) is `true` (the
    /// built-in ones), the reducer's bookkeeping: one presence flag per parameter and the step's
    /// control words, small non-negative integers that must come back exactly reduced (summed,
    /// or averaged with [`ReduceOp::Avg`]). Other hooks get the gradients only.
    pub buffer: &'a mut [f32],
    /// The number of gradient values at the start of `buffer`.
    pub gradients: usize,
}

/// What a hook did in one step, for the reducer's counters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HookStats {
    /// Bytes this rank sent to the all-reduces (what one rank contributes, before the ring's
    /// `2 (N-1)/N` factor).
    pub bytes: usize,
    /// Buckets sent as `f32` although the hook compresses (their values did not fit the
    /// format).
    pub uncompressed_buckets: u64,
}

/// How a step's gradient buckets are reduced (see the [module docs](self)).
///
/// One hook object may serve several ranks of a process at once (replicas that are threads share
/// the configuration): keep per-rank state keyed by [`ProcessGroup::rank`] or per thread, and
/// never hold a lock across a collective (the other ranks' calls would wait for it, and the
/// collective for them).
pub trait CommHook: Send + Sync + fmt::Debug {
    /// A name that identifies the hook and its settings, e.g. `"compress16(bf16)"`: every rank
    /// must use the same hook, which the ranks check at start-up by comparing names.
    fn name(&self) -> String;

    /// Reduces `buckets` across the ranks of `group` in place: afterwards every rank holds the
    /// same values, the element-wise reduction `op` of all ranks' buffers (for a lossy hook, an
    /// approximation of the gradients; the bookkeeping after `gradients` exactly). Every rank
    /// calls it once per step with buckets of the same sizes; every collective must finish
    /// within `timeout`.
    ///
    /// # Errors
    /// The collectives' errors ([`Timeout`](crate::comm::CommError::Timeout),
    /// [`PeerLeft`](crate::comm::CommError::PeerLeft), ...); a hook's own errors as
    /// [`InvalidConfig`](crate::error::DdpError::InvalidConfig) or
    /// [`Bucket`](crate::error::DdpError::Bucket).
    fn reduce(
        &self,
        group: &dyn ProcessGroup,
        buckets: &mut [HostBucket<'_>],
        op: ReduceOp,
        timeout: Duration,
        stats: &mut HookStats,
    ) -> Result<()>;

    /// Whether the hook also reduces the reducer's bookkeeping (presence flags, control words)
    /// after the first bucket's gradients, exactly. Default `false`: the hook sees the
    /// gradients only and the reducer reduces the bookkeeping itself, with one small all-reduce
    /// more per step, so a hook can never leave the ranks disagreeing on which tensors have
    /// gradients or whether to stop.
    fn reduces_bookkeeping(&self) -> bool {
        false
    }
}

/// The default hook: one `f32` all-reduce per bucket, exact (the result is the ranks' sum in
/// ring order, or that divided by the world size).
#[derive(Debug, Clone, Copy, Default)]
pub struct AllReduce;

impl CommHook for AllReduce {
    fn name(&self) -> String {
        "all_reduce".into()
    }

    fn reduces_bookkeeping(&self) -> bool {
        true
    }

    fn reduce(
        &self,
        group: &dyn ProcessGroup,
        buckets: &mut [HostBucket<'_>],
        op: ReduceOp,
        timeout: Duration,
        stats: &mut HookStats,
    ) -> Result<()> {
        for bucket in buckets {
            group.all_reduce(bucket.buffer, op, timeout)?;
            stats.bytes += bucket.buffer.len() * 4;
        }
        Ok(())
    }
}

/// Gradients on the wire as 16-bit floats, half the bytes, like PyTorch's
/// `bf16_compress_hook`/`fp16_compress_hook` but without their overflow and underflow: the
/// ranks agree on every bucket's largest and smallest non-zero magnitude (one all-gather per
/// step, which also carries the bookkeeping, reduced exactly), each bucket is scaled by a power
/// of two that keeps the sum in the format's range, sent with
/// [`ExtendedCollectives::all_reduce_half`], and scaled back. A bucket whose magnitudes span more than
/// the format's normal range goes as `f32` that step, counted and reported once per bucket (see
/// [`CommStats::uncompressed_buckets`](crate::metrics::CommStats::uncompressed_buckets)).
#[derive(Debug)]
pub struct Compress16 {
    format: HalfFloat,
    /// Buckets whose fallback to `f32` was already reported, per rank.
    warned: Mutex<BTreeSet<(usize, usize)>>,
}

thread_local! {
    /// The 16-bit wire buffer of the rank on this thread, kept between steps.
    static WIRE: std::cell::RefCell<Vec<u16>> = const { std::cell::RefCell::new(Vec::new()) };
}

impl Compress16 {
    /// Compression to `format`.
    pub fn new(format: HalfFloat) -> Self {
        Self {
            format,
            warned: Mutex::new(BTreeSet::new()),
        }
    }

    fn compression(&self) -> GradientCompression {
        match self.format {
            HalfFloat::Bf16 => GradientCompression::Bf16,
            HalfFloat::F16 => GradientCompression::F16,
        }
    }
}

impl CommHook for Compress16 {
    fn name(&self) -> String {
        format!("compress16({})", self.format)
    }

    fn reduces_bookkeeping(&self) -> bool {
        true
    }

    fn reduce(
        &self,
        group: &dyn ProcessGroup,
        buckets: &mut [HostBucket<'_>],
        op: ReduceOp,
        timeout: Duration,
        stats: &mut HookStats,
    ) -> Result<()> {
        let n = group.world_size();
        // One all-gather: every bucket's largest and smallest non-zero magnitude, then the
        // bookkeeping (reduced here exactly, in rank order, the same on every rank).
        let mut words: Vec<u64> = Vec::new();
        for bucket in buckets.iter() {
            let (max, min) = magnitudes(&bucket.buffer[..bucket.gradients]);
            words.push(u64::from(max.to_bits()));
            words.push(u64::from(min.to_bits()));
        }
        let stats_len = words.len();
        for bucket in buckets.iter() {
            words.extend(
                bucket.buffer[bucket.gradients..]
                    .iter()
                    .map(|v| u64::from(v.to_bits())),
            );
        }
        let per_rank = words.len();
        let all = if n == 1 {
            words.clone()
        } else {
            group.all_gather(&words, timeout)?
        };
        stats.bytes += per_rank * 8;
        let value = |r: usize, i: usize| f32::from_bits(all[r * per_rank + i] as u32);
        let mut tail_at = stats_len;
        for bucket in buckets.iter_mut() {
            let gradients = bucket.gradients;
            for (k, slot) in bucket.buffer[gradients..].iter_mut().enumerate() {
                let sum = (0..n).fold(0f32, |acc, r| acc + value(r, tail_at + k));
                *slot = if op == ReduceOp::Avg {
                    sum / n as f32
                } else {
                    sum
                };
            }
            tail_at += bucket.buffer.len() - gradients;
        }
        let mut wire = WIRE.with(|w| std::mem::take(&mut *w.borrow_mut()));
        let result = self.reduce_values(
            group, buckets, op, timeout, stats, &all, per_rank, &mut wire,
        );
        WIRE.with(|w| *w.borrow_mut() = wire);
        result
    }
}

impl Compress16 {
    /// The gradients of every bucket, given the all-gathered magnitudes (`all`, `per_rank` words
    /// per rank): 16-bit where they fit, else `f32`.
    #[allow(clippy::too_many_arguments)]
    fn reduce_values(
        &self,
        group: &dyn ProcessGroup,
        buckets: &mut [HostBucket<'_>],
        op: ReduceOp,
        timeout: Duration,
        stats: &mut HookStats,
        all: &[u64],
        per_rank: usize,
        wire: &mut Vec<u16>,
    ) -> Result<()> {
        let n = group.world_size();
        let rank = group.rank();
        let value = |r: usize, i: usize| f32::from_bits(all[r * per_rank + i] as u32);
        for (b, bucket) in buckets.iter_mut().enumerate() {
            let (mut max, mut min) = (0f32, f32::INFINITY);
            for r in 0..n {
                let (rmax, rmin) = (value(r, 2 * b), value(r, 2 * b + 1));
                max = if rmax.is_nan() || max.is_nan() {
                    f32::NAN
                } else {
                    max.max(rmax)
                };
                min = min.min(rmin);
            }
            let gradients = &mut bucket.buffer[..bucket.gradients];
            match choose_wire(self.compression(), op, n, max, min) {
                Ok(Wire::Half { scale, factor }) => {
                    wire.clear();
                    wire.extend(gradients.iter().map(|&g| self.format.from_f32(g * factor)));
                    group.all_reduce_half(wire, self.format, ReduceOp::Sum, timeout)?;
                    for (g, &bits) in gradients.iter_mut().zip(wire.iter()) {
                        *g = self.format.to_f32(bits) / scale;
                    }
                    stats.bytes += wire.len() * 2;
                }
                Ok(Wire::F32) | Err(Fallback::NonFinite) => {
                    // Sent as they are: the NaN/infinity check after the hook names the ranks.
                    group.all_reduce(gradients, op, timeout)?;
                    stats.bytes += gradients.len() * 4;
                }
                Err(Fallback::Range) => {
                    group.all_reduce(gradients, op, timeout)?;
                    stats.bytes += gradients.len() * 4;
                    stats.uncompressed_buckets += 1;
                    let first = self
                        .warned
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .insert((rank, bucket.index));
                    if first {
                        tracing::warn!(
                            "burn-ddp: rank {rank}: {} gradient compression: bucket {} holds \
                             gradients from {min:e} to {max:e} (over all ranks), more than the \
                             format's normal range at world size {n}; it goes as f32 this step \
                             (counted in CommStats::uncompressed_buckets; bf16 covers f32's \
                             range)",
                            self.format,
                            bucket.index
                        );
                    }
                }
            }
        }
        Ok(())
    }
}

/// The largest magnitude of `values` (NaN if one is NaN) and the smallest non-zero one
/// (infinity when all are zero).
fn magnitudes(values: &[f32]) -> (f32, f32) {
    let mut max = 0f32;
    let mut min = f32::INFINITY;
    for &v in values {
        let a = v.abs();
        max = if a.is_nan() || max.is_nan() {
            f32::NAN
        } else {
            max.max(a)
        };
        if a != 0.0 {
            min = min.min(a);
        }
    }
    (max, min)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn_ddp_comm::group::ThreadGroup;
    use burn_ddp_comm::store::StoreServer;
    use std::sync::Arc;

    const T: Duration = Duration::from_secs(30);

    /// Rank `r`'s buckets: two of gradients around `magnitudes[b]` (mixed signs), the first
    /// followed by 3 bookkeeping words.
    fn buffers(rank: usize, magnitudes: [f32; 2]) -> Vec<Vec<f32>> {
        let values = |len: usize, m: f32| crate::compress::test_gradients(rank, len, m);
        let mut first = values(300, magnitudes[0]);
        first.extend([1.0, 0.0, (rank + 1) as f32]);
        vec![first, values(257, magnitudes[1])]
    }

    /// Reduces every rank's [`buffers`] with `hook` over `groups`, one thread per rank.
    fn reduce_all(
        groups: Vec<Arc<dyn ProcessGroup>>,
        hook: &dyn CommHook,
        magnitudes: [f32; 2],
        op: ReduceOp,
    ) -> Vec<(Vec<Vec<f32>>, HookStats)> {
        std::thread::scope(|s| {
            let handles: Vec<_> = groups
                .into_iter()
                .map(|group| {
                    s.spawn(move || {
                        let mut mine = buffers(group.rank(), magnitudes);
                        let mut stats = HookStats::default();
                        {
                            let mut buckets: Vec<HostBucket<'_>> = mine
                                .iter_mut()
                                .enumerate()
                                .map(|(index, buffer)| HostBucket {
                                    index,
                                    gradients: if index == 0 { 300 } else { 257 },
                                    buffer,
                                })
                                .collect();
                            hook.reduce(group.as_ref(), &mut buckets, op, T, &mut stats)
                                .unwrap();
                        }
                        (mine, stats)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    fn threads(n: usize) -> Vec<Arc<dyn ProcessGroup>> {
        ThreadGroup::new_group(n)
            .unwrap()
            .into_iter()
            .map(|g| Arc::new(g) as Arc<dyn ProcessGroup>)
            .collect()
    }

    fn tcp(n: usize) -> (StoreServer, Vec<Arc<dyn ProcessGroup>>) {
        let (server, groups) = burn_ddp_comm::group::loopback_groups(n, T);
        let groups = groups
            .into_iter()
            .map(|g| Arc::new(g) as Arc<dyn ProcessGroup>)
            .collect();
        (server, groups)
    }

    #[test]
    fn compression_on_threads_and_tcp_keeps_the_16_bit_rounding_and_the_bookkeeping_exact() {
        for (format, eps) in [
            (HalfFloat::Bf16, 2f64.powi(-8)),
            (HalfFloat::F16, 2f64.powi(-11)),
        ] {
            for n in [2usize, 3] {
                let magnitudes = [2e5f32, 1e-9];
                let exact = reduce_all(threads(n), &AllReduce, magnitudes, ReduceOp::Avg);
                let (_store, tcp_groups) = tcp(n);
                for (kind, results) in [
                    (
                        "threads",
                        reduce_all(
                            threads(n),
                            &Compress16::new(format),
                            magnitudes,
                            ReduceOp::Avg,
                        ),
                    ),
                    (
                        "tcp",
                        reduce_all(
                            tcp_groups.clone(),
                            &Compress16::new(format),
                            magnitudes,
                            ReduceOp::Avg,
                        ),
                    ),
                ] {
                    let what = format!("{format} {kind} n={n}");
                    for (rank, (buckets, stats)) in results.iter().enumerate() {
                        assert_eq!(
                            buckets, &results[0].0,
                            "{what}: rank {rank} differs from rank 0"
                        );
                        assert_eq!(stats.uncompressed_buckets, 0, "{what}");
                        for (b, (got, want)) in buckets.iter().zip(&exact[0].0).enumerate() {
                            let gradients = if b == 0 { 300 } else { 257 };
                            for i in 0..gradients {
                                // The magnitudes summed, averaged: each input rounded once, each
                                // hop once.
                                let magnitude: f64 = (0..n)
                                    .map(|r| f64::from(buffers(r, magnitudes)[b][i]).abs())
                                    .sum::<f64>()
                                    / n as f64;
                                let error = (f64::from(got[i]) - f64::from(want[i])).abs();
                                // (A flushed or overflowed value would miss this by far.)
                                assert!(
                                    error <= 2.0 * n as f64 * eps * magnitude,
                                    "{what}: bucket {b} element {i}: {} vs {}",
                                    got[i],
                                    want[i]
                                );
                            }
                            // The bookkeeping, exactly as the f32 all-reduce gives it.
                            assert_eq!(got[gradients..], want[gradients..], "{what}: bookkeeping");
                        }
                    }
                    if kind == "tcp" {
                        // Half the gradient bytes of the f32 path, plus the small all-gather.
                        let f32_bytes = exact[0].1.bytes as f64;
                        let bytes = results[0].1.bytes as f64;
                        assert!(
                            bytes < 0.6 * f32_bytes,
                            "{what}: {bytes} vs {f32_bytes} bytes"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn a_bucket_wider_than_f16_goes_as_f32_and_is_counted() {
        // The first bucket spans 2e5 down to 1e-9 across ranks: beyond f16's normal range.
        let groups = threads(2);
        let hook = Compress16::new(HalfFloat::F16);
        let wide = |rank: usize| if rank == 0 { 2e5 } else { 1e-9 };
        let results = std::thread::scope(|s| {
            let handles: Vec<_> = groups
                .into_iter()
                .map(|group| {
                    let hook = &hook;
                    s.spawn(move || {
                        let rank = group.rank();
                        let mut first = buffers(rank, [wide(rank), 1.0]).swap_remove(0);
                        let exact = {
                            let mut copy = first.clone();
                            group.all_reduce(&mut copy, ReduceOp::Avg, T).unwrap();
                            copy
                        };
                        let mut stats = HookStats::default();
                        let mut buckets = [HostBucket {
                            index: 0,
                            gradients: 300,
                            buffer: &mut first,
                        }];
                        hook.reduce(group.as_ref(), &mut buckets, ReduceOp::Avg, T, &mut stats)
                            .unwrap();
                        (first, exact, stats)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap())
                .collect::<Vec<_>>()
        });
        for (rank, (got, exact, stats)) in results.iter().enumerate() {
            assert_eq!(stats.uncompressed_buckets, 1, "rank {rank}");
            assert_eq!(got, exact, "rank {rank}: sent as f32, exactly");
        }
    }
}
