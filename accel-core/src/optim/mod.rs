//! Optimizers whose state we own (so checkpoints and, later, sharding can reach it), learning
//! rate schedules, and gradient clipping — each equal to its `torch.optim` counterpart.
//!
//! - [`Sgd`] (momentum, dampening, Nesterov, weight decay), [`Adam`] and [`AdamW`]
//!   (optionally ATen's fused kernel) implement [`Optimizer`];
//! - [`TchOptimizer`] puts tch's own `nn::Optimizer` behind it too, minus state export: it
//!   trains, but a checkpoint of it is refused with an error (tch cannot read its state);
//! - [`LrScheduler`] drives any of them through the [`Optimizer`] trait;
//! - [`clip_grad_norm`] is `torch.nn.utils.clip_grad_norm_`.

mod adam;
mod schedule;
mod sgd;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};

pub use adam::{Adam, AdamConfig, AdamW};
pub use schedule::{LrScheduler, Schedule, SchedulerState};
pub use sgd::{Sgd, SgdConfig};

/// A parameter and the name it is saved under.
#[derive(Debug)]
pub struct Param {
    /// Its name in the model, e.g. `layers.0.weight`.
    pub name: String,
    /// The parameter (a leaf that requires grad).
    pub tensor: Tensor,
}

impl Clone for Param {
    fn clone(&self) -> Self {
        Self { name: self.name.clone(), tensor: self.tensor.shallow_clone() }
    }
}

/// Every variable of a `VarStore`, sorted by name (its map has no stable order, and every
/// rank must agree on one).
pub fn sorted_variables(vs: &tch::nn::VarStore) -> Vec<Param> {
    let mut params: Vec<Param> =
        vs.variables().into_iter().map(|(name, tensor)| Param { name, tensor }).collect();
    params.sort_by(|a, b| a.name.cmp(&b.name));
    params
}

/// The trainable variables of a `VarStore`, sorted by name.
pub fn named_params(vs: &tch::nn::VarStore) -> Vec<Param> {
    sorted_variables(vs).into_iter().filter(|p| p.tensor.requires_grad()).collect()
}

/// Names `param.{i}` for parameters given without names.
pub fn unnamed_params(tensors: &[Tensor]) -> Vec<Param> {
    tensors
        .iter()
        .enumerate()
        .map(|(i, t)| Param { name: format!("param.{i}"), tensor: t.shallow_clone() })
        .collect()
}

/// A group of parameters sharing hyper-parameters `H` (torch's `param_groups`).
#[derive(Debug, Clone)]
pub struct ParamGroup<H> {
    /// The parameters.
    pub params: Vec<Param>,
    /// Their hyper-parameters.
    pub hyper: H,
}

/// Everything an optimizer must restore to continue bit-identically.
#[derive(Debug, Default)]
pub struct OptimizerState {
    /// State tensors, keyed `{param name}/{slot}` (e.g. `layers.0.weight/exp_avg`).
    pub tensors: BTreeMap<String, Tensor>,
    /// Hyper-parameters per group, in the optimizer's serde form.
    pub groups: serde_json::Value,
}

