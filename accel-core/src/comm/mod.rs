//! Processes working together: the rendezvous [`store`], and [`ProcessGroup`], the
//! collectives (`cpu` backend: TCP between processes, gloo's ring algorithms; `nccl`
//! backend for CUDA tensors in [`nccl`]).
//!
//! Every operation has a sequence number, the same on all ranks, and a timeout (30 min by
//! default, like torch's gloo; `ACCEL_TIMEOUT_SECS` or [`GroupOptions::timeout`]). A
//! timeout names the operation, its number, the tensor's shape and dtype, and the ranks
//! that did not arrive (each rank posts its progress to the store, which is read back when
//! something goes wrong).

mod mesh;
pub mod nccl;
pub mod store;

use std::net::TcpListener;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;
use tch::Tensor;

use crate::error::{Error, Result};
use crate::topology::Topology;
pub use mesh::ReduceOp;
use mesh::{Buffer, Fault, Mesh, Tag};
use store::{StoreClient, StoreServer};

/// The default timeout of the cpu backend (torch's gloo default).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// How a group is made.
#[derive(Debug, Clone)]
pub struct GroupOptions {
    /// Bound on every wait: rendezvous and each collective.
    pub timeout: Duration,
    /// When every member is on this machine, copy data straight between processes
    /// (`process_vm_readv`) instead of through TCP. On by default; `ACCEL_DISABLE_CMA=1`
    /// turns it off. Falls back to TCP by itself where the kernel forbids it.
    pub direct_copy: bool,
}

impl Default for GroupOptions {
    fn default() -> Self {
        let timeout = std::env::var("ACCEL_TIMEOUT_SECS")
            .ok()
            .and_then(|s| s.trim().parse::<f64>().ok())
            .map_or(DEFAULT_TIMEOUT, Duration::from_secs_f64);
        Self { timeout, direct_copy: std::env::var_os("ACCEL_DISABLE_CMA").is_none() }
    }
}

type Job = Box<dyn FnOnce(&Mesh) -> std::result::Result<(), Fault> + Send>;

struct Queued {
    seq: u64,
    /// Collectives advance the rank's posted progress; point-to-point messages do not.
    collective: bool,
    what: String,
    job: Job,
    done: Sender<Result<()>>,
}

/// A pending operation started by an `_async` method.
#[derive(Debug)]
#[must_use = "an async collective must be waited for"]
pub struct Work {
    done: Receiver<Result<()>>,
}

impl Work {
    /// Blocks until the operation has finished on this rank.
    pub fn wait(self) -> Result<()> {
        self.done.recv().unwrap_or_else(|_| {
            Err(Error::Training("the process group's worker thread is gone".into()))
        })
    }
}

struct Shared {
    store: Mutex<StoreClient>,
    /// Server of rank 0 of the world group, kept alive with it.
    _server: Option<StoreServer>,
    next_group: AtomicU64,
}

/// A set of processes that run collectives together (the whole world, or a subgroup).
/// Cheap to clone; operations are executed in call order by one worker thread per group.
#[derive(Clone)]
pub struct ProcessGroup {
    rank: usize,
    world: usize,
    /// Global ranks of the members, by group rank.
    members: Arc<Vec<usize>>,
    id: u64,
    seq: Arc<AtomicU64>,
    jobs: Sender<Queued>,
    direct: bool,
    sockets: Arc<Vec<std::net::TcpStream>>,
    /// Point-to-point messages are numbered per peer and direction, apart from the
    /// collectives (which not every rank takes part in).
    p2p: Arc<Mutex<std::collections::HashMap<(usize, bool), u64>>>,
    shared: Arc<Shared>,
    options: GroupOptions,
}

impl std::fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessGroup")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("members", &self.members)
            .finish_non_exhaustive()
    }
}

