//! [`ShardedModel`]: one model's master shards and units (their flat-buffer collectives in
//! flat.rs), and what training does with them: hooks that reduce-scatter each unit's
//! gradients as backward produces them, zero3's gather before a unit's forward and backward
//! and release after, prefetch in the order of the first pass. See README.md.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex, MutexGuard};

use tch::{Device, Kind, Tensor};

use super::flat::{Engine, Shard, UnitState};
use super::layout::{chunk_of, size_based_units, unit_of};
use super::unit::{PendingUnits, in_model};
use super::{ShardOptions, Stage};
use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::optim::Param;
use crate::shim::{self, PostAccumulateGradHook, add_grad_hook, add_post_accumulate_grad_hook};

/// A model whose gradients (zero2) or gradients and parameters (zero3) are sharded.
pub(crate) struct ShardedModel {
    engine: Arc<Mutex<Engine>>,
    _hooks: Mutex<Vec<PostAccumulateGradHook>>,
}

impl std::fmt::Debug for ShardedModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardedModel").finish_non_exhaustive()
    }
}

fn lock(engine: &Mutex<Engine>) -> MutexGuard<'_, Engine> {
    engine.lock().unwrap_or_else(|e| e.into_inner())
}

impl ShardedModel {
    /// Broadcasts rank 0's values, keeps this rank's share of every trainable parameter as
    /// a master shard, releases the full parameters of zero3 units and hooks the rest.
    ///
    /// `data` spans every data-parallel process (rank 0's values are broadcast over it);
    /// parameters are split across `group`, and under hybrid sharding `replicas` holds the
    /// same shards on the other machines. The [`super::Unit`]s pending in `units` under the
    /// model's names are bound to it.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        params: &[Param],
        units: &PendingUnits,
        data: &dyn Communicator,
        group: Arc<dyn Communicator>,
        replicas: Option<Arc<dyn Communicator>>,
        stage: Stage,
        options: ShardOptions,
        broadcast: bool,
    ) -> Result<Arc<Self>> {
        if broadcast {
            tch::no_grad(|| -> Result<()> {
                for p in params {
                    data.broadcast(&p.tensor, 0)?;
                }
                Ok(())
            })?;
        }
        let (world, rank) = (group.size() as i64, group.rank() as i64);
        let names: Vec<&str> = params.iter().map(|p| p.name.as_str()).collect();
        let handles = units.take(in_model(&names))?;
        let wrapped: BTreeSet<String> = handles.iter().map(|h| h.prefix.clone()).collect();
        let sized = options.min_unit_params.map(|min| {
            let trainable: Vec<(&str, i64)> = params
                .iter()
                .filter(|p| p.tensor.requires_grad())
                .map(|p| (p.name.as_str(), p.tensor.numel() as i64))
                .collect();
            size_based_units(&trainable, min)
        });
        let mut shards = Vec::new();
        let mut units: Vec<UnitState> = Vec::new();
        for p in params.iter().filter(|p| p.tensor.requires_grad()) {
            let (numel, kind) = (p.tensor.numel() as i64, p.tensor.kind());
            let chunk = (numel + world - 1) / world;
            // Zero2 in fp32 keeps whole parameters anyway: a share that needs no padding can
            // be a view of its own parameter instead of a copy (ZeRO-2's 4Ψ + 12Ψ/N, not 16Ψ/N).
            let in_place = stage == Stage::Gradients
                && !options.offload
                && p.tensor.kind() == Kind::Float
                && p.tensor.is_contiguous()
                && (rank + 1) * chunk <= numel;
            let master = tch::no_grad(|| -> Result<Tensor> {
                let flat = p.tensor.f_detach()?.f_reshape([-1])?;
                if in_place {
                    return Ok(flat.f_narrow(0, chunk * rank, chunk)?);
                }
                let device = if options.offload { Device::Cpu } else { p.tensor.device() };
                let master = chunk_of(&flat, rank as usize, world as usize)?
                    .f_to_kind(Kind::Float)?
                    .f_to_device(device)?
                    .f_detach_copy()?;
                // Offloaded from a GPU: page-locked host memory, which the copies of the
                // gradient shards down and the parameter shards up use at full speed.
                Ok(match (options.offload, p.tensor.device()) {
                    (true, Device::Cuda(_)) => crate::shim::pin_memory(&master)?,
                    _ => master,
                })
            })?
            .set_requires_grad(true);
            let prefix = unit_of(&p.name, options.units.as_deref(), &wrapped, sized.as_deref());
            let u = match units.iter().position(|u| u.prefix == prefix) {
                Some(u) => u,
                None => {
                    let managed = stage == Stage::Parameters && wrapped.contains(&prefix);
                    units.push(UnitState {
                        prefix,
                        members: Vec::new(),
                        offsets: Vec::new(),
                        segment: 0,
                        managed,
                        gathered: true,
                        fired: Vec::new(),
                        ready: 0,
                        reducing: None,
                        reduced: false,
                        prefetched: None,
                    });
                    units.len() - 1
                }
            };
            let unit = &mut units[u];
            if let (true, Some(compute)) = (unit.managed, options.param_dtype) {
                // FSDP's MixedPrecision(param_dtype): the module computes (and its gradients
                // come out) in `compute`; the fp32 master above is what the optimizer steps.
                let mut param = p.tensor.shallow_clone();
                let low = tch::no_grad(|| p.tensor.f_detach()?.f_to_kind(compute))?;
                param.f_set_data(&low)?;
            }
            unit.members.push(shards.len());
            unit.offsets.push(unit.segment);
            unit.segment += chunk;
            unit.fired.push(false);
            shards.push(Shard {
                name: p.name.clone(),
                param: p.tensor.shallow_clone(),
                id: shim::tensor_id(&p.tensor)?,
                master,
                numel,
                chunk,
                kind,
            });
        }
        let device = params.first().map_or(Device::Cpu, |p| p.tensor.device());
        let mut engine = Engine {
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
        };
        for u in 0..engine.units.len() {
            if engine.units[u].managed {
                engine.release(u)?;
            }
        }
        let engine = Arc::new(Mutex::new(engine));
        let mut hooks = Vec::new();
        let layout: Vec<(usize, usize, Tensor)> = {
            let engine = lock(&engine);
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
            };
            hooks.push(add_post_accumulate_grad_hook(&param, hook)?);
        }
        let model = Arc::new(Self { engine, _hooks: Mutex::new(hooks) });
        for handle in &handles {
            if let Some(unit) = model.unit(&handle.prefix) {
                handle.bind(&model, unit);
            }
        }
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
        if !engine.order_known {
            if engine.order.contains(&unit) {
                engine.order_known = true;
            } else {
                engine.order.push(unit);
            }
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
        Ok(())
    }

    /// Gathers a unit for its backward, and starts gathering the one whose backward comes
    /// next (the unit before it in the forward pass).
    fn before_backward(&self, unit: usize) -> Result<()> {
        let mut engine = lock(&self.engine);
        if engine.failed {
            return engine.fill_locally(unit);
        }
        if !engine.units[unit].gathered {
            engine.gather(unit)?;
        }
        let previous = engine.order.iter().take_while(|&&u| u != unit).last().copied();
        if let Some(previous) = previous {
            engine.prefetch(previous)?;
        }
        Ok(())
    }

    /// Releases a zero3 unit's parameters after its forward and arranges for them to be
    /// gathered again when the gradient of its output arrives (just before its backward).
    pub(crate) fn after_forward(self: &Arc<Self>, unit: usize, output: &Tensor) -> Result<()> {
        let mut engine = lock(&self.engine);
        if !engine.units[unit].managed {
            return Ok(());
        }
        engine.release(unit)?;
        drop(engine);
        if output.requires_grad() {
            let model = self.clone();
            // Inside autograd an error cannot be returned: it is kept for `finish`.
            add_grad_hook(output, move |_| {
                if let Err(e) = model.before_backward(unit) {
                    model.record(unit, e);
                }
                None
            })?;
        }
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
        if engine.units.iter().all(|u| u.ready == 0 && !u.reduced) {
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
                 {}; every rank must produce a gradient for every parameter (or set \
                 ShardOptions::allow_unused)",
                engine.group.rank()
            )));
        }
        for u in 0..engine.units.len() {
            if !engine.units[u].reduced {
                engine.reduce(u)?;
            }
        }
        while let Some(u) = engine.in_flight.pop_front() {
            engine.complete(u)?;
        }
        for unit in &mut engine.units {
            unit.reduced = false;
        }
        Ok(())
    }

    /// After the optimizer stepped the master shards: gathers the parameters that stay
    /// whole (zero2; zero3's root) from them. Zero3 units are gathered at their next use.
    pub(crate) fn after_step(&self) -> Result<()> {
        let mut engine = lock(&self.engine);
        for u in 0..engine.units.len() {
            // A gather launched before the step holds the old values.
            if let Some((work, _)) = engine.units[u].prefetched.take() {
                work.wait()?;
            }
            if !engine.units[u].managed {
                engine.gather(u)?;
            }
        }
        Ok(())
    }

    /// The full value of every sharded parameter by [`shim::tensor_id`], gathered from the
    /// master shards, in the dtype the model made it (a collective: every rank must call it).
    pub(crate) fn full_parameters(&self) -> Result<Vec<(usize, Tensor)>> {
        let mut engine = lock(&self.engine);
        let mut out = Vec::new();
        for u in 0..engine.units.len() {
            let full = engine.gathered(u)?;
            for (s, full) in engine.units[u].members.iter().zip(full) {
                let shard = &engine.shards[*s];
                out.push((shard.id, full.f_to_kind(shard.kind)?));
            }
        }
        Ok(out)
    }
}
