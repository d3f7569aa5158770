//! TCP connections between every pair of ranks of a group, and the algorithms that run on
//! them: gloo's ring reduce-scatter + all-gather for all-reduce, ring all-gather, direct
//! broadcast, send/recv. Received data is reduced by ATen kernels (vectorised for every
//! dtype) segment by segment while the rest is still arriving.
//!
//! Every transfer carries a header (sequence number, op, dtype, element count), so ranks
//! that disagree about the collective they are in get an error naming both sides instead
//! of corrupting each other's data.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};

const MAGIC: u32 = 0xACCE_1001;
/// Bytes reduced at a time while the rest of a chunk is still in flight.
const SEGMENT: usize = 1 << 20;
const SOCKET_BUFFER: i32 = 4 << 20;

/// The reductions of all-reduce and reduce-scatter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    /// Sum.
    Sum,
    /// Mean over ranks (floating-point tensors only).
    Avg,
    /// Element-wise minimum.
    Min,
    /// Element-wise maximum.
    Max,
}

/// What a transfer belongs to; both sides must agree.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Tag {
    pub seq: u64,
    pub op: u8,
    pub kind: u8,
    pub numel: u64,
}

pub(crate) const OP_ALL_REDUCE: u8 = 10;
pub(crate) const OP_BROADCAST: u8 = 20;
pub(crate) const OP_ALL_GATHER: u8 = 30;
pub(crate) const OP_REDUCE_SCATTER: u8 = 40;
pub(crate) const OP_SEND: u8 = 50;
pub(crate) const OP_BYTES: u8 = 60;

pub(crate) fn op_name(op: u8) -> String {
    let reduce = |base: &str, code: u8| {
        let r = match code {
            1 => "sum",
            2 => "avg",
            3 => "min",
            4 => "max",
            _ => "?",
        };
        format!("{base}({r})")
    };
    match op {
        10..=14 => reduce("all_reduce", op - 10),
        20 => "broadcast".into(),
        30 => "all_gather".into(),
        40..=44 => reduce("reduce_scatter", op - 40),
        50 => "send/recv".into(),
        60 => "object exchange".into(),
        other => format!("op {other}"),
    }
}

pub(crate) fn kind_code(kind: Kind) -> Result<u8> {
    Ok(match kind {
        Kind::Float => 1,
        Kind::Double => 2,
        Kind::Half => 3,
        Kind::BFloat16 => 4,
        Kind::Int64 => 5,
        Kind::Int => 6,
        Kind::Uint8 => 7,
        Kind::Bool => 8,
        other => {
            return Err(Error::Unsupported(format!(
                "collectives on {other:?} tensors; use f32, f64, f16, bf16, i64, i32, u8 or bool"
            )));
        }
    })
}

fn kind_name(code: u8) -> &'static str {
    match code {
        1 => "f32",
        2 => "f64",
        3 => "f16",
        4 => "bf16",
        5 => "i64",
        6 => "i32",
        7 => "u8",
        8 => "bool",
        _ => "bytes",
    }
}

fn encode(tag: Tag, payload: u64) -> [u8; 32] {
    let mut h = [0u8; 32];
    h[0..4].copy_from_slice(&MAGIC.to_le_bytes());
    h[4..12].copy_from_slice(&tag.seq.to_le_bytes());
    h[12] = tag.op;
    h[13] = tag.kind;
    h[16..24].copy_from_slice(&tag.numel.to_le_bytes());
    h[24..32].copy_from_slice(&payload.to_le_bytes());
    h
}

/// Connections of one rank to every other rank of its group.
pub(crate) struct Mesh {
    pub rank: usize,
    pub world: usize,
    readers: Vec<Option<TcpStream>>,
    writers: Vec<Option<TcpStream>>,
    /// Process ids of the members when all share this machine and may read each other's
    /// memory (`process_vm_readv`): the single-copy fast path.
    pids: Option<Vec<i32>>,
}