impl ProcessGroup {
    /// Joins the run described by `topology`: rank 0 starts the store on the master
    /// address, everyone registers and connects to everyone.
    pub fn new(topology: &Topology, options: GroupOptions) -> Result<Self> {
        let server = if topology.rank == 0 {
            Some(StoreServer::start(&topology.master_addr, topology.master_port)?)
        } else {
            None
        };
        let mut store =
            StoreClient::connect(&topology.master_addr, topology.master_port, options.timeout)?;
        store.hello(topology.rank, topology.world_size)?;
        let shared = Arc::new(Shared {
            store: Mutex::new(store),
            _server: server,
            next_group: AtomicU64::new(1),
        });
        let members: Vec<usize> = (0..topology.world_size).collect();
        Self::join(shared, 0, topology.rank, members, options)
    }

    fn join(
        shared: Arc<Shared>,
        id: u64,
        global_rank: usize,
        members: Vec<usize>,
        options: GroupOptions,
    ) -> Result<Self> {
        let rank = members.iter().position(|&r| r == global_rank).expect("a member");
        let world = members.len();
        let prefix = format!("group{id}");
        let (listener, addrs, hosts) = {
            let mut store = shared.store.lock().unwrap_or_else(|e| e.into_inner());
            let ip = store.local_ip()?;
            let listener = TcpListener::bind((ip, 0)).map_err(|e| {
                Error::Rendezvous(format!("rank {global_rank} cannot listen on {ip}: {e}"))
            })?;
            let addr = listener.local_addr().map_err(|e| Error::Rendezvous(e.to_string()))?;
            store.set(&format!("{prefix}/addr/{rank}"), addr.to_string().as_bytes())?;
            let host = format!("{}|{}|{}", host_id(), std::process::id(), mesh::probe_address());
            store.set(&format!("{prefix}/host/{rank}"), host.as_bytes())?;
            store.wait_all(&format!("{prefix}/addr"), world, options.timeout).map_err(
                |e| match e {
                    Error::Rendezvous(m) => {
                        Error::Rendezvous(format!("{m} (group ranks; global ranks {members:?})"))
                    }
                    other => other,
                },
            )?;
            let addrs = (0..world)
                .map(|r| {
                    let bytes = store.get(&format!("{prefix}/addr/{r}"), options.timeout)?;
                    Ok(String::from_utf8_lossy(&bytes).into_owned())
                })
                .collect::<Result<Vec<_>>>()?;
            let hosts = (0..world)
                .map(|r| {
                    let bytes = store.get(&format!("{prefix}/host/{r}"), options.timeout)?;
                    Ok(String::from_utf8_lossy(&bytes).into_owned())
                })
                .collect::<Result<Vec<_>>>()?;
            (listener, addrs, hosts)
        };
        let mut mesh = Mesh::connect(rank, world, id, &listener, &addrs, options.timeout)?;
        // Everyone on this machine: peers read each other's memory directly.
        let parsed: Vec<(String, i32, u64)> = hosts
            .iter()
            .map(|h| {
                let mut parts = h.split('|');
                let host = parts.next().unwrap_or_default().to_owned();
                let pid = parts.next().and_then(|p| p.parse().ok()).unwrap_or(0);
                let probe = parts.next().and_then(|p| p.parse().ok()).unwrap_or(0);
                (host, pid, probe)
            })
            .collect();
        let same_host = parsed.iter().all(|(h, _, _)| *h == parsed[0].0);
        let pids =
            (same_host && options.direct_copy).then(|| parsed.iter().map(|(_, p, _)| *p).collect());
        let probes: Vec<u64> = parsed.iter().map(|(_, _, a)| *a).collect();
        let direct = mesh.enable_local(pids, &probes)?;
        let sockets = Arc::new(mesh.shutdown_handles());
        let (jobs, queue) = channel::<Queued>();
        // The collective each rank is in, posted to the store off the hot path (at most
        // twice a second) for the diagnosis of timeouts.
        let progress = Arc::new(AtomicU64::new(0));
        {
            let (progress, shared) = (Arc::downgrade(&progress), shared.clone());
            std::thread::Builder::new()
                .name(format!("accel-group{id}-progress"))
                .spawn(move || {
                    let mut posted = 0;
                    while let Some(progress) = progress.upgrade() {
                        let seq = progress.load(Ordering::SeqCst);
                        drop(progress);
                        if seq != posted {
                            let key = format!("group{id}/progress/{rank}");
                            if let Ok(mut store) = shared.store.lock() {
                                if store.set(&key, &seq.to_le_bytes()).is_ok() {
                                    posted = seq;
                                }
                            }
                        }
                        std::thread::sleep(Duration::from_millis(500));
                    }
                })
                .map_err(|e| Error::Rendezvous(format!("cannot start the progress thread: {e}")))?;
        }
        let worker_shared = shared.clone();
        let worker_members = members.clone();
        let timeout = options.timeout;
        std::thread::Builder::new()
            .name(format!("accel-group{id}"))
            .spawn(move || {
                for Queued { seq, collective, what, job, done } in queue {
                    if collective {
                        progress.store(seq, Ordering::SeqCst);
                    }
                    let result = job(&mesh).map_err(|fault| {
                        diagnose(
                            fault,
                            seq,
                            &what,
                            rank,
                            world,
                            id,
                            &worker_members,
                            &worker_shared,
                            timeout,
                        )
                    });
                    let _ = done.send(result);
                }
            })
            .map_err(|e| Error::Rendezvous(format!("cannot start the group thread: {e}")))?;
        Ok(Self {
            rank,
            world,
            members: Arc::new(members),
            id,
            seq: Arc::new(AtomicU64::new(1)),
            jobs,
            p2p: Arc::new(Mutex::new(std::collections::HashMap::new())),
            direct,
            sockets,
            shared,
            options,
        })
    }

