//! The optimizer a user gets from [`Accelerator::prepare_optimizer`]: Accelerate's
//! `AcceleratedOptimizer` and `AcceleratedScheduler` rolled into one handle.
//!
//! [`Accelerator::prepare_optimizer`]: super::Accelerator::prepare_optimizer

use std::sync::{Arc, Mutex, MutexGuard};

use tch::Tensor;

use super::state::GradientState;
use crate::error::Result;
use crate::optim::{LrScheduler, Optimizer, Schedule, clip_grad_norm};
use crate::precision::GradScaler;

pub(crate) struct Slot {
    pub(crate) optimizer: Box<dyn Optimizer>,
    pub(crate) scheduler: Option<LrScheduler>,
    pub(crate) step_was_skipped: bool,
    /// Gradients already unscaled (and maybe clipped) in this step.
    unscaled: bool,
}

/// An optimizer whose `step`, `zero_grad` and learning-rate schedule follow the
/// accelerator: they act only on sync steps of gradient accumulation; fp16 gradients are
/// unscaled and checked first, and a step with inf/NaN gradients is skipped (and the
/// schedule not advanced); `clip_grad_norm` from the config is applied before each step.
/// The schedule advances once per process per real optimizer step, as Accelerate's does.
#[derive(Clone)]
pub struct AcceleratedOptimizer {
    pub(crate) slot: Arc<Mutex<Slot>>,
    state: Arc<GradientState>,
    scaler: Option<Arc<Mutex<GradScaler>>>,
    clip: Option<f64>,
    num_processes: usize,
}

impl std::fmt::Debug for AcceleratedOptimizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let slot = self.lock();
        f.debug_struct("AcceleratedOptimizer")
            .field("optimizer", &slot.optimizer.name())
            .field("scheduler", &slot.scheduler)
            .finish_non_exhaustive()
    }
}

impl AcceleratedOptimizer {
    pub(crate) fn new(
        optimizer: Box<dyn Optimizer>,
        state: Arc<GradientState>,
        scaler: Option<Arc<Mutex<GradScaler>>>,
        clip: Option<f64>,
        num_processes: usize,
    ) -> Self {
        let slot = Slot { optimizer, scheduler: None, step_was_skipped: false, unscaled: false };
        Self { slot: Arc::new(Mutex::new(slot)), state, scaler, clip, num_processes }
    }

    fn lock(&self) -> MutexGuard<'_, Slot> {
        self.slot.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Drives the learning rate with `schedule` from now on (applies its step 0 now).
    pub fn set_schedule(&mut self, schedule: Schedule) -> Result<()> {
        let mut slot = self.lock();
        let scheduler = LrScheduler::new(schedule, slot.optimizer.as_mut())?;
        slot.scheduler = Some(scheduler);
        Ok(())
    }

    /// Learning rate of the first parameter group.
    pub fn lr(&self) -> f64 {
        self.lock().optimizer.lr(0)
    }

    /// Learning rates of all groups.
    pub fn lrs(&self) -> Vec<f64> {
        let slot = self.lock();
        (0..slot.optimizer.num_groups()).map(|g| slot.optimizer.lr(g)).collect()
    }

    /// Sets the learning rate of every group (as tch's `Optimizer::set_lr`).
    pub fn set_lr(&mut self, lr: f64) {
        let mut slot = self.lock();
        for g in 0..slot.optimizer.num_groups() {
            slot.optimizer.set_lr(g, lr);
        }
    }

    /// Whether the last sync step was skipped because of inf/NaN gradients (fp16).
    pub fn step_was_skipped(&self) -> bool {
        self.lock().step_was_skipped
    }

    /// The parameters, for inspection.
    pub fn params(&self) -> Vec<Tensor> {
        self.lock().optimizer.params()
    }

    /// Unscales fp16 gradients (once per step) and clips their global norm to `max_norm`;
    /// returns the norm before clipping. Call between `backward` and `step` for a norm
    /// other than the configured one; does nothing (returns 0) on accumulation steps.
    pub fn clip_grad_norm(&mut self, max_norm: f64) -> Result<f64> {
        if !self.state.sync_gradients() {
            return Ok(0.0);
        }
        let mut slot = self.lock();
        self.unscale(&mut slot)?;
        clip_grad_norm(&slot.optimizer.params(), max_norm)
    }

    fn unscale(&self, slot: &mut Slot) -> Result<()> {
        if let (Some(scaler), false) = (&self.scaler, slot.unscaled) {
            scaler.lock().unwrap_or_else(|e| e.into_inner()).unscale(&slot.optimizer.params())?;
        }
        slot.unscaled = true;
        Ok(())
    }

    /// The optimizer step (on sync steps only).
    pub fn step(&mut self) -> Result<()> {
        if !self.state.sync_gradients() {
            return Ok(());
        }
        let mut slot = self.lock();
        self.unscale(&mut slot)?;
        let params = slot.optimizer.params();
        let skipped = match &self.scaler {
            Some(scaler) => {
                let mut scaler = scaler.lock().unwrap_or_else(|e| e.into_inner());
                let overflow = scaler.found_inf(&params)?;
                scaler.update()?;
                overflow
            }
            None => false,
        };
        if !skipped {
            if let Some(max) = self.clip {
                clip_grad_norm(&params, max)?;
            }
            slot.optimizer.step()?;
            let Slot { optimizer, scheduler, .. } = &mut *slot;
            if let Some(scheduler) = scheduler {
                for _ in 0..self.num_processes {
                    // One-cycle refuses to go past its end; Accelerate stops stepping it there.
                    if let Schedule::OneCycle { total_steps, .. } = scheduler.state().schedule {
                        if scheduler.steps() >= total_steps {
                            break;
                        }
                    }
                    scheduler.step(optimizer.as_mut())?;
                }
            }
        }
        slot.step_was_skipped = skipped;
        slot.unscaled = false;
        self.state.record_optimizer_step(skipped);
        Ok(())
    }

    /// Clears gradients, on sync steps only: sets them to none, or, with several processes
    /// (DDP), zeroes them in place so that they stay views of the all-reduce buckets.
    pub fn zero_grad(&mut self) -> Result<()> {
        if !self.state.sync_gradients() {
            return Ok(());
        }
        let mut slot = self.lock();
        if self.num_processes > 1 {
            tch::no_grad(|| -> Result<()> {
                for p in slot.optimizer.params() {
                    let mut grad = p.grad();
                    if grad.defined() {
                        let _ = grad.f_zero_()?;
                    }
                }
                Ok(())
            })
        } else {
            slot.optimizer.zero_grad()
        }
    }
}
