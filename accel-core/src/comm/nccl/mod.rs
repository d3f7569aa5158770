//! The `nccl` backend: [`NcclComm`], a [`Communicator`] on CUDA tensors over the
//! `libnccl.so.2` the torch wheel ships (the one libtorch_cuda itself uses), or
//! `NCCL_LIBRARY`, loaded once at run time (ffi.rs).
//!
//! How an operation runs (as ProcessGroupNCCL's do): an event recorded on torch's current
//! stream orders it after the work that produced its tensors; it is enqueued on the
//! communicator's own stream (taken from torch's pool), so it overlaps with the compute
//! that follows; its tensors are marked as used on that stream (`record_stream`), so the
//! caching allocator cannot hand their memory out early; and an event recorded after it is
//! its [`Work`]: `wait()` makes the *current* stream wait for it, without blocking the host.
//! The host waits only where the result is read on the host.
//!
//! Communicators are made blocking, as PyTorch makes its groups (`ncclCommInitRankConfig`;
//! `ACCEL_NCCL_NONBLOCKING=1` for non-blocking ones), one per mesh dimension by
//! `ncclCommSplit` of the world's (handle.rs); a watchdog thread per
//! communicator polls asynchronous errors and every operation's event against the timeout,
//! and aborts the communicator when one fails (watchdog.rs). The unique id, the progress
//! posts that name late ranks, and the sequence check go through the cpu group of the same
//! members, the run's control plane.
//!
//! Always compiled. Without a GPU or the library, [`NcclComm::new`] fails with a message
//! that says which.

pub(crate) mod ffi;
pub(crate) mod handle;
pub(crate) mod watchdog;

use std::ffi::c_int;
use std::panic::Location;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tch::{Device, Kind, Tensor};

use self::ffi::{Nccl, RawComm, RawStream, UniqueId};
use self::handle::Handle;
use self::watchdog::{Tracked, Watchdog, WatchdogOptions};
use super::cpu::diagnosis::Scene;
use super::cpu::worker::describe;
use super::ledger::{Ledger, Scope};
use super::progress::{progress_key, progress_value};
use super::{Backend, Communicator, Op, ProcessGroup, ReduceOp, Work, WorkHandle, check_rank};
use crate::error::{Error, Result};
use crate::shim::cuda_runtime::{Event, Stream, record_stream};

/// The default timeout of an NCCL operation (torch's: 10 minutes).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10 * 60);

/// The timeout of NCCL operations: `ACCEL_NCCL_TIMEOUT` (seconds; `accel launch --timeout`
/// sets it), else [`DEFAULT_TIMEOUT`]. A value that is not a positive number of seconds is
/// an error naming it.
pub fn timeout_from_env() -> Result<Duration> {
    match std::env::var(crate::config::env::NCCL_TIMEOUT) {
        Ok(value) => Ok(Duration::from_secs_f64(
            crate::config::parse_seconds(&value, false)
                .map_err(|e| Error::Config(format!("ACCEL_NCCL_TIMEOUT: {e}")))?,
        )),
        Err(_) => Ok(DEFAULT_TIMEOUT),
    }
}

/// An NCCL communicator over the members of a cpu [`ProcessGroup`], one GPU per process.
pub struct NcclComm {
    handle: Arc<Handle>,
    device_index: usize,
    /// The communication stream: every operation is enqueued here.
    stream: Stream,
    /// The cpu group of the same members: unique ids, progress posts, the sequence check.
    control: ProcessGroup,
    /// Store prefix of this communicator ("nccl{id}").
    scope: String,
    seq: AtomicU64,
    /// Point-to-point transfers are numbered apart (not every rank takes part in each).
    p2p_seq: AtomicU64,
    ledger: Ledger,
    watchdog: Watchdog,
}

impl Drop for NcclComm {
    /// Lets what is queued finish (the watchdog still watching) before the communicator is
    /// finalized: a blocking finalize waits for its streams, and a peer lost meanwhile would
    /// make it wait forever. Not finished within the timeout: aborted instead (PyTorch's
    /// shutdown flushes the same way before it joins its watchdog).
    fn drop(&mut self) {
        if !self.watchdog.drain(self.handle.timeout) && !self.handle.is_aborted() {
            self.handle.abort();
        }
    }
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclComm")
            .field("rank", &self.handle.rank)
            .field("size", &self.handle.size)
            .field("device", &self.device_index)
            .finish_non_exhaustive()
    }
}

