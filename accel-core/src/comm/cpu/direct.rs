//! The single-copy path between processes of one machine: each rank reads its peers'
//! buffers straight from their memory (`process_vm_readv`), with a signal or two per
//! collective to exchange addresses and keep anyone from overwriting a chunk still being
//! read (through the mailboxes of mailbox.rs; TCP messages where those are off). Used among
//! the members of each machine where the kernel lets them read and write each other: for
//! the whole collective when every member is on one machine, for its part within each
//! machine when the group spans several (ring.rs joins the machines over TCP).

use std::ops::Range;
use std::sync::atomic::AtomicU64;

use super::buffer::{Buffer, reduce_into};
use super::diagnosis::{Fault, FaultResult};
use super::mailbox::{Mailbox, write_peer};
use super::tcp::Links;
use super::wire::{Tag, WireKind};
use crate::comm::{Op, ReduceOp};
use crate::error::{Error, Result};

/// Something to read from a peer and write back: the probe for `process_vm_readv` and
/// `process_vm_writev` (an atomic, so that it lies in writable memory).
static PROBE: AtomicU64 = AtomicU64::new(u64::from_le_bytes(*b"accelCMA"));

/// Address of this process's probe bytes.
pub(crate) fn probe_address() -> u64 {
    PROBE.as_ptr() as u64
}

/// Copies `local.len()` bytes at `remote` in process `pid` into `local`.
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

/// How a group's members move data between each other.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Transport {
    /// Reading each other's memory (`process_vm_readv`): one copy, no sockets for the data.
    Direct,
    /// Direct copies within each of `machines` machines (equal numbers of members on each),
    /// TCP between them.
    Mixed {
        /// How many machines the members are on.
        machines: usize,
    },
    /// TCP between every pair, and why not directly.
    Tcp(String),
}

impl std::fmt::Display for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Transport::Direct => {
                write!(f, "direct copies between the processes' memory (process_vm_readv)")
            }
            Transport::Mixed { machines } => write!(
                f,
                "direct copies within each machine (process_vm_readv), TCP between the \
                 {machines} machines"
            ),
            Transport::Tcp(why) => write!(f, "TCP ({why})"),
        }
    }
}

/// Bytes in an address or a vote.
const SMALL: u64 = 64;

impl Links {
    /// Turns on the single-copy path among the members of each machine (`machines`: the
    /// members by machine; `pids`: every member's process id, or why the path cannot be
    /// used) if this process can read the probe (`probes`) of every peer on its machine; all
    /// ranks agree on the outcome.
    pub fn enable_direct(
        &mut self,
        pids: std::result::Result<Vec<i32>, String>,
        probes: &[u64],
        machines: Vec<Vec<usize>>,
    ) -> Result<Transport> {
        let mut why = pids.as_ref().err().cloned();
        let machine = machines.iter().position(|m| m.contains(&self.rank)).expect("a machine");
        if let Ok(pids) = &pids {
            for &peer in &machines[machine] {
                let (pid, address) = (pids[peer], probes[peer]);
                if peer == self.rank || why.is_some() {
                    continue;
                }
                let mut bytes = [0u8; 8];
                match read_peer(pid, address, &mut bytes) {
                    Ok(()) if bytes == *b"accelCMA" => {}
                    Ok(()) => why = Some(format!("rank {peer}'s memory held other bytes")),
                    Err(e) => why = Some(format!("reading rank {peer}'s memory: {e}")),
                }
                // The signals write where the data is read (the same bytes go back).
                if why.is_none() && cfg!(target_arch = "x86_64") {
                    if let Err(e) = write_peer(pid, address, &bytes) {
                        why = Some(format!("writing rank {peer}'s memory: {e}"));
                    }
                }
            }
        }
        let tag = Tag { seq: 0, op: Op::Objects, kind: WireKind::Bytes, numel: 0 };
        let votes = self.all_to_all(tag, &[u8::from(why.is_none())], SMALL).map_err(|_| {
            Error::Rendezvous("the members could not agree on the shared-memory path".into())
        })?;
        if why.is_none() && votes.iter().all(|v| v.first() == Some(&1)) {
            self.pids = pids.ok();
            let count = machines.len();
            (self.machines, self.machine) = (machines, machine);
            if cfg!(target_arch = "x86_64") {
                let tag = Tag { seq: 0, op: Op::Objects, kind: WireKind::Bytes, numel: 1 };
                let mut mailbox = Mailbox::new(self.world);
                let addresses = self.exchange_words(&self.everyone, tag, mailbox.address());
                mailbox.connect(addresses.map_err(|_| {
                    Error::Rendezvous("the members could not exchange their mailboxes".into())
                })?);
                self.mailbox = Some(mailbox);
            }
            return Ok(if count == 1 {
                Transport::Direct
            } else {
                Transport::Mixed { machines: count }
            });
        }
        self.pids = None;
        let Ok(_) = pids else {
            return Ok(Transport::Tcp(why.unwrap_or_default()));
        };
        let why = why.unwrap_or_else(|| "another rank could not read its peers' memory".into());
        let scope = std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope")
            .map(|s| format!("; kernel.yama.ptrace_scope = {}", s.trim()))
            .unwrap_or_default();
        let why =
            format!("the processes on this machine cannot read each other's memory ({why}{scope})");
        if self.rank == 0 {
            // Said once per group, on rank 0: the run goes on, slower, over TCP.
            eprintln!(
                "accel: {why}; collectives go through TCP, slower (docs/performance.md). Allow \
                 it with `sysctl kernel.yama.ptrace_scope=1` or CAP_SYS_PTRACE, or silence this \
                 with ACCEL_DISABLE_CMA=1"
            );
        }
        Ok(Transport::Tcp(why))
    }

