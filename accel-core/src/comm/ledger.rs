//! The collective sequence check: each communicator keeps a ledger of the collectives it
//! issued (operation, shape, dtype and the call site, through `#[track_caller]`), and at
//! every optimizer step the ranks compare their ledgers through the store. A rank that
//! skipped, added or reordered a collective is reported within one step, with each side's
//! diverging call and its source line — instead of a hang until the timeout, or, where
//! the shapes happen to match, silently combined wrong data.
//!
//! The comparison runs on a thread of its own, off the training step: the step hands over
//! its ledgers and goes on; the thread posts them (`ledger/{scope}/{step}/{rank}`) and reads
//! the next rank's. If that rank's post does not come, its posted progress tells a rank that
//! is merely late from one blocked in a collective this rank never issued. On a divergence
//! the thread reports it, aborts the run's communicators (so that a rank blocked in a
//! collective fails now), keeps the error for the next step to return, and by default ends
//! the process after a grace period. `ACCEL_CHECK_COLLECTIVES=0` turns the check off.

use std::collections::BTreeMap;
use std::panic::Location;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::progress::{parse_progress, progress_key};
use super::store::StoreClient;
use super::{Communicator, Op};
use crate::error::{Error, Result};
use crate::sync::Locked;

/// Entries kept per step for the report (the hash covers them all).
const KEPT: usize = 256;

/// One collective as the ledger records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    /// Its sequence number in the communicator.
    pub seq: u64,
    /// "all_reduce(sum) of [4, 8] Float".
    pub call: String,
    /// "src/strategy/ddp/mod.rs:66": the end of the path (machines may build from
    /// different folders) and the line.
    pub site: String,
}

impl Entry {
    fn describe(&self) -> String {
        if self.is_note() {
            return self.call.clone();
        }
        format!("collective #{} {} at {}", self.seq, self.call, self.site)
    }

    /// A note of where the rank is in its data ([`Ledger::note`]), not a collective.
    fn is_note(&self) -> bool {
        self.seq == 0
    }
}

/// The last three components of a source path and the line.
pub(crate) fn site_of(location: &Location<'_>) -> String {
    let parts: Vec<&str> = location.file().rsplitn(4, ['/', '\\']).collect();
    let tail: Vec<&str> = parts.iter().take(3).rev().copied().collect();
    format!("{}:{}", tail.join("/"), location.line())
}

/// What a communicator issued since its last check.
#[derive(Debug)]
pub struct Ledger {
    inner: Mutex<Pending>,
    /// Checks so far (optimizer steps handed over): a collective issued now belongs to
    /// step `epoch + 1`.
    epoch: AtomicU64,
    /// The check is on (`ACCEL_CHECK_COLLECTIVES`, read when the communicator is made):
    /// off, collectives are not recorded at all.
    on: bool,
}

impl Default for Ledger {
    fn default() -> Self {
        Self { inner: Mutex::default(), epoch: AtomicU64::default(), on: enabled() }
    }
}

#[derive(Debug, Default)]
struct Pending {
    entries: Vec<Entry>,
    count: u64,
    /// Over operations, shapes, dtypes and call sites.
    hash: u64,
    /// Over operations, shapes and dtypes only (`ACCEL_CHECK_COLLECTIVES=shapes`).
    shape_hash: u64,
    last_seq: u64,
}

