//! Checkpoints that survive a crash mid-write, and the job state a resumed run checks.
//!
//! - [`AtomicRecorder`] wraps any Burn file recorder so that every file is written under a
//!   temporary name, synced to disk and renamed into place: a checkpoint file is either the old
//!   one or the complete new one, never half written. Give it to
//!   `SupervisedTraining::with_file_checkpointer`; with [`DdpStrategy`](crate::DdpStrategy) only
//!   global rank 0 writes checkpoints.
//! - A DDP state is what rank 0 writes next to them after every epoch (`ddp-state-<epoch>.json`,
//!   atomically) when [`DdpConfig::with_checkpoint_dir`](crate::DdpConfig::with_checkpoint_dir) is
//!   set: the world size, the epoch, the optimizer steps. A resumed run reads it and refuses a
//!   different world size, which would silently change the per-rank batch and the data shards.
//!
//! What resuming restores: burn-train's checkpoint (model, optimizer, LR scheduler) through
//! `SupervisedTraining::checkpoint(epoch)`; the data order follows, because under
//! [`DdpStrategy`](crate::DdpStrategy) the [`DistributedDataLoader`](crate::DistributedDataLoader)
//! takes its epoch from burn-train's (the strategy sets it before every epoch). A
//! resumed run then trains exactly as the uninterrupted run would have (tested bit for bit).
//!
//! A run stopped by SIGTERM, SIGINT or SIGHUP ([`DdpConfig::with_stop_on_signal`](
//! crate::DdpConfig::with_stop_on_signal)) writes a checkpoint of the step it stopped at and
//! exits with [`PREEMPTED_EXIT_CODE`].

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use burn::record::{FileRecorder, Recorder, RecorderError};
use burn::tensor::backend::Backend;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::error::{DdpError, Result};

pub use burn_ddp_comm::signals::PREEMPTED_EXIT_CODE;

/// A Burn file recorder that writes atomically: to a temporary file in the same directory, synced,
/// then renamed over the final name. Reading is the wrapped recorder's.
///
/// ```
/// use burn::record::{FullPrecisionSettings, NamedMpkFileRecorder};
/// use burn_ddp::checkpoint::AtomicRecorder;
///
/// let recorder = AtomicRecorder::new(NamedMpkFileRecorder::<FullPrecisionSettings>::new());
/// // training.with_file_checkpointer(recorder)
/// # let _ = recorder;
/// ```
#[derive(Debug, Clone, Default)]
pub struct AtomicRecorder<R> {
    inner: R,
}

impl<R> AtomicRecorder<R> {
    /// Wraps `inner`.
    pub fn new(inner: R) -> Self {
        Self { inner }
    }
}

/// `dir/.tmp-<name>-<pid>-<n>` for the final `dir/<name>`: unique per process and per call (two
/// threads saving the same name never share a temporary), and no dot after the prefix, so the
/// wrapped recorder's `set_extension` only appends its extension.
fn temporary_for(file: &Path) -> PathBuf {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let name = file
        .file_name()
        .map(|n| n.to_string_lossy().replace('.', "_"))
        .unwrap_or_default();
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    file.with_file_name(format!(".tmp-{name}-{}-{n}", std::process::id()))
}

/// Syncs `written` to disk, renames it over `target` and syncs the directory so the rename is
/// durable too. On failure the temporary is removed and `target` is left as it was.
fn publish(written: &Path, target: &Path) -> std::io::Result<()> {
    let result = std::fs::OpenOptions::new()
        .write(true)
        .open(written)
        .and_then(|f| f.sync_all())
        .and_then(|()| std::fs::rename(written, target));
    if result.is_err() {
        let _ = std::fs::remove_file(written);
        return result;
    }
    if let Some(dir) = target.parent()
        && let Ok(dir) = std::fs::File::open(dir)
    {
        // Best effort: directories cannot be opened for syncing on every platform.
        let _ = dir.sync_all();
    }
    Ok(())
}

impl<B: Backend, R: FileRecorder<B>> Recorder<B> for AtomicRecorder<R> {
    type Settings = R::Settings;
    type RecordArgs = PathBuf;
    type RecordOutput = ();
    type LoadArgs = PathBuf;

