//! What went wrong in a collective, told as a user can act on it: the operation, its
//! sequence number, the tensor, and for timeouts and lost peers the ranks that are behind
//! (each rank posts its progress to the store, read back only when something fails).

use std::sync::Mutex;
use std::time::Duration;

use crate::comm::Op;
use crate::comm::progress::{parse_progress, progress_key};
use crate::comm::store::StoreClient;
use crate::error::Error;

/// What the transport knows went wrong, before the group adds names and diagnoses.
#[derive(Debug)]
pub(crate) enum Fault {
    /// A socket operation timed out waiting for `peer` (a group rank).
    Timeout { peer: usize },
    /// `peer` closed the connection or the connection broke.
    Lost { peer: usize, detail: String },
    /// `peer` is in another collective, or sent something malformed.
    Mismatch { peer: usize, detail: String },
    /// Anything else (a libtorch error while reducing, say).
    Other(Error),
}

impl From<tch::TchError> for Fault {
    fn from(e: tch::TchError) -> Self {
        Fault::Other(e.into())
    }
}

pub(crate) type FaultResult<T> = std::result::Result<T, Fault>;

pub(crate) fn io_fault(peer: usize, e: std::io::Error) -> Fault {
    match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => Fault::Timeout { peer },
        _ => Fault::Lost { peer, detail: e.to_string() },
    }
}

/// The group a fault happened in, for naming ranks and reading their progress.
pub(crate) struct Scene<'a> {
    /// The group's store prefix ("group3"; "nccl1" for an NCCL communicator).
    pub scope: String,
    pub rank: usize,
    /// Global ranks of the members, by group rank.
    pub members: &'a [usize],
    pub store: &'a Mutex<StoreClient>,
    pub timeout: Duration,
    /// Host names of the members, by group rank; empty where unknown. Named in reports
    /// only when the members are on several hosts.
    pub hosts: &'a [String],
}

impl Scene<'_> {
    /// "rank 3", or "rank 3 on h2" when the group spans hosts.
    fn name(&self, group_rank: usize) -> String {
        let member = self.members[group_rank];
        match self.hosts.get(group_rank) {
            Some(host) if self.hosts.iter().any(|h| h != host) => {
                format!("rank {member} on {host}")
            }
            _ => format!("rank {member}"),
        }
    }

    /// "; not arrived: rank 2 (last at #14)", read from the store.
    pub fn behind(&self, seq: u64) -> String {
        let Ok(mut store) = self.store.lock() else { return String::new() };
        let mut late = Vec::new();
        // Progress is posted every half second: a rank without a post may have done a few
        // collectives already, but not many. This rank's own is known without asking.
        for r in (0..self.members.len()).filter(|&r| r != self.rank) {
            let who = self.name(r);
            match store.get(&progress_key(&self.scope, r), Duration::ZERO) {
                Ok(bytes) => {
                    let theirs = parse_progress(&bytes).map_or(0, |(seq, _, _)| seq);
                    if theirs < seq {
                        late.push(format!("{who} (last at #{theirs})"));
                    }
                }
                Err(Error::StoreLost { .. }) => {
                    return "; the store of rank 0 is unreachable: rank 0 has probably exited"
                        .into();
                }
                Err(_) => late.push(format!("{who} (no progress posted yet)")),
            }
        }
        if late.is_empty() { String::new() } else { format!("; not arrived: {}", late.join(", ")) }
    }

    /// Turns a fault of collective `seq` (`op` on `what`) into the user's error.
    pub fn diagnose(&self, fault: Fault, seq: u64, op: Op, what: &str) -> Error {
        let message = match fault {
            Fault::Timeout { peer } => format!(
                "timed out after {:.0} s waiting for {}{}",
                self.timeout.as_secs_f64(),
                self.name(peer),
                self.behind(seq)
            ),
            Fault::Lost { peer, detail } => format!(
                "lost the connection to {} ({detail}); it has probably exited{}",
                self.name(peer),
                self.behind(seq)
            ),
            Fault::Mismatch { peer, detail } => {
                format!("mismatch with rank {}: {detail}", self.members[peer])
            }
            Fault::Other(e) => e.to_string(),
        };
        Error::Collective { op, seq, what: what.to_owned(), rank: self.members[self.rank], message }
    }
}