impl NcclComm {
    /// Creates the communicator of `group`'s members on `device` (each process its own
    /// GPU): rank 0 makes the unique id, the group carries it. Every member must call this.
    pub fn new(group: &ProcessGroup, device: Device) -> Result<Self> {
        let index = Self::cuda_index(device)?;
        let nccl = Nccl::load(&crate::cuda::nccl_library_path())?;
        crate::shim::set_cuda_device(index)?;
        let mut id = UniqueId { internal: [0; ffi::UNIQUE_ID_BYTES] };
        if group.rank() == 0 {
            // SAFETY: the documented signature; `id` is a valid out-pointer.
            let status = unsafe { (nccl.get_unique_id)(&mut id) };
            if status != ffi::SUCCESS {
                // The others are waiting for the id: an empty one fails them at once (the
                // length check below) instead of at the control plane's timeout.
                let _ = group.broadcast_object(Some(&Vec::<u8>::new()), 0);
                return Err(Error::Nccl {
                    call: "ncclGetUniqueId".into(),
                    code: status,
                    rank: group.members()[0],
                    during: String::new(),
                    message: nccl.describe(status, std::ptr::null_mut()),
                });
            }
        }
        let bytes: Vec<u8> = id.internal.iter().map(|&c| c as u8).collect();
        let bytes = group.broadcast_object(Some(&bytes).filter(|_| group.rank() == 0), 0)?;
        if bytes.is_empty() {
            return Err(Error::Training(format!(
                "rank {}: NCCL could not make the communicator's unique id (ncclGetUniqueId \
                 failed there; see its error)",
                group.members()[0]
            )));
        }
        if bytes.len() != ffi::UNIQUE_ID_BYTES {
            return Err(Error::Training(format!(
                "the NCCL unique id arrived with {} bytes, not {}",
                bytes.len(),
                ffi::UNIQUE_ID_BYTES
            )));
        }
        for (dst, src) in id.internal.iter_mut().zip(bytes) {
            *dst = src as std::ffi::c_char;
        }
        let timeout = timeout_from_env()?;
        let global_rank = group.members()[group.rank()];
        // Blocking, as PyTorch creates its groups: a non-blocking communicator makes every
        // call host-bound (NCCL runs it on a thread of its own, the caller polls). A peer that
        // never arrives is the launcher's to report (it stops the group when one dies).
        let blocking = !std::env::var(crate::config::env::NCCL_NONBLOCKING)
            .is_ok_and(|v| matches!(v.as_str(), "1" | "true" | "yes"));
        let (size, rank) = (group.size(), group.rank());
        let handle = Handle::init(nccl, id, size, rank, global_rank, timeout, blocking)?;
        Self::around(handle, group.clone(), index)
    }

    /// The communicator of the members of `sub` (a subgroup of this communicator's group,
    /// as [`ProcessGroup::new_subgroup`] made it), by `ncclCommSplit`. Every rank of this
    /// communicator calls it, in the same order; those outside `sub` pass `None`.
    pub fn split(&self, sub: Option<&ProcessGroup>, color: usize) -> Result<Option<Self>> {
        let (color, key, size) = match sub {
            Some(g) => (color as i32, g.rank(), g.size()),
            None => (-1, 0, 0),
        };
        match (self.handle.split(color, key, size)?, sub) {
            (Some(handle), Some(group)) => {
                Self::around(handle, group.clone(), self.device_index).map(Some)
            }
            _ => Ok(None),
        }
    }

