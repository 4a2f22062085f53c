//! How whole items of different sizes get owners ([`balance`]): the tensors a rank steps under
//! optimizer-state sharding and those whose gradients it reduces for thread replicas on one
//! device, so both give a tensor the same owner. (How `len` things are split into contiguous
//! chunks, the collectives' and the data shards' one rule, is
//! [`chunk_range`](burn_ddp_comm::group::chunk_range).)

/// An owner among `parts` ranks for each item of `sizes`: largest first (ties in index order),
/// each to the rank that owns the least so far (ties to the lower rank): the greedy "longest
/// processing time" rule, within one item of even, computed alike by every rank. Returns the
/// owner of each item and what each rank owns in all.
pub(crate) fn balance(sizes: &[u64], parts: usize) -> (Vec<usize>, Vec<u64>) {
    let parts = parts.max(1);
    let mut order: Vec<usize> = (0..sizes.len()).collect();
    order.sort_by_key(|&i| (std::cmp::Reverse(sizes[i]), i));
    let mut load = vec![0u64; parts];
    let mut owners = vec![0; sizes.len()];
    for i in order {
        let least = (0..parts).min_by_key(|&r| (load[r], r)).unwrap_or(0);
        load[least] += sizes[i];
        owners[i] = least;
    }
    (owners, load)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn balance_gives_the_largest_first_to_the_least_loaded_rank() {
        // 8 -> 0; 5 -> 1; 4 -> 1 (5 < 8); 3 -> 0 (8 < 9); 1 -> 1 (9 < 11).
        let (owners, load) = balance(&[3, 8, 1, 5, 4], 2);
        assert_eq!(owners, [0, 0, 1, 1, 1]);
        assert_eq!(load, [11, 10]);
        // Ties in index order, to the lower rank; no rank: one.
        assert_eq!(balance(&[2, 2, 2], 3).0, [0, 1, 2]);
        assert_eq!(balance(&[2, 2], 0), (vec![0, 0], vec![4]));
    }
}
