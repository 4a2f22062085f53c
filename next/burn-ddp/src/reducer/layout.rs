//! Which gradients travel together: the assignment of parameters to buckets (PyTorch's
//! `compute_bucket_assignment_by_size`), and the set of parameters the reducer reduces.

use crate::replica::{ReplicaLayout, TensorSpec};

/// Bytes of one gradient element in a bucket (`f32`).
pub(crate) const ELEMENT_BYTES: usize = 4;

/// One bucket: parameters whose gradients are all-reduced together.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bucket {
    /// Indices into the reducer's parameter list (registration order), in bucket order.
    pub params: Vec<usize>,
    /// Offset of each parameter's gradient in the flat bucket, in elements.
    pub offsets: Vec<usize>,
    /// Number of gradient elements (`f32`), without the presence flags.
    pub numel: usize,
}

impl Bucket {
    fn empty() -> Self {
        Self {
            params: Vec::new(),
            offsets: Vec::new(),
            numel: 0,
        }
    }

    /// Size of the gradients in bytes (`numel * 4`).
    pub fn bytes(&self) -> usize {
        self.numel * ELEMENT_BYTES
    }
}

/// Assignment of parameters to buckets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BucketLayout {
    buckets: Vec<Bucket>,
}

impl BucketLayout {
    /// Assigns parameters (given in registration order, with their element counts) to buckets in
    /// reverse order. The first bucket closes once it holds `first_cap_bytes` or more, every later
    /// bucket once it holds `cap_bytes` or more (PyTorch's `compute_bucket_assignment_by_size`).
    pub fn new(param_numels: &[usize], first_cap_bytes: usize, cap_bytes: usize) -> Self {
        let mut buckets = Vec::new();
        let mut current = Bucket::empty();
        for (index, &numel) in param_numels.iter().enumerate().rev() {
            current.params.push(index);
            current.offsets.push(current.numel);
            current.numel += numel;
            let cap = if buckets.is_empty() {
                first_cap_bytes
            } else {
                cap_bytes
            };
            if current.bytes() >= cap {
                buckets.push(std::mem::replace(&mut current, Bucket::empty()));
            }
        }
        if !current.params.is_empty() {
            buckets.push(current);
        }
        Self { buckets }
    }

    /// [`new`](Self::new), with one empty bucket when there is no parameter: the reducer's first
    /// bucket also carries its per-step control words, so every step has one.
    pub(crate) fn at_least_one(param_numels: &[usize], first_cap: usize, cap: usize) -> Self {
        let mut layout = Self::new(param_numels, first_cap, cap);
        if layout.buckets.is_empty() {
            layout.buckets.push(Bucket::empty());
        }
        layout
    }

    /// The buckets, in all-reduce order.
    pub fn buckets(&self) -> &[Bucket] {
        &self.buckets
    }
}

/// The parameters of `layout` the reducer reduces: each tensor that requires gradients, once. A
/// weight reachable from two places of the module tree (the same `ParamId`) has one gradient in
/// Burn's `GradientsParams`; it is reduced once, under its first place in registration order.
pub(crate) fn trainable(layout: &ReplicaLayout) -> Vec<TensorSpec> {
    let mut seen = std::collections::HashSet::new();
    layout
        .parameters()
        .filter(|spec| seen.insert(spec.id))
        .cloned()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::DdpConfig;

    #[test]
    fn buckets_follow_reverse_order_and_caps() {
        // Four parameters of 100, 300, 50 and 400 elements (400, 1200, 200, 1600 bytes).
        let numels = [100, 300, 50, 400];
        let layout = BucketLayout::new(&numels, 1000, 1500);
        let buckets = layout.buckets();
        // Reverse order: 3 (1600 B) closes the first bucket at once (cap 1000);
        // then 2 (200 B) + 1 (1200 B) = 1400 < 1500, + 0 (400 B) = 1800 closes the second.
        assert_eq!(buckets.len(), 2);
        assert_eq!(buckets[0].params, vec![3]);
        assert_eq!(buckets[0].numel, 400);
        assert_eq!(buckets[1].params, vec![2, 1, 0]);
        assert_eq!(buckets[1].offsets, vec![0, 50, 350]);
        assert_eq!(buckets[1].numel, 450);
        // No parameter: no bucket, or one empty bucket for the control words.
        assert!(BucketLayout::new(&[], 1000, 1500).buckets().is_empty());
        let control = BucketLayout::at_least_one(&[], 1000, 1500);
        assert_eq!(control.buckets().len(), 1);
        assert_eq!(control.buckets()[0].numel, 0);
    }

    #[test]
    fn small_models_fit_one_bucket_with_default_caps() {
        let numels = [160, 16, 4608, 32, 100_352, 64, 640, 10];
        let config = DdpConfig::default();
        let layout = BucketLayout::new(
            &numels,
            config.first_bucket_cap_bytes(),
            config.bucket_cap_bytes(),
        );
        assert_eq!(layout.buckets().len(), 1);
        assert_eq!(layout.buckets()[0].numel, numels.iter().sum::<usize>());
        assert_eq!(layout.buckets()[0].params, (0..8).rev().collect::<Vec<_>>());
    }

    #[test]
    fn every_parameter_lands_in_exactly_one_bucket() {
        let numels: Vec<usize> = (1..40).map(|i| (i * 7919) % 5000 + 1).collect();
        let layout = BucketLayout::new(&numels, 4096, 16384);
        let mut seen: Vec<usize> = layout
            .buckets()
            .iter()
            .flat_map(|b| b.params.clone())
            .collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..numels.len()).collect::<Vec<_>>());
        for b in layout.buckets() {
            let sum: usize = b.params.iter().map(|&p| numels[p]).sum();
            assert_eq!(sum, b.numel);
        }
    }
}
