//! burn-train's records (model, optimizer, LR scheduler) as checkpoint files: burn-ddp's
//! [`RecordCheckpointer`], a drop-in for burn-train's `FileCheckpointer` that writes each record's
//! burnpack bytes atomically and notes their SHA-256 in a [`Ledger`], so that the state file of
//! an epoch or a step can name exactly the record files written for it, and a resume can check
//! that the files it loads are those.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use burn::tensor::Bytes;
use burn::train::checkpoint::{Checkpoint, Checkpointer, CheckpointerError};
use serde::{Deserialize, Serialize};

use super::file::{remove_if_present, sha256_hex, write_atomically};

/// A record file of a checkpoint and its content's SHA-256.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct RecordFile {
    /// The file's name, in the checkpoint directory.
    pub name: String,
    /// SHA-256 of its bytes, 64 lowercase hexadecimal digits.
    pub sha256: String,
}

impl RecordFile {
    /// The file in `dir`, when its name is one plain file name (a state's names are not
    /// trusted: no separator, no `..`, nothing absolute).
    ///
    /// # Errors
    /// A message naming the name.
    pub fn path_in(&self, dir: &Path) -> std::result::Result<PathBuf, String> {
        let mut components = Path::new(&self.name).components();
        match (components.next(), components.next()) {
            (Some(std::path::Component::Normal(name)), None) if name == self.name.as_str() => {
                Ok(dir.join(name))
            }
            _ => Err(format!(
                "its state names the record file {:?}, which is not a file name in the \
                 checkpoint's directory",
                self.name
            )),
        }
    }

    /// Whether `sha256`, the hash of the bytes at `path`, is this record's.
    ///
    /// # Errors
    /// A message naming the file and both hashes.
    pub fn check(&self, path: &Path, sha256: &str) -> std::result::Result<(), String> {
        if sha256 == self.sha256 {
            Ok(())
        } else {
            Err(format!(
                "{} is not the file it was written with (SHA-256 {sha256}, the state says {})",
                path.display(),
                self.sha256
            ))
        }
    }
}

/// What a [`RecordCheckpointer`] did, in the order it did it. `record` is the checkpointer's
/// [`key`](RecordCheckpointer::key): its directory and record name, so that checkpointers of
/// several directories can share a ledger (clones of one `DdpConfig`) without one's entries
/// answering for another's.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Entry {
    /// Record `record` of checkpoint `number` was written, with this file and hash.
    Written {
        record: String,
        number: usize,
        file: RecordFile,
    },
    /// Writing record `record` of checkpoint `number` failed.
    Failed {
        record: String,
        number: usize,
        why: String,
    },
    /// Record `record` of checkpoint `number` was deleted (burn-train's checkpointing strategy
    /// keeps only some epochs).
    Deleted { record: String, number: usize },
    /// Checkpoint `number`'s record `record` was asked for (a read is queued behind the writes:
    /// every write asked for before it is done).
    Read { record: String, number: usize },
}

/// The record files the checkpointers sharing it wrote (or failed to write), for the thread that
/// waits for them: burn-train hands records to its checkpointers on background threads.
/// Clones share one ledger.
#[derive(Clone, Default)]
pub(crate) struct Ledger {
    entries: Arc<(Mutex<Vec<Entry>>, Condvar)>,
}

impl std::fmt::Debug for Ledger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let entries = self
            .entries
            .0
            .lock()
            .map(|entries| entries.len())
            .unwrap_or_default();
        write!(f, "Ledger({entries} entries)")
    }
}

/// A position in a [`Ledger`]: entries after it are new.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Mark(usize);

impl Ledger {
    fn note(&self, entry: Entry) {
        let (entries, changed) = &*self.entries;
        entries
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(entry);
        changed.notify_all();
    }

    /// The position after every entry so far.
    pub fn mark(&self) -> Mark {
        let (entries, _) = &*self.entries;
        Mark(
            entries
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .len(),
        )
    }

    /// The numbers of the checkpoints whose record `record` was deleted after `since`, in order.
    pub fn deleted_since(&self, record: &str, since: Mark) -> Vec<usize> {
        let (entries, _) = &*self.entries;
        let entries = entries
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        entries
            .get(since.0..)
            .unwrap_or_default()
            .iter()
            .filter_map(|entry| match entry {
                Entry::Deleted { record: r, number } if r == record => Some(*number),
                _ => None,
            })
            .collect()
    }