/// Something to read from a peer: the probe for `process_vm_readv`.
static PROBE: [u8; 8] = *b"accelCMA";

/// Address of this process's probe bytes.
pub(crate) fn probe_address() -> u64 {
    PROBE.as_ptr() as u64
}

/// Copies `len` bytes at `remote` in process `pid` into `local`.
fn read_peer(pid: i32, remote: u64, local: &mut [u8]) -> std::io::Result<()> {
    let mut done = 0;
    while done < local.len() {
        let local_iov = libc::iovec {
            iov_base: local[done..].as_mut_ptr().cast(),
            iov_len: local.len() - done,
        };
        let remote_iov = libc::iovec {
            iov_base: (remote + done as u64) as *mut libc::c_void,
            iov_len: local.len() - done,
        };
        // SAFETY: the local iovec covers our own writable slice; the kernel checks the
        // remote range against the peer's address space and fails with EFAULT if invalid.
        let n = unsafe { libc::process_vm_readv(pid, &local_iov, 1, &remote_iov, 1, 0) };
        if n < 0 {
            return Err(std::io::Error::last_os_error());
        }
        if n == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "process_vm_readv read nothing",
            ));
        }
        done += n as usize;
    }
    Ok(())
}

/// What the mesh knows went wrong, before the group adds op names and diagnoses.
pub(crate) enum Fault {
    /// A socket operation timed out waiting for `peer`.
    Timeout { peer: usize },
    /// `peer` closed the connection or the connection broke.
    Lost { peer: usize, detail: String },
    /// `peer` is in another collective.
    Mismatch { peer: usize, detail: String },
    /// Anything else (a libtorch error while reducing, say).
    Other(Error),
}

impl From<tch::TchError> for Fault {
    fn from(e: tch::TchError) -> Self {
        Fault::Other(e.into())
    }
}

type FaultResult<T> = std::result::Result<T, Fault>;

fn io_fault(peer: usize, e: std::io::Error) -> Fault {
    match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => Fault::Timeout { peer },
        _ => Fault::Lost { peer, detail: e.to_string() },
    }
}

fn tune(stream: &TcpStream, timeout: Duration) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    for option in [libc::SO_SNDBUF, libc::SO_RCVBUF] {
        // SAFETY: a valid socket fd and a pointer to an i32 that outlives the call.
        unsafe {
            libc::setsockopt(
                stream.as_raw_fd(),
                libc::SOL_SOCKET,
                option,
                (&SOCKET_BUFFER as *const i32).cast(),
                std::mem::size_of::<i32>() as libc::socklen_t,
            );
        }
    }
    Ok(())
}

