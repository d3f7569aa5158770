//! NCCL's C ABI (`nccl.h` of NCCL 2.28, whose values have been stable since 2.x): the
//! enums, `ncclUniqueId`, the 2.17 layout of `ncclConfig_t`, and the table of functions,
//! resolved once when the library is loaded.

use std::collections::HashMap;
use std::ffi::{CStr, c_char, c_int, c_void};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use tch::Kind;

use crate::collective::ReduceOp;
use crate::error::{Error, Result};
use crate::sync::Locked;

/// `ncclComm_t`.
pub(crate) type RawComm = *mut c_void;
/// `cudaStream_t`.
pub(crate) type RawStream = *mut c_void;

/// `ncclResult_t`.
pub(crate) const SUCCESS: c_int = 0;
/// `ncclInProgress`: a non-blocking communicator is still working on the call.
pub(crate) const IN_PROGRESS: c_int = 7;

/// The name of an `ncclResult_t`, as nccl.h spells it.
pub(crate) fn result_name(code: c_int) -> &'static str {
    match code {
        0 => "ncclSuccess",
        1 => "ncclUnhandledCudaError",
        2 => "ncclSystemError",
        3 => "ncclInternalError",
        4 => "ncclInvalidArgument",
        5 => "ncclInvalidUsage",
        6 => "ncclRemoteError",
        7 => "ncclInProgress",
        _ => "an unknown ncclResult_t",
    }
}

/// `NCCL_UNIQUE_ID_BYTES`.
pub(crate) const UNIQUE_ID_BYTES: usize = 128;

/// `ncclUniqueId`: what rank 0 makes and every rank passes to the initialiser, by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct UniqueId {
    pub internal: [c_char; UNIQUE_ID_BYTES],
}

/// `NCCL_CONFIG_UNDEF_INT`.
const UNDEF_INT: c_int = c_int::MIN;

/// `ncclConfig_t` as NCCL 2.17 laid it out (size, magic, version, then the fields of that
/// release). NCCL reads a config by the `size` and `version` it carries, so this older
/// layout is understood by every later release, and fields added since keep their
/// defaults.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct Config {
    size: usize,
    magic: u32,
    version: u32,
    pub blocking: c_int,
    cga_cluster_size: c_int,
    min_ctas: c_int,
    max_ctas: c_int,
    net_name: *const c_char,
}

/// `NCCL_VERSION(2, 17, 0)`: the release whose layout [`Config`] has (NCCL resets fields a
/// config's version predates to their defaults).
pub(crate) const CONFIG_VERSION: u32 = 21700;

impl Config {
    /// `NCCL_CONFIG_INITIALIZER` with `blocking` set. Blocking (PyTorch's default for the
    /// groups it creates): every call returns when done. Non-blocking: calls return at once,
    /// possibly with `ncclInProgress`, which makes each one host-bound (NCCL runs it on a
    /// thread of its own and the caller polls) but lets a creation be bounded and aborted.
    pub fn new(blocking: bool) -> Self {
        Self {
            size: std::mem::size_of::<Self>(),
            magic: 0xcafe_beef,
            version: CONFIG_VERSION,
            blocking: i32::from(blocking),
            cga_cluster_size: UNDEF_INT,
            min_ctas: UNDEF_INT,
            max_ctas: UNDEF_INT,
            net_name: std::ptr::null(),
        }
    }
}

/// `ncclRedOp_t`.
#[allow(dead_code)] // PROD has no ReduceOp; kept for the table test
pub(crate) mod red_op {
    pub const SUM: i32 = 0;
    pub const PROD: i32 = 1;
    pub const MAX: i32 = 2;
    pub const MIN: i32 = 3;
    pub const AVG: i32 = 4;
}

/// `ncclDataType_t`.
#[allow(dead_code)] // the unsigned 32/64-bit types have no tch kind; kept for the table test
pub(crate) mod data_type {
    pub const INT8: i32 = 0;
    pub const UINT8: i32 = 1;
    pub const INT32: i32 = 2;
    pub const UINT32: i32 = 3;
    pub const INT64: i32 = 4;
    pub const UINT64: i32 = 5;
    pub const FLOAT16: i32 = 6;
    pub const FLOAT32: i32 = 7;
    pub const FLOAT64: i32 = 8;
    pub const BFLOAT16: i32 = 9;
    pub const FLOAT8_E4M3: i32 = 10;
    pub const FLOAT8_E5M2: i32 = 11;
}

/// NCCL 2.24 added the fp8 types.
const FP8_SINCE: i32 = 22400;

