//! [`Unit`]: a module whose parameters zero3 gathers just before its use and releases right
//! after. Each unit owns a handle that the sharded model binds when it is prepared; the
//! unit reaches its model through that handle.
//!
//! A unit is made for an accelerator (as FSDP2's `fully_shard(module, mesh=...)` names its
//! mesh) and waits in that accelerator's [`PendingUnits`] until the accelerator prepares the
//! model whose variables it holds. Preparing a model, under any strategy, tells the pending
//! units under its names whether the accelerator checkpoints activations; zero3 then takes
//! them and binds them. Nothing is process-wide or per thread: two accelerators (ranks run
//! as threads in tests) keep their units apart.

use std::sync::{Arc, Mutex, OnceLock, Weak};

use tch::Tensor;
use tch::nn::Module;

use super::engine::ShardedModel;
use crate::error::{Error, Result};
use crate::shim;
use crate::sync::Locked;

/// A unit's link to the sharded model that holds its parameters, set when the model is
/// prepared.
#[derive(Debug)]
pub(crate) struct UnitHandle {
    pub prefix: String,
    /// Made by `#[accelerate]` around a layer of an `nn::seq()` rather than by the user: it
    /// yields to the size-based policy, and two of one name are left unbound, not an error.
    pub automatic: bool,
    binding: OnceLock<(Weak<ShardedModel>, usize)>,
    /// Activation checkpointing, as the unit's accelerator has it when it first prepares the
    /// unit's model (off until then; under every strategy, not only zero3).
    checkpointing: OnceLock<bool>,
}

impl UnitHandle {
    /// Ties the unit to unit number `unit` of `model`.
    pub fn bind(&self, model: &Arc<ShardedModel>, unit: usize) {
        let _ = self.binding.set((Arc::downgrade(model), unit));
    }

    fn model(&self) -> Option<(Arc<ShardedModel>, usize)> {
        let (model, unit) = self.binding.get()?;
        Some((model.upgrade()?, *unit))
    }
}

/// Whether a unit of prefix `prefix` belongs to a model with variables `names`.
pub(crate) fn in_model<'a>(names: &'a [&'a str]) -> impl Fn(&str) -> bool + 'a {
    move |prefix| names.iter().any(|n| n.starts_with(prefix) && n[prefix.len()..].starts_with('.'))
}

/// The [`Unit`]s made for an accelerator whose models it has not prepared yet. Every
/// [`Accelerator`](crate::Accelerator) has one (`Unit::new(&accelerator, ..)` reaches it
/// through `AsRef`). A model built with no accelerator at all (a raw loop) gives its units
/// `&PendingUnits::default()`: they are never bound and run their module unchanged. A unit
/// made for one accelerator and prepared by another is not bound either (no error: it is
/// the module unchanged, gathered with the root under zero3).
#[derive(Debug, Default)]
pub struct PendingUnits {
    units: Mutex<Vec<Weak<UnitHandle>>>,
}

impl AsRef<PendingUnits> for PendingUnits {
    fn as_ref(&self) -> &PendingUnits {
        self
    }
}

impl PendingUnits {
    /// The live pending handles (units dropped meanwhile leave the list).
    fn live(&self) -> std::sync::MutexGuard<'_, Vec<Weak<UnitHandle>>> {
        let mut units = self.units.locked();
        units.retain(|h| h.strong_count() > 0);
        units
    }

    /// Tells the pending units whose prefix `matches` (the model being prepared) whether
    /// activation checkpointing is on, unless an earlier prepare told them; they stay
    /// pending, for zero3 to bind.
    pub(crate) fn set_checkpointing(&self, matches: impl Fn(&str) -> bool, on: bool) {
        for handle in self.live().iter().filter_map(Weak::upgrade) {
            if matches(&handle.prefix) {
                let _ = handle.checkpointing.set(on);
            }
        }
    }

    /// The pending units whose prefix `matches`, taken out of the list. Two pending units
    /// with one prefix cannot be told apart: an error — unless the attribute made them, which
    /// then stay unbound (their modules run unchanged), as does an automatic one beside one
    /// the user made.
    pub(crate) fn take(&self, matches: impl Fn(&str) -> bool) -> Result<Vec<Arc<UnitHandle>>> {
        let mut pending = self.live();
        let (mine, rest): (Vec<_>, Vec<_>) = std::mem::take(&mut *pending)
            .into_iter()
            .partition(|h| h.upgrade().is_some_and(|h| matches(&h.prefix)));
        *pending = rest;
        let mine: Vec<Arc<UnitHandle>> = mine.iter().filter_map(Weak::upgrade).collect();
        let shared = |h: &Arc<UnitHandle>| mine.iter().filter(|o| o.prefix == h.prefix).count() > 1;
        let mine: Vec<Arc<UnitHandle>> =
            mine.iter().filter(|h| !(h.automatic && shared(h))).cloned().collect();
        for (i, a) in mine.iter().enumerate() {
            if let Some(b) = mine[..i].iter().find(|b| b.prefix == a.prefix) {
                return Err(Error::Config(format!(
                    "two units named `{}` wait to be prepared ({:p} and {:p}), and accel cannot \
                     tell which model each belongs to: prepare each model before building the \
                     next, make them for different accelerators, or give their VarStore paths \
                     different names",
                    a.prefix,
                    Arc::as_ptr(a),
                    Arc::as_ptr(b)
                )));
            }
        }
        Ok(mine)
    }

    fn push(&self, handle: &Arc<UnitHandle>) {
        self.live().push(Arc::downgrade(handle));
    }
}