    /// This process's rank in the group.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of processes in the group.
    pub fn size(&self) -> usize {
        self.world
    }

    /// Global ranks of the members.
    pub fn members(&self) -> &[usize] {
        &self.members
    }

    /// Makes a subgroup of the global ranks `ranks`. Every process of this group must call
    /// it with the same list, in the same order as its other `new_subgroup` calls; members
    /// get `Some(group)`, the others `None`.
    pub fn new_subgroup(&self, ranks: &[usize]) -> Result<Option<ProcessGroup>> {
        let id = self.shared.next_group.fetch_add(1, Ordering::SeqCst);
        let global = self.members[self.rank];
        if !ranks.contains(&global) {
            return Ok(None);
        }
        let mut members = ranks.to_vec();
        members.dedup();
        Self::join(self.shared.clone(), id, global, members, self.options.clone()).map(Some)
    }

    fn submit(
        &self,
        what: String,
        op: u8,
        kind: u8,
        numel: u64,
        job: impl FnOnce(&Mesh, Tag) -> std::result::Result<(), Fault> + Send + 'static,
    ) -> Work {
        let seq = self.seq.fetch_add(1, Ordering::SeqCst);
        self.enqueue(seq, true, what, Tag { seq, op, kind, numel }, job)
    }

    /// Point-to-point: numbered by (peer, direction).
    #[allow(clippy::too_many_arguments)]
    fn submit_p2p(
        &self,
        peer: usize,
        sending: bool,
        what: String,
        op: u8,
        kind: u8,
        numel: u64,
        job: impl FnOnce(&Mesh, Tag) -> std::result::Result<(), Fault> + Send + 'static,
    ) -> Work {
        let seq = {
            let mut counters = self.p2p.lock().unwrap_or_else(|e| e.into_inner());
            let counter = counters.entry((peer, sending)).or_insert(0);
            *counter += 1;
            *counter
        };
        self.enqueue(seq, false, what, Tag { seq, op, kind, numel }, job)
    }

