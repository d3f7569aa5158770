//! The watchdog of an NCCL communicator (ProcessGroupNCCL's, in spirit): a thread that
//! polls `ncclCommGetAsyncError` and the completion of every operation in flight against
//! the timeout. A communicator aborted by the program (or by a check that reports its own
//! error) ends the watch quietly. On a failure it aborts the communicator (operations in flight end, peers
//! waiting on this rank fail too), keeps the error for the next call to return, and reports
//! it; by default the process then exits, since its main thread may be blocked in a CUDA
//! wait that would never return. It also posts the last operation enqueued to the store,
//! which is how a timeout names the ranks that did not arrive.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::ffi::{IN_PROGRESS, SUCCESS};
use super::handle::Handle;
use crate::comm::Op;
use crate::error::{Error, Result};
use crate::sync::Locked;

/// Something that says whether an operation has completed (a CUDA event in practice).
pub(crate) trait Completion: Send + Sync {
    /// Whether the operation is done.
    fn is_done(&self) -> Result<bool>;
}

impl Completion for crate::shim::cuda_runtime::Event {
    fn is_done(&self) -> Result<bool> {
        self.query()
    }
}

/// An operation in flight.
pub(crate) struct Tracked {
    /// Its number: among collectives, or among point-to-point transfers.
    pub seq: u64,
    /// Optimizer steps handed to the sequence check before it was issued (collectives).
    pub epoch: u64,
    pub op: Op,
    /// A collective (else a point-to-point transfer, numbered apart, not posted).
    pub collective: bool,
    /// Shape and dtype.
    pub what: String,
    pub started: Instant,
    pub done: Arc<dyn Completion>,
}

/// What the watchdog does, and with what.
#[derive(Clone)]
pub(crate) struct WatchdogOptions {
    /// How long an operation may take (`ACCEL_NCCL_TIMEOUT`, `--timeout`; 10 min).
    pub timeout: Duration,
    /// How often it looks.
    pub poll: Duration,
    /// Called once with the failure, before the abort. By default: print it, and end the
    /// process if its main thread has not returned the error itself within
    /// [`crate::comm::EXIT_GRACE`].
    pub on_failure: Arc<dyn Fn(&str) + Send + Sync>,
    /// "; not arrived: rank 2 (last at #14)" for a timeout of operation `seq`.
    pub behind: Arc<dyn Fn(u64) -> String + Send + Sync>,
    /// Posts the last collective enqueued and its epoch (called when it changed, at most
    /// every poll).
    pub post_progress: Arc<dyn Fn(u64, u64) + Send + Sync>,
    /// The communicator's GPU: the watchdog's own CUDA calls (event queries and frees, the
    /// abort) must land there, not on device 0 (`None`: no GPU, the tests' stub).
    pub device_index: Option<usize>,
}

struct Shared {
    handle: Arc<Handle>,
    pending: Mutex<VecDeque<Tracked>>,
    failure: Mutex<Option<String>>,
    /// The last collective enqueued and its epoch.
    enqueued: Mutex<(u64, u64)>,
    stop: AtomicBool,
}

/// Runs until dropped.
pub(crate) struct Watchdog {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Watchdog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watchdog").finish_non_exhaustive()
    }
}

impl Watchdog {
    /// Starts watching `handle`.
    pub fn start(handle: Arc<Handle>, options: WatchdogOptions) -> Result<Self> {
        let shared = Arc::new(Shared {
            handle,
            pending: Mutex::new(VecDeque::new()),
            failure: Mutex::new(None),
            enqueued: Mutex::new((0, 0)),
            stop: AtomicBool::new(false),
        });
        let thread = {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name("accel-nccl-watchdog".into())
                .spawn(move || watch(&shared, &options))
                .map_err(|e| Error::Training(format!("cannot start the NCCL watchdog: {e}")))?
        };
        Ok(Self { shared, thread: Some(thread) })
    }

    /// Watches `op` until it completes.
    pub fn track(&self, op: Tracked) {
        if op.collective {
            let mut enqueued = self.shared.enqueued.locked();
            if op.seq > enqueued.0 {
                *enqueued = (op.seq, op.epoch);
            }
        }
        self.shared.pending.locked().push_back(op);
    }