    fn save_item<I: Serialize>(
        &self,
        item: I,
        file: PathBuf,
    ) -> std::result::Result<(), RecorderError> {
        let extension = <R as FileRecorder<B>>::file_extension();
        let target = file.with_extension(extension);
        let temporary = temporary_for(&file);
        let written = temporary.with_extension(extension);
        if let Err(e) = self.inner.save_item(item, temporary) {
            // A half-written temporary is garbage; the previous checkpoint stays.
            let _ = std::fs::remove_file(&written);
            return Err(e);
        }
        publish(&written, &target).map_err(|e| {
            RecorderError::Unknown(format!(
                "cannot move {} to {}: {e}",
                written.display(),
                target.display()
            ))
        })
    }

    fn load_item<I: DeserializeOwned>(
        &self,
        file: &mut PathBuf,
    ) -> std::result::Result<I, RecorderError> {
        self.inner.load_item(file)
    }
}

impl<B: Backend, R: FileRecorder<B>> FileRecorder<B> for AtomicRecorder<R> {
    fn file_extension() -> &'static str {
        R::file_extension()
    }
}

/// The job state rank 0 writes after every epoch (see the [module docs](self)).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct DdpState {
    /// The epoch just finished (burn-train counts from 1).
    pub epoch: usize,
    /// Number of ranks of the job.
    pub world_size: usize,
    /// Optimizer steps taken since the start of the run (skipped steps excluded).
    pub optimizer_steps: u64,
    /// The sampler epoch of the next epoch (what `DistributedDataLoader::with_epoch` takes, for a
    /// loader used outside `DdpStrategy`).
    pub next_sampler_epoch: u64,
    /// Gradient synchronisations since the start of the run, skipped steps included (they number
    /// the step checkpoints and set the cadence of the consistency check and of
    /// `with_checkpoint_every`). 0 when read from a state written before this field existed.
    #[serde(default)]
    pub synchronisations: u64,
    /// The run that wrote it (a resumed run takes only its own run's checkpoints). `None` when
    /// read from a state written before this field existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_id: Option<String>,
    /// HMAC-SHA-256 of the state (without this field) under the job's key, when the job has a
    /// token (`BURN_DDP_JOB_TOKEN`, or the launcher's): a resumed run of the job checks it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mac: Option<String>,
}

impl DdpState {
    /// `dir/ddp-state-<epoch>.json`.
    pub fn path(dir: &Path, epoch: usize) -> PathBuf {
        dir.join(format!("ddp-state-{epoch}.json"))
    }

    /// Writes the state atomically (temporary file, sync, rename).
    ///
    /// # Errors
    /// [`DdpError::Checkpoint`] naming the file.
    pub fn write(&self, dir: &Path) -> Result<()> {
        write_json(self, &Self::path(dir, self.epoch))
    }

    /// The bytes the signature covers: the state as JSON without its signature.
    fn signed_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(&DdpState {
            mac: None,
            ..self.clone()
        })
        .unwrap_or_default()
    }

    /// Signs the state under `key`.
    pub(crate) fn sign(&mut self, key: &burn_ddp_comm::auth::CheckpointKey) {
        self.mac = Some(key.sign(&self.signed_bytes()));
    }

    /// Whether the state carries `key`'s signature.
    pub(crate) fn signed_by(&self, key: &burn_ddp_comm::auth::CheckpointKey) -> bool {
        self.mac
            .as_deref()
            .is_some_and(|mac| key.verifies(&self.signed_bytes(), mac))
    }

    /// Reads the state written after `epoch`, if there is one.
    ///
    /// # Errors
    /// [`DdpError::Checkpoint`] when the file exists but cannot be read or parsed.
    pub fn read(dir: &Path, epoch: usize) -> Result<Option<DdpState>> {
        let path = Self::path(dir, epoch);
        match std::fs::read(&path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(DdpError::Checkpoint {
                path: path.display().to_string(),
                detail: e.to_string(),
            }),
            Ok(bytes) => {
                serde_json::from_slice(&bytes)
                    .map(Some)
                    .map_err(|e| DdpError::Checkpoint {
                        path: path.display().to_string(),
                        detail: e.to_string(),
                    })
            }
        }
    }
}

