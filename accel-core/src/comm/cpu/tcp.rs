//! TCP connections between every pair of ranks of a group: the handshake that names the
//! group and the dialling rank, and framed transfers (header, then payload) over them.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use super::diagnosis::{Fault, FaultResult, io_fault};
use super::mailbox::Mailbox;
use super::wire::{HEADER, Tag, check_header, encode};
use crate::comm::auth::{Token, authenticate_acceptor, authenticate_dialler};
use crate::error::{Error, Result};

/// How long an accepted connection may take to prove the token and name itself.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Accepted connections proving themselves at once; more are dropped until some finish.
const MAX_HANDSHAKES: usize = 64;

/// An accepted connection's proof of the token and its hello (group id, dialling rank);
/// `None` (said on stderr if it failed the proof) when it does not give them in `limit`.
fn accept_handshake(
    stream: &TcpStream,
    token: &Token,
    limit: Duration,
    rank: usize,
    from: std::net::SocketAddr,
) -> Option<(u64, usize)> {
    stream.set_nonblocking(false).ok()?;
    stream.set_nodelay(true).ok()?;
    stream.set_read_timeout(Some(limit)).ok()?;
    stream.set_write_timeout(Some(limit)).ok()?;
    if let Err(e) = authenticate_acceptor(&mut &*stream, token, "mesh") {
        eprintln!("accel: rank {rank} refused a connection from {from}: {e}");
        return None;
    }
    let mut hello = [0u8; 16];
    (&*stream).read_exact(&mut hello).ok()?;
    let group = u64::from_le_bytes(hello[0..8].try_into().expect("8 bytes"));
    let peer = u64::from_le_bytes(hello[8..16].try_into().expect("8 bytes"));
    Some((group, usize::try_from(peer).unwrap_or(usize::MAX)))
}

/// Bytes handed to the consumer at a time while the rest of a transfer is in flight.
pub(crate) const SEGMENT: usize = 1 << 20;
const SOCKET_BUFFER: i32 = 4 << 20;

/// One rank's connections to every other rank of its group.
pub(crate) struct Links {
    pub rank: usize,
    pub world: usize,
    readers: Vec<Option<TcpStream>>,
    writers: Vec<Option<TcpStream>>,
    /// Process ids of the members, by rank, when those on each machine may read each other's
    /// memory (`process_vm_readv`): the single-copy path of direct.rs.
    pub pids: Option<Vec<i32>>,
    /// The members by machine (ranks in order, machines in order of their lowest rank), and
    /// this rank's machine: the direct path runs within a machine, TCP between them.
    pub machines: Vec<Vec<usize>>,
    pub machine: usize,
    /// Every rank of the group, in order (the whole group as a ring or a list of peers).
    pub everyone: Vec<usize>,
    /// The direct path's signals (mailbox.rs), where it has them.
    pub mailbox: Option<Mailbox>,
    pub timeout: Duration,
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

impl Links {
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
        token: &Token,
    ) -> Result<Self> {
        let mut readers: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
        let deadline = Instant::now() + timeout;
        let fail = |what: String| Error::Rendezvous(what);
        for (peer, addr) in addrs.iter().enumerate().take(rank) {
            readers[peer] = Some(dial(rank, peer, addr, group, deadline, timeout, token)?);
        }
        accept_peers(rank, group, listener, &mut readers, deadline, timeout, token)?;
        let writers = readers
            .iter()
            .map(|r| r.as_ref().map(TcpStream::try_clone).transpose())
            .collect::<std::io::Result<Vec<_>>>()
            .map_err(|e| fail(e.to_string()))?;
        let everyone: Vec<usize> = (0..world).collect();
        let machines = vec![everyone.clone()];
        Ok(Self {
            rank,
            world,
            readers,
            writers,
            pids: None,
            machines,
            machine: 0,
            everyone,
            mailbox: None,
            timeout,
        })
    }

    /// Clones of the sockets, so that another thread can shut them down (abort).
    pub fn shutdown_handles(&self) -> Vec<TcpStream> {
        self.readers.iter().flatten().filter_map(|s| s.try_clone().ok()).collect()
    }

    fn writer(&self, peer: usize) -> &TcpStream {
        self.writers[peer].as_ref().expect("a connection to every other rank")
    }

    /// The connections by peer, for watching them close.
    pub fn readers(&self) -> &[Option<TcpStream>] {
        &self.readers
    }

    fn reader(&self, peer: usize) -> &TcpStream {
        self.readers[peer].as_ref().expect("a connection to every other rank")
    }

    /// Sends a header and `data` to `peer`.
    pub fn send(&self, peer: usize, tag: Tag, data: &[u8]) -> FaultResult<()> {
        let mut w = self.writer(peer);
        w.write_all(&encode(tag, data.len() as u64)).map_err(|e| io_fault(peer, e))?;
        w.write_all(data).map_err(|e| io_fault(peer, e))
    }

