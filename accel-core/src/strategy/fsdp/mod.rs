//! ZeRO stages 2 and 3 (FSDP's `SHARD_GRAD_OP` and `FULL_SHARD`, and `HYBRID_SHARD` on a
//! replicate × shard mesh): the [`Sharded`] strategy over one engine per model (engine.rs),
//! the layout of shards (layout.rs) and [`Unit`] (unit.rs). See README.md beside this file.

mod engine;
mod flat;
mod layout;
mod spare;
mod unit;
mod vocab;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use tch::{Kind, Tensor};

use super::{Context, ModelOptions, OptimizerPlan, Placement, Strategy, UpdateInBackward};
use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::mesh::{DeviceMesh, Dim};
use crate::optim::{Optimizer, Param};
use crate::sync::Locked;
pub(crate) use engine::ShardedModel;
pub(crate) use layout::chunk_of;
pub(crate) use unit::in_model;
pub use unit::{PendingUnits, Unit};

/// How a sharded model is cut into units and where its shards live.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ShardOptions {
    /// Unit prefixes (e.g. `encoder.layers.0`): a unit's parameters are gathered together
    /// and their gradients reduce-scattered together. `None`: the prefixes of [`Unit`]
    /// wrappers, then each element of a repeated layer list (`layers.{i}`, `layer.{i}`,
    /// `h.{i}`, `blocks.{i}`); every other parameter belongs to the root unit.
    pub units: Option<Vec<String>>,
    /// Instead of the repeated-layer rule: each parameter's unit is the innermost module
    /// (name prefix) holding at least this many elements (FSDP's size-based wrap policy).
    pub min_unit_params: Option<i64>,
    /// Keep the fp32 master shards, and so the optimizer state, in CPU memory.
    pub offload: bool,
    /// Reduce-scatter gradients in this dtype (bf16 or f16) instead of their own.
    pub reduce_dtype: Option<Kind>,
    /// FSDP's `MixedPrecision(param_dtype)`: zero3 units (wrapped in [`Unit`]) are
    /// all-gathered and computed in this dtype (bf16 or f16: half the bytes of both), while
    /// the master shards the optimizer steps stay fp32. Their gradients come out in it and
    /// are reduce-scattered in it unless `reduce_dtype` says otherwise. Needs autocast
    /// (precision bf16 or fp16) for the operations between units.
    pub param_dtype: Option<Kind>,
    /// Parameters may go without a gradient in a step (they contribute zeros).
    pub allow_unused: bool,
    /// `optimizer_in_backward`: each unit's update is applied as soon as its gradient
    /// shard is reduced, and the shard dropped, inside backward.
    pub step_in_backward: bool,
}

/// What is sharded besides the optimizer state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stage {
    /// Gradients (ZeRO-2, `SHARD_GRAD_OP`).
    Gradients,
    /// Gradients and parameters (ZeRO-3, `FULL_SHARD`).
    Parameters,
}

/// ZeRO-2/3: each model's trainable parameters split across the mesh's data-shard
/// processes, replicated across its data-replicate ones (hybrid sharding).
pub struct Sharded {
    stage: Stage,
    options: ShardOptions,
    data: Arc<dyn Communicator>,
    group: Arc<dyn Communicator>,
    replicas: Option<Arc<dyn Communicator>>,
    models: Mutex<Vec<Arc<ShardedModel>>>,
}

impl std::fmt::Debug for Sharded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sharded").field("stage", &self.stage).finish_non_exhaustive()
    }
}

impl Sharded {
    pub(crate) fn new(mesh: &DeviceMesh, stage: Stage, options: ShardOptions) -> Self {
        let replicas = mesh.comm(Dim::DataReplicate);
        Self {
            stage,
            options,
            data: mesh.comm(Dim::Data),
            group: mesh.comm(Dim::DataShard),
            replicas: (replicas.size() > 1).then_some(replicas),
            models: Mutex::new(Vec::new()),
        }
    }

    fn models(&self) -> MutexGuard<'_, Vec<Arc<ShardedModel>>> {
        self.models.locked()
    }

    /// The model holding `param` and its master shard.
    fn master_of(&self, param: &Tensor) -> Result<Option<(Arc<ShardedModel>, Tensor)>> {
        let id = crate::shim::tensor_id(param)?;
        Ok(self.models().iter().find_map(|m| m.master_of(id).map(|t| (m.clone(), t))))
    }

    fn placement(&self, model: &ShardedModel, numel: i64) -> Placement {
        let group = model.group();
        Placement::Chunk {
            index: group.rank(),
            count: group.size(),
            numel,
            write: model.writes_shards(),
        }
    }
}