/// What [`crate::optim`]'s optimizers and the scheduler need from an optimizer.
pub trait Optimizer: Send {
    /// A short name for messages, e.g. `AdamW`.
    fn name(&self) -> &'static str;
    /// One update from the parameters' current `.grad` (parameters without one are skipped).
    fn step(&mut self) -> Result<()>;
    /// The update as the accelerator takes it, once it has reduced, unscaled and clipped
    /// the gradients. accel's optimizers make [`step`](Optimizer::step) this behind a check
    /// that refuses a direct step in a multi-process run (the optimizer was not prepared);
    /// an optimizer without such a check keeps this default. A wrapper of another optimizer
    /// forwards both methods to it.
    fn prepared_step(&mut self) -> Result<()> {
        self.step()
    }
    /// Every parameter, in group order (shallow clones).
    fn params(&self) -> Vec<Tensor>;
    /// The names its state is saved under, in [`Optimizer::params`] order.
    fn param_names(&self) -> Vec<String> {
        (0..self.params().len()).map(|i| format!("param.{i}")).collect()
    }
    /// Clears the gradients (`zero_grad(set_to_none=True)`, torch's default).
    fn zero_grad(&mut self) -> Result<()> {
        for p in self.params() {
            crate::shim::set_grad(&p, None)?;
        }
        Ok(())
    }
    /// Number of parameter groups.
    fn num_groups(&self) -> usize;
    /// Learning rate of group `group`.
    fn lr(&self, group: usize) -> f64;
    /// Sets the learning rate of group `group`.
    fn set_lr(&mut self, group: usize, lr: f64);
    /// The momentum a one-cycle schedule cycles: SGD's `momentum`, Adam's `beta1`.
    fn momentum(&self, group: usize) -> Option<f64>;
    /// Sets that momentum.
    fn set_momentum(&mut self, group: usize, momentum: f64);
    /// Sets the weight decay of group `group` (SGD's and Adam's L2 penalty, AdamW's
    /// decoupled decay).
    fn set_weight_decay(&mut self, group: usize, weight_decay: f64);
    /// Exports the state (a copy; the optimizer keeps going).
    fn state(&self) -> Result<OptimizerState>;
    /// Restores a state from [`Optimizer::state`] of an optimizer over the same parameters.
    fn load_state(&mut self, state: &OptimizerState) -> Result<()>;
    /// Checks that [`load_state`](Optimizer::load_state) would accept `state`, changing
    /// nothing: `load_state` of a checkpoint calls it for every optimizer before it changes
    /// any weight. The default accepts everything (the load itself still checks).
    fn check_state(&self, state: &OptimizerState) -> Result<()> {
        let _ = state;
        Ok(())
    }
    /// [`load_state`](Optimizer::load_state) of a state handed over: an optimizer may keep
    /// its tensors instead of copying them (what loading a checkpoint calls, so that the
    /// state read and the state kept are never both in memory). Copies by default.
    fn take_state(&mut self, state: OptimizerState) -> Result<()> {
        self.load_state(&state)
    }
    /// Keeps only the parameters whose index (in [`Optimizer::params`] order) `keep`
    /// accepts, with their state: how ZeRO stage 1 gives each process its share.
    fn retain(&mut self, keep: &dyn Fn(usize) -> bool) -> Result<()> {
        let _ = keep;
        Err(Error::Unsupported(format!(
            "{} cannot be sharded across processes (zero1): build accel's own instead, e.g. \
             `accel_core::optim::AdamW::new(accelerator.params(&vs), AdamConfig::adamw())?` \
             (or Sgd/Adam); under #[accelerate], tch's nn::Sgd/Adam/AdamW configs become these",
            self.name()
        )))
    }
    /// This optimizer prepared by `preparer` (the accelerator) over the model in `vs`,
    /// which is prepared first, once: what `#[accelerate]` makes of `AdamW::new(..)` (a
    /// method, so that the user's import of this trait stays in use).
    fn into_prepared<P: Preparer>(self, preparer: &P, vs: &tch::nn::VarStore) -> Result<P::Prepared>
    where
        Self: Sized + 'static,
    {
        preparer.prepare_boxed(vs, Box::new(self))
    }
    /// Puts `replace(p)` in place of every parameter `p` (before the first step): how
    /// zero2/zero3 make the optimizer step each process's parameter shards.
    fn replace_params(&mut self, replace: &dyn Fn(&Tensor) -> Result<Tensor>) -> Result<()> {
        let _ = replace;
        Err(Error::Unsupported(format!(
            "{} cannot step parameter shards (zero2/zero3/fsdp): build accel's own instead, e.g. \
             `accel_core::optim::AdamW::new(accelerator.params(&vs), AdamConfig::adamw())?` \
             (or Sgd/Adam); under #[accelerate], tch's nn::Sgd/Adam/AdamW configs become these",
            self.name()
        )))
    }
}

