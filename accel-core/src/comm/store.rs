//! The rendezvous store: a small TCP key-value server run by rank 0 on the master address,
//! and its client. Processes register their rank, exchange addresses and wait for each
//! other through it; after a timeout it names the ranks that never arrived.
//!
//! Wire format: every message is a `u32` little-endian length (at most [`MAX_MESSAGE`])
//! followed by that many bytes; a request starts with an op byte, strings and byte strings
//! are `u32` length + bytes. A malformed or oversized message gets an error reply and its
//! connection is closed; the server keeps serving everyone else.
//!
//! (About 500 lines: the wire format, the server and the client stay in one file so that
//! both ends of the protocol are read together.)

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::auth::{DialFailure, Token, authenticate_acceptor, try_authenticate_dialler};
use crate::error::{Error, Result};
use crate::sync::Locked;

/// How long a new connection may take to prove the run's token.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections served at once, at least; more are closed at once (torch's TCPStore has no
/// such cap, and a flood of idle connections would otherwise hold a thread each). A run of
/// N processes is served 4·N (each process holds one or two).
const MAX_CONNECTIONS: usize = 1024;
/// Each connection's thread only parses requests: a small stack lets a store serve tens of
/// thousands of them.
const CONNECTION_STACK: usize = 256 << 10;
/// The largest message either side accepts.
pub const MAX_MESSAGE: usize = 64 << 20;

const OP_HELLO: u8 = 0;
const OP_SET: u8 = 1;
const OP_GET: u8 = 2;
const OP_ADD: u8 = 3;
const OP_CHECK: u8 = 4;
const OP_DELETE: u8 = 5;
const OP_TAKE: u8 = 6;
const REPLY_OK: u8 = 0;
const REPLY_ERR: u8 = 1;

/// Which attempt of the run this process belongs to: the launcher's restart count
/// (`ACCEL_RESTART_COUNT`, or torchrun's `TORCHELASTIC_RESTART_COUNT`), 0 without one. A
/// store refuses ranks of another attempt, so a restarted group never meets the old one.
pub(crate) fn run_generation() -> u32 {
    [crate::config::env::RESTART_COUNT, "TORCHELASTIC_RESTART_COUNT"]
        .iter()
        .find_map(|k| std::env::var(k).ok()?.trim().parse().ok())
        .unwrap_or(0)
}

#[derive(Default)]
struct Table {
    values: HashMap<String, Vec<u8>>,
    /// rank -> the peer address that claimed it.
    ranks: HashMap<u32, SocketAddr>,
    world_size: Option<u32>,
    /// The attempt of the run this store belongs to (see [`run_generation`]).
    generation: u32,
}

struct Shared {
    table: Mutex<Table>,
    changed: Condvar,
    token: Token,
    connections: std::sync::atomic::AtomicUsize,
    max_connections: usize,
}

/// A running store server; it serves until the process ends.
#[derive(Debug)]
pub struct StoreServer {
    addr: SocketAddr,
}

impl StoreServer {
    /// Listens on `addr:port` only (port 0 picks a free one), without authentication. A
    /// port in use is an error that says so.
    pub fn start(addr: &str, port: u16) -> Result<Self> {
        Self::start_with(addr, port, Token::none())
    }

    /// [`StoreServer::start`] serving only clients that prove `token` (see
    /// [`super::auth`]).
    pub fn start_with(addr: &str, port: u16, token: Token) -> Result<Self> {
        Self::start_for(addr, port, token, 0)
    }

