//! One worker thread per group runs its transfers in the order they were issued (so every
//! rank runs them in the same order), and a second thread posts the last collective this
//! rank entered to the store, off the hot path, for the diagnosis of timeouts.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Sender, channel};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::diagnosis::{FaultResult, Scene, progress_key};
use super::tcp::Links;
use super::wire::Tag;
use crate::comm::store::StoreClient;
use crate::comm::{Op, Work};
use crate::error::{Error, Result};

type Job = Box<dyn FnOnce(&Links) -> FaultResult<()> + Send>;

struct Queued {
    tag: Tag,
    /// Collectives advance the rank's posted progress; point-to-point messages do not.
    collective: bool,
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
}

/// The queue of a group's worker thread.
pub(crate) struct Worker {
    jobs: Sender<Queued>,
}

impl Worker {
    /// Starts the worker over `links`, and the thread that posts its progress to `store`.
    pub fn start(links: Links, who: Identity, store: Arc<Mutex<StoreClient>>) -> Result<Self> {
        let (jobs, queue) = channel::<Queued>();
        let progress = Arc::new(AtomicU64::new(0));
        {
            let (progress, store) = (Arc::downgrade(&progress), store.clone());
            let key = progress_key(who.group, who.rank);
            std::thread::Builder::new()
                .name(format!("accel-group{}-progress", who.group))
                .spawn(move || {
                    let mut posted = 0;
                    while let Some(progress) = progress.upgrade() {
                        let seq = progress.load(Ordering::SeqCst);
                        drop(progress);
                        if seq != posted {
                            if let Ok(mut store) = store.lock() {
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
        std::thread::Builder::new()
            .name(format!("accel-group{}", who.group))
            .spawn(move || {
                let scene = Scene {
                    group: who.group,
                    rank: who.rank,
                    members: &who.members,
                    store: &store,
                    timeout: who.timeout,
                };
                for Queued { tag, collective, what, job, done } in queue {
                    if collective {
                        progress.store(tag.seq, Ordering::SeqCst);
                    }
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
        collective: bool,
        what: String,
        job: impl FnOnce(&Links) -> FaultResult<()> + Send + 'static,
    ) -> Work {
        let (done, wait) = channel();
        let queued = Queued { tag, collective, what, job: Box::new(job), done: done.clone() };
        if self.jobs.send(queued).is_err() {
            let _ =
                done.send(Err(Error::Training("the process group's worker thread is gone".into())));
        }
        Work::channel(wait)
    }
}

/// The operation a queued job performs, for messages (`Op`'s own `Display`).
pub(crate) fn describe(op: Op, tensor: &tch::Tensor) -> String {
    format!("{op} {:?} {:?}", tensor.size(), tensor.kind())
}
