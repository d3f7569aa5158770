//! One worker thread per group runs its transfers in the order they were issued (so every
//! rank runs them in the same order), and a second thread posts the last collective this
//! rank entered to the store, off the hot path, for the diagnosis of timeouts and the
//! sequence check.

use std::panic::Location;
use std::sync::mpsc::{Sender, channel};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::diagnosis::{FaultResult, Scene};
use super::tcp::Links;
use super::wire::Tag;
use crate::comm::Work;
use crate::comm::ledger::site_of;
use crate::comm::progress::{progress_key, progress_value};
use crate::comm::store::StoreClient;
use crate::error::{Error, Result};
use crate::sync::Locked;

type Job = Box<dyn FnOnce(&Links) -> FaultResult<()> + Send>;

struct Queued {
    tag: Tag,
    /// Where a collective was called and its epoch; collectives advance the rank's posted
    /// progress, point-to-point messages (`None`) do not.
    site: Option<(&'static Location<'static>, u64)>,
    what: String,
    job: Job,
    done: Sender<Result<()>>,
}

/// Who the worker works for: the group's id, this rank, the members' global ranks.
pub(crate) struct Identity {
    pub group: u64,
    pub rank: usize,
    pub members: Vec<usize>,
    pub timeout: Duration,
    /// Host names by group rank (for naming the unreachable).
    pub hosts: Vec<String>,
}

/// The queue of a group's worker thread.
pub(crate) struct Worker {
    jobs: Sender<Queued>,
}

impl Worker {
    /// Starts the worker over `links`, and the thread that posts its progress to `store`.
    pub fn start(links: Links, who: Identity, store: Arc<Mutex<StoreClient>>) -> Result<Self> {
        let (jobs, queue) = channel::<Queued>();
        let progress = Arc::new(Mutex::new((0u64, 0u64, String::new())));
        {
            let (progress, store) = (Arc::downgrade(&progress), store.clone());
            let key = progress_key(&format!("group{}", who.group), who.rank);
            std::thread::Builder::new()
                .name(format!("accel-group{}-progress", who.group))
                .spawn(move || {
                    let mut posted = 0;
                    while let Some(progress) = progress.upgrade() {
                        let (seq, epoch, described) = progress.locked().clone();
                        drop(progress);
                        if seq != posted {
                            if let Ok(mut store) = store.lock() {
                                let value = progress_value(seq, epoch, &described);
                                if store.set(&key, &value).is_ok() {
                                    posted = seq;
                                }
                            }
                        }
                        std::thread::sleep(Duration::from_millis(500));
                    }
                })
                .map_err(|e| Error::Rendezvous(format!("cannot start the progress thread: {e}")))?;
        }
        std::thread::Builder::new()
            .name(format!("accel-group{}", who.group))
            .spawn(move || {
                let scene = Scene {
                    scope: format!("group{}", who.group),
                    rank: who.rank,
                    members: &who.members,
                    store: &store,
                    timeout: who.timeout,
                    hosts: &who.hosts,
                };
                for Queued { tag, site, what, job, done } in queue {
                    if let Some((site, epoch)) = site {
                        let described = format!("{} of {what} at {}", tag.op, site_of(site));
                        *progress.locked() = (tag.seq, epoch, described);
                    }
                    // In a profile, each transfer is a range on this thread.
                    crate::shim::profiler_follow_main();
                    let _range = crate::shim::recording()
                        .then(|| crate::shim::range(&format!("accel::{} {what}", tag.op)));
                    let result =
                        job(&links).map_err(|fault| scene.diagnose(fault, tag.seq, tag.op, &what));
                    let _ = done.send(result);
                }
            })
            .map_err(|e| Error::Rendezvous(format!("cannot start the group thread: {e}")))?;
        Ok(Self { jobs })
    }

    /// Queues `job` and returns its handle.
    pub fn submit(
        &self,
        tag: Tag,
        site: Option<(&'static Location<'static>, u64)>,
        what: String,
        job: impl FnOnce(&Links) -> FaultResult<()> + Send + 'static,
    ) -> Work {
        let (done, wait) = channel();
        let queued = Queued { tag, site, what, job: Box::new(job), done: done.clone() };
        if self.jobs.send(queued).is_err() {
            let _ =
                done.send(Err(Error::Training("the process group's worker thread is gone".into())));
        }
        Work::channel(wait)
    }
}

/// The data a queued job works on, for messages ("[4, 8] Float"; the error names the op).
pub(crate) fn describe(tensor: &tch::Tensor) -> String {
    format!("{:?} {:?}", tensor.size(), tensor.kind())
}
