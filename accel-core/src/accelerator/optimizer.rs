//! The optimizer a user gets from [`Accelerator::prepare_optimizer`]: Accelerate's
//! `AcceleratedOptimizer` and `AcceleratedScheduler` rolled into one handle.
//!
//! [`Accelerator::prepare_optimizer`]: super::Accelerator::prepare_optimizer

use std::sync::{Arc, Mutex, MutexGuard, Weak};

use tch::Tensor;

use super::{Accelerator, Inner};
use crate::accumulation::GradientState;
use crate::error::{Error, Result};
use crate::optim::{LrScheduler, Optimizer, Schedule, clip_grad_value};
use crate::precision::GradScaler;
use crate::strategy::{OptimizerPlan, Replicated};

pub(crate) struct Slot {
    pub(crate) optimizer: Box<dyn Optimizer>,
    /// What the strategy does at this optimizer's steps (`None` if preparing it failed).
    pub(crate) plan: Option<Box<dyn OptimizerPlan>>,
    pub(crate) scheduler: Option<LrScheduler>,
    pub(crate) step_was_skipped: bool,
    /// Gradients already unscaled (and maybe clipped) in this step.
    unscaled: bool,
    /// A failure to set up, reported by the first step (`prepare_optimizer` cannot fail).
    deferred: Option<String>,
    /// The model's parameters as the user sees them (before any sharding): what
    /// `trainable_variables` returns.
    trainable: Vec<Tensor>,
    /// Whether the first sync step checked that every parameter belongs to a prepared model.
    membership_checked: bool,
}

impl Slot {
    /// The model's parameters by the optimizer's names for them (for a shard, the whole
    /// parameter it is a shard of).
    pub(crate) fn named_trainable(&self) -> std::collections::BTreeMap<String, Tensor> {
        let names = self.optimizer.param_names();
        names.into_iter().zip(self.trainable.iter().map(Tensor::shallow_clone)).collect()
    }

    /// The strategy's plan (a failed one was reported at the first step already).
    pub(crate) fn plan(&self) -> &dyn OptimizerPlan {
        self.plan.as_deref().unwrap_or(&Replicated)
    }
}

/// An optimizer whose `step`, `zero_grad` and learning-rate schedule follow the
/// accelerator: they act only on sync steps of gradient accumulation; fp16 gradients are
/// unscaled and checked first, and a step with inf/NaN gradients is skipped (and the
/// schedule not advanced); `clip_grad_norm` from the config is applied before each step.
/// The schedule advances once per data-parallel replica per real optimizer step, as
/// Accelerate's does (once per process: its processes are all data-parallel).
#[derive(Clone)]
pub struct AcceleratedOptimizer {
    pub(crate) slot: Arc<Mutex<Slot>>,
    state: Arc<GradientState>,
    scaler: Option<Arc<Mutex<GradScaler>>>,
    clip: Option<f64>,
    num_processes: usize,
    /// Data-parallel replicas: each sees 1/replicas of an epoch, so the schedule advances
    /// this many times per step (tensor and pipeline ranks share one replica's batches).
    data_replicas: usize,
    /// For `backward_step*` (weak: the accelerator's registry holds this optimizer).
    accelerator: Weak<Inner>,
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
    pub(crate) fn new(mut optimizer: Box<dyn Optimizer>, accelerator: &Accelerator) -> Self {
        let inner = &accelerator.inner;
        let trainable = optimizer.params();
        let (plan, deferred) = match inner
            .strategy
            .prepare_optimizer(&accelerator.strategy_context(), optimizer.as_mut())
        {
            Ok(plan) => (Some(plan), None),
            Err(e) => (None, Some(e.to_string())),
        };
        let slot = Slot {
            optimizer,
            plan,
            scheduler: None,
            step_was_skipped: false,
            unscaled: false,
            deferred,
            trainable,
            membership_checked: false,
        };
        Self {
            slot: Arc::new(Mutex::new(slot)),
            state: inner.state.clone(),
            scaler: inner.scaler.clone(),
            clip: inner.config.clip_grad_norm,
            num_processes: inner.process.world_size,
            data_replicas: inner.mesh.dims().size(crate::mesh::Dim::Batch),
            accelerator: Arc::downgrade(inner),
        }
    }