impl Strategy for Sharded {
    fn name(&self) -> String {
        match (self.stage, self.replicas.is_some()) {
            (Stage::Gradients, _) => "zero2".into(),
            (Stage::Parameters, false) => "zero3".into(),
            (Stage::Parameters, true) => "hybrid_shard".into(),
        }
    }

    fn places_parameters(&self) -> bool {
        true
    }

    fn prepare_model(&self, cx: &Context<'_>, params: &[Param], o: &ModelOptions) -> Result<()> {
        let model = shard_model(
            params,
            cx.units,
            self.data.as_ref(),
            self.group.clone(),
            self.replicas.clone(),
            self.stage,
            self.options.clone(),
            o.sync_module_states,
            cx.device,
            cx.placed,
        )?;
        if let (true, Some(notice)) = (cx.announce, &model.whole_notice) {
            println!("accel: {notice}");
        }
        self.models().push(model);
        Ok(())
    }

    fn prepare_optimizer(
        &self,
        _: &Context<'_>,
        optimizer: &mut dyn Optimizer,
    ) -> Result<Box<dyn OptimizerPlan>> {
        let models = self.models().clone();
        let name = optimizer.name();
        // Under the update inside backward, the models whose masters this optimizer steps
        // (theirs alone: a GAN's two optimizers each take their own model).
        let in_backward = match self.options.step_in_backward {
            true => {
                let ids: Vec<usize> =
                    optimizer.params().iter().map(crate::shim::tensor_id).collect::<Result<_>>()?;
                let owns = |m: &&Arc<ShardedModel>| ids.iter().any(|&id| m.master_of(id).is_some());
                Some(models.iter().filter(owns).cloned().collect())
            }
            false => None,
        };
        let numel: BTreeMap<String, i64> = optimizer
            .param_names()
            .into_iter()
            .zip(optimizer.params())
            .map(|(n, p)| (n, p.numel() as i64))
            .collect();
        optimizer.replace_params(&|param| {
            let id = crate::shim::tensor_id(param)?;
            models.iter().find_map(|m| m.master_of(id)).ok_or_else(|| {
                Error::Unsupported(format!(
                    "{name} steps a tensor {:?} that is not a parameter of a prepared model; \
                     under zero2/zero3 prepare the model before the optimizer",
                    param.size()
                ))
            })
        })?;
        Ok(Box::new(ShardedPlan { group: self.group.clone(), models, numel, in_backward }))
    }

    fn steps_whole_parameters(&self) -> bool {
        false
    }

    fn after_backward(&self, _: &Context<'_>, _sync: bool) -> Result<()> {
        // Reduce-scattered every micro-step (as DeepSpeed's ZeRO-2), so that no rank ever
        // holds a whole accumulated gradient.
        for model in self.models().iter() {
            model.finish()?;
        }
        Ok(())
    }

    fn take_error(&self) -> Result<()> {
        for model in self.models().iter() {
            model.take_error()?;
        }
        Ok(())
    }

    fn parameter(&self, param: &Param) -> Result<(Tensor, Placement)> {
        match self.master_of(&param.tensor)? {
            Some((model, master)) => {
                Ok((master.f_detach()?, self.placement(&model, param.tensor.numel() as i64)))
            }
            None => Ok((param.tensor.f_detach()?, Placement::Replicated)),
        }
    }

    fn load_parameter(&self, param: &Param, whole: &Tensor) -> Result<()> {
        tch::no_grad(|| -> Result<()> {
            match self.master_of(&param.tensor)? {
                Some((model, master)) => {
                    let group = model.group();
                    let mine = chunk_of(whole, group.rank(), group.size())?;
                    master.shallow_clone().f_copy_(&mine)?;
                }
                None => {
                    param.tensor.shallow_clone().f_copy_(whole)?;
                }
            }
            Ok(())
        })
    }

    fn load_part(&self, param: &Param, part: &Tensor) -> Result<()> {
        let (model, master) = self.master_of(&param.tensor)?.ok_or_else(|| Error::Checkpoint {
            path: None,
            message: format!("`{}` is not sharded here, yet was loaded as a shard", param.name),
        })?;
        let _ = model;
        tch::no_grad(|| master.shallow_clone().f_copy_(part))?;
        Ok(())
    }

    fn after_load(&self) -> Result<()> {
        // The whole parameters follow their new master shards.
        for model in self.models().iter() {
            model.after_step()?;
        }
        Ok(())
    }

