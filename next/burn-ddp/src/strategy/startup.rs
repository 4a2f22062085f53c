//! What every process builds for itself and must agree on before the first step: where the run
//! starts (epochs, resumed batches and counters), the settings that shape the steps, and the
//! data (training items, the training sampler's seed, shuffling, padding and batch size, the
//! validation items). In thread mode the ranks share one of each, in process mode nothing else
//! makes them equal; one all-gather compares them and names the first difference. (What can only
//! be seen once training runs, the learning rate and the optimizer, is compared at every step:
//! `lockstep.rs`.)

use crate::error::{DdpError, Result};
use burn_ddp_comm::group::ProcessGroup;

/// One rank's view of the run, compared across the ranks at start-up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Startup {
    /// burn-train's epochs this run trains.
    pub epochs: (u64, u64),
    /// Batches of the first epoch a resumed run skips.
    pub resumed_batches: u64,
    /// Gradient synchronisations and optimizer steps before this run (a resume's counters).
    pub counters: (u64, u64),
    /// The settings that shape the steps (`DdpConfig`'s and the gradient accumulation).
    pub settings: u64,
    /// Items of the training loader (all ranks' shards).
    pub train_items: u64,
    /// The training `DistributedDataLoader`'s sampler and batch size, hashed (0: another loader).
    pub train_loader: u64,
    /// Items of the validation loader.
    pub valid_items: u64,
    /// The validation `DistributedDataLoader`'s sampler and batch size, hashed (0: another
    /// loader). Sharded validation between processes deals one device's batches, which every
    /// process builds from its own loader: they must be the same.
    pub valid_loader: u64,
}

const WORDS: usize = 10;

impl Startup {
    fn words(&self) -> [u64; WORDS] {
        [
            self.epochs.0,
            self.epochs.1,
            self.resumed_batches,
            self.counters.0,
            self.counters.1,
            self.settings,
            self.train_items,
            self.train_loader,
            self.valid_items,
            self.valid_loader,
        ]
    }

    fn from_words(w: &[u64]) -> Self {
        Self {
            epochs: (w[0], w[1]),
            resumed_batches: w[2],
            counters: (w[3], w[4]),
            settings: w[5],
            train_items: w[6],
            train_loader: w[7],
            valid_items: w[8],
            valid_loader: w[9],
        }
    }

    /// Compares this rank's view with every other rank's (one all-gather).
    ///
    /// # Errors
    /// [`DdpError::ReplicaMismatch`] on every rank, naming the first field that differs between
    /// rank 0 and the first rank that differs from it; the all-gather's errors.
    pub fn compare(
        &self,
        group: &dyn ProcessGroup,
        timeout: std::time::Duration,
        config: &dyn std::fmt::Display,
    ) -> Result<()> {
        let all = group.all_gather(&self.words(), timeout)?;
        let views: Vec<Startup> = all.chunks(WORDS).map(Startup::from_words).collect();
        let first = views[0];
        let Some((other, theirs)) = views
            .iter()
            .enumerate()
            .find(|(_, v)| **v != first)
            .map(|(r, v)| (r, *v))
        else {
            return Ok(());
        };
        Err(DdpError::ReplicaMismatch {
            rank: group.rank(),
            detail: describe(&first, other, &theirs, config),
        })
    }
}

/// The first difference between rank 0's view `first` and rank `other`'s.
fn describe(
    first: &Startup,
    other: usize,
    theirs: &Startup,
    config: &dyn std::fmt::Display,
) -> String {
    if (first.epochs, first.resumed_batches) != (theirs.epochs, theirs.resumed_batches) {
        return format!(
            "rank 0 trains epochs {}..={} from batch {} but rank {other} trains {}..={} from batch \
             {} (resumed from different checkpoints?)",
            first.epochs.0,
            first.epochs.1,
            first.resumed_batches,
            theirs.epochs.0,
            theirs.epochs.1,
            theirs.resumed_batches
        );
    }
    if first.counters != theirs.counters {
        return format!(
            "rank 0 resumes after {} gradient synchronisations ({} optimizer steps) but rank \
             {other} after {} ({}): they read different checkpoint states",
            first.counters.0, first.counters.1, theirs.counters.0, theirs.counters.1
        );
    }
    if first.settings != theirs.settings {
        return format!(
            "rank 0 and rank {other} have different DdpConfig training settings (clipping, \
             non-finite policy, uneven inputs, buffer sync, bucket caps, compression, validation, \
             metrics and check cadences, optimizer sharding, and with it whether checkpoints are \
             written: a file checkpointer and a checkpoint directory on every rank or none) or \
             gradient accumulation; here: {config}"
        );
    }
    if first.train_items != theirs.train_items {
        return format!(
            "rank 0's training loader has {} items but rank {other}'s {}: the ranks must load the \
             same training set (the same dataset and limits)",
            first.train_items, theirs.train_items
        );
    }
    if first.train_loader != theirs.train_loader {
        return format!(
            "rank 0's and rank {other}'s training DistributedDataLoaders differ in their sampler \
             (seed, shuffling, padding or drop_last, uneven shards) or batch size: every rank must \
             build the same loader, or the shards overlap and the steps differ"
        );
    }
    if first.valid_items != theirs.valid_items {
        return format!(
            "rank 0's validation loader has {} items but rank {other}'s {}: the ranks must load \
             the same validation set, or its metrics are wrong",
            first.valid_items, theirs.valid_items
        );
    }
    format!(
        "rank 0's and rank {other}'s validation DistributedDataLoaders differ in their sampler \
         (seed, shuffling, shards) or batch size: the ranks share one device's validation \
         batches out, which each process builds from its own loader, so every rank must build \
         the same one"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_difference_is_named_with_both_values() {
        let view = Startup {
            epochs: (1, 3),
            resumed_batches: 0,
            counters: (0, 0),
            settings: 7,
            train_items: 640,
            train_loader: 11,
            valid_items: 64,
            valid_loader: 8,
        };
        let text = |theirs| describe(&view, 2, &theirs, &"config");
        assert!(
            text(Startup {
                valid_items: 65,
                ..view
            })
            .contains("64 items but rank 2's 65")
        );
        assert!(
            text(Startup {
                valid_loader: 9,
                ..view
            })
            .contains("rank 0's and rank 2's validation DistributedDataLoaders differ")
        );
        assert!(
            text(Startup {
                train_loader: 12,
                ..view
            })
            .contains("seed, shuffling")
        );
        assert!(
            text(Startup {
                train_items: 600,
                ..view
            })
            .contains("640 items but rank 2's 600")
        );
        assert!(
            text(Startup {
                epochs: (2, 3),
                ..view
            })
            .contains("epochs 1..=3 from batch 0")
        );
        assert_eq!(Startup::from_words(&view.words()), view);
    }
}
