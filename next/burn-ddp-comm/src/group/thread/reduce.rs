//! The arithmetic of [`ThreadGroup`](super::ThreadGroup)'s data phase: a range of every rank's
//! buffer summed in ring order, block by block, straight from the peers' memory.

use crate::group::ReduceOp;

/// Number of elements reduced per block: small enough to stay in L1 (8 KiB of `f32`).
const BLOCK: usize = 2048;

/// Reduces `range` of every rank's buffer and writes the result into `range` of every buffer,
/// block by block, adding the ranks in the order `first, first + 1, ..., first - 1` (mod N): the
/// order in which a ring all-reduce sums chunk `first`, so [`TcpGroup`](crate::group::TcpGroup) gives the
/// same bits. Each block is read from every buffer before it is written to any, so the caller's
/// own buffer may be among `addrs`.
///
/// # Safety
/// Every address in `addrs` points to a live `f32` buffer of at least `range.end` elements, and no
/// other thread reads or writes `range` of any of them during the call.
pub(super) unsafe fn reduce_range(
    addrs: &[usize],
    first: usize,
    range: std::ops::Range<usize>,
    op: ReduceOp,
) {
    let n = addrs.len();
    let order: Vec<usize> = (0..n).map(|i| addrs[(first + i) % n]).collect();
    let mut acc = [0f32; BLOCK];
    let mut start = range.start;
    while start < range.end {
        let len = BLOCK.min(range.end - start);
        let acc = &mut acc[..len];
        // SAFETY: per the function contract, the ranges read are live and not written meanwhile.
        unsafe {
            acc.copy_from_slice(std::slice::from_raw_parts(
                (order[0] as *const f32).add(start),
                len,
            ));
            for &addr in &order[1..] {
                let src = std::slice::from_raw_parts((addr as *const f32).add(start), len);
                for (a, s) in acc.iter_mut().zip(src) {
                    *a += *s;
                }
            }
        }
        if op == ReduceOp::Avg {
            let divisor = n as f32;
            for a in acc.iter_mut() {
                *a /= divisor;
            }
        }
        for &addr in addrs {
            // SAFETY: `range` of every buffer is only touched by this thread in this phase, and
            // this block of it has been read above.
            unsafe {
                std::slice::from_raw_parts_mut((addr as *mut f32).add(start), len)
                    .copy_from_slice(acc);
            }
        }
        start += len;
    }
}

/// Writes into `out` the reduction of `range` of every buffer in `addrs`, summed in ring order
/// from rank `first` (as [`reduce_range`], without writing the buffers): rank `first`'s block of
/// a reduce-scatter.
///
/// # Safety
/// Every address in `addrs` points to a live `f32` buffer of at least `range.end` elements that
/// no thread writes during the call; `out` has `range.len()` elements and is none of them.
pub(super) unsafe fn reduce_into(
    addrs: &[usize],
    first: usize,
    range: std::ops::Range<usize>,
    out: &mut [f32],
    op: ReduceOp,
) {
    let n = addrs.len();
    let block = |i: usize| {
        // SAFETY: per the function contract.
        unsafe {
            std::slice::from_raw_parts(
                (addrs[(first + i) % n] as *const f32).add(range.start),
                range.len(),
            )
        }
    };
    out.copy_from_slice(block(0));
    for i in 1..n {
        for (o, s) in out.iter_mut().zip(block(i)) {
            *o += *s;
        }
    }
    if op == ReduceOp::Avg {
        let divisor = n as f32;
        out.iter_mut().for_each(|o| *o /= divisor);
    }
}
