//! [`ShardedModel`]: one model's master shards and units (their flat-buffer collectives in
//! flat.rs), and what training does with them: hooks that reduce-scatter each unit's
//! gradients as backward produces them, zero3's gather before a unit's forward and backward
//! and release after, prefetch in the order of the first pass. See README.md.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use tch::{Device, Kind, Tensor};

use super::flat::{Engine, Frozen, Shard, UnitState};
use super::layout::{chunk_of, size_based_units, unit_of};
use super::spare::Spare;
use super::{ShardOptions, Stage};
use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::optim::Param;
use crate::shim::{
    self, GradHook, PostAccumulateGradHook, add_grad_hook, add_post_accumulate_grad_hook,
};
use crate::strategy::UpdateInBackward;
use crate::sync::Locked;

/// Under zero3: what of the model stays whole on every process because no unit is released
/// at rest, when that is more than the largest unit (or there is no unit at all).
fn whole_notice(params: &[Param], engine: &Engine) -> Option<String> {
    let bytes = |s: usize| {
        let shard = &engine.shards[s];
        shard.numel as usize * shard.kind.elt_size_in_bytes()
    };
    let largest = engine
        .units
        .iter()
        .filter(|u| u.managed)
        .map(|u| {
            u.members
                .iter()
                .chain(u.frozen.iter().flat_map(|f| &f.members))
                .map(|&s| bytes(s))
                .sum()
        })
        .max()
        .unwrap_or(0usize);
    let whole: Vec<&Param> = params
        .iter()
        .filter(|p| {
            let id = shim::tensor_id(&p.tensor).ok();
            let released = engine
                .units
                .iter()
                .filter(|u| u.managed)
                .any(|u| u.members.iter().any(|&s| Some(engine.shards[s].id) == id));
            p.tensor.requires_grad() && !released
        })
        .collect();
    let total: usize =
        whole.iter().map(|p| p.tensor.numel() * p.tensor.kind().elt_size_in_bytes()).sum();
    if whole.is_empty() || total <= largest {
        return None;
    }
    let mut names: Vec<&str> = whole.iter().take(3).map(|p| p.name.as_str()).collect();
    if whole.len() > 3 {
        names.push("...");
    }
    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    Some(format!(
        "zero3: {} parameter(s) ({:.1} MiB: {}) belong to no Unit, so every process keeps them \
         whole, as under zero2{}. Wrap each layer as a unit: \
         `accel_core::Unit::new(&accelerator, &path, layer)`; #[accelerate] does it by itself \
         for layers added to an `nn::seq()` inside the annotated function (docs/strategies.md)",
        whole.len(),
        mib(total),
        names.join(", "),
        if largest > 0 {
            format!(" (the largest unit holds {:.1} MiB)", mib(largest))
        } else {
            String::new()
        }
    ))
}

/// Makes `param` a parameter of `kind` on `device` whose memory is released (zero3's state
/// at rest), never whole there; a read of it fails, naming it, `rank` and the fix. A
/// parameter whose storage it shares with other tensors is refused: the others would keep
/// the memory, and a tie would be silently broken.
fn release_on(param: &Param, kind: Kind, device: Device, rank: usize) -> Result<()> {
    super::flat::release_as(&param.tensor, &param.name, kind, device, rank)
}

/// A model whose gradients (zero2) or gradients and parameters (zero3) are sharded.
pub(crate) struct ShardedModel {
    engine: Arc<Mutex<Engine>>,
    /// Under zero3, what of the model no unit holds, where that is more than a unit: said
    /// when the run starts.
    pub(crate) whole_notice: Option<String>,
    _hooks: Mutex<Vec<PostAccumulateGradHook>>,
    /// See [`unguard_before_accumulating`]; taken off when the model is dropped (each holds
    /// its parameter).
    unguards: Mutex<Vec<GradHook>>,
}

impl Drop for ShardedModel {
    fn drop(&mut self) {
        for hook in self.unguards.get_mut().map(std::mem::take).unwrap_or_default() {
            let _ = hook.remove();
        }
    }
}

