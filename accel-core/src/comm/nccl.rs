//! The `nccl` backend: collectives on CUDA tensors through the `libnccl.so.2` that the torch
//! wheel ships (the one libtorch_cuda itself uses), or `NCCL_LIBRARY`, loaded at run time,
//! on torch's current CUDA stream. The unique id travels through the cpu group.
//!
//! Always compiled. Without a GPU or the library, [`NcclComm::new`] fails with a message
//! that says which.
//!
//! Limit: operations are enqueued on the stream and return; they are not yet bounded by a
//! watchdog timeout (NCCL's own `NCCL_TIMEOUT`-style settings apply).

use std::ffi::{CStr, c_char, c_int, c_void};

use tch::{Device, Kind, Tensor};

use super::{ProcessGroup, ReduceOp};
use crate::error::{Error, Result};

#[repr(C)]
#[derive(Clone, Copy)]
struct UniqueId {
    internal: [c_char; 128],
}

type Comm = *mut c_void;
type GetUniqueId = unsafe extern "C" fn(*mut UniqueId) -> c_int;
type CommInitRank = unsafe extern "C" fn(*mut Comm, c_int, UniqueId, c_int) -> c_int;
type AllReduce = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    Comm,
    *mut c_void,
) -> c_int;
type Broadcast = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    Comm,
    *mut c_void,
) -> c_int;
type AllGather =
    unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, Comm, *mut c_void) -> c_int;
type CommFinish = unsafe extern "C" fn(Comm) -> c_int;
type ErrorString = unsafe extern "C" fn(c_int) -> *const c_char;

/// An NCCL communicator over the members of a cpu [`ProcessGroup`], one GPU per process.
pub struct NcclComm {
    lib: libloading::Library,
    comm: Comm,
    device: Device,
    rank: usize,
    world: usize,
}

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it are not
// concurrent; `NcclComm` methods take `&self` but are only called from one thread at a
// time by the accelerator (documented on the type).
unsafe impl Send for NcclComm {}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclComm").field("rank", &self.rank).field("world", &self.world).finish()
    }
}

fn nccl_dtype(kind: Kind) -> Result<c_int> {
    Ok(match kind {
        Kind::Uint8 => 1,
        Kind::Int => 2,
        Kind::Int64 => 4,
        Kind::Half => 6,
        Kind::Float => 7,
        Kind::Double => 8,
        Kind::BFloat16 => 9,
        other => return Err(Error::Unsupported(format!("NCCL collectives on {other:?} tensors"))),
    })
}

fn nccl_op(op: ReduceOp) -> c_int {
    match op {
        ReduceOp::Sum => 0,
        ReduceOp::Max => 2,
        ReduceOp::Min => 3,
        ReduceOp::Avg => 4,
    }
}

impl NcclComm {
    /// Creates the communicator on `device` (each process its own GPU). Rank 0 of `group`
    /// makes the unique id and broadcasts it; every member must call this.
    pub fn new(group: &ProcessGroup, device: Device) -> Result<Self> {
        let Device::Cuda(index) = device else {
            return Err(Error::Unsupported(format!(
                "the nccl backend needs a CUDA device; this process runs on {device:?} (use the \
                 cpu backend)"
            )));
        };
        crate::cuda::check_device(device)?;
        let path = crate::cuda::nccl_library_path();
        // SAFETY: NCCL's initialisers have no preconditions.
        let lib = unsafe { libloading::Library::new(&path) }.map_err(|e| {
            Error::Unsupported(format!(
                "cannot load NCCL from {} ({e}); set NCCL_LIBRARY to a libnccl.so.2",
                path.display()
            ))
        })?;
        let mut id = UniqueId { internal: [0; 128] };
        if group.rank() == 0 {
            // SAFETY: the documented signature; `id` is a valid out-pointer.
            let status =
                unsafe { Self::symbol::<GetUniqueId>(&lib, b"ncclGetUniqueId\0")?(&mut id) };
            Self::check_with(&lib, status, "ncclGetUniqueId")?;
        }
        let bytes: Vec<u8> = id.internal.iter().map(|&c| c as u8).collect();
        let bytes = group.broadcast_object(Some(&bytes).filter(|_| group.rank() == 0), 0)?;
        for (dst, src) in id.internal.iter_mut().zip(bytes) {
            *dst = src as c_char;
        }
        crate::shim::set_cuda_device(index)?;
        let mut comm: Comm = std::ptr::null_mut();
        // SAFETY: as documented by NCCL: out-pointer, world size, id by value, rank.
        let status = unsafe {
            Self::symbol::<CommInitRank>(&lib, b"ncclCommInitRank\0")?(
                &mut comm,
                group.size() as c_int,
                id,
                group.rank() as c_int,
            )
        };
        Self::check_with(&lib, status, "ncclCommInitRank")?;
        Ok(Self { lib, comm, device, rank: group.rank(), world: group.size() })
    }

