//! [`ProcessGroup`]: the cpu backend's [`Communicator`], and the control plane of a run
//! (objects, subgroups, the rendezvous store it was made through).

use std::net::TcpListener;
use std::panic::Location;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::channel;
use std::sync::{Arc, Mutex};

use serde::Serialize;
use serde::de::DeserializeOwned;
use tch::Tensor;

use super::cpu::buffer::Buffer;
use super::cpu::diagnosis::FaultResult;
use super::cpu::direct::{self, Transport};
use super::cpu::tcp::Links;
use super::cpu::wire::{Tag, WireKind};
use super::cpu::worker::{Identity, Worker, describe};
use super::cpu::{OBJECT_LIMIT, ring};
use super::ledger::{Ledger, Scope};
use super::store::{StoreClient, StoreServer};
use super::{Backend, Communicator, GroupOptions, Op, ReduceOp, Work, check_rank};
use crate::error::{Error, Result};
use crate::sync::Locked;
use crate::topology::Topology;

/// What every group of a run shares: the store connection, and the next group id.
struct Shared {
    store: Arc<Mutex<StoreClient>>,
    /// Server of rank 0 of the world group, kept alive with it.
    _server: Option<StoreServer>,
    next_group: AtomicU64,
}

/// A set of processes that run collectives together (the whole world, or a subgroup), on
/// CPU tensors. Cheap to clone; operations run in call order on one worker thread per group.
#[derive(Clone)]
pub struct ProcessGroup {
    rank: usize,
    world: usize,
    /// Global ranks of the members, by group rank.
    members: Arc<Vec<usize>>,
    id: u64,
    seq: Arc<AtomicU64>,
    worker: Arc<Worker>,
    direct: bool,
    transport: Transport,
    sockets: Arc<Vec<std::net::TcpStream>>,
    /// Point-to-point messages are numbered per peer and direction, apart from the
    /// collectives (which not every rank takes part in).
    p2p: Arc<Mutex<std::collections::HashMap<(usize, bool), u64>>>,
    shared: Arc<Shared>,
    options: GroupOptions,
    /// The collectives issued since the last sequence check.
    ledger: Arc<Ledger>,
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

/// Lets the process that started this one, and its other children (the run's other ranks,
/// under `accel launch` or torchrun), read this process's memory: Yama's default
/// `ptrace_scope = 1` (Ubuntu, Debian) otherwise forbids it between siblings, which would
/// push the single-copy path back to TCP. Nothing changes where Yama is absent.
fn allow_siblings_to_read() {
    if crate::fault::deny_memory_reads() {
        return;
    }
    // SAFETY: prctl(PR_SET_PTRACER, pid) only names which process (and its descendants) may
    // ptrace this one; it touches no memory. An error (no Yama) is harmless.
    unsafe {
        let parent = libc::getppid();
        if parent > 1 {
            libc::prctl(libc::PR_SET_PTRACER, parent as libc::c_ulong, 0, 0, 0);
        }
    }
}

/// The members (ranks) by machine, machines in order of their lowest rank.
fn by_machine<'a>(machine_of_rank: impl Iterator<Item = &'a str>) -> Vec<Vec<usize>> {
    let mut machines: Vec<(&str, Vec<usize>)> = Vec::new();
    for (rank, machine) in machine_of_rank.enumerate() {
        match machines.iter_mut().find(|(m, _)| *m == machine) {
            Some((_, members)) => members.push(rank),
            None => machines.push((machine, vec![rank])),
        }
    }
    machines.into_iter().map(|(_, members)| members).collect()
}

/// Identifies this machine (boot id and host name): members with equal ids share memory.
fn host_id() -> String {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    format!("{}/{}", boot.trim(), host.trim())
}