/// The NCCL type of a torch dtype: every type NCCL has that tch can name (bool travels as
/// uint8; fp8 from NCCL 2.24 on; tch has no unsigned 32/64-bit kinds). `version` is the
/// library's `ncclGetVersion`.
pub(crate) fn data_type(kind: Kind, version: i32) -> Result<c_int> {
    use data_type::*;
    Ok(match kind {
        Kind::Bool | Kind::Uint8 => UINT8,
        Kind::Int8 => INT8,
        Kind::Int => INT32,
        Kind::Int64 => INT64,
        Kind::Half => FLOAT16,
        Kind::Float => FLOAT32,
        Kind::Double => FLOAT64,
        Kind::BFloat16 => BFLOAT16,
        Kind::Float8e4m3fn | Kind::Float8e5m2 if version < FP8_SINCE => {
            return Err(Error::Unsupported(format!(
                "NCCL collectives on {kind:?} tensors need NCCL 2.24 or later; this one is {}",
                version_string(version)
            )));
        }
        Kind::Float8e4m3fn => FLOAT8_E4M3,
        Kind::Float8e5m2 => FLOAT8_E5M2,
        other => {
            return Err(Error::Unsupported(format!(
                "NCCL has no type for {other:?} tensors (it has bool, uint8, int8, int32, int64, \
                 f16, bf16, f32, f64 and, from 2.24, fp8 e4m3/e5m2)"
            )));
        }
    })
}

/// The NCCL reduction of `op` on `kind`, as torch's ProcessGroupNCCL maps it: averages of
/// floating-point types only; on bool, a sum is a logical or (max).
pub(crate) fn reduction(op: ReduceOp, kind: Kind) -> Result<c_int> {
    let floating = matches!(
        kind,
        Kind::Half
            | Kind::Float
            | Kind::Double
            | Kind::BFloat16
            | Kind::Float8e4m3fn
            | Kind::Float8e5m2
    );
    Ok(match op {
        ReduceOp::Avg if !floating => {
            return Err(Error::Unsupported(format!(
                "an average of {kind:?} tensors (NCCL's ncclAvg divides integers with rounding; \
                 sum and divide yourself)"
            )));
        }
        ReduceOp::Sum if kind == Kind::Bool => red_op::MAX,
        ReduceOp::Sum => red_op::SUM,
        ReduceOp::Avg => red_op::AVG,
        ReduceOp::Max => red_op::MAX,
        ReduceOp::Min => red_op::MIN,
    })
}

/// "2.28.9" for 22809 (NCCL >= 2.9 encodes major·10000 + minor·100 + patch).
pub(crate) fn version_string(code: i32) -> String {
    if code >= 20900 {
        format!("{}.{}.{}", code / 10000, (code % 10000) / 100, code % 100)
    } else {
        format!("{}.{}.{}", code / 1000, (code % 1000) / 100, code % 100)
    }
}

type FnVersion = unsafe extern "C" fn(*mut c_int) -> c_int;
type FnUniqueId = unsafe extern "C" fn(*mut UniqueId) -> c_int;
type FnInitConfig =
    unsafe extern "C" fn(*mut RawComm, c_int, UniqueId, c_int, *mut Config) -> c_int;
type FnSplit = unsafe extern "C" fn(RawComm, c_int, c_int, *mut RawComm, *mut Config) -> c_int;
type FnComm = unsafe extern "C" fn(RawComm) -> c_int;
type FnAsyncError = unsafe extern "C" fn(RawComm, *mut c_int) -> c_int;
type FnErrorString = unsafe extern "C" fn(c_int) -> *const c_char;
type FnLastError = unsafe extern "C" fn(RawComm) -> *const c_char;
type FnAllReduce = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    RawComm,
    RawStream,
) -> c_int;
type FnBroadcast = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    RawComm,
    RawStream,
) -> c_int;
type FnReduceScatter = FnAllReduce;
type FnAllGather =
    unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, RawComm, RawStream) -> c_int;
type FnSend = unsafe extern "C" fn(*const c_void, usize, c_int, c_int, RawComm, RawStream) -> c_int;
type FnRecv = unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, RawComm, RawStream) -> c_int;
type FnGroup = unsafe extern "C" fn() -> c_int;

/// Every NCCL function accel calls, resolved when the library is loaded (a library that
/// lacks one is refused then, by name, not at the first use).
pub(crate) struct Nccl {
    /// Where it was loaded from.
    pub path: PathBuf,
    /// `ncclGetVersion`.
    pub version: i32,
    pub get_unique_id: FnUniqueId,
    pub comm_init_rank_config: FnInitConfig,
    pub comm_split: FnSplit,
    pub comm_get_async_error: FnAsyncError,
    pub comm_abort: FnComm,
    pub comm_finalize: FnComm,
    pub comm_destroy: FnComm,
    pub get_error_string: FnErrorString,
    pub get_last_error: FnLastError,
    pub all_reduce: FnAllReduce,
    pub broadcast: FnBroadcast,
    pub reduce_scatter: FnReduceScatter,
    pub all_gather: FnAllGather,
    pub send: FnSend,
    pub recv: FnRecv,
    pub group_start: FnGroup,
    pub group_end: FnGroup,
    _lib: libloading::Library,
}

