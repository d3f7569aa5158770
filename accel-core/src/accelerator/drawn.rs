//! Loops that draw their own batches (nanoGPT's `for iter in 0..max_iters { let (x, y) =
//! get_batch(..); .. }`): nothing to deal, so every process runs every iteration — on
//! batches of its own. Each process draws from torch's generator seeded with the run's seed
//! plus its data-parallel rank (nanoGPT's `seed_offset`, Accelerate's
//! `set_seed(seed, device_specific=True)`), and the first step checks that the processes
//! really did compute different losses: processes that all draw the same batches (a
//! generator seeded alike, a loop over the whole data set) would do one process's work N
//! times, so they are stopped there, saying why.

use std::sync::{Arc, Mutex};

use super::Accelerator;
use super::data::{DataPosition, LoopNotes, PreparedIter};
use crate::error::{Error, Result};
use crate::sync::Locked;

/// What the accelerator knows of the loops that draw their own batches.
#[derive(Debug, Default)]
pub(crate) struct Drawn {
    /// Torch's generator was seeded per process (by `set_seed(.., true)` or a drawn loop).
    pub(crate) seeded_per_process: bool,
    /// The loop whose first step still has to show that the processes' batches differ.
    pub(crate) check: Option<String>,
}

/// Every index of a counting range, on every process (see [`Accelerator::prepare_steps`]).
pub struct Steps<I: Iterator>(PreparedIter<Counted<I>>);

impl<I: Iterator> Iterator for Steps<I> {
    type Item = I::Item;
    fn next(&mut self) -> Option<I::Item> {
        self.0.next().map(|Step(item)| item)
    }
}

/// The range of a drawn loop, each index wrapped so that the prepared iterator's device
/// placement leaves it alone.
#[doc(hidden)]
pub struct Counted<I>(I);

impl<I: Iterator> Iterator for Counted<I> {
    type Item = Step<I::Item>;
    fn next(&mut self) -> Option<Step<I::Item>> {
        self.0.next().map(Step)
    }
}

/// An index of a drawn loop: a plain value, nothing to move.
#[doc(hidden)]
pub struct Step<T>(T);

impl<T> crate::device::ToDevice for Step<T> {
    fn to_device(self, _device: tch::Device) -> Self {
        self
    }
}

/// The guard of a drawn `loop { .. }` or `while cond { .. }` (see
/// [`Accelerator::drawn_loop`]): each iteration calls [`next_step`](Self::next_step).
#[must_use = "the guard counts the loop's iterations until dropped"]
pub struct DrawnLoop {
    accelerator: Accelerator,
    notes: Option<LoopNotes>,
    started: bool,
}

impl DrawnLoop {
    /// An iteration begins: its backward passes are one micro-step.
    pub fn next_step(&mut self) {
        self.started = true;
        self.accelerator.inner.state.mark_new_batch();
        if let Some(notes) = &mut self.notes {
            notes.batch(false);
        }
    }
}

impl Drop for DrawnLoop {
    fn drop(&mut self) {
        if self.started {
            self.accelerator.inner.state.end_batches();
        }
    }
}

impl Accelerator {
    /// A counting loop that draws its own batches (`for iter in 0..max_iters`): every
    /// process runs every index (none is dealt), each iteration a micro-step, the last one
    /// closing the accumulation window. On its first use, with several data-parallel
    /// processes, each process's torch generator is seeded with the seed + its rank (unless
    /// the program did so with [`set_seed`](Self::set_seed)), and the first step checks that
    /// the processes' losses differ. What `#[accelerate]` wraps such a loop's range in.
    #[track_caller]
    pub fn prepare_steps<I: IntoIterator>(&self, range: I) -> Steps<I::IntoIter> {
        let site = std::panic::Location::caller();
        self.draw_per_process(site);
        let position = Arc::new(Mutex::new(DataPosition::default()));
        let inner = PreparedIter::new(
            Counted(range.into_iter()),
            self.inner.state.clone(),
            position,
            self.device(),
        );
        Steps(inner.with_notes(self.loop_notes(site)))
    }

