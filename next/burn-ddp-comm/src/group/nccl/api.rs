//! The NCCL C API, loaded at run time ([`NcclApi::load`]: the first candidate of
//! [`library`](super::library) that is NCCL 2.18 or later).
//!
//! Every function is declared with C `int` arguments and results instead of Rust enums, so a
//! result code or data type that a newer NCCL adds cannot be undefined behaviour; the constants
//! below are the values of `nccl.h` (checked against cudarc's bindings by a test under the `cuda`
//! feature).

use std::ffi::{c_char, c_int, c_uint, c_void};

use super::library::{
    NCCL_HINT, NCCL_LIB_ENV, nccl_candidates, nccl_result_advice, nccl_result_name, open_first,
    python_package_roots,
};
use crate::error::{CommError, Result};
use crate::group::ReduceOp;

/// `ncclComm_t`: an opaque communicator handle.
pub type RawComm = *mut c_void;
/// `cudaStream_t` / `CUstream`.
pub type RawStream = *mut c_void;

/// `ncclSuccess`.
pub const NCCL_SUCCESS: c_int = 0;
/// `ncclInProgress`: a non-blocking communicator's call has not finished yet.
pub const NCCL_IN_PROGRESS: c_int = 7;

/// `ncclDataType_t` values of `nccl.h`.
pub mod dtype {
    use std::ffi::c_int;
    /// `ncclUint64`.
    pub const UINT64: c_int = 5;
    /// `ncclFloat16`.
    pub const FLOAT16: c_int = 6;
    /// `ncclFloat32`.
    pub const FLOAT32: c_int = 7;
    /// `ncclBfloat16`.
    pub const BFLOAT16: c_int = 9;
}

/// `ncclRedOp_t` values of `nccl.h`.
pub mod redop {
    use std::ffi::c_int;
    /// `ncclSum`.
    pub const SUM: c_int = 0;
    /// `ncclAvg` (NCCL 2.10 and later).
    pub const AVG: c_int = 4;
}

/// The NCCL reduction for a [`ReduceOp`].
pub fn nccl_op(op: ReduceOp) -> c_int {
    match op {
        ReduceOp::Sum => redop::SUM,
        ReduceOp::Avg => redop::AVG,
    }
}

/// `ncclUniqueId`: the 128 bytes that name a communicator. Rank 0 creates it
/// (`ncclGetUniqueId`) and every rank passes the same one to its communicator's
/// initialisation; it travels as 16 `u64` words ([`to_words`](Self::to_words)) through a host
/// process group or as 256 hex digits ([`to_hex`](Self::to_hex)) through a rendezvous store.
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct NcclUniqueId {
    /// The id's bytes, as NCCL wrote them.
    pub bytes: [u8; 128],
}

impl std::fmt::Debug for NcclUniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclUniqueId({}...)", &self.to_hex()[..16])
    }
}

impl NcclUniqueId {
    /// The id as 16 native-endian `u64` words (for [`ProcessGroup::all_gather`](crate::group::ProcessGroup::all_gather)).
    pub fn to_words(&self) -> [u64; 16] {
        std::array::from_fn(|i| {
            let mut word = [0u8; 8];
            word.copy_from_slice(&self.bytes[i * 8..i * 8 + 8]);
            u64::from_ne_bytes(word)
        })
    }

    /// The inverse of [`to_words`](Self::to_words).
    pub fn from_words(words: &[u64]) -> Option<Self> {
        if words.len() != 16 {
            return None;
        }
        let mut bytes = [0u8; 128];
        for (chunk, word) in bytes.chunks_exact_mut(8).zip(words) {
            chunk.copy_from_slice(&word.to_ne_bytes());
        }
        Some(Self { bytes })
    }