/// Where a run stood when rank 0 wrote a **step checkpoint** (after a stop signal, or every
/// [`DdpConfig::with_checkpoint_every`](crate::DdpConfig::with_checkpoint_every) optimizer
/// steps): `ddp-step-<run>-<n>.json`, written atomically after the checkpoint's model, optimizer
/// and LR scheduler files (`ddp-model-<run>-<n>.mpk`, `ddp-optim-<run>-<n>.mpk`,
/// `ddp-scheduler-<run>-<n>.mpk`, full precision) were written and read back, so its presence
/// means the files were complete; it holds their SHA-256, which a resume checks. `<run>` is the
/// run id made safe for a file name, so runs sharing a directory never touch each
/// other's files. `n` counts the gradient synchronisations of the run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepState {
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
    /// The run that wrote it (a resumed run takes only its own run's checkpoints). `None` when
    /// read from a state written before this field existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_id: Option<String>,
    /// The checkpoint's record files (model, optimizer, LR scheduler, in the state's directory)
    /// and their SHA-256. Empty when read from a state written before this field existed (its
    /// files are then `ddp-model-<n>.mpk`, ..., unchecked).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(crate) records: Vec<RecordFile>,
    /// HMAC-SHA-256 of the state (without this field) under the job's key, when the job has a
    /// token: a resumed run of the job checks it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mac: Option<String>,
}

/// A record file of a step checkpoint and its content's SHA-256.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct RecordFile {
    /// The file's name, in the state file's directory.
    pub name: String,
    /// SHA-256 of its bytes, hexadecimal.
    pub sha256: String,
}

/// A run id as a part of file names: its letters, digits, `.` and `_` (others become `_`, at
/// most 40), then `-` and 8 hexadecimal digits of its SHA-256, so two run ids never share a tag.
pub(crate) fn run_tag(run_id: &str) -> String {
    use sha2::Digest;
    let safe: String = run_id
        .chars()
        .map(|c| match c {
            'a'..='z' | 'A'..='Z' | '0'..='9' | '.' | '_' => c,
            _ => '_',
        })
        .take(40)
        .collect();
    let digest = sha2::Sha256::digest(run_id.as_bytes());
    let short: String = digest[..4].iter().map(|b| format!("{b:02x}")).collect();
    format!("{safe}-{short}")
}