    /// Why the latest write of record `record` failed, when its latest write (of any number)
    /// failed.
    pub fn latest_failure(&self, record: &str) -> Option<String> {
        let (entries, _) = &*self.entries;
        let entries = entries
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        entries.iter().rev().find_map(|entry| match entry {
            Entry::Written { record: r, .. } if r == record => Some(None),
            Entry::Failed { record: r, why, .. } if r == record => Some(Some(why.clone())),
            _ => None,
        })?
    }

    /// Whether record `record` of checkpoint `number` was read after `since`, by a checkpointer
    /// sharing this ledger.
    pub fn was_read(&self, record: &str, number: usize, since: Mark) -> bool {
        let (entries, _) = &*self.entries;
        let entries = entries
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        entries.get(since.0..).unwrap_or_default().iter().any(|entry| {
            matches!(entry, Entry::Read { record: r, number: n } if r == record && *n == number)
        })
    }

    /// The record files of checkpoint `number` that the checkpointers of `records` wrote after
    /// `since` (the latest write of each), in the order of `records`, once all are written, or
    /// `None` when `timeout` passes first.
    ///
    /// # Errors
    /// Why one of them could not be written, as soon as its checkpointer failed.
    pub fn wait_for(
        &self,
        records: &[&str],
        number: usize,
        since: Mark,
        timeout: Duration,
    ) -> std::result::Result<Option<Vec<RecordFile>>, String> {
        let deadline = Instant::now().checked_add(timeout);
        let (entries, changed) = &*self.entries;
        let mut guard = entries
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        loop {
            let new = guard.get(since.0..).unwrap_or_default();
            let mut found = Vec::with_capacity(records.len());
            for wanted in records {
                let latest = new.iter().rev().find(|entry| match entry {
                    Entry::Written {
                        record, number: n, ..
                    }
                    | Entry::Failed {
                        record, number: n, ..
                    } => record == wanted && *n == number,
                    Entry::Deleted { .. } | Entry::Read { .. } => false,
                });
                match latest {
                    Some(Entry::Written { file, .. }) => found.push(file.clone()),
                    Some(Entry::Failed { why, .. }) => return Err(why.clone()),
                    _ => break,
                }
            }
            if found.len() == records.len() {
                return Ok(Some(found));
            }
            let left = match deadline {
                Some(deadline) => deadline.saturating_duration_since(Instant::now()),
                None => Duration::MAX,
            };
            if left.is_zero() {
                return Ok(None);
            }
            // `wait_timeout` takes any duration: a `Duration::MAX` timeout waits for as long as it
            // takes.
            guard = changed
                .wait_timeout(guard, left)
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        }
    }
}

/// burn-ddp's checkpointer of one kind of record (see the [module docs](self)): checkpoint `n` is
/// the file `<dir>/<record>-<n>.bpk`, burn-train's own names, written atomically (temporary
/// name, sync, rename: the old file or the complete new one, never half written), its SHA-256
/// noted in the ledger it shares with the others of its run, as are its reads and deletions.
/// A read takes the whole file into memory and parses it as burn-train's `FileCheckpointer`
/// does; a deletion after this record's latest write failed is refused, so that a
/// checkpointing strategy's `[Save(e), Delete(e - n)]` never leaves no good checkpoint.
#[derive(Debug, Clone)]
pub struct RecordCheckpointer {
    dir: PathBuf,
    record: String,
    ledger: Ledger,
}

impl RecordCheckpointer {
    /// The checkpointer of the records named `record` in `dir`, noting what it writes in `ledger`.
    pub(crate) fn new(dir: &Path, record: &str, ledger: Ledger) -> Self {
        Self {
            dir: dir.to_path_buf(),
            record: record.to_string(),
            ledger,
        }
    }

    /// The name of checkpoint `number`'s file: `<record>-<number>.bpk`.
    pub fn file_name(&self, number: usize) -> String {
        format!("{}-{number}.bpk", self.record)
    }

    /// Checkpoint `number`'s file: `<dir>/<record>-<number>.bpk`.
    pub fn path(&self, number: usize) -> PathBuf {
        self.dir.join(self.file_name(number))
    }

    /// The name of the records it writes (`model`, `optim`, `scheduler` for burn-train's).
    pub fn record(&self) -> &str {
        &self.record
    }