    fn enqueue(
        &self,
        seq: u64,
        collective: bool,
        what: String,
        tag: Tag,
        job: impl FnOnce(&Mesh, Tag) -> std::result::Result<(), Fault> + Send + 'static,
    ) -> Work {
        let (done, wait) = channel();
        let job: Job = Box::new(move |mesh| job(mesh, tag));
        if self.jobs.send(Queued { seq, collective, what, job, done: done.clone() }).is_err() {
            let _ =
                done.send(Err(Error::Training("the process group's worker thread is gone".into())));
        }
        Work { done: wait }
    }

    fn describe(name: &str, t: &Tensor) -> String {
        format!("{name} {:?} {:?}", t.size(), t.kind())
    }

    /// Reduces `tensor` across ranks, in place, without waiting.
    pub fn all_reduce_async(&self, tensor: &Tensor, op: ReduceOp) -> Result<Work> {
        if op == ReduceOp::Avg && !tensor.is_floating_point() {
            return Err(Error::Unsupported(format!(
                "all_reduce avg of a {:?} tensor",
                tensor.kind()
            )));
        }
        let buf = Buffer::new(tensor)?;
        let target = tensor.shallow_clone();
        let code = mesh::kind_code(tensor.kind())?;
        Ok(self.submit(
            Self::describe("all_reduce", tensor),
            mesh::OP_ALL_REDUCE + op_code(op),
            code,
            tensor.numel() as u64,
            move |mesh, tag| {
                mesh.all_reduce(&buf, op, tag)?;
                copy_back(&target, buf.tensor())
            },
        ))
    }

    /// Reduces `tensor` across ranks, in place.
    pub fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<()> {
        self.all_reduce_async(tensor, op)?.wait()
    }

    /// Copies rank `root`'s `tensor` into every rank's `tensor`.
    pub fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<()> {
        self.check_rank(root)?;
        let buf = Buffer::new(tensor)?;
        let target = tensor.shallow_clone();
        self.submit(
            Self::describe("broadcast", tensor),
            mesh::OP_BROADCAST,
            mesh::kind_code(tensor.kind())?,
            tensor.numel() as u64,
            move |mesh, tag| {
                mesh.broadcast(&buf, root, tag)?;
                copy_back(&target, buf.tensor())
            },
        )
        .wait()
    }

    /// Every rank's `tensor` (same shape everywhere), concatenated along dim 0 in rank
    /// order; a scalar becomes a `[world]` tensor.
    pub fn all_gather(&self, tensor: &Tensor) -> Result<Tensor> {
        let flat = tensor.f_reshape([-1])?;
        let n = flat.numel() as i64;
        let out = Tensor::f_empty([n * self.world as i64], (tensor.kind(), tensor.device()))?;
        out.f_narrow(0, n * self.rank as i64, n)?.f_copy_(&flat)?;
        let buf = Buffer::new(&out)?;
        self.submit(
            Self::describe("all_gather", tensor),
            mesh::OP_ALL_GATHER,
            mesh::kind_code(tensor.kind())?,
            n as u64,
            move |mesh, tag| mesh.all_gather(&buf, tag),
        )
        .wait()?;
        let mut shape = tensor.size();
        if shape.is_empty() {
            shape = vec![self.world as i64];
        } else {
            shape[0] *= self.world as i64;
        }
        Ok(out.f_reshape(&shape)?)
    }

    /// Every rank's `tensor`, as a list in rank order.
    pub fn all_gather_list(&self, tensor: &Tensor) -> Result<Vec<Tensor>> {
        let gathered = self.all_gather(&tensor.f_unsqueeze(0)?)?;
        Ok((0..self.world as i64).map(|r| gathered.get(r)).collect())
    }