/// SHA-256 of a file's bytes, hexadecimal.
///
/// # Errors
/// The file cannot be read.
pub(crate) fn file_sha256(path: &Path) -> std::io::Result<String> {
    use sha2::Digest;
    let mut file = std::fs::File::open(path)?;
    let mut hasher = sha2::Sha256::new();
    std::io::copy(&mut file, &mut hasher)?;
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

impl StepState {
    /// The record files' prefixes of step checkpoints (the recorder adds `-<n>.mpk`).
    const RECORDS: [&'static str; 3] = ["ddp-model", "ddp-optim", "ddp-scheduler"];

    /// The prefixes of the record files of run `run_id`'s step checkpoints (`None`: a state
    /// written before they carried the run's tag).
    pub(crate) fn prefixes_of(run_id: Option<&str>) -> [String; 3] {
        Self::RECORDS.map(|record| match run_id {
            Some(run_id) => format!("{record}-{}", run_tag(run_id)),
            None => record.to_string(),
        })
    }

    /// The prefixes of this checkpoint's record files.
    pub(crate) fn prefixes(&self) -> [String; 3] {
        Self::prefixes_of(self.tagged().then_some(self.run_id.as_deref()).flatten())
    }

    /// Whether its files carry the run's tag (states written with their records' hashes do).
    fn tagged(&self) -> bool {
        !self.records.is_empty() && self.run_id.is_some()
    }

    /// The state file of checkpoint `number` of run `run_id` in `dir`:
    /// `dir/ddp-step-<run tag>-<number>.json`.
    pub fn path_of(dir: &Path, run_id: &str, number: u64) -> PathBuf {
        dir.join(format!("ddp-step-{}-{number}.json", run_tag(run_id)))
    }

    /// The names of the checkpoint's record files (model, optimizer, LR scheduler), in the
    /// state file's directory; none for a state written before states listed them.
    pub fn record_files(&self) -> impl Iterator<Item = &str> {
        self.records.iter().map(|record| record.name.as_str())
    }

    /// This state's file in `dir`.
    pub fn file_in(&self, dir: &Path) -> PathBuf {
        match (&self.run_id, self.tagged()) {
            (Some(run_id), true) => Self::path_of(dir, run_id, self.number),
            _ => dir.join(format!("ddp-step-{}.json", self.number)),
        }
    }

    /// The bytes the signature covers: the state as JSON without its signature.
    fn signed_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(&StepState {
            mac: None,
            ..self.clone()
        })
        .unwrap_or_default()
    }

    /// Signs the state under `key`.
    pub(crate) fn sign(&mut self, key: &burn_ddp_comm::auth::CheckpointKey) {
        self.mac = Some(key.sign(&self.signed_bytes()));
    }

    /// Why the checkpoint is not the one its state describes, if it is not: a record file
    /// missing, or changed since it was written (another file swapped in), or (with `key`) a
    /// signature that is missing or not the job's.
    pub(crate) fn verify(
        &self,
        dir: &Path,
        key: Option<&burn_ddp_comm::auth::CheckpointKey>,
    ) -> std::result::Result<(), String> {
        if let Some(key) = key {
            match &self.mac {
                None => return Err("it is not signed with this job's key".into()),
                Some(mac) if !key.verifies(&self.signed_bytes(), mac) => {
                    return Err("its signature is not this job's (another token, or edited)".into());
                }
                Some(_) => {}
            }
        }
        for record in &self.records {
            let path = dir.join(&record.name);
            let actual = file_sha256(&path).map_err(|e| format!("{}: {e}", path.display()))?;
            if actual != record.sha256 {
                return Err(format!(
                    "{} is not the file it was written with (SHA-256 {actual}, the state says {})",
                    path.display(),
                    record.sha256
                ));
            }
        }
        Ok(())
    }

    /// Writes the state atomically (temporary file, sync, rename), to
    /// [`file_in`](Self::file_in)`(dir)`.
    ///
    /// # Errors
    /// [`DdpError::Checkpoint`] naming the file.
    pub fn write(&self, dir: &Path) -> Result<()> {
        write_json(self, &self.file_in(dir))
    }

    /// Reads a state file.
    ///
    /// # Errors
    /// The file cannot be read or parsed, as a message.
    pub fn read(path: &Path) -> std::result::Result<StepState, String> {
        std::fs::read(path)
            .map_err(|e| e.to_string())
            .and_then(|bytes| serde_json::from_slice(&bytes).map_err(|e| e.to_string()))
    }

    /// Every step state in `dir`, newest first (by number); files that cannot be read or parsed
    /// come back as `Err((path, why))`, in no particular order.
    pub fn list(dir: &Path) -> Vec<std::result::Result<StepState, (PathBuf, String)>> {
        let mut found: Vec<std::result::Result<StepState, (PathBuf, String)>> =
            std::fs::read_dir(dir)
                .into_iter()
                .flatten()
                .flatten()
                .filter(|entry| {
                    let name = entry.file_name().to_string_lossy().into_owned();
                    name.starts_with("ddp-step-") && name.ends_with(".json")
                })
                .map(|entry| {
                    let path = entry.path();
                    Self::read(&path).map_err(|why| (path, why))
                })
                .collect();
        found.sort_by_key(|state| match state {
            Ok(state) => std::cmp::Reverse(state.number),
            Err(_) => std::cmp::Reverse(0),
        });
        found
    }

    /// Removes the checkpoint from `dir`: its state file first (so an interrupted removal never
    /// leaves a state without its records), then its record files. Missing files are fine.
    ///
    /// # Errors
    /// [`DdpError::Checkpoint`] naming a file that exists but cannot be removed.
    pub(crate) fn remove(&self, dir: &Path) -> Result<()> {
        let records = self
            .prefixes()
            .map(|p| dir.join(format!("{p}-{}.mpk", self.number)));
        for path in std::iter::once(self.file_in(dir)).chain(records) {
            match std::fs::remove_file(&path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(DdpError::Checkpoint {
                        path: path.display().to_string(),
                        detail: format!("cannot delete the older step checkpoint: {e}"),
                    });
                }
                _ => {}
            }
        }
        Ok(())
    }
}

