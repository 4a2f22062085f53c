//! The ranks' training loaders: how each rank of this process takes its batches from the loader
//! burn-train hands the strategy.

use std::sync::Arc;
use std::time::Duration;

use burn::tensor::Device;
use burn::train::{LearnerModel, TrainLoader};

use super::dealer::Dealer;
use super::dealt_loader::DealtLoader;
use crate::error::{DdpError, Result};
use burn_ddp_comm::group::ProcessGroup;

/// How the ranks take their training batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Cut {
    /// One replica: the loader as one device reads it (one copy, `to_device`).
    Alone,
    /// A `DistributedDataLoader` (or join mode): each rank its sampler's shard, nothing dropped.
    Sampler,
    /// Another loader, read as one device reads it, its batches dealt to the ranks: rank `r`
    /// takes batches `r, r + N, ...` of one device's pass, so every step is one device's batch
    /// of `N` times the size (threads of one process on one device of a CPU backend).
    Dealt,
    /// Another loader, cut into `N` equal contiguous slices (a remainder of fewer than `N` items
    /// dropped): not one device's steps, where one device's batches cannot reach every rank
    /// (processes, whose loaders may order their batches differently; thread replicas on
    /// several devices or on wgpu and CUDA, which cannot use a batch another thread built).
    Sliced,
}

impl Cut {
    /// The cut for a training loader that is a `DistributedDataLoader` (`distributed`) or not,
    /// in join mode or not, for `world_size` replicas, threads of this process or not, on
    /// `devices`.
    pub fn of(
        distributed: bool,
        join: bool,
        world_size: usize,
        threads: bool,
        devices: &[Device],
    ) -> Self {
        if world_size == 1 {
            Cut::Alone
        } else if distributed || join {
            Cut::Sampler
        } else if threads
            && devices.windows(2).all(|pair| pair[0] == pair[1])
            && devices
                .first()
                .is_some_and(crate::replica::shares_plain_values)
        {
            Cut::Dealt
        } else {
            Cut::Sliced
        }
    }

    /// Whether the ranks' loaders record on their threads what each step holds (the weights of
    /// a short last step, a rank without a sample in it).
    pub fn draws_steps(self, distributed: bool) -> bool {
        self == Cut::Dealt || (self != Cut::Sliced && distributed)
    }
}

