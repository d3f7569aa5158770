//! Data prepared by the accelerator: batches moved to the process's device, one batch of
//! look-ahead so that the accumulation window closes on the last batch, and a position
//! that checkpoints record and resume from.

use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use tch::Device;

use crate::accumulation::GradientState;
use crate::data::{Batches, DataLoader, Dataset};
use crate::device::ToDevice;
use crate::error::Result;

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

/// Any iterator of batches, prepared ([`super::Accelerator::prepare_iter`]).
pub struct PreparedIter<I: Iterator> {
    lookahead: Lookahead<I>,
    state: Arc<GradientState>,
    position: Arc<Mutex<DataPosition>>,
    device: Device,
    remainder: Option<usize>,
}

impl<I: Iterator> PreparedIter<I> {
    pub(crate) fn new(
        inner: I,
        state: Arc<GradientState>,
        position: Arc<Mutex<DataPosition>>,
        device: Device,
    ) -> Self {
        Self { lookahead: Lookahead::new(inner), state, position, device, remainder: None }
    }
}

impl<I> Iterator for PreparedIter<I>
where
    I: Iterator,
    I::Item: ToDevice,
{
    type Item = I::Item;
    fn next(&mut self) -> Option<I::Item> {
        let mut position = self.position.lock().unwrap_or_else(|e| e.into_inner());
        let range = crate::shim::range("accel::data_wait");
        let advanced = self.lookahead.advance();
        drop(range);
        let Some((item, last)) = advanced else {
            self.state.set_end_of_dataloader(false);
            self.state.end_batches();
            return None;
        };
        self.state.set_end_of_dataloader(last);
        self.state.mark_new_batch();
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
        self.position.lock().unwrap_or_else(|e| e.into_inner()).epoch
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
        self.position.lock().unwrap_or_else(|e| e.into_inner()).batches = n;
    }

    /// One epoch of batches on the accelerator's device. Resumes inside an epoch after
    /// `load_state`.
    pub fn iter(&mut self) -> PreparedBatches<'_, D> {
        let start = *self.position.lock().unwrap_or_else(|e| e.into_inner());
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
}
