//! The helpers Accelerate users reach for around the training loop: a state of one's own in
//! checkpoints, early stopping across processes, the main process first or alone, metrics
//! of any serde type, and the largest batch that fits.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::Accelerator;
use crate::comm::ReduceOp;
use crate::error::{Error, Result};
use crate::mesh::Dim;

/// A state of one's own that `save_state` saves and `load_state` restores once registered
/// with [`Accelerator::register_for_checkpointing`] (Accelerate's objects with `state_dict`
/// and `load_state_dict`). Every type serde can write and read is one, as JSON in the
/// checkpoint's manifest; implement it by hand for anything else.
pub trait Stateful: Send {
    /// The state to save.
    fn state(&self) -> Result<serde_json::Value>;
    /// Takes back a state [`state`](Self::state) gave.
    fn load(&mut self, state: serde_json::Value) -> Result<()>;
}

impl<T: Serialize + serde::de::DeserializeOwned + Send> Stateful for T {
    fn state(&self) -> Result<serde_json::Value> {
        serde_json::to_value(self).map_err(|e| {
            Error::Training(format!(
                "register_for_checkpointing: a {} cannot be saved: {e}",
                std::any::type_name::<T>()
            ))
        })
    }

    fn load(&mut self, state: serde_json::Value) -> Result<()> {
        *self = serde_json::from_value(state).map_err(|e| {
            Error::Training(format!(
                "register_for_checkpointing: the saved state is not a {}: {e}",
                std::any::type_name::<T>()
            ))
        })?;
        Ok(())
    }
}

impl Accelerator {
    /// Saves `state` with every [`save_state`](Self::save_state) (and checkpoint) and
    /// restores it with [`load_state`](Self::load_state), as Accelerate's
    /// `register_for_checkpointing`: anything serde can write (an epoch counter, an early
    /// stopper, a metric history), or a [`Stateful`] of one's own. The main process's value
    /// is saved; every process gets it back. Register the same objects, in the same order,
    /// in the run that loads.
    pub fn register_for_checkpointing<T: Stateful + 'static>(&self, state: Arc<Mutex<T>>) {
        self.registry().custom.push(state);
    }

    /// Raises this process's flag for [`check_trigger`](Self::check_trigger) (Accelerate's
    /// `set_trigger`): e.g. when its loss says training should stop early.
    pub fn set_trigger(&self) {
        self.inner.trigger.store(true, Ordering::SeqCst);
    }

    /// Whether any process called [`set_trigger`](Self::set_trigger) since the last check
    /// (a collective: call it on every process; every process gets the same answer, and the
    /// flags are lowered). The way to break out of a loop on all processes at once.
    #[track_caller]
    pub fn check_trigger(&self) -> Result<bool> {
        let mine = self.inner.trigger.swap(false, Ordering::SeqCst);
        if self.num_processes() == 1 {
            return Ok(mine);
        }
        let flag = tch::Tensor::from(i64::from(mine));
        Ok(self.reduce(&flag, ReduceOp::Sum)?.int64_value(&[]) > 0)
    }

    /// Runs `f` on the main process first, then on the others (Accelerate's
    /// `main_process_first`): e.g. the main process downloads or preprocesses into a cache,
    /// the others read it. A collective (two barriers' worth): call it on every process.
    pub fn main_process_first<R>(&self, f: impl FnOnce() -> R) -> Result<R> {
        self.first(self.is_main_process(), f)
    }

    /// Runs `f` on each machine's local main process first, then on that machine's other
    /// processes (Accelerate's `local_main_process_first`). A collective.
    pub fn local_main_process_first<R>(&self, f: impl FnOnce() -> R) -> Result<R> {
        self.first(self.is_local_main_process(), f)
    }

    fn first<R>(&self, leader: bool, f: impl FnOnce() -> R) -> Result<R> {
        if !leader {
            self.wait_for_everyone()?;
        }
        let out = f();
        if leader {
            self.wait_for_everyone()?;
        }
        Ok(out)
    }

    /// `f()` on the main process, `None` elsewhere (Accelerate's `on_main_process`).
    pub fn on_main_process<R>(&self, f: impl FnOnce() -> R) -> Option<R> {
        self.is_main_process().then(f)
    }

    /// `f()` on each machine's local main process, `None` elsewhere
    /// (`on_local_main_process`).
    pub fn on_local_main_process<R>(&self, f: impl FnOnce() -> R) -> Option<R> {
        self.is_local_main_process().then(f)
    }

    /// `f()` on the process of global index `index`, `None` elsewhere (`on_process`).
    pub fn on_process<R>(&self, index: usize, f: impl FnOnce() -> R) -> Option<R> {
        (self.process_index() == index).then(f)
    }

    /// `f()` on the process of local index `index` on each machine, `None` elsewhere
    /// (`on_local_process`).
    pub fn on_local_process<R>(&self, index: usize, f: impl FnOnce() -> R) -> Option<R> {
        (self.local_process_index() == index).then(f)
    }

    /// [`gather_for_metrics`](Self::gather_for_metrics) for values of any serde type
    /// (Accelerate's `gather_for_metrics` with `use_gather_object`): every data-parallel
    /// replica's `items`, in replica order, on every process; on the last batch of a
    /// prepared loader the samples repeated to even out the processes are dropped, so
    /// that an epoch yields exactly the dataset. A collective.
    #[track_caller]
    pub fn gather_objects_for_metrics<T: Serialize + DeserializeOwned>(
        &self,
        items: Vec<T>,
    ) -> Result<Vec<T>> {
        self.inner.strategy.take_error()?;
        let mut gathered = match self.process_group() {
            None => items,
            Some(group) => {
                // A replica's tensor ranks, context ranks and pipeline stages hold the same
                // samples: one of each replica speaks.
                let speaks = [Dim::Tensor, Dim::Context, Dim::Pipeline]
                    .into_iter()
                    .all(|dim| self.index_along(dim) == 0);
                let sent: Option<Vec<T>> = speaks.then_some(items);
                group.all_gather_objects(&sent)?.into_iter().flatten().flatten().collect()
            }
        };
        if self.inner.state.end_of_dataloader() {
            if let Some(remainder) = self.inner.state.remainder() {
                gathered.truncate(remainder);
            }
        }
        Ok(gathered)
    }
}