    /// Reads a header from `peer` and checks it against `tag`; returns the payload length.
    fn expect(&self, peer: usize, tag: Tag) -> FaultResult<u64> {
        let mut h = [0u8; HEADER];
        self.reader(peer).read_exact(&mut h).map_err(|e| io_fault(peer, e))?;
        check_header(peer, &h, tag, "sent")
    }

    /// Receives exactly `out.len()` payload bytes of `tag` from `peer`.
    pub fn recv_into(&self, peer: usize, tag: Tag, out: &mut [u8]) -> FaultResult<()> {
        let len = self.expect(peer, tag)?;
        if len != out.len() as u64 {
            return Err(Fault::Mismatch {
                peer,
                detail: format!("rank {peer} sent {len} bytes, {} expected", out.len()),
            });
        }
        self.reader(peer).read_exact(out).map_err(|e| io_fault(peer, e))
    }

    /// Sends `send` to `to` while receiving `recv_len` bytes from `from`, handing received
    /// segments to `sink(offset, bytes)` as they arrive.
    pub fn exchange(
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
                let len = self.expect(from, tag)?;
                if len != recv_len as u64 {
                    return Err(Fault::Mismatch {
                        peer: from,
                        detail: format!("rank {from} sent {len} bytes, {recv_len} expected"),
                    });
                }
                let mut segment = vec![0u64; SEGMENT.min(recv_len).div_ceil(8)];
                let mut offset = 0;
                while offset < recv_len {
                    let n = SEGMENT.min(recv_len - offset);
                    // SAFETY: a u64 buffer viewed as bytes (for alignment); n <= its length.
                    let bytes = unsafe {
                        std::slice::from_raw_parts_mut(segment.as_mut_ptr().cast::<u8>(), n)
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

    /// A byte string of any length from `from`.
    pub fn recv_bytes(&self, from: usize, tag: Tag, limit: u64) -> FaultResult<Vec<u8>> {
        let len = self.expect(from, tag)?;
        if len > limit {
            return Err(Fault::Mismatch {
                peer: from,
                detail: format!("rank {from} announced {len} bytes, more than the {limit} allowed"),
            });
        }
        let mut out = vec![0; len as usize];
        self.reader(from).read_exact(&mut out).map_err(|e| io_fault(from, e))?;
        Ok(out)
    }

    /// Sends `data` to every peer and returns what each sent (own entry: `data`).
    pub fn all_to_all(&self, tag: Tag, data: &[u8], limit: u64) -> FaultResult<Vec<Vec<u8>>> {
        self.all_to_all_among(&self.everyone, tag, data, limit)
    }

    /// Sends `data` to every other rank of `members` and returns, by rank, what each sent
    /// (own entry: `data`; empty for those not in `members`).
    pub fn all_to_all_among(
        &self,
        members: &[usize],
        tag: Tag,
        data: &[u8],
        limit: u64,
    ) -> FaultResult<Vec<Vec<u8>>> {
        for &peer in members.iter().filter(|&&p| p != self.rank) {
            self.send(peer, tag, data)?;
        }
        let mut out = vec![Vec::new(); self.world];
        for &peer in members {
            out[peer] =
                if peer == self.rank { data.to_vec() } else { self.recv_bytes(peer, tag, limit)? };
        }
        Ok(out)
    }

    /// Every member, as one ring.
    pub fn whole(&self) -> Ring<'_> {
        Ring { members: &self.everyone, me: self.rank }
    }

    /// The members of this rank's machine.
    pub fn local(&self) -> &[usize] {
        &self.machines[self.machine]
    }

    /// The ranks at position `index` of every machine, in machine order (a ring across them).
    pub fn across(&self, index: usize) -> Vec<usize> {
        self.machines.iter().map(|m| m[index]).collect()
    }
}

/// A ring through some of a group's ranks (`members`, in ring order), where this rank is at
/// `me`.
#[derive(Clone, Copy)]
pub(crate) struct Ring<'a> {
    pub members: &'a [usize],
    pub me: usize,
}

impl Ring<'_> {
    pub fn len(&self) -> usize {
        self.members.len()
    }

    pub fn next(&self) -> usize {
        self.members[(self.me + 1) % self.len()]
    }

    pub fn prev(&self) -> usize {
        self.members[(self.me + self.len() - 1) % self.len()]
    }
}