    /// [`StoreServer::start_with`] for a run of `processes` processes (the connection cap
    /// grows with it).
    pub fn start_for(addr: &str, port: u16, token: Token, processes: usize) -> Result<Self> {
        let listener = TcpListener::bind((addr, port)).map_err(|e| {
            let hint = if e.kind() == std::io::ErrorKind::AddrInUse {
                format!(
                    "port {port} on {addr} is already in use (another run, or a leftover \
                     process?); pick another with --main-process-port, or 0 for a free one"
                )
            } else {
                format!("cannot listen on {addr}:{port}: {e}")
            };
            Error::Rendezvous(hint)
        })?;
        let addr = listener.local_addr().map_err(|e| Error::Rendezvous(e.to_string()))?;
        let shared = Arc::new(Shared {
            table: Mutex::new(Table { generation: run_generation(), ..Table::default() }),
            changed: Condvar::new(),
            token,
            connections: Default::default(),
            max_connections: MAX_CONNECTIONS.max(processes.saturating_mul(4)),
        });
        std::thread::Builder::new()
            .name("accel-store".into())
            .spawn(move || {
                use std::sync::atomic::Ordering;
                for stream in listener.incoming().flatten() {
                    if shared.connections.fetch_add(1, Ordering::SeqCst) >= shared.max_connections {
                        shared.connections.fetch_sub(1, Ordering::SeqCst);
                        continue; // dropped: closed at once
                    }
                    let shared = shared.clone();
                    let spawned = std::thread::Builder::new()
                        .name("accel-store-conn".into())
                        .stack_size(CONNECTION_STACK)
                        .spawn({
                            let shared = shared.clone();
                            move || {
                                serve(stream, &shared);
                                shared.connections.fetch_sub(1, Ordering::SeqCst);
                            }
                        });
                    if spawned.is_err() {
                        shared.connections.fetch_sub(1, Ordering::SeqCst);
                    }
                }
            })
            .map_err(|e| Error::Rendezvous(format!("cannot start the store thread: {e}")))?;
        Ok(Self { addr })
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

fn read_message(stream: &mut TcpStream) -> std::io::Result<Option<Vec<u8>>> {
    let mut len = [0u8; 4];
    match stream.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_MESSAGE {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("message of {len} bytes is over the {MAX_MESSAGE}-byte limit"),
        ));
    }
    // Memory grows with the bytes that actually arrive, not with the length announced.
    let mut body = Vec::with_capacity(len.min(1 << 16));
    stream.take(len as u64).read_to_end(&mut body)?;
    if body.len() != len {
        return Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            format!("message cut short: {} of {len} bytes", body.len()),
        ));
    }
    Ok(Some(body))
}

fn write_message(stream: &mut TcpStream, body: &[u8]) -> std::io::Result<()> {
    let mut framed = Vec::with_capacity(body.len() + 4);
    framed.extend_from_slice(&(body.len() as u32).to_le_bytes());
    framed.extend_from_slice(body);
    stream.write_all(&framed)
}

/// Reads the fields of a request, failing cleanly on anything short or malformed.
struct Fields<'a>(&'a [u8]);

impl<'a> Fields<'a> {
    fn take(&mut self, n: usize) -> std::result::Result<&'a [u8], String> {
        if self.0.len() < n {
            return Err(format!("truncated field: needs {n} bytes, {} left", self.0.len()));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }
    fn u8(&mut self) -> std::result::Result<u8, String> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> std::result::Result<u32, String> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes")))
    }
    fn u64(&mut self) -> std::result::Result<u64, String> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes")))
    }
    fn bytes(&mut self) -> std::result::Result<&'a [u8], String> {
        let n = self.u32()? as usize;
        self.take(n)
    }
    fn string(&mut self) -> std::result::Result<String, String> {
        String::from_utf8(self.bytes()?.to_vec()).map_err(|_| "a key is not UTF-8".to_owned())
    }
    fn end(&self) -> std::result::Result<(), String> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(format!("{} stray bytes at the end", self.0.len()))
        }
    }
}

fn put_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
    out.extend_from_slice(bytes);
}