    /// The id as 256 lower-case hex digits (for a rendezvous store or an environment variable).
    pub fn to_hex(&self) -> String {
        self.bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// The inverse of [`to_hex`](Self::to_hex).
    ///
    /// # Errors
    /// [`CommError::InvalidConfig`] when `hex` is not 256 hex digits.
    pub fn from_hex(hex: &str) -> Result<Self> {
        let hex = hex.trim();
        let bad = || {
            CommError::InvalidConfig(format!(
                "an NCCL unique id is 256 hex digits, got {} characters: {:?}",
                hex.len(),
                hex.chars().take(16).collect::<String>()
            ))
        };
        if hex.len() != 256 || !hex.is_ascii() {
            return Err(bad());
        }
        let mut bytes = [0u8; 128];
        for (i, byte) in bytes.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
        }
        Ok(Self { bytes })
    }
}

impl NcclUniqueId {
    /// Shares a communicator id through a rendezvous store, as PyTorch's `ProcessGroupNCCL` does:
    /// rank 0 creates it (`ncclGetUniqueId`, through `api`) and [publishes](Self::publish) it
    /// under `key`; every other rank [reads](Self::read) it, waiting up to `timeout`. Pass the
    /// result as [`NcclIdSource::Given`](crate::group::nccl::NcclIdSource::Given). Use a fresh `key`
    /// per communicator (e.g. with the restart count in it).
    ///
    /// # Errors
    /// The store's errors ([`CommError::Store`] naming the key after `timeout`), NCCL's
    /// ([`CommError::Nccl`]), [`CommError::InvalidConfig`] for a value that is not an id.
    pub fn share_through_store(
        api: &NcclApi,
        store: &crate::store::StoreClient,
        key: &str,
        rank: usize,
        timeout: std::time::Duration,
    ) -> Result<Self> {
        if rank == 0 {
            let id = api.unique_id(rank)?;
            id.publish(store, key)?;
            Ok(id)
        } else {
            Self::read(store, key, timeout)
        }
    }

    /// Sets `key` in `store` to this id (256 hex digits).
    ///
    /// # Errors
    /// [`CommError::Store`] when the store cannot be reached.
    pub fn publish(&self, store: &crate::store::StoreClient, key: &str) -> Result<()> {
        store.set(key, self.to_hex().as_bytes())
    }

    /// The id under `key` in `store`, waiting up to `timeout` for it to be set.
    ///
    /// # Errors
    /// [`CommError::Store`] after `timeout`; [`CommError::InvalidConfig`] when the value is not an
    /// id.
    pub fn read(
        store: &crate::store::StoreClient,
        key: &str,
        timeout: std::time::Duration,
    ) -> Result<Self> {
        let value = store.get(key, timeout)?;
        Self::from_hex(&String::from_utf8_lossy(&value))
    }
}

/// `ncclConfig_t` as NCCL 2.18 lays it out, plus 2.26's `trafficClass` (which fills what would
/// be padding). NCCL copies `min(size, its own size)` bytes of a caller's configuration and
/// resets the fields newer than `version`, so later libraries accept this layout; the fields
/// not set stay at `NCCL_CONFIG_UNDEF_INT` (NCCL's defaults).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct NcclConfig {
    size: usize,
    magic: c_uint,
    version: c_uint,
    /// 0 for a non-blocking communicator: calls return `ncclInProgress` and are polled with
    /// `ncclCommGetAsyncError`, which is what lets a timeout abort them.
    pub blocking: c_int,
    cga_cluster_size: c_int,
    min_ctas: c_int,
    max_ctas: c_int,
    net_name: *const c_char,
    split_share: c_int,
    /// `trafficClass` in NCCL 2.26's layout; set here so no byte NCCL copies is padding.
    traffic_class: c_int,
}

/// `NCCL_CONFIG_UNDEF_INT` (`INT_MIN`).
const NCCL_CONFIG_UNDEF_INT: c_int = c_int::MIN;