/// Calls `f` with `starting_batch_size`, and again with half the batch each time it fails
/// for lack of memory (Accelerate's `find_executable_batch_size`): the first batch size that
/// fits, and what `f` returned with it. Accelerate 1.15 shrinks to 90% instead;
/// [`find_executable_batch_size_with`] takes that rule (`|b| b * 9 / 10`) or any other.
/// Out of memory is recognised by libtorch's messages (see [`is_out_of_memory`]); any other
/// error is returned as it is, and reaching a batch of 0 is an error.
pub fn find_executable_batch_size<R>(
    starting_batch_size: usize,
    f: impl FnMut(usize) -> Result<R>,
) -> Result<(usize, R)> {
    find_executable_batch_size_with(starting_batch_size, |b| b / 2, f)
}

/// [`find_executable_batch_size`] with the next batch size after a failure given by
/// `reduce` (Accelerate's `reduce_batch_size_fn`); a `reduce` that does not shrink the
/// batch is taken as one less.
pub fn find_executable_batch_size_with<R>(
    starting_batch_size: usize,
    mut reduce: impl FnMut(usize) -> usize,
    mut f: impl FnMut(usize) -> Result<R>,
) -> Result<(usize, R)> {
    let mut batch_size = starting_batch_size;
    let mut tried = Vec::new();
    loop {
        if batch_size == 0 {
            return Err(Error::Training(format!(
                "find_executable_batch_size: no batch size fits in memory (tried {}); reduce \
                 the model or its inputs, or train on a device with more memory",
                tried.iter().map(usize::to_string).collect::<Vec<_>>().join(", ")
            )));
        }
        tried.push(batch_size);
        match f(batch_size) {
            Ok(out) => return Ok((batch_size, out)),
            Err(e) if is_out_of_memory(&e) => {
                // What the failed attempt held is freed when its tensors dropped; the
                // caching allocator gives it back so that the next try can have it.
                crate::shim::cuda_runtime::empty_cache()?;
                let next = reduce(batch_size);
                eprintln!(
                    "accel: batch size {batch_size} ran out of memory; trying {next} ({})",
                    first_line(&e.to_string())
                );
                batch_size = next.min(batch_size.saturating_sub(1));
            }
            Err(e) => return Err(e),
        }
    }
}

fn first_line(text: &str) -> &str {
    text.lines().next().unwrap_or(text)
}

