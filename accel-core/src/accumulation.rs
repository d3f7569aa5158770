//! Gradient accumulation bookkeeping shared by the accelerator, its optimizers and its data:
//! Accelerate's `GradientState` and `_do_sync`.

use std::sync::Mutex;

use crate::sync::Locked;
use serde::{Deserialize, Serialize};

/// The counters a checkpoint keeps.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepCounters {
    /// Micro-steps since the last sync step (Accelerate's `accelerator.step`).
    pub micro_step: u64,
    /// Micro-steps in the whole run: `backward` calls, or with prepared data the batches
    /// that ran one (a second backward on one batch joins its micro-step).
    pub micro_steps_total: u64,
    /// Optimizer steps taken (skipped fp16 steps not counted).
    pub optimizer_steps: u64,
    /// Optimizer steps skipped because of inf/NaN gradients.
    pub skipped_steps: u64,
}

#[derive(Debug, Default)]
struct Inner {
    counters: StepCounters,
    sync_gradients: bool,
    end_of_dataloader: bool,
    /// Samples in the last round that are real (not padding), when known: the data set's
    /// length modulo the total batch size across processes (Accelerate's `remainder`).
    remainder: Option<usize>,
    /// While a prepared data source's batch is being worked on: the backward passes run on
    /// it so far (`None` outside prepared data, where each backward is a micro-step).
    backwards_on_batch: Option<u32>,
    /// A micro-step of the current accumulation window ran on batches no prepared data
    /// source handed out.
    undealt_in_window: bool,
    /// An autocast region was entered since the last optimizer step.
    autocast_since_step: bool,
}

/// Shared by every handle of one accelerator.
#[derive(Debug)]
pub(crate) struct GradientState {
    accumulate: u64,
    inner: Mutex<Inner>,
}

impl GradientState {
    pub(crate) fn new(accumulate: u32) -> Self {
        let inner = Inner { sync_gradients: true, ..Default::default() };
        Self { accumulate: u64::from(accumulate), inner: Mutex::new(inner) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // The state stays consistent even if a holder panicked: every update is one store.
        self.inner.locked()
    }

    pub(crate) fn accumulate(&self) -> u64 {
        self.accumulate
    }

    /// A prepared data source handed out a new batch: the next `backward` starts a
    /// micro-step, and further ones on the same batch (two models, two losses) join it.
    pub(crate) fn mark_new_batch(&self) {
        self.lock().backwards_on_batch = Some(0);
    }

    /// A pipeline step of `micro_batches` starts: they (fetched ahead) are one accumulation
    /// window, each backward one micro-step, the last one the sync step. A short window (the
    /// end of an epoch) is the last `micro_batches` of a full one, as accumulation without a
    /// pipeline ends an epoch: the loss still divided by `accumulate`, the step at its end.
    pub(crate) fn start_window(&self, micro_batches: u64) {
        let mut s = self.lock();
        s.counters.micro_step = self.accumulate - micro_batches.min(self.accumulate);
        s.end_of_dataloader = false;
        s.backwards_on_batch = None;
    }

    /// The prepared data source ran out or was dropped: backward counts alone again.
    pub(crate) fn end_batches(&self) {
        self.lock().backwards_on_batch = None;
    }

    /// Starts a micro-step (called by `backward`): a sync step every `accumulate` steps and
    /// at the end of the data, which also restarts the window (Accelerate's `_do_sync`).
    /// With prepared data, a micro-step is a batch, as Accelerate counts them: a second
    /// backward on the same batch stays in its micro-step.
    pub(crate) fn begin_micro_step(&self) -> bool {
        let mut s = self.lock();
        if let Some(n) = &mut s.backwards_on_batch {
            *n += 1;
            if *n > 1 {
                return s.sync_gradients;
            }
        }
        s.counters.micro_steps_total += 1;
        // The previous micro-step closed a window: this one opens the next.
        if s.sync_gradients {
            s.undealt_in_window = false;
        }
        s.undealt_in_window |= s.backwards_on_batch.is_none();
        if s.end_of_dataloader {
            s.counters.micro_step = 0;
            s.sync_gradients = true;
        } else {
            s.counters.micro_step += 1;
            s.sync_gradients = s.counters.micro_step % self.accumulate == 0;
        }
        s.sync_gradients
    }

    pub(crate) fn sync_gradients(&self) -> bool {
        self.lock().sync_gradients
    }

    /// Whether a micro-step of the current window ran on batches that no prepared data
    /// source handed out.
    pub(crate) fn window_had_undealt_batches(&self) -> bool {
        self.lock().undealt_in_window
    }

    /// An autocast region was entered.
    pub(crate) fn note_autocast(&self) {
        self.lock().autocast_since_step = true;
    }

    /// Whether an autocast region was entered since the last optimizer step.
    pub(crate) fn autocast_since_step(&self) -> bool {
        self.lock().autocast_since_step
    }

    pub(crate) fn set_end_of_dataloader(&self, end: bool) {
        self.lock().end_of_dataloader = end;
    }

    pub(crate) fn end_of_dataloader(&self) -> bool {
        self.lock().end_of_dataloader
    }

    pub(crate) fn set_remainder(&self, remainder: Option<usize>) {
        self.lock().remainder = remainder;
    }

    pub(crate) fn remainder(&self) -> Option<usize> {
        self.lock().remainder
    }

    pub(crate) fn record_optimizer_step(&self, skipped: bool) {
        let mut s = self.lock();
        s.autocast_since_step = false;
        if skipped {
            s.counters.skipped_steps += 1;
        } else {
            s.counters.optimizer_steps += 1;
        }
    }

    pub(crate) fn counters(&self) -> StepCounters {
        self.lock().counters
    }

    pub(crate) fn restore(&self, counters: StepCounters) {
        let mut s = self.lock();
        s.counters = counters;
        s.sync_gradients = counters.micro_step % self.accumulate == 0;
        s.end_of_dataloader = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sync_every_n_steps_and_at_the_end_of_the_data() {
        let state = GradientState::new(3);
        let mut syncs = Vec::new();
        for step in 1..=10 {
            state.set_end_of_dataloader(step == 10);
            syncs.push(state.begin_micro_step());
        }
        // Windows 3, 3, 3 and a short last one of 1.
        assert_eq!(syncs, [false, false, true, false, false, true, false, false, true, true]);
        // The end of the data restarts the window for the next epoch.
        state.set_end_of_dataloader(false);
        assert_eq!(
            [state.begin_micro_step(), state.begin_micro_step(), state.begin_micro_step()],
            [false, false, true]
        );
    }

    #[test]
    fn backward_twice_on_one_prepared_batch_is_one_micro_step() {
        let state = GradientState::new(2);
        let mut syncs = Vec::new();
        for _batch in 0..4 {
            state.mark_new_batch();
            // A GAN's two losses: the second backward joins the first one's micro-step.
            syncs.push((state.begin_micro_step(), state.begin_micro_step()));
        }
        assert_eq!(syncs, [(false, false), (true, true), (false, false), (true, true)]);
        assert_eq!(state.counters().micro_steps_total, 4);
        // Once the data is done, each backward is a micro-step again.
        state.end_batches();
        assert_eq!([state.begin_micro_step(), state.begin_micro_step()], [false, true]);
    }
}