    fn around(handle: Handle, control: ProcessGroup, device_index: usize) -> Result<Self> {
        let handle = Arc::new(handle);
        let stream = Stream::from_pool(device_index, false)?;
        let scope = format!("nccl{}", control.id());
        let store = control.store();
        let options = WatchdogOptions {
            timeout: handle.timeout,
            poll: Duration::from_millis(100),
            on_failure: super::exit_after_grace(handle.global_rank),
            device_index: Some(device_index),
            behind: {
                let (store, scope, members) =
                    (store.clone(), scope.clone(), control.members().to_vec());
                let (rank, timeout) = (control.rank(), handle.timeout);
                Arc::new(move |seq| {
                    let scene = Scene {
                        scope: scope.clone(),
                        rank,
                        members: &members,
                        store: &store,
                        timeout,
                        hosts: &[],
                    };
                    scene.behind(seq)
                })
            },
            post_progress: {
                let key = progress_key(&scope, control.rank());
                Arc::new(move |seq, epoch| {
                    if let Ok(mut store) = store.lock() {
                        let _ = store.set(&key, &progress_value(seq, epoch, ""));
                    }
                })
            },
        };
        let watchdog = Watchdog::start(handle.clone(), options)?;
        Ok(Self {
            handle,
            device_index,
            stream,
            control,
            scope,
            seq: AtomicU64::new(1),
            p2p_seq: AtomicU64::new(1),
            ledger: Ledger::default(),
            watchdog,
        })
    }

    fn cuda_index(device: Device) -> Result<usize> {
        let Device::Cuda(index) = device else {
            return Err(Error::Unsupported(format!(
                "the nccl backend needs a CUDA device; this process runs on {device:?} (use the \
                 cpu backend)"
            )));
        };
        crate::cuda::check_device(device)?;
        Ok(index)
    }

    /// The NCCL library in use and its version ("2.28.9").
    pub fn library(&self) -> (PathBuf, String) {
        (self.handle.nccl.path.clone(), ffi::version_string(self.handle.nccl.version))
    }

    fn check_tensor(&self, t: &Tensor) -> Result<()> {
        if t.device() != Device::Cuda(self.device_index) {
            return Err(Error::Training(format!(
                "the NCCL communicator of cuda:{} got a tensor on {:?}",
                self.device_index,
                t.device()
            )));
        }
        Ok(())
    }