/// FNV-1a: the same on every machine and build (std's hashers promise neither).
fn fnv(mut hash: u64, bytes: &[u8]) -> u64 {
    if hash == 0 {
        hash = 0xcbf2_9ce4_8422_2325;
    }
    for &b in bytes {
        hash = (hash ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    hash
}

impl Ledger {
    /// Notes collective `seq`, `op` on `what` ("[4] Float"), called at `site`; returns its
    /// epoch (the checks before it), which progress posts carry.
    pub(crate) fn record(&self, seq: u64, op: Op, what: &str, site: &Location<'_>) -> u64 {
        if !self.on {
            return 0;
        }
        let entry = Entry { seq, call: format!("{op} of {what}"), site: site_of(site) };
        let mut p = self.inner.locked();
        p.shape_hash = fnv(p.shape_hash, entry.call.as_bytes());
        p.hash = fnv(fnv(p.hash, entry.call.as_bytes()), entry.site.as_bytes());
        p.count += 1;
        p.last_seq = seq;
        if p.entries.len() < KEPT {
            p.entries.push(entry);
        }
        self.epoch.load(Ordering::SeqCst)
    }

    /// Notes where this rank is in its data ("took batch 3 of the loop at src/main.rs:40"):
    /// compared at the next check like a collective, so that ranks that part ways in
    /// their data loops are reported even where their collectives still match.
    pub(crate) fn note(&self, what: String) {
        if !self.on {
            return;
        }
        let mut p = self.inner.locked();
        p.shape_hash = fnv(p.shape_hash, what.as_bytes());
        p.hash = fnv(p.hash, what.as_bytes());
        p.count += 1;
        if p.entries.len() < KEPT {
            p.entries.push(Entry { seq: 0, call: what, site: String::new() });
        }
    }

    /// The call sites recorded since the last check, in order (tests).
    #[cfg(test)]
    pub(crate) fn sites(&self) -> Vec<String> {
        let p = self.inner.locked();
        p.entries.iter().map(|e| e.site.clone()).collect()
    }

    /// Everything since the last call, and a fresh start (the next epoch).
    fn take(&self) -> Pending {
        let mut p = self.inner.locked();
        let last = p.last_seq;
        let taken = std::mem::take(&mut *p);
        *p = Pending { last_seq: last, ..Pending::default() };
        self.epoch.fetch_add(1, Ordering::SeqCst);
        taken
    }
}

/// A communicator's share in the check: where its ranks post, and its ledger.
#[derive(Debug, Clone)]
pub struct Scope {
    /// Store prefix of the communicator ("group3", "nccl1"): its progress posts live under
    /// `{name}/progress/{rank}`.
    pub name: String,
    /// This rank's position in it.
    pub rank: usize,
    /// Global ranks of its members.
    pub members: Vec<usize>,
}

/// What one rank posts for one communicator at one step.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Post {
    step: u64,
    count: u64,
    hash: u64,
    shape_hash: u64,
    /// The sequence number of its last collective (overall, not just this step's).
    last_seq: u64,
    entries: Vec<Entry>,
}

struct Submitted {
    step: u64,
    groups: Vec<(Scope, Post, Arc<dyn Communicator>)>,
}

/// The thread that compares the ranks' ledgers (one per process).
pub struct SequenceChecker {
    jobs: Sender<Submitted>,
    failure: Arc<Mutex<Option<String>>>,
}

impl std::fmt::Debug for SequenceChecker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SequenceChecker").finish_non_exhaustive()
    }
}

/// What the checker does on a divergence, before it aborts the communicators (by default
/// printing the failure at once and ending the process with code 1 if it still runs
/// [`EXIT_GRACE`](crate::comm::EXIT_GRACE) later).
pub type OnDivergence = Arc<dyn Fn(&str) + Send + Sync>;

/// Whether `ACCEL_CHECK_COLLECTIVES` leaves the check on (it is on unless set to 0).
pub fn enabled() -> bool {
    std::env::var(crate::config::env::CHECK_COLLECTIVES).map_or(true, |v| v.trim() != "0")
}

/// `ACCEL_CHECK_COLLECTIVES=shapes`: compare operations, shapes and dtypes only, for
/// programs whose ranks call the same collective from different lines on purpose.
fn sites_compared() -> bool {
    std::env::var(crate::config::env::CHECK_COLLECTIVES).map_or(true, |v| v.trim() != "shapes")
}

impl SequenceChecker {
    /// Starts the thread on its own store connection (its waits hold up nobody).
    /// `timeout` bounds each wait for a peer (the run's collective timeout).
    pub fn start(
        store: StoreClient,
        timeout: Duration,
        on_divergence: OnDivergence,
    ) -> Result<Self> {
        let (jobs, queue) = channel();
        let failure = Arc::new(Mutex::new(None));
        let kept = failure.clone();
        std::thread::Builder::new()
            .name("accel-sequence-check".into())
            .spawn(move || run(store, queue, timeout, &kept, &on_divergence))
            .map_err(|e| Error::Training(format!("cannot start the sequence check: {e}")))?;
        Ok(Self { jobs, failure })
    }

    /// Hands over the ledgers of `comms` (each with its scope) for optimizer step `step`;
    /// returns a divergence found at an earlier step.
    pub fn submit(
        &self,
        step: u64,
        comms: impl IntoIterator<Item = (Scope, Arc<dyn Communicator>)>,
    ) -> Result<()> {
        self.failure()?;
        let groups = comms
            .into_iter()
            .filter_map(|(scope, comm)| {
                let p = comm.ledger()?.take();
                let post = Post {
                    step,
                    count: p.count,
                    hash: p.hash,
                    shape_hash: p.shape_hash,
                    last_seq: p.last_seq,
                    entries: p.entries,
                };
                Some((scope, post, comm))
            })
            .collect();
        let _ = self.jobs.send(Submitted { step, groups });
        Ok(())
    }