/// A gradient hook on each trainable shard's parameter that takes away the guarded gradient
/// a backward pass left (`Engine::guard_gradients`) just before autograd accumulates the
/// next one into it, whichever way that backward is started.
fn unguard_before_accumulating(engine: &Mutex<Engine>) -> Result<Vec<GradHook>> {
    let params: Vec<Tensor> = {
        let engine = lock(engine);
        let members = engine.units.iter().flat_map(|u| u.members.iter());
        members.map(|&s| engine.shards[s].param.shallow_clone()).collect()
    };
    params
        .into_iter()
        .map(|param| {
            let target = Mutex::new(param.shallow_clone());
            add_grad_hook(&param, move |_| {
                let target = target.locked();
                let grad = target.grad();
                if grad.defined() && shim::is_released(&grad).unwrap_or(false) {
                    let _ = shim::set_grad(&target, None);
                }
                None
            })
        })
        .collect()
}

impl std::fmt::Debug for ShardedModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardedModel").finish_non_exhaustive()
    }
}

fn lock(engine: &Mutex<Engine>) -> MutexGuard<'_, Engine> {
    engine.locked()
}

/// Hooks every trainable shard's parameter so that a unit's gradients are reduce-scattered
/// as soon as backward has produced the last of them.
fn reduce_when_ready(engine: &Arc<Mutex<Engine>>) -> Result<Vec<PostAccumulateGradHook>> {
    let layout: Vec<(usize, usize, Tensor)> = {
        let engine = lock(engine);
        let shards = &engine.shards;
        engine
            .units
            .iter()
            .enumerate()
            .flat_map(|(u, unit)| {
                unit.members
                    .iter()
                    .enumerate()
                    .map(move |(i, &s)| (u, i, shards[s].param.shallow_clone()))
            })
            .collect()
    };
    let mut hooks = Vec::new();
    for (u, i, param) in layout {
        let engine = engine.clone();
        let hook = move |_: &Tensor| {
            let mut guard = lock(&engine);
            let unit = &mut guard.units[u];
            if !unit.fired[i] {
                unit.fired[i] = true;
                unit.ready += 1;
            }
            if unit.ready == unit.members.len() && !guard.failed {
                if let Err(e) = guard.reduce(u) {
                    guard.record(e);
                }
            }
            let due = guard.due_update();
            drop(guard);
            if let Some(Err(e)) = due.map(|update| update()) {
                lock(&engine).record(e);
            }
        };
        hooks.push(add_post_accumulate_grad_hook(&param, hook)?);
    }
    Ok(hooks)
}

/// What placing each parameter needs: where it goes, in how many shares, where rank 0's
/// values come from, and the count of bytes placed on the device.
struct Placing<'a> {
    device: Device,
    rank: i64,
    world: i64,
    stage: Stage,
    options: &'a ShardOptions,
    broadcast: bool,
    data: &'a dyn Communicator,
    placed: &'a AtomicU64,
}