impl ProcessGroup {
    /// Joins the run described by `topology`: rank 0 starts the store on the master
    /// address, everyone registers and connects to everyone.
    pub fn new(topology: &Topology, options: GroupOptions) -> Result<Self> {
        if options.direct_copy {
            // Before registering: a peer may try to read this process as soon as every rank
            // has registered.
            allow_siblings_to_read();
        }
        let server = if topology.rank == 0 {
            // Across machines the store listens on every interface, as torch's TCPStore
            // does: the master's host name may resolve here to an address that only this
            // machine sees (Debian's 127.0.1.1).
            let listen = if topology.num_nodes() > 1 { "0.0.0.0" } else { &topology.master_addr };
            Some(StoreServer::start_for(
                listen,
                topology.master_port,
                options.token.clone(),
                topology.world_size,
            )?)
        } else {
            None
        };
        let mut store = StoreClient::connect_with(
            &topology.master_addr,
            topology.master_port,
            options.timeout,
            &options.token,
        )?;
        let ip = store.local_ip()?;
        // A loopback MASTER_ADDR says every "machine" is this one (a test, a simulation);
        // a host name that resolves to loopback here says nothing of the sort.
        let said_loopback = topology.master_addr == "localhost"
            || topology.master_addr.parse::<std::net::IpAddr>().is_ok_and(|a| a.is_loopback());
        if topology.num_nodes() > 1 && ip.is_loopback() && !said_loopback {
            // Peers are dialled at the address this connection came from.
            return Err(Error::Rendezvous(format!(
                "rank {} reaches the store at MASTER_ADDR={} through {ip}, a loopback address \
                 that the other machines cannot dial: set MASTER_ADDR to an address of rank 0's \
                 host that every machine reaches (e.g. the first of `hostname -I`)",
                topology.rank, topology.master_addr
            )));
        }
        store.hello(topology.rank, topology.world_size)?;
        let shared = Arc::new(Shared {
            store: Arc::new(Mutex::new(store)),
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
            let mut store = shared.store.locked();
            let ip = store.local_ip()?;
            let listener = TcpListener::bind((ip, 0)).map_err(|e| {
                Error::Rendezvous(format!("rank {global_rank} cannot listen on {ip}: {e}"))
            })?;
            let addr = listener.local_addr().map_err(|e| Error::Rendezvous(e.to_string()))?;
            store.set(&format!("{prefix}/addr/{rank}"), addr.to_string().as_bytes())?;
            let machine = options.machine.clone().unwrap_or_else(host_id);
            let host = format!("{machine}|{}|{}", std::process::id(), direct::probe_address());
            store.set(&format!("{prefix}/host/{rank}"), host.as_bytes())?;
            store.wait_all(&format!("{prefix}/addr"), world, options.timeout).map_err(
                |e| match e {
                    Error::Rendezvous(m) => {
                        Error::Rendezvous(format!("{m} (group ranks; global ranks {members:?})"))
                    }
                    other => other,
                },
            )?;
            let mut read = |key: &str| -> Result<Vec<String>> {
                (0..world)
                    .map(|r| {
                        let bytes = store.get(&format!("{prefix}/{key}/{r}"), options.timeout)?;
                        Ok(String::from_utf8_lossy(&bytes).into_owned())
                    })
                    .collect()
            };
            let addrs = read("addr")?;
            let hosts = read("host")?;
            (listener, addrs, hosts)
        };
        let mut links =
            Links::connect(rank, world, id, &listener, &addrs, options.timeout, &options.token)?;
        // Members of one machine read each other's memory directly.
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
        let machines = by_machine(parsed.iter().map(|(h, _, _)| h.as_str()));
        let sizes: Vec<usize> = machines.iter().map(Vec::len).collect();
        let pids = if world == 1 {
            Err("one process".to_string())
        } else if !options.direct_copy {
            Err("direct copies are off: ACCEL_DISABLE_CMA is set".to_string())
        } else if sizes.iter().all(|&n| n == 1) {
            Err(format!("one member on each of {} machines", machines.len()))
        } else if sizes.iter().any(|&n| n != sizes[0]) {
            Err(format!(
                "the machines hold unequal numbers of members ({sizes:?}), so every byte goes \
                 through TCP"
            ))
        } else {
            Ok(parsed.iter().map(|(_, p, _)| *p).collect())
        };
        let probes: Vec<u64> = parsed.iter().map(|(_, _, a)| *a).collect();
        let transport = links.enable_direct(pids, &probes, machines)?;
        let direct = transport == Transport::Direct;
        let sockets = Arc::new(links.shutdown_handles());
        // host_id() is "boot id/host name".
        let hosts = parsed
            .iter()
            .map(|(h, _, _)| h.rsplit_once('/').map_or(h.as_str(), |(_, name)| name).to_owned())
            .collect();
        let who =
            Identity { group: id, rank, members: members.clone(), timeout: options.timeout, hosts };
        let worker = Arc::new(Worker::start(links, who, shared.store.clone())?);
        Ok(Self {
            rank,
            world,
            members: Arc::new(members),
            id,
            seq: Arc::new(AtomicU64::new(1)),
            worker,
            p2p: Arc::new(Mutex::new(std::collections::HashMap::new())),
            direct,
            transport,
            sockets,
            shared,
            options,
            ledger: Arc::default(),
        })
    }

    /// The group's ledger of collectives (kept alive by the handle).
    pub(crate) fn ledger_handle(&self) -> Arc<Ledger> {
        self.ledger.clone()
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

    /// Queues a collective (numbered in the group's sequence, noted in the ledger with the
    /// caller's source line).
    #[track_caller]
    fn collective(
        &self,
        op: Op,
        what: String,
        kind: WireKind,
        numel: u64,
        job: impl FnOnce(&Links, Tag) -> FaultResult<()> + Send + 'static,
    ) -> Work {
        let seq = self.seq.fetch_add(1, Ordering::SeqCst);
        let tag = Tag { seq, op, kind, numel };
        let site = Location::caller();
        let epoch = self.ledger.record(seq, op, &what, site);
        self.worker.submit(tag, Some((site, epoch)), what, move |links| job(links, tag))
    }

    /// The tag of the next point-to-point transfer of `tensor` with `peer` (numbered by
    /// peer and direction, apart from the collectives).
    fn p2p_tag(&self, peer: usize, sending: bool, tensor: &Tensor) -> Result<Tag> {
        check_rank(peer, self.world)?;
        let seq = {
            let mut counters = self.p2p.locked();
            let counter = counters.entry((peer, sending)).or_insert(0);
            *counter += 1;
            *counter
        };
        let kind = WireKind::of(tensor.kind())?;
        Ok(Tag { seq, op: Op::SendRecv, kind, numel: tensor.numel() as u64 })
    }

    /// Queues a point-to-point transfer.
    fn point_to_point(
        &self,
        peer: usize,
        sending: bool,
        tensor: &Tensor,
        job: impl FnOnce(&Links, Tag) -> FaultResult<()> + Send + 'static,
    ) -> Result<Work> {
        let tag = self.p2p_tag(peer, sending, tensor)?;
        let what = describe(tensor);
        Ok(self.worker.submit(tag, None, what, move |links| job(links, tag)))
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

    /// Rank `root`'s `value` on every rank (others pass `None`).
    #[track_caller]
    pub fn broadcast_object<T: Serialize + DeserializeOwned>(
        &self,
        value: Option<&T>,
        root: usize,
    ) -> Result<T> {
        check_rank(root, self.world)?;
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
        self.collective(
            Op::Objects,
            "broadcast_object".into(),
            WireKind::Bytes,
            0,
            move |l, tag| {
                let out = if rank == root {
                    for p in (0..world).filter(|&p| p != root) {
                        l.send(p, tag, &bytes)?;
                    }
                    bytes
                } else {
                    l.recv_bytes(root, tag, OBJECT_LIMIT)?
                };
                let _ = tx.send(out);
                Ok(())
            },
        )
        .wait()?;
        let bytes =
            rx.recv().map_err(|_| Error::Training("broadcast_object lost its result".into()))?;
        serde_json::from_slice(&bytes)
            .map_err(|e| Error::Training(format!("broadcast_object: {e}")))
    }

    /// Every rank's `value` on rank `root` (in rank order); `None` elsewhere.
    #[track_caller]
    pub fn gather_objects<T: Serialize + DeserializeOwned>(
        &self,
        value: &T,
        root: usize,
    ) -> Result<Option<Vec<T>>> {
        check_rank(root, self.world)?;
        let bytes = serde_json::to_vec(value)
            .map_err(|e| Error::Training(format!("gather_objects: {e}")))?;
        let (tx, rx) = channel();
        let (rank, world) = (self.rank, self.world);
        self.collective(Op::Objects, "gather_objects".into(), WireKind::Bytes, 0, move |l, tag| {
            if rank == root {
                let mut all = Vec::with_capacity(world);
                for p in 0..world {
                    all.push(if p == root {
                        bytes.clone()
                    } else {
                        l.recv_bytes(p, tag, OBJECT_LIMIT)?
                    });
                }
                let _ = tx.send(all);
            } else {
                l.send(root, tag, &bytes)?;
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
    #[track_caller]
    pub fn all_gather_objects<T: Serialize + DeserializeOwned>(&self, value: &T) -> Result<Vec<T>> {
        let gathered = self.gather_objects(value, 0)?;
        self.broadcast_object(gathered.as_ref(), 0)
    }

    /// Whether this group copies directly between processes (all members on one machine).
    pub fn direct_copy(&self) -> bool {
        self.direct
    }

    /// How this group's members exchange data, and why not directly if they do not.
    pub fn transport(&self) -> &Transport {
        &self.transport
    }

    /// Collectives issued on this group so far (point-to-point messages not counted).
    pub fn collectives_issued(&self) -> u64 {
        self.seq.load(Ordering::SeqCst) - 1
    }

    /// The group's id (0 for the world).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The run's connection to the rendezvous store.
    pub(crate) fn store(&self) -> Arc<Mutex<StoreClient>> {
        self.shared.store.clone()
    }

    /// A connection of its own to the run's store (authenticated as the group's are).
    pub(crate) fn new_store_connection(&self) -> Result<StoreClient> {
        let store = self.shared.store.locked();
        store.reconnect(self.options.timeout, &self.options.token)
    }

    /// The bound on every wait of this group.
    pub fn timeout(&self) -> std::time::Duration {
        self.options.timeout
    }
}

/// Non-contiguous inputs were worked on in a contiguous copy; write the result back.
fn copy_back(target: &Tensor, worked: &Tensor) -> FaultResult<()> {
    if target.data_ptr() != worked.data_ptr() {
        target.shallow_clone().f_copy_(worked)?;
    }
    Ok(())
}

impl Communicator for ProcessGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.world
    }

    fn backend(&self) -> Backend {
        Backend::Cpu
    }

    #[track_caller]
    fn all_reduce_async(&self, tensor: &Tensor, op: ReduceOp) -> Result<Work> {
        if op == ReduceOp::Avg && !tensor.is_floating_point() {
            return Err(Error::Unsupported(format!(
                "all_reduce avg of a {:?} tensor",
                tensor.kind()
            )));
        }
        let mut buf = Buffer::new(tensor)?;
        let target = tensor.shallow_clone();
        let (kind, numel) = (WireKind::of(tensor.kind())?, tensor.numel() as u64);
        let op_ = Op::AllReduce(op);
        Ok(self.collective(op_, describe(tensor), kind, numel, move |links, tag| {
            ring::all_reduce(links, &mut buf, op, tag)?;
            copy_back(&target, buf.tensor())
        }))
    }

    #[track_caller]
    fn broadcast_async(&self, tensor: &Tensor, root: usize) -> Result<Work> {
        check_rank(root, self.world)?;
        let mut buf = Buffer::new(tensor)?;
        let target = tensor.shallow_clone();
        let (kind, numel) = (WireKind::of(tensor.kind())?, tensor.numel() as u64);
        let what = describe(tensor);
        Ok(self.collective(Op::Broadcast, what, kind, numel, move |links, tag| {
            ring::broadcast(links, &mut buf, root, tag)?;
            copy_back(&target, buf.tensor())
        }))
    }

    #[track_caller]
    fn all_gather_in_place_async(&self, buffer: &Tensor) -> Result<Work> {
        let mut buf = self.in_place_buffer("all_gather", buffer)?;
        let kind = WireKind::of(buffer.kind())?;
        let numel = (buffer.numel() / self.world) as u64;
        let what = describe(buffer);
        Ok(self.collective(Op::AllGather, what, kind, numel, move |links, tag| {
            ring::all_gather(links, &mut buf, tag)
        }))
    }

    #[track_caller]
    fn reduce_scatter_in_place_async(&self, buffer: &Tensor, op: ReduceOp) -> Result<Work> {
        if op == ReduceOp::Avg && !buffer.is_floating_point() {
            return Err(Error::Unsupported(format!(
                "reduce_scatter avg of a {:?} tensor",
                buffer.kind()
            )));
        }
        let mut buf = self.in_place_buffer("reduce_scatter", buffer)?;
        let (kind, numel) = (WireKind::of(buffer.kind())?, buffer.numel() as u64);
        let op_ = Op::ReduceScatter(op);
        Ok(self.collective(op_, describe(buffer), kind, numel, move |links, tag| {
            ring::reduce_scatter(links, &mut buf, op, tag)
        }))
    }

    #[track_caller]
    fn send_async(&self, tensor: &Tensor, to: usize) -> Result<Work> {
        let buf = Buffer::new(tensor)?;
        self.point_to_point(to, true, tensor, move |links, tag| {
            links.send(to, tag, buf.bytes(0..buf.len()))
        })
    }

    #[track_caller]
    fn recv_async(&self, tensor: &Tensor, from: usize) -> Result<Work> {
        let mut buf = Buffer::new(tensor)?;
        let target = tensor.shallow_clone();
        self.point_to_point(from, false, tensor, move |links, tag| {
            let len = buf.len();
            links.recv_into(from, tag, buf.bytes_mut(0..len))?;
            copy_back(&target, buf.tensor())
        })
    }

    #[track_caller]
    fn send_recv_async(
        &self,
        send: &Tensor,
        to: usize,
        recv: &Tensor,
        from: usize,
    ) -> Result<Work> {
        let out = Buffer::new(send)?;
        let mut into = Buffer::new(recv)?;
        let target = recv.shallow_clone();
        let (send_tag, recv_tag) =
            (self.p2p_tag(to, true, send)?, self.p2p_tag(from, false, recv)?);
        let what = format!("{} and {}", describe(send), describe(recv));
        Ok(self.worker.submit(recv_tag, None, what, move |links| {
            let outgoing = out.bytes(0..out.len());
            std::thread::scope(|scope| {
                let sender = scope.spawn(|| links.send(to, send_tag, outgoing));
                let len = into.len();
                let received = links.recv_into(from, recv_tag, into.bytes_mut(0..len));
                let sent = sender.join().unwrap_or_else(|_| {
                    Err(super::cpu::diagnosis::Fault::Other(Error::Training(
                        "sender thread panicked".into(),
                    )))
                });
                received.and(sent)
            })?;
            copy_back(&target, into.tensor())
        }))
    }

    /// Pairwise exchanges (gloo's all-to-all): at step `s` each rank sends to `rank + s`
    /// while receiving from `rank − s`, so every pair meets once and no rank waits on two.
    #[track_caller]
    fn all_to_all_async(&self, output: &Tensor, input: &Tensor) -> Result<Work> {
        let k = crate::comm::all_to_all_part(self.world, output, input)? as usize;
        let send = Buffer::new(input)?;
        let mut recv = Buffer::new(output)?;
        let (kind, numel) = (WireKind::of(input.kind())?, input.numel() as u64);
        let what = format!("{} into {}", describe(input), describe(output));
        Ok(self.collective(Op::AllToAll, what, kind, numel, move |links, tag| {
            let (n, rank, bytes) = (links.world, links.rank, k * send.elem());
            let part = |i: usize| i * bytes..(i + 1) * bytes;
            recv.bytes_mut(part(rank)).copy_from_slice(send.bytes(part(rank)));
            for step in 1..n {
                let (to, from) = ((rank + step) % n, (rank + n - step) % n);
                let incoming = recv.bytes_mut(part(from));
                links.exchange(to, send.bytes(part(to)), from, bytes, tag, |offset, got| {
                    incoming[offset..offset + got.len()].copy_from_slice(got);
                    Ok(())
                })?;
            }
            Ok(())
        }))
    }

    fn abort(&self) {
        for socket in self.sockets.iter() {
            let _ = socket.shutdown(std::net::Shutdown::Both);
        }
    }

    fn ledger(&self) -> Option<&Ledger> {
        Some(&self.ledger)
    }

    fn scope(&self) -> Option<Scope> {
        (self.world > 1).then(|| Scope {
            name: format!("group{}", self.id),
            rank: self.rank,
            members: self.members.to_vec(),
        })
    }
}
