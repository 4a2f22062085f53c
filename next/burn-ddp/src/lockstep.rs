//! Ranks in step. When the ranks synchronise gradients they must be at the same point of
//! training: the same batch of the same epoch, batches of the size the split promises, the same
//! learning rate, the same parameters after the optimizer's first steps. The collectives cannot
//! see it (they count calls, not steps): a rank that skipped a synchronisation, or was built with
//! another batch size, learning rate or optimizer, meets the others in every collective and
//! trains against the wrong steps until the data runs out. [`Position`] finds it at the first
//! synchronisation where it differs, inside the gradient reduction that happens anyway (no
//! collective of its own while the ranks agree).
//!
//! How: every rank hashes its position to 16 bits and sends each bit as a pair of words
//! `(bit, 1 - bit)` with the gradients ([`ReduceOptions::words`](crate::mechanism::ReduceOptions)).
//! Summed over the ranks, a word is positive when any rank set it, whatever the wire (`f32`,
//! 16-bit, an average): the ranks agree exactly when no pair has both words positive (up to
//! hash collisions, one in 2^16 per step; a rank whose batches are out of step stays so, and the
//! next steps hash differently). Every rank reads the same reduced words, so all take
//! the same path; when they differ, one all-gather of the positions names the ranks and what
//! differs.

use crate::error::{DdpError, Result};
use burn_ddp_comm::group::ProcessGroup;

/// What must be equal on every rank at a gradient synchronisation. A field is 0 when the caller
/// does not know it; every rank of a job knows the same fields (the same code runs everywhere).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Position {
    /// The epoch (burn-train's, or the sampler's).
    pub epoch: u64,
    /// Batches the rank has drawn in the epoch (or its step number).
    pub batches: u64,
    /// Samples of the step over all ranks (one device's batch), as the rank's loader says.
    pub samples: u64,
    /// The learning rate's bits (`f64::to_bits`).
    pub lr_bits: u64,
    /// A fingerprint of one small parameter after the first optimizer steps (0 afterwards).
    pub probe: u64,
}

/// Bits of the position's hash that travel: 32 words a step (128 bytes in `f32`). A collision
/// lets a difference pass one step in 65536; a rank whose batches are out of step stays so, and
/// the next steps' positions hash differently.
const BITS: usize = 16;

impl Position {
    /// Words a position adds to a reduction.
    pub const WORDS: usize = 2 * BITS;

    fn fields(&self) -> [u64; 5] {
        [
            self.epoch,
            self.batches,
            self.samples,
            self.lr_bits,
            self.probe,
        ]
    }

    fn from_fields(words: &[u64]) -> Self {
        let field = |i: usize| words.get(i).copied().unwrap_or(0);
        Self {
            epoch: field(0),
            batches: field(1),
            samples: field(2),
            lr_bits: field(3),
            probe: field(4),
        }
    }

    /// This rank's words for the reduction.
    pub fn words(&self) -> Vec<f32> {
        let hash = crate::replica::fnv(self.fields().into_iter());
        (0..BITS)
            .flat_map(|i| {
                let bit = f32::from(u8::from(hash >> i & 1 == 1));
                [bit, 1.0 - bit]
            })
            .collect()
    }

    /// Whether every rank sent the same position, from the reduced words.
    pub fn agreed(reduced: &[f32]) -> bool {
        reduced
            .chunks(2)
            .all(|pair| !(pair.len() == 2 && pair[0] > 0.0 && pair[1] > 0.0))
    }

    /// The error when the ranks' positions differ: every rank calls it (they all read the same
    /// reduced words), one all-gather of the positions, and a message naming what differs.
    /// `sync` is the gradient synchronisation (0-based) where it was found.
    pub fn out_of_step(
        &self,
        group: &dyn ProcessGroup,
        sync: u64,
        timeout: std::time::Duration,
    ) -> DdpError {
        let all = match group.all_gather(&self.fields(), timeout) {
            Ok(all) => all,
            Err(err) => return err.into(),
        };
        let positions: Vec<Position> = all.chunks(5).map(Position::from_fields).collect();
        DdpError::OutOfStep {
            rank: group.rank(),
            sync,
            detail: describe(&positions),
        }
    }
}