impl Mesh {
    /// Connects to every member: lower ranks are dialled (their addresses in `addrs`),
    /// higher ranks are accepted on `listener`. Each connection starts with a handshake
    /// naming the group and the dialling rank.
    pub fn connect(
        rank: usize,
        world: usize,
        group: u64,
        listener: &TcpListener,
        addrs: &[String],
        timeout: Duration,
    ) -> Result<Self> {
        let mut readers: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
        let deadline = Instant::now() + timeout;
        let fail = |what: String| Error::Rendezvous(what);
        for (peer, addr) in addrs.iter().enumerate().take(rank) {
            let stream = loop {
                match TcpStream::connect(addr) {
                    Ok(s) => break s,
                    Err(e) if Instant::now() >= deadline => {
                        return Err(fail(format!(
                            "rank {rank} cannot reach rank {peer} at {addr}: {e}"
                        )));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(20)),
                }
            };
            tune(&stream, timeout).map_err(|e| fail(e.to_string()))?;
            let mut hello = [0u8; 16];
            hello[0..8].copy_from_slice(&group.to_le_bytes());
            hello[8..16].copy_from_slice(&(rank as u64).to_le_bytes());
            (&stream)
                .write_all(&hello)
                .map_err(|e| fail(format!("handshake with rank {peer}: {e}")))?;
            readers[peer] = Some(stream);
        }
        listener.set_nonblocking(true).map_err(|e| fail(e.to_string()))?;
        let mut waiting = world - rank - 1;
        while waiting > 0 {
            match listener.accept() {
                Ok((stream, from)) => {
                    stream.set_nonblocking(false).map_err(|e| fail(e.to_string()))?;
                    tune(&stream, timeout).map_err(|e| fail(e.to_string()))?;
                    let mut hello = [0u8; 16];
                    if (&stream).read_exact(&mut hello).is_err() {
                        continue;
                    }
                    let their_group = u64::from_le_bytes(hello[0..8].try_into().expect("8"));
                    let peer = u64::from_le_bytes(hello[8..16].try_into().expect("8")) as usize;
                    if their_group != group
                        || peer <= rank
                        || peer >= world
                        || readers[peer].is_some()
                    {
                        eprintln!("accel: rank {rank} ignored a stray connection from {from}");
                        continue;
                    }
                    readers[peer] = Some(stream);
                    waiting -= 1;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        let missing: Vec<usize> =
                            (rank + 1..world).filter(|p| readers[*p].is_none()).collect();
                        return Err(fail(format!(
                            "rank {rank}: rank(s) {missing:?} never connected within {:.0} s",
                            timeout.as_secs_f64()
                        )));
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => return Err(fail(e.to_string())),
            }
        }
        let writers = readers
            .iter()
            .map(|r| r.as_ref().map(TcpStream::try_clone).transpose())
            .collect::<std::io::Result<Vec<_>>>()
            .map_err(|e| fail(e.to_string()))?;
        Ok(Self { rank, world, readers, writers, pids: None })
    }

    /// Clones of the sockets, so that another thread can shut them down (abort).
    pub fn shutdown_handles(&self) -> Vec<TcpStream> {
        self.readers.iter().flatten().filter_map(|s| s.try_clone().ok()).collect()
    }

    fn writer(&self, peer: usize) -> &TcpStream {
        self.writers[peer].as_ref().expect("a connection to every other rank")
    }

    fn reader(&self, peer: usize) -> &TcpStream {
        self.readers[peer].as_ref().expect("a connection to every other rank")
    }

    fn send(&self, peer: usize, tag: Tag, data: &[u8]) -> FaultResult<()> {
        let mut w = self.writer(peer);
        w.write_all(&encode(tag, data.len() as u64)).map_err(|e| io_fault(peer, e))?;
        w.write_all(data).map_err(|e| io_fault(peer, e))
    }

    /// Reads a header from `peer` and checks it against `tag`; returns the payload length.
    fn expect(&self, peer: usize, tag: Tag) -> FaultResult<u64> {
        let mut h = [0u8; 32];
        self.reader(peer).read_exact(&mut h).map_err(|e| io_fault(peer, e))?;
        let magic = u32::from_le_bytes(h[0..4].try_into().expect("4"));
        let theirs = Tag {
            seq: u64::from_le_bytes(h[4..12].try_into().expect("8")),
            op: h[12],
            kind: h[13],
            numel: u64::from_le_bytes(h[16..24].try_into().expect("8")),
        };
        if magic != MAGIC {
            return Err(Fault::Mismatch {
                peer,
                detail: format!("rank {peer} sent a corrupt header"),
            });
        }
        if theirs != tag {
            return Err(Fault::Mismatch {
                peer,
                detail: format!(
                    "rank {peer} is in collective #{} {} of {} × {}, this rank in #{} {} of {} × {}; \
                     every rank must call the same collectives in the same order with the same \
                     shapes",
                    theirs.seq,
                    op_name(theirs.op),
                    theirs.numel,
                    kind_name(theirs.kind),
                    tag.seq,
                    op_name(tag.op),
                    tag.numel,
                    kind_name(tag.kind)
                ),
            });
        }
        Ok(u64::from_le_bytes(h[24..32].try_into().expect("8")))
    }

    fn recv_into(&self, peer: usize, tag: Tag, out: &mut [u8]) -> FaultResult<()> {
        let len = self.expect(peer, tag)?;
        if len as usize != out.len() {
            return Err(Fault::Mismatch {
                peer,
                detail: format!("rank {peer} sent {len} bytes, {} expected", out.len()),
            });
        }
        self.reader(peer).read_exact(out).map_err(|e| io_fault(peer, e))
    }

    /// Sends `send` to `to` while receiving from `from`, handing received segments to
    /// `sink(offset, bytes)`.
    fn exchange(
        &self,
        to: usize,
        send: &[u8],
        from: usize,
        recv_len: usize,
        tag: Tag,
        mut sink: impl FnMut(usize, &[u8]) -> FaultResult<()>,
    ) -> FaultResult<()> {
        std::thread::scope(|scope| {
            let sender = scope.spawn(|| self.send(to, tag, send));
            let received = (|| {
                let len = self.expect(from, tag)? as usize;
                if len != recv_len {
                    return Err(Fault::Mismatch {
                        peer: from,
                        detail: format!("rank {from} sent {len} bytes, {recv_len} expected"),
                    });
                }
                let mut buffer = vec![0u64; SEGMENT.min(recv_len).div_ceil(8)];
                let mut offset = 0;
                while offset < recv_len {
                    let n = SEGMENT.min(recv_len - offset);
                    // SAFETY: a u64 buffer viewed as bytes; n <= its byte length.
                    let bytes = unsafe {
                        std::slice::from_raw_parts_mut(buffer.as_mut_ptr().cast::<u8>(), n)
                    };
                    self.reader(from).read_exact(bytes).map_err(|e| io_fault(from, e))?;
                    sink(offset, bytes)?;
                    offset += n;
                }
                Ok(())
            })();
            let sent = sender.join().unwrap_or_else(|_| {
                Err(Fault::Other(Error::Training("sender thread panicked".into())))
            });
            received.and(sent)
        })
    }
}

/// A contiguous CPU tensor's bytes, and the element size.
pub(crate) struct Buffer {
    tensor: Tensor,
    ptr: *mut u8,
    len: usize,
    pub elem: usize,
    kind: Kind,
}

// SAFETY: the buffer is used by one thread at a time (the group's worker); the tensor it
// points into is kept alive by `tensor`.
unsafe impl Send for Buffer {}

impl Buffer {
    pub fn new(tensor: &Tensor) -> Result<Self> {
        if tensor.device() != Device::Cpu {
            return Err(Error::Unsupported(format!(
                "the cpu backend works on CPU tensors, got one on {:?}; use the nccl backend for GPUs",
                tensor.device()
            )));
        }
        let tensor = tensor.f_contiguous()?;
        let elem = tensor.kind().elt_size_in_bytes();
        let len = tensor.numel() * elem;
        Ok(Self { ptr: tensor.data_ptr().cast(), len, elem, kind: tensor.kind(), tensor })
    }