fn serve(mut stream: TcpStream, shared: &Shared) {
    let _ = stream.set_nodelay(true);
    let peer = stream.peer_addr().ok();
    // Nothing is served before the client proves the token, within a bounded time.
    if stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT)).is_err()
        || authenticate_acceptor(&mut stream, &shared.token, "store").is_err()
        || stream.set_read_timeout(None).is_err()
    {
        return;
    }
    let mut claimed = None;
    serve_requests(&mut stream, shared, peer, &mut claimed);
    // A rank's claim ends with its connection, so that a restarted process can take it.
    if let Some(rank) = claimed {
        let mut table = shared.table.locked();
        table.ranks.remove(&rank);
    }
}

fn serve_requests(
    stream: &mut TcpStream,
    shared: &Shared,
    peer: Option<SocketAddr>,
    claimed: &mut Option<u32>,
) {
    loop {
        let body = match read_message(stream) {
            Ok(Some(body)) => body,
            Ok(None) => return,
            Err(e) => {
                let _ = write_message(stream, &error_reply(&format!("malformed message: {e}")));
                return;
            }
        };
        match handle(&body, shared, peer) {
            Ok(reply) => {
                if body.first() == Some(&OP_HELLO) {
                    *claimed = body.get(1..5).map(|b| u32::from_le_bytes(b.try_into().expect("4")));
                }
                if write_message(stream, &reply).is_err() {
                    return;
                }
            }
            Err(Handled::Refused(message)) => {
                if write_message(stream, &error_reply(&message)).is_err() {
                    return;
                }
            }
            Err(Handled::Malformed(message)) => {
                let _ =
                    write_message(stream, &error_reply(&format!("malformed message: {message}")));
                return;
            }
        }
    }
}

enum Handled {
    /// A well-formed request the store declines (the connection stays).
    Refused(String),
    /// Garbage: the connection is dropped.
    Malformed(String),
}

fn error_reply(message: &str) -> Vec<u8> {
    let mut out = vec![REPLY_ERR];
    put_bytes(&mut out, message.as_bytes());
    out
}

