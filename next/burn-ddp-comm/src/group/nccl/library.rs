//! Finding and loading `libnccl` at run time.
//!
//! NCCL ships as `libnccl.so.2` (its soname): in CUDA images, in the `nvidia-nccl-cu12` /
//! `nvidia-nccl-cu13` Python wheels that PyTorch installs, and in distribution packages, which add
//! the unversioned `libnccl.so` only with the development package. cudarc's loader looks for
//! `libnccl.so` and `libnccl.so.<CUDA major>` but not `libnccl.so.2`, so burn-ddp opens the
//! library itself, trying in order:
//!
//! 1. `$BURN_DDP_NCCL_LIB` (a path or a file name), and only it when set;
//! 2. `libnccl.so.2`, then `libnccl.so` (the dynamic linker's search: `LD_LIBRARY_PATH`, the
//!    cache of `ldconfig`, the system directories);
//! 3. `nvidia/nccl/lib/libnccl.so.2` under the Python package directories of the active virtual
//!    environment (`$VIRTUAL_ENV`), the user's `~/.local/lib/python3.*/site-packages` and
//!    `/usr/local/lib/python3.*/dist-packages`, `/usr/lib/python3/dist-packages`.
//!
//! A failure is [`CommError::LibraryNotFound`] listing every name tried and how to fix it.

use std::path::{Path, PathBuf};

use crate::error::{CommError, Result};

/// The environment variable that names the NCCL library to load.
pub const NCCL_LIB_ENV: &str = "BURN_DDP_NCCL_LIB";

/// How to fix a missing NCCL, for error messages.
pub const NCCL_HINT: &str = "install NCCL (e.g. `pip install nvidia-nccl-cu13`, or the \
    libnccl2 package) and set BURN_DDP_NCCL_LIB to the file, e.g. \
    BURN_DDP_NCCL_LIB=$(python3 -c \"import nvidia.nccl as m; print(list(m.__path__)[0])\")/lib/libnccl.so.2, \
    or add its directory to LD_LIBRARY_PATH";

/// The names and paths tried for NCCL, in order. `explicit` is the value of
/// [`NCCL_LIB_ENV`]; `python_roots` the directories that hold Python packages.
pub fn nccl_candidates(explicit: Option<&str>, python_roots: &[PathBuf]) -> Vec<String> {
    if let Some(explicit) = explicit.filter(|s| !s.trim().is_empty()) {
        return vec![explicit.to_string()];
    }
    let mut candidates = vec!["libnccl.so.2".to_string(), "libnccl.so".to_string()];
    candidates.extend(python_roots.iter().map(|root| {
        root.join("nvidia/nccl/lib/libnccl.so.2")
            .display()
            .to_string()
    }));
    candidates
}

/// Directories of Python packages where a `nvidia-nccl-cu*` wheel may live: the virtual
/// environment's, the user's and the system's `site-packages`/`dist-packages` that exist.
pub fn python_package_roots() -> Vec<PathBuf> {
    let mut parents: Vec<PathBuf> = Vec::new();
    if let Some(venv) = std::env::var_os("VIRTUAL_ENV") {
        parents.push(PathBuf::from(venv).join("lib"));
    }
    if let Some(home) = std::env::var_os("HOME") {
        parents.push(PathBuf::from(home).join(".local/lib"));
    }
    parents.push(PathBuf::from("/usr/local/lib"));
    parents.push(PathBuf::from("/usr/lib"));
    python_package_roots_in(&parents)
}

/// The `python3*/{site,dist}-packages` directories under each of `parents` (`<prefix>/lib`).
pub fn python_package_roots_in(parents: &[PathBuf]) -> Vec<PathBuf> {
    let mut roots = Vec::new();
    for parent in parents {
        let Ok(entries) = std::fs::read_dir(parent) else {
            continue;
        };
        let mut pythons: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("python3"))
            })
            .collect();
        pythons.sort();
        for python in pythons {
            for packages in ["site-packages", "dist-packages"] {
                let dir = python.join(packages);
                if dir.is_dir() {
                    roots.push(dir);
                }
            }
        }
    }
    roots
}

/// Opens the first of `candidates` that loads. `library` names it in the error.
///
/// # Errors
/// [`CommError::LibraryNotFound`] with every candidate and the loader's last message.
pub fn open_first(
    library: &str,
    candidates: &[String],
    hint: &str,
) -> Result<(libloading::Library, String)> {
    let mut last = String::from("no candidate");
    for candidate in candidates {
        // SAFETY: loading a shared library runs its initialisers; NCCL's and CUDA's are the
        // vendor's and have no preconditions on the caller.
        match unsafe { libloading::Library::new(Path::new(candidate)) } {
            Ok(lib) => return Ok((lib, candidate.clone())),
            Err(e) => last = e.to_string(),
        }
    }
    Err(CommError::LibraryNotFound {
        library: library.to_string(),
        searched: candidates.to_vec(),
        detail: last,
        hint: hint.to_string(),
    })
}