    pub fn tensor(&self) -> &Tensor {
        &self.tensor
    }

    fn bytes(&self, range: std::ops::Range<usize>) -> &[u8] {
        assert!(range.end <= self.len);
        // SAFETY: within the tensor's storage, which `self.tensor` keeps alive.
        unsafe { std::slice::from_raw_parts(self.ptr.add(range.start), range.len()) }
    }

    #[allow(clippy::mut_from_ref)]
    fn bytes_mut(&self, range: std::ops::Range<usize>) -> &mut [u8] {
        assert!(range.end <= self.len);
        // SAFETY: as `bytes`; callers never hold overlapping ranges at once (the ring sends
        // one chunk while receiving into another).
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(range.start), range.len()) }
    }

    /// dst[offset..] = reduce(dst, src) for the bytes of `src`, by an ATen kernel.
    fn reduce_into(&self, byte_offset: usize, src: &[u8], op: ReduceOp) -> FaultResult<()> {
        let n = (src.len() / self.elem) as i64;
        // SAFETY: both views cover memory that outlives them (our storage and the receive
        // buffer), with the buffer's element kind; they do not overlap.
        let (dst, src) = unsafe {
            (
                Tensor::from_blob(self.ptr.add(byte_offset), &[n], &[1], self.kind, Device::Cpu),
                Tensor::from_blob(src.as_ptr(), &[n], &[1], self.kind, Device::Cpu),
            )
        };
        let mut dst = dst;
        match op {
            ReduceOp::Sum | ReduceOp::Avg => {
                let _ = dst.f_add_(&src)?;
            }
            ReduceOp::Min => {
                let _ = dst.f_minimum_out(&dst, &src)?;
            }
            ReduceOp::Max => {
                let _ = dst.f_maximum_out(&dst, &src)?;
            }
        }
        Ok(())
    }
}

