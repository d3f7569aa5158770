//! [`Handle`]: one NCCL communicator (`ncclComm_t`) and its life — non-blocking creation
//! and split, every call's status checked (waiting out `ncclInProgress` within a bound),
//! asynchronous errors, and the way out: `ncclCommAbort` on failure, else
//! `ncclCommFinalize` then `ncclCommDestroy`. Knows nothing of tensors or streams.

use std::ffi::c_int;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::ffi::{Config, IN_PROGRESS, Nccl, RawComm, SUCCESS, UniqueId};
use crate::error::{Error, Result};

/// An NCCL communicator. Calls on it are serialised by [`Handle::lock`] (NCCL does not
/// allow concurrent calls on one communicator); status queries and abort are not, as NCCL
/// allows them from any thread at any time.
pub(crate) struct Handle {
    pub nccl: &'static Nccl,
    comm: RawComm,
    /// Group rank and size.
    pub rank: usize,
    pub size: usize,
    /// This process's rank in the world, for messages.
    pub global_rank: usize,
    /// How long a call may stay `ncclInProgress`.
    pub timeout: Duration,
    aborted: AtomicBool,
    calls: Mutex<()>,
}

// SAFETY: NCCL communicators may be used from any thread; calls that must not overlap are
// serialised by `calls`, and ncclCommGetAsyncError / ncclCommAbort are documented as safe to
// call concurrently with the others.
unsafe impl Send for Handle {}
// SAFETY: as above.
unsafe impl Sync for Handle {}

impl std::fmt::Debug for Handle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Handle").field("rank", &self.rank).field("size", &self.size).finish()
    }
}

/// Where a failed call was made, for its message: " in collective #12 all_reduce(sum) of
/// [4] Float".
pub(crate) type During<'a> = Option<&'a str>;

impl Handle {
    /// `ncclCommInitRankConfig` with a non-blocking config, waited for (at most `timeout`).
    /// Every rank of the new communicator calls it with the same `id`.
    pub fn init(
        nccl: &'static Nccl,
        id: UniqueId,
        size: usize,
        rank: usize,
        global_rank: usize,
        timeout: Duration,
    ) -> Result<Self> {
        let mut comm: RawComm = std::ptr::null_mut();
        let mut config = Config::non_blocking();
        let (n, r) = (as_int(size)?, as_int(rank)?);
        // SAFETY: out-pointer and config are live locals; the id is passed by value as
        // nccl.h declares.
        let status = unsafe { (nccl.comm_init_rank_config)(&mut comm, n, id, r, &mut config) };
        Self::adopt(nccl, comm, status, "ncclCommInitRankConfig", size, rank, global_rank, timeout)
    }

    /// `ncclCommSplit`: every rank of this communicator calls it; those with the same
    /// `color` form a new communicator, ranked by `key`. `None` for `color` < 0 (this rank
    /// takes no part).
    pub fn split(&self, color: i32, key: usize, size: usize) -> Result<Option<Self>> {
        let mut comm: RawComm = std::ptr::null_mut();
        let mut config = Config::non_blocking();
        let status = {
            let _calls = self.lock();
            // SAFETY: `self.comm` is live (checked by `lock` not being poisoned by abort);
            // out-pointer and config are live locals.
            unsafe {
                (self.nccl.comm_split)(
                    self.comm,
                    color.max(-1),
                    as_int(key)?,
                    &mut comm,
                    &mut config,
                )
            }
        };
        // The parent finishes its part of the split like any call.
        self.check(status, "ncclCommSplit", None)?;
        if color < 0 {
            return Ok(None);
        }
        Self::adopt(
            self.nccl,
            comm,
            IN_PROGRESS,
            "ncclCommSplit",
            size,
            key,
            self.global_rank,
            self.timeout,
        )
        .map(Some)
    }

    #[allow(clippy::too_many_arguments)]
    fn adopt(
        nccl: &'static Nccl,
        comm: RawComm,
        status: c_int,
        call: &str,
        size: usize,
        rank: usize,
        global_rank: usize,
        timeout: Duration,
    ) -> Result<Self> {
        if status != SUCCESS && status != IN_PROGRESS {
            let message = nccl.describe(status, comm);
            if !comm.is_null() {
                // SAFETY: a communicator NCCL handed out, abandoned here once.
                unsafe { (nccl.comm_abort)(comm) };
            }
            return Err(Error::Nccl {
                call: call.into(),
                code: status,
                rank: global_rank,
                during: String::new(),
                message,
            });
        }
        if comm.is_null() {
            return Err(Error::Nccl {
                call: call.into(),
                code: status,
                rank: global_rank,
                during: String::new(),
                message: "NCCL returned no communicator".into(),
            });
        }
        let handle = Self {
            nccl,
            comm,
            rank,
            size,
            global_rank,
            timeout,
            aborted: AtomicBool::new(false),
            calls: Mutex::new(()),
        };
        handle.wait_ready(call, None)?;
        Ok(handle)
    }