    /// Reduces `input` (dim 0 of size world × k) across ranks and returns this rank's
    /// slice `[rank·k, (rank+1)·k)` of the result.
    pub fn reduce_scatter(&self, input: &Tensor, op: ReduceOp) -> Result<Tensor> {
        let rows = input.size().first().copied().unwrap_or(0);
        if input.dim() == 0 || rows % self.world as i64 != 0 {
            return Err(Error::Training(format!(
                "reduce_scatter needs dim 0 divisible by the {} ranks, got shape {:?}",
                self.world,
                input.size()
            )));
        }
        let work = input.f_contiguous()?.f_detach_copy()?;
        let buf = Buffer::new(&work)?;
        self.submit(
            Self::describe("reduce_scatter", input),
            mesh::OP_REDUCE_SCATTER + op_code(op),
            mesh::kind_code(input.kind())?,
            input.numel() as u64,
            move |mesh, tag| mesh.reduce_scatter(&buf, op, tag),
        )
        .wait()?;
        let k = rows / self.world as i64;
        let mine = work.f_narrow(0, k * self.rank as i64, k)?;
        Ok(if op == ReduceOp::Avg {
            mine.f_div_scalar(self.world as f64)?
        } else {
            mine.f_detach_copy()?
        })
    }

    /// Sums the contiguous CPU `buffer` (world × k elements) across ranks, in place and
    /// without waiting: afterwards this rank's slice `[rank·k, (rank+1)·k)` holds the sum
    /// and the rest is scratch. What ZeRO's gradient reduce-scatter is built on.
    pub fn reduce_scatter_in_place_async(&self, buffer: &Tensor) -> Result<Work> {
        let buf = self.in_place_buffer("reduce_scatter", buffer)?;
        Ok(self.submit(
            Self::describe("reduce_scatter", buffer),
            mesh::OP_REDUCE_SCATTER + op_code(ReduceOp::Sum),
            mesh::kind_code(buffer.kind())?,
            buffer.numel() as u64,
            move |mesh, tag| mesh.reduce_scatter(&buf, ReduceOp::Sum, tag),
        ))
    }

    /// Fills the contiguous CPU `buffer` (world × k elements) with every rank's slice
    /// `[r·k, (r+1)·k)`, in place and without waiting (this rank's slice must hold its
    /// part). What ZeRO's parameter all-gather is built on.
    pub fn all_gather_in_place_async(&self, buffer: &Tensor) -> Result<Work> {
        let buf = self.in_place_buffer("all_gather", buffer)?;
        Ok(self.submit(
            Self::describe("all_gather", buffer),
            mesh::OP_ALL_GATHER,
            mesh::kind_code(buffer.kind())?,
            (buffer.numel() / self.world) as u64,
            move |mesh, tag| mesh.all_gather(&buf, tag),
        ))
    }

    fn in_place_buffer(&self, what: &str, buffer: &Tensor) -> Result<Buffer> {
        if !buffer.is_contiguous() || buffer.numel() % self.world != 0 {
            return Err(Error::Training(format!(
                "{what} in place needs a contiguous buffer whose size divides by the {} ranks, \
                 got shape {:?}",
                self.world,
                buffer.size()
            )));
        }
        Buffer::new(buffer)
    }

    /// Waits until every rank of the group gets here.
    pub fn barrier(&self) -> Result<()> {
        self.all_reduce(&Tensor::zeros([1], (tch::Kind::Float, tch::Device::Cpu)), ReduceOp::Sum)
    }

    /// Sends `tensor` to group rank `to` (which calls [`recv`](Self::recv) with a tensor of
    /// the same shape and dtype).
    pub fn send(&self, tensor: &Tensor, to: usize) -> Result<()> {
        self.check_rank(to)?;
        let buf = Buffer::new(tensor)?;
        self.submit_p2p(
            to,
            true,
            Self::describe("send", tensor),
            mesh::OP_SEND,
            mesh::kind_code(tensor.kind())?,
            tensor.numel() as u64,
            move |mesh, tag| mesh.send_tensor(&buf, to, tag),
        )
        .wait()
    }

