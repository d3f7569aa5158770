//! How the work of training is shared between processes: the [`Strategy`] trait, which the
//! accelerator calls at each point of training and branches on nothing else, and the
//! built-in strategies — DDP ([`ddp`]), ZeRO-1 ([`zero1`]), ZeRO-2/3 and FSDP ([`fsdp`]).
//! A strategy of one's own (Accelerate's custom plugins; `examples/by_feature/local_sgd.rs`)
//! implements the same trait with the public API and is given to
//! [`crate::AcceleratorBuilder::custom_strategy`].
//!
//! Checkpoints ask the strategy what each process holds of each tensor (a [`Placement`],
//! what PyTorch's distributed checkpoint calls a chunk), never which strategy it is.

pub mod auto;
pub mod buffers;
pub mod cp;
pub mod ddp;
pub mod fsdp;
pub(crate) mod model_parallel;
pub mod tp;
pub mod zero1;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tch::{Device, Tensor};

use crate::accumulation::GradientState;
use crate::comm::Communicator;
use crate::config::Strategy as StrategyName;
use crate::error::{Error, Result};
use crate::mesh::{DeviceMesh, Dim};
use crate::optim::{Optimizer, Param};
use crate::sync::Locked;

/// What one process holds of a tensor of the model or of an optimizer's state, for
/// checkpoints: how to save it, and how to cut a whole tensor back to it on load.
#[derive(Debug, Clone, PartialEq)]
pub enum Placement {
    /// The whole tensor, the same on every process: saved once, by the main process.
    Replicated,
    /// The whole tensor, held by some processes only (ZeRO-1's state of the parameters a
    /// process steps; a pipeline stage's tensors): saved by this process when `write`.
    Whole {
        /// Whether this process's copy is the one saved.
        write: bool,
    },
    /// Chunk `index` of `count` equal chunks of the flattened whole of `numel` elements,
    /// zero-padded at the end (ZeRO-2/3's shards); saved by this process when `write`
    /// (under hybrid sharding the other machines hold copies).
    Chunk {
        /// Which chunk.
        index: usize,
        /// How many chunks the whole is cut into.
        count: usize,
        /// Elements of the whole.
        numel: i64,
        /// Whether this process's copy is the one saved.
        write: bool,
    },
    /// Slice `index` of `count` equal slices along dimension `dim` of a whole of `shape`
    /// (tensor parallelism), itself held as `inner` says.
    Slice {
        /// The dimension cut.
        dim: usize,
        /// Which slice.
        index: usize,
        /// How many slices.
        count: usize,
        /// The whole's shape.
        shape: Vec<i64>,
        /// How this process holds its slice.
        inner: Box<Placement>,
    },
}

impl Placement {
    /// Cuts `whole` to what this placement holds, shaped like `like` where whole.
    pub fn cut(&self, whole: &Tensor, like: Option<&Tensor>) -> Result<Tensor> {
        match self {
            Placement::Chunk { index, count, .. } => {
                crate::strategy::fsdp::chunk_of(whole, *index, *count)
            }
            Placement::Slice { dim, index, count, inner, .. } => {
                let part = whole.size()[*dim] / *count as i64;
                let slice = whole.f_narrow(*dim as i64, *index as i64 * part, part)?;
                inner.cut(&slice, like)
            }
            Placement::Replicated | Placement::Whole { .. } => match like {
                Some(t) if t.numel() == whole.numel() && t.size() != whole.size() => {
                    Ok(whole.f_reshape(t.size().as_slice())?)
                }
                _ => Ok(whole.shallow_clone()),
            },
        }
    }

    /// Whether this process saves its part.
    pub fn writes(&self) -> bool {
        match self {
            Placement::Replicated => false,
            Placement::Whole { write } | Placement::Chunk { write, .. } => *write,
            Placement::Slice { inner, .. } => inner.writes(),
        }
    }
}

/// What a strategy's hooks may use of the run (the accelerator hands it to each call).
pub struct Context<'a> {
    pub(crate) mesh: &'a DeviceMesh,
    pub(crate) state: &'a Arc<GradientState>,
    pub(crate) device: Device,
    /// The units made for this accelerator, waiting for their model (zero3 binds them).
    pub(crate) units: &'a fsdp::PendingUnits,
    /// Whether this process speaks for the run (the main process, not quiet).
    pub(crate) announce: bool,
    /// Bytes of model variables placed on the device (`Accelerator::io_counts`).
    pub(crate) placed: &'a std::sync::atomic::AtomicU64,
}