/// The name of an NCCL result code (`ncclResult_t`), as `nccl.h` defines them.
pub fn nccl_result_name(code: u32) -> &'static str {
    match code {
        0 => "ncclSuccess",
        1 => "ncclUnhandledCudaError",
        2 => "ncclSystemError",
        3 => "ncclInternalError",
        4 => "ncclInvalidArgument",
        5 => "ncclInvalidUsage",
        6 => "ncclRemoteError",
        7 => "ncclInProgress",
        8 => "ncclTimeout",
        _ => "unknown NCCL result",
    }
}

/// What an NCCL result code usually means for a user, for error messages.
pub fn nccl_result_advice(code: u32) -> &'static str {
    match code {
        1 => "a CUDA call inside NCCL failed (out of memory, a device fault, or a driver error)",
        2 => "a system call failed (sockets, shared memory: check /dev/shm size and the network)",
        3 => "NCCL internal error (run with NCCL_DEBUG=INFO for details)",
        4 => "invalid argument (a null or misaligned buffer, or a wrong count)",
        5 => "invalid usage (ranks called different collectives, or two ranks share one GPU)",
        6 => "a remote rank failed or the connection to it broke",
        7 => "the operation is still in progress",
        8 => "NCCL's own timeout passed (NCCL 2.30+): a peer did not take part in time",
        _ => "see NCCL_DEBUG=INFO",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_explicit_library_is_the_only_candidate() {
        let roots = vec![PathBuf::from("/venv/lib/python3.12/site-packages")];
        assert_eq!(
            nccl_candidates(Some("/opt/nccl/libnccl.so.2"), &roots),
            vec!["/opt/nccl/libnccl.so.2".to_string()]
        );
        // An empty variable counts as unset.
        let all = nccl_candidates(Some(" "), &roots);
        assert_eq!(
            all,
            vec![
                "libnccl.so.2".to_string(),
                "libnccl.so".to_string(),
                "/venv/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2".to_string(),
            ]
        );
        assert_eq!(nccl_candidates(None, &[]).first().unwrap(), "libnccl.so.2");
    }

    #[test]
    fn python_package_roots_finds_a_wheel_layout() {
        // A fake virtual environment with the wheel's layout, and a prefix without Python.
        let venv = tempfile::tempdir().unwrap();
        let lib = venv
            .path()
            .join("lib/python3.12/site-packages/nvidia/nccl/lib");
        std::fs::create_dir_all(&lib).unwrap();
        let empty = tempfile::tempdir().unwrap();
        let roots = python_package_roots_in(&[empty.path().to_path_buf(), venv.path().join("lib")]);
        assert_eq!(
            roots,
            vec![venv.path().join("lib/python3.12/site-packages")]
        );
        let candidates = nccl_candidates(None, &roots);
        assert_eq!(
            candidates[2],
            lib.join("libnccl.so.2").display().to_string()
        );
    }

    #[test]
    fn a_missing_library_is_an_error_that_lists_what_was_tried() {
        let candidates = vec![
            "libdefinitely-not-nccl.so.2".to_string(),
            "/nonexistent/libnccl.so.2".to_string(),
        ];
        match open_first("NCCL", &candidates, NCCL_HINT) {
            Err(CommError::LibraryNotFound {
                library,
                searched,
                hint,
                ..
            }) => {
                assert_eq!(library, "NCCL");
                assert_eq!(searched, candidates);
                assert!(hint.contains("BURN_DDP_NCCL_LIB"), "{hint}");
            }
            other => panic!("expected LibraryNotFound, got {:?}", other.map(|(_, n)| n)),
        }
        let message = open_first("NCCL", &candidates, NCCL_HINT)
            .err()
            .unwrap()
            .to_string();
        assert!(message.contains("libdefinitely-not-nccl.so.2"), "{message}");
        assert!(message.contains("BURN_DDP_NCCL_LIB"), "{message}");
    }

    #[test]
    fn the_first_loadable_candidate_wins() {
        // libc is loadable everywhere these tests run; the first candidate is not.
        let candidates = vec![
            "libdefinitely-missing.so".to_string(),
            "libc.so.6".to_string(),
        ];
        let (_, name) = open_first("libc", &candidates, "").unwrap();
        assert_eq!(name, "libc.so.6");
    }

    #[test]
    fn result_codes_have_their_nccl_names() {
        assert_eq!(nccl_result_name(0), "ncclSuccess");
        assert_eq!(nccl_result_name(5), "ncclInvalidUsage");
        assert_eq!(nccl_result_name(8), "ncclTimeout");
        assert!(nccl_result_advice(8).contains("timeout"));
        assert_eq!(nccl_result_name(7), "ncclInProgress");
        assert_eq!(nccl_result_name(99), "unknown NCCL result");
        assert!(nccl_result_advice(5).contains("share one GPU"));
    }
}