    /// Addresses of the buffers of this machine's members (for reading them), by rank,
    /// exchanged through the mailboxes (over TCP where they are off).
    pub fn addresses(&self, buf: &Buffer, tag: Tag) -> FaultResult<Vec<u64>> {
        match &self.mailbox {
            Some(mailbox) => self.signal(mailbox, tag, buf.address()),
            None => self.exchange_words(self.local(), tag, buf.address()),
        }
    }

    /// The `word` of every rank of `members`, by rank, over TCP.
    fn exchange_words(&self, members: &[usize], tag: Tag, word: u64) -> FaultResult<Vec<u64>> {
        Ok(self
            .all_to_all_among(members, tag, &word.to_le_bytes(), SMALL)?
            .iter()
            .map(|b| b.as_slice().try_into().map(u64::from_le_bytes).unwrap_or(0))
            .collect())
    }

    /// Every member of this machine reaches this point (phase `phase` of a collective)
    /// before any goes on: a round of the mailboxes, or a message to and from each over TCP.
    pub fn barrier(&self, tag: Tag, phase: u8) -> FaultResult<()> {
        match &self.mailbox {
            Some(mailbox) => self.signal(mailbox, tag, u64::from(phase)).map(|_| ()),
            None => self.all_to_all_among(self.local(), tag, &[phase], SMALL).map(|_| ()),
        }
    }

    /// One round of the mailboxes: every member of this machine says `word` and hears
    /// the others'.
    fn signal(&self, mailbox: &Mailbox, tag: Tag, word: u64) -> FaultResult<Vec<u64>> {
        let pids = self.pids.as_ref().expect("the direct path is on");
        mailbox.round(self.rank, self.local(), pids, tag, word, self.readers(), self.timeout)
    }

    fn read(&self, peer: usize, remote: u64, local: &mut [u8]) -> FaultResult<()> {
        let pid = self.pids.as_ref().expect("the direct path is on")[peer];
        read_peer(pid, remote, local)
            .map_err(|e| Fault::Lost { peer, detail: format!("reading its memory: {e}") })
    }

    /// Reduce-scatter among this machine's members by reading, from each, this rank's
    /// `regions[me]` (`me`: this rank's place on its machine) straight from its memory.
    pub fn direct_reduce_scatter(
        &self,
        buf: &mut Buffer,
        regions: &[Vec<Range<usize>>],
        addrs: &[u64],
        op: ReduceOp,
    ) -> FaultResult<()> {
        let (local, me) = (self.local(), self.place());
        let kind = buf.kind();
        let mut scratch = vec![0u64; (256 << 10) / 8];
        // SAFETY: a u64 buffer viewed as bytes (for alignment).
        let scratch = unsafe {
            std::slice::from_raw_parts_mut(scratch.as_mut_ptr().cast::<u8>(), scratch.len() * 8)
        };
        for step in 1..local.len() {
            let peer = local[(me + step) % local.len()];
            for mine in &regions[me] {
                let mut offset = mine.start;
                while offset < mine.end {
                    let n = scratch.len().min(mine.end - offset);
                    self.read(peer, addrs[peer] + offset as u64, &mut scratch[..n])?;
                    reduce_into(buf.bytes_mut(offset..offset + n), &scratch[..n], kind, op)?;
                    offset += n;
                }
            }
        }
        Ok(())
    }

    /// All-gather among this machine's members by reading each one's `regions[place]`
    /// straight into ours.
    pub fn direct_all_gather(
        &self,
        buf: &mut Buffer,
        regions: &[Vec<Range<usize>>],
        addrs: &[u64],
    ) -> FaultResult<()> {
        let (local, me) = (self.local(), self.place());
        for step in 1..local.len() {
            let place = (me + step) % local.len();
            let peer = local[place];
            for range in regions[place].iter().filter(|r| !r.is_empty()) {
                let start = range.start as u64;
                self.read(peer, addrs[peer] + start, buf.bytes_mut(range.clone()))?;
            }
        }
        Ok(())
    }

    /// This rank's place among its machine's members.
    pub fn place(&self) -> usize {
        self.local().iter().position(|&r| r == self.rank).expect("a member of its machine")
    }
}
