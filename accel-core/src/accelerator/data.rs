//! Data prepared by the accelerator (`prepare_loader`, `prepare_iter`, `shard_samples`):
//! batches moved to the process's device, one batch of look-ahead so that the accumulation
//! window closes on the last batch, and a position that checkpoints record and resume from.

use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use tch::Device;

use super::Accelerator;
use crate::accumulation::GradientState;
use crate::data::{Batches, DataLoader, Dataset};
use crate::device::ToDevice;
use crate::error::{Error, Result};
use crate::sync::Locked;

/// Where a prepared data source stands (saved in checkpoints).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataPosition {
    /// The epoch in progress (or the next one, between epochs).
    pub epoch: u64,
    /// Batches of that epoch already handed out.
    pub batches: u64,
}

/// Reads one item ahead of what it hands out, telling the gradient state when the item
/// handed out is the last one.
struct Lookahead<I: Iterator> {
    inner: I,
    next: Option<I::Item>,
    started: bool,
}

impl<I: Iterator> Lookahead<I> {
    fn new(inner: I) -> Self {
        Self { inner, next: None, started: false }
    }

    /// The next item, and whether it is the last.
    fn advance(&mut self) -> Option<(I::Item, bool)> {
        if !self.started {
            self.started = true;
            self.next = self.inner.next();
        }
        let current = self.next.take()?;
        self.next = self.inner.next();
        Some((current, self.next.is_none()))
    }
}

/// This rank's share of an iterator shared by `world` processes: items are dealt
/// round-robin (item k to rank k mod world); a last round too short to give every rank an
/// item is dropped, since items cannot be duplicated to pad it (a `DataLoader` pads, as
/// Accelerate does).
pub struct Rounds<I: Iterator> {
    inner: I,
    rank: usize,
    world: usize,
}

impl<I: Iterator> Rounds<I> {
    pub(crate) fn new(inner: I, rank: usize, world: usize) -> Self {
        Self { inner, rank, world }
    }
}

impl<I: Iterator> Iterator for Rounds<I> {
    type Item = I::Item;
    fn next(&mut self) -> Option<I::Item> {
        let mut mine = None;
        for k in 0..self.world {
            let item = self.inner.next()?;
            if k == self.rank {
                mine = Some(item);
            }
        }
        mine
    }
}

/// Where the processes are in a loop the attribute prepared, written into the world's
/// collective ledger (see [`crate::comm::ledger`]): the batch each takes, and where one
/// leaves early. The sequence check compares them at every optimizer step, so a process
/// that leaves the loop alone (a `break` on its own loss) is reported at the next step,
/// with the line it left at, instead of training on beside the others' other batches.
pub(crate) struct LoopNotes {
    ledger: Arc<crate::comm::ledger::Ledger>,
    /// "src/main.rs:40": the loop.
    site: String,
    /// Where the body last left the loop (`Accelerator::leaving_loop`).
    exit: Arc<Mutex<Option<&'static std::panic::Location<'static>>>>,
    handed: u64,
    done: bool,
}

impl LoopNotes {
    pub(crate) fn batch(&mut self, last: bool) {
        self.handed += 1;
        self.done |= last;
        self.ledger.note(format!("took batch {} of the loop at {}", self.handed, self.site));
    }
}

impl Drop for LoopNotes {
    fn drop(&mut self) {
        let exit = self.exit.locked().take();
        if self.done || self.handed == 0 {
            return;
        }
        let how = match exit {
            Some(at) => format!(" (`break`/`return` at {})", crate::comm::ledger::site_of(at)),
            None => String::new(),
        };
        self.ledger
            .note(format!("left the loop at {} after its batch {}{how}", self.site, self.handed));
    }
}

/// Any iterator of batches, prepared ([`super::Accelerator::prepare_iter`]).
pub struct PreparedIter<I: Iterator> {
    lookahead: Lookahead<I>,
    state: Arc<GradientState>,
    position: Arc<Mutex<DataPosition>>,
    device: Device,
    remainder: Option<usize>,
    notes: Option<LoopNotes>,
}

impl<I: Iterator> PreparedIter<I> {
    pub(crate) fn new(
        inner: I,
        state: Arc<GradientState>,
        position: Arc<Mutex<DataPosition>>,
        device: Device,
    ) -> Self {
        Self {
            lookahead: Lookahead::new(inner),
            state,
            position,
            device,
            remainder: None,
            notes: None,
        }
    }

    pub(crate) fn with_notes(mut self, notes: Option<LoopNotes>) -> Self {
        self.notes = notes;
        self
    }
}

