//! [`Handle`]: one NCCL communicator (`ncclComm_t`) and its life — creation and split
//! (blocking by default, as PyTorch makes its groups; non-blocking on request), every
//! call's status checked (waiting out `ncclInProgress` within a bound),
//! asynchronous errors, and the way out: `ncclCommAbort` on failure, else
//! `ncclCommFinalize` then `ncclCommDestroy`. Knows nothing of tensors or streams.
//!
//! `ncclCommAbort` frees the communicator, so it must not run while another thread is
//! inside a call on it (the watchdog and the sequence check abort from their own threads).
//! Every call is made under a [`Use`]; an abort requested while some are open is carried
//! out by the last one to close, and no new one opens after it.
//!
//! No two NCCL calls on one communicator ever overlap, status queries included: in NCCL
//! 2.28 `ncclCommGetAsyncError` completes a pending group job of a non-blocking
//! communicator and frees it, so the watchdog's poll and a caller's wait could free it
//! twice (PyTorch takes a mutex for the same reason, pytorch#169484). Each call holds
//! [`Handle::api`] for its duration.

use std::ffi::c_int;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::ffi::{Config, IN_PROGRESS, Nccl, RawComm, SUCCESS, UniqueId};
use crate::error::{Error, Result};
use crate::sync::Locked;

/// Who is using the communicator, and whether it is still there.
#[derive(Debug, Default)]
struct Life {
    /// Calls under way (any thread).
    users: usize,
    /// An abort was asked for: no new call starts.
    abort_pending: bool,
    /// `ncclCommAbort` ran: the communicator is gone.
    freed: bool,
}

/// An NCCL communicator. Calls that must not overlap (everything but status queries) are
/// serialised by [`Handle::lock`].
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
    life: Mutex<Life>,
    calls: Mutex<()>,
    /// Held for the duration of every NCCL call on the communicator (after `calls` and
    /// `life` when those are held too).
    api: Mutex<()>,
    /// Made with a blocking config (the default; `ACCEL_NCCL_NONBLOCKING=1` for the other).
    blocking: bool,
    /// The launch under way, if any: when it began and what it is. A blocking call can
    /// wait on the host (connecting to peers at first use, a full work queue behind a stuck
    /// kernel, a split): the watchdog reads this to see one that never returns.
    launching: Mutex<Option<(Instant, String)>>,
}

// SAFETY: NCCL communicators may be used from any thread; no two calls on one overlap
// (`api`), sequences of launches are serialised by `calls`, and `ncclCommAbort`, which
// frees the communicator, runs only when no call is under way (`life`).
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

/// A call (or a run of them) on a live communicator; see the module's comment.
pub(crate) struct Use<'a> {
    handle: &'a Handle,
}

impl Drop for Use<'_> {
    fn drop(&mut self) {
        let mut life = self.handle.life();
        life.users -= 1;
        if life.users == 0 && life.abort_pending && !life.freed {
            life.freed = true;
            let _api = self.handle.api();
            // SAFETY: the last call on the communicator just ended and no other can start
            // (abort_pending); it is freed once (freed).
            unsafe { (self.handle.nccl.comm_abort)(self.handle.comm) };
        }
    }
}

/// The serialised use of a communicator for launching work ([`Handle::lock`]).
pub(crate) struct Calls<'a> {
    _use: Use<'a>,
    _calls: MutexGuard<'a, ()>,
}

impl Handle {
    /// `ncclCommInitRankConfig`, blocking or not (then waited for, at most `timeout`).
    /// Every rank of the new communicator calls it with the same `id`.
    pub fn init(
        nccl: &'static Nccl,
        id: UniqueId,
        size: usize,
        rank: usize,
        global_rank: usize,
        timeout: Duration,
        blocking: bool,
    ) -> Result<Self> {
        let mut comm: RawComm = std::ptr::null_mut();
        let mut config = Config::new(blocking);
        let (n, r) = (as_int(size)?, as_int(rank)?);
        // SAFETY: out-pointer and config are live locals; the id is passed by value as
        // nccl.h declares.
        let status = unsafe { (nccl.comm_init_rank_config)(&mut comm, n, id, r, &mut config) };
        let call = "ncclCommInitRankConfig";
        Self::adopt(nccl, comm, status, call, size, rank, global_rank, timeout, blocking)
    }

    /// `ncclCommSplit`: every rank of this communicator calls it; those with the same
    /// `color` form a new communicator, ranked by `key`. `None` for `color` < 0 (this rank
    /// takes no part).
    pub fn split(&self, color: i32, key: usize, size: usize) -> Result<Option<Self>> {
        let mut comm: RawComm = std::ptr::null_mut();
        let mut config = Config::new(self.blocking);
        {
            // The parent is in progress until the split is done: no other call on it meanwhile.
            let _calls = self.lock()?;
            let key = as_int(key)?;
            let status = {
                let _api = self.api();
                // SAFETY: the communicator is live (`lock`); out-pointer and config are
                // locals.
                unsafe {
                    (self.nccl.comm_split)(self.comm, color.max(-1), key, &mut comm, &mut config)
                }
            };
            self.check(status, "ncclCommSplit", None)?;
        }
        if color < 0 {
            return Ok(None);
        }
        // The split's status was checked (and waited out) above: the new one is ready once
        // `ncclCommGetAsyncError` says so.
        Self::adopt(
            self.nccl,
            comm,
            IN_PROGRESS,
            "ncclCommSplit",
            size,
            key,
            self.global_rank,
            self.timeout,
            self.blocking,
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
        blocking: bool,
    ) -> Result<Self> {
        let error = |code, message| Error::Nccl {
            call: call.into(),
            code,
            rank: global_rank,
            during: String::new(),
            message,
        };
        if status != SUCCESS && status != IN_PROGRESS {
            let message = nccl.describe(status, comm);
            if !comm.is_null() {
                // SAFETY: a communicator NCCL handed out, abandoned here once.
                unsafe { (nccl.comm_abort)(comm) };
            }
            return Err(error(status, message));
        }
        if comm.is_null() {
            return Err(error(status, "NCCL returned no communicator".into()));
        }
        let handle = Self {
            nccl,
            comm,
            rank,
            size,
            global_rank,
            timeout,
            life: Mutex::new(Life::default()),
            calls: Mutex::new(()),
            api: Mutex::new(()),
            blocking,
            launching: Mutex::new(None),
        };
        handle.wait_ready(call, None)?;
        Ok(handle)
    }

    fn life(&self) -> MutexGuard<'_, Life> {
        self.life.locked()
    }