impl Context<'_> {
    /// The run's parallel dimensions and a communicator for each.
    pub fn mesh(&self) -> &DeviceMesh {
        self.mesh
    }

    /// This process's device.
    pub fn device(&self) -> Device {
        self.device
    }

    /// Whether the current micro-step ends an accumulation window.
    pub fn sync_gradients(&self) -> bool {
        self.state.sync_gradients()
    }
}

/// `tensor` on `device` (itself where it is there already), its bytes counted as placed on
/// the process's device (`Accelerator::io_counts`, where the memory a strategy promises is
/// checked: under zero3 only shards and the units kept whole reach the device).
pub(crate) fn place(tensor: &Tensor, device: Device, placed: &AtomicU64) -> Result<Tensor> {
    let bytes = tensor.numel() * tensor.kind().elt_size_in_bytes();
    placed.fetch_add(bytes as u64, Ordering::Relaxed);
    Ok(tensor.f_to_device(device)?)
}

/// Moves every variable of a model whole to the process's device, in place (tensors keep
/// their identity, so the model's layers see the move): what every strategy but the sharded
/// ones needs before [`Strategy::prepare_model`].
pub(crate) fn place_whole(cx: &Context<'_>, params: &[Param]) -> Result<()> {
    tch::no_grad(|| -> Result<()> {
        for p in params {
            let moved = place(&p.tensor, cx.device, cx.placed)?;
            if p.tensor.device() != cx.device {
                p.tensor.shallow_clone().set_data(&moved);
            }
        }
        Ok(())
    })
}

/// Per-model settings of the built-in strategies (given to
/// `Accelerator::prepare_model_with`); other strategies may ignore them.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct ModelOptions {
    /// DDP's bucket size, unused-parameter handling and gradient compression.
    pub ddp: ddp::DdpOptions,
    /// Broadcast the first process's values to the others when the model is prepared (FSDP's
    /// `sync_module_states`; on by default). Off for a model whose values a checkpoint fills
    /// on every process next (`Accelerator::prepare_model_from_checkpoint`).
    pub sync_module_states: bool,
}

impl Default for ModelOptions {
    fn default() -> Self {
        Self { ddp: Default::default(), sync_module_states: true }
    }
}

impl ModelOptions {
    /// These options with `sync_module_states` set to `on`.
    pub fn sync_module_states(self, on: bool) -> Self {
        Self { sync_module_states: on, ..self }
    }
}

impl From<ddp::DdpOptions> for ModelOptions {
    fn from(ddp: ddp::DdpOptions) -> Self {
        Self { ddp, ..Default::default() }
    }
}

/// What a strategy does for each prepared optimizer. The accelerator's optimizer wrapper
/// does accumulation, loss scaling and clipping, and asks this for everything else.
pub trait OptimizerPlan: Send {
    /// The tensors whose gradients this process's step reads: what fp16 unscaling,
    /// overflow checks and clipping look at. The optimizer's parameters by default.
    fn gradients(&self, optimizer: &dyn Optimizer) -> Vec<Tensor> {
        optimizer.params()
    }

    /// The communicator across which [`gradients`](Self::gradients) are split (the global
    /// norm and the overflow flag are reduced over it); `None` when every process holds
    /// them all.
    fn gradient_group(&self) -> Option<Arc<dyn Communicator>> {
        None
    }

    /// After every `step()` call of the prepared optimizer: `stepped` is false on
    /// accumulation steps and on skipped fp16 steps.
    fn after_step(&mut self, optimizer: &mut dyn Optimizer, stepped: bool) -> Result<()> {
        let _ = (optimizer, stepped);
        Ok(())
    }

    /// Under `optimizer_in_backward`: takes `update` and calls it during backward as soon
    /// as gradients are ready (it applies the optimizer's update to the parameters that
    /// have one, then drops their gradients), so that the step applies nothing. Returns
    /// whether it will; the default never does (the update waits for the step).
    fn update_in_backward(&mut self, update: &UpdateInBackward) -> Result<bool> {
        let _ = update;
        Ok(false)
    }

    /// What this process holds of optimizer state tensor `key` (`{param}/{slot}`), whose
    /// value here is `tensor`.
    fn state_placement(&self, key: &str, tensor: &Tensor) -> Placement {
        let _ = (key, tensor);
        Placement::Replicated
    }

    /// What this process holds of the state of the whole of parameter `param` (for
    /// loading a state saved under another layout); `numel` is the whole's size.
    fn state_placement_of(&self, param: &str, numel: i64) -> Placement {
        let _ = (param, numel);
        Placement::Replicated
    }
}

/// The update a prepared optimizer applies inside backward (`optimizer_in_backward`): the
/// optimizer's update of every parameter whose gradient is ready, then those gradients
/// dropped. Called by a strategy, never while it holds a lock of its own.
pub type UpdateInBackward = Arc<dyn Fn() -> Result<()> + Send + Sync>;

