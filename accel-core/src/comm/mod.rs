//! Processes working together.
//!
//! - [`Communicator`]: the collectives strategies use on tensors (all-reduce,
//!   reduce-scatter, all-gather, broadcast, send/recv, barrier), each with an async form
//!   returning a [`Work`] handle. Implemented by [`ProcessGroup`] (the `cpu` backend: TCP
//!   between machines, direct copies between processes of one machine; cpu/), by
//!   [`LocalComm`] (a group of one, no traffic), and on GPUs by NCCL ([`nccl`]).
//! - [`ProcessGroup`] also carries the control traffic: objects, subgroups, and the
//!   rendezvous [`store`] it was made through. Control traffic always stays on CPU.
//!
//! Every operation has a sequence number, the same on all ranks, and a timeout (30 min by
//! default, like torch's gloo; `ACCEL_TIMEOUT_SECS` or [`GroupOptions::timeout`]). A
//! timeout names the operation, its number, the tensor's shape and dtype, and the ranks
//! that did not arrive. Every collective is noted with its call site in the
//! communicator's [`ledger`], and at each optimizer step the ranks compare ledgers, so a
//! rank that skipped or reordered one is named with the source line within a step.

pub mod auth;
mod cpu;
mod group;
pub mod ledger;
pub mod nccl;
pub(crate) mod progress;
pub mod store;

pub use cpu::direct::Transport;

use std::fmt;
use std::net::TcpListener;
use std::sync::mpsc::Receiver;
use std::time::Duration;

use tch::Tensor;

pub use crate::collective::{Op, ReduceOp};
use crate::error::{Error, Result};
pub use group::ProcessGroup;

/// The default timeout of the cpu backend (torch's gloo default).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// How a group is made.
#[derive(Debug, Clone)]
pub struct GroupOptions {
    /// Bound on every wait: rendezvous and each collective.
    pub timeout: Duration,
    /// Copy data straight between the processes of each machine (`process_vm_readv`)
    /// instead of through TCP. On by default; `ACCEL_DISABLE_CMA=1`
    /// turns it off. Falls back to TCP by itself where the kernel forbids it.
    pub direct_copy: bool,
    /// The run's shared secret, proven on every store and mesh connection.
    pub token: auth::Token,
    /// Stands in for this machine's identity (boot id and host name), so that threads of one
    /// process can play ranks on several machines in tests.
    #[doc(hidden)]
    pub machine: Option<String>,
}

impl Default for GroupOptions {
    /// The default timeout, direct copies unless `ACCEL_DISABLE_CMA` is set.
    fn default() -> Self {
        Self {
            timeout: DEFAULT_TIMEOUT,
            direct_copy: std::env::var_os(crate::config::env::DISABLE_CMA).is_none(),
            token: auth::Token::none(),
            machine: None,
        }
    }
}

impl GroupOptions {
    /// The defaults with `ACCEL_TIMEOUT_SECS` and the run's token (`ACCEL_TOKEN`,
    /// `ACCEL_TOKEN_FILE`) applied; a timeout that is not a positive number of seconds is an
    /// error naming it (not a silent default).
    pub fn from_env() -> Result<Self> {
        let mut options = Self { token: auth::Token::from_env()?, ..Self::default() };
        if let Ok(value) = std::env::var(crate::config::env::TIMEOUT_SECS) {
            options.timeout = Duration::from_secs_f64(
                crate::config::parse_seconds(&value, false)
                    .map_err(|e| Error::Config(format!("ACCEL_TIMEOUT_SECS: {e}")))?,
            );
        }
        Ok(options)
    }
}

/// Which implementation carries a communicator's traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// A group of one process: every collective is the identity.
    Local,
    /// accel's CPU transport (TCP, direct copies between processes of one machine).
    Cpu,
    /// NCCL on CUDA tensors.
    Nccl,
}

/// A pending operation started by an `_async` method; [`Work::wait`] blocks until this rank
/// is done with it (for GPU backends: until the work is ordered before the current stream's).
#[derive(Debug)]
#[must_use = "an async collective must be waited for"]
pub struct Work {
    state: WorkState,
}

enum WorkState {
    Done(Result<()>),
    Channel(Receiver<Result<()>>),
    Handle(Box<dyn WorkHandle>),
}

impl fmt::Debug for WorkState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            WorkState::Done(_) => "Done",
            WorkState::Channel(_) => "Pending",
            WorkState::Handle(_) => "Handle",
        })
    }
}

