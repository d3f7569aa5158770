//! Optimizers the accelerator drives without owning them: one kept in a struct field or
//! passed in by reference, which `#[accelerate(model = ...)]` cannot replace where it is
//! made. Each call (`accelerator.drive(&mut self.opt).step()`) follows the accelerator's
//! rules (sync steps, fp16 unscaling and skipped steps, clipping), as a prepared optimizer's
//! would.

use tch::Tensor;

use super::step::StepTarget;
use super::{AcceleratedOptimizer, Accelerator};
use crate::error::{Error, Result};
use crate::optim::Optimizer;

/// What [`Accelerator::drive`] needs of an optimizer it does not own: tch's
/// `nn::Optimizer`, any of accel's [`Optimizer`]s, or an [`AcceleratedOptimizer`] (whose own
/// methods are used as they are).
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not an optimizer the accelerator can drive",
    note = "the optimizers are tch's nn::Optimizer, any accel_core::optim::Optimizer and an \
            AcceleratedOptimizer"
)]
pub trait DriveOptimizer {
    /// `Some` for an optimizer the accelerator already prepared (it keeps its own rules).
    fn prepared(&mut self) -> Option<&mut AcceleratedOptimizer> {
        None
    }
    /// A short name for messages.
    fn name(&self) -> &'static str;
    /// The parameters, whole.
    fn params(&self) -> Vec<Tensor>;
    /// The optimizer's own step.
    fn raw_step(&mut self) -> Result<()>;
    /// The optimizer's own `zero_grad`.
    fn raw_zero_grad(&mut self) -> Result<()>;
    /// Number of parameter groups (for setting every group).
    fn groups(&self) -> usize;
    /// Sets every group's learning rate.
    fn set_lr_all(&mut self, lr: f64) {
        for g in 0..self.groups() {
            self.set_lr_group(g, lr);
        }
    }
    /// Sets every group's momentum.
    fn set_momentum_all(&mut self, momentum: f64) {
        for g in 0..self.groups() {
            self.set_momentum_group(g, momentum);
        }
    }
    /// Sets every group's weight decay.
    fn set_weight_decay_all(&mut self, weight_decay: f64) {
        for g in 0..self.groups() {
            self.set_weight_decay_group(g, weight_decay);
        }
    }
    /// Sets a group's learning rate.
    fn set_lr_group(&mut self, group: usize, lr: f64);
    /// Sets a group's momentum.
    fn set_momentum_group(&mut self, group: usize, momentum: f64);
    /// Sets a group's weight decay.
    fn set_weight_decay_group(&mut self, group: usize, weight_decay: f64);
}

impl DriveOptimizer for tch::nn::Optimizer {
    fn name(&self) -> &'static str {
        "tch::nn::Optimizer"
    }
    fn params(&self) -> Vec<Tensor> {
        self.trainable_variables()
    }
    fn raw_step(&mut self) -> Result<()> {
        self.step();
        Ok(())
    }
    fn raw_zero_grad(&mut self) -> Result<()> {
        self.zero_grad();
        Ok(())
    }
    // tch does not say how many groups it has; its own setters reach all of them.
    fn groups(&self) -> usize {
        1
    }
    fn set_lr_all(&mut self, lr: f64) {
        tch::nn::Optimizer::set_lr(self, lr)
    }
    fn set_momentum_all(&mut self, momentum: f64) {
        tch::nn::Optimizer::set_momentum(self, momentum)
    }
    fn set_weight_decay_all(&mut self, weight_decay: f64) {
        tch::nn::Optimizer::set_weight_decay(self, weight_decay)
    }
    fn set_lr_group(&mut self, group: usize, lr: f64) {
        tch::nn::Optimizer::set_lr_group(self, group, lr)
    }
    fn set_momentum_group(&mut self, group: usize, momentum: f64) {
        tch::nn::Optimizer::set_momentum_group(self, group, momentum)
    }
    fn set_weight_decay_group(&mut self, group: usize, weight_decay: f64) {
        tch::nn::Optimizer::set_weight_decay_group(self, group, weight_decay)
    }
}

impl<O: Optimizer> DriveOptimizer for O {
    fn name(&self) -> &'static str {
        Optimizer::name(self)
    }
    fn params(&self) -> Vec<Tensor> {
        Optimizer::params(self)
    }
    fn raw_step(&mut self) -> Result<()> {
        Optimizer::prepared_step(self)
    }
    fn raw_zero_grad(&mut self) -> Result<()> {
        Optimizer::zero_grad(self)
    }
    fn groups(&self) -> usize {
        self.num_groups()
    }
    fn set_lr_group(&mut self, group: usize, lr: f64) {
        self.set_lr(group, lr)
    }
    fn set_momentum_group(&mut self, group: usize, momentum: f64) {
        self.set_momentum(group, momentum)
    }
    fn set_weight_decay_group(&mut self, group: usize, weight_decay: f64) {
        self.set_weight_decay(group, weight_decay)
    }
}