    fn accelerator(&self) -> Result<Accelerator> {
        self.accelerator.upgrade().map(|inner| Accelerator { inner }).ok_or_else(|| {
            Error::Training(
                "backward_step: the accelerator this optimizer was prepared by has been dropped"
                    .into(),
            )
        })
    }

    /// The tensors whose gradients the step reads (the strategy decides: under zero1 every
    /// parameter, under zero2/zero3 this process's shards).
    fn gradients(&self, slot: &Slot) -> Vec<Tensor> {
        slot.plan().gradients(slot.optimizer.as_ref())
    }

    /// Whether the gradients the step reads are split across processes (zero2, zero3).
    pub fn is_sharded(&self) -> bool {
        self.lock().plan().gradient_group().is_some()
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

    /// Sets the learning rate of group `group` (tch's `set_lr_group`).
    pub fn set_lr_group(&mut self, group: usize, lr: f64) {
        self.lock().optimizer.set_lr(group, lr);
    }

    /// Sets the momentum of every group: SGD's momentum, Adam's `beta1` (tch's `set_momentum`).
    pub fn set_momentum(&mut self, momentum: f64) {
        let mut slot = self.lock();
        for g in 0..slot.optimizer.num_groups() {
            slot.optimizer.set_momentum(g, momentum);
        }
    }

    /// Sets the momentum of group `group` (tch's `set_momentum_group`).
    pub fn set_momentum_group(&mut self, group: usize, momentum: f64) {
        self.lock().optimizer.set_momentum(group, momentum);
    }

    /// Sets the weight decay of every group (tch's `set_weight_decay`).
    pub fn set_weight_decay(&mut self, weight_decay: f64) {
        let mut slot = self.lock();
        for g in 0..slot.optimizer.num_groups() {
            slot.optimizer.set_weight_decay(g, weight_decay);
        }
    }

    /// Sets the weight decay of group `group` (tch's `set_weight_decay_group`).
    pub fn set_weight_decay_group(&mut self, group: usize, weight_decay: f64) {
        self.lock().optimizer.set_weight_decay(group, weight_decay);
    }

    /// The model's parameters this optimizer trains, whole (tch's `trainable_variables`;
    /// under zero2/zero3 these are the model's parameters, not this process's shards).
    pub fn trainable_variables(&self) -> Vec<Tensor> {
        self.lock().trainable.iter().map(Tensor::shallow_clone).collect()
    }

    /// tch's `backward_step`: `zero_grad`, the accelerator's `backward`, `step`.
    pub fn backward_step(&mut self, loss: &Tensor) -> Result<()> {
        self.zero_grad()?;
        self.accelerator()?.backward(loss)?;
        self.step()
    }

    /// tch's `backward_step_clip`: as [`backward_step`](Self::backward_step), with every
    /// gradient element clamped to `[-max, max]` before the step.
    pub fn backward_step_clip(&mut self, loss: &Tensor, max: f64) -> Result<()> {
        self.zero_grad()?;
        self.accelerator()?.backward(loss)?;
        self.clip_grad_value(max)?;
        self.step()
    }

    /// tch's `backward_step_clip_norm`: as [`backward_step`](Self::backward_step), with the
    /// global gradient norm (across processes and shards) clipped to `max` before the step.
    pub fn backward_step_clip_norm(&mut self, loss: &Tensor, max: f64) -> Result<()> {
        self.zero_grad()?;
        self.accelerator()?.backward(loss)?;
        self.clip_grad_norm(max)?;
        self.step()
    }

    /// Clamps every gradient element to `[-max, max]` (tch's `clip_grad_value`), after
    /// unscaling fp16 gradients; on sync steps only, like [`clip_grad_norm`](Self::clip_grad_norm).
    /// Elementwise, so shards clamp alone.
    pub fn clip_grad_value(&mut self, max: f64) -> Result<()> {
        if !self.state.sync_gradients() {
            return Ok(());
        }
        let mut slot = self.lock();
        self.unscale(&mut slot)?;
        clip_grad_value(&self.gradients(&slot), max)
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
        self.clip(&slot, &self.gradients(&slot), max_norm)
    }

    /// Clips the global gradient norm, each parameter counted once across the run (the
    /// model-parallel dimensions know how: `ModelParallel::clip_grad_norm`).
    fn clip(&self, slot: &Slot, grads: &[Tensor], max_norm: f64) -> Result<f64> {
        let group = slot.plan().gradient_group();
        let parallel = &self.accelerator()?.inner.parallel;
        parallel.clip_grad_norm(&slot.trainable, grads, group.as_deref(), max_norm)
    }

    /// Once per step, before anything reads the gradients: what the model-parallel
    /// dimensions owe them (`finalize_grads`), then the fp16 unscale.
    fn unscale(&self, slot: &mut Slot) -> Result<()> {
        if slot.unscaled {
            return Ok(());
        }
        let grads = self.gradients(slot);
        self.accelerator()?.inner.parallel.finalize_grads(&slot.trainable, &grads)?;
        if let Some(scaler) = &self.scaler {
            scaler.lock().unwrap_or_else(|e| e.into_inner()).unscale(&grads)?;
        }
        slot.unscaled = true;
        Ok(())
    }

    /// The optimizer step (on sync steps only); the strategy hears of every call.
    pub fn step(&mut self) -> Result<()> {
        let mut slot = self.lock();
        if !self.state.sync_gradients() {
            let Slot { optimizer, plan, .. } = &mut *slot;
            if let Some(plan) = plan {
                plan.after_step(optimizer.as_mut(), false)?;
            }
            return Ok(());
        }
        if let Some(why) = &slot.deferred {
            return Err(crate::Error::Unsupported(why.clone()));
        }
        let _range = crate::shim::range("accel::optimizer_step");
        // The step's autocast (`autocast_step`) stays off while the optimizer runs.
        let _no_autocast = crate::precision::suspend(self.accelerator()?.device())?;
        if !slot.membership_checked && self.num_processes > 1 {
            self.check_membership(&slot)?;
            slot.membership_checked = true;
        }
        self.unscale(&mut slot)?;
        let params = self.gradients(&slot);
        let skipped = match &self.scaler {
            Some(scaler) => {
                let mut scaler = scaler.lock().unwrap_or_else(|e| e.into_inner());
                let parallel = &self.accelerator()?.inner.parallel;
                // Where an overflow must be seen: the shards' group, or everyone if the model
                // is split (an overflow anywhere skips the step everywhere).
                if let Some(group) = parallel.grad_stats_group(slot.plan().gradient_group()) {
                    scaler.share_found_inf(&params, group.as_ref())?;
                }
                let overflow = scaler.found_inf(&params)?;
                scaler.update()?;
                overflow
            }
            None => false,
        };
        if !skipped {
            if let Some(max) = self.clip {
                self.clip(&slot, &params, max)?;
            }
            slot.optimizer.prepared_step()?;
        }
        {
            let Slot { optimizer, plan, .. } = &mut *slot;
            if let Some(plan) = plan {
                plan.after_step(optimizer.as_mut(), !skipped)?;
            }
        }
        if !skipped {
            let Slot { optimizer, scheduler, .. } = &mut *slot;
            if let Some(scheduler) = scheduler {
                for _ in 0..self.data_replicas {
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
        self.accelerator()?.end_optimizer_step(skipped)
    }

    /// The safety net under a model that was never prepared: its gradients would not be
    /// averaged, and this step would train this process's replica alone.
    fn check_membership(&self, slot: &Slot) -> Result<()> {
        let accelerator = self.accelerator()?;
        let strays = accelerator.unprepared(&slot.trainable)?;
        if let Some(size) = strays.first() {
            return Err(Error::Training(format!(
                "{} steps {} parameter(s) (the first of shape {size:?}) that belong to no model \
                 the accelerator prepared, on rank {} of {}: their gradients are not averaged \
                 across processes, so the replicas would drift apart. Call \
                 `accelerator.prepare_model(&vs)` on the model's VarStore before training (under \
                 #[accelerate], build the optimizer in the function over the VarStore, or name \
                 it with `model = vs`)",
                slot.optimizer.name(),
                strays.len(),
                accelerator.process_index(),
                self.num_processes
            )));
        }
        Ok(())
    }

    /// Clears gradients, on sync steps only: sets them to none, or, where the strategy
    /// needs it (DDP), zeroes them in place so that they stay views of the all-reduce buckets.
    pub fn zero_grad(&mut self) -> Result<()> {
        if !self.state.sync_gradients() {
            return Ok(());
        }
        let in_place = self.accelerator()?.zero_grad_in_place();
        let mut slot = self.lock();
        if in_place {
            tch::no_grad(|| -> Result<()> {
                for p in self.gradients(&slot) {
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