/// The plan of an optimizer every process steps alike (single process, DDP).
#[derive(Debug, Default)]
pub struct Replicated;

impl OptimizerPlan for Replicated {}

/// The hooks of a distribution strategy. Every method is called on every process, at the
/// same points, so a strategy may run collectives in any of them.
pub trait Strategy: Send + Sync + 'static {
    /// Its name, for messages.
    fn name(&self) -> String;

    /// Whether [`prepare_model`](Self::prepare_model) places the model's variables on the
    /// process's device itself (a sharded strategy moves only shards there). Otherwise the
    /// accelerator moves every variable there whole first.
    fn places_parameters(&self) -> bool {
        false
    }

    /// Prepares a model: `params` are all its variables (sorted by name; on the process's
    /// device unless [`places_parameters`](Self::places_parameters)). Broadcast them, hook
    /// their gradients, shard them.
    fn prepare_model(
        &self,
        cx: &Context<'_>,
        params: &[Param],
        options: &ModelOptions,
    ) -> Result<()>;

    /// Prepares an optimizer over prepared models, before its first step: keep a share of
    /// its parameters, swap them for shards... Returns what to do at its steps.
    fn prepare_optimizer(
        &self,
        cx: &Context<'_>,
        optimizer: &mut dyn Optimizer,
    ) -> Result<Box<dyn OptimizerPlan>> {
        let _ = (cx, optimizer);
        Ok(Box::new(Replicated))
    }

    /// After every backward pass; `sync` when it ends an accumulation window (the step
    /// that follows updates the parameters).
    fn after_backward(&self, cx: &Context<'_>, sync: bool) -> Result<()> {
        let _ = (cx, sync);
        Ok(())
    }

    /// A failure kept where it could not be returned (a collective inside `Module::forward`
    /// or an autograd hook), for the accelerator's next call to return.
    fn take_error(&self) -> Result<()> {
        Ok(())
    }

    /// Whether `zero_grad` must zero gradients in place instead of dropping them (DDP's
    /// gradients are views of its buckets).
    fn zero_grad_in_place(&self) -> bool {
        false
    }

    /// Whether an optimizer the strategy did not prepare can step the model's parameters
    /// as they are (whole, their gradients in `.grad`): false where the parameters or their
    /// gradients live in shards.
    fn steps_whole_parameters(&self) -> bool {
        true
    }

    /// The group across which a model's buffers (its variables that are not parameters:
    /// batch norm's running statistics) are kept equal: its first rank's values are
    /// broadcast after every sync step (see `buffers.rs`). The data-parallel group by default,
    /// as torch's DDP does with `broadcast_buffers=True`; `None` leaves buffers alone.
    fn buffer_group(
        &self,
        cx: &Context<'_>,
        options: &ModelOptions,
    ) -> Option<Arc<dyn Communicator>> {
        let _ = options;
        let data = cx.mesh.comm(Dim::Data);
        (data.size() > 1).then_some(data)
    }

    /// The end of training (`Accelerator::end_training`, and the successful end of an
    /// `#[accelerate]` function).
    fn end_training(&self, cx: &Context<'_>) -> Result<()> {
        let _ = cx;
        Ok(())
    }

    /// What this process holds of the model parameter `param`, and where: for checkpoints.
    /// The parameter itself, replicated, by default.
    fn parameter(&self, param: &Param) -> Result<(Tensor, Placement)> {
        Ok((param.tensor.f_detach()?, Placement::Replicated))
    }

    /// Sets the model parameter `param` from its whole value (loading a checkpoint); the
    /// strategy writes what this process holds of it.
    fn load_parameter(&self, param: &Param, whole: &Tensor) -> Result<()> {
        tch::no_grad(|| param.tensor.shallow_clone().f_copy_(whole))?;
        Ok(())
    }

    /// Sets what this process holds of the model parameter `param` from `part`: its value as
    /// [`parameter`](Self::parameter) places it (a chunk, for a [`Placement::Chunk`]).
    /// Loading a checkpoint calls this instead of [`load_parameter`](Self::load_parameter)
    /// wherever the placement is not [`Placement::Replicated`], so that no process reads
    /// the whole of a tensor it keeps a piece of. By default `part` is copied into the
    /// tensor `parameter` returns.
    fn load_part(&self, param: &Param, part: &Tensor) -> Result<()> {
        let (local, _) = self.parameter(param)?;
        tch::no_grad(|| local.shallow_clone().f_copy_(part))?;
        Ok(())
    }

    /// After [`load_parameter`](Self::load_parameter) of every parameter.
    fn after_load(&self) -> Result<()> {
        Ok(())
    }

    /// Makes every parameter of the prepared models whole on this process, with its trained
    /// values, until training resumes (a collective where parameters are released between
    /// uses: zero3); returns the bytes it made whole. Nothing to do by default: the
    /// parameters are whole already.
    fn summon_full_params(&self) -> Result<u64> {
        Ok(0)
    }

    /// The whole values of `params` (a collective under sharding: every process calls it);
    /// copies of the local values by default.
    fn full_parameters(&self, params: &[Param]) -> Result<Vec<Tensor>> {
        params.iter().map(|p| Ok(p.tensor.f_detach_copy()?)).collect()
    }
}