impl DriveOptimizer for AcceleratedOptimizer {
    fn prepared(&mut self) -> Option<&mut AcceleratedOptimizer> {
        Some(self)
    }
    fn name(&self) -> &'static str {
        "AcceleratedOptimizer"
    }
    fn params(&self) -> Vec<Tensor> {
        self.trainable_variables()
    }
    fn raw_step(&mut self) -> Result<()> {
        self.step()
    }
    fn raw_zero_grad(&mut self) -> Result<()> {
        self.zero_grad()
    }
    fn groups(&self) -> usize {
        self.lrs().len()
    }
    fn set_lr_group(&mut self, group: usize, lr: f64) {
        AcceleratedOptimizer::set_lr_group(self, group, lr)
    }
    fn set_momentum_group(&mut self, group: usize, momentum: f64) {
        AcceleratedOptimizer::set_momentum_group(self, group, momentum)
    }
    fn set_weight_decay_group(&mut self, group: usize, weight_decay: f64) {
        AcceleratedOptimizer::set_weight_decay_group(self, group, weight_decay)
    }
}

/// An optimizer driven by the accelerator for one call; see [`Accelerator::drive`]. The
/// methods are tch's `nn::Optimizer` API with the accelerator's meaning.
#[derive(Debug)]
pub struct Driven<'a, O: DriveOptimizer> {
    accelerator: &'a Accelerator,
    optimizer: &'a mut O,
}

impl Accelerator {
    /// Drives `optimizer`, which the accelerator does not own (a struct field, a `&mut`
    /// argument), through one call of tch's optimizer API with the accelerator's rules:
    /// what `self.opt.step()` becomes under `#[accelerate(model = self.vs)]`. The model must
    /// be prepared (the attribute does it before the training loop); its optimizer state
    /// cannot be sharded, so zero2/zero3 refuse it.
    pub fn drive<'a, O: DriveOptimizer>(&'a self, optimizer: &'a mut O) -> Driven<'a, O> {
        Driven { accelerator: self, optimizer }
    }
}

/// A driven optimizer's part in the step sequence (`Accelerator::optimizer_step`, the one
/// prepared optimizers follow): its own update over whole parameters, nothing around it.
struct Target<'a, O: DriveOptimizer> {
    optimizer: &'a mut O,
    params: Vec<Tensor>,
}

impl<O: DriveOptimizer> StepTarget for Target<'_, O> {
    fn trainable(&self) -> &[Tensor] {
        &self.params
    }

    fn gradients(&self) -> Vec<Tensor> {
        self.params.iter().map(Tensor::shallow_clone).collect()
    }

    fn update(&mut self) -> Result<()> {
        self.optimizer.raw_step()
    }
}