impl<I> Iterator for PreparedIter<I>
where
    I: Iterator,
    I::Item: ToDevice,
{
    type Item = I::Item;
    fn next(&mut self) -> Option<I::Item> {
        let mut position = self.position.locked();
        let range = crate::shim::range("accel::data_wait");
        let advanced = self.lookahead.advance();
        drop(range);
        let Some((item, last)) = advanced else {
            self.state.set_end_of_dataloader(false);
            self.state.end_batches();
            if let Some(notes) = &mut self.notes {
                notes.done = true;
            }
            return None;
        };
        self.state.set_end_of_dataloader(last);
        self.state.mark_new_batch();
        if let Some(notes) = &mut self.notes {
            notes.batch(last);
        }
        position.batches += 1;
        if last {
            self.state.set_remainder(self.remainder);
            *position = DataPosition { epoch: position.epoch + 1, batches: 0 };
        }
        Some(item.to_device(self.device))
    }
}

impl<I: Iterator> Drop for PreparedIter<I> {
    fn drop(&mut self) {
        // Left early (a `break`): backward passes outside prepared data count alone again.
        self.state.end_batches();
    }
}

/// A [`DataLoader`] prepared by the accelerator ([`super::Accelerator::prepare_loader`]).
pub struct PreparedLoader<D: Dataset> {
    loader: DataLoader<D>,
    state: Arc<GradientState>,
    pub(crate) position: Arc<Mutex<DataPosition>>,
    device: Device,
}

impl<D: Dataset> std::fmt::Debug for PreparedLoader<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreparedLoader").field("loader", &self.loader).finish_non_exhaustive()
    }
}

impl<D: Dataset> PreparedLoader<D>
where
    D::Batch: ToDevice,
{
    pub(crate) fn new(
        loader: DataLoader<D>,
        state: Arc<GradientState>,
        position: Arc<Mutex<DataPosition>>,
        device: Device,
    ) -> Self {
        Self { loader, state, position, device }
    }

    /// The epoch the next [`iter`](Self::iter) runs: 0 in a fresh run, the interrupted one
    /// after [`super::Accelerator::load_state`].
    pub fn epoch(&self) -> u64 {
        self.position.locked().epoch
    }

    /// Batches per epoch on this process.
    pub fn len(&self) -> usize {
        self.loader.len()
    }

    /// Whether an epoch has no batch.
    pub fn is_empty(&self) -> bool {
        self.loader.is_empty()
    }

    /// Skips the first `n` batches of the next epoch (Accelerate's `skip_first_batches`;
    /// `load_state` does this by itself for prepared loaders).
    pub fn skip_first_batches(&mut self, n: u64) {
        self.position.locked().batches = n;
    }

    /// One epoch of batches on the accelerator's device. Resumes inside an epoch after
    /// `load_state`.
    pub fn iter(&mut self) -> PreparedBatches<'_, D> {
        let start = *self.position.locked();
        self.loader.set_epoch(start.epoch);
        self.loader.skip_first_batches(start.batches as usize);
        let remainder = self.loader.remainder();
        let batches = self.loader.iter();
        let mut inner =
            PreparedIter::new(batches, self.state.clone(), self.position.clone(), self.device);
        inner.remainder = remainder;
        PreparedBatches { inner }
    }
}

/// One epoch of a [`PreparedLoader`].
pub struct PreparedBatches<'a, D: Dataset> {
    inner: PreparedIter<Batches<'a, D>>,
}

impl<D: Dataset> Iterator for PreparedBatches<'_, D>
where
    D::Batch: ToDevice,
{
    type Item = Result<D::Batch>;
    fn next(&mut self) -> Option<Self::Item> {
        self.inner.next()
    }
}

impl<T: ToDevice, E> ToDevice for std::result::Result<T, E> {
    fn to_device(self, device: Device) -> Self {
        self.map(|t| t.to_device(device))
    }
    fn pin_memory(self, device: Device) -> Self {
        self.map(|t| t.pin_memory(device))
    }
}

impl Accelerator {
    /// Shards `loader` across processes, moves its batches to the device, and registers its
    /// position for checkpoints.
    pub fn prepare_loader<D: Dataset>(&self, mut loader: DataLoader<D>) -> Result<PreparedLoader<D>>
    where
        D::Batch: ToDevice,
    {
        // Processes of one data-parallel replica (its tensor ranks and pipeline stages) see
        // the same batches.
        let (index, replicas) = self.data_parallel();
        loader.shard(index, replicas)?;
        if let (Some(micro), per_process) =
            (self.inner.micro_batch_size, loader.per_process_batch())
        {
            if micro != per_process {
                return Err(Error::Config(format!(
                    "the DeepSpeed config's micro batch size is {micro} per process, but this \
                     loader gives each process batches of {per_process}; make them agree (or \
                     set train_micro_batch_size_per_gpu to \"auto\")"
                )));
            }
        }
        let device = self.device();
        if device.is_cuda() && loader.options().pin_memory {
            // Workers build each batch in pinned memory; the iterator's copy to the GPU is
            // then asynchronous, on the compute stream.
            loader.pin_batches(Arc::new(move |batch: D::Batch| batch.pin_memory(device)));
        }
        let position = Arc::new(Mutex::new(DataPosition::default()));
        self.registry().loaders.push(position.clone());
        Ok(PreparedLoader::new(loader, self.inner.state.clone(), position, device))
    }

