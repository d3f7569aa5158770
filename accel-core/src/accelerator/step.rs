//! The step as the accelerator runs it: autocast over the forward pass, `backward` (the
//! micro-step, loss division and scaling, the strategy's hooks, the checks that a step's
//! data was dealt and ran under autocast), and the optimizer step — one sequence for every
//! optimizer, prepared ([`super::AcceleratedOptimizer`]) or driven ([`super::Driven`]), over
//! a [`StepTarget`].

use std::sync::Arc;

use tch::Tensor;

use super::Accelerator;
use crate::error::{Error, Result};
use crate::precision::{self, ToFp32};
use crate::shim::AutocastGuard;
use crate::sync::Locked;

/// What [`Accelerator::autocast`] returns: autocast for the configured precision and, in a
/// profile, the `accel::forward` range, both until dropped.
#[must_use = "autocast lasts only while the guard lives"]
#[derive(Debug)]
pub struct ForwardGuard {
    _autocast: Option<AutocastGuard>,
    _range: crate::shim::Range,
}

/// What [`Accelerator::autocast_step`] returns: autocast for the configured precision
/// until dropped.
#[must_use = "autocast lasts only while the guard lives"]
#[derive(Debug)]
pub struct StepGuard {
    _autocast: Option<AutocastGuard>,
}

impl Accelerator {
    /// Autocast for the configured precision until the guard is dropped (nothing to undo in
    /// fp32), and in a profile the `accel::forward` range.
    pub fn autocast(&self) -> Result<ForwardGuard> {
        self.inner.state.note_autocast();
        Ok(ForwardGuard {
            _autocast: precision::enter(self.inner.config.precision, self.device())?,
            _range: crate::shim::range("accel::forward"),
        })
    }

    /// Autocast for the configured precision over one training step, until dropped: what
    /// `#[accelerate]` puts at the top of a training loop's body, so that every forward pass
    /// of the step runs under it wherever it is written. [`backward`](Self::backward) and
    /// the optimizer's step switch it off while they run.
    pub fn autocast_step(&self) -> Result<StepGuard> {
        self.inner.state.note_autocast();
        Ok(StepGuard { _autocast: precision::enter(self.inner.config.precision, self.device())? })
    }

    /// Runs `forward` under autocast and casts its half-precision outputs back to fp32
    /// (as Accelerate wraps `model.forward`).
    pub fn forward<T: ToFp32>(&self, forward: impl FnOnce() -> T) -> Result<T> {
        let guard = self.autocast()?;
        let out = forward();
        drop(guard);
        Ok(if precision::autocast_kind(self.inner.config.precision).is_some() {
            out.to_fp32()
        } else {
            out
        })
    }

    /// The backward pass of one micro-batch: decides whether this is a sync step, divides
    /// the loss by `accumulate` (always, as Accelerate does), scales it for fp16 and runs
    /// autograd. A failure inside backward (a hook that panicked, say) comes back as `Err`.
    pub fn backward(&self, loss: &Tensor) -> Result<()> {
        if loss.numel() != 1 {
            return Err(Error::Training(format!(
                "backward needs a scalar loss, got shape {:?}; reduce it first (mean or sum)",
                loss.size()
            )));
        }
        if self.num_processes() > 1 && self.registry().models.is_empty() {
            return Err(Error::Training(format!(
                "backward on rank {} of {} with no prepared model: its gradients would not be \
                 averaged across processes, and each process would train a model of its own. \
                 Call `accelerator.prepare_model(&vs)` on the model's VarStore first (under \
                 #[accelerate], build the optimizer in the function over the VarStore, or name \
                 it with `model = vs`)",
                self.process_index(),
                self.num_processes()
            )));
        }
        self.inner.parallel.check_backward(self.process_index())?;
        self.check_drawn_batches(loss)?;
        // A collective that failed inside the forward (zero3's gathers in `Module::forward`).
        self.inner.strategy.take_error()?;
        let sync = self.inner.state.begin_micro_step();
        if sync {
            self.check_data_was_dealt()?;
            self.inner.parallel.check_sync_step(self.process_index())?;
        }
        self.check_autocast()?;
        // The step's autocast (`autocast_step`) stays off while autograd runs.
        let _no_autocast = precision::suspend(self.device())?;
        let n = self.inner.state.accumulate();
        let loss = if n > 1 { loss.f_div_scalar(n as f64)? } else { loss.shallow_clone() };
        let loss = match &self.inner.scaler {
            Some(scaler) => scaler.locked().scale_loss(&loss)?,
            None => loss,
        };
        let range = crate::shim::range("accel::backward");
        if let Err(e) = loss.f_backward() {
            self.inner.strategy.take_error()?;
            return Err(Error::Training(format!(
                "backward failed: {}",
                crate::error::torch_text(&e)
            )));
        }
        drop(range);
        let _range = crate::shim::range("accel::gradient_sync");
        self.inner.strategy.after_backward(&self.strategy_context(), sync)?;
        if sync {
            self.sync_buffers()?;
        }
        Ok(())
    }