impl NcclConfig {
    /// `NCCL_CONFIG_INITIALIZER` with `blocking` set.
    pub fn new(blocking: bool) -> Self {
        Self {
            size: std::mem::size_of::<Self>(),
            magic: 0xcafe_beef,
            // NCCL_VERSION(2, 18, 0): the layout above (NCCL ignores `trafficClass` below 2.26).
            version: 2 * 10_000 + 18 * 100,
            blocking: c_int::from(blocking),
            cga_cluster_size: NCCL_CONFIG_UNDEF_INT,
            min_ctas: NCCL_CONFIG_UNDEF_INT,
            max_ctas: NCCL_CONFIG_UNDEF_INT,
            net_name: std::ptr::null(),
            split_share: NCCL_CONFIG_UNDEF_INT,
            traffic_class: NCCL_CONFIG_UNDEF_INT,
        }
    }
}

type GetVersion = unsafe extern "C" fn(*mut c_int) -> c_int;
type GetUniqueId = unsafe extern "C" fn(*mut NcclUniqueId) -> c_int;
type CommInitRankConfig =
    unsafe extern "C" fn(*mut RawComm, c_int, NcclUniqueId, c_int, *mut NcclConfig) -> c_int;
type CommGetAsyncError = unsafe extern "C" fn(RawComm, *mut c_int) -> c_int;
type CommOnly = unsafe extern "C" fn(RawComm) -> c_int;
type AllReduce = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    RawComm,
    RawStream,
) -> c_int;
type Broadcast = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    RawComm,
    RawStream,
) -> c_int;
type AllGather =
    unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, RawComm, RawStream) -> c_int;
/// `ncclReduceScatter(sendbuff, recvbuff, recvcount, datatype, op, comm, stream)`.
type ReduceScatter = AllReduce;
type GetErrorString = unsafe extern "C" fn(c_int) -> *const c_char;
type GetLastError = unsafe extern "C" fn(RawComm) -> *const c_char;

/// The NCCL functions burn-ddp calls, resolved once from the loaded library.
// Without the `cuda` feature only loading and errors are used (and tested).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub struct NcclApi {
    /// Where the library was found.
    pub path: String,
    /// `ncclGetVersion`, e.g. 22703 for 2.27.3.
    pub version: i32,
    pub(crate) get_unique_id: GetUniqueId,
    pub(crate) comm_init_rank_config: CommInitRankConfig,
    pub(crate) comm_get_async_error: CommGetAsyncError,
    pub(crate) comm_abort: CommOnly,
    pub(crate) comm_finalize: CommOnly,
    pub(crate) comm_destroy: CommOnly,
    pub(crate) all_reduce: AllReduce,
    pub(crate) broadcast: Broadcast,
    pub(crate) all_gather: AllGather,
    pub(crate) reduce_scatter: ReduceScatter,
    get_error_string: GetErrorString,
    get_last_error: Option<GetLastError>,
    // Keeps the library mapped while the function pointers above are used.
    _library: libloading::Library,
}

impl std::fmt::Debug for NcclApi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclApi")
            .field("path", &self.path)
            .field("version", &self.version)
            .finish_non_exhaustive()
    }
}

/// NCCL 2.18: non-blocking communicators with `ncclConfig_t` in the layout of [`NcclConfig`]
/// (and `ncclAvg`, from 2.10).
pub const NCCL_MIN_VERSION: i32 = 21_800;

/// `major.minor.patch` of an `ncclGetVersion` code (`major * 10000 + minor * 100 + patch` since
/// NCCL 2.9).
pub fn version_string(code: i32) -> String {
    format!("{}.{}.{}", code / 10_000, (code % 10_000) / 100, code % 100)
}

impl NcclApi {
    /// Loads NCCL (see [`library`](super::library) for where it is looked for) and resolves
    /// its functions.
    ///
    /// # Errors
    /// [`CommError::LibraryNotFound`] when no candidate loads or a function is missing (a library
    /// older than [`NCCL_MIN_VERSION`]).
    pub fn load() -> Result<Self> {
        let explicit = std::env::var(NCCL_LIB_ENV).ok();
        Self::load_from(&nccl_candidates(
            explicit.as_deref(),
            &python_package_roots(),
        ))
    }