fn handle(
    body: &[u8],
    shared: &Shared,
    peer: Option<SocketAddr>,
) -> std::result::Result<Vec<u8>, Handled> {
    let mut f = Fields(body);
    let op = f.u8().map_err(Handled::Malformed)?;
    let mut table = shared.table.locked();
    let mut ok = vec![REPLY_OK];
    match op {
        OP_HELLO => {
            let (rank, world) =
                (f.u32().map_err(Handled::Malformed)?, f.u32().map_err(Handled::Malformed)?);
            let version = f.string().map_err(Handled::Malformed)?;
            let generation = f.u32().map_err(Handled::Malformed)?;
            f.end().map_err(Handled::Malformed)?;
            if version != crate::VERSION {
                return Err(Handled::Refused(format!(
                    "rank {rank} runs accel {version}, the store (rank 0) runs {}; every process \
                     must run the same build",
                    crate::VERSION
                )));
            }
            if generation != table.generation {
                return Err(Handled::Refused(format!(
                    "rank {rank} belongs to attempt {generation} of the run, the store (rank 0) to \
                     attempt {} (ACCEL_RESTART_COUNT / TORCHELASTIC_RESTART_COUNT): a process of \
                     another attempt is still running, or the machines restarted apart; stop it \
                     and start every machine's launcher again",
                    table.generation
                )));
            }
            match table.world_size {
                Some(w) if w != world => {
                    return Err(Handled::Refused(format!(
                        "rank {rank} says the world size is {world}, but rank 0 started a run of \
                         {w}; check WORLD_SIZE / --num-processes on every machine"
                    )));
                }
                _ => table.world_size = Some(world),
            }
            if rank >= world {
                return Err(Handled::Refused(format!(
                    "rank {rank} is not below the world size {world}"
                )));
            }
            if let Some(other) = table.ranks.get(&rank) {
                return Err(Handled::Refused(format!(
                    "rank {rank} is already taken by the process at {other}; two processes claim \
                     the same rank (check RANK / --machine-rank)"
                )));
            }
            table.ranks.insert(rank, peer.unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], 0))));
        }
        OP_SET => {
            let key = f.string().map_err(Handled::Malformed)?;
            let value = f.bytes().map_err(Handled::Malformed)?.to_vec();
            f.end().map_err(Handled::Malformed)?;
            table.values.insert(key, value);
            shared.changed.notify_all();
        }
        OP_GET | OP_TAKE => {
            let key = f.string().map_err(Handled::Malformed)?;
            let wait_ms = f.u64().map_err(Handled::Malformed)?;
            f.end().map_err(Handled::Malformed)?;
            let deadline = Instant::now() + Duration::from_millis(wait_ms);
            loop {
                if op == OP_TAKE {
                    if let Some(value) = table.values.remove(&key) {
                        put_bytes(&mut ok, &value);
                        break;
                    }
                } else if let Some(value) = table.values.get(&key) {
                    put_bytes(&mut ok, value);
                    break;
                }
                let now = Instant::now();
                if now >= deadline {
                    return Err(Handled::Refused(format!("timeout waiting for key `{key}`")));
                }
                table = shared
                    .changed
                    .wait_timeout(table, deadline - now)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
        }
        OP_ADD => {
            let key = f.string().map_err(Handled::Malformed)?;
            let delta = f.u64().map_err(Handled::Malformed)? as i64;
            f.end().map_err(Handled::Malformed)?;
            let current = table
                .values
                .get(&key)
                .and_then(|v| v.as_slice().try_into().ok())
                .map(i64::from_le_bytes)
                .unwrap_or(0);
            let new = current + delta;
            table.values.insert(key, new.to_le_bytes().to_vec());
            shared.changed.notify_all();
            ok.extend_from_slice(&new.to_le_bytes());
        }
        OP_CHECK => {
            let key = f.string().map_err(Handled::Malformed)?;
            f.end().map_err(Handled::Malformed)?;
            ok.push(u8::from(table.values.contains_key(&key)));
        }
        OP_DELETE => {
            let key = f.string().map_err(Handled::Malformed)?;
            f.end().map_err(Handled::Malformed)?;
            ok.push(u8::from(table.values.remove(&key).is_some()));
        }
        other => return Err(Handled::Malformed(format!("unknown op {other}"))),
    }
    Ok(ok)
}

/// A connection to the store.
#[derive(Debug)]
pub struct StoreClient {
    stream: TcpStream,
    addr: String,
}

impl StoreClient {
    /// Connects to `addr:port`, retrying until `timeout` (rank 0 may still be starting).
    pub fn connect(addr: &str, port: u16, timeout: Duration) -> Result<Self> {
        Self::connect_with(addr, port, timeout, &Token::none())
    }