    /// Any iterable of batches: moved to the device, with the look-ahead that closes the
    /// accumulation window on the last batch. With several processes, batches are dealt
    /// round-robin (batch k to rank k mod N) and a last round too short for every rank is
    /// dropped; use a [`DataLoader`] for Accelerate's padding.
    ///
    /// Each call site is one loop: its position (epoch, batches taken) is kept in
    /// checkpoints, and after [`load_state`](Self::load_state) the next pass of the same
    /// loop skips the batches the saved run had taken (Accelerate's `skip_first_batches`).
    #[track_caller]
    pub fn prepare_iter<I>(&self, iterable: I) -> PreparedIter<Rounds<I::IntoIter>>
    where
        I: IntoIterator,
        I::Item: ToDevice,
    {
        let site = std::panic::Location::caller();
        let (index, replicas) = self.data_parallel();
        let mut inner = iterable.into_iter();
        let (position, skip) = self.loop_pass(site);
        // Resuming mid-epoch: this process's batches of the rounds already taken.
        for _ in 0..skip.saturating_mul(replicas as u64) {
            if inner.next().is_none() {
                break;
            }
        }
        let rounds = Rounds::new(inner, index, replicas);
        PreparedIter::new(rounds, self.inner.state.clone(), position, self.device())
            .with_notes(self.loop_notes(site))
    }

    /// The position of the loop at `site`, at the start of a pass: a pass resumed from a
    /// checkpoint keeps its saved position and skips its batches (returned); any other
    /// starts at batch 0 of the next epoch.
    fn loop_pass(
        &self,
        site: &'static std::panic::Location<'static>,
    ) -> (Arc<Mutex<DataPosition>>, u64) {
        let key = crate::comm::ledger::site_of(site);
        let mut registry = self.registry();
        let resumed = registry.resume_loops.remove(&key);
        let position = registry
            .loops
            .entry(key)
            .or_insert_with(|| Arc::new(Mutex::new(DataPosition::default())))
            .clone();
        drop(registry);
        let mut p = position.locked();
        let skip = match resumed {
            Some(saved) => {
                *p = saved;
                saved.batches
            }
            None => {
                // A pass left early (a `break`) counts as an epoch begun.
                if p.batches > 0 {
                    *p = DataPosition { epoch: p.epoch + 1, batches: 0 };
                }
                0
            }
        };
        drop(p);
        (position, skip)
    }

    /// The notes a prepared loop writes into the world's ledger (several processes, no
    /// pipeline: pipeline stages take their micro-batches from the schedule).
    pub(crate) fn loop_notes(
        &self,
        site: &'static std::panic::Location<'static>,
    ) -> Option<LoopNotes> {
        let world = self.process_group()?;
        if !self.inner.mesh.whole_model_per_process() {
            return None;
        }
        Some(LoopNotes {
            ledger: world.ledger_handle(),
            site: crate::comm::ledger::site_of(site),
            exit: self.inner.loop_exit.clone(),
            handed: 0,
            done: false,
        })
    }

    /// Where the body of a prepared loop leaves it early (`break`, `return`): what
    /// `#[accelerate]` calls before each, so that a process leaving the loop alone is
    /// reported with this line.
    #[track_caller]
    pub fn leaving_loop(&self) {
        *self.inner.loop_exit.locked() = Some(std::panic::Location::caller());
    }

    /// The epoch the prepared loops resume in after [`load_state`](Self::load_state) (the
    /// latest of their saved positions; 0 in a fresh run): where a resumed program's own
    /// loop over epochs starts (`for epoch in accelerator.resumed_epoch()..epochs`).
    pub fn resumed_epoch(&self) -> u64 {
        self.registry().resumed_epoch
    }

    /// This process's share of a stream of samples, with Accelerate's
    /// `IterableDatasetShard` rules (buffers of `batch_size × processes`, rank r takes its
    /// slice, a short last buffer completed from the first); batch the result yourself, or
    /// through a [`DataLoader`].
    pub fn shard_samples<I>(
        &self,
        samples: I,
        batch_size: usize,
    ) -> crate::data::IterableShard<I::IntoIter>
    where
        I: IntoIterator,
        I::Item: Clone,
    {
        let (rank, world) = self.data_parallel();
        let options = crate::data::ShardOptions {
            rank,
            world,
            batch_size,
            drop_last: false,
            even_batches: true,
            split_batches: false,
        };
        crate::data::IterableShard::new(samples.into_iter(), options)
    }
}