    /// Enqueues one operation on the communication stream after the current stream's work,
    /// and returns its event as the work. `tensors` are what it reads and writes (the first
    /// one names it in messages); `call` is the NCCL function, for errors. Collectives are
    /// numbered and noted in the ledger with `site`, the caller of the trait method (taken
    /// there: `#[track_caller]` does not reach through the closures in between);
    /// point-to-point transfers (`op` SendRecv) are not.
    fn enqueue(
        &self,
        op: Op,
        site: &'static Location<'static>,
        tensors: &[&Tensor],
        call: &str,
        launch: impl FnOnce(&'static Nccl, RawComm, RawStream) -> c_int,
    ) -> Result<Work> {
        self.watchdog.failure()?;
        for t in tensors {
            self.check_tensor(t)?;
        }
        let what = tensors.first().map(|t| describe(t)).unwrap_or_default();
        // In a profile: the enqueue on the host (the kernel is CUDA activity of its own).
        let _range = crate::shim::recording()
            .then(|| crate::shim::range(&format!("accel::nccl {op} {what}")));
        // Everything from numbering to tracking under the lock: the stream, the numbers and
        // the watchdog's queue then agree on the order of the operations.
        let _calls = self.handle.lock()?;
        let current = Stream::current(self.device_index)?;
        Event::record(&current)?.block(&self.stream)?;
        let collective = op != Op::SendRecv;
        let (seq, epoch) = if collective {
            let seq = self.seq.fetch_add(1, Ordering::SeqCst);
            (seq, self.ledger.record(seq, op, &what, site))
        } else {
            (self.p2p_seq.fetch_add(1, Ordering::SeqCst), 0)
        };
        let during = if collective {
            format!("collective #{seq} {op} of {what}")
        } else {
            format!("point-to-point transfer #{seq} of {what}")
        };
        // The communicator's device is this thread's for the call: NCCL launches a
        // one-rank communicator's kernels on the current device (PyTorch's device guard).
        crate::shim::set_cuda_device(self.device_index)?;
        let status = self
            .handle
            .launch(&during, |comm| launch(self.handle.nccl, comm, self.stream.native()))?;
        self.handle.check(status, call, Some(&during))?;
        for t in tensors {
            record_stream(t, &self.stream)?;
        }
        let done = Arc::new(Event::record(&self.stream)?);
        self.watchdog.track(Tracked {
            seq,
            epoch,
            op,
            collective,
            what,
            started: Instant::now(),
            done: done.clone(),
        });
        Ok(Work::from_handle(Box::new(NcclWork {
            done,
            device_index: self.device_index,
            failure: self.failure_probe(),
        })))
    }

    fn failure_probe(&self) -> Arc<dyn Fn() -> Result<()> + Send + Sync> {
        let handle = self.handle.clone();
        let global = handle.global_rank;
        Arc::new(move || {
            if handle.is_aborted() {
                Err(Error::Training(format!(
                    "rank {global}: the NCCL communicator was aborted after a failure (see the \
                     watchdog's report above)"
                )))
            } else {
                Ok(())
            }
        })
    }

    /// For in-place operations on a non-contiguous tensor: works on a contiguous copy and
    /// writes the result back when waited for.
    fn in_place(&self, tensor: &Tensor, run: impl FnOnce(&Tensor) -> Result<Work>) -> Result<Work> {
        if tensor.is_contiguous() {
            return run(tensor);
        }
        let worked = tensor.f_contiguous()?;
        let inner = run(&worked)?;
        Ok(Work::from_handle(Box::new(CopyBack { inner, target: tensor.shallow_clone(), worked })))
    }
}

/// NCCL refuses fp8 reductions below compute capability 9.0 and sums in fp8 above, which
/// loses most of the precision: refused everywhere, as PyTorch refuses them (fp8 moves
/// through broadcast, all-gather and send/recv, which copy it exactly).
fn refuse_fp8_reduction(kind: tch::Kind) -> Result<()> {
    if matches!(kind, tch::Kind::Float8e4m3fn | tch::Kind::Float8e5m2) {
        return Err(Error::Config(format!(
            "NCCL reductions of fp8 ({kind:?}) are refused, as PyTorch refuses them: reduce in \
             bf16 or fp32 (fp8 may be broadcast, gathered and sent)"
        )));
    }
    Ok(())
}

/// # Safety
/// `t` must be a live tensor; the pointer is `byte_offset` bytes past its data.
unsafe fn at(t: &Tensor, elements: usize) -> *mut std::ffi::c_void {
    // SAFETY: upheld by the caller; the offset stays inside the tensor's storage.
    unsafe { t.data_ptr().cast::<u8>().add(elements * t.kind().elt_size_in_bytes()).cast() }
}

impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        self.handle.rank
    }

    fn size(&self) -> usize {
        self.handle.size
    }

    fn backend(&self) -> Backend {
        Backend::Nccl
    }

    #[track_caller]
    fn all_reduce_async(&self, tensor: &Tensor, op: ReduceOp) -> Result<Work> {
        let site = Location::caller();
        refuse_fp8_reduction(tensor.kind())?;
        let dtype = ffi::data_type(tensor.kind(), self.handle.nccl.version)?;
        let red = ffi::reduction(op, tensor.kind())?;
        self.in_place(tensor, |t| {
            // SAFETY: in-place on a live contiguous tensor of `numel` elements.
            self.enqueue(
                Op::AllReduce(op),
                site,
                &[t],
                "ncclAllReduce",
                |nccl, comm, stream| unsafe {
                    (nccl.all_reduce)(
                        t.data_ptr(),
                        t.data_ptr(),
                        t.numel(),
                        dtype,
                        red,
                        comm,
                        stream,
                    )
                },
            )
        })
    }

    #[track_caller]
    fn broadcast_async(&self, tensor: &Tensor, root: usize) -> Result<Work> {
        let site = Location::caller();
        check_rank(root, self.size())?;
        let dtype = ffi::data_type(tensor.kind(), self.handle.nccl.version)?;
        let root = root as c_int;
        self.in_place(tensor, |t| {
            // SAFETY: as in all_reduce_async.
            self.enqueue(Op::Broadcast, site, &[t], "ncclBroadcast", |nccl, comm, stream| unsafe {
                (nccl.broadcast)(t.data_ptr(), t.data_ptr(), t.numel(), dtype, root, comm, stream)
            })
        })
    }

    #[track_caller]
    fn all_gather_in_place_async(&self, buffer: &Tensor) -> Result<Work> {
        let site = Location::caller();
        let k = in_place_share(buffer, self.size(), "all_gather")?;
        let dtype = ffi::data_type(buffer.kind(), self.handle.nccl.version)?;
        let rank = self.rank();
        // SAFETY: NCCL's in-place all-gather: sendbuff = recvbuff + rank·k, inside `buffer`
        // (size·k elements, contiguous, checked).
        self.enqueue(Op::AllGather, site, &[buffer], "ncclAllGather", |nccl, comm, stream| unsafe {
            (nccl.all_gather)(at(buffer, rank * k), buffer.data_ptr(), k, dtype, comm, stream)
        })
    }

    #[track_caller]
    fn reduce_scatter_in_place_async(&self, buffer: &Tensor, op: ReduceOp) -> Result<Work> {
        let site = Location::caller();
        refuse_fp8_reduction(buffer.kind())?;
        let k = in_place_share(buffer, self.size(), "reduce_scatter")?;
        let dtype = ffi::data_type(buffer.kind(), self.handle.nccl.version)?;
        let red = ffi::reduction(op, buffer.kind())?;
        let rank = self.rank();
        let op_ = Op::ReduceScatter(op);
        // SAFETY: NCCL's in-place reduce-scatter: recvbuff = sendbuff + rank·k, inside
        // `buffer` (size·k elements, contiguous, checked).
        self.enqueue(op_, site, &[buffer], "ncclReduceScatter", |nccl, comm, stream| unsafe {
            (nccl.reduce_scatter)(
                buffer.data_ptr(),
                at(buffer, rank * k),
                k,
                dtype,
                red,
                comm,
                stream,
            )
        })
    }

    #[track_caller]
    fn send_async(&self, tensor: &Tensor, to: usize) -> Result<Work> {
        let site = Location::caller();
        check_rank(to, self.size())?;
        let t = tensor.f_contiguous()?;
        let dtype = ffi::data_type(t.kind(), self.handle.nccl.version)?;
        // SAFETY: a live contiguous tensor of `numel` elements, read by NCCL.
        self.enqueue(Op::SendRecv, site, &[&t], "ncclSend", |nccl, comm, stream| unsafe {
            (nccl.send)(t.data_ptr(), t.numel(), dtype, to as c_int, comm, stream)
        })
    }

    #[track_caller]
    fn recv_async(&self, tensor: &Tensor, from: usize) -> Result<Work> {
        let site = Location::caller();
        check_rank(from, self.size())?;
        let dtype = ffi::data_type(tensor.kind(), self.handle.nccl.version)?;
        self.in_place(tensor, |t| {
            // SAFETY: a live contiguous tensor of `numel` elements, written by NCCL.
            self.enqueue(Op::SendRecv, site, &[t], "ncclRecv", |nccl, comm, stream| unsafe {
                (nccl.recv)(t.data_ptr(), t.numel(), dtype, from as c_int, comm, stream)
            })
        })
    }

    /// One NCCL group (`ncclGroupStart`/`End`): the send and the receive proceed together,
    /// so neighbours exchanging at once cannot block each other.
    #[track_caller]
    fn send_recv_async(
        &self,
        send: &Tensor,
        to: usize,
        recv: &Tensor,
        from: usize,
    ) -> Result<Work> {
        let site = Location::caller();
        check_rank(to, self.size())?;
        check_rank(from, self.size())?;
        let out = send.f_contiguous()?;
        let send_type = ffi::data_type(out.kind(), self.handle.nccl.version)?;
        let recv_type = ffi::data_type(recv.kind(), self.handle.nccl.version)?;
        self.in_place(recv, |into| {
            self.enqueue(Op::SendRecv, site, &[into, &out], "ncclGroupEnd", |nccl, comm, stream| {
                // SAFETY: live contiguous tensors; NCCL groups the two calls and launches them
                // at ncclGroupEnd, whose status is returned.
                unsafe {
                    let started = (nccl.group_start)();
                    if started != ffi::SUCCESS {
                        return started;
                    }
                    let sent = (nccl.send)(
                        out.data_ptr(),
                        out.numel(),
                        send_type,
                        to as c_int,
                        comm,
                        stream,
                    );
                    let received = (nccl.recv)(
                        into.data_ptr(),
                        into.numel(),
                        recv_type,
                        from as c_int,
                        comm,
                        stream,
                    );
                    let ended = (nccl.group_end)();
                    [sent, received, ended]
                        .into_iter()
                        .find(|&s| s != ffi::SUCCESS && s != ffi::IN_PROGRESS)
                        .unwrap_or(ended)
                }
            })
        })
    }

    /// One NCCL group of a send to and a receive from every rank (how torch's
    /// `all_to_all_single` runs on NCCL), the part for this rank copied by NCCL as well.
    #[track_caller]
    fn all_to_all_async(&self, output: &Tensor, input: &Tensor) -> Result<Work> {
        let site = Location::caller();
        let k = crate::comm::all_to_all_part(self.size(), output, input)? as usize;
        let input = input.f_contiguous()?;
        let dtype = ffi::data_type(input.kind(), self.handle.nccl.version)?;
        let n = self.size();
        self.enqueue(Op::AllToAll, site, &[output, &input], "ncclGroupEnd", |nccl, comm, stream| {
            // SAFETY: live contiguous tensors of n × k elements (checked above); NCCL groups
            // the calls and launches them at ncclGroupEnd, whose status is returned.
            unsafe {
                let started = (nccl.group_start)();
                if started != ffi::SUCCESS {
                    return started;
                }
                let mut first_failure = None;
                for peer in 0..n {
                    let sent =
                        (nccl.send)(at(&input, peer * k), k, dtype, peer as c_int, comm, stream);
                    let received =
                        (nccl.recv)(at(output, peer * k), k, dtype, peer as c_int, comm, stream);
                    first_failure = first_failure.or([sent, received]
                        .into_iter()
                        .find(|&s| s != ffi::SUCCESS && s != ffi::IN_PROGRESS));
                }
                let ended = (nccl.group_end)();
                first_failure.unwrap_or(ended)
            }
        })
    }

    /// An all-reduce of one element on the GPU, waited for by the host.
    #[track_caller]
    fn barrier(&self) -> Result<()> {
        let flag = Tensor::f_zeros([1], (Kind::Float, Device::Cuda(self.device_index)))?;
        self.all_reduce_async(&flag, ReduceOp::Sum)?.wait()?;
        Stream::current(self.device_index)?.synchronize()?;
        self.watchdog.failure()
    }

    fn abort(&self) {
        self.handle.abort();
    }

    fn ledger(&self) -> Option<&Ledger> {
        Some(&self.ledger)
    }

    fn scope(&self) -> Option<Scope> {
        (self.size() > 1).then(|| Scope {
            name: self.scope.clone(),
            rank: self.rank(),
            members: self.control.members().to_vec(),
        })
    }
}

