//! The optimizer a user gets from [`Accelerator::prepare_optimizer`]: Accelerate's
//! `AcceleratedOptimizer` and `AcceleratedScheduler` rolled into one handle.
//!
//! [`Accelerator::prepare_optimizer`]: super::Accelerator::prepare_optimizer

use std::sync::{Arc, Mutex, MutexGuard, Weak};

use tch::Tensor;

use super::step::StepTarget;
use super::{Accelerator, Inner};
use crate::error::{Error, Result};
use crate::optim::{LrScheduler, Optimizer, Schedule};
use crate::strategy::{OptimizerPlan, Replicated};
use crate::sync::Locked;

pub(crate) struct Slot {
    pub(crate) optimizer: Box<dyn Optimizer>,
    /// What the strategy does at this optimizer's steps (`None` if preparing it failed).
    pub(crate) plan: Option<Box<dyn OptimizerPlan>>,
    pub(crate) scheduler: Option<LrScheduler>,
    pub(crate) step_was_skipped: bool,
    /// A failure to set up, reported by the first step (`prepare_optimizer` cannot fail).
    deferred: Option<String>,
    /// The model's parameters as the user sees them (before any sharding): what
    /// `trainable_variables` returns.
    trainable: Vec<Tensor>,
    /// Whether the first sync step checked that every parameter belongs to a prepared model.
    membership_checked: bool,
    /// The VarStore it was built over (tch's `config.build(&vs, lr)`) and its number of
    /// trainable variables then: tch's own optimizer adds variables created later at its
    /// next step; a prepared one cannot, so a step refuses them by name.
    store: Option<(Arc<Mutex<tch::nn::Variables>>, usize)>,
    /// `optimizer_in_backward`: the strategy applies the update inside backward
    /// ([`Slot::apply_ready`]); the step applies nothing more.
    in_backward: bool,
    /// Under it, the parameters (by tensor id) updated since the last `step()`: a second
    /// gradient before it is refused, as the ordinary step would have summed the two.
    updated: std::collections::BTreeSet<usize>,
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

    /// Under `optimizer_in_backward`: the update of every parameter whose gradient is
    /// ready, those gradients then dropped (what the strategy calls inside backward).
    fn apply_ready(&mut self) -> Result<()> {
        let params = self.optimizer.params();
        let ready: Vec<(usize, &Tensor)> =
            params.iter().enumerate().filter(|(_, p)| p.grad().defined()).collect();
        if ready.is_empty() {
            return Ok(());
        }
        for &(i, p) in &ready {
            if self.updated.contains(&crate::shim::tensor_id(p)?) {
                let name = self.optimizer.param_names().swap_remove(i);
                return Err(Error::Training(format!(
                    "optimizer_in_backward: `{name}` got a second gradient before the \
                     optimizer's step(): its update is applied inside each backward, so two \
                     backward passes per step (or a step() left out) would apply two updates \
                     where the ordinary step applies one of their sum. Call step() after \
                     every backward, or set optimizer_in_backward = false"
                )));
            }
        }
        self.optimizer.prepared_step()?;
        for (_, p) in ready {
            self.updated.insert(crate::shim::tensor_id(p)?);
            crate::shim::set_grad(p, None)?;
        }
        Ok(())
    }
}

/// What the strategy calls inside backward under `optimizer_in_backward`: the update of
/// the optimizer in `slot` ([`Slot::apply_ready`]).
fn update_in_backward(slot: std::sync::Weak<Mutex<Slot>>) -> crate::strategy::UpdateInBackward {
    Arc::new(move || {
        let Some(slot) = slot.upgrade() else { return Ok(()) };
        // Never a wait: the only holder while backward runs would be this thread, in a
        // backward started from inside the optimizer's own step.
        let Ok(mut slot) = slot.try_lock() else {
            return Err(Error::Training(
                "optimizer_in_backward: the optimizer was busy when backward applied its \
                 update (a backward run from inside its step?)"
                    .into(),
            ));
        };
        slot.apply_ready()
    })
}

/// A prepared optimizer's part in the step sequence (`Accelerator::optimizer_step`): its
/// optimizer's update, the strategy's plan around it, its schedule.
impl StepTarget for Slot {
    fn trainable(&self) -> &[Tensor] {
        &self.trainable
    }

    /// The strategy decides: under zero1 every parameter, under zero2/zero3 this process's
    /// shards.
    fn gradients(&self) -> Vec<Tensor> {
        self.plan().gradients(self.optimizer.as_ref())
    }

    fn gradient_group(&self) -> Option<Arc<dyn crate::comm::Communicator>> {
        self.plan().gradient_group()
    }

    fn update(&mut self) -> Result<()> {
        if self.in_backward {
            // Applied inside backward already; whatever is left (nothing, normally).
            self.apply_ready()?;
            self.updated.clear();
            return Ok(());
        }
        self.optimizer.prepared_step()
    }

    fn after_step(&mut self, stepped: bool) -> Result<()> {
        match &mut self.plan {
            Some(plan) => plan.after_step(self.optimizer.as_mut(), stepped),
            None => Ok(()),
        }
    }