    /// A drawn `loop`/`while` (no range to wrap): as [`prepare_steps`](Self::prepare_steps),
    /// with a guard whose `next_step` starts each iteration.
    #[track_caller]
    pub fn drawn_loop(&self) -> DrawnLoop {
        let site = std::panic::Location::caller();
        self.draw_per_process(site);
        DrawnLoop { accelerator: self.clone(), notes: self.loop_notes(site), started: false }
    }

    /// Seeds torch's generators: with `device_specific`, `seed` + this process's
    /// data-parallel rank, so that data-parallel processes draw different random numbers
    /// while the processes of one model replica (tensor, pipeline, context ranks) agree
    /// (Accelerate's `set_seed(seed, device_specific=True)`; the rank is the process index
    /// without model parallelism). Under `#[accelerate]`, `tch::manual_seed(s)` in a
    /// function whose loop draws its own batches becomes `set_seed(s, true)`.
    pub fn set_seed(&self, seed: u64, device_specific: bool) {
        let offset = if device_specific { self.data_parallel().0 as u64 } else { 0 };
        tch::manual_seed(seed.wrapping_add(offset) as i64);
        if device_specific {
            self.inner.drawn.locked().seeded_per_process = true;
        }
    }

    /// The first use of a drawn loop: per-process seeds (where the program set none) and
    /// the check of its first step.
    fn draw_per_process(&self, site: &'static std::panic::Location<'static>) {
        let (rank, replicas) = self.data_parallel();
        if replicas < 2 {
            return;
        }
        let site = crate::comm::ledger::site_of(site);
        let mut drawn = self.inner.drawn.locked();
        if !drawn.seeded_per_process {
            drawn.seeded_per_process = true;
            let seed = crate::shim::initial_seed().unwrap_or(0);
            tch::manual_seed(seed.wrapping_add(rank as u64) as i64);
            if self.is_main_process() && !super::builder::quiet() {
                eprintln!(
                    "accel: the loop at {site} draws its own batches: every process runs every \
                     iteration, each drawing from torch's generator seeded with {seed} + its rank \
                     (set it with `accelerator.set_seed(seed, true)`)"
                );
            }
        }
        if drawn.check.is_none() {
            drawn.check = Some(site);
        }
    }

    /// At the first backward of a drawn loop: the losses of the data-parallel processes
    /// must differ, else they all trained on the same batches.
    pub(crate) fn check_drawn_batches(&self, loss: &tch::Tensor) -> Result<()> {
        let Some(site) = self.inner.drawn.locked().check.take() else {
            return Ok(());
        };
        let (_, replicas) = self.data_parallel();
        if replicas < 2 {
            return Ok(());
        }
        let mine = loss.detach().to_kind(tch::Kind::Double).reshape([1]).to_device(self.device());
        let all = self.inner.mesh.comm(crate::mesh::Dim::Batch).all_gather(&mine)?;
        let values = Vec::<f64>::try_from(all.to_device(tch::Device::Cpu))
            .map_err(|e| Error::Training(format!("reading the gathered losses: {e}")))?;
        if values.windows(2).all(|w| w[0].to_bits() == w[1].to_bits()) {
            return Err(Error::Training(format!(
                "every one of the {replicas} processes computed the same loss ({}) at the first \
                 step of the loop at {site}, so they are training on the same batches: {replicas} \
                 processes would do the work of one. This loop counts, and its body makes its \
                 own batches; for them to differ, draw them from torch's generator (it is seeded \
                 with the seed + each process's rank) or from a generator of your own seeded with \
                 the rank (`accelerator.process_index()`); or loop over the batches themselves \
                 (`for (x, y) in batches {{ .. }}`) and #[accelerate] deals them. If the batches \
                 do differ and the first losses are equal by construction (a model whose output \
                 starts at zero), say so with #[accelerate(data = \"manual\")]",
                values[0]
            )));
        }
        Ok(())
    }
}