    /// # Safety
    /// `T` must be the C signature of the symbol `name`.
    unsafe fn symbol<T: Copy>(lib: &libloading::Library, name: &[u8]) -> Result<T> {
        // SAFETY: upheld by the caller.
        unsafe { lib.get::<T>(name) }.map(|s| *s).map_err(|e| {
            Error::Unsupported(format!("NCCL lacks {}: {e}", String::from_utf8_lossy(name)))
        })
    }

    fn check_with(lib: &libloading::Library, status: c_int, call: &str) -> Result<()> {
        if status == 0 {
            return Ok(());
        }
        // SAFETY: ncclGetErrorString returns a static string for any code.
        let text = unsafe {
            Self::symbol::<ErrorString>(lib, b"ncclGetErrorString\0")
                .map(|f| CStr::from_ptr(f(status)).to_string_lossy().into_owned())
                .unwrap_or_default()
        };
        Err(Error::Nccl { call: call.into(), code: status, rank: 0, message: text })
    }

    fn prepare(&self, t: &Tensor) -> Result<(*mut c_void, c_int)> {
        if t.device() != self.device {
            return Err(Error::Training(format!(
                "NCCL communicator of {:?} got a tensor on {:?}",
                self.device,
                t.device()
            )));
        }
        if !t.is_contiguous() {
            return Err(Error::Training("NCCL collectives need contiguous tensors".into()));
        }
        let Device::Cuda(index) = self.device else { unreachable!("checked in new") };
        let stream = crate::shim::current_cuda_stream(index)?;
        Ok((stream.0, nccl_dtype(t.kind())?))
    }

    /// All-reduce in place on torch's current stream.
    pub fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<()> {
        let (stream, dtype) = self.prepare(t)?;
        // SAFETY: device pointers of a live contiguous tensor of `numel` elements.
        let status = unsafe {
            Self::symbol::<AllReduce>(&self.lib, b"ncclAllReduce\0")?(
                t.data_ptr(),
                t.data_ptr(),
                t.numel(),
                dtype,
                nccl_op(op),
                self.comm,
                stream,
            )
        };
        Self::check_with(&self.lib, status, "ncclAllReduce")
    }

    /// Broadcast from `root` in place.
    pub fn broadcast(&self, t: &Tensor, root: usize) -> Result<()> {
        let (stream, dtype) = self.prepare(t)?;
        // SAFETY: as in `all_reduce`.
        let status = unsafe {
            Self::symbol::<Broadcast>(&self.lib, b"ncclBroadcast\0")?(
                t.data_ptr(),
                t.data_ptr(),
                t.numel(),
                dtype,
                root as c_int,
                self.comm,
                stream,
            )
        };
        Self::check_with(&self.lib, status, "ncclBroadcast")
    }

    /// Every rank's `t` concatenated along dim 0.
    pub fn all_gather(&self, t: &Tensor) -> Result<Tensor> {
        let (stream, dtype) = self.prepare(t)?;
        let mut shape = t.size();
        if shape.is_empty() {
            shape = vec![1];
        }
        shape[0] *= self.world as i64;
        let out = Tensor::f_empty(&shape, (t.kind(), t.device()))?;
        // SAFETY: `out` has room for world × numel elements.
        let status = unsafe {
            Self::symbol::<AllGather>(&self.lib, b"ncclAllGather\0")?(
                t.data_ptr(),
                out.data_ptr(),
                t.numel(),
                dtype,
                self.comm,
                stream,
            )
        };
        Self::check_with(&self.lib, status, "ncclAllGather")?;
        Ok(out)
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        // SAFETY: the communicator was created by ncclCommInitRank and is destroyed once.
        unsafe {
            if let Ok(destroy) = Self::symbol::<CommFinish>(&self.lib, b"ncclCommDestroy\0") {
                destroy(self.comm);
            }
        }
    }
}