/// What a backend's pending operation must offer (e.g. a CUDA event to wait on).
pub trait WorkHandle: Send {
    /// Returns once the operation's result may be used on this thread: for the cpu backend
    /// when it is complete; for GPU backends when the current stream is ordered after it
    /// (the host does not wait: reading the result on the host, or from another stream,
    /// synchronises as any GPU result does). A failure known by then is returned.
    fn wait(self: Box<Self>) -> Result<()>;
}

impl Work {
    /// A finished operation with this outcome.
    pub fn done(outcome: Result<()>) -> Self {
        Self { state: WorkState::Done(outcome) }
    }

    /// An operation whose outcome arrives on `receiver` (the cpu backend's worker thread).
    pub(crate) fn channel(receiver: Receiver<Result<()>>) -> Self {
        Self { state: WorkState::Channel(receiver) }
    }

    /// An operation a backend tracks itself.
    pub fn from_handle(handle: Box<dyn WorkHandle>) -> Self {
        Self { state: WorkState::Handle(handle) }
    }

    /// Blocks until the operation has finished on this rank.
    pub fn wait(self) -> Result<()> {
        match self.state {
            WorkState::Done(outcome) => outcome,
            WorkState::Channel(receiver) => receiver.recv().unwrap_or_else(|_| {
                Err(Error::Training("the process group's worker thread is gone".into()))
            }),
            WorkState::Handle(handle) => handle.wait(),
        }
    }
}

/// Collectives on tensors among a fixed set of processes; what every strategy uses. Each
/// rank must issue the same operations in the same order with the same shapes and dtypes.
///
/// The `_async` methods start an operation and return its [`Work`]; the tensors must stay
/// alive and untouched until it is waited for. The plain forms wait.
pub trait Communicator: Send + Sync + fmt::Debug {
    /// This process's rank in the communicator.
    fn rank(&self) -> usize;
    /// Number of processes.
    fn size(&self) -> usize;
    /// Which implementation this is.
    fn backend(&self) -> Backend;

    /// Reduces `tensor` across ranks, in place.
    #[track_caller]
    fn all_reduce_async(&self, tensor: &Tensor, op: ReduceOp) -> Result<Work>;
    /// Copies rank `root`'s `tensor` into every rank's, in place.
    #[track_caller]
    fn broadcast_async(&self, tensor: &Tensor, root: usize) -> Result<Work>;
    /// Fills the contiguous `buffer` (size × k elements) with every rank's slice
    /// `[r·k, (r+1)·k)`, in place; this rank's slice must hold its part.
    #[track_caller]
    fn all_gather_in_place_async(&self, buffer: &Tensor) -> Result<Work>;
    /// Reduces the contiguous `buffer` (size × k elements) across ranks, in place:
    /// afterwards this rank's slice `[rank·k, (rank+1)·k)` holds the reduction and the rest
    /// is scratch.
    #[track_caller]
    fn reduce_scatter_in_place_async(&self, buffer: &Tensor, op: ReduceOp) -> Result<Work>;
    /// Sends `tensor` to rank `to`, which receives it into a tensor of the same shape and
    /// dtype.
    #[track_caller]
    fn send_async(&self, tensor: &Tensor, to: usize) -> Result<Work>;
    /// Receives into `tensor` what rank `from` sends.
    #[track_caller]
    fn recv_async(&self, tensor: &Tensor, from: usize) -> Result<Work>;
    /// Stops taking part at once: ranks waiting on this one get an error instead of waiting
    /// for their timeout. The communicator is unusable afterwards.
    fn abort(&self);

    /// The collectives it issued since the last optimizer step, with their call sites, for
    /// the sequence check ([`ledger`]); `None` where it keeps none (a group of one).
    fn ledger(&self) -> Option<&ledger::Ledger> {
        None
    }

    /// Where its ranks post for the sequence check; `None` where there is nothing to
    /// compare.
    fn scope(&self) -> Option<ledger::Scope> {
        None
    }

    /// Sends `send` to rank `to` while receiving into `recv` from rank `from` (NCCL's
    /// grouped send/recv, torch's `batch_isend_irecv`): what neighbouring pipeline stages
    /// exchange, neither waiting for the other. By default one after the other, which a
    /// backend must override where a large send blocks until it is received.
    #[track_caller]
    fn send_recv_async(
        &self,
        send: &Tensor,
        to: usize,
        recv: &Tensor,
        from: usize,
    ) -> Result<Work> {
        self.send_async(send, to)?.wait()?;
        self.recv_async(recv, from)
    }

