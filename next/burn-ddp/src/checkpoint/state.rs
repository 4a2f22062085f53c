//! The state files of checkpoints: where a run stood when rank 0 wrote a checkpoint, which record
//! files belong to it (with their SHA-256), which run wrote it, and (when the job has a token) an
//! HMAC-SHA-256 over all of it under the job's checkpoint key.
//!
//! - [`EpochState`], `ddp-state-<epoch>.json`, next to burn-train's epoch checkpoint;
//! - [`StepState`], `ddp-step-<run tag>-<n>.json`, a step checkpoint's (after a stop signal, or
//!   every [`DdpConfig::with_checkpoint_every`](crate::DdpConfig::with_checkpoint_every)
//!   optimizer steps).
//!
//! A state is written after its records are on disk, so its presence means they were complete;
//! [`verify`](SignedState::verify) says whether the files there now are the ones written.

use std::path::{Path, PathBuf};

use burn_ddp_comm::auth::CheckpointKey;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::file::{file_sha256, write_json};
use super::records::RecordFile;
use crate::error::{DdpError, Result};

/// The format of the state files burn-ddp writes on Burn 0.22 (its records are burnpack files).
/// burn-ddp on Burn 0.21 wrote format 1 (no such field; MessagePack records), which this one
/// cannot resume.
pub(crate) const FORMAT: u32 = 2;

fn format_1() -> u32 {
    1
}

/// Where a run stood at the end of an epoch (see the [module docs](self)).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct EpochState {
    /// The state file format ([`FORMAT`]; 1 when absent: burn-ddp on Burn 0.21).
    #[serde(default = "format_1")]
    pub format: u32,
    /// The epoch just finished (burn-train counts from 1).
    pub epoch: usize,
    /// Number of ranks of the job.
    pub world_size: usize,
    /// Optimizer steps taken since the start of the run (skipped steps excluded).
    pub optimizer_steps: u64,
    /// Gradient synchronisations since the start of the run, skipped steps included (they number
    /// the step checkpoints and set the cadence of the consistency check and of
    /// `with_checkpoint_every`).
    pub synchronisations: u64,
    /// The sampler epoch of the next epoch (what `DistributedDataLoader::with_epoch` takes, for a
    /// loader used outside `DdpStrategy`).
    pub next_sampler_epoch: u64,
    /// The run that wrote it.
    pub run_id: String,
    /// The epoch's record files written for this state (model, optimizer, LR scheduler) and their
    /// SHA-256; empty when burn-train's checkpointing strategy saved no records this epoch.
    #[serde(default)]
    pub records: Vec<RecordFile>,
    /// HMAC-SHA-256 of the state (without this field) under the job's checkpoint key, when the job
    /// has a token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mac: Option<String>,
}

/// Where a run stood at a step checkpoint (see the [module docs](self)).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct StepState {
    /// The state file format ([`FORMAT`]; 1 when absent: burn-ddp on Burn 0.21).
    #[serde(default = "format_1")]
    pub format: u32,
    /// The checkpoint's number (`n` in the file names): gradient synchronisations since the
    /// start of the run, skipped steps included.
    pub number: u64,
    /// The epoch in progress (burn-train counts from 1).
    pub epoch: usize,
    /// Batches of that epoch every rank had trained on (micro-batches with gradient
    /// accumulation; always at an optimizer step's boundary).
    pub batches: usize,
    /// Number of ranks of the job.
    pub world_size: usize,
    /// Optimizer steps taken since the start of the run (skipped steps excluded).
    pub optimizer_steps: u64,
    /// The run that wrote it.
    pub run_id: String,
    /// The checkpoint's record files (model, optimizer, LR scheduler) and their SHA-256.
    #[serde(default)]
    pub records: Vec<RecordFile>,
    /// HMAC-SHA-256 of the state (without this field) under the job's checkpoint key, when the job
    /// has a token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mac: Option<String>,
}

/// What the two kinds of state share: records, a signature, a JSON file.
pub(crate) trait SignedState: Serialize + DeserializeOwned + Clone {
    /// The record files the state names.
    fn records(&self) -> &[RecordFile];
    /// The state file format it was written in.
    fn format(&self) -> u32;
    /// The signature, if any.
    fn mac(&self) -> Option<&str>;
    /// Where the signature goes.
    fn mac_mut(&mut self) -> &mut Option<String>;

    /// The bytes the signature covers: the state as JSON without its signature.
    fn signed_bytes(&self) -> Vec<u8> {
        let mut unsigned = self.clone();
        *unsigned.mac_mut() = None;
        serde_json::to_vec(&unsigned).unwrap_or_default()
    }

    /// Signs the state under `key`.
    fn sign(&mut self, key: &CheckpointKey) {
        let mac = key.sign(&self.signed_bytes());
        *self.mac_mut() = Some(mac);
    }