    /// The net under data that was not dealt: with several data-parallel processes, a sync
    /// step whose micro-batches did not all come through a prepared iterator or loader
    /// would average the gradients of processes that may all have seen the same batches.
    fn check_data_was_dealt(&self) -> Result<()> {
        let (_, replicas) = self.data_parallel();
        if replicas < 2
            || self.inner.data == crate::config::DataSharding::Manual
            || !self.inner.state.window_had_undealt_batches()
        {
            return Ok(());
        }
        Err(Error::Training(format!(
            "backward on rank {} of {replicas} data-parallel processes, on batches that did not \
             come through a prepared data loader or iterator: nothing dealt them, so every \
             process may be training on the same batches. Prepare the data \
             (`accelerator.prepare_loader(loader)` or `accelerator.prepare_iter(batches)`; \
             under #[accelerate], loop over the batches in the annotated function), or, if each \
             process already loads its own part, say so: `.data(DataSharding::Manual)` on the \
             builder, #[accelerate(data = \"manual\")]",
            self.process_index()
        )))
    }

    /// The optimizer step, for every optimizer (prepared or driven): on accumulation steps
    /// only the strategy hears of the call; on sync steps, autocast suspended and in the
    /// profile's `accel::optimizer_step` range, the gradients prepared once
    /// ([`prepare_gradients`](Self::prepare_gradients): finalize_grads, the fp16 unscale),
    /// the overflow seen by every rank that holds part of them (and the step skipped on
    /// inf/NaN), the configured norm clipping, the optimizer's own update, the strategy's
    /// `after_step`, the schedule, and the end of the step. Returns whether it was skipped
    /// (`None` on accumulation steps).
    pub(crate) fn optimizer_step(&self, target: &mut dyn StepTarget) -> Result<Option<bool>> {
        if !self.sync_gradients() {
            target.after_step(false)?;
            return Ok(None);
        }
        let _range = crate::shim::range("accel::optimizer_step");
        // The step's autocast (`autocast_step`) stays off while the optimizer runs.
        let _no_autocast = precision::suspend(self.device())?;
        self.prepare_gradients(target)?;
        let gradients = target.gradients();
        let skipped = match &self.inner.scaler {
            Some(scaler) => {
                let mut scaler = scaler.locked();
                // Where an overflow must be seen: the shards' group, or everyone if the model
                // is split (an overflow anywhere skips the step everywhere).
                let parallel = &self.inner.parallel;
                if let Some(group) = parallel.grad_stats_group(target.gradient_group()) {
                    scaler.share_found_inf(&gradients, group.as_ref())?;
                }
                let overflow = scaler.found_inf(&gradients)?;
                scaler.update()?;
                overflow
            }
            None => false,
        };
        if !skipped {
            if let Some(max) = self.inner.config.clip_grad_norm {
                self.clip_norm(target, max)?;
            }
            target.update()?;
        }
        target.after_step(!skipped)?;
        if !skipped {
            target.schedule(self.data_parallel().1)?;
        }
        self.gradients_used(target)?;
        self.end_optimizer_step(skipped)?;
        Ok(Some(skipped))
    }