impl<O: DriveOptimizer> Driven<'_, O> {
    fn sync(&self) -> bool {
        self.accelerator.sync_gradients()
    }

    fn refuse_shards(&self) -> Result<()> {
        let strategy = self.accelerator.strategy();
        if self.accelerator.inner.parallel.splits_model() {
            return Err(Error::Unsupported(format!(
                "{} is kept outside the #[accelerate] function, and driving it does not support \
                 tensor or pipeline parallelism ({}): build the optimizer in the function",
                self.optimizer.name(),
                self.accelerator.mesh().dims()
            )));
        }
        if self.accelerator.config().optimizer_in_backward {
            return Err(Error::Unsupported(format!(
                "{} is kept outside the #[accelerate] function (a field or an argument), so its \
                 update cannot be applied inside backward (optimizer_in_backward = true): build \
                 the optimizer in the function, or set optimizer_in_backward = false",
                self.optimizer.name()
            )));
        }
        if !strategy.steps_whole_parameters() {
            return Err(Error::Unsupported(format!(
                "{} is kept outside the #[accelerate] function (a field or an argument), so it \
                 cannot be given this process's parameter shards ({}): build the optimizer in \
                 the function, or use strategy ddp or zero1",
                self.optimizer.name(),
                strategy.name()
            )));
        }
        Ok(())
    }

    /// Clears gradients on sync steps (in place with several processes, so that they stay
    /// views of DDP's buckets).
    pub fn zero_grad(self) -> Result<()> {
        if let Some(prepared) = self.optimizer.prepared() {
            return prepared.zero_grad();
        }
        let params = self.optimizer.params();
        self.accelerator.zero_grads(&params, || self.optimizer.raw_zero_grad())
    }

    /// The optimizer for one pass of the step sequence.
    fn target(&mut self) -> Target<'_, O> {
        let params = self.optimizer.params();
        Target { optimizer: &mut *self.optimizer, params }
    }

    /// The optimizer step on sync steps, by the accelerator's one step sequence (as a
    /// prepared optimizer's): gradients finalized and fp16-unscaled once, a step with
    /// inf/NaN gradients skipped, the configured norm clipping, then the optimizer's own step.
    pub fn step(mut self) -> Result<()> {
        if let Some(prepared) = self.optimizer.prepared() {
            return prepared.step();
        }
        let (acc, name, sync) = (self.accelerator, self.optimizer.name(), self.sync());
        if sync {
            self.refuse_shards()?;
        }
        let mut target = self.target();
        if sync {
            acc.check_membership(name, target.trainable())?;
        }
        acc.optimizer_step(&mut target).map(|_| ())
    }

    /// Unscales and clips the global gradient norm to `max`; returns the norm before (0 on
    /// accumulation steps).
    pub fn clip_grad_norm(mut self, max: f64) -> Result<f64> {
        if let Some(prepared) = self.optimizer.prepared() {
            return prepared.clip_grad_norm(max);
        }
        if !self.sync() {
            return Ok(0.0);
        }
        let acc = self.accelerator;
        acc.clip_norm(&self.target(), max)
    }

    /// Unscales and clamps every gradient element to `[-max, max]`.
    pub fn clip_grad_value(mut self, max: f64) -> Result<()> {
        if let Some(prepared) = self.optimizer.prepared() {
            return prepared.clip_grad_value(max);
        }
        if !self.sync() {
            return Ok(());
        }
        let acc = self.accelerator;
        acc.clip_value(&self.target(), max)
    }

    /// `zero_grad`, the accelerator's `backward`, `step`.
    pub fn backward_step(self, loss: &Tensor) -> Result<()> {
        let (acc, opt) = (self.accelerator, self.optimizer);
        acc.drive(&mut *opt).zero_grad()?;
        acc.backward(loss)?;
        acc.drive(opt).step()
    }

    /// As [`backward_step`](Self::backward_step), clamping gradient values to `max` first.
    pub fn backward_step_clip(self, loss: &Tensor, max: f64) -> Result<()> {
        let (acc, opt) = (self.accelerator, self.optimizer);
        acc.drive(&mut *opt).zero_grad()?;
        acc.backward(loss)?;
        acc.drive(&mut *opt).clip_grad_value(max)?;
        acc.drive(opt).step()
    }

    /// As [`backward_step`](Self::backward_step), clipping the gradient norm to `max` first.
    pub fn backward_step_clip_norm(self, loss: &Tensor, max: f64) -> Result<()> {
        let (acc, opt) = (self.accelerator, self.optimizer);
        acc.drive(&mut *opt).zero_grad()?;
        acc.backward(loss)?;
        acc.drive(&mut *opt).clip_grad_norm(max)?;
        acc.drive(opt).step()
    }

    /// Sets the learning rate of every group.
    pub fn set_lr(self, lr: f64) {
        self.optimizer.set_lr_all(lr)
    }
    /// Sets the learning rate of one group.
    pub fn set_lr_group(self, group: usize, lr: f64) {
        self.optimizer.set_lr_group(group, lr)
    }
    /// Sets the momentum of every group.
    pub fn set_momentum(self, momentum: f64) {
        self.optimizer.set_momentum_all(momentum)
    }
    /// Sets the momentum of one group.
    pub fn set_momentum_group(self, group: usize, momentum: f64) {
        self.optimizer.set_momentum_group(group, momentum)
    }
    /// Sets the weight decay of every group.
    pub fn set_weight_decay(self, weight_decay: f64) {
        self.optimizer.set_weight_decay_all(weight_decay)
    }
    /// Sets the weight decay of one group.
    pub fn set_weight_decay_group(self, group: usize, weight_decay: f64) {
        self.optimizer.set_weight_decay_group(group, weight_decay)
    }
    /// The parameters the optimizer trains.
    pub fn trainable_variables(self) -> Vec<Tensor> {
        self.optimizer.params()
    }
}