    fn schedule(&mut self, replicas: usize) -> Result<()> {
        let Some(scheduler) = &mut self.scheduler else { return Ok(()) };
        for _ in 0..replicas {
            // One-cycle refuses to go past its end; Accelerate stops stepping it there.
            if let Schedule::OneCycle { total_steps, .. } = scheduler.state().schedule {
                if scheduler.steps() >= total_steps {
                    break;
                }
            }
            scheduler.step(self.optimizer.as_mut())?;
        }
        Ok(())
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
    /// The accelerator whose step sequence this optimizer follows (weak: the accelerator's
    /// registry holds this optimizer).
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
            deferred,
            trainable,
            membership_checked: false,
            store: None,
            in_backward: false,
            updated: Default::default(),
        };
        let slot = Arc::new(Mutex::new(slot));
        {
            let update = update_in_backward(Arc::downgrade(&slot));
            let mut guard = slot.locked();
            let slot = &mut *guard;
            if let Some(plan) = &mut slot.plan {
                match plan.update_in_backward(&update) {
                    Ok(on) => slot.in_backward = on,
                    Err(e) => slot.deferred = Some(e.to_string()),
                }
            }
        }
        Self { slot, accelerator: Arc::downgrade(inner) }
    }

    /// Remembers that this optimizer was built over every trainable variable of `vs` as it
    /// is now (what tch's `OptimizerConfig::build` does), so that a step refuses variables
    /// created since, which tch's optimizer would have added.
    pub(crate) fn built_over(&self, vs: &tch::nn::VarStore) {
        let count = vs.variables_.locked().trainable_variables.len();
        self.lock().store = Some((vs.variables_.clone(), count));
    }

    fn accelerator(&self) -> Result<Accelerator> {
        self.accelerator.upgrade().map(|inner| Accelerator { inner }).ok_or_else(|| {
            Error::Training(
                "the accelerator this optimizer was prepared by has been dropped: keep it while \
                 the optimizer steps"
                    .into(),
            )
        })
    }

    /// Whether the gradients the step reads are split across processes (zero2, zero3).
    pub fn is_sharded(&self) -> bool {
        self.lock().plan().gradient_group().is_some()
    }

    fn lock(&self) -> MutexGuard<'_, Slot> {
        self.slot.locked()
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
        let accelerator = self.accelerator()?;
        if !accelerator.sync_gradients() {
            return Ok(());
        }
        let slot = self.lock();
        refuse_clipping(&slot, "clip_grad_value")?;
        accelerator.clip_value(&*slot, max)
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
        let accelerator = self.accelerator()?;
        if !accelerator.sync_gradients() {
            return Ok(0.0);
        }
        let slot = self.lock();
        refuse_clipping(&slot, "clip_grad_norm")?;
        accelerator.clip_norm(&*slot, max_norm)
    }

    /// The optimizer step (on sync steps only), by the accelerator's one step sequence
    /// (`Accelerator::optimizer_step`); the strategy hears of every call.
    pub fn step(&mut self) -> Result<()> {
        let accelerator = self.accelerator()?;
        let mut slot = self.lock();
        if let Some((variables, built)) = &slot.store {
            grown_since_built(&variables.locked(), *built)?;
        }
        if accelerator.sync_gradients() {
            if let Some(why) = &slot.deferred {
                return Err(crate::Error::Unsupported(why.clone()));
            }
            if !slot.membership_checked {
                accelerator.check_membership(slot.optimizer.name(), &slot.trainable)?;
                slot.membership_checked = true;
            }
        }
        if let Some(skipped) = accelerator.optimizer_step(&mut *slot)? {
            slot.step_was_skipped = skipped;
        }
        Ok(())
    }

    /// Clears gradients, on sync steps only: sets them to none, or, where the strategy
    /// needs it (DDP), zeroes them in place so that they stay views of the all-reduce buckets.
    pub fn zero_grad(&mut self) -> Result<()> {
        let accelerator = self.accelerator()?;
        let mut slot = self.lock();
        if !slot.updated.is_empty() {
            // The gradients this would throw away were applied inside backward already.
            return Err(Error::Training(
                "optimizer_in_backward: zero_grad() after a backward but before the optimizer's \
                 step(): that backward's gradients were applied inside it already, so they \
                 cannot be thrown away (code that discards gradients, such as a GAN's \
                 discriminator stepping on the generator's loss, needs the ordinary step: set \
                 optimizer_in_backward = false)"
                    .into(),
            ));
        }
        let gradients = slot.gradients();
        accelerator.zero_grads(&gradients, || slot.optimizer.zero_grad())
    }
}

/// Clipping after backward under `optimizer_in_backward`, where the gradients were applied
/// and dropped inside it: an error instead of a clip of nothing.
fn refuse_clipping(slot: &Slot, what: &str) -> Result<()> {
    if !slot.in_backward {
        return Ok(());
    }
    Err(Error::Config(format!(
        "{what} after backward under optimizer_in_backward: each gradient was applied and \
         dropped inside backward, so there is nothing left to clip. Leave out the clipping, or \
         set optimizer_in_backward = false"
    )))
}

/// An error naming the trainable variables `variables` gained after an optimizer was built
/// over its first `built` ones.
fn grown_since_built(variables: &tch::nn::Variables, built: usize) -> Result<()> {
    let later = &variables.trainable_variables;
    if later.len() <= built {
        return Ok(());
    }
    let mut names: Vec<&str> = later[built..]
        .iter()
        .filter_map(|v| {
            // By identity: a released zero3 parameter has no data pointer to compare.
            let id = crate::shim::tensor_id(&v.tensor).ok()?;
            variables
                .named_variables
                .iter()
                .find(|(_, t)| crate::shim::tensor_id(t).ok() == Some(id))
                .map(|(n, _)| n.as_str())
        })
        .collect();
    names.sort_unstable();
    Err(Error::Config(format!(
        "{} trainable variable(s) were created after the optimizer was built ({}): tch's own \
         optimizer adds them at its next step, but accel prepared the model and its optimizer \
         when the optimizer was built, so they would not train and the processes would not \
         keep them equal. Build the optimizer after the model (`config.build(&vs, lr)` once \
         every layer exists)",
        later.len() - built,
        names.join(", ")
    )))
}