    /// A use of the communicator, refused once an abort was asked for.
    fn enter(&self) -> Result<Use<'_>> {
        let mut life = self.life();
        if life.abort_pending || life.freed {
            return Err(self.aborted_error());
        }
        life.users += 1;
        Ok(Use { handle: self })
    }

    /// Held around each NCCL call on the communicator: no two overlap (see the module).
    pub fn api(&self) -> MutexGuard<'_, ()> {
        self.api.locked()
    }

    /// Runs `call` (one NCCL launch) on the communicator under [`Handle::api`], marked as
    /// under way for the watchdog ([`Handle::stuck_launch`]).
    pub fn launch<T>(&self, during: &str, call: impl FnOnce(RawComm) -> T) -> Result<T> {
        let _use = self.enter()?;
        *self.launching.locked() = Some((Instant::now(), during.to_owned()));
        let out = {
            let _api = self.api();
            call(self.comm)
        };
        *self.launching.locked() = None;
        Ok(out)
    }

    /// The launch under way for longer than the timeout, if any: how long, and what.
    pub fn stuck_launch(&self) -> Option<(Duration, String)> {
        let launching = self.launching.locked();
        let (since, what) = launching.as_ref()?;
        (since.elapsed() > self.timeout).then(|| (since.elapsed(), what.clone()))
    }

    /// Serialises calls on the communicator, and keeps it alive while they run.
    pub fn lock(&self) -> Result<Calls<'_>> {
        let calls = self.calls.locked();
        Ok(Calls { _use: self.enter()?, _calls: calls })
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
        let _use = self.enter()?;
        let mut state = SUCCESS;
        // A blocking communicator has no group job to complete here: the call only reads
        // its error state (NCCL 2.28 group.cc), so it need not wait behind a call that is
        // blocked on the host — which is what the watchdog polls to find.
        let _api = (!self.blocking).then(|| self.api());
        // SAFETY: the communicator is live while `_use` is (no abort frees it meanwhile);
        // non-blocking, no other call on it runs (`_api`); out-pointer to a local.
        let status = unsafe { (self.nccl.comm_get_async_error)(self.comm, &mut state) };
        drop(_api);
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

    /// Whether [`Handle::abort`] was asked for.
    pub fn is_aborted(&self) -> bool {
        self.life().abort_pending
    }

    /// `ncclCommAbort`, once, from any thread: at once when no call is under way, else
    /// when the last one ends; no call starts after this. Operations in flight end with an
    /// error, peers waiting on this rank see it fail, and the communicator is freed.
    pub fn abort(&self) {
        let mut life = self.life();
        life.abort_pending = true;
        if life.users == 0 && !life.freed {
            life.freed = true;
            let _api = self.api();
            // SAFETY: no call is under way and none can start; freed once.
            unsafe { (self.nccl.comm_abort)(self.comm) };
        }
    }
}

impl Handle {
    /// The failure path's abort (the watchdog's): `ncclCommAbort` now, even while a call is
    /// under way — NCCL's abort sets the flags that release a call blocked on the host, so
    /// waiting for that call to end first would wait forever (PyTorch aborts so too). The
    /// caller of that call gets an error, and no call starts after this. A non-blocking
    /// communicator's calls are short: their end is waited for up to a second, since one
    /// may be completing a group job the abort would free.
    pub fn abort_at_once(&self) {
        {
            let mut life = self.life();
            life.abort_pending = true;
            if life.freed {
                return;
            }
            life.freed = true;
        }
        let _api = if self.blocking {
            None
        } else {
            let deadline = Instant::now() + Duration::from_secs(1);
            loop {
                match self.api.try_lock() {
                    Ok(guard) => break Some(guard),
                    Err(std::sync::TryLockError::Poisoned(e)) => break Some(e.into_inner()),
                    Err(std::sync::TryLockError::WouldBlock) if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(1))
                    }
                    Err(std::sync::TryLockError::WouldBlock) => break None,
                }
            }
        };
        // SAFETY: freed once (`freed`); see above for the call that may still be inside.
        unsafe { (self.nccl.comm_abort)(self.comm) };
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
        let status = {
            let _api = self.api();
            // SAFETY: live communicator (no use can be open: we are dropping it), finalized
            // once.
            unsafe { (self.nccl.comm_finalize)(self.comm) }
        };
        if self.check(status, "ncclCommFinalize", None).is_err() {
            self.abort();
            return;
        }
        let _api = self.api();
        // SAFETY: finalized above; destroyed once.
        unsafe { (self.nccl.comm_destroy)(self.comm) };
    }
}

fn as_int(n: usize) -> Result<c_int> {
    c_int::try_from(n).map_err(|_| Error::Config(format!("{n} is too large for NCCL's int")))
}