/// What prepares optimizers for a model: the accelerator.
pub trait Preparer {
    /// The prepared optimizer.
    type Prepared;
    /// Prepares the model in `vs` (once) and `optimizer` over it.
    fn prepare_boxed(
        &self,
        vs: &tch::nn::VarStore,
        optimizer: Box<dyn Optimizer>,
    ) -> Result<Self::Prepared>;
}

/// The rank and size of the multi-process run this process belongs to, as the first
/// accelerator of a launched run found them: what the check below needs to know. Like
/// torch's default process group, a fact about the process, set once (a one-shot cache;
/// later accelerators of the same run find the same).
static RUN: std::sync::OnceLock<(usize, usize)> = std::sync::OnceLock::new();

/// Records that this process is rank `rank` of `world` (called when an accelerator is built).
pub(crate) fn note_run(rank: usize, world: usize) {
    let _ = RUN.set((rank, world));
}

/// The safety net under forgetting `prepare_optimizer`, in [`Optimizer::step`] of accel's
/// optimizers (the accelerator calls [`Optimizer::prepared_step`]): with several processes,
/// an optimizer stepped directly would apply this process's gradients alone, skip
/// accumulation and loss scaling, and let the replicas drift apart without a word. That
/// is an error instead.
pub(crate) fn guard_unprepared_step(name: &str) -> Result<()> {
    let (rank, world) = RUN.get().copied().unwrap_or((0, 0));
    match world {
        world if world > 1 => Err(Error::Training(format!(
            "{name}.step() was called directly on rank {} of {}: this optimizer was not prepared \
             by the accelerator, so its step would ignore accumulation and loss scaling, and \
             under zero1/zero2/zero3 the shards. Wrap it with \
             `accelerator.prepare_optimizer(optimizer)` (after `prepare_model`) and step that",
            rank, world
        ))),
        _ => Ok(()),
    }
}

/// Replaces every parameter tensor of `groups` by `replace(tensor)`; refused once any
/// state exists (it belongs to the old tensors).
pub(crate) fn replace_params<H, S>(
    name: &str,
    groups: &mut [ParamGroup<H>],
    states: &[Option<S>],
    replace: &dyn Fn(&Tensor) -> Result<Tensor>,
) -> Result<()> {
    if states.iter().any(Option::is_some) {
        return Err(Error::Unsupported(format!(
            "{name} has stepped already; prepare it before its first step so that zero2/zero3 \
             can give it the parameter shards"
        )));
    }
    for param in groups.iter_mut().flat_map(|g| &mut g.params) {
        param.tensor = replace(&param.tensor)?;
    }
    Ok(())
}

/// Keeps the entries of `groups` (and the per-parameter `states`, in the same flat order)
/// whose flat index `keep` accepts.
pub(crate) fn retain_params<H, S>(
    groups: &mut [ParamGroup<H>],
    states: &mut Vec<S>,
    keep: &dyn Fn(usize) -> bool,
) {
    let mut index = 0;
    let mut kept_states = Vec::new();
    let mut old_states = std::mem::take(states).into_iter();
    for group in groups.iter_mut() {
        let params = std::mem::take(&mut group.params);
        for param in params {
            let state = old_states.next().expect("one state per parameter");
            if keep(index) {
                group.params.push(param);
                kept_states.push(state);
            }
            index += 1;
        }
    }
    *states = kept_states;
}

/// Global-norm gradient clipping, as `torch.nn.utils.clip_grad_norm_(params, max_norm)`:
/// returns the total L2 norm before clipping; scales every gradient by
/// `min(1, max_norm / (norm + 1e-6))`.
pub fn clip_grad_norm(params: &[Tensor], max_norm: f64) -> Result<f64> {
    let grads: Vec<Tensor> = params.iter().map(|p| p.grad()).filter(Tensor::defined).collect();
    if grads.is_empty() {
        return Ok(0.0);
    }
    let norms: Vec<Tensor> = grads.iter().map(|g| g.f_norm()).collect::<Result<_, _>>()?;
    let total = Tensor::f_stack(&norms, 0)?.f_norm()?;
    let coef = (max_norm / (&total + 1e-6)).f_clamp_max(1.0)?;
    tch::no_grad(|| -> Result<()> {
        for g in &grads {
            let mut g = g.shallow_clone();
            let _ = g.f_mul_(&coef)?;
        }
        Ok(())
    })?;
    Ok(total.f_double_value(&[])?)
}