    /// Once per step and optimizer, before anything reads the gradients: what the
    /// model-parallel dimensions owe them (`finalize_grads`), then the fp16 unscale. Kept per
    /// optimizer (by its first parameter) until its step, as PyTorch's GradScaler keeps a
    /// stage per optimizer: a `clip_grad_norm` before the step prepares them once.
    pub(crate) fn prepare_gradients(&self, target: &dyn StepTarget) -> Result<()> {
        let trainable = target.trainable();
        let key = match trainable.first() {
            Some(first) => crate::shim::tensor_id(first)?,
            None => return Ok(()),
        };
        if !self.inner.prepared_gradients.locked().insert(key) {
            return Ok(());
        }
        let gradients = target.gradients();
        self.inner.parallel.finalize_grads(trainable, &gradients)?;
        if let Some(scaler) = &self.inner.scaler {
            scaler.locked().unscale(&gradients)?;
        }
        Ok(())
    }

    /// The step of `target` is over: its next step prepares its gradients again.
    fn gradients_used(&self, target: &dyn StepTarget) -> Result<()> {
        if let Some(first) = target.trainable().first() {
            let key = crate::shim::tensor_id(first)?;
            self.inner.prepared_gradients.locked().remove(&key);
        }
        Ok(())
    }

    /// Prepares the gradients (once per step) and clips their global norm to `max_norm`,
    /// each parameter counted once across the run (shards, tensor and pipeline ranks: the
    /// model-parallel dimensions know how). Returns the norm before clipping.
    pub(crate) fn clip_norm(&self, target: &dyn StepTarget, max_norm: f64) -> Result<f64> {
        self.prepare_gradients(target)?;
        let group = target.gradient_group();
        let (trainable, gradients) = (target.trainable(), target.gradients());
        self.inner.parallel.clip_grad_norm(trainable, &gradients, group.as_deref(), max_norm)
    }

    /// Prepares the gradients (once per step) and clamps every element to `[-max, max]`
    /// (elementwise, so shards clamp alone).
    pub(crate) fn clip_value(&self, target: &dyn StepTarget, max: f64) -> Result<()> {
        self.prepare_gradients(target)?;
        crate::optim::clip_grad_value(&target.gradients(), max)
    }

    /// Clears gradients on sync steps, for every optimizer: in place where the strategy needs
    /// them to stay views of its buffers (DDP's buckets), else by the optimizer's own
    /// `zero_grad` (`own`).
    pub(crate) fn zero_grads(
        &self,
        params: &[Tensor],
        own: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        if !self.sync_gradients() {
            return Ok(());
        }
        if !self.zero_grad_in_place() {
            return own();
        }
        tch::no_grad(|| -> Result<()> {
            for p in params {
                let mut grad = p.grad();
                if grad.defined() {
                    let _ = grad.f_zero_()?;
                }
            }
            Ok(())
        })
    }

    /// The safety net under a model that was never prepared, for every optimizer with
    /// several processes: its gradients would not be averaged, and the step would train
    /// this process's replica alone.
    pub(crate) fn check_membership(&self, name: &str, trainable: &[Tensor]) -> Result<()> {
        if self.num_processes() == 1 {
            return Ok(());
        }
        let strays = self.unprepared(trainable)?;
        if let Some(size) = strays.first() {
            return Err(Error::Training(format!(
                "{name} steps {} parameter(s) (the first of shape {size:?}) that belong to no \
                 model the accelerator prepared, on rank {} of {}: their gradients are not \
                 averaged across processes, so the replicas would drift apart. Call \
                 `accelerator.prepare_model(&vs)` on the model's VarStore before training \
                 (under #[accelerate], build the optimizer in the function over the VarStore, \
                 or name it with `model = vs`)",
                strays.len(),
                self.process_index(),
                self.num_processes()
            )));
        }
        Ok(())
    }

    /// The end of every optimizer step, prepared or driven: the step counted (or the skip),
    /// then, with several processes, the collective sequence check (every rank compares the
    /// collectives it issued since the last step with the others', off this thread; a
    /// divergence found earlier is returned here).
    pub(crate) fn end_optimizer_step(&self, skipped: bool) -> Result<()> {
        self.inner.state.record_optimizer_step(skipped);
        if self.num_processes() > 1 {
            self.inner.mesh.check_collectives()?;
        }
        Ok(())
    }