impl Placing<'_> {
    fn count(&self, t: &Tensor) {
        let bytes = (t.numel() * t.kind().elt_size_in_bytes()) as u64;
        self.placed.fetch_add(bytes, Ordering::Relaxed);
    }

    /// A parameter kept whole: moved to the device (in place, so that the model's module
    /// sees it there).
    fn keep_whole(&self, p: &Param) -> Result<()> {
        if p.tensor.device() != self.device {
            let moved = tch::no_grad(|| p.tensor.f_to_device(self.device))?;
            p.tensor.shallow_clone().set_data(&moved);
        }
        self.count(&p.tensor);
        Ok(())
    }

    /// Rank 0's values of `p`: where the parameter is, or on the device for the moment of
    /// the broadcast (a collective on the device's communicator).
    fn rank0_values(&self, p: &Param) -> Result<Tensor> {
        tch::no_grad(|| -> Result<Tensor> {
            let start = match (p.tensor.device() == self.device, self.broadcast) {
                (false, true) => {
                    self.count(&p.tensor);
                    p.tensor.f_to_device(self.device)?
                }
                _ => p.tensor.shallow_clone(),
            };
            if self.broadcast {
                self.data.broadcast(&start, 0)?;
            }
            Ok(start)
        })
    }

    /// This rank's chunk of a frozen parameter's values `start`, in its own dtype.
    fn frozen_share(&self, start: &Tensor) -> Result<Tensor> {
        let share = tch::no_grad(|| -> Result<Tensor> {
            let flat = start.f_detach()?.f_reshape([-1])?;
            let mine = chunk_of(&flat, self.rank as usize, self.world as usize)?;
            Ok(mine.f_to_device(self.device)?.f_detach_copy()?)
        })?;
        self.count(&share);
        Ok(share)
    }

    /// The fp32 master of this rank's chunk (`chunk` elements) of trainable `p`, from its
    /// values `start`: on the device, or page-locked on the host when offloaded.
    fn master_share(&self, p: &Param, start: &Tensor, chunk: i64) -> Result<Tensor> {
        let (rank, world, offload) = (self.rank, self.world, self.options.offload);
        // Zero2 in fp32 keeps whole parameters anyway: a share that needs no padding can
        // be a view of its own parameter instead of a copy (ZeRO-2's 4Ψ + 12Ψ/N, not 16Ψ/N).
        let in_place = self.stage == Stage::Gradients
            && !offload
            && p.tensor.kind() == Kind::Float
            && p.tensor.is_contiguous()
            && (rank + 1) * chunk <= p.tensor.numel() as i64;
        tch::no_grad(|| -> Result<Tensor> {
            if in_place {
                let flat = p.tensor.f_detach()?.f_reshape([-1])?;
                return Ok(flat.f_narrow(0, chunk * rank, chunk)?);
            }
            let flat = start.f_detach()?.f_reshape([-1])?;
            let at = if offload { Device::Cpu } else { self.device };
            let master = chunk_of(&flat, rank as usize, world as usize)?
                .f_to_kind(Kind::Float)?
                .f_to_device(at)?
                .f_detach_copy()?;
            if !offload {
                self.count(&master);
            }
            // Offloaded from a GPU: page-locked host memory, which the copies of the
            // gradient shards down and the parameter shards up use at full speed.
            Ok(match (offload, self.device) {
                (true, Device::Cuda(_)) => crate::shim::pin_memory(&master)?,
                _ => master,
            })
        })
    }
}

