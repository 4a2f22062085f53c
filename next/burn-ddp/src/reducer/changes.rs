//! The layout the ranks agreed on, and what happens when the model's trained tensors change:
//! adopting a new agreed layout (a layer frozen or unfrozen on every rank), and the
//! `ModelChanged` error, the same on every rank, for any other change (each rank describes the
//! first tensor where its model differs, gathered as text).

use std::time::Duration;

use super::gradients::numels;
use super::layout::{BucketLayout, trainable};
use super::link::Link;
use crate::error::{DdpError, Result};
use crate::replica::{LayoutFingerprints, ReplicaLayout, ReplicaView, TensorSpec};
use burn_ddp_comm::group::ProcessGroup;

/// What the reducer noticed about the model before a step.
pub(super) struct Changes {
    /// The step's gradient synchronisation number.
    pub step: u64,
    /// The model's tensors themselves changed (added, removed, replaced).
    pub structure_changed: bool,
    /// Only which tensors are trainable changed.
    pub trainable_changed: bool,
    /// This rank's new layout, when its trainable tensors changed.
    pub proposed: Option<ReplicaLayout>,
    /// This rank's fingerprints now (adopted with `proposed`).
    pub seen: LayoutFingerprints,
}

/// The layout the ranks agreed on last (at start-up, or when the trainable tensors changed) and
/// the buckets it gives.
pub(super) struct Agreed {
    pub replica: ReplicaLayout,
    /// This rank's fingerprints of `replica`.
    fingerprints: LayoutFingerprints,
    /// The parameters reduced every step (`replica`'s trainable tensors, each id once).
    pub params: Vec<TensorSpec>,
    pub layout: BucketLayout,
    first_cap_bytes: usize,
    cap_bytes: usize,
}

impl Agreed {
    /// `replica`'s trainable tensors in buckets of the given caps (bytes).
    pub fn new(replica: &ReplicaLayout, first_cap_bytes: usize, cap_bytes: usize) -> Self {
        let params = trainable(replica);
        Self {
            layout: BucketLayout::at_least_one(&numels(&params), first_cap_bytes, cap_bytes),
            params,
            fingerprints: replica.fingerprints(),
            replica: replica.clone(),
            first_cap_bytes,
            cap_bytes,
        }
    }

    /// How `replica` differs from the agreed layout at gradient synchronisation `step` (no
    /// tensor data is read).
    pub fn changes(&self, replica: &dyn ReplicaView, step: u64) -> Changes {
        let seen = replica.fingerprints();
        let structure_changed = seen.structure != self.fingerprints.structure;
        let trainable_changed = !structure_changed && seen.trainable != self.fingerprints.trainable;
        Changes {
            step,
            structure_changed,
            trainable_changed,
            proposed: trainable_changed.then(|| self.replica.with_trainable(&replica.scan())),
            seen,
        }
    }

    /// Buckets of `specs` with the agreed caps (the newly trainable tensors of a step).
    pub fn buckets_of(&self, specs: &[TensorSpec]) -> BucketLayout {
        BucketLayout::new(&numels(specs), self.first_cap_bytes, self.cap_bytes)
    }

    /// Makes `layout` the agreed one: its trainable tensors are reduced from the next step on.
    pub fn adopt(
        &mut self,
        layout: ReplicaLayout,
        fingerprints: LayoutFingerprints,
        step: u64,
        rank: usize,
    ) {
        *self = Self {
            fingerprints,
            ..Self::new(&layout, self.first_cap_bytes, self.cap_bytes)
        };
        tracing::debug!(
            "burn-ddp: rank {rank}: {} trainable tensor(s) in {} bucket(s) from gradient \
             synchronisation #{step} on",
            self.params.len(),
            self.layout.buckets().len()
        );
    }