    /// Whether optimizers zero gradients in place instead of setting them to none: where
    /// the strategy needs them to stay views of its buffers (DDP's buckets). The one rule
    /// for prepared and driven optimizers.
    pub(crate) fn zero_grad_in_place(&self) -> bool {
        self.inner.strategy.zero_grad_in_place()
    }

    /// A pipeline step of `micro_batches` begins (one accumulation window, see
    /// `GradientState::start_window`); its backward passes are allowed until the guard drops.
    pub(crate) fn pipeline_step(
        &self,
        micro_batches: u64,
    ) -> crate::strategy::model_parallel::PipelineStep<'_> {
        self.inner.state.start_window(micro_batches);
        self.inner.parallel.pipeline_step()
    }

    /// The net under a forward pass that forgot autocast: under bf16/fp16/fp8, a backward
    /// with no autocast region since the last optimizer step is reported once (a warning:
    /// code may cast by hand).
    fn check_autocast(&self) -> Result<()> {
        use std::sync::atomic::Ordering::Relaxed;
        if precision::autocast_kind(self.inner.config.precision).is_none()
            || self.inner.state.autocast_since_step()
            || self.inner.warned_autocast.load(Relaxed)
            || crate::shim::autocast_state(self.device())?.is_some()
        {
            return Ok(());
        }
        self.inner.warned_autocast.store(true, Relaxed);
        if self.is_main_process() {
            eprintln!(
                "accel: precision is {}, but this backward's forward pass ran outside any \
                 autocast region, so it ran in fp32 (reported once). Run the forward pass \
                 through `accelerator.forward(|| ..)` or under `accelerator.autocast()`; under \
                 #[accelerate], inside the training loop",
                self.inner.config.precision
            );
        }
        Ok(())
    }

    /// Every prepared model's buffers from the first rank of their group to the others.
    pub(crate) fn sync_buffers(&self) -> Result<()> {
        for buffers in self.inner.buffers.locked().iter() {
            buffers.sync()?;
        }
        Ok(())
    }

    /// A backward pass from `output` with its gradient `grad` given (a pipeline stage's
    /// output, whose gradient the next stage computed): a micro-step as [`backward`]'s,
    /// without loss division or scaling (the gradient carries them already).
    ///
    /// [`backward`]: Self::backward
    pub(crate) fn backward_with_grad(&self, output: &Tensor, grad: &Tensor) -> Result<()> {
        self.inner.state.begin_micro_step();
        let surrogate = output.f_mul(grad)?.f_sum(tch::Kind::Float)?;
        surrogate.f_backward().map_err(|e| {
            Error::Training(format!("backward failed: {}", crate::error::torch_text(&e)))
        })?;
        let sync = self.inner.state.sync_gradients();
        self.inner.strategy.after_backward(&self.strategy_context(), sync)?;
        if sync {
            self.sync_buffers()?;
        }
        Ok(())
    }
}

/// What one optimizer step works on, for [`Accelerator::optimizer_step`]: a prepared
/// optimizer (its optimizer, the strategy's plan for it, its schedule) or one the accelerator
/// drives for a call (the program's own, whole parameters, nothing around its update).
pub(crate) trait StepTarget {
    /// The parameters as the user sees them, whole.
    fn trainable(&self) -> &[Tensor];
    /// The tensors whose gradients the step reads (this process's shards under zero2/3).
    fn gradients(&self) -> Vec<Tensor>;
    /// The group [`gradients`](Self::gradients) are split across (zero2, zero3), if they are.
    fn gradient_group(&self) -> Option<Arc<dyn crate::comm::Communicator>> {
        None
    }
    /// The optimizer's own update.
    fn update(&mut self) -> Result<()>;
    /// What the strategy does after every call (`stepped`: false on accumulation steps
    /// and skipped fp16 steps).
    fn after_step(&mut self, stepped: bool) -> Result<()> {
        let _ = stepped;
        Ok(())
    }
    /// Advances the learning-rate schedule, once per data-parallel replica (`replicas`).
    fn schedule(&mut self, replicas: usize) -> Result<()> {
        let _ = replicas;
        Ok(())
    }
}