/// Element ranges of `n` nearly equal chunks of `count` elements, in bytes.
fn chunks(count: usize, n: usize, elem: usize) -> Vec<std::ops::Range<usize>> {
    let (base, extra) = (count / n, count % n);
    let mut start = 0;
    (0..n)
        .map(|i| {
            let len = base + usize::from(i < extra);
            let r = start * elem..(start + len) * elem;
            start += len;
            r
        })
        .collect()
}

impl Mesh {
    /// Turns on the single-copy path if every member is on this machine (`pids`) and this
    /// process can read every peer's probe (`probes`); all ranks agree on the outcome.
    pub fn enable_local(&mut self, pids: Option<Vec<i32>>, probes: &[u64]) -> Result<bool> {
        let mut ok = pids.is_some();
        if let Some(pids) = &pids {
            for (peer, (&pid, &address)) in pids.iter().zip(probes).enumerate() {
                if peer == self.rank || !ok {
                    continue;
                }
                let mut bytes = [0u8; 8];
                ok = read_peer(pid, address, &mut bytes).is_ok() && bytes == PROBE;
            }
        }
        let tag = Tag { seq: 0, op: OP_BYTES, kind: 0, numel: 0 };
        let votes = self.all_to_all(tag, &[u8::from(ok)]).map_err(|_| {
            Error::Rendezvous("the members could not agree on the shared-memory path".into())
        })?;
        let all = ok && votes.iter().all(|v| v.first() == Some(&1));
        self.pids = if all { pids } else { None };
        Ok(all)
    }

    /// Sends `data` to every peer and returns what each sent (own entry: `data`).
    fn all_to_all(&self, tag: Tag, data: &[u8]) -> FaultResult<Vec<Vec<u8>>> {
        for peer in (0..self.world).filter(|&p| p != self.rank) {
            self.send(peer, tag, data)?;
        }
        (0..self.world)
            .map(
                |peer| {
                    if peer == self.rank { Ok(data.to_vec()) } else { self.recv_bytes(peer, tag) }
                },
            )
            .collect()
    }

    /// Addresses of every member's buffer (for reading it), exchanged over TCP.
    fn addresses(&self, buf: &Buffer, tag: Tag) -> FaultResult<Vec<u64>> {
        let mine = (buf.ptr as u64).to_le_bytes();
        Ok(self
            .all_to_all(tag, &mine)?
            .iter()
            .map(|b| b.as_slice().try_into().map(u64::from_le_bytes).unwrap_or(0))
            .collect())
    }

    fn local_barrier(&self, tag: Tag, phase: u8) -> FaultResult<()> {
        self.all_to_all(tag, &[phase]).map(|_| ())
    }