    /// The divergence found so far, as an error.
    pub fn failure(&self) -> Result<()> {
        match &*self.failure.locked() {
            Some(message) => Err(Error::Diverged(message.clone())),
            None => Ok(()),
        }
    }
}

fn post_key(scope: &str, step: u64, rank: usize) -> String {
    format!("ledger/{scope}/{step}/{rank}")
}

fn run(
    mut store: StoreClient,
    queue: Receiver<Submitted>,
    timeout: Duration,
    failure: &Mutex<Option<String>>,
    on_divergence: &OnDivergence,
) {
    for Submitted { step, groups } in queue {
        // Post everything first: a wait below then never waits on a post that is itself
        // behind a wait.
        for (scope, post, _) in &groups {
            let Ok(bytes) = serde_json::to_vec(post) else { continue };
            if store.set(&post_key(&scope.name, step, scope.rank), &bytes).is_err() {
                return; // the store is gone: the run is ending, the collectives say why
            }
        }
        let mut diverged = None;
        for (scope, post, _) in &groups {
            match compare(&mut store, scope, post, timeout) {
                Ok(None) => {}
                Ok(Some(report)) => {
                    diverged = Some(report);
                    break;
                }
                Err(_) => return, // the store is gone or a peer never came: the run's own
                                  // timeouts and the launcher report that
            }
        }
        if let Some(report) = diverged {
            *failure.locked() = Some(report.clone());
            on_divergence(&report);
            for (_, _, comm) in &groups {
                comm.abort();
            }
            return;
        }
    }
}

/// Compares this rank's post with the next rank's of the same communicator; `Some(report)`
/// when they diverge.
fn compare(
    store: &mut StoreClient,
    scope: &Scope,
    mine: &Post,
    timeout: Duration,
) -> Result<Option<String>> {
    let n = scope.members.len();
    if n < 2 {
        return Ok(None);
    }
    let peer = (scope.rank + 1) % n;
    let key = post_key(&scope.name, mine.step, peer);
    let deadline = Instant::now() + timeout;
    // Since when the peer has been past this rank's last collective without a post.
    let mut past_since: Option<Instant> = None;
    loop {
        // This rank is the only reader of the peer's post: it takes it.
        match store.take(&key, Duration::from_millis(250)) {
            Ok(bytes) => {
                let theirs: Post = serde_json::from_slice(&bytes)
                    .map_err(|e| Error::Training(format!("unreadable ledger post: {e}")))?;
                return Ok(diverging(scope, peer, mine, &theirs));
            }
            Err(e @ Error::StoreLost { .. }) => return Err(e),
            Err(_) => {}
        }
        // Not posted: late, or blocked in a collective this rank never issued before the
        // step. Its progress says which: a collective past this rank's last one, issued
        // before the peer handed over this step (its epoch), and still no post a second
        // later.
        match progress(store, &scope.name, peer) {
            Some((seq, epoch, doing)) if seq > mine.last_seq && epoch < mine.step => {
                let since = *past_since.get_or_insert_with(Instant::now);
                if since.elapsed() >= STUCK_AFTER && !store.check(&key)? {
                    return Ok(Some(stuck(scope, peer, mine, seq, &doing)));
                }
            }
            _ => past_since = None,
        }
        if Instant::now() >= deadline {
            return Err(Error::Training("no ledger post from the peer".into()));
        }
    }
}

/// How long a peer must be seen past this rank's collectives without a post before it is
/// reported as blocked in one this rank never issued.
const STUCK_AFTER: Duration = Duration::from_secs(1);

/// A rank's last posted progress: the sequence number of the collective it entered last,
/// its epoch, and what it is.
fn progress(store: &mut StoreClient, scope: &str, rank: usize) -> Option<(u64, u64, String)> {
    let bytes = store.get(&progress_key(scope, rank), Duration::ZERO).ok()?;
    parse_progress(&bytes)
}

fn who(scope: &Scope, rank: usize) -> String {
    format!("rank {}", scope.members[rank])
}

fn group_of(scope: &Scope) -> String {
    format!("the group of ranks {:?}", scope.members)
}