/// The training loaders of the `local` ranks (global ranks run by this process, with their
/// groups, on `devices`) as `cut` says (`distributed`: the loader is a `DistributedDataLoader`); `timeout` bounds a dealt rank's wait for its batch.
/// Warns (on rank 0) when the cut does not give one device's steps.
///
/// # Errors
/// [`DdpError::InvalidConfig`] when slices would leave a rank without an item.
pub(super) fn train_loaders<M: LearnerModel>(
    loader: &TrainLoader<M>,
    (cut, distributed): (Cut, bool),
    local: &[(usize, Arc<dyn ProcessGroup>)],
    world_size: usize,
    devices: &[Device],
    timeout: Duration,
) -> Result<Vec<TrainLoader<M>>> {
    let ranks: Vec<usize> = local.iter().map(|(rank, _)| *rank).collect();
    let items = loader.num_items();
    let per_rank = items / world_size;
    match cut {
        Cut::Alone => return Ok(devices.iter().map(|d| loader.to_device(d)).collect()),
        Cut::Sampler => {
            if !distributed && ranks.contains(&0) {
                burn_ddp_comm::log::warn_console(
                    "UnevenInputs::Join with a training loader that is not a \
                     DistributedDataLoader: each replica trains a contiguous slice of it, so \
                     the steps are not one device's (a shuffled Burn loader shuffles inside its \
                     slice); a DistributedDataLoader built with \
                     DistributedSampler::with_uneven_shards trains as one device does",
                );
            }
            // With whole shards a rank may have no sample at all: it takes part in every step
            // without one.
            return Ok(ranks
                .iter()
                .zip(devices)
                .map(|(&rank, device)| {
                    let range = burn_ddp_comm::group::chunk_range(items, world_size, rank);
                    loader.slice(range.start, range.end).to_device(device)
                })
                .collect());
        }
        Cut::Dealt => {
            let dealer = Dealer::new(loader, &devices[0], world_size, ranks.clone());
            return Ok(local
                .iter()
                .map(|(_, group)| {
                    Arc::new(DealtLoader::new(dealer.clone(), group.clone(), timeout))
                        as TrainLoader<M>
                })
                .collect());
        }
        Cut::Sliced => {}
    }
    if per_rank == 0 {
        return Err(DdpError::InvalidConfig(format!(
            "the training set has {items} items, fewer than the {world_size} replicas"
        )));
    }
    if ranks.contains(&0) {
        // It changes what is trained: on the console, not only in burn-train's log file.
        burn_ddp_comm::log::warn_console(&format!(
            "the training loader is not a DistributedDataLoader, and its batches cannot reach \
             every replica in one device's order ({}): each replica trains a contiguous slice \
             of {per_rank} items{}, so the steps are not one device's; a DistributedDataLoader \
             (burn_ddp::DistributedDataLoader) trains as one device does",
            if devices.len() > 1 {
                "thread replicas on several devices, or on a backend whose tensors belong to \
                 their thread"
            } else {
                "between processes its order may differ from process to process"
            },
            if items.is_multiple_of(world_size) {
                String::new()
            } else {
                format!(" (the last {} items are not used)", items % world_size)
            }
        ));
    }
    Ok(ranks
        .iter()
        .zip(devices)
        .map(|(&rank, device)| {
            loader
                .slice(rank * per_rank, (rank + 1) * per_rank)
                .to_device(device)
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::{Regressor, loader};
    use burn_ddp_comm::group::ThreadGroup;

    fn local(world_size: usize) -> Vec<(usize, Arc<dyn ProcessGroup>)> {
        ThreadGroup::new_group(world_size)
            .unwrap()
            .into_iter()
            .enumerate()
            .map(|(rank, g)| (rank, Arc::new(g) as Arc<dyn ProcessGroup>))
            .collect()
    }

    #[test]
    fn the_cut_follows_the_loader_the_mode_and_the_devices() {
        let cpu = [Device::flex(), Device::flex()];
        assert_eq!(Cut::of(false, false, 1, true, &cpu[..1]), Cut::Alone);
        assert_eq!(Cut::of(true, false, 2, true, &cpu), Cut::Sampler);
        assert_eq!(Cut::of(false, true, 2, false, &cpu), Cut::Sampler);
        // One CPU device shared by thread replicas: one device's batches, dealt.
        assert_eq!(Cut::of(false, false, 2, true, &cpu), Cut::Dealt);
        // Processes: their loaders' orders may differ, so slices.
        assert_eq!(Cut::of(false, false, 2, false, &cpu[..1]), Cut::Sliced);
        assert!(Cut::Dealt.draws_steps(false));
        assert!(Cut::Sampler.draws_steps(true));
        assert!(!Cut::Sliced.draws_steps(true));
    }

    #[test]
    fn slices_are_equal_contiguous_and_drop_the_remainder_or_refuse_too_few_items() {
        let device = [Device::flex(), Device::flex(), Device::flex()];
        // 10 items for 3 ranks: 3 each, the last item unused.
        let shards = train_loaders::<Regressor>(
            &loader(10),
            (Cut::Sliced, false),
            &local(3),
            3,
            &device,
            Duration::from_secs(10),
        )
        .unwrap();
        let items: Vec<usize> = shards.iter().map(|s| s.num_items()).collect();
        assert_eq!(items, vec![3, 3, 3]);
        let err = train_loaders::<Regressor>(
            &loader(2),
            (Cut::Sliced, false),
            &local(3),
            3,
            &device,
            Duration::from_secs(10),
        )
        .err()
        .unwrap();
        assert!(
            err.to_string().contains("fewer than the 3 replicas"),
            "{err}"
        );
        // Whole shards for the sampler's cut: a rank may get nothing, none is dropped.
        let shards = train_loaders::<Regressor>(
            &loader(2),
            (Cut::Sampler, true),
            &local(3),
            3,
            &device,
            Duration::from_secs(10),
        )
        .unwrap();
        let items: usize = shards.iter().map(|s| s.num_items()).sum();
        assert_eq!(items, 2);
    }
}