/// Rank `rank`'s connection to the lower rank `peer` listening at `addr`: dialled until
/// `deadline`, authenticated, and introduced (`group`, `rank`).
fn dial(
    rank: usize,
    peer: usize,
    addr: &str,
    group: u64,
    deadline: Instant,
    timeout: Duration,
    token: &Token,
) -> Result<TcpStream> {
    let fail = |what: String| Error::Rendezvous(what);
    let stream = loop {
        match TcpStream::connect(addr) {
            Ok(s) => break s,
            Err(e) if Instant::now() >= deadline => {
                return Err(fail(format!(
                    "rank {rank} cannot reach rank {peer} at {addr}: {e}. Each rank \
                     listens for the run's collectives on a port of its machine's \
                     ephemeral range (/proc/sys/net/ipv4/ip_local_port_range): a \
                     firewall between the machines must let TCP through on that range, \
                     and rank {peer}'s address must be reachable from here (check with \
                     `nc -vz` on {addr})"
                )));
            }
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    };
    tune(&stream, timeout).map_err(|e| fail(e.to_string()))?;
    authenticate_dialler(&mut &stream, token, "mesh").map_err(|e| match e {
        Error::Rendezvous(m) => {
            Error::Rendezvous(format!("{m} (rank {rank} dialling rank {peer} at {addr})"))
        }
        other => other,
    })?;
    let mut hello = [0u8; 16];
    hello[0..8].copy_from_slice(&group.to_le_bytes());
    hello[8..16].copy_from_slice(&(rank as u64).to_le_bytes());
    (&stream).write_all(&hello).map_err(|e| fail(format!("handshake with rank {peer}: {e}")))?;
    Ok(stream)
}

/// Accepts the higher ranks' connections on `listener` into `readers` until each has
/// arrived, or fails at `deadline` naming those that did not.
fn accept_peers(
    rank: usize,
    group: u64,
    listener: &TcpListener,
    readers: &mut [Option<TcpStream>],
    deadline: Instant,
    timeout: Duration,
    token: &Token,
) -> Result<()> {
    let fail = |what: String| Error::Rendezvous(what);
    let world = readers.len();
    listener.set_nonblocking(true).map_err(|e| fail(e.to_string()))?;
    // Each accepted connection proves the token and names itself on a thread of its
    // own, so that a silent or hostile one delays nobody (each is dropped within
    // HANDSHAKE_TIMEOUT, and at most MAX_HANDSHAKES are under way at once).
    let (done, arrived) = std::sync::mpsc::channel::<(TcpStream, u64, usize)>();
    let in_progress = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let handshake = HANDSHAKE_TIMEOUT.min(timeout);
    let mut waiting = world - rank - 1;
    while waiting > 0 {
        while let Ok((stream, their_group, peer)) = arrived.try_recv() {
            if their_group != group || peer <= rank || peer >= world || readers[peer].is_some() {
                let from = stream.peer_addr().map(|a| a.to_string()).unwrap_or_default();
                eprintln!("accel: rank {rank} ignored a stray connection from {from}");
                continue;
            }
            tune(&stream, timeout).map_err(|e| fail(e.to_string()))?;
            readers[peer] = Some(stream);
            waiting -= 1;
        }
        if waiting == 0 {
            break;
        }
        match listener.accept() {
            Ok((stream, from)) => {
                use std::sync::atomic::Ordering;
                if in_progress.load(Ordering::SeqCst) >= MAX_HANDSHAKES {
                    continue; // dropped: its peer sees the connection close
                }
                in_progress.fetch_add(1, Ordering::SeqCst);
                let (done, count, token) = (done.clone(), in_progress.clone(), token.clone());
                let started = std::thread::Builder::new()
                    .name("accel-mesh-handshake".into())
                    .spawn(move || {
                        if let Some((g, peer)) =
                            accept_handshake(&stream, &token, handshake, rank, from)
                        {
                            let _ = done.send((stream, g, peer));
                        }
                        count.fetch_sub(1, Ordering::SeqCst);
                    });
                if started.is_err() {
                    in_progress.fetch_sub(1, Ordering::SeqCst);
                }
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
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::net::{TcpListener, TcpStream};
    use std::time::{Duration, Instant};

    use super::Links;
    use crate::comm::auth::Token;

    /// 20 silent connections and 5 that send garbage reach rank 0's listener before the real
    /// peer dials: their handshakes run beside it, so the mesh forms at once instead of after
    /// 10 s per silent connection.
    #[test]
    fn silent_and_unauthenticated_connections_do_not_delay_the_mesh() {
        let token = Token::from_bytes(b"a shared secret of the run").unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let silent: Vec<TcpStream> = (0..20).map(|_| TcpStream::connect(&addr).unwrap()).collect();
        let garbage: Vec<TcpStream> = (0..5)
            .map(|_| {
                let mut s = TcpStream::connect(&addr).unwrap();
                let _ = s.write_all(&[0xAB; 4096]);
                s
            })
            .collect();
        let started = Instant::now();
        let timeout = Duration::from_secs(30);
        let peer = {
            let (addrs, token) = (vec![addr.clone()], token.clone());
            std::thread::spawn(move || {
                let own = TcpListener::bind("127.0.0.1:0").unwrap();
                Links::connect(1, 2, 7, &own, &addrs, timeout, &token).map(|l| l.rank)
            })
        };
        let links = Links::connect(0, 2, 7, &listener, &[addr], timeout, &token).unwrap();
        assert_eq!((links.rank, peer.join().unwrap().unwrap()), (0, 1));
        assert!(started.elapsed() < Duration::from_secs(5), "took {:?}", started.elapsed());
        drop((silent, garbage));
    }
}