    /// Receives into `tensor` what group rank `from` sends.
    pub fn recv(&self, tensor: &Tensor, from: usize) -> Result<()> {
        self.check_rank(from)?;
        let buf = Buffer::new(tensor)?;
        let target = tensor.shallow_clone();
        self.submit_p2p(
            from,
            false,
            Self::describe("recv", tensor),
            mesh::OP_SEND,
            mesh::kind_code(tensor.kind())?,
            tensor.numel() as u64,
            move |mesh, tag| {
                mesh.recv_tensor(&buf, from, tag)?;
                copy_back(&target, buf.tensor())
            },
        )
        .wait()
    }

    /// Rank `root`'s `value` on every rank (others pass `None`).
    pub fn broadcast_object<T: Serialize + DeserializeOwned>(
        &self,
        value: Option<&T>,
        root: usize,
    ) -> Result<T> {
        self.check_rank(root)?;
        let bytes = match (self.rank == root, value) {
            (true, Some(v)) => serde_json::to_vec(v)
                .map_err(|e| Error::Training(format!("broadcast_object: {e}")))?,
            (true, None) => {
                return Err(Error::Training("broadcast_object: the root must pass a value".into()));
            }
            (false, _) => Vec::new(),
        };
        let (tx, rx) = channel();
        let (rank, world) = (self.rank, self.world);
        self.submit("broadcast_object".into(), mesh::OP_BYTES, 0, 0, move |mesh, tag| {
            let out = if rank == root {
                for p in (0..world).filter(|&p| p != root) {
                    mesh.send_bytes(p, tag, &bytes)?;
                }
                bytes
            } else {
                mesh.recv_bytes(root, tag)?
            };
            let _ = tx.send(out);
            Ok(())
        })
        .wait()?;
        let bytes =
            rx.recv().map_err(|_| Error::Training("broadcast_object lost its result".into()))?;
        serde_json::from_slice(&bytes)
            .map_err(|e| Error::Training(format!("broadcast_object: {e}")))
    }

    /// Every rank's `value` on rank `root` (in rank order); `None` elsewhere.
    pub fn gather_objects<T: Serialize + DeserializeOwned>(
        &self,
        value: &T,
        root: usize,
    ) -> Result<Option<Vec<T>>> {
        self.check_rank(root)?;
        let bytes = serde_json::to_vec(value)
            .map_err(|e| Error::Training(format!("gather_objects: {e}")))?;
        let (tx, rx) = channel();
        let (rank, world) = (self.rank, self.world);
        self.submit("gather_objects".into(), mesh::OP_BYTES, 0, 0, move |mesh, tag| {
            if rank == root {
                let mut all = Vec::with_capacity(world);
                for p in 0..world {
                    all.push(if p == root { bytes.clone() } else { mesh.recv_bytes(p, tag)? });
                }
                let _ = tx.send(all);
            } else {
                mesh.send_bytes(root, tag, &bytes)?;
            }
            Ok(())
        })
        .wait()?;
        if self.rank != root {
            return Ok(None);
        }
        let all =
            rx.recv().map_err(|_| Error::Training("gather_objects lost its result".into()))?;
        all.iter()
            .map(|b| {
                serde_json::from_slice(b)
                    .map_err(|e| Error::Training(format!("gather_objects: {e}")))
            })
            .collect::<Result<Vec<T>>>()
            .map(Some)
    }

    /// Every rank's `value`, on every rank.
    pub fn all_gather_objects<T: Serialize + DeserializeOwned>(&self, value: &T) -> Result<Vec<T>> {
        let gathered = self.gather_objects(value, 0)?;
        self.broadcast_object(gathered.as_ref(), 0)
    }

    fn check_rank(&self, rank: usize) -> Result<()> {
        if rank < self.world {
            Ok(())
        } else {
            Err(Error::Training(format!("rank {rank} is not in this group of {}", self.world)))
        }
    }

    /// Whether this group copies directly between processes (all members on one machine).
    pub fn direct_copy(&self) -> bool {
        self.direct
    }