    /// Its entries' key in the ledger: `<dir>/<record>`.
    pub(crate) fn key(&self) -> String {
        self.dir.join(&self.record).to_string_lossy().into_owned()
    }
}

impl<R: Checkpoint> Checkpointer<R> for RecordCheckpointer {
    /// Writes the record's burnpack bytes to [`path`](Self::path)`(number)` atomically.
    ///
    /// # Errors
    /// The record cannot be serialised, or the file cannot be written (then the previous file, if
    /// any, is left as it was).
    fn save(&self, number: usize, record: R) -> Result<(), CheckpointerError> {
        let path = self.path(number);
        let written = record
            .checkpoint_into_bytes()
            .map_err(CheckpointerError::Record)
            .and_then(|bytes| {
                write_atomically(&path, &bytes)
                    .map(|()| sha256_hex(&bytes))
                    .map_err(|e| {
                        CheckpointerError::Unknown(format!("cannot write {}: {e}", path.display()))
                    })
            });
        match written {
            Ok(sha256) => {
                self.ledger.note(Entry::Written {
                    record: self.key(),
                    number,
                    file: RecordFile {
                        name: self.file_name(number),
                        sha256,
                    },
                });
                Ok(())
            }
            Err(e) => {
                self.ledger.note(Entry::Failed {
                    record: self.key(),
                    number,
                    why: format!("{}: {e}", path.display()),
                });
                Err(e)
            }
        }
    }

    /// Removes [`path`](Self::path)`(number)`; a missing file is fine.
    ///
    /// # Errors
    /// The file exists but cannot be removed.
    fn delete(&self, number: usize) -> Result<(), CheckpointerError> {
        if let Some(why) = self.ledger.latest_failure(&self.key()) {
            return Err(CheckpointerError::Unknown(format!(
                "{} is kept: this record's latest write failed ({why})",
                self.path(number).display()
            )));
        }
        remove_if_present(&self.path(number)).map_err(CheckpointerError::IOError)?;
        self.ledger.note(Entry::Deleted {
            record: self.key(),
            number,
        });
        Ok(())
    }