/// Marks `inner`, the module built under `path`, as a unit of a sharded model. Under
/// zero3 its parameters live as shards and are gathered just before its forward and freed
/// after it, gathered again just before its backward and freed after it. Under every
/// other strategy it is `inner` unchanged.
///
/// Every use of the unit's parameters must go through [`Unit::forward`] or
/// [`Unit::run`]: outside them, under zero3, their memory is released.
#[derive(Debug)]
pub struct Unit<M> {
    handle: Arc<UnitHandle>,
    /// Shared with the recomputation of a checkpointed forward pass.
    inner: Shared<M>,
}

/// The module, shared by the unit and the recomputation of its checkpointed forward passes.
#[derive(Debug)]
struct Shared<M>(Arc<M>);

impl<M> Shared<M> {
    fn get(&self) -> &M {
        &self.0
    }
}

// SAFETY: the recomputation reads the module on autograd's thread while the thread that
// ran the forward pass waits inside `backward` for it, and nothing else reads the module
// meanwhile; the module is `Send`, and the `Arc` keeps it alive as long as the graph needs
// it (a module dropped before its backward would otherwise be read after being freed).
unsafe impl<M: Send> Send for Shared<M> {}

impl<M> Unit<M> {
    /// Wraps `inner`, whose variables live under `path`, for `accelerator`, which prepares
    /// the model after this (FSDP2's `fully_shard(module, mesh=...)`).
    pub fn new(accelerator: &impl AsRef<PendingUnits>, path: &tch::nn::Path, inner: M) -> Self {
        let prefix = path.components().collect::<Vec<_>>().join(".");
        Self::named(accelerator, prefix, inner, false)
    }

    /// The unit of the variables under `prefix`; `automatic` for one `#[accelerate]` made
    /// around a layer by itself (see `UnitHandle::automatic`).
    pub(crate) fn named(
        accelerator: &impl AsRef<PendingUnits>,
        prefix: String,
        inner: M,
        automatic: bool,
    ) -> Self {
        let handle = Arc::new(UnitHandle {
            prefix,
            automatic,
            binding: OnceLock::new(),
            checkpointing: OnceLock::new(),
        });
        accelerator.as_ref().push(&handle);
        Self { handle, inner: Shared(Arc::new(inner)) }
    }

    /// The wrapped module.
    pub fn inner(&self) -> &M {
        self.inner.get()
    }

    /// The variable-name prefix of the unit.
    pub fn prefix(&self) -> &str {
        &self.handle.prefix
    }

    /// Runs `forward` on the wrapped module with its parameters gathered; an error if
    /// gathering or releasing them fails (a peer died or timed out).
    pub fn try_run(&self, forward: impl FnOnce(&M) -> Tensor) -> Result<Tensor> {
        let Some((model, unit)) = self.handle.model() else { return Ok(forward(self.inner.get())) };
        model.before_forward(unit)?;
        let out = forward(self.inner.get());
        model.after_forward(unit, &out, true)?;
        Ok(out)
    }

    /// [`try_run`](Self::try_run) for `Module::forward`, which cannot return an error: a
    /// failure (a peer died or timed out) is kept, and returned by the next accelerator call
    /// (`backward`, the optimizer step, a gather); the forward still completes, on zeros
    /// instead of the parameters, with no further collective.
    pub fn run(&self, forward: impl FnOnce(&M) -> Tensor) -> Tensor {
        self.run_reading(forward, true)
    }

    /// [`run`](Self::run); `backward_reads_parameters` false for a forward whose backward
    /// reads none of the unit's parameters, which zero3 then does not gather again for it.
    fn run_reading(
        &self,
        forward: impl FnOnce(&M) -> Tensor,
        backward_reads_parameters: bool,
    ) -> Tensor {
        let Some((model, unit)) = self.handle.model() else { return forward(self.inner.get()) };
        if let Err(e) = model.before_forward(unit) {
            model.record(unit, e);
        }
        let out = forward(self.inner.get());
        if let Err(e) = model.after_forward(unit, &out, backward_reads_parameters) {
            model.record(unit, e);
        }
        out
    }