    /// Loads the first of `candidates` (paths or file names) that opens, is NCCL 2.18 or later
    /// and has every function: an old system `libnccl.so.2` does not hide a newer one later in
    /// the list.
    ///
    /// # Errors
    /// [`CommError::LibraryNotFound`] listing every candidate, with why each was passed over.
    pub fn load_from(candidates: &[String]) -> Result<Self> {
        let mut reasons = Vec::new();
        for candidate in candidates {
            let loaded = open_first("NCCL", std::slice::from_ref(candidate), NCCL_HINT)
                .and_then(|(library, path)| Self::resolve(library, path));
            match loaded {
                Ok(api) => return Ok(api),
                Err(CommError::LibraryNotFound { detail, .. }) => {
                    reasons.push(format!("{candidate}: {detail}"))
                }
                Err(other) => return Err(other),
            }
        }
        Err(CommError::LibraryNotFound {
            library: "NCCL".into(),
            searched: candidates.to_vec(),
            detail: reasons.join("; "),
            hint: NCCL_HINT.into(),
        })
    }

    /// Resolves NCCL's functions in `library`, loaded from `path`.
    fn resolve(library: libloading::Library, path: String) -> Result<Self> {
        let missing = |name: &str, e: libloading::Error| CommError::LibraryNotFound {
            library: "NCCL".into(),
            searched: vec![path.clone()],
            detail: format!("{path} has no `{name}` ({e}); burn-ddp needs NCCL 2.18 or later"),
            hint: NCCL_HINT.into(),
        };
        macro_rules! symbol {
            ($name:literal, $ty:ty) => {
                // SAFETY: the symbol is NCCL's function of that name, whose C signature `$ty`
                // declares (nccl.h); the library outlives the pointer (kept in `_library`).
                unsafe {
                    *library
                        .get::<$ty>(concat!($name, "\0").as_bytes())
                        .map_err(|e| missing($name, e))?
                }
            };
        }
        let get_version = symbol!("ncclGetVersion", GetVersion);
        let mut version: c_int = 0;
        // SAFETY: `ncclGetVersion` writes one int.
        let code = unsafe { get_version(&mut version) };
        if code != NCCL_SUCCESS || version < NCCL_MIN_VERSION {
            return Err(CommError::LibraryNotFound {
                library: "NCCL".into(),
                searched: vec![path.clone()],
                detail: format!(
                    "{path} is NCCL {} (ncclGetVersion returned {code}); burn-ddp needs {} or later",
                    version_string(version),
                    version_string(NCCL_MIN_VERSION)
                ),
                hint: NCCL_HINT.into(),
            });
        }
        let get_last_error = {
            // SAFETY: as in `symbol!`; `ncclGetLastError` exists from NCCL 2.13 on.
            unsafe { library.get::<GetLastError>(b"ncclGetLastError\0") }
                .ok()
                .map(|f| *f)
        };
        Ok(Self {
            version,
            get_unique_id: symbol!("ncclGetUniqueId", GetUniqueId),
            comm_init_rank_config: symbol!("ncclCommInitRankConfig", CommInitRankConfig),
            comm_get_async_error: symbol!("ncclCommGetAsyncError", CommGetAsyncError),
            comm_abort: symbol!("ncclCommAbort", CommOnly),
            comm_finalize: symbol!("ncclCommFinalize", CommOnly),
            comm_destroy: symbol!("ncclCommDestroy", CommOnly),
            all_reduce: symbol!("ncclAllReduce", AllReduce),
            broadcast: symbol!("ncclBroadcast", Broadcast),
            all_gather: symbol!("ncclAllGather", AllGather),
            reduce_scatter: symbol!("ncclReduceScatter", ReduceScatter),
            get_error_string: symbol!("ncclGetErrorString", GetErrorString),
            get_last_error,
            path,
            _library: library,
        })
    }

    /// A new communicator id (`ncclGetUniqueId`); rank 0 calls it and shares the result.
    ///
    /// # Errors
    /// [`CommError::Nccl`] with the NCCL result.
    pub fn unique_id(&self, rank: usize) -> Result<NcclUniqueId> {
        let mut id = NcclUniqueId { bytes: [0; 128] };
        // SAFETY: `ncclGetUniqueId` writes one `ncclUniqueId` (128 bytes, `repr(C)` above).
        let code = unsafe { (self.get_unique_id)(&mut id) };
        self.check(code, rank, "ncclGetUniqueId", 0, std::ptr::null_mut())?;
        Ok(id)
    }