    fn summon_full_params(&self) -> Result<u64> {
        let mut bytes = 0;
        for model in self.models().clone() {
            model.summon()?;
            bytes += model.summon_bytes();
        }
        Ok(bytes)
    }

    fn full_parameters(&self, params: &[Param]) -> Result<Vec<Tensor>> {
        let ids: Vec<usize> =
            params.iter().map(|p| crate::shim::tensor_id(&p.tensor)).collect::<Result<_>>()?;
        let mut gathered = std::collections::BTreeMap::new();
        for model in self.models().clone() {
            if ids.iter().any(|id| model.master_of(*id).is_some()) {
                gathered.extend(model.full_parameters()?);
            }
        }
        params
            .iter()
            .zip(ids)
            .map(|(p, id)| match gathered.remove(&id) {
                Some(v) => Ok(v),
                None => Ok(p.tensor.f_detach_copy()?),
            })
            .collect()
    }
}

/// An optimizer stepping master shards.
struct ShardedPlan {
    group: Arc<dyn Communicator>,
    models: Vec<Arc<ShardedModel>>,
    /// Elements of the whole parameter behind each master shard, by the optimizer's name.
    numel: BTreeMap<String, i64>,
    /// Under `ShardOptions::step_in_backward`, the models whose masters it steps.
    in_backward: Option<Vec<Arc<ShardedModel>>>,
}

impl ShardedPlan {
    fn chunk(&self, numel: i64) -> i64 {
        let world = self.group.size() as i64;
        (numel + world - 1) / world
    }
}

impl OptimizerPlan for ShardedPlan {
    fn gradient_group(&self) -> Option<Arc<dyn Communicator>> {
        Some(self.group.clone())
    }

    fn after_step(&mut self, _: &mut dyn Optimizer, stepped: bool) -> Result<()> {
        if stepped {
            for model in &self.models {
                model.after_step()?;
            }
        }
        Ok(())
    }

    fn update_in_backward(&mut self, update: &UpdateInBackward) -> Result<bool> {
        let Some(owners) = &self.in_backward else { return Ok(false) };
        for model in owners {
            model.update_in_backward(update.clone())?;
        }
        Ok(true)
    }

    fn state_placement(&self, key: &str, tensor: &Tensor) -> Placement {
        let whole = key.rsplit_once('/').and_then(|(p, _)| self.numel.get(p)).copied();
        match whole {
            // A chunk of the whole's state (moments); scalars (step counts) are replicated.
            Some(numel) if tensor.dim() == 1 && tensor.size()[0] == self.chunk(numel) => {
                Placement::Chunk {
                    index: self.group.rank(),
                    count: self.group.size(),
                    numel,
                    write: self.models.first().is_none_or(|m| m.writes_shards()),
                }
            }
            _ => Placement::Replicated,
        }
    }

    fn state_placement_of(&self, param: &str, numel: i64) -> Placement {
        match self.numel.get(param) {
            Some(&n) if n == numel => Placement::Chunk {
                index: self.group.rank(),
                count: self.group.size(),
                numel,
                write: true,
            },
            _ => Placement::Replicated,
        }
    }
}

/// `params` sharded ([`ShardedModel::place`]) and the [`Unit`]s pending in `units` under
/// their names bound to it (units the attribute wrapped by itself yield to the size-based
/// policy, `ShardOptions::min_unit_params`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn shard_model(
    params: &[Param],
    units: &PendingUnits,
    data: &dyn Communicator,
    group: Arc<dyn Communicator>,
    replicas: Option<Arc<dyn Communicator>>,
    stage: Stage,
    options: ShardOptions,
    broadcast: bool,
    device: tch::Device,
    placed: &std::sync::atomic::AtomicU64,
) -> Result<Arc<ShardedModel>> {
    let names: Vec<&str> = params.iter().map(|p| p.name.as_str()).collect();
    let sizes: Vec<(&str, i64)> =
        params.iter().map(|p| (p.name.as_str(), p.tensor.numel() as i64)).collect();
    let handles: Vec<_> = (units.take(unit::in_model(&names))?.into_iter())
        .filter(|h| match (h.automatic, options.min_unit_params) {
            (true, Some(min)) => layout::unit_size(&sizes, &h.prefix) >= min,
            _ => true,
        })
        .collect();
    let wrapped = handles.iter().map(|h| h.prefix.clone()).collect();
    let model = ShardedModel::place(
        params, &wrapped, data, group, replicas, stage, options, broadcast, device, placed,
    )?;
    for handle in &handles {
        if let Some(unit) = model.unit(&handle.prefix) {
            handle.bind(&model, unit);
        }
    }
    Ok(model)
}

#[cfg(test)]
mod tests;