    /// The error of a step where some rank's model tensors changed (or held gradients of tensors
    /// it does not train), the same on every rank: every rank reports where its model first
    /// differs from the agreed layout (one all-gather), and each names that tensor as its own
    /// model has it. `unknown`: this rank's gradients that belong to no tensor it trains.
    pub fn structure_error(
        &self,
        link: &Link,
        step: u64,
        replica: &dyn ReplicaView,
        unknown: usize,
    ) -> Result<DdpError> {
        let rank = link.group.rank();
        let now = replica.scan();
        let mine = first_difference(&self.replica, &now);
        // Each rank describes its own change: only the rank that changed knows its new tensors.
        let described = mine
            .map(|index| describe_change(&self.replica, &now, index))
            .unwrap_or_default();
        let words = [mine.map_or(0, |i| i as u64 + 1), unknown as u64];
        let (all, descriptions) = if link.group.world_size() == 1 {
            (words.to_vec(), vec![described])
        } else {
            let all = link.group.all_gather(&words, link.timeout)?;
            let descriptions = gather_text(link.group.as_ref(), &described, link.timeout)?;
            (all, descriptions)
        };
        let reports: Vec<(usize, Option<usize>, usize)> = all
            .chunks(2)
            .enumerate()
            .map(|(r, w)| (r, w[0].checked_sub(1).map(|i| i as usize), w[1] as usize))
            .collect();
        let changed: Vec<usize> = reports
            .iter()
            .filter(|(_, first, unknown)| first.is_some() || *unknown > 0)
            .map(|(r, _, _)| *r)
            .collect();
        let detail = match reports
            .iter()
            .find_map(|(r, first, _)| first.map(|i| (*r, i)))
        {
            Some((who, _)) => format!(
                "rank(s) {changed:?} changed the model's tensors since the process group was set \
                 up: {} (first seen on rank {who}); layers must not be added, removed or \
                 replaced during data-parallel training (build a new DistributedDataParallel, or \
                 start a new run, after changing the model)",
                descriptions.get(who).map_or("?", String::as_str)
            ),
            None => {
                let (who, _, count) = reports
                    .iter()
                    .find(|(_, _, unknown)| *unknown > 0)
                    .copied()
                    .unwrap_or((rank, None, unknown));
                format!(
                    "rank {who} has gradients for {count} tensor(s) that its model does not train \
                     (gradients of another model, or of a tensor that does not require \
                     gradients?)"
                )
            }
        };
        Ok(DdpError::ModelChanged { rank, step, detail })
    }
}

/// The first tensor (registration order) where `now` differs from `agreed` in shape, element
/// size or id, or exists on one side only.
fn first_difference(agreed: &ReplicaLayout, now: &ReplicaLayout) -> Option<usize> {
    let (a, n) = (agreed.tensors(), now.tensors());
    (0..a.len().max(n.len())).find(|&i| match (a.get(i), n.get(i)) {
        (Some(a), Some(n)) => {
            a.shape != n.shape || a.element_bytes != n.element_bytes || a.id != n.id
        }
        _ => true,
    })
}

/// Every rank's `text` (UTF-8, at most a few KiB), in rank order: two all-gathers (the lengths,
/// then the bytes padded to the longest).
fn gather_text(group: &dyn ProcessGroup, text: &str, timeout: Duration) -> Result<Vec<String>> {
    let lengths = group.all_gather(&[text.len() as u64], timeout)?;
    let longest = lengths.iter().copied().max().unwrap_or(0) as usize;
    let words = longest.div_ceil(8);
    let mut mine = vec![0u64; words];
    for (i, byte) in text.bytes().enumerate() {
        mine[i / 8] |= u64::from(byte) << (8 * (i % 8));
    }
    let all = if words == 0 {
        vec![0; 0]
    } else {
        group.all_gather(&mine, timeout)?
    };
    Ok(lengths
        .iter()
        .enumerate()
        .map(|(rank, &len)| {
            let bytes: Vec<u8> = (0..len as usize)
                .map(|i| (all[rank * words + i / 8] >> (8 * (i % 8))) as u8)
                .collect();
            String::from_utf8_lossy(&bytes).into_owned()
        })
        .collect())
}

/// "tensor #4 `extra.weight` appeared", as this rank's model has it.
fn describe_change(agreed: &ReplicaLayout, now: &ReplicaLayout, index: usize) -> String {
    match (agreed.tensors().get(index), now.tensors().get(index)) {
        (None, Some(n)) => format!(
            "tensor #{index} `{}` (shape {:?}) appeared after the {} tensors of the start",
            n.path,
            n.shape,
            agreed.tensors().len()
        ),
        (Some(a), None) => format!(
            "tensor #{index} `{}` (shape {:?}) disappeared: the model has {} tensors, {} at the \
             start",
            a.path,
            a.shape,
            now.tensors().len(),
            agreed.tensors().len()
        ),
        (Some(a), Some(n)) if a.shape != n.shape || a.element_bytes != n.element_bytes => format!(
            "tensor #{index} was `{}` of shape {:?}, now `{}` of shape {:?}",
            a.path, a.shape, n.path, n.shape
        ),
        (Some(_), Some(n)) => format!(
            "tensor #{index} `{}` was replaced by another tensor (a new parameter id)",
            n.path
        ),
        (None, None) => format!(
            "tensor #{index}, which this rank's model does not have (it has {} tensors)",
            now.tensors().len()
        ),
    }
}
