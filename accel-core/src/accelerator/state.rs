//! Gradient accumulation bookkeeping shared by the accelerator, its optimizers and its data:
//! Accelerate's `GradientState` and `_do_sync`.

use std::sync::Mutex;

use serde::{Deserialize, Serialize};

/// The counters a checkpoint keeps.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepCounters {
    /// Micro-steps since the last sync step (Accelerate's `accelerator.step`).
    pub micro_step: u64,
    /// `backward` calls in the whole run.
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
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn accumulate(&self) -> u64 {
        self.accumulate
    }

    /// Starts a micro-step (called by `backward`): a sync step every `accumulate` steps and
    /// at the end of the data, which also restarts the window (Accelerate's `_do_sync`).
    pub(crate) fn begin_micro_step(&self) -> bool {
        let mut s = self.lock();
        s.counters.micro_steps_total += 1;
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
}