impl ShardedModel {
    /// Broadcasts rank 0's values, keeps this rank's share of every trainable parameter as
    /// a master shard, releases the full parameters of zero3 units and hooks the rest.
    /// Variables are placed on `device` one at a time as they are sharded: a zero3 unit's
    /// parameters reach it as this rank's shards only (and, when rank 0's values are
    /// broadcast from another device, whole for the moment of their broadcast), so the model
    /// is never whole there. Bytes placed are counted in `placed`.
    ///
    /// `data` spans every data-parallel process (rank 0's values are broadcast over it);
    /// parameters are split across `group`, and under hybrid sharding `replicas` holds the
    /// same shards on the other machines. `wrapped`: the prefixes of the [`super::Unit`]s
    /// that wrap parts of it ([`super::shard_model`] binds them).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn place(
        params: &[Param],
        wrapped: &BTreeSet<String>,
        data: &dyn Communicator,
        group: Arc<dyn Communicator>,
        replicas: Option<Arc<dyn Communicator>>,
        stage: Stage,
        options: ShardOptions,
        broadcast: bool,
        device: Device,
        placed: &AtomicU64,
    ) -> Result<Arc<Self>> {
        let sizes: Vec<(&str, i64)> =
            params.iter().map(|p| (p.name.as_str(), p.tensor.numel() as i64)).collect();
        let sized = options.min_unit_params.map(|min| size_based_units(&sizes, min));
        let placing = Placing {
            device,
            rank: group.rank() as i64,
            world: group.size() as i64,
            stage,
            options: &options,
            broadcast,
            data,
            placed,
        };
        let (mut shards, mut units) = (Vec::new(), Vec::<UnitState>::new());
        for p in params {
            let trainable = p.tensor.requires_grad();
            let prefix = unit_of(&p.name, options.units.as_deref(), wrapped, sized.as_deref());
            let managed = stage == Stage::Parameters && wrapped.contains(&prefix);
            // A parameter released at rest never reaches the device whole; any other is
            // kept there whole.
            if !managed {
                placing.keep_whole(p)?;
            }
            let start = placing.rank0_values(p)?;
            // A frozen parameter is sharded only where its unit is released at rest (zero3);
            // elsewhere it stays whole, as every process needs it whole anyway.
            if !trainable && !managed {
                continue;
            }
            let (numel, kind) = (p.tensor.numel() as i64, p.tensor.kind());
            let chunk = (numel + placing.world - 1) / placing.world;
            let u = match units.iter().position(|u| u.prefix == prefix) {
                Some(u) => u,
                None => {
                    units.push(UnitState::new(prefix, managed));
                    units.len() - 1
                }
            };
            let unit = &mut units[u];
            if !trainable {
                // Frozen, in a zero3 unit: this rank's chunk in its own dtype (one dtype per
                // unit's frozen buffer; another stays whole).
                let frozen = unit.frozen.get_or_insert_with(|| Frozen::new(kind));
                if frozen.kind != kind {
                    continue;
                }
                let master = placing.frozen_share(&start)?;
                release_on(p, kind, device, placing.rank as usize)?;
                frozen.members.push(shards.len());
                frozen.offsets.push(frozen.segment);
                frozen.segment += chunk;
                shards.push(Shard::of(p, master, chunk, kind)?);
                continue;
            }
            let master = placing.master_share(p, &start, chunk)?.set_requires_grad(true);
            if unit.managed {
                // FSDP's MixedPrecision(param_dtype): the module computes (and its gradients
                // come out) in `param_dtype`; the fp32 master above is what the optimizer steps.
                release_on(p, options.param_dtype.unwrap_or(kind), device, placing.rank as usize)?;
            }
            unit.members.push(shards.len());
            unit.offsets.push(unit.segment);
            unit.segment += chunk;
            unit.fired.push(false);
            shards.push(Shard::of(p, master, chunk, kind)?);
        }
        let engine = Engine {
            group,
            device,
            replicas,
            options,
            shards,
            units,
            error: None,
            failed: false,
            in_flight: Default::default(),
            order: Vec::new(),
            order_known: false,
            update: None,
            update_due: false,
            spare: Spare::new(device),
            summoned: None,
        };
        let engine = Arc::new(Mutex::new(engine));
        let hooks = reduce_when_ready(&engine)?;
        let unguards = unguard_before_accumulating(&engine)?;
        let whole_notice =
            (stage == Stage::Parameters).then(|| whole_notice(params, &lock(&engine)));
        let model = Arc::new(Self {
            engine,
            whole_notice: whole_notice.flatten(),
            _hooks: Mutex::new(hooks),
            unguards: Mutex::new(unguards),
        });
        Ok(model)
    }

    /// The master shard the optimizer steps in place of the parameter `id`
    /// ([`shim::tensor_id`]), if it is one of this model's.
    pub(crate) fn master_of(&self, id: usize) -> Option<Tensor> {
        lock(&self.engine).shards.iter().find(|s| s.id == id).map(|s| s.master.shallow_clone())
    }

    /// The unit with variable-name prefix `prefix`, if it is one of this model's.
    pub(crate) fn unit(&self, prefix: &str) -> Option<usize> {
        lock(&self.engine).units.iter().position(|u| u.prefix == prefix)
    }

    /// Bytes kept for the next unit (see spare.rs).
    #[cfg(test)]
    pub(crate) fn spare_bytes(&self) -> u64 {
        lock(&self.engine).spare.bytes()
    }

    /// Whether unit `unit`'s all-gather was launched ahead of its use (tests).
    #[cfg(test)]
    pub(crate) fn prefetch_pending(&self, unit: usize) -> bool {
        lock(&self.engine).units[unit].prefetched.is_some()
    }

    /// The processes each parameter is split across.
    pub(crate) fn group(&self) -> Arc<dyn Communicator> {
        lock(&self.engine).group.clone()
    }

    /// Whether this process's shards are the ones a checkpoint keeps (under hybrid
    /// sharding, those of the first machine; the other machines hold copies).
    pub(crate) fn writes_shards(&self) -> bool {
        lock(&self.engine).replicas.as_ref().is_none_or(|r| r.rank() == 0)
    }

    /// Gathers a unit for its forward, and starts gathering the one that follows it.
    pub(crate) fn before_forward(&self, unit: usize) -> Result<()> {
        let mut engine = lock(&self.engine);
        engine.note_forward(unit);
        engine.units[unit].on_shards = false;
        if engine.summoned.is_some() {
            if !shim::grad_mode_enabled()? {
                // Whole already (an evaluation after the loop): used as they are.
                return Ok(());
            }
            // Training resumes.
            engine.unsummon()?;
        }
        if engine.failed {
            return engine.fill_locally(unit);
        }
        if !engine.units[unit].gathered {
            engine.gather(unit)?;
        }
        if engine.order_known {
            let next = engine.order.iter().skip_while(|&&u| u != unit).nth(1).copied();
            if let Some(next) = next {
                engine.prefetch(next)?;
            }
        }
        engine.spare.trim();
        Ok(())
    }

    /// Zero3's `Unit::linear_cross_entropy` of unit `unit` (its head `w`) computed on the
    /// shards, the head never gathered (vocab.rs), where it fits; `None` where it does not.
    /// Backward reaching the loss adds the head's gradient shard (and applies the update
    /// under `optimizer_in_backward`) and starts gathering the unit before it.
    pub(crate) fn cross_entropy_on_shards(
        self: &Arc<Self>,
        unit: usize,
        x: &Tensor,
        targets: &Tensor,
        ignore_index: i64,
        w: &Tensor,
    ) -> Result<Option<Tensor>> {
        let (value, grad_x, grad_w) = {
            let mut engine = lock(&self.engine);
            if engine.summoned.is_some() || !engine.on_shards_fits(unit, w, x)? {
                return Ok(None);
            }
            engine.note_forward(unit);
            engine.units[unit].on_shards = true;
            // Nothing is gathered here: what the last unit's release kept goes back first.
            engine.spare.trim();
            let computed = engine.cross_entropy_on_shards(unit, x, targets, ignore_index);
            // Returned now; what follows of this model runs without collectives.
            engine.failed |= computed.is_err();
            computed?
        };
        let loss = shim::loss_with_gradient(&value, x, grad_x.as_ref())?;
        let (model, grad_w) = (self.clone(), Mutex::new(Some(grad_w)));
        // Inside autograd an error cannot be returned: it is kept for `finish`.
        add_grad_hook(&loss, move |g| {
            let grad_w = grad_w.locked().take()?;
            if let Err(e) = model.backward_on_shards(unit, &grad_w, g) {
                model.record(unit, e);
            }
            None
        })?;
        Ok(Some(loss))
    }

    /// See [`cross_entropy_on_shards`](Self::cross_entropy_on_shards).
    fn backward_on_shards(&self, unit: usize, grad_w: &Tensor, g: &Tensor) -> Result<()> {
        self.before_backward(unit, false)?;
        let mut engine = lock(&self.engine);
        if engine.failed {
            return Ok(());
        }
        engine.add_gradient_on_shards(unit, grad_w, g)?;
        let due = engine.due_update();
        drop(engine);
        due.map_or(Ok(()), |update| update())
    }

    /// Gathers a unit for its backward (unless `gather` is false: a backward that reads
    /// none of its parameters), and starts gathering the one whose backward comes next
    /// (the unit before it in the forward pass).
    fn before_backward(&self, unit: usize, gather: bool) -> Result<()> {
        let mut engine = lock(&self.engine);
        if engine.failed {
            return if gather { engine.fill_locally(unit) } else { Ok(()) };
        }
        if gather && !engine.units[unit].gathered {
            engine.gather(unit)?;
        }
        // The nearest unit before this one that its backward gathers.
        let previous = engine
            .order
            .iter()
            .take_while(|&&u| u != unit)
            .filter(|&&u| engine.units[u].backward_reads)
            .last()
            .copied();
        if let Some(previous) = previous {
            engine.prefetch(previous)?;
        }
        engine.spare.trim();
        Ok(())
    }

    /// Releases a zero3 unit's parameters after its forward and arranges for them to be
    /// gathered again when the gradient of its output arrives (just before its backward);
    /// with `backward_reads_parameters` false (a forward that computed their gradients
    /// already: `Unit::linear_cross_entropy`), only the next unit is gathered then.
    pub(crate) fn after_forward(
        self: &Arc<Self>,
        unit: usize,
        output: &Tensor,
        backward_reads_parameters: bool,
    ) -> Result<()> {
        let mut engine = lock(&self.engine);
        if !engine.units[unit].managed || engine.summoned.is_some() {
            return Ok(());
        }
        engine.units[unit].backward_reads |= backward_reads_parameters && output.requires_grad();
        engine.units[unit].gets_gradient |= output.requires_grad();
        engine.release(unit)?;
        if !engine.order_known || engine.order.last() == Some(&unit) {
            // The forward pass's last unit (or the first pass, whose last unit is not known
            // yet): no gather may follow before backward.
            engine.spare.trim();
        }
        drop(engine);
        if output.requires_grad() {
            let model = self.clone();
            // Inside autograd an error cannot be returned: it is kept for `finish`.
            add_grad_hook(output, move |_| {
                if let Err(e) = model.before_backward(unit, backward_reads_parameters) {
                    model.record(unit, e);
                }
                None
            })?;
        }
        Ok(())
    }

    /// For a zero3 unit of frozen parameters only (LoRA's base, no gradient of its own whose
    /// reduction would release it): releases it again once the gradient of its `input`
    /// arrives, that is once its backward is done. Without an input that needs a gradient
    /// it is released at the end of the backward pass.
    pub(crate) fn release_after_backward_of(
        self: &Arc<Self>,
        unit: usize,
        input: &Tensor,
    ) -> Result<()> {
        let frozen_only = {
            let engine = lock(&self.engine);
            engine.units[unit].managed && engine.units[unit].members.is_empty()
        };
        if !frozen_only || !input.requires_grad() {
            return Ok(());
        }
        let model = self.clone();
        add_grad_hook(input, move |_| {
            let mut engine = lock(&model.engine);
            if !engine.failed {
                if let Err(e) = engine.release(unit) {
                    engine.record(e);
                }
            }
            None
        })?;
        Ok(())
    }

    /// Keeps `error`, raised around unit `unit` where it could not be returned (inside
    /// autograd, or `Module::forward`), for the next accelerator call, and gives the unit
    /// zero-filled parameters so that the pass under way completes without collectives.
    pub(crate) fn record(&self, unit: usize, error: Error) {
        let mut engine = lock(&self.engine);
        engine.record(error);
        if let Err(e) = engine.fill_locally(unit) {
            engine.record(e); // behind the first error, which is the one returned
        }
    }

    /// The error kept by [`record`](Self::record) or a gradient hook, if any (once; then an
    /// error saying that the model failed earlier).
    pub(crate) fn take_error(&self) -> Result<()> {
        lock(&self.engine).take_error()
    }

    /// After each backward: launches the reductions no hook launched (units some of whose
    /// parameters got no gradient), waits for all, and adds this rank's averaged share into
    /// the master shards' gradients.
    pub(crate) fn finish(&self) -> Result<()> {
        let mut guard = lock(&self.engine);
        let engine = &mut *guard;
        engine.take_error()?;
        let idle = |u: &UnitState| u.ready == 0 && !u.reduced && !(u.managed && u.gathered);
        if engine.units.iter().all(idle) {
            return Ok(());
        }
        let unused: Vec<String> = engine
            .units
            .iter()
            .filter(|u| !u.reduced)
            .flat_map(|u| u.members.iter().zip(&u.fired).filter(|(_, f)| !**f))
            .map(|(&s, _)| engine.shards[s].name.clone())
            .collect();
        if !unused.is_empty() && !engine.options.allow_unused {
            for u in &mut engine.units {
                u.ready = 0;
                u.reduced = false;
                u.fired.iter_mut().for_each(|f| *f = false);
            }
            return Err(Error::Training(format!(
                "sharded model: parameter(s) {unused:?} received no gradient in this step on rank \
                 {}; every rank must produce a gradient for every parameter. Where some may go \
                 without one (a branch the data chooses), say so: \
                 #[accelerate(find_unused_parameters = true)], `find_unused_parameters: true` in \
                 the config file, ACCEL_FIND_UNUSED_PARAMETERS=1, or \
                 .find_unused_parameters(true) on the builder: they then contribute zeros",
                engine.group.rank()
            )));
        }
        for u in 0..engine.units.len() {
            if !engine.units[u].reduced {
                engine.reduce(u)?;
            }
        }
        // Nothing is gathered again in this pass: the buffers are freed as they complete.
        engine.spare.trim();
        while let Some(u) = engine.in_flight.pop_front() {
            engine.complete(u)?;
            engine.spare.trim();
        }
        for u in 0..engine.units.len() {
            // A part computed on the shards whose tied gradient never came.
            if let Some(part) = engine.units[u].shard_part.take() {
                engine.shards[engine.units[u].members[0]].add_to_grad(&part)?;
                engine.update_due = engine.update.is_some();
            }
            let unit = &mut engine.units[u];
            unit.reduced = false;
            unit.backward_reads = false;
            unit.gets_gradient = false;
        }
        engine.guard_gradients()?;
        let due = engine.due_update();
        drop(guard);
        due.map_or(Ok(()), |update| update())
    }

    /// Under `optimizer_in_backward`: applies `update` as units' gradient shards arrive in
    /// backward. One optimizer per model: a second would find its parameters' gradients
    /// gone, applied by the first.
    pub(crate) fn update_in_backward(&self, update: UpdateInBackward) -> Result<()> {
        let mut engine = lock(&self.engine);
        if engine.update.is_some() {
            return Err(Error::Unsupported(
                "optimizer_in_backward applies one optimizer's update of a model inside \
                 backward, and an optimizer over this model was prepared already: give each \
                 model one optimizer (parameter groups give parts of it their own settings), \
                 or set optimizer_in_backward = false"
                    .into(),
            ));
        }
        engine.update = Some(update);
        Ok(())
    }

    /// After the optimizer stepped the master shards: gathers the parameters that stay
    /// whole (zero2; zero3's root) from them. Zero3 units are gathered at their next use.
    pub(crate) fn after_step(&self) -> Result<()> {
        let mut engine = lock(&self.engine);
        // Stepped without a forward since a summon: the whole values are the old ones.
        engine.unsummon()?;
        for u in 0..engine.units.len() {
            // A gather launched before the step holds the old values.
            if let Some((work, _)) = engine.units[u].prefetched.take() {
                work.wait()?;
            }
            if !engine.units[u].managed {
                engine.gather(u)?;
            }
        }
        engine.spare.trim();
        Ok(())
    }

    /// Makes every zero3 parameter whole on this process until training resumes (see
    /// `Engine::summon`; a collective).
    pub(crate) fn summon(&self) -> Result<()> {
        lock(&self.engine).summon()
    }

    /// Bytes that [`summon`](Self::summon) makes whole on this process: the zero3 units'
    /// parameters in the dtypes the model made them.
    pub(crate) fn summon_bytes(&self) -> u64 {
        let engine = lock(&self.engine);
        engine
            .units
            .iter()
            .filter(|u| u.managed)
            .flat_map(|u| u.members.iter().chain(u.frozen.iter().flat_map(|f| &f.members)))
            .map(|&s| {
                (engine.shards[s].numel as usize * engine.shards[s].kind.elt_size_in_bytes()) as u64
            })
            .sum()
    }

    /// The full value of every sharded parameter by [`shim::tensor_id`], gathered from the
    /// master shards, in the dtype the model made it (a collective: every rank must call it).
    pub(crate) fn full_parameters(&self) -> Result<Vec<(usize, Tensor)>> {
        let mut engine = lock(&self.engine);
        engine.write_back()?;
        let mut out = Vec::new();
        for u in 0..engine.units.len() {
            let full = engine.gathered(u)?;
            for (s, full) in engine.units[u].members.iter().zip(full) {
                let shard = &engine.shards[*s];
                out.push((shard.id, full.f_to_kind(shard.kind)?));
            }
            for (s, full) in engine.gathered_frozen(u)? {
                out.push((engine.shards[s].id, full));
            }
        }
        engine.spare.trim();
        Ok(out)
    }
}