    /// Why this state cannot be taken as this job's, if it cannot: written in another format
    /// (burn-ddp on Burn 0.21), or (with `key`) a signature that is missing or not the job's.
    fn check_signature(&self, key: Option<&CheckpointKey>) -> std::result::Result<(), String> {
        if self.format() != FORMAT {
            return Err(format!(
                "it was written in checkpoint format {} (burn-ddp on Burn 0.21 wrote 1), which \
                 burn-ddp on Burn 0.22 cannot resume (CHANGELOG, \"Moving to Burn 0.22\")",
                self.format()
            ));
        }
        if let Some(key) = key {
            match self.mac() {
                None => return Err("it is not signed with this job's key".into()),
                Some(mac) if !key.verifies(&self.signed_bytes(), mac) => {
                    return Err("its signature is not this job's (another token, or edited)".into());
                }
                Some(_) => {}
            }
        }
        Ok(())
    }

    /// Why the checkpoint in `dir` is not the one this state describes, if it is not: the
    /// [signature check](Self::check_signature)'s reasons, or a record file missing or changed
    /// since it was written (another file swapped in).
    fn verify(&self, dir: &Path, key: Option<&CheckpointKey>) -> std::result::Result<(), String> {
        self.check_signature(key)?;
        for record in self.records() {
            let path = record.path_in(dir)?;
            let actual = file_sha256(&path).map_err(|e| format!("{}: {e}", path.display()))?;
            record.check(&path, &actual)?;
        }
        Ok(())
    }

    /// Writes the state to `path` atomically.
    ///
    /// # Errors
    /// [`DdpError::Checkpoint`] naming the file.
    fn write_to(&self, path: &Path) -> Result<()> {
        write_json(self, path)
    }

    /// Reads the state file `path`: `Ok(None)` when there is none.
    ///
    /// # Errors
    /// [`DdpError::Checkpoint`] naming the file when it exists but cannot be read or parsed.
    fn read_from(path: &Path) -> Result<Option<Self>> {
        let fail = |detail: String| DdpError::Checkpoint {
            path: path.display().to_string(),
            detail,
        };
        match std::fs::read(path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(fail(format!("cannot read it: {e}"))),
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map(Some)
                .map_err(|e| fail(format!("not a burn-ddp checkpoint state: {e}"))),
        }
    }
}

macro_rules! signed_state {
    ($state:ty) => {
        impl SignedState for $state {
            fn records(&self) -> &[RecordFile] {
                &self.records
            }
            fn format(&self) -> u32 {
                self.format
            }
            fn mac(&self) -> Option<&str> {
                self.mac.as_deref()
            }
            fn mac_mut(&mut self) -> &mut Option<String> {
                &mut self.mac
            }
        }
    };
}
signed_state!(EpochState);
signed_state!(StepState);

impl EpochState {
    /// `dir/ddp-state-<epoch>.json`: one per epoch, as burn-train's epoch checkpoints are.
    pub fn path(dir: &Path, epoch: usize) -> PathBuf {
        dir.join(format!("ddp-state-{epoch}.json"))
    }
}

impl StepState {
    /// `dir/ddp-step-<tag>-<number>.json` for the run tagged `tag`.
    pub fn path(dir: &Path, tag: &str, number: u64) -> PathBuf {
        dir.join(format!("ddp-step-{tag}-{number}.json"))
    }

    /// This state's file in `dir`: `dir/ddp-step-<its run's tag>-<number>.json`.
    pub fn file_in(&self, dir: &Path) -> PathBuf {
        Self::path(dir, &super::run_tag(&self.run_id), self.number)
    }

