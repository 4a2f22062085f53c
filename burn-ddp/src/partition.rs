//! How `len` things are split between `parts` ranks: into contiguous chunks whose sizes differ by
//! at most one, the larger ones first. Shared by the ring collectives (which rank reduces which
//! chunk of a buffer) and by the data shards (which samples a rank gets in join mode, where the
//! rank shards of [`DistributedSampler`](crate::DistributedSampler) start), so both stay one rule.

/// The half-open range of chunk `index` when `len` elements are split into `parts` contiguous
/// chunks whose sizes differ by at most one (the first `len % parts` chunks get one more).
pub(crate) fn chunk_range(len: usize, parts: usize, index: usize) -> std::ops::Range<usize> {
    let base = len / parts;
    let extra = len % parts;
    let start = index * base + index.min(extra);
    let size = base + usize::from(index < extra);
    start..start + size
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_the_buffer_without_overlap() {
        for len in [0usize, 1, 5, 16, 17, 1000] {
            for parts in 1..6 {
                let mut next = 0;
                for index in 0..parts {
                    let range = chunk_range(len, parts, index);
                    assert_eq!(range.start, next, "len {len} parts {parts} index {index}");
                    assert!(range.len() == len / parts || range.len() == len / parts + 1);
                    next = range.end;
                }
                assert_eq!(next, len);
            }
        }
    }
}