/// Clamps every gradient element to `[-max, max]`, as `torch.nn.utils.clip_grad_value_`.
pub fn clip_grad_value(params: &[Tensor], max: f64) -> Result<()> {
    tch::no_grad(|| -> Result<()> {
        for p in params {
            let mut grad = p.grad();
            if grad.defined() {
                let _ = grad.f_clamp_(-max, max)?;
            }
        }
        Ok(())
    })
}

/// [`clip_grad_norm`] over gradients sharded across `group`: the norm is of all ranks'
/// shards together, and every rank scales its own by the same factor.
pub fn clip_grad_norm_sharded(
    params: &[Tensor],
    max_norm: f64,
    group: &dyn crate::comm::Communicator,
) -> Result<f64> {
    let grads: Vec<Tensor> = params.iter().map(|p| p.grad()).filter(Tensor::defined).collect();
    // On the gradients' device (NCCL reduces device memory); one host read at the end.
    let device = params.first().map_or(tch::Device::Cpu, Tensor::device);
    let mut squares = Tensor::f_zeros([1], (tch::Kind::Double, device))?;
    for g in &grads {
        let n = g.f_norm()?.f_to_kind(tch::Kind::Double)?.f_to_device(device)?;
        squares = squares.f_add(&n.f_square()?)?;
    }
    group.all_reduce(&squares, crate::comm::ReduceOp::Sum)?;
    let total = squares.f_sqrt()?.f_double_value(&[0])?;
    let coef = (max_norm / (total + 1e-6)).min(1.0);
    tch::no_grad(|| -> Result<()> {
        for g in &grads {
            let _ = g.shallow_clone().f_mul_scalar_(coef)?;
        }
        Ok(())
    })?;
    Ok(total)
}

/// Saved state tensors as an optimizer takes them back: each checked for the shape its slot
/// must have, then copied (from a state the caller keeps: [`Optimizer::load_state`]), moved
/// (from one handed over, [`Optimizer::take_state`]: a state read from a checkpoint becomes
/// the optimizer's without a second copy in memory), or only checked
/// ([`Optimizer::check_state`], which allocates nothing).
pub(crate) enum Restore<'a> {
    Check(&'a BTreeMap<String, Tensor>),
    Copy(&'a BTreeMap<String, Tensor>),
    Take(BTreeMap<String, Tensor>),
}

impl Restore<'_> {
    fn tensors(&self) -> &BTreeMap<String, Tensor> {
        match self {
            Restore::Check(t) | Restore::Copy(t) => t,
            Restore::Take(t) => t,
        }
    }

    /// Whether the state has tensor `key`.
    pub(crate) fn has(&self, key: &str) -> bool {
        self.tensors().contains_key(key)
    }

    /// Saved tensor `key` as the slot `like` (its shape, dtype and device) keeps it; an
    /// undefined tensor when only checking.
    pub(crate) fn slot(
        &mut self,
        optimizer: &'static str,
        key: &str,
        shape: &[i64],
        like: (Kind, Device),
    ) -> Result<Tensor> {
        let saved = self.tensors().get(key).ok_or_else(|| Error::Checkpoint {
            path: None,
            message: format!("{optimizer} state has no tensor `{key}`"),
        })?;
        if saved.size() != shape {
            return Err(Error::Checkpoint {
                path: None,
                message: format!(
                    "{optimizer} state tensor `{key}` has shape {:?}, the optimizer expects \
                     {shape:?}",
                    saved.size(),
                ),
            });
        }
        let (kind, device) = like;
        Ok(match self {
            Restore::Check(_) => Tensor::new(),
            Restore::Copy(_) => {
                tch::no_grad(|| saved.f_to_device(device)?.f_to_kind(kind)?.f_detach_copy())?
            }
            Restore::Take(tensors) => {
                let saved = tensors.remove(key).expect("found above");
                if saved.kind() == kind && saved.device() == device && saved.is_contiguous() {
                    saved.f_detach()?
                } else {
                    tch::no_grad(|| saved.f_to_device(device)?.f_to_kind(kind)?.f_contiguous())?
                }
            }
        })
    }
}

