//! CUDA streams and events through c10's device-generic interfaces (the shim needs no CUDA
//! headers): what the NCCL communicator orders its work with. On a machine or a libtorch
//! without CUDA every call returns libtorch's own error.

use std::ffi::c_void;

use tch::Tensor;

pub use super::ffi::Stream;
use super::{check, ffi, raw};
use crate::error::{Error, Result};

fn index(device_index: usize) -> Result<i32> {
    i32::try_from(device_index).map_err(|_| Error::Libtorch {
        op: "cuda stream",
        message: format!("device index {device_index} is out of range"),
    })
}

impl Stream {
    fn empty() -> Self {
        Self { id: 0, device_index: 0, device_type: 0, native: std::ptr::null_mut() }
    }

    /// torch's current stream on `cuda:{device_index}` (`torch.cuda.current_stream()`).
    pub fn current(device_index: usize) -> Result<Self> {
        let mut out = Self::empty();
        // SAFETY: out-pointer to a local; the shim catches every C++ exception.
        check(unsafe { ffi::accel_stream_current(index(device_index)?, &mut out) }, "stream")?;
        Ok(out)
    }

    /// A stream from torch's pool (what ProcessGroupNCCL uses for communication).
    pub fn from_pool(device_index: usize, high_priority: bool) -> Result<Self> {
        let mut out = Self::empty();
        // SAFETY: as in `current`.
        let status =
            unsafe { ffi::accel_stream_from_pool(index(device_index)?, high_priority, &mut out) };
        check(status, "stream_from_pool")?;
        Ok(out)
    }

    /// The `cudaStream_t`, for NCCL.
    pub fn native(&self) -> *mut c_void {
        self.native
    }

    /// Makes this stream current on its device until the guard is dropped (as `with
    /// torch.cuda.stream(s):`).
    pub fn make_current(&self) -> Result<StreamGuard> {
        let mut previous = Self::empty();
        // SAFETY: both pointers are to live locals; the shim catches C++ exceptions.
        check(unsafe { ffi::accel_stream_exchange(self, &mut previous) }, "stream_exchange")?;
        Ok(StreamGuard { previous })
    }

    /// Blocks the host until everything queued on the stream is done.
    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: as in `current`.
        check(unsafe { ffi::accel_stream_synchronize(self) }, "stream_synchronize")
    }
}

/// Puts the previous current stream back when dropped.
#[derive(Debug)]
#[must_use = "the stream is current only while the guard lives"]
pub struct StreamGuard {
    previous: Stream,
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        let mut replaced = Stream::empty();
        // SAFETY: as in `Stream::make_current`. A failure cannot be reported from drop and
        // leaves the other stream current, which only orders work more than needed.
        let _ = check(
            unsafe { ffi::accel_stream_exchange(&self.previous, &mut replaced) },
            "stream_exchange",
        );
    }
}

/// A CUDA event (`c10::Event`), recorded on one stream and waited on by others or by the
/// host.
#[derive(Debug)]
pub struct Event {
    ptr: *mut c_void,
}

// SAFETY: a recorded CUDA event may be queried, waited on and destroyed from any host
// thread; `c10::Event`'s methods used here take it by const reference or are guarded by
// the `&mut`/ownership rules of this type.
unsafe impl Send for Event {}
// SAFETY: `query`, `block` and `synchronize` only read the event.
unsafe impl Sync for Event {}

impl Event {
    /// Records a new event at the current end of `stream`.
    pub fn record(stream: &Stream) -> Result<Self> {
        let mut ptr = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; the shim catches every C++ exception.
        check(unsafe { ffi::accel_event_new(&mut ptr) }, "event_new")?;
        let event = Self { ptr };
        // SAFETY: `event.ptr` is a live c10::Event; `stream` a live local.
        check(unsafe { ffi::accel_event_record(event.ptr, stream) }, "event_record")?;
        Ok(event)
    }

    /// Work queued on `stream` from now on waits for this event (the host does not).
    pub fn block(&self, stream: &Stream) -> Result<()> {
        // SAFETY: live event and stream.
        check(unsafe { ffi::accel_event_block(self.ptr, stream) }, "event_block")
    }

    /// Whether the work before the event is done.
    pub fn query(&self) -> Result<bool> {
        let mut done = false;
        // SAFETY: live event; out-pointer to a local.
        check(unsafe { ffi::accel_event_query(self.ptr, &mut done) }, "event_query")?;
        Ok(done)
    }

    /// Blocks the host until the work before the event is done.
    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: live event.
        check(unsafe { ffi::accel_event_synchronize(self.ptr) }, "event_synchronize")
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: made by accel_event_new, freed once.
        unsafe { ffi::accel_event_free(self.ptr) }
    }
}

/// Marks `tensor`'s memory as used by `stream`, so that the caching allocator does not
/// reuse it before the work queued there so far is done (`tensor.record_stream(stream)`).
pub fn record_stream(tensor: &Tensor, stream: &Stream) -> Result<()> {
    // SAFETY: live tensor and stream.
    check(unsafe { ffi::accel_record_stream(raw(tensor), stream) }, "record_stream")
}

/// The most bytes of tensors held at once on `cuda:{device_index}` since the last
/// [`reset_peak_memory`] (`torch.cuda.max_memory_allocated`).
pub fn max_memory_allocated(device_index: usize) -> Result<u64> {
    let mut bytes = 0;
    // SAFETY: out-pointer to a local.
    let status = unsafe { ffi::accel_cuda_max_memory_allocated(index(device_index)?, &mut bytes) };
    check(status, "max_memory_allocated")?;
    Ok(bytes)
}

/// Starts a new peak for [`max_memory_allocated`].
pub fn reset_peak_memory(device_index: usize) -> Result<()> {
    // SAFETY: plain call.
    check(unsafe { ffi::accel_cuda_reset_peak_memory(index(device_index)?) }, "reset_peak_memory")
}

/// Gives the CUDA caching allocator's unused memory back to the driver
/// (`torch.cuda.empty_cache()`); nothing without CUDA.
pub fn empty_cache() -> Result<()> {
    if !tch::Cuda::is_available() {
        return Ok(());
    }
    // SAFETY: plain call.
    check(unsafe { ffi::accel_cuda_empty_cache() }, "empty_cache")
}