    /// [`run`](Self::run) of `forward(module, x)` on the unit's one input `x`: knowing it,
    /// a unit whose parameters are all frozen (LoRA's base) is released again as soon as its
    /// backward is done (when `x`'s gradient arrives), not at the end of the backward pass.
    pub fn run_with(&self, x: &Tensor, forward: impl FnOnce(&M, &Tensor) -> Tensor) -> Tensor {
        let out = self.run(|m| forward(m, x));
        self.watch_input(x);
        out
    }

    /// A language model's head and its loss in one: the mean cross-entropy of the logits
    /// `x · wᵀ` against `targets` ([`crate::nn::linear_cross_entropy`]), `w` the weight
    /// `weight` picks out of the module. Its gradients are computed in the forward pass, so
    /// its backward reads no parameter, and under zero3 the unit is not gathered again for
    /// it: the head's size less in memory when backward starts, where activations are at
    /// their peak. Under zero3 a unit of `w` alone whose rows split evenly over the
    /// processes is not gathered at all: each process computes its slice of the vocabulary
    /// for every process's rows (see the fsdp README; the loss's gradient must then be the
    /// same on every process). An error if `x` and `w` do not fit (`x` `[N, d]`, `w`
    /// `[V, d]`, `targets` `[N]`).
    pub fn linear_cross_entropy(
        &self,
        x: &Tensor,
        targets: &Tensor,
        ignore_index: i64,
        weight: impl FnOnce(&M) -> &Tensor,
    ) -> Result<Tensor> {
        // The weight is a handle: gathering fills its storage, the tensor stays the same.
        let w = weight(self.inner.get());
        if let Some((model, unit)) = self.handle.model() {
            if let Some(loss) = model.cross_entropy_on_shards(unit, x, targets, ignore_index, w)? {
                return Ok(loss);
            }
        }
        let mut result = Ok(());
        let out = self.run_reading(
            |_| match shim::linear_cross_entropy_in_chunks(x, w, targets, ignore_index) {
                Ok(loss) => loss,
                Err(e) => {
                    result = Err(e);
                    Tensor::zeros([], (tch::Kind::Float, x.device()))
                }
            },
            false,
        );
        // Never gathered in backward, so nothing to release after it (no `watch_input`).
        result.map(|()| out)
    }

    /// A token embedding: the rows of the weight `weight` picks out of the module at `ids`
    /// (`Tensor::embedding`; rows of `padding_idx` get no gradient, -1 for none). Its
    /// backward reads the indices only, never the weight, so under zero3 the unit is not
    /// gathered again for it (FSDP2 gathers it): the embedding's size less to all-gather,
    /// write and hold at the end of the backward pass.
    pub fn embedding(
        &self,
        ids: &Tensor,
        padding_idx: i64,
        weight: impl FnOnce(&M) -> &Tensor,
    ) -> Tensor {
        self.run_reading(|m| Tensor::embedding(weight(m), ids, padding_idx, false, false), false)
    }

    /// See [`run_with`](Self::run_with).
    fn watch_input(&self, x: &Tensor) {
        if let Some((model, unit)) = self.handle.model() {
            if let Err(e) = model.release_after_backward_of(unit, x) {
                model.record(unit, e);
            }
        }
    }
}

impl<M: Send + 'static> Unit<M> {
    /// `forward(module, x)`, as [`run`](Self::run) runs it (under zero3 with the unit's
    /// parameters gathered), and with the accelerator's activation checkpointing (FSDP's
    /// `activation_checkpointing`) without keeping its activations: they are recomputed in
    /// backward, with the same random draws and casts (`shim::checkpoint`). `x` is the only
    /// input whose gradient flows back; whatever else `forward` reads it must own
    /// (shallow clones), as it may run again in backward.
    pub fn run_on(
        &self,
        x: &Tensor,
        forward: impl Fn(&M, &Tensor) -> Tensor + Send + 'static,
    ) -> Tensor {
        if self.handle.checkpointing.get() != Some(&true) {
            return self.run_with(x, |m, x| forward(m, x));
        }
        let module = Shared(self.inner.0.clone());
        let out = self.run(|_| {
            let recompute = move |x: &Tensor| forward(module.get(), x);
            crate::shim::checkpoint(x, recompute)
                .unwrap_or_else(|e| panic!("activation checkpointing of unit: {e}"))
        });
        self.watch_input(x);
        out
    }
}

impl<M: Module> Module for Unit<M> {
    fn forward(&self, xs: &Tensor) -> Tensor {
        self.run_with(xs, |m, xs| m.forward(xs))
    }
}