    /// [`StoreClient::connect`], then proves `token` to the store (and checks the store's
    /// proof) before anything else.
    pub fn connect_with(addr: &str, port: u16, timeout: Duration, token: &Token) -> Result<Self> {
        let deadline = Instant::now() + timeout;
        loop {
            let mut client =
                Self::dial(addr, port, deadline.saturating_duration_since(Instant::now()))?;
            client
                .stream
                .set_read_timeout(Some(HANDSHAKE_TIMEOUT))
                .map_err(|e| Error::Rendezvous(e.to_string()))?;
            let where_ = |e: Error| match e {
                Error::Rendezvous(m) => {
                    Error::Rendezvous(format!("{m} (store at {})", client.addr))
                }
                other => other,
            };
            match try_authenticate_dialler(&mut client.stream, token, "store") {
                Ok(()) => return Ok(client),
                // Closed before the exchange ended (the store at its connection limit, say):
                // dial again until the timeout.
                Err(DialFailure::Dropped(_)) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(100));
                }
                Err(DialFailure::Dropped(e) | DialFailure::Refused(e)) => return Err(where_(e)),
            }
        }
    }

    fn dial(addr: &str, port: u16, timeout: Duration) -> Result<Self> {
        let deadline = Instant::now() + timeout;
        let target = format!("{addr}:{port}");
        loop {
            let attempt = target
                .to_socket_addrs()
                .map_err(|e| Error::Rendezvous(format!("cannot resolve MASTER_ADDR {addr}: {e}")))?
                .next()
                .ok_or_else(|| Error::Rendezvous(format!("MASTER_ADDR {addr} resolves to nothing")))
                .and_then(|sa| {
                    TcpStream::connect_timeout(&sa, Duration::from_secs(2))
                        .map_err(|e| Error::Rendezvous(e.to_string()))
                });
            match attempt {
                Ok(stream) => {
                    let _ = stream.set_nodelay(true);
                    return Ok(Self { stream, addr: target });
                }
                Err(e) if Instant::now() >= deadline => {
                    return Err(Error::Rendezvous(format!(
                        "could not reach the store of rank 0 at {target} within {:.0} s ({e}); is \
                         MASTER_ADDR/MASTER_PORT (accel launch's --main-process-ip/-port) right, \
                         did rank 0 start, and does a firewall between the machines let TCP \
                         through to port {port} of {addr}? (check with `nc -vz {addr} {port}`)",
                        timeout.as_secs_f64()
                    )));
                }
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        }
    }

    fn request(&mut self, body: &[u8], wait: Duration) -> Result<Vec<u8>> {
        let lost = |e: std::io::Error, addr: &str| Error::StoreLost {
            addr: addr.to_owned(),
            detail: e.to_string(),
        };
        self.stream
            .set_read_timeout(Some(wait + Duration::from_secs(10)))
            .map_err(|e| lost(e, &self.addr))?;
        write_message(&mut self.stream, body).map_err(|e| lost(e, &self.addr))?;
        let reply =
            read_message(&mut self.stream).map_err(|e| lost(e, &self.addr))?.ok_or_else(|| {
                Error::StoreLost { addr: self.addr.clone(), detail: "connection closed".into() }
            })?;
        let mut f = Fields(&reply);
        match f.u8().map_err(Error::Rendezvous)? {
            REPLY_OK => Ok(f.0.to_vec()),
            _ => {
                let message = f.string().unwrap_or_else(|_| "unreadable error".into());
                Err(Error::Rendezvous(message))
            }
        }
    }

    /// Claims `rank` in a run of `world_size` (refused if taken, or if the world size or
    /// accel version differ from the others').
    pub fn hello(&mut self, rank: usize, world_size: usize) -> Result<()> {
        self.hello_in(rank, world_size, run_generation())
    }

    fn hello_in(&mut self, rank: usize, world_size: usize, generation: u32) -> Result<()> {
        let mut body = vec![OP_HELLO];
        body.extend_from_slice(&(rank as u32).to_le_bytes());
        body.extend_from_slice(&(world_size as u32).to_le_bytes());
        put_bytes(&mut body, crate::VERSION.as_bytes());
        body.extend_from_slice(&generation.to_le_bytes());
        self.request(&body, Duration::ZERO).map(|_| ())
    }

    /// Sets `key` to `value`.
    pub fn set(&mut self, key: &str, value: &[u8]) -> Result<()> {
        let mut body = vec![OP_SET];
        put_bytes(&mut body, key.as_bytes());
        put_bytes(&mut body, value);
        self.request(&body, Duration::ZERO).map(|_| ())
    }

    /// The value of `key`, waiting up to `wait` for it to be set.
    pub fn get(&mut self, key: &str, wait: Duration) -> Result<Vec<u8>> {
        self.wait_for(OP_GET, key, wait)
    }

    /// [`StoreClient::get`], removing the key as it is read (one round trip for a value
    /// meant for one reader).
    pub fn take(&mut self, key: &str, wait: Duration) -> Result<Vec<u8>> {
        self.wait_for(OP_TAKE, key, wait)
    }

    /// A request (`op`: get or take) for `key`'s value that the store answers once it is set.
    fn wait_for(&mut self, op: u8, key: &str, wait: Duration) -> Result<Vec<u8>> {
        let mut body = vec![op];
        put_bytes(&mut body, key.as_bytes());
        body.extend_from_slice(&(wait.as_millis() as u64).to_le_bytes());
        let reply = self.request(&body, wait)?;
        let mut f = Fields(&reply);
        Ok(f.bytes().map_err(Error::Rendezvous)?.to_vec())
    }

    /// Adds `delta` to the integer at `key` (0 if unset); returns the new value.
    pub fn add(&mut self, key: &str, delta: i64) -> Result<i64> {
        let mut body = vec![OP_ADD];
        put_bytes(&mut body, key.as_bytes());
        body.extend_from_slice(&(delta as u64).to_le_bytes());
        let reply = self.request(&body, Duration::ZERO)?;
        let bytes: [u8; 8] =
            reply.as_slice().try_into().map_err(|_| Error::Rendezvous("bad ADD reply".into()))?;
        Ok(i64::from_le_bytes(bytes))
    }

    /// Whether `key` is set.
    pub fn check(&mut self, key: &str) -> Result<bool> {
        let mut body = vec![OP_CHECK];
        put_bytes(&mut body, key.as_bytes());
        Ok(self.request(&body, Duration::ZERO)? == [1])
    }

    /// Another connection to the same store, authenticated with `token` (for a thread whose
    /// waits must not hold up this connection's users).
    pub fn reconnect(&self, timeout: Duration, token: &Token) -> Result<Self> {
        let peer = self
            .stream
            .peer_addr()
            .map_err(|e| Error::StoreLost { addr: self.addr.clone(), detail: e.to_string() })?;
        Self::connect_with(&peer.ip().to_string(), peer.port(), timeout, token)
    }

    /// Removes `key`; whether it was set.
    pub fn delete(&mut self, key: &str) -> Result<bool> {
        let mut body = vec![OP_DELETE];
        put_bytes(&mut body, key.as_bytes());
        Ok(self.request(&body, Duration::ZERO)? == [1])
    }

    /// Waits until every rank of `0..world_size` has set `{prefix}/{rank}`; a timeout names
    /// the ranks that did not.
    pub fn wait_all(&mut self, prefix: &str, world_size: usize, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        for rank in 0..world_size {
            let left = deadline.saturating_duration_since(Instant::now());
            if self.get(&format!("{prefix}/{rank}"), left).is_err() {
                let mut missing = Vec::new();
                for r in 0..world_size {
                    if !self.check(&format!("{prefix}/{r}")).unwrap_or(false) {
                        missing.push(r);
                    }
                }
                return Err(Error::Rendezvous(format!(
                    "rank(s) {missing:?} of {world_size} never arrived at `{prefix}` within {:.0} s; \
                     did they start, and do they use the same MASTER_ADDR/MASTER_PORT?",
                    timeout.as_secs_f64()
                )));
            }
        }
        Ok(())
    }

    /// The local address this client uses to reach the store: the interface other ranks
    /// can reach this process on.
    pub fn local_ip(&self) -> Result<std::net::IpAddr> {
        Ok(self.stream.local_addr().map_err(|e| Error::Rendezvous(e.to_string()))?.ip())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::auth::authenticate_dialler;

    #[test]
    fn set_get_add_check_delete_and_waiting() {
        let server = StoreServer::start("127.0.0.1", 0).unwrap();
        let port = server.addr().port();
        let mut a = StoreClient::connect("127.0.0.1", port, Duration::from_secs(5)).unwrap();
        let mut b = StoreClient::connect("127.0.0.1", port, Duration::from_secs(5)).unwrap();
        a.set("k", b"v").unwrap();
        assert_eq!(b.get("k", Duration::ZERO).unwrap(), b"v");
        assert_eq!(a.add("n", 2).unwrap(), 2);
        assert_eq!(b.add("n", 3).unwrap(), 5);
        assert!(b.check("k").unwrap() && !b.check("nope").unwrap());
        assert!(a.delete("n").unwrap() && !a.delete("n").unwrap() && !b.check("n").unwrap());
        a.set("once", b"1").unwrap();
        assert_eq!(b.take("once", Duration::ZERO).unwrap(), b"1");
        assert!(!a.check("once").unwrap() && a.take("once", Duration::ZERO).is_err());
        let waiter = std::thread::spawn(move || b.get("later", Duration::from_secs(5)).unwrap());
        std::thread::sleep(Duration::from_millis(100));
        a.set("later", b"now").unwrap();
        assert_eq!(waiter.join().unwrap(), b"now");
        let err = a.get("never", Duration::from_millis(50)).unwrap_err().to_string();
        assert!(err.contains("timeout waiting for key `never`"), "{err}");
    }

    #[test]
    fn taken_ranks_other_world_sizes_and_missing_ranks_are_named() {
        let server = StoreServer::start("127.0.0.1", 0).unwrap();
        let port = server.addr().port();
        let connect = || StoreClient::connect("127.0.0.1", port, Duration::from_secs(5)).unwrap();
        let mut r0 = connect();
        r0.hello(0, 3).unwrap();
        let err = connect().hello(0, 3).unwrap_err().to_string();
        assert!(err.contains("rank 0 is already taken"), "{err}");
        let err = connect().hello(1, 4).unwrap_err().to_string();
        assert!(err.contains("world size is 4, but rank 0 started a run of 3"), "{err}");
        let mut r1 = connect();
        r1.hello(1, 3).unwrap();
        r0.set("ready/0", b"").unwrap();
        r1.set("ready/1", b"").unwrap();
        let err = r0.wait_all("ready", 3, Duration::from_millis(300)).unwrap_err().to_string();
        assert!(err.contains("rank(s) [2] of 3 never arrived"), "{err}");
        // A rank of another attempt of the run (a leftover of a restarted group) is refused.
        let err = connect().hello_in(2, 3, 7).unwrap_err().to_string();
        assert!(err.contains("rank 2 belongs to attempt 7 of the run"), "{err}");
        connect().hello_in(2, 3, run_generation()).unwrap();
    }

    #[test]
    fn malformed_and_oversized_messages_are_rejected_and_the_store_keeps_serving() {
        let server = StoreServer::start("127.0.0.1", 0).unwrap();
        let addr = server.addr();
        let reply_to = |bytes: &[u8]| {
            let mut s = TcpStream::connect(addr).unwrap();
            authenticate_dialler(&mut s, &Token::none(), "test").unwrap();
            s.write_all(bytes).unwrap();
            let mut out = Vec::new();
            let _ = s.read_to_end(&mut out);
            String::from_utf8_lossy(&out).into_owned()
        };
        assert!(reply_to(&[2, 0, 0, 0, 99, 1]).contains("unknown op 99"));
        assert!(reply_to(&[3, 0, 0, 0, OP_SET, 200, 0]).contains("truncated field"));
        assert!(reply_to(&u32::MAX.to_le_bytes()).contains("over the"));
        let mut ok =
            StoreClient::connect("127.0.0.1", addr.port(), Duration::from_secs(5)).unwrap();
        ok.set("alive", b"yes").unwrap();
        assert_eq!(ok.get("alive", Duration::ZERO).unwrap(), b"yes");
    }

    #[test]
    fn only_clients_with_the_token_are_served_and_a_closed_claim_is_released() {
        let token = Token::from_bytes(b"a shared secret of the run").unwrap();
        let server = StoreServer::start_with("127.0.0.1", 0, token.clone()).unwrap();
        let port = server.addr().port();
        let wait = Duration::from_secs(5);
        // Without the token, or with another one: refused before anything is served.
        let err = StoreClient::connect("127.0.0.1", port, wait).unwrap_err().to_string();
        assert!(err.contains("has no token") && err.contains("ACCEL_TOKEN"), "{err}");
        let other = Token::from_bytes(b"another run's secret!").unwrap();
        let err = StoreClient::connect_with("127.0.0.1", port, wait, &other).unwrap_err();
        assert!(err.to_string().contains("does not hold this run's token"), "{err}");
        // Raw requests without the handshake get nothing back.
        let mut raw = TcpStream::connect(server.addr()).unwrap();
        raw.write_all(&[1, 0, 0, 0, OP_CHECK]).unwrap();
        let mut out = Vec::new();
        let _ = raw.read_to_end(&mut out);
        assert!(!String::from_utf8_lossy(&out).contains("malformed"), "served: {out:?}");
        // With it: served; a rank claimed by a connection that closed can be claimed again.
        let mut first = StoreClient::connect_with("127.0.0.1", port, wait, &token).unwrap();
        first.hello(0, 2).unwrap();
        drop(first);
        let deadline = Instant::now() + wait;
        loop {
            let mut again = StoreClient::connect_with("127.0.0.1", port, wait, &token).unwrap();
            match again.hello(0, 2) {
                Ok(()) => break,
                Err(e) if Instant::now() < deadline => {
                    assert!(e.to_string().contains("already taken"), "{e}");
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => panic!("the closed connection's claim was never released: {e}"),
            }
        }
    }

    /// A flood of idle connections that never authenticate: the store holds at most its
    /// limit of them, each for at most the handshake timeout, and a real client that
    /// arrives during the flood is served once they time out.
    #[test]
    fn idle_connection_floods_are_bounded_in_count_and_time() {
        let token = Token::from_bytes(b"a shared secret of the run").unwrap();
        // 2,000 silent connections against the default cap of 1024 (loopback only).
        let server = StoreServer::start_with("127.0.0.1", 0, token.clone()).unwrap();
        let idle: Vec<TcpStream> =
            (0..2000).filter_map(|_| TcpStream::connect(server.addr()).ok()).collect();
        assert!(idle.len() >= 1500, "could open only {} connections", idle.len());
        std::thread::sleep(Duration::from_millis(300));
        let started = Instant::now();
        let wait = HANDSHAKE_TIMEOUT + Duration::from_secs(10);
        let mut client =
            StoreClient::connect_with("127.0.0.1", server.addr().port(), wait, &token).unwrap();
        client.set("alive", b"yes").unwrap();
        assert!(started.elapsed() < wait, "served after {:?}", started.elapsed());
        drop(idle);
    }

    #[test]
    fn a_port_in_use_is_a_clear_error() {
        let server = StoreServer::start("127.0.0.1", 0).unwrap();
        let err = StoreServer::start("127.0.0.1", server.addr().port()).unwrap_err().to_string();
        assert!(err.contains("already in use"), "{err}");
    }

    #[test]
    fn a_store_for_many_processes_serves_more_than_the_default_cap() {
        // 1,500 clients at once, each proving the token and writing: past the default cap of
        // 1024, within a run of 1,000 processes' 4,000.
        let token = Token::from_bytes(b"many processes, one store").unwrap();
        let server = StoreServer::start_for("127.0.0.1", 0, token.clone(), 1000).unwrap();
        let port = server.addr().port();
        let clients: Vec<StoreClient> = (0..1500)
            .map(|i| {
                let mut c =
                    StoreClient::connect_with("127.0.0.1", port, Duration::from_secs(20), &token)
                        .unwrap_or_else(|e| panic!("client {i}: {e}"));
                c.set(&format!("k{i}"), b"x").unwrap();
                c
            })
            .collect();
        let mut last =
            StoreClient::connect_with("127.0.0.1", port, Duration::from_secs(5), &token).unwrap();
        assert_eq!(last.get("k1499", Duration::from_secs(1)).unwrap(), b"x");
        drop(clients);
    }
}
