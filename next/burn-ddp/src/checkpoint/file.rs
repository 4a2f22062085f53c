//! A checkpoint's files on disk: written whole or not at all (a temporary name in the same
//! directory, synced, renamed over the final name, the directory synced), and their SHA-256.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use serde::Serialize;

use crate::error::{DdpError, Result};

/// The prefix of the temporary files of writes in progress. A write killed before its rename
/// leaves its temporary behind, which nothing removes yet (issue 39: temporaries of killed
/// writes).
pub(crate) const TEMPORARY_PREFIX: &str = ".tmp-";

/// `dir/.tmp-<name>-<pid>-<n>` for the final `dir/<name>`: unique per process and per call, so
/// two threads writing the same name never share a temporary.
fn temporary_for(target: &Path) -> PathBuf {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let name = target
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    target.with_file_name(format!(
        "{TEMPORARY_PREFIX}{name}-{}-{n}",
        std::process::id()
    ))
}

/// Writes `bytes` to `target` atomically: `target` is afterwards the old file or the complete new
/// one, never half written, also after a crash (synced before the rename, the directory after).
/// The directory is created when missing.
///
/// # Errors
/// The I/O error of the step that failed; the temporary file is removed then, `target` left as
/// it was.
pub(crate) fn write_atomically(target: &Path, bytes: &[u8]) -> io::Result<()> {
    if let Some(dir) = target.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    let temporary = temporary_for(target);
    let written = std::fs::File::create(&temporary)
        .and_then(|mut file| {
            io::Write::write_all(&mut file, bytes)?;
            file.sync_all()
        })
        .and_then(|()| std::fs::rename(&temporary, target));
    if let Err(e) = written {
        let _ = std::fs::remove_file(&temporary);
        return Err(e);
    }
    if let Some(dir) = target.parent()
        && let Ok(dir) = std::fs::File::open(if dir.as_os_str().is_empty() {
            Path::new(".")
        } else {
            dir
        })
    {
        // Best effort: not every platform opens a directory for syncing.
        let _ = dir.sync_all();
    }
    Ok(())
}

/// Writes `value` as pretty JSON to `target`, atomically.
///
/// # Errors
/// [`DdpError::Checkpoint`] naming `target`.
pub(crate) fn write_json<T: Serialize>(value: &T, target: &Path) -> Result<()> {
    let fail = |detail: String| DdpError::Checkpoint {
        path: target.display().to_string(),
        detail,
    };
    let json = serde_json::to_vec_pretty(value).map_err(|e| fail(e.to_string()))?;
    write_atomically(target, &json).map_err(|e| fail(format!("cannot write it: {e}")))
}

/// Removes `path`; a file that is not there is fine.
///
/// # Errors
/// The file exists but cannot be removed.
pub(crate) fn remove_if_present(path: &Path) -> io::Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// [`remove_if_present`], its error a [`DdpError::Checkpoint`] naming `path` and `what` it is.
pub(crate) fn remove_checkpoint_file(path: &Path, what: &str) -> Result<()> {
    remove_if_present(path).map_err(|e| DdpError::Checkpoint {
        path: path.display().to_string(),
        detail: format!("cannot delete {what}: {e}"),
    })
}

/// SHA-256 of `bytes`, as 64 lowercase hexadecimal digits.
pub(crate) fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    hex(&sha2::Sha256::digest(bytes))
}

/// SHA-256 of a file's bytes, as 64 lowercase hexadecimal digits (read in pieces, not whole).
///
/// # Errors
/// The file cannot be read.
pub(crate) fn file_sha256(path: &Path) -> io::Result<String> {
    use sha2::Digest;
    let mut file = std::fs::File::open(path)?;
    let mut hasher = sha2::Sha256::new();
    io::copy(&mut file, &mut hasher)?;
    Ok(hex(&hasher.finalize()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn an_atomic_write_leaves_the_final_name_only_and_replaces_the_old_file() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("sub").join("model-1.bpk");
        write_atomically(&target, b"first").unwrap();
        write_atomically(&target, b"second").unwrap();
        assert_eq!(std::fs::read(&target).unwrap(), b"second");
        assert_eq!(names(&dir.path().join("sub")), vec!["model-1.bpk"]);
    }

    #[test]
    fn a_failed_write_leaves_the_old_file_and_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("model-1.bpk");
        std::fs::write(&target, b"previous").unwrap();
        // A directory where the file should go: the rename fails after the temporary is written.
        let blocked = dir.path().join("blocked");
        std::fs::create_dir_all(blocked.join("inside")).unwrap();
        assert!(write_atomically(&blocked, b"new").is_err());
        assert_eq!(std::fs::read(&target).unwrap(), b"previous");
        assert_eq!(names(dir.path()), vec!["blocked", "model-1.bpk"]);
    }

    #[test]
    fn the_hash_of_a_file_is_the_hash_of_its_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x");
        std::fs::write(&path, b"abc").unwrap();
        // SHA-256("abc"), FIPS 180-2's example.
        let abc = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
        assert_eq!(sha256_hex(b"abc"), abc);
        assert_eq!(file_sha256(&path).unwrap(), abc);
        assert!(file_sha256(&dir.path().join("missing")).is_err());
    }

    #[test]
    fn json_is_written_atomically_and_a_bad_target_names_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("state.json");
        write_json(&serde_json::json!({"epoch": 2}), &target).unwrap();
        let back: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&target).unwrap()).unwrap();
        assert_eq!(back["epoch"], 2);
        std::fs::create_dir_all(dir.path().join("a-dir").join("x")).unwrap();
        let err = write_json(&1, &dir.path().join("a-dir")).unwrap_err();
        assert!(err.to_string().contains("a-dir"), "{err}");
    }
}