    /// Reads [`path`](Self::path)`(number)`.
    ///
    /// # Errors
    /// The file cannot be read, or is no burnpack record of this kind.
    fn restore(&self, number: usize) -> Result<R, CheckpointerError> {
        self.ledger.note(Entry::Read {
            record: self.key(),
            number,
        });
        let bytes = std::fs::read(self.path(number)).map_err(CheckpointerError::IOError)?;
        R::checkpoint_from_bytes(Bytes::from_bytes_vec(bytes)).map_err(CheckpointerError::Record)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::module::Module;
    use burn::nn::{Linear, LinearConfig};
    use burn::store::ModuleRecord;

    fn layer() -> Linear {
        LinearConfig::new(3, 2).init(&Default::default())
    }

    #[test]
    fn a_record_is_written_under_burn_trains_name_noted_and_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = Ledger::default();
        let model = RecordCheckpointer::new(dir.path(), "model", ledger.clone());
        let original = layer();
        // Burn initialises a parameter lazily, per clone: make its values before cloning.
        let _ = original.weight.val();
        let mark = ledger.mark();
        Checkpointer::<ModuleRecord>::save(&model, 3, original.clone().into_record()).unwrap();
        let names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, vec!["model-3.bpk"], "no temporary is left");
        let files = ledger
            .wait_for(&[&model.key()], 3, mark, Duration::from_secs(5))
            .unwrap()
            .expect("noted");
        assert_eq!(files[0].name, "model-3.bpk");
        assert_eq!(
            files[0].sha256,
            super::super::file::file_sha256(&dir.path().join("model-3.bpk")).unwrap()
        );
        let record: ModuleRecord = model.restore(3).unwrap();
        let restored = layer().load_record(record);
        assert_eq!(
            restored.weight.val().into_data(),
            original.weight.val().into_data()
        );
        let before_delete = ledger.mark();
        Checkpointer::<ModuleRecord>::delete(&model, 3).unwrap();
        assert!(!dir.path().join("model-3.bpk").exists());
        assert_eq!(ledger.deleted_since(&model.key(), before_delete), vec![3]);
        assert_eq!(
            ledger.deleted_since(&format!("{}x", model.key()), before_delete),
            Vec::<usize>::new()
        );
        // Deleting what is not there is fine; restoring it is an error.
        Checkpointer::<ModuleRecord>::delete(&model, 3).unwrap();
        let before_read = ledger.mark();
        assert!(Checkpointer::<ModuleRecord>::restore(&model, 3).is_err());
        assert!(ledger.was_read(&model.key(), 3, before_read));
        assert!(!ledger.was_read(&model.key(), 2, before_read));
    }

    #[test]
    fn the_ledger_waits_for_every_record_of_the_number_written_after_the_mark() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = Ledger::default();
        let model = RecordCheckpointer::new(dir.path(), "model", ledger.clone());
        let optim = RecordCheckpointer::new(dir.path(), "optim", ledger.clone());
        Checkpointer::<ModuleRecord>::save(&model, 1, layer().into_record()).unwrap();
        let mark = ledger.mark();
        // Written before the mark, or another number: not counted.
        Checkpointer::<ModuleRecord>::save(&optim, 2, layer().into_record()).unwrap();
        assert_eq!(
            ledger.wait_for(
                &[&model.key(), &optim.key()],
                1,
                mark,
                Duration::from_millis(50)
            ),
            Ok(None)
        );
        let writer = {
            let model = model.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(50));
                Checkpointer::<ModuleRecord>::save(&model, 2, layer().into_record()).unwrap();
            })
        };
        let files = ledger
            .wait_for(
                &[&model.key(), &optim.key()],
                2,
                mark,
                Duration::from_secs(10),
            )
            .unwrap()
            .expect("both written");
        writer.join().unwrap();
        assert_eq!(
            files.iter().map(|f| f.name.as_str()).collect::<Vec<_>>(),
            vec!["model-2.bpk", "optim-2.bpk"]
        );
    }

    #[test]
    fn a_failed_write_is_an_answer_at_once_and_leaves_the_previous_file() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = Ledger::default();
        let model = RecordCheckpointer::new(dir.path(), "model", ledger.clone());
        std::fs::write(dir.path().join("model-1.bpk"), b"previous").unwrap();
        // The temporary cannot be created where a file stands in for the directory.
        let blocked =
            RecordCheckpointer::new(&dir.path().join("model-1.bpk"), "model", ledger.clone());
        let mark = ledger.mark();
        assert!(Checkpointer::<ModuleRecord>::save(&blocked, 1, layer().into_record()).is_err());
        let started = Instant::now();
        let why = ledger
            .wait_for(&[&blocked.key()], 1, mark, Duration::from_secs(60))
            .unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(30));
        assert!(why.contains("model-1.bpk"), "{why}");
        assert_eq!(
            std::fs::read(dir.path().join("model-1.bpk")).unwrap(),
            b"previous"
        );
        // Not a record of this kind: an error, not a panic.
        assert!(Checkpointer::<ModuleRecord>::restore(&model, 1).is_err());
        // After its latest write failed, an older checkpoint is not deleted (a strategy's
        // `Delete(e - n)` after a failed `Save(e)`); a good write lifts that.
        assert!(Checkpointer::<ModuleRecord>::delete(&blocked, 0).is_err());
        // Another directory's checkpointer sharing the ledger is not held back by it.
        let elsewhere = tempfile::tempdir().unwrap();
        let other = RecordCheckpointer::new(elsewhere.path(), "model", ledger.clone());
        Checkpointer::<ModuleRecord>::delete(&other, 1).unwrap();
        std::fs::remove_file(dir.path().join("model-1.bpk")).unwrap();
        Checkpointer::<ModuleRecord>::save(&blocked, 2, layer().into_record()).unwrap();
        Checkpointer::<ModuleRecord>::delete(&blocked, 0).unwrap();
    }

    #[test]
    fn a_record_file_name_from_a_state_is_one_plain_file_name() {
        let dir = Path::new("/checkpoints");
        let named = |name: &str| RecordFile {
            name: name.into(),
            sha256: String::new(),
        };
        assert_eq!(
            named("model-3.bpk").path_in(dir),
            Ok(dir.join("model-3.bpk"))
        );
        for bad in [
            "../model-3.bpk",
            "/etc/passwd",
            "sub/model.bpk",
            "",
            ".",
            "..",
        ] {
            assert!(named(bad).path_in(dir).is_err(), "{bad:?}");
        }
    }
}