    /// Exchanges equal parts with every rank (all-to-all; torch's `all_to_all_single`):
    /// `input` and the contiguous `output` have the same number of elements, `size()` parts
    /// of it in their flat layout; part `j` of `input` goes to rank `j`, and part `i` of
    /// `output` receives rank `i`'s part `rank()`. By default pairwise exchanges over
    /// [`send_recv_async`](Self::send_recv_async) (gloo's algorithm), waited for here;
    /// backends override it with one operation of their own.
    #[track_caller]
    fn all_to_all_async(&self, output: &Tensor, input: &Tensor) -> Result<Work> {
        let k = all_to_all_part(self.size(), output, input)?;
        let (n, rank) = (self.size(), self.rank());
        let (input, flat) = (input.f_contiguous()?.f_view([-1])?, output.f_view([-1])?);
        let part = |t: &Tensor, i: usize| t.f_narrow(0, i as i64 * k, k);
        part(&flat, rank)?.f_copy_(&part(&input, rank)?)?;
        for step in 1..n {
            let (to, from) = ((rank + step) % n, (rank + n - step) % n);
            self.send_recv_async(&part(&input, to)?, to, &part(&flat, from)?, from)?.wait()?;
        }
        Ok(Work::done(Ok(())))
    }

    /// [`all_to_all_async`](Self::all_to_all_async) into a new tensor of `input`'s shape,
    /// waited for.
    #[track_caller]
    fn all_to_all(&self, input: &Tensor) -> Result<Tensor> {
        let output = Tensor::f_empty(input.size(), (input.kind(), input.device()))?;
        self.all_to_all_async(&output, input)?.wait()?;
        Ok(output)
    }

    /// [`all_reduce_async`](Self::all_reduce_async), waited for.
    #[track_caller]
    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<()> {
        self.all_reduce_async(tensor, op)?.wait()
    }
    /// [`broadcast_async`](Self::broadcast_async), waited for.
    #[track_caller]
    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<()> {
        self.broadcast_async(tensor, root)?.wait()
    }
    /// [`send_async`](Self::send_async), waited for.
    #[track_caller]
    fn send(&self, tensor: &Tensor, to: usize) -> Result<()> {
        self.send_async(tensor, to)?.wait()
    }
    /// [`recv_async`](Self::recv_async), waited for.
    #[track_caller]
    fn recv(&self, tensor: &Tensor, from: usize) -> Result<()> {
        self.recv_async(tensor, from)?.wait()
    }
    /// Waits until every rank gets here.
    #[track_caller]
    fn barrier(&self) -> Result<()> {
        let flag = Tensor::f_zeros([1], (tch::Kind::Float, tch::Device::Cpu))?;
        self.all_reduce(&flag, ReduceOp::Sum)
    }

    /// Every rank's `tensor` (same shape everywhere), concatenated along dim 0 in rank
    /// order into a new tensor; a scalar becomes a `[size]` tensor.
    #[track_caller]
    fn all_gather(&self, tensor: &Tensor) -> Result<Tensor> {
        let (world, rank) = (self.size() as i64, self.rank() as i64);
        let flat = tensor.f_reshape([-1])?;
        let n = flat.numel() as i64;
        let out = Tensor::f_empty([n * world], (tensor.kind(), tensor.device()))?;
        out.f_narrow(0, n * rank, n)?.f_copy_(&flat)?;
        self.all_gather_in_place_async(&out)?.wait()?;
        let mut shape = tensor.size();
        if shape.is_empty() {
            shape = vec![world];
        } else {
            shape[0] *= world;
        }
        Ok(out.f_reshape(&shape)?)
    }

    /// Every rank's `tensor`, as a list in rank order.
    #[track_caller]
    fn all_gather_list(&self, tensor: &Tensor) -> Result<Vec<Tensor>> {
        let gathered = self.all_gather(&tensor.f_unsqueeze(0)?)?;
        Ok((0..self.size() as i64).map(|r| gathered.get(r)).collect())
    }