/// An optimizer kept as the program made it (tch's `nn::Optimizer`), lent for one call to a
/// function `#[accelerate]` cannot see into (`apply_schedule(&mut opt, epoch)`): see
/// [`Accelerator::lend`].
#[must_use = "`returned` checks what the function did with the optimizer"]
#[derive(Debug)]
pub struct Lent {
    accelerator: Accelerator,
    /// "`apply_schedule(..)` at src/main.rs:40".
    call: String,
    params: Vec<Tensor>,
    versions: Vec<i64>,
}

impl Accelerator {
    /// Prepares the model in `vs` (once) for an optimizer that stays the program's own
    /// because the body lends it to functions the attribute cannot see into: its calls in
    /// the body are driven ([`drive`](Self::drive)) and each lending is checked
    /// ([`lend`](Self::lend)). Refused where such an optimizer cannot follow the strategy
    /// (its state would have to hold this process's shards).
    pub fn keep_optimizer<O: DriveOptimizer>(
        &self,
        vs: &tch::nn::VarStore,
        optimizer: O,
    ) -> Result<O> {
        // tch's own `zero_grad` (in a helper) detaches gradients, which it cannot do to
        // views of DDP's buckets.
        let mut options = self.inner.model_options;
        options.ddp.gradient_as_bucket_view = false;
        self.prepare_model_once_with(vs, options)?;
        let strategy = self.strategy();
        if self.inner.parallel.splits_model() || !strategy.steps_whole_parameters() {
            return Err(Error::Unsupported(format!(
                "the optimizer ({}) is passed to a function #[accelerate] cannot see into, so it \
                 stays the program's own, which cannot hold this process's shards of the model \
                 under strategy {} ({}): pass that function what it needs (the learning rate) \
                 instead of the optimizer, or use strategy ddp or zero1",
                optimizer.name(),
                strategy.name(),
                self.mesh().dims()
            )));
        }
        Ok(optimizer)
    }

    /// Lends `optimizer` to one call of a function the attribute cannot see into (`what`,
    /// e.g. "`apply_schedule(..)`"): [`Lent::returned`] then checks what it did. A function
    /// that only sets the learning rate is fine; one that steps the optimizer itself is
    /// correct only where nothing has to happen around a step (gradients averaged in
    /// backward, no loss scaling, no accumulation, no clipping) and refused otherwise.
    #[track_caller]
    pub fn lend<O: DriveOptimizer>(&self, optimizer: &O, what: &str) -> Result<Lent> {
        let at = crate::comm::ledger::site_of(std::panic::Location::caller());
        let params = optimizer.params();
        let versions = params.iter().map(crate::shim::tensor_version).collect::<Result<_>>()?;
        Ok(Lent { accelerator: self.clone(), call: format!("{what} at {at}"), params, versions })
    }
}

impl Lent {
    /// The function returned: if it stepped the optimizer (its parameters changed), the
    /// step is counted where it was correct, and refused, saying why, where it was not.
    pub fn returned(self) -> Result<()> {
        let now =
            self.params.iter().map(crate::shim::tensor_version).collect::<Result<Vec<_>>>()?;
        if now == self.versions {
            return Ok(());
        }
        let acc = &self.accelerator;
        let config = &acc.inner.config;
        let mut needs = Vec::new();
        if acc.inner.scaler.is_some() {
            needs.push("fp16's loss scaling (unscale, skip steps with inf/NaN)".to_owned());
        }
        if config.accumulate > 1 {
            needs.push(format!("gradient accumulation (accumulate = {})", config.accumulate));
        }
        if let Some(max) = config.clip_grad_norm {
            needs.push(format!("clipping (clip_grad_norm = {max})"));
        }
        if config.optimizer_in_backward {
            needs.push("the update inside backward (optimizer_in_backward)".to_owned());
        }
        if !needs.is_empty() {
            return Err(Error::Training(format!(
                "{} stepped the optimizer itself (its parameters changed during the call), on \
                 rank {}; under {} a step must go through the accelerator. Step the optimizer in \
                 the training loop (`opt.step()`, which #[accelerate] makes the accelerator's) \
                 and leave the function the rest (setting the learning rate, say)",
                self.call,
                acc.process_index(),
                needs.join(" and ")
            )));
        }
        if acc.num_processes() > 1 && !acc.unprepared(&self.params)?.is_empty() {
            return Err(Error::Training(format!(
                "{} stepped an optimizer over parameters of no prepared model, on rank {}: their \
                 gradients are not averaged across processes",
                self.call,
                acc.process_index()
            )));
        }
        // Gradients were averaged in backward; the step was the one the accelerator would
        // have taken. Count it (and run the step's checks).
        acc.end_optimizer_step(false)
    }
}