/// Writes `value` as JSON to `target` atomically.
fn write_json<T: Serialize>(value: &T, target: &Path) -> Result<()> {
    let fail = |e: String| DdpError::Checkpoint {
        path: target.display().to_string(),
        detail: e,
    };
    if let Some(dir) = target.parent() {
        std::fs::create_dir_all(dir).map_err(|e| fail(e.to_string()))?;
    }
    let temporary = temporary_for(target);
    let json = serde_json::to_vec_pretty(value).map_err(|e| fail(e.to_string()))?;
    std::fs::write(&temporary, &json)
        .and_then(|()| publish(&temporary, target))
        .map_err(|e| {
            let _ = std::fs::remove_file(&temporary);
            fail(e.to_string())
        })
}

/// The epochs with a burn-train checkpoint in `dir` (a `model-<epoch>.*` file), newest first.
pub(crate) fn epoch_checkpoints(dir: &Path) -> Vec<usize> {
    let mut epochs: Vec<usize> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let name = entry.file_name().to_string_lossy().into_owned();
            let rest = name.strip_prefix("model-")?;
            rest.split('.').next()?.parse().ok()
        })
        .collect();
    epochs.sort_unstable_by(|a, b| b.cmp(a));
    epochs.dedup();
    epochs
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::NdArray;
    use burn::module::Module;
    use burn::nn::{Linear, LinearConfig};
    use burn::record::{FullPrecisionSettings, NamedMpkFileRecorder};

    type B = NdArray;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("burn-ddp-ckpt-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn the_atomic_recorder_writes_the_final_name_only_and_reads_it_back() {
        let dir = scratch("atomic");
        let recorder = AtomicRecorder::new(NamedMpkFileRecorder::<FullPrecisionSettings>::new());
        let layer: Linear<B> = LinearConfig::new(3, 2).init(&Default::default());
        // Burn initialises lazily, per clone: create the values before cloning.
        let _ = layer.weight.val();
        Recorder::<B>::record(&recorder, layer.clone().into_record(), dir.join("model-1")).unwrap();
        let names: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            names,
            vec!["model-1.mpk".to_string()],
            "no temporary file is left"
        );
        let loaded: <Linear<B> as Module<B>>::Record =
            Recorder::<B>::load(&recorder, dir.join("model-1"), &Default::default()).unwrap();
        let reloaded = layer.clone().load_record(loaded);
        assert_eq!(
            reloaded.weight.val().into_data(),
            layer.weight.val().into_data()
        );
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn a_failed_write_leaves_the_previous_file_in_place() {
        let dir = scratch("failed");
        std::fs::write(dir.join("model-1.mpk"), b"previous").unwrap();
        // A recorder that fails half-way, after creating its file.
        #[derive(Debug, Clone, Default)]
        struct Failing;
        impl Recorder<B> for Failing {
            type Settings = FullPrecisionSettings;
            type RecordArgs = PathBuf;
            type RecordOutput = ();
            type LoadArgs = PathBuf;
            fn save_item<I: Serialize>(
                &self,
                _item: I,
                mut file: PathBuf,
            ) -> std::result::Result<(), RecorderError> {
                file.set_extension("mpk");
                std::fs::write(&file, b"half").unwrap();
                Err(RecorderError::Unknown("disk full".into()))
            }
            fn load_item<I: DeserializeOwned>(
                &self,
                _file: &mut PathBuf,
            ) -> std::result::Result<I, RecorderError> {
                Err(RecorderError::Unknown("unused".into()))
            }
        }
        impl FileRecorder<B> for Failing {
            fn file_extension() -> &'static str {
                "mpk"
            }
        }
        let layer: Linear<B> = LinearConfig::new(3, 2).init(&Default::default());
        let recorder = AtomicRecorder::new(Failing);
        assert!(
            Recorder::<B>::record(&recorder, layer.into_record(), dir.join("model-1")).is_err()
        );
        assert_eq!(std::fs::read(dir.join("model-1.mpk")).unwrap(), b"previous");
        let left: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(left, vec!["model-1.mpk".to_string()], "no temporary left");
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn the_ddp_state_round_trips() {
        let dir = scratch("state");
        let state = DdpState {
            epoch: 3,
            world_size: 4,
            optimizer_steps: 300,
            next_sampler_epoch: 3,
            synchronisations: 310,
            run_id: Some("run-a".into()),
            mac: None,
        };
        state.write(&dir).unwrap();
        assert_eq!(DdpState::read(&dir, 3).unwrap(), Some(state.clone()));
        // A state written before `synchronisations` existed still reads.
        std::fs::write(
            DdpState::path(&dir, 3),
            r#"{"epoch":3,"world_size":4,"optimizer_steps":300,"next_sampler_epoch":3}"#,
        )
        .unwrap();
        assert_eq!(
            DdpState::read(&dir, 3).unwrap(),
            Some(DdpState {
                synchronisations: 0,
                run_id: None,
                ..state
            })
        );
        assert_eq!(DdpState::read(&dir, 2).unwrap(), None);
        std::fs::write(DdpState::path(&dir, 2), b"{").unwrap();
        assert!(DdpState::read(&dir, 2).is_err());
        let _ = std::fs::remove_dir_all(dir);
    }
    #[test]
    fn a_signed_step_state_verifies_only_under_its_key_and_with_its_own_records() {
        let dir = scratch("signed");
        std::fs::create_dir_all(&dir).unwrap();
        let record = dir.join("ddp-model-x-1.mpk");
        std::fs::write(&record, b"the model's bytes").unwrap();
        let key = |token: &[u8]| {
            burn_ddp_comm::auth::JobIdentity::new("run-x", Some(token))
                .unwrap()
                .checkpoint_key()
                .unwrap()
        };
        let mut state = StepState {
            number: 1,
            epoch: 1,
            batches: 2,
            world_size: 2,
            optimizer_steps: 1,
            run_id: Some("run-x".into()),
            records: vec![RecordFile {
                name: "ddp-model-x-1.mpk".into(),
                sha256: file_sha256(&record).unwrap(),
            }],
            mac: None,
        };
        // Unsigned: fine without a key, refused with one.
        assert_eq!(state.verify(&dir, None), Ok(()));
        assert!(state.verify(&dir, Some(&key(b"the job's token"))).is_err());
        state.sign(&key(b"the job's token"));
        assert_eq!(state.verify(&dir, Some(&key(b"the job's token"))), Ok(()));
        // Another job's key, or an edited state, does not verify.
        assert!(state.verify(&dir, Some(&key(b"another token"))).is_err());
        let edited = StepState {
            batches: 3,
            ..state.clone()
        };
        assert!(edited.verify(&dir, Some(&key(b"the job's token"))).is_err());
        // Nor does a record file that changed since the state was written.
        std::fs::write(&record, b"another model's bytes").unwrap();
        let why = state.verify(&dir, None).unwrap_err();
        assert!(why.contains("ddp-model-x-1.mpk"), "{why}");
        // A state survives its JSON round trip with its signature.
        state.write(&dir).unwrap();
        assert_eq!(StepState::read(&state.file_in(&dir)), Ok(state.clone()));
        assert!(
            state
                .file_in(&dir)
                .ends_with(format!("ddp-step-{}-1.json", run_tag("run-x")))
        );
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn run_tags_are_file_name_safe_and_tell_run_ids_apart() {
        assert_ne!(run_tag("run/a"), run_tag("run_a"));
        assert!(
            run_tag("job 7: ../../etc")
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "._-".contains(c))
        );
        assert!(run_tag(&"x".repeat(128)).len() <= 49);
    }
}