    /// Reduces `input` (dim 0 of size `size() × k`) across ranks and returns this rank's
    /// slice `[rank·k, (rank+1)·k)` of the result, as a new tensor.
    #[track_caller]
    fn reduce_scatter(&self, input: &Tensor, op: ReduceOp) -> Result<Tensor> {
        let world = self.size() as i64;
        let rows = input.size().first().copied().unwrap_or(0);
        if input.dim() == 0 || rows % world != 0 {
            return Err(Error::Training(format!(
                "reduce_scatter needs dim 0 divisible by the {world} ranks, got shape {:?}",
                input.size()
            )));
        }
        let work = input.f_contiguous()?.f_detach_copy()?;
        self.reduce_scatter_in_place_async(&work, op)?.wait()?;
        let k = rows / world;
        Ok(work.f_narrow(0, k * self.rank() as i64, k)?.f_detach_copy()?)
    }
}

/// A communicator of one process: collectives are the identity (an average of one value
/// is the value) and cost nothing. What a mesh dimension of size 1 uses.
#[derive(Debug, Clone, Copy, Default)]
pub struct LocalComm;

impl Communicator for LocalComm {
    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        1
    }
    fn backend(&self) -> Backend {
        Backend::Local
    }
    fn all_reduce_async(&self, _: &Tensor, _: ReduceOp) -> Result<Work> {
        Ok(Work::done(Ok(())))
    }
    fn broadcast_async(&self, _: &Tensor, root: usize) -> Result<Work> {
        check_rank(root, 1)?;
        Ok(Work::done(Ok(())))
    }
    fn all_gather_in_place_async(&self, _: &Tensor) -> Result<Work> {
        Ok(Work::done(Ok(())))
    }
    fn reduce_scatter_in_place_async(&self, _: &Tensor, _: ReduceOp) -> Result<Work> {
        Ok(Work::done(Ok(())))
    }
    fn send_async(&self, _: &Tensor, to: usize) -> Result<Work> {
        Err(Error::Training(format!("send to rank {to} in a group of one process")))
    }
    fn recv_async(&self, _: &Tensor, from: usize) -> Result<Work> {
        Err(Error::Training(format!("recv from rank {from} in a group of one process")))
    }
    fn abort(&self) {}
}

/// The elements in each of an all-to-all's `world` parts; an error naming the shapes where
/// `output` and `input` cannot be split so.
pub(crate) fn all_to_all_part(world: usize, output: &Tensor, input: &Tensor) -> Result<i64> {
    let n = input.numel();
    if output.numel() != n || n % world != 0 || !output.is_contiguous() {
        return Err(Error::Training(format!(
            "all_to_all needs a contiguous output with as many elements as the input, divisible \
             into {world} equal parts; got input {:?} and output {:?}{}",
            input.size(),
            output.size(),
            if output.is_contiguous() { "" } else { " (not contiguous)" }
        )));
    }
    if output.kind() != input.kind() || output.device() != input.device() {
        return Err(Error::Training(format!(
            "all_to_all: input {:?} on {:?}, output {:?} on {:?}: they must agree",
            input.kind(),
            input.device(),
            output.kind(),
            output.device()
        )));
    }
    Ok((n / world) as i64)
}

pub(crate) fn check_rank(rank: usize, world: usize) -> Result<()> {
    if rank < world {
        Ok(())
    } else {
        Err(Error::Training(format!("rank {rank} is not in this group of {world}")))
    }
}

/// How long a rank's main thread has, after a watchdog or the sequence check found a
/// failure and aborted its communicators, to return the error itself before the process is
/// ended (it may be blocked in a wait that never returns).
pub const EXIT_GRACE: Duration = Duration::from_secs(10);

/// The default reaction to a failure found off the main thread: print it at once, and end
/// the process with code 1 if it is still running [`EXIT_GRACE`] later.
pub(crate) fn exit_after_grace(rank: usize) -> std::sync::Arc<dyn Fn(&str) + Send + Sync> {
    std::sync::Arc::new(move |message: &str| {
        eprintln!("accel: rank {rank}: {message}");
        let _ =
            std::thread::Builder::new().name("accel-exit-after-grace".into()).spawn(move || {
                std::thread::sleep(EXIT_GRACE);
                eprintln!(
                    "accel: rank {rank}: still running {} s after that failure; exiting",
                    EXIT_GRACE.as_secs()
                );
                std::process::exit(1);
            });
    })
}

/// A port that was free a moment ago (for tests and `--main-process-port 0`).
pub fn free_port(addr: &str) -> Result<u16> {
    let listener = TcpListener::bind((addr, 0))
        .map_err(|e| Error::Rendezvous(format!("cannot find a free port on {addr}: {e}")))?;
    Ok(listener.local_addr().map_err(|e| Error::Rendezvous(e.to_string()))?.port())
}

#[cfg(test)]
pub(crate) mod tests;