fn diverging(scope: &Scope, peer: usize, mine: &Post, theirs: &Post) -> Option<String> {
    let sites = sites_compared();
    let same = if sites { mine.hash == theirs.hash } else { mine.shape_hash == theirs.shape_hash };
    if same && mine.count == theirs.count {
        return None;
    }
    let (me, them) = (who(scope, scope.rank), who(scope, peer));
    let first = mine
        .entries
        .iter()
        .zip(&theirs.entries)
        .position(|(a, b)| a.call != b.call || (sites && a.site != b.site));
    let detail = match first {
        Some(i) => format!(
            "the {} collective of the step differs: {me} issued {}, {them} issued {}",
            ordinal(i + 1),
            mine.entries[i].describe(),
            theirs.entries[i].describe()
        ),
        None => {
            let (longer, shorter, extra) = if mine.count > theirs.count {
                (&me, &them, mine.entries.get(theirs.entries.len()))
            } else {
                (&them, &me, theirs.entries.get(mine.entries.len()))
            };
            match extra {
                Some(e) if e.is_note() => {
                    return Some(format!(
                        "{longer} {} before optimizer step {} in {}, which {shorter} did not: \
                         every process must go through a prepared loop's batches together \
                         ({me}: {} collective(s) and notes this step, {them}: {})",
                        e.describe(),
                        mine.step,
                        group_of(scope),
                        mine.count,
                        theirs.count
                    ));
                }
                Some(e) => format!(
                    "{longer} issued {}, which {shorter} did not ({me}: {} collective(s) this step, \
                     {them}: {})",
                    e.describe(),
                    mine.count,
                    theirs.count
                ),
                None => format!(
                    "they differ after the first {KEPT} collectives of the step ({me}: {}, {them}: {})",
                    mine.count, theirs.count
                ),
            }
        }
    };
    if let Some(i) = first.filter(|&i| mine.entries[i].is_note() || theirs.entries[i].is_note()) {
        return Some(format!(
            "{me} and {them} parted ways in their data before optimizer step {} in {}: {me} {}, \
             while {them} {}. Every process must go through a prepared loop's batches together: \
             a `break` or `return` that only some processes take (on their own loss, say) leaves \
             the others training on alone, their gradients averaged with other batches' — \
             decide it on a value every process shares (`accelerator.reduce(..)`, \
             `accelerator.set_trigger()` / `check_trigger()`)",
            mine.step,
            group_of(scope),
            mine.entries[i].describe(),
            theirs.entries[i].describe()
        ));
    }
    let same_call = first.is_some_and(|i| mine.entries[i].call == theirs.entries[i].call);
    let hint = if sites && same_call {
        " If the ranks call it from different lines on purpose, set \
         ACCEL_CHECK_COLLECTIVES=shapes to compare operations, shapes and dtypes only."
    } else {
        ""
    };
    Some(format!(
        "ranks issued different collectives before optimizer step {} in {}: {detail}. Every rank \
         of a group must issue the same collectives in the same order (a collective inside a \
         branch only some ranks take, or a loop that runs a different number of times, does \
         this).{hint}",
        mine.step,
        group_of(scope)
    ))
}

fn stuck(scope: &Scope, peer: usize, mine: &Post, seq: u64, doing: &str) -> String {
    let (me, them) = (who(scope, scope.rank), who(scope, peer));
    let last =
        mine.entries.last().map(|e| format!(", the last {}", e.describe())).unwrap_or_default();
    let doing = if doing.is_empty() { String::new() } else { format!(" ({doing})") };
    format!(
        "ranks issued different collectives before optimizer step {} in {}: {them} is in its \
         collective #{seq}{doing}, which {me} never issued: {me} reached the step after \
         collective #{}{last}. Every rank of a group must issue the same collectives in the \
         same order (a collective inside a branch only some ranks take, or a loop that runs a \
         different number of times, does this)",
        mine.step,
        group_of(scope),
        mine.last_seq
    )
}

fn ordinal(n: usize) -> String {
    let suffix = match (n % 10, n % 100) {
        (1, 11) | (2, 12) | (3, 13) => "th",
        (1, _) => "st",
        (2, _) => "nd",
        (3, _) => "rd",
        _ => "th",
    };
    format!("{n}{suffix}")
}

/// The scopes of distinct communicators, in a fixed order.
pub(crate) fn distinct(
    comms: impl IntoIterator<Item = Arc<dyn Communicator>>,
) -> Vec<(Scope, Arc<dyn Communicator>)> {
    let mut seen = BTreeMap::new();
    for comm in comms {
        if let Some(scope) = comm.scope() {
            seen.entry(scope.name.clone()).or_insert((scope, comm));
        }
    }
    seen.into_values().collect()
}