    /// `Ok` for `ncclSuccess`, else [`CommError::Nccl`] naming `op`, with NCCL's message (its
    /// last error for `comm`, when not null) and advice.
    ///
    /// # Errors
    /// As above.
    pub(crate) fn check(
        &self,
        code: c_int,
        rank: usize,
        op: &str,
        seq: u64,
        comm: RawComm,
    ) -> Result<()> {
        if code == NCCL_SUCCESS {
            return Ok(());
        }
        Err(self.error(code, rank, op, seq, comm))
    }

    /// The [`CommError::Nccl`] for result `code` of `op`.
    pub(crate) fn error(
        &self,
        code: c_int,
        rank: usize,
        op: &str,
        seq: u64,
        comm: RawComm,
    ) -> CommError {
        // SAFETY: both return a pointer to a static (or per-thread) NUL-terminated string, or
        // null.
        let text = |ptr: *const c_char| {
            if ptr.is_null() {
                String::new()
            } else {
                unsafe { std::ffi::CStr::from_ptr(ptr) }
                    .to_string_lossy()
                    .into_owned()
            }
        };
        let described = text(unsafe { (self.get_error_string)(code) });
        let last = match self.get_last_error {
            Some(f) => text(unsafe { f(comm) }),
            None => String::new(),
        };
        let mut detail = described;
        if !last.is_empty() {
            detail = format!("{detail} ({last})");
        }
        CommError::Nccl {
            rank,
            op: op.to_string(),
            seq,
            code: nccl_result_name(code as u32).to_string(),
            detail: format!("{detail}; {}", nccl_result_advice(code as u32)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unique_ids_round_trip_through_words_and_hex() {
        let id = NcclUniqueId {
            bytes: std::array::from_fn(|i| (i * 37 % 256) as u8),
        };
        assert_eq!(NcclUniqueId::from_words(&id.to_words()), Some(id));
        assert_eq!(NcclUniqueId::from_hex(&id.to_hex()).unwrap(), id);
        assert_eq!(id.to_hex().len(), 256);
        assert!(NcclUniqueId::from_words(&[0; 15]).is_none());
        assert!(matches!(
            NcclUniqueId::from_hex("abc"),
            Err(CommError::InvalidConfig(m)) if m.contains("256 hex digits")
        ));
        let mut bad = id.to_hex();
        bad.replace_range(0..2, "zz");
        assert!(NcclUniqueId::from_hex(&bad).is_err());
    }

    #[test]
    fn config_is_the_nccl_2_18_initializer() {
        let config = NcclConfig::new(false);
        // size_t + 2 unsigned + 4 int + pointer + 2 int: no padding on 64-bit targets.
        let expected = if cfg!(target_pointer_width = "64") {
            48
        } else {
            40
        };
        assert_eq!(config.size, expected);
        assert_eq!(std::mem::size_of::<NcclConfig>(), expected);
        assert_eq!(config.magic, 0xcafe_beef);
        assert_eq!(config.version, 21_800);
        assert_eq!(config.blocking, 0);
        assert_eq!(config.min_ctas, i32::MIN);
        assert_eq!(config.split_share, i32::MIN);
        assert_eq!(config.traffic_class, i32::MIN);
        assert_eq!(NcclConfig::new(true).blocking, 1);
    }

    #[test]
    fn unique_ids_travel_through_the_rendezvous_store() {
        use crate::store::{StoreClient, StoreServer};
        use std::time::Duration;
        let server =
            StoreServer::bind("127.0.0.1:0".parse().unwrap(), &crate::auth::test_job()).unwrap();
        let addr = server.local_addr().to_string();
        let client = StoreClient::connect(
            &addr,
            Duration::from_secs(10),
            &crate::auth::test_job(),
            crate::auth::Role::Worker,
        )
        .unwrap();
        let id = NcclUniqueId {
            bytes: std::array::from_fn(|i| (255 - i) as u8),
        };
        id.publish(&client, "nccl/0").unwrap();
        let other = StoreClient::connect(
            &addr,
            Duration::from_secs(10),
            &crate::auth::test_job(),
            crate::auth::Role::Worker,
        )
        .unwrap();
        assert_eq!(
            NcclUniqueId::read(&other, "nccl/0", Duration::from_secs(10)).unwrap(),
            id
        );
        // Not published: the store's timeout, naming the key.
        let err = NcclUniqueId::read(&other, "nccl/1", Duration::from_millis(200)).unwrap_err();
        assert!(matches!(err, CommError::Store { .. }), "{err:?}");
        assert!(err.to_string().contains("nccl/1"), "{err}");
        // Not an id.
        client.set("nccl/2", b"not hex").unwrap();
        assert!(matches!(
            NcclUniqueId::read(&other, "nccl/2", Duration::from_secs(10)),
            Err(CommError::InvalidConfig(_))
        ));
    }

    #[test]
    fn versions_read_as_major_minor_patch() {
        assert_eq!(version_string(22_703), "2.27.3");
        assert_eq!(version_string(NCCL_MIN_VERSION), "2.18.0");
        assert_eq!(nccl_op(ReduceOp::Avg), redop::AVG);
        assert_eq!(nccl_op(ReduceOp::Sum), redop::SUM);
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn constants_match_cudarc_bindings() {
        use cudarc::nccl::sys::{ncclDataType_t, ncclRedOp_t, ncclResult_t};
        assert_eq!(dtype::UINT64, ncclDataType_t::ncclUint64 as c_int);
        assert_eq!(dtype::FLOAT16, ncclDataType_t::ncclFloat16 as c_int);
        assert_eq!(dtype::FLOAT32, ncclDataType_t::ncclFloat32 as c_int);
        assert_eq!(dtype::BFLOAT16, ncclDataType_t::ncclBfloat16 as c_int);
        assert_eq!(redop::SUM, ncclRedOp_t::ncclSum as c_int);
        assert_eq!(redop::AVG, ncclRedOp_t::ncclAvg as c_int);
        assert_eq!(NCCL_IN_PROGRESS, ncclResult_t::ncclInProgress as c_int);
        assert_eq!(
            std::mem::size_of::<NcclUniqueId>(),
            std::mem::size_of::<cudarc::nccl::sys::ncclUniqueId>()
        );
    }

    #[test]
    fn a_missing_library_is_a_clear_error() {
        let candidates = vec![
            "/nonexistent/burn-ddp-test/libnccl.so.2".to_string(),
            "libburn-ddp-no-such-nccl.so.2".to_string(),
        ];
        match NcclApi::load_from(&candidates).unwrap_err() {
            CommError::LibraryNotFound {
                library,
                searched,
                detail,
                hint,
            } => {
                assert_eq!(library, "NCCL");
                assert_eq!(searched, candidates);
                // Why each candidate was passed over.
                assert!(detail.contains(&candidates[0]) && detail.contains(&candidates[1]));
                assert!(hint.contains("BURN_DDP_NCCL_LIB"));
            }
            other => panic!("expected LibraryNotFound, got {other:?}"),
        }
    }

    #[test]
    fn a_library_without_nccl_is_passed_over() {
        // libc opens but has no NCCL functions: the error says so and names the next candidate.
        let candidates = vec![
            "libc.so.6".to_string(),
            "/nonexistent/libnccl.so.2".to_string(),
        ];
        match NcclApi::load_from(&candidates).unwrap_err() {
            CommError::LibraryNotFound { detail, .. } => {
                assert!(
                    detail.contains("libc.so.6") && detail.contains("ncclGetVersion"),
                    "{detail}"
                );
                assert!(detail.contains("/nonexistent/libnccl.so.2"), "{detail}");
            }
            other => panic!("expected LibraryNotFound, got {other:?}"),
        }
    }
}