    fn read(&self, peer: usize, remote: u64, local: &mut [u8]) -> FaultResult<()> {
        let pid = self.pids.as_ref().expect("local path enabled")[peer];
        read_peer(pid, remote, local)
            .map_err(|e| Fault::Lost { peer, detail: format!("reading its memory: {e}") })
    }

    /// Reduce-scatter by reading each peer's chunk `rank` straight from its memory.
    fn local_reduce_scatter(
        &self,
        buf: &Buffer,
        chunks: &[std::ops::Range<usize>],
        addrs: &[u64],
        op: ReduceOp,
    ) -> FaultResult<()> {
        let mine = chunks[self.rank].clone();
        let mut scratch = vec![0u64; (256 << 10) / 8];
        // SAFETY: a u64 buffer viewed as bytes.
        let scratch =
            unsafe { std::slice::from_raw_parts_mut(scratch.as_mut_ptr().cast::<u8>(), 256 << 10) };
        for step in 1..self.world {
            let peer = (self.rank + step) % self.world;
            let mut offset = mine.start;
            while offset < mine.end {
                let n = scratch.len().min(mine.end - offset);
                self.read(peer, addrs[peer] + offset as u64, &mut scratch[..n])?;
                buf.reduce_into(offset, &scratch[..n], op)?;
                offset += n;
            }
        }
        Ok(())
    }

    /// All-gather by reading each peer's chunk `peer` straight into ours.
    fn local_all_gather(
        &self,
        buf: &Buffer,
        chunks: &[std::ops::Range<usize>],
        addrs: &[u64],
    ) -> FaultResult<()> {
        for step in 1..self.world {
            let peer = (self.rank + step) % self.world;
            let range = chunks[peer].clone();
            if !range.is_empty() {
                self.read(peer, addrs[peer] + range.start as u64, buf.bytes_mut(range))?;
            }
        }
        Ok(())
    }

    fn next(&self) -> usize {
        (self.rank + 1) % self.world
    }
    fn prev(&self) -> usize {
        (self.rank + self.world - 1) % self.world
    }

    /// Ring reduce-scatter over `chunks`: afterwards this rank's chunk `rank` holds the
    /// reduction of every rank's chunk `rank`.
    fn ring_reduce_scatter(
        &self,
        buf: &Buffer,
        chunks: &[std::ops::Range<usize>],
        op: ReduceOp,
        tag: Tag,
    ) -> FaultResult<()> {
        let n = self.world;
        for s in 0..n - 1 {
            let send = chunks[(self.rank + 2 * n - s - 1) % n].clone();
            let recv = chunks[(self.rank + 2 * n - s - 2) % n].clone();
            let base = recv.start;
            self.exchange(
                self.next(),
                buf.bytes(send),
                self.prev(),
                recv.len(),
                tag,
                |offset, bytes| buf.reduce_into(base + offset, bytes, op),
            )?;
        }
        Ok(())
    }

    /// Ring all-gather over `chunks`, where this rank starts with chunk `rank`.
    fn ring_all_gather(
        &self,
        buf: &Buffer,
        chunks: &[std::ops::Range<usize>],
        tag: Tag,
    ) -> FaultResult<()> {
        let n = self.world;
        for s in 0..n - 1 {
            let send = chunks[(self.rank + n - s) % n].clone();
            let recv = chunks[(self.rank + 2 * n - s - 1) % n].clone();
            let dst = buf.bytes_mut(recv.clone());
            self.exchange(
                self.next(),
                buf.bytes(send),
                self.prev(),
                recv.len(),
                tag,
                |offset, bytes| {
                    dst[offset..offset + bytes.len()].copy_from_slice(bytes);
                    Ok(())
                },
            )?;
        }
        Ok(())
    }