/// Reads the serde form of hyper-parameters back.
pub(crate) fn groups_from_json<H: for<'de> Deserialize<'de>>(
    optimizer: &'static str,
    value: &serde_json::Value,
    expected: usize,
) -> Result<Vec<H>> {
    let groups: Vec<H> = serde_json::from_value(value.clone()).map_err(|e| Error::Checkpoint {
        path: None,
        message: format!("{optimizer} hyper-parameters do not parse: {e}"),
    })?;
    if groups.len() != expected {
        return Err(Error::Checkpoint {
            path: None,
            message: format!(
                "{optimizer} state has {} parameter groups, the optimizer has {expected}",
                groups.len()
            ),
        });
    }
    Ok(groups)
}

pub(crate) fn groups_to_json<H: Serialize>(groups: &[&H]) -> serde_json::Value {
    serde_json::to_value(groups).unwrap_or(serde_json::Value::Null)
}

/// tch's own optimizer behind the [`Optimizer`] trait. Steps, zero_grad and learning rates
/// work; exporting its state does not (tch cannot read it), so a checkpoint that includes it
/// is refused with an error. Use [`Sgd`], [`Adam`] or [`AdamW`] where state must be saved.
pub struct TchOptimizer {
    inner: tch::nn::Optimizer,
    lrs: Vec<f64>,
    momenta: Vec<Option<f64>>,
}

impl std::fmt::Debug for TchOptimizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TchOptimizer").field("lrs", &self.lrs).finish_non_exhaustive()
    }
}

impl TchOptimizer {
    /// Wraps `optimizer`, built with learning rate `lr` (tch cannot report it back).
    pub fn new(optimizer: tch::nn::Optimizer, lr: f64) -> Self {
        Self { inner: optimizer, lrs: vec![lr], momenta: vec![None] }
    }

    /// Wraps `optimizer` built elsewhere with a learning rate nobody told us: [`Optimizer::lr`]
    /// reports NaN until [`Optimizer::set_lr`] sets one (schedules refuse to start from it).
    pub fn adopted(optimizer: tch::nn::Optimizer) -> Self {
        Self::new(optimizer, f64::NAN)
    }
}

impl Optimizer for TchOptimizer {
    fn name(&self) -> &'static str {
        "tch::nn::Optimizer"
    }
    fn step(&mut self) -> Result<()> {
        self.inner.step();
        Ok(())
    }
    fn params(&self) -> Vec<Tensor> {
        self.inner.trainable_variables()
    }
    fn zero_grad(&mut self) -> Result<()> {
        self.inner.zero_grad();
        Ok(())
    }
    fn num_groups(&self) -> usize {
        self.lrs.len()
    }
    fn lr(&self, group: usize) -> f64 {
        self.lrs[group]
    }
    fn set_lr(&mut self, group: usize, lr: f64) {
        self.inner.set_lr_group(group, lr);
        self.lrs[group] = lr;
    }
    fn momentum(&self, group: usize) -> Option<f64> {
        self.momenta[group]
    }
    fn set_momentum(&mut self, group: usize, momentum: f64) {
        self.inner.set_momentum_group(group, momentum);
        self.momenta[group] = Some(momentum);
    }
    fn set_weight_decay(&mut self, group: usize, weight_decay: f64) {
        self.inner.set_weight_decay_group(group, weight_decay);
    }
    fn state(&self) -> Result<OptimizerState> {
        Err(Error::Unsupported(
            "tch's nn::Optimizer cannot export its state, so it cannot be checkpointed; use \
             accel_core::optim::{Sgd, Adam, AdamW} instead"
                .into(),
        ))
    }
    fn load_state(&mut self, _state: &OptimizerState) -> Result<()> {
        self.state().map(|_| ())
    }
    fn check_state(&self, _state: &OptimizerState) -> Result<()> {
        self.state().map(|_| ())
    }
}