    /// Every step state in `dir`, newest first (by number); files that cannot be read or parsed
    /// come back as `Err`, first.
    pub fn list(dir: &Path) -> Vec<Result<StepState>> {
        let mut found: Vec<Result<StepState>> = std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter(|entry| {
                let name = entry.file_name().to_string_lossy().into_owned();
                name.starts_with("ddp-step-") && name.ends_with(".json")
            })
            .filter_map(|entry| StepState::read_from(&entry.path()).transpose())
            .collect();
        found.sort_by_key(|state| match state {
            Ok(state) => (1, std::cmp::Reverse(state.number)),
            Err(_) => (0, std::cmp::Reverse(0)),
        });
        found
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn_ddp_comm::auth::JobIdentity;

    fn key(token: &[u8]) -> CheckpointKey {
        JobIdentity::new("run-x", Some(token))
            .unwrap()
            .checkpoint_key()
            .unwrap()
    }

    fn step(dir: &Path, number: u64) -> StepState {
        let name = format!("ddp-model-x-{number}.bpk");
        std::fs::write(dir.join(&name), format!("model {number}")).unwrap();
        StepState {
            format: FORMAT,
            number,
            epoch: 1,
            batches: 2,
            world_size: 2,
            optimizer_steps: number,
            run_id: "run-x".into(),
            records: vec![RecordFile {
                sha256: file_sha256(&dir.join(&name)).unwrap(),
                name,
            }],
            mac: None,
        }
    }

    #[test]
    fn a_signed_state_verifies_only_under_its_key_and_with_its_own_records() {
        let dir = tempfile::tempdir().unwrap();
        let mut state = step(dir.path(), 1);
        // Unsigned: fine without a key, refused with one.
        assert_eq!(state.verify(dir.path(), None), Ok(()));
        assert!(
            state
                .verify(dir.path(), Some(&key(b"the job's token")))
                .is_err()
        );
        state.sign(&key(b"the job's token"));
        assert_eq!(
            state.verify(dir.path(), Some(&key(b"the job's token"))),
            Ok(())
        );
        // Another job's key, or an edited state, does not verify.
        assert!(
            state
                .verify(dir.path(), Some(&key(b"another token")))
                .is_err()
        );
        let edited = StepState {
            batches: 3,
            ..state.clone()
        };
        assert!(
            edited
                .verify(dir.path(), Some(&key(b"the job's token")))
                .is_err()
        );
        // Nor does a record file that changed since the state was written, or a missing one.
        std::fs::write(dir.path().join("ddp-model-x-1.bpk"), b"another model").unwrap();
        let why = state.verify(dir.path(), None).unwrap_err();
        assert!(why.contains("ddp-model-x-1.bpk"), "{why}");
        std::fs::remove_file(dir.path().join("ddp-model-x-1.bpk")).unwrap();
        assert!(state.verify(dir.path(), None).is_err());
    }

    #[test]
    fn an_epoch_state_round_trips_and_binds_its_records() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("model-3.bpk"), b"epoch 3").unwrap();
        let state = EpochState {
            format: FORMAT,
            epoch: 3,
            world_size: 4,
            optimizer_steps: 300,
            synchronisations: 310,
            next_sampler_epoch: 3,
            run_id: "run-a".into(),
            records: vec![RecordFile {
                name: "model-3.bpk".into(),
                sha256: file_sha256(&dir.path().join("model-3.bpk")).unwrap(),
            }],
            mac: None,
        };
        let path = EpochState::path(dir.path(), 3);
        state.write_to(&path).unwrap();
        assert_eq!(EpochState::read_from(&path).unwrap(), Some(state.clone()));
        assert_eq!(state.verify(dir.path(), None), Ok(()));
        // A stale record swapped in under the same name is found.
        std::fs::write(
            dir.path().join("model-3.bpk"),
            b"epoch 3 of another attempt",
        )
        .unwrap();
        assert!(state.verify(dir.path(), None).is_err());
        assert_eq!(
            EpochState::read_from(&EpochState::path(dir.path(), 2)).unwrap(),
            None
        );
        std::fs::write(EpochState::path(dir.path(), 2), b"{").unwrap();
        let err = EpochState::read_from(&EpochState::path(dir.path(), 2)).unwrap_err();
        assert!(err.to_string().contains("ddp-state-2.json"), "{err}");
    }

    #[test]
    fn a_state_of_burn_ddp_on_burn_0_21_is_refused_with_its_reason() {
        let dir = tempfile::tempdir().unwrap();
        let path = EpochState::path(dir.path(), 1);
        // What burn-ddp 0.1 on Burn 0.21 wrote after epoch 1.
        std::fs::write(
            &path,
            r#"{"epoch":1,"world_size":2,"optimizer_steps":10,"next_sampler_epoch":1,
               "synchronisations":10,"run_id":"old"}"#,
        )
        .unwrap();
        let state = EpochState::read_from(&path).unwrap().unwrap();
        assert_eq!(state.format, 1);
        let why = state.verify(dir.path(), None).unwrap_err();
        assert!(why.contains("Burn 0.21"), "{why}");
    }

    #[test]
    fn step_states_are_listed_newest_first_after_the_unreadable_ones() {
        let dir = tempfile::tempdir().unwrap();
        for number in [3, 10, 7] {
            let state = step(dir.path(), number);
            state
                .write_to(&StepState::path(dir.path(), "x", number))
                .unwrap();
        }
        std::fs::write(dir.path().join("ddp-step-x-99.json"), b"not json").unwrap();
        let listed = StepState::list(dir.path());
        assert!(listed[0].is_err());
        let numbers: Vec<u64> = listed[1..]
            .iter()
            .map(|s| s.as_ref().unwrap().number)
            .collect();
        assert_eq!(numbers, vec![10, 7, 3]);
    }
}