/// One process: nothing to share.
#[derive(Debug, Default)]
pub struct Single {
    /// `optimizer_in_backward`: each parameter's update is applied as its gradient arrives.
    in_backward: bool,
    /// A failure of an update applied inside backward, for the next call to return.
    error: Arc<Mutex<Option<Error>>>,
    /// The parameters (tensor ids) whose update an optimizer applies inside backward.
    hooked: Mutex<std::collections::BTreeSet<usize>>,
}

impl Strategy for Single {
    fn name(&self) -> String {
        "single".into()
    }
    fn prepare_model(&self, _: &Context<'_>, _: &[Param], _: &ModelOptions) -> Result<()> {
        Ok(())
    }
    fn prepare_optimizer(
        &self,
        _: &Context<'_>,
        optimizer: &mut dyn Optimizer,
    ) -> Result<Box<dyn OptimizerPlan>> {
        if !self.in_backward {
            return Ok(Box::new(Replicated));
        }
        let params = optimizer.params();
        let mut hooked = self.hooked.locked();
        for p in &params {
            if !hooked.insert(crate::shim::tensor_id(p)?) {
                return Err(Error::Unsupported(format!(
                    "optimizer_in_backward applies one optimizer's update of a parameter inside \
                     backward, and {} steps parameters another prepared optimizer steps \
                     already: give each parameter one optimizer (parameter groups give parts \
                     of a model their own settings), or set optimizer_in_backward = false",
                    optimizer.name()
                )));
            }
        }
        Ok(Box::new(InBackward { params, error: self.error.clone(), hooks: Vec::new() }))
    }
    fn after_backward(&self, _: &Context<'_>, _sync: bool) -> Result<()> {
        self.take_error()
    }
    fn take_error(&self) -> Result<()> {
        match self.error.locked().take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// One process under `optimizer_in_backward` (as torchtune on one device): a hook on every
/// parameter applies its update as soon as backward has accumulated its gradient.
struct InBackward {
    params: Vec<Tensor>,
    error: Arc<Mutex<Option<Error>>>,
    hooks: Vec<crate::shim::PostAccumulateGradHook>,
}

impl OptimizerPlan for InBackward {
    fn update_in_backward(&mut self, update: &UpdateInBackward) -> Result<bool> {
        for param in &self.params {
            let (update, error) = (update.clone(), self.error.clone());
            let hook = move |_: &Tensor| {
                if let Err(e) = update() {
                    error.locked().get_or_insert(e);
                }
            };
            self.hooks.push(crate::shim::add_post_accumulate_grad_hook(param, hook)?);
        }
        Ok(true)
    }
}

/// The built-in strategy a configuration names, over `mesh` (`local_processes`: this
/// machine's, whose memory `auto` shares among them).
pub(crate) fn builtin(
    name: StrategyName,
    mesh: &DeviceMesh,
    sharding: fsdp::ShardOptions,
    local_processes: usize,
) -> Arc<dyn Strategy> {
    if mesh.dims().world() == 1 && mesh.world().is_none() {
        return Arc::new(Single { in_backward: sharding.step_in_backward, ..Single::default() });
    }
    let data = mesh.comm(Dim::Data);
    match name {
        StrategyName::Single | StrategyName::Ddp => Arc::new(ddp::DdpStrategy::new(data)),
        StrategyName::Zero1 => Arc::new(zero1::Zero1::new(data)),
        StrategyName::Zero2 => Arc::new(fsdp::Sharded::new(mesh, fsdp::Stage::Gradients, sharding)),
        StrategyName::Zero3 | StrategyName::Fsdp | StrategyName::HybridShard => {
            Arc::new(fsdp::Sharded::new(mesh, fsdp::Stage::Parameters, sharding))
        }
        StrategyName::Auto if mesh.dims().world() > 1 => {
            Arc::new(auto::Auto::new(mesh, sharding, local_processes))
        }
        // A group of one: nothing to choose between.
        StrategyName::Auto => Arc::new(ddp::DdpStrategy::new(data)),
    }
}

#[cfg(test)]
pub(crate) mod tests;
