//! The direct path's signals: each rank has a mailbox in its own memory with two slots per
//! peer, and a peer signals by writing its slot there (`process_vm_writev`, the same access
//! the direct path's reads need). Waiting is a look at local memory — no socket, no system
//! call, no wake-up through the kernel — which is what a collective's three synchronisations
//! cost over TCP on a small VM (a blocked reader's wake-up there can take a millisecond).
//!
//! On x86-64 only: a peer that sees the round must see the header written before it, which
//! x86's store order guarantees across the two `process_vm_writev` calls; elsewhere the
//! signals stay on TCP.
//!
//! Every signal carries the collective's 32-byte wire header, so ranks in different
//! collectives get the same error as over TCP. A wait spins briefly, then yields, then
//! sleeps, and watches the TCP links meanwhile: a peer that dies closes them, so does an
//! abort, and a peer in a collective that goes over TCP sends its header there; a wait ends
//! with a clear fault within milliseconds of any of these, and with a timeout after the
//! group's timeout.

use std::io::Read;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::diagnosis::{Fault, FaultResult};
use super::wire::{HEADER, Tag, check_header, decode, encode, mismatch};

/// One signal: the sender's wire header (with its buffer's address as the payload word),
/// then the round it belongs to, written last.
#[repr(C, align(64))]
#[derive(Default)]
struct Slot {
    header: [AtomicU64; HEADER / 8],
    round: AtomicU64,
}

const ROUND_OFFSET: usize = HEADER;

/// This rank's mailbox (slot `2 * peer + round % 2` is `peer`'s) and where its peers' are.
pub(crate) struct Mailbox {
    /// Never freed (128 bytes per member and group): a peer that arrives after this rank
    /// gave up on a collective still writes its signal here, and must not write into memory
    /// that has been handed out again.
    slots: &'static [Slot],
    /// Address of each peer's `slots` in its own memory (ours at our rank).
    peers: Vec<u64>,
    /// Signals sent so far; every rank counts the same rounds (collectives run in order).
    round: AtomicU64,
}

/// Writes `bytes` at `remote` in process `pid`.
pub(crate) fn write_peer(pid: i32, remote: u64, bytes: &[u8]) -> std::io::Result<()> {
    let local = libc::iovec { iov_base: bytes.as_ptr() as *mut libc::c_void, iov_len: bytes.len() };
    let remote = libc::iovec { iov_base: remote as *mut libc::c_void, iov_len: bytes.len() };
    // SAFETY: the local iovec covers our own readable slice; the kernel checks the remote
    // range against the peer's address space and fails with EFAULT if it is invalid.
    let n = unsafe { libc::process_vm_writev(pid, &local, 1, &remote, 1, 0) };
    match n {
        n if n < 0 => Err(std::io::Error::last_os_error()),
        n if n as usize == bytes.len() => Ok(()),
        n => Err(std::io::Error::other(format!("wrote {n} of {} bytes", bytes.len()))),
    }
}

impl Mailbox {
    /// An empty mailbox for a group of `world`, not yet connected to its peers'.
    pub fn new(world: usize) -> Self {
        let slots = Box::leak((0..2 * world).map(|_| Slot::default()).collect());
        Self { slots, peers: Vec::new(), round: AtomicU64::new(0) }
    }

    /// Where this mailbox is, for the peers.
    pub fn address(&self) -> u64 {
        self.slots.as_ptr() as u64
    }

    /// Every member's mailbox address, by rank: signals can flow.
    pub fn connect(&mut self, peers: Vec<u64>) {
        self.peers = peers;
    }