/// What differs between the ranks' positions, naming the first rank that differs from rank 0.
fn describe(positions: &[Position]) -> String {
    let first = positions.first().copied().unwrap_or_default();
    let Some((other, theirs)) = positions
        .iter()
        .enumerate()
        .find(|(_, p)| **p != first)
        .map(|(r, p)| (r, *p))
    else {
        // The hashes differed but the positions do not: they changed in between (cannot
        // happen), or a hash collision of the other way round.
        return "the ranks' positions differed in the reduction but agree now".into();
    };
    if (theirs.epoch, theirs.batches) != (first.epoch, first.batches) {
        return format!(
            "rank 0 is at batch {} of epoch {} but rank {other} at batch {} of epoch {}: a rank \
             skipped or repeated a gradient synchronisation, or its loader gives another number \
             of batches",
            first.batches, first.epoch, theirs.batches, theirs.epoch
        );
    }
    if theirs.samples != first.samples {
        return format!(
            "rank 0's step holds {} samples over all ranks but rank {other}'s {}: the ranks' \
             loaders were built with different batch sizes (the per-rank batch must be the same \
             on every rank)",
            first.samples, theirs.samples
        );
    }
    if theirs.lr_bits != first.lr_bits {
        return format!(
            "rank 0's learning rate is {} but rank {other}'s {}: the ranks were built with \
             different learning rates or schedulers",
            f64::from_bits(first.lr_bits),
            f64::from_bits(theirs.lr_bits)
        );
    }
    format!(
        "rank {other}'s parameters differ from rank 0's after the same optimizer steps on the same \
         gradients: the ranks were built with different optimizers or hyper-parameters \
         (momentum, betas, epsilon, weight decay)"
    )
}

/// Fingerprints of one small parameter after the first optimizer steps: a different optimizer or
/// hyper-parameter shows in the first steps' updates, and reading one small tensor for a few
/// steps costs nothing measurable.
#[derive(Debug, Clone)]
pub(crate) struct Probe {
    /// Registration index of the smallest trainable tensor (`None`: no trainable tensor).
    tensor: Option<usize>,
}

/// Synchronisations (after the first) at which the probe is taken: after optimizer steps 1..=3.
const PROBED: std::ops::RangeInclusive<u64> = 1..=3;

impl Probe {
    /// The probe of a replica with this layout.
    pub fn new(layout: &crate::replica::ReplicaLayout) -> Self {
        let tensor = layout
            .tensors()
            .iter()
            .filter(|t| t.kind == crate::replica::TensorKind::Parameter)
            .min_by_key(|t| t.numel())
            .map(|t| t.index);
        Self { tensor }
    }

    /// The fingerprint to send at synchronisation `sync` (0-based): the probed tensor's value
    /// fingerprint at synchronisations 1 to 3, else 0.
    pub fn at<M: burn::module::Module>(&self, module: &M, sync: u64) -> u64 {
        match self.tensor {
            Some(index) if PROBED.contains(&sync) => {
                crate::replica::fingerprint_of(module, index).unwrap_or(0)
            }
            _ => 0,
        }
    }
}

/// Checks the reduced words of a synchronisation at `position`, returning the error when the
/// ranks were not in step.
pub(crate) fn check(
    reduced: &[f32],
    position: &Position,
    group: &dyn ProcessGroup,
    sync: u64,
    timeout: std::time::Duration,
) -> Result<()> {
    if Position::agreed(reduced) {
        Ok(())
    } else {
        Err(position.out_of_step(group, sync, timeout))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The sum over ranks of their words, as the reduction gives it.
    fn reduce(positions: &[Position]) -> Vec<f32> {
        let mut sum = vec![0.0; Position::WORDS];
        for p in positions {
            for (s, w) in sum.iter_mut().zip(p.words()) {
                *s += w;
            }
        }
        sum
    }

    #[test]
    fn equal_positions_agree_and_any_difference_does_not() {
        let at = Position {
            epoch: 2,
            batches: 7,
            samples: 32,
            lr_bits: 0.1f64.to_bits(),
            probe: 0,
        };
        assert!(Position::agreed(&reduce(&[at, at, at])));
        // An average over 3 ranks keeps positive words positive.
        let avg: Vec<f32> = reduce(&[at, at, at]).iter().map(|w| w / 3.0).collect();
        assert!(Position::agreed(&avg));
        for other in [
            Position { batches: 8, ..at },
            Position { samples: 48, ..at },
            Position {
                lr_bits: 0.2f64.to_bits(),
                ..at
            },
            Position { probe: 9, ..at },
            Position { epoch: 3, ..at },
        ] {
            assert!(!Position::agreed(&reduce(&[at, other, at])), "{other:?}");
        }
    }

    #[test]
    fn the_message_names_what_differs_and_the_rank() {
        let at = Position {
            epoch: 1,
            batches: 5,
            samples: 32,
            ..Position::default()
        };
        let skipped = describe(&[at, Position { batches: 6, ..at }]);
        assert!(
            skipped.contains("batch 5 of epoch 1 but rank 1 at batch 6"),
            "{skipped}"
        );
        let batch = describe(&[at, at, Position { samples: 48, ..at }]);
        assert!(
            batch.contains("32 samples over all ranks but rank 2's 48"),
            "{batch}"
        );
    }
}