    pub fn all_reduce(&self, buf: &Buffer, op: ReduceOp, tag: Tag) -> FaultResult<()> {
        if self.world == 1 {
            return Ok(());
        }
        let chunks = chunks(buf.len / buf.elem, self.world, buf.elem);
        if self.pids.is_some() {
            // Peers read our chunks while we read theirs; the barriers keep anyone from
            // overwriting a chunk that another rank still reads.
            let addrs = self.addresses(buf, tag)?;
            self.local_reduce_scatter(buf, &chunks, &addrs, op)?;
            self.local_barrier(tag, 1)?;
            self.local_all_gather(buf, &chunks, &addrs)?;
            self.local_barrier(tag, 2)?;
        } else {
            self.ring_reduce_scatter(buf, &chunks, op, tag)?;
            self.ring_all_gather(buf, &chunks, tag)?;
        }
        if op == ReduceOp::Avg {
            let _ = buf.tensor.shallow_clone().f_div_scalar_(self.world as f64)?;
        }
        Ok(())
    }

    /// `buf` holds every rank's input (world equal chunks); afterwards chunk `rank` holds
    /// the reduction.
    pub fn reduce_scatter(&self, buf: &Buffer, op: ReduceOp, tag: Tag) -> FaultResult<()> {
        if self.world == 1 {
            return Ok(());
        }
        let chunks = chunks(buf.len / buf.elem, self.world, buf.elem);
        if self.pids.is_some() {
            let addrs = self.addresses(buf, tag)?;
            self.local_reduce_scatter(buf, &chunks, &addrs, op)?;
            return self.local_barrier(tag, 1);
        }
        self.ring_reduce_scatter(buf, &chunks, op, tag)
    }

    /// `buf` has room for every rank's part, this rank's already in place at slot `rank`.
    pub fn all_gather(&self, buf: &Buffer, tag: Tag) -> FaultResult<()> {
        if self.world == 1 {
            return Ok(());
        }
        let chunks = chunks(buf.len / buf.elem, self.world, buf.elem);
        if self.pids.is_some() {
            let addrs = self.addresses(buf, tag)?;
            self.local_all_gather(buf, &chunks, &addrs)?;
            return self.local_barrier(tag, 2);
        }
        self.ring_all_gather(buf, &chunks, tag)
    }

    pub fn broadcast(&self, buf: &Buffer, root: usize, tag: Tag) -> FaultResult<()> {
        if self.world == 1 {
            return Ok(());
        }
        let all = 0..buf.len;
        if self.rank == root {
            std::thread::scope(|scope| {
                let sends: Vec<_> = (0..self.world)
                    .filter(|&p| p != root)
                    .map(|p| {
                        let data = buf.bytes(all.clone());
                        scope.spawn(move || self.send(p, tag, data))
                    })
                    .collect();
                sends.into_iter().try_for_each(|h| h.join().unwrap_or(Ok(())))
            })
        } else {
            self.recv_into(root, tag, buf.bytes_mut(all))
        }
    }

    pub fn send_tensor(&self, buf: &Buffer, to: usize, tag: Tag) -> FaultResult<()> {
        self.send(to, tag, buf.bytes(0..buf.len))
    }

    pub fn recv_tensor(&self, buf: &Buffer, from: usize, tag: Tag) -> FaultResult<()> {
        self.recv_into(from, tag, buf.bytes_mut(0..buf.len))
    }

    /// Byte strings of any length: `to` gets `data`.
    pub fn send_bytes(&self, to: usize, tag: Tag, data: &[u8]) -> FaultResult<()> {
        self.send(to, tag, data)
    }

    pub fn recv_bytes(&self, from: usize, tag: Tag) -> FaultResult<Vec<u8>> {
        let len = self.expect(from, tag)? as usize;
        let mut out = vec![0; len];
        self.reader(from).read_exact(&mut out).map_err(|e| io_fault(from, e))?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::chunks;

    #[test]
    fn chunks_cover_everything_nearly_evenly() {
        assert_eq!(chunks(10, 3, 4), vec![0..16, 16..28, 28..40]);
        assert_eq!(chunks(2, 3, 1), vec![0..1, 1..2, 2..2]);
    }
}