    /// Tells every other rank of `members` (this machine's) that this rank reached the next
    /// round of `tag` (with `word` for them: a buffer's address), then waits until each has
    /// said the same; returns what each said, by rank (our own `word` at our rank, 0 for
    /// those not in `members`). The same members take part in every round of a mailbox.
    #[allow(clippy::too_many_arguments)]
    pub fn round(
        &self,
        rank: usize,
        members: &[usize],
        pids: &[i32],
        tag: Tag,
        word: u64,
        watch: &[Option<std::net::TcpStream>],
        timeout: Duration,
    ) -> FaultResult<Vec<u64>> {
        let round = self.round.fetch_add(1, Ordering::Relaxed) + 1;
        let parity = (round % 2) as usize;
        let header = encode(tag, word);
        for &peer in members.iter().filter(|&&p| p != rank) {
            let pid = pids[peer];
            let slot = self.peers[peer] + ((2 * rank + parity) * size_of::<Slot>()) as u64;
            // The header first, then the round: a peer that sees the round sees the header.
            write_peer(pid, slot, &header)
                .and_then(|()| write_peer(pid, slot + ROUND_OFFSET as u64, &round.to_le_bytes()))
                .map_err(|e| Fault::Lost { peer, detail: format!("signalling it: {e}") })?;
        }
        let started = Instant::now();
        let mut said = vec![0; pids.len()];
        for &peer in members {
            said[peer] = if peer == rank {
                word
            } else {
                self.wait_for(peer, round, tag, started, watch, timeout)?
            };
        }
        Ok(said)
    }

    /// Waits until `peer` has signalled `round` (started at `started`); returns its word.
    fn wait_for(
        &self,
        peer: usize,
        round: u64,
        tag: Tag,
        started: Instant,
        watch: &[Option<std::net::TcpStream>],
        timeout: Duration,
    ) -> FaultResult<u64> {
        let slot = &self.slots[2 * peer + (round % 2) as usize];
        let mut spins = 0u32;
        while slot.round.load(Ordering::Acquire) < round {
            spins = spins.wrapping_add(1);
            if spins < 2000 {
                std::hint::spin_loop();
                continue;
            }
            let waited = started.elapsed();
            // Yield for the first few milliseconds (the peer is usually close behind), then
            // sleep, so that a long wait (a peer saving a checkpoint) costs no CPU.
            if waited < Duration::from_millis(5) {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(200));
            }
            if spins % 64 == 0 {
                let signalled = || slot.round.load(Ordering::Acquire) >= round;
                if let Some(fault) = check(peer, watch, tag, signalled) {
                    return Err(fault);
                }
                if waited > timeout {
                    return Err(Fault::Timeout { peer });
                }
            }
        }
        let mut theirs = [0u8; HEADER];
        for (bytes, word) in theirs.chunks_exact_mut(8).zip(&slot.header) {
            bytes.copy_from_slice(&word.load(Ordering::Relaxed).to_le_bytes());
        }
        check_header(peer, &theirs, tag, "signalled")
    }
}

/// A fault if `peer` is no longer where this rank waits for it: its TCP link closed (it
/// died, or this group was aborted), or it sent something over TCP, which it only does in
/// another collective (every earlier transfer was read in full).
///
/// A peer that signalled this round, left the collective and then sent the next one's header
/// over TCP (or exited) is not at fault: it wrote its slot before it sent or closed, so once
/// the link stirs, `signalled` (a look at the slot) tells the two apart.
fn check(
    peer: usize,
    watch: &[Option<std::net::TcpStream>],
    tag: Tag,
    signalled: impl Fn() -> bool,
) -> Option<Fault> {
    let stream = watch.get(peer)?.as_ref()?;
    let events = libc::POLLIN | libc::POLLRDHUP;
    let mut fd = libc::pollfd { fd: stream.as_raw_fd(), events, revents: 0 };
    // SAFETY: one valid pollfd, no waiting.
    if unsafe { libc::poll(&mut fd, 1, 0) } <= 0 || signalled() {
        return None;
    }
    let lost = |detail: String| Some(Fault::Lost { peer, detail });
    if fd.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0 {
        return lost("its connection closed while this rank waited for it".into());
    }
    let mut header = [0u8; HEADER];
    if let Err(e) = (&mut &*stream).read_exact(&mut header) {
        return lost(format!("reading what it sent while this rank waited for it: {e}"));
    }
    Some(match decode(&header) {
        Ok((theirs, _)) => Fault::Mismatch { peer, detail: mismatch(peer, theirs, tag) },
        Err(detail) => Fault::Mismatch { peer, detail: format!("rank {peer} sent {detail}") },
    })
}