    /// Shuts this group's connections down: every rank waiting on this one gets an error
    /// at once (instead of at its timeout). The group is unusable afterwards.
    pub fn abort(&self) {
        for socket in self.sockets.iter() {
            let _ = socket.shutdown(std::net::Shutdown::Both);
        }
    }

    /// Collectives issued on this group so far (point-to-point messages not counted).
    pub fn collectives_issued(&self) -> u64 {
        self.seq.load(Ordering::SeqCst) - 1
    }

    /// The group's id (0 for the world).
    pub fn id(&self) -> u64 {
        self.id
    }
}

fn op_code(op: ReduceOp) -> u8 {
    match op {
        ReduceOp::Sum => 1,
        ReduceOp::Avg => 2,
        ReduceOp::Min => 3,
        ReduceOp::Max => 4,
    }
}

/// Non-contiguous inputs were worked on in a contiguous copy; write the result back.
fn copy_back(target: &Tensor, worked: &Tensor) -> std::result::Result<(), Fault> {
    if target.data_ptr() != worked.data_ptr() {
        target.shallow_clone().f_copy_(worked)?;
    }
    Ok(())
}

/// Turns a fault into an error that names the collective and, for timeouts and lost peers,
/// the ranks that are behind (read from the store).
#[allow(clippy::too_many_arguments)]
fn diagnose(
    fault: Fault,
    seq: u64,
    what: &str,
    rank: usize,
    world: usize,
    id: u64,
    members: &[usize],
    shared: &Shared,
    timeout: Duration,
) -> Error {
    let (op, shape) = what.split_once(' ').unwrap_or((what, ""));
    let behind = || -> String {
        let Ok(mut store) = shared.store.lock() else { return String::new() };
        let mut late = Vec::new();
        for (r, member) in members.iter().enumerate().take(world) {
            match store.get(&format!("group{id}/progress/{r}"), Duration::ZERO) {
                Ok(bytes) => {
                    let theirs = bytes.as_slice().try_into().map(u64::from_le_bytes).unwrap_or(0);
                    if theirs < seq {
                        late.push(format!("rank {member} (last at #{theirs})"));
                    }
                }
                Err(Error::Rendezvous(m)) if m.contains("lost the store") => {
                    return "; the store of rank 0 is unreachable: rank 0 has probably exited"
                        .into();
                }
                Err(_) => late.push(format!("rank {member} (never reached a collective)")),
            }
        }
        if late.is_empty() { String::new() } else { format!("; not arrived: {}", late.join(", ")) }
    };
    let message = match fault {
        Fault::Timeout { peer } => format!(
            "timed out after {:.0} s waiting for rank {}{}",
            timeout.as_secs_f64(),
            members[peer],
            behind()
        ),
        Fault::Lost { peer, detail } => {
            format!(
                "lost the connection to rank {} ({detail}); it has probably exited{}",
                members[peer],
                behind()
            )
        }
        Fault::Mismatch { peer, detail } => {
            format!("mismatch with rank {}: {detail}", members[peer])
        }
        Fault::Other(e) => e.to_string(),
    };
    Error::Collective {
        op: op.to_owned(),
        seq,
        what: shape.to_owned(),
        rank: members[rank],
        message,
    }
}

/// Identifies this machine (boot id and host name): members with equal ids share memory.
fn host_id() -> String {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    format!("{}/{}", boot.trim(), host.trim())
}

/// A port that was free a moment ago (for tests and `--main-process-port 0`).
pub fn free_port(addr: &str) -> Result<u16> {
    let listener = TcpListener::bind((addr, 0))
        .map_err(|e| Error::Rendezvous(format!("cannot find a free port on {addr}: {e}")))?;
    Ok(listener.local_addr().map_err(|e| Error::Rendezvous(e.to_string()))?.port())
}

#[cfg(test)]
pub(crate) mod tests;