    /// The raw communicator, for calls made under [`Handle::lock`].
    pub fn raw(&self) -> RawComm {
        self.comm
    }

    /// Serialises calls on the communicator.
    pub fn lock(&self) -> MutexGuard<'_, ()> {
        self.calls.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Turns a call's status into a result; `ncclInProgress` is waited out (non-blocking
    /// communicators return it while they finish the call).
    pub fn check(&self, status: c_int, call: &str, during: During<'_>) -> Result<()> {
        match status {
            SUCCESS => Ok(()),
            IN_PROGRESS => self.wait_ready(call, during),
            code => Err(self.error(call, code, during)),
        }
    }

    /// Polls `ncclCommGetAsyncError` until the communicator is no longer in progress, at
    /// most [`Handle::timeout`]; a timeout aborts it.
    fn wait_ready(&self, call: &str, during: During<'_>) -> Result<()> {
        let deadline = Instant::now() + self.timeout;
        let mut pause = Duration::from_micros(20);
        loop {
            match self.async_error()? {
                SUCCESS => return Ok(()),
                IN_PROGRESS if Instant::now() < deadline => {
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_millis(10));
                }
                IN_PROGRESS => {
                    self.abort();
                    return Err(Error::Nccl {
                        call: call.into(),
                        code: IN_PROGRESS,
                        rank: self.global_rank,
                        during: during.map(|d| format!(" in {d}")).unwrap_or_default(),
                        message: format!(
                            "still in progress after {:.0} s (a peer that never made the same \
                             call?); the communicator was aborted",
                            self.timeout.as_secs_f64()
                        ),
                    });
                }
                code => return Err(self.error(call, code, during)),
            }
        }
    }

    /// `ncclCommGetAsyncError`: `SUCCESS`, `IN_PROGRESS`, or the error that broke the
    /// communicator (a peer lost, a remote error...).
    pub fn async_error(&self) -> Result<c_int> {
        if self.aborted.load(Ordering::SeqCst) {
            return Err(self.aborted_error());
        }
        let mut state = SUCCESS;
        // SAFETY: live communicator (not aborted, checked above; abort and this query may
        // race, which NCCL allows); out-pointer to a local.
        let status = unsafe { (self.nccl.comm_get_async_error)(self.comm, &mut state) };
        if status != SUCCESS {
            return Err(self.error("ncclCommGetAsyncError", status, None));
        }
        Ok(state)
    }

    pub fn error(&self, call: &str, code: c_int, during: During<'_>) -> Error {
        Error::Nccl {
            call: call.into(),
            code,
            rank: self.global_rank,
            during: during.map(|d| format!(" in {d}")).unwrap_or_default(),
            message: self.nccl.describe(code, self.comm),
        }
    }

    fn aborted_error(&self) -> Error {
        Error::Nccl {
            call: "a call".into(),
            code: -1,
            rank: self.global_rank,
            during: String::new(),
            message: "the communicator was aborted after an earlier failure".into(),
        }
    }

    /// Whether [`Handle::abort`] ran.
    pub fn is_aborted(&self) -> bool {
        self.aborted.load(Ordering::SeqCst)
    }

    /// `ncclCommAbort`, once: operations in flight end with an error, peers waiting on
    /// this rank see it fail, and the communicator's resources are freed.
    pub fn abort(&self) {
        if !self.aborted.swap(true, Ordering::SeqCst) {
            // SAFETY: live communicator, abandoned once (guarded by `aborted`).
            unsafe { (self.nccl.comm_abort)(self.comm) };
        }
    }
}

impl Drop for Handle {
    /// `ncclCommFinalize` (flushes what is queued, waited for within the timeout), then
    /// `ncclCommDestroy`; an aborted communicator is already gone, and one that does not
    /// finalize in time is aborted instead.
    fn drop(&mut self) {
        if self.is_aborted() {
            return;
        }
        // SAFETY: live communicator, finalized once.
        let status = unsafe { (self.nccl.comm_finalize)(self.comm) };
        if self.check(status, "ncclCommFinalize", None).is_err() {
            self.abort();
            return;
        }
        // SAFETY: finalized above; destroyed once.
        unsafe { (self.nccl.comm_destroy)(self.comm) };
    }
}

fn as_int(n: usize) -> Result<c_int> {
    c_int::try_from(n).map_err(|_| Error::Config(format!("{n} is too large for NCCL's int")))
}