/// Whether `error` is libtorch running out of memory, by the messages Accelerate's
/// `should_reduce_batch_size` recognises: CUDA's and HIP's " out of memory.", cuDNN's
/// `CUDNN_STATUS_NOT_SUPPORTED` (what it says for too large a batch), and the CPU
/// allocator's "DefaultCPUAllocator: can't allocate memory".
pub fn is_out_of_memory(error: &Error) -> bool {
    const STATEMENTS: &[&str] = &[
        " out of memory.",
        "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",
        "DefaultCPUAllocator: can't allocate memory",
    ];
    let text = error.to_string();
    STATEMENTS.iter().any(|s| text.contains(s))
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use serde::{Deserialize, Serialize};
    use tch::{Device, Kind, Tensor};

    use super::*;
    use crate::comm::tests::on_ranks;
    use crate::config::Strategy as StrategyName;
    use crate::data::{DataLoader, LoaderOptions, TensorDataset};
    use crate::strategy::tests::{thread_accelerator, thread_accelerator_on};

    fn ddp(group: crate::comm::ProcessGroup) -> Accelerator {
        thread_accelerator(StrategyName::Ddp, group.clone(), Arc::new(group), |b| b)
    }

    /// An early stopper, as one would register it.
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    struct Stopper {
        best: f64,
        patience_left: u32,
        history: Vec<f64>,
    }

    #[test]
    fn a_registered_state_is_saved_from_the_main_process_and_restored_on_every_rank() {
        let dir = std::env::temp_dir().join(format!("accel-custom-state-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let d = dir.clone();
        let results = on_ranks(2, Duration::from_secs(30), move |g| {
            let rank = g.rank();
            let acc = ddp(g);
            let stopper = Arc::new(Mutex::new(Stopper {
                best: 0.25 + rank as f64,
                patience_left: 3,
                history: vec![1.0, 0.5, rank as f64],
            }));
            let epoch = Arc::new(Mutex::new(7u64 + rank as u64));
            acc.register_for_checkpointing(stopper.clone());
            acc.register_for_checkpointing(epoch.clone());
            acc.save_state(&d).unwrap();
            *stopper.lock().unwrap() = Stopper { best: 9.0, patience_left: 0, history: vec![] };
            *epoch.lock().unwrap() = 100;
            acc.load_state(&d).unwrap();
            let restored = (stopper.lock().unwrap().clone(), *epoch.lock().unwrap());
            // A run that registers fewer states is refused, naming what differs.
            let other = ddp_again(&acc);
            let refused = other.load_state(&d).unwrap_err().to_string();
            (restored, refused)
        });
        let main = Stopper { best: 0.25, patience_left: 3, history: vec![1.0, 0.5, 0.0] };
        for ((stopper, epoch), refused) in &results {
            assert_eq!((stopper, *epoch), (&main, 7), "every rank gets the main process's state");
            assert!(
                refused.contains("2 states registered for checkpointing, this run prepared 0"),
                "{refused}"
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A second accelerator on the same ranks, with nothing registered.
    fn ddp_again(acc: &Accelerator) -> Accelerator {
        let group = acc.process_group().unwrap().clone();
        ddp(group)
    }

    #[test]
    fn a_trigger_set_on_one_rank_stops_every_rank_at_the_same_step() {
        let stopped = on_ranks(2, Duration::from_secs(30), |g| {
            let rank = g.rank();
            let acc = ddp(g);
            let mut stopped_at = None;
            for step in 0..10 {
                if rank == 1 && step == 3 {
                    acc.set_trigger();
                }
                if acc.check_trigger().unwrap() {
                    stopped_at = Some(step);
                    break;
                }
            }
            // The flags were lowered by the check.
            (stopped_at, acc.check_trigger().unwrap())
        });
        assert_eq!(stopped, [(Some(3), false), (Some(3), false)]);
    }

    #[test]
    fn the_main_process_goes_first_and_the_on_helpers_pick_their_process() {
        let order = Arc::new(Mutex::new(Vec::new()));
        let seen = order.clone();
        let picked = on_ranks(2, Duration::from_secs(30), move |g| {
            let rank = g.rank();
            let acc = ddp(g);
            for local in [false, true] {
                let first = || {
                    if rank == 0 {
                        // The other rank would overtake a slow main process if it could.
                        std::thread::sleep(Duration::from_millis(200));
                    }
                    seen.lock().unwrap().push((local, rank));
                    rank * 10
                };
                let out = if local {
                    acc.local_main_process_first(first).unwrap()
                } else {
                    acc.main_process_first(first).unwrap()
                };
                assert_eq!(out, rank * 10);
                acc.wait_for_everyone().unwrap();
            }
            (
                acc.on_main_process(|| "main"),
                acc.on_local_main_process(|| "local main"),
                acc.on_process(1, || "one"),
                acc.on_local_process(1, || "local one"),
            )
        });
        assert_eq!(*order.lock().unwrap(), [(false, 0), (false, 1), (true, 0), (true, 1)]);
        assert_eq!(picked[0], (Some("main"), Some("local main"), None, None));
        assert_eq!(picked[1], (None, None, Some("one"), Some("local one")));
    }

    #[test]
    fn objects_gathered_for_metrics_are_exactly_the_dataset_as_tensors_are() {
        // 2 replicas of 1 process, then of 2 context ranks each (they hold the same samples).
        for (ranks, context) in [(2, 1), (4, 2)] {
            objects_gathered_for_metrics_on(ranks, context);
        }
    }

    fn objects_gathered_for_metrics_on(ranks: usize, context: usize) {
        let gathered = on_ranks(ranks, Duration::from_secs(30), move |g| {
            let dims = crate::mesh::ParallelDims::new(ranks, 1, ranks / context, 1, context, 1);
            let acc = thread_accelerator_on(StrategyName::Ddp, g, dims.unwrap(), |b| {
                b.context_parallel(context)
            });
            // 5 samples over 2 processes: the last batch repeats one to even them out.
            let x = Tensor::arange(5, (Kind::Int64, Device::Cpu));
            let loader = DataLoader::new(
                TensorDataset::new(vec![x]).unwrap(),
                LoaderOptions { batch_size: 2, ..Default::default() },
            )
            .unwrap();
            let mut loader = acc.prepare_loader(loader).unwrap();
            let (mut objects, mut tensors) = (Vec::new(), Vec::new());
            for batch in loader.iter() {
                let batch = batch.unwrap();
                let labels: Vec<String> = Vec::<i64>::try_from(&batch[0])
                    .unwrap()
                    .iter()
                    .map(|v| format!("#{v}"))
                    .collect();
                objects.extend(acc.gather_objects_for_metrics(labels).unwrap());
                let t = acc.gather_for_metrics(&batch[0]).unwrap();
                tensors
                    .extend(Vec::<i64>::try_from(&t).unwrap().into_iter().map(|v| format!("#{v}")));
            }
            (objects, tensors)
        });
        for (objects, tensors) in &gathered {
            assert_eq!(objects, tensors, "objects and tensors come back alike");
            let mut sorted = objects.clone();
            sorted.sort();
            assert_eq!(sorted, ["#0", "#1", "#2", "#3", "#4"], "exactly the dataset: {objects:?}");
            assert_eq!((objects, tensors), (&gathered[0].0, &gathered[0].1), "ranks agree");
        }
    }

    #[test]
    fn the_batch_size_shrinks_on_libtorchs_out_of_memory_errors_only() {
        // A real allocation failure from libtorch's CPU allocator above 8 samples.
        let mut tried = Vec::new();
        let (fits, bytes) = find_executable_batch_size(64, |batch| {
            tried.push(batch);
            let bytes = if batch > 8 { (batch as i64) << 50 } else { batch as i64 };
            Ok(Tensor::f_empty([bytes], (Kind::Uint8, Device::Cpu))?.numel())
        })
        .unwrap();
        assert_eq!((fits, bytes, tried), (8, 8, vec![64, 32, 16, 8]));

        // CUDA's message, and Accelerate 1.15's rule of 90%.
        let mut tried = Vec::new();
        let cuda =
            "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.15 GiB total capacity)";
        let (fits, ()) = find_executable_batch_size_with(
            100,
            |b| b * 9 / 10,
            |batch| {
                tried.push(batch);
                if batch > 75 { Err(tch::TchError::Torch(cuda.into()).into()) } else { Ok(()) }
            },
        )
        .unwrap();
        assert_eq!((fits, tried), (72, vec![100, 90, 81, 72]));

        // Any other error is returned at once; running out at every size names the sizes.
        let mut calls = 0;
        let err = find_executable_batch_size(16, |_| -> Result<()> {
            calls += 1;
            Err(Error::Training("shape mismatch".into()))
        })
        .unwrap_err();
        assert_eq!((calls, err.to_string()), (1, "shape mismatch".into()));
        let err = find_executable_batch_size(4, |_| -> Result<()> {
            Err(tch::TchError::Torch(cuda.into()).into())
        })
        .unwrap_err()
        .to_string();
        assert!(err.contains("no batch size fits in memory (tried 4, 2, 1)"), "{err}");
    }
}