/// `k`, the share of each of `size` ranks in an in-place all-gather or reduce-scatter
/// `buffer`, checked.
fn in_place_share(buffer: &Tensor, size: usize, what: &str) -> Result<usize> {
    if !buffer.is_contiguous() || buffer.numel() % size != 0 {
        return Err(Error::Training(format!(
            "{what} in place needs a contiguous buffer whose size divides by the {size} ranks, got \
             shape {:?}",
            buffer.size()
        )));
    }
    Ok(buffer.numel() / size)
}

/// An NCCL operation's completion: its event on the communication stream.
struct NcclWork {
    done: Arc<Event>,
    device_index: usize,
    failure: Arc<dyn Fn() -> Result<()> + Send + Sync>,
}

impl WorkHandle for NcclWork {
    /// Orders the current stream after the operation; the host does not wait.
    fn wait(self: Box<Self>) -> Result<()> {
        (self.failure)()?;
        self.done.block(&Stream::current(self.device_index)?)
    }
}

/// An in-place operation on a non-contiguous tensor, done on a contiguous copy.
struct CopyBack {
    inner: Work,
    target: Tensor,
    worked: Tensor,
}

impl WorkHandle for CopyBack {
    /// Waits for the operation, then writes the copy back (on the current stream).
    fn wait(self: Box<Self>) -> Result<()> {
        self.inner.wait()?;
        self.target.shallow_clone().f_copy_(&self.worked)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests;