    /// The failure the watchdog found, if any, as an error (every call after it fails).
    pub fn failure(&self) -> Result<()> {
        match &*self.shared.failure.locked() {
            Some(message) => Err(Error::Training(message.clone())),
            None => Ok(()),
        }
    }

    /// Waits, at most `timeout`, until every operation tracked has completed; false when
    /// some has not (or the watchdog found a failure).
    pub fn drain(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            if self.failure().is_err() || self.shared.handle.is_aborted() {
                return false;
            }
            if self.shared.pending.locked().is_empty() {
                return true;
            }
            if Instant::now() >= deadline || self.thread.as_ref().is_none_or(|t| t.is_finished()) {
                return false;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Operations not yet seen complete (tests).
    #[cfg(test)]
    pub fn in_flight(&self) -> usize {
        self.shared.pending.locked().len()
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn watch(shared: &Shared, options: &WatchdogOptions) {
    if let Some(index) = options.device_index {
        let _ = crate::shim::set_cuda_device(index);
    }
    let rank = shared.handle.global_rank;
    let mut posted = 0;
    while !shared.stop.load(Ordering::SeqCst) {
        // Aborted by someone else — the program (`Accelerator::abort`, a failing run's exit
        // guard) or a check that reports its own error: not a fault to report or to end the
        // process for. Nothing is left to watch.
        if shared.handle.is_aborted() {
            return;
        }
        if let Some(message) = inspect(shared, options, rank) {
            if shared.handle.is_aborted() {
                return;
            }
            *shared.failure.locked() = Some(message.clone());
            (options.on_failure)(&message);
            shared.handle.abort_at_once();
            return;
        }
        let (seq, epoch) = *shared.enqueued.locked();
        if seq != posted {
            (options.post_progress)(seq, epoch);
            posted = seq;
        }
        std::thread::sleep(options.poll);
    }
}

/// One look: the communicator's asynchronous error, then the operations in flight, oldest
/// first (one stream completes them in order). `Some(message)` on a failure.
fn inspect(shared: &Shared, options: &WatchdogOptions, rank: usize) -> Option<String> {
    if let Some((for_, what)) = shared.handle.stuck_launch() {
        return Some(format!(
            "rank {rank}: an NCCL call has not returned after {:.0} s, in {what} (waiting on \
             the host for a peer that never made the same call, or was lost?); the \
             communicator was aborted (ACCEL_NCCL_TIMEOUT or accel launch --timeout sets the \
             limit)",
            for_.as_secs_f64()
        ));
    }
    match shared.handle.async_error() {
        Ok(SUCCESS | IN_PROGRESS) => {}
        Ok(code) => {
            let e = shared.handle.error("ncclCommGetAsyncError", code, None);
            let oldest = shared.pending.locked().front().map(|t| {
                let kind = if t.collective { "collective" } else { "point-to-point transfer" };
                format!("; operation in flight: {kind} #{} {} of {}", t.seq, t.op, t.what)
            });
            return Some(format!(
                "NCCL reported an asynchronous error: {e}{}; the communicator was aborted",
                oldest.unwrap_or_default()
            ));
        }
        Err(e) => return Some(e.to_string()),
    }
    let mut pending = shared.pending.locked();
    while let Some(oldest) = pending.front() {
        match oldest.done.is_done() {
            Ok(true) => {
                pending.pop_front();
            }
            Ok(false) if oldest.started.elapsed() > options.timeout => {
                let (seq, op, what) = (oldest.seq, oldest.op, oldest.what.clone());
                let collective = oldest.collective;
                drop(pending);
                // Progress posts count collectives: they say who is behind in those only.
                let behind = if collective { (options.behind)(seq) } else { String::new() };
                return Some(
                    Error::Collective {
                        op,
                        seq,
                        what,
                        rank,
                        message: format!(
                            "timed out after {:.0} s on the GPU{behind}; the communicator was \
                             aborted (ACCEL_NCCL_TIMEOUT or accel launch --timeout sets the limit)",
                            options.timeout.as_secs_f64()
                        ),
                    }
                    .to_string(),
                );
            }
            Ok(false) => break,
            Err(e) => return Some(format!("cannot query collective #{}: {e}", oldest.seq)),
        }
    }
    None
}