impl std::fmt::Debug for Nccl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nccl")
            .field("path", &self.path)
            .field("version", &version_string(self.version))
            .finish()
    }
}

/// NCCL 2.18 is the oldest release with every function of [`Nccl`] (`ncclCommSplit` came
/// in 2.18, `ncclCommInitRankConfig` in 2.14).
pub(crate) const OLDEST: i32 = 21800;

impl Nccl {
    /// The library at `path`, loaded and resolved once per process (later calls return the
    /// same table).
    pub fn load(path: &Path) -> Result<&'static Nccl> {
        static LOADED: OnceLock<Mutex<HashMap<PathBuf, &'static Nccl>>> = OnceLock::new();
        let mut loaded = LOADED.get_or_init(Default::default).locked();
        if let Some(nccl) = loaded.get(path) {
            return Ok(nccl);
        }
        // Leaked on purpose: communicators and their watchdogs use the table until the
        // process ends, and NCCL must not be unloaded under them.
        let nccl: &'static Nccl = Box::leak(Box::new(Self::open(path)?));
        loaded.insert(path.to_path_buf(), nccl);
        Ok(nccl)
    }

    fn open(path: &Path) -> Result<Self> {
        let cannot = |why: String| {
            Error::Unsupported(format!(
                "cannot use NCCL from {}: {why}; set NCCL_LIBRARY to a libnccl.so.2 (2.18 or \
                 later)",
                path.display()
            ))
        };
        // SAFETY: NCCL's initialisers have no preconditions.
        let lib = unsafe { libloading::Library::new(path) }.map_err(|e| cannot(e.to_string()))?;
        // SAFETY: each symbol is looked up with the C signature nccl.h declares for it.
        unsafe {
            macro_rules! sym {
                ($name:literal) => {
                    *lib.get(concat!($name, "\0").as_bytes())
                        .map_err(|e| cannot(format!("it lacks {} ({e})", $name)))?
                };
            }
            let get_version: FnVersion = sym!("ncclGetVersion");
            let mut version = 0;
            let status = get_version(&mut version);
            if status != SUCCESS {
                return Err(cannot(format!("ncclGetVersion returned {}", result_name(status))));
            }
            if version < OLDEST {
                return Err(cannot(format!(
                    "it is NCCL {}, older than 2.18 (no ncclCommSplit)",
                    version_string(version)
                )));
            }
            Ok(Self {
                path: path.to_path_buf(),
                version,
                get_unique_id: sym!("ncclGetUniqueId"),
                comm_init_rank_config: sym!("ncclCommInitRankConfig"),
                comm_split: sym!("ncclCommSplit"),
                comm_get_async_error: sym!("ncclCommGetAsyncError"),
                comm_abort: sym!("ncclCommAbort"),
                comm_finalize: sym!("ncclCommFinalize"),
                comm_destroy: sym!("ncclCommDestroy"),
                get_error_string: sym!("ncclGetErrorString"),
                get_last_error: sym!("ncclGetLastError"),
                all_reduce: sym!("ncclAllReduce"),
                broadcast: sym!("ncclBroadcast"),
                reduce_scatter: sym!("ncclReduceScatter"),
                all_gather: sym!("ncclAllGather"),
                send: sym!("ncclSend"),
                recv: sym!("ncclRecv"),
                group_start: sym!("ncclGroupStart"),
                group_end: sym!("ncclGroupEnd"),
                _lib: lib,
            })
        }
    }

    /// `ncclGetErrorString`, and `ncclGetLastError(comm)` where it says more.
    pub fn describe(&self, status: c_int, comm: RawComm) -> String {
        // SAFETY: both return pointers to NUL-terminated strings NCCL owns (static, or one
        // process-wide buffer that ncclGetLastError never clears); copied at once.
        let (text, last) = unsafe {
            let text = (self.get_error_string)(status);
            let last = (self.get_last_error)(comm);
            let read = |p: *const c_char| {
                if p.is_null() { String::new() } else { CStr::from_ptr(p).to_string_lossy().into() }
            };
            (read(text), read(last))
        };
        let mut out = format!("{} ({status}): {text}", result_name(status));
        if !last.is_empty() && last != text {
            // NCCL keeps one last warning for the whole process, whatever communicator or
            // thread it came from: a clue, labelled as such.
            out.push_str(&format!("; NCCL's last warning (process-wide, may be older): {last}"));
        }
        out
    }
}
