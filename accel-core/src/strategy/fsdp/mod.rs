//! ZeRO stages 2 and 3 (FSDP's `SHARD_GRAD_OP` and `FULL_SHARD`); see README.md beside
//! this file.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex, MutexGuard};

use tch::nn::Module;
use tch::{Device, Kind, Tensor};

use crate::comm::{ProcessGroup, Work};
use crate::error::{Error, Result};
use crate::optim::Param;
use crate::shim::{self, PostAccumulateGradHook, add_grad_hook, add_post_accumulate_grad_hook};

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
    /// Parameters may go without a gradient in a step (they contribute zeros).
    pub allow_unused: bool,
}

/// What is sharded besides the optimizer state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stage {
    /// Gradients (ZeRO-2, `SHARD_GRAD_OP`).
    Gradients,
    /// Gradients and parameters (ZeRO-3, `FULL_SHARD`).
    Parameters,
}

/// Layer-list names whose numbered elements become units by default.
const REPEATED: &[&str] = &["layers", "layer", "h", "blocks"];

static WRAPPED: Mutex<BTreeSet<String>> = Mutex::new(BTreeSet::new());

fn wrapped() -> MutexGuard<'static, BTreeSet<String>> {
    WRAPPED.lock().unwrap_or_else(|e| e.into_inner())
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
    prefix: String,
    inner: M,
}

impl<M> Unit<M> {
    /// Wraps `inner`, whose variables live under `path`.
    pub fn new(path: &tch::nn::Path, inner: M) -> Self {
        let prefix = path.components().collect::<Vec<_>>().join(".");
        wrapped().insert(prefix.clone());
        Self { prefix, inner }
    }

    /// The wrapped module.
    pub fn inner(&self) -> &M {
        &self.inner
    }

    /// The variable-name prefix of the unit.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Runs `forward` on the wrapped module with its parameters gathered.
    ///
    /// # Panics
    /// If gathering fails (a peer died or timed out): a forward pass returns a plain
    /// `Tensor` in tch, so the error becomes a panic with the collective's message.
    pub fn run(&self, forward: impl FnOnce(&M) -> Tensor) -> Tensor {
        let Some((model, unit)) = crate::current().and_then(|a| a.sharded_unit(&self.prefix))
        else {
            return forward(&self.inner);
        };
        if let Err(e) = model.before_forward(unit) {
            panic!("zero3: gathering the parameters of unit `{}` failed: {e}", self.prefix);
        }
        let out = forward(&self.inner);
        if let Err(e) = model.after_forward(unit, &out) {
            panic!("zero3: releasing the parameters of unit `{}` failed: {e}", self.prefix);
        }
        out
    }
}

impl<M: Module> Module for Unit<M> {
    fn forward(&self, xs: &Tensor) -> Tensor {
        self.run(|m| m.forward(xs))
    }
}

/// One trainable parameter and this rank's share of it.
struct Shard {
    name: String,
    /// The model's full parameter (freed between uses under zero3).
    param: Tensor,
    id: usize,
    /// This rank's `chunk` elements of the flattened, zero-padded parameter, in fp32: what
    /// the optimizer steps.
    master: Tensor,
    numel: i64,
    chunk: i64,
}

struct UnitState {
    prefix: String,
    /// Indexes into `shards`.
    members: Vec<usize>,
    /// Where each member's chunk starts in a rank's segment of the flat buffers.
    offsets: Vec<i64>,
    /// Elements per rank in the flat buffers.
    segment: i64,
    /// Parameters released outside forward and backward (zero3, wrapped in a [`Unit`]).
    managed: bool,
    gathered: bool,
    fired: Vec<bool>,
    ready: usize,
    reducing: Option<(Work, Tensor)>,
    /// Reduced in the current backward pass.
    reduced: bool,
    /// An all-gather launched ahead of this unit's use (prefetch).
    prefetched: Option<(Work, Tensor)>,
}

struct Engine {
    /// The processes a parameter is split across (all, or one machine's under hybrid).
    group: ProcessGroup,
    /// Hybrid sharding: the processes holding the same shard on other machines.
    replicas: Option<ProcessGroup>,
    options: ShardOptions,
    shards: Vec<Shard>,
    units: Vec<UnitState>,
    error: Option<String>,
    /// Units whose reduce-scatter is in flight, oldest first.
    in_flight: std::collections::VecDeque<usize>,
    /// Zero3 units in the order of the first forward pass, once complete: what to
    /// prefetch next (the following unit in forward, the preceding one in backward).
    order: Vec<usize>,
    order_known: bool,
}

/// Reduce-scatters in flight at once: enough to overlap communication with the backward
/// pass, few enough that their flat buffers (one unit's gradients each) stay a small part
/// of memory.
const MAX_IN_FLIGHT: usize = 2;

/// A model whose gradients (zero2) or gradients and parameters (zero3) are sharded.
pub(crate) struct ShardedModel {
    engine: Arc<Mutex<Engine>>,
    _hooks: Mutex<Vec<PostAccumulateGradHook>>,
}

fn lock(engine: &Mutex<Engine>) -> MutexGuard<'_, Engine> {
    engine.lock().unwrap_or_else(|e| e.into_inner())
}

/// Rank `rank`'s share of a flattened tensor split `world` ways: `ceil(n / world)` elements,
/// zero-padded at the end of the last share.
pub(crate) fn chunk_of(flat: &Tensor, rank: usize, world: usize) -> Result<Tensor> {
    let (n, world) = (flat.numel() as i64, world as i64);
    let chunk = (n + world - 1) / world;
    Ok(flat
        .f_reshape([-1])?
        .f_constant_pad_nd([0, chunk * world - n])?
        .f_narrow(0, chunk * rank as i64, chunk)?
        .f_contiguous()?)
}

/// One member's place in a unit's flat buffer: `[world, chunk]`, row r being rank r's chunk.
fn columns(buffer: &Tensor, world: i64, segment: i64, offset: i64, chunk: i64) -> Result<Tensor> {
    Ok(buffer.f_view([world, segment])?.f_narrow(1, offset, chunk)?)
}

/// Copies the `numel` elements of `flat` into `columns` in row-major order (the padding
/// left as it is), without a padded temporary.
fn copy_into_columns(columns: &Tensor, flat: &Tensor, numel: i64, chunk: i64) -> Result<()> {
    let (rows, rest) = (numel / chunk.max(1), numel % chunk.max(1));
    if rows > 0 {
        let source = flat.f_narrow(0, 0, rows * chunk)?.f_view([rows, chunk])?;
        columns.f_narrow(0, 0, rows)?.f_copy_(&source)?;
    }
    if rest > 0 {
        let source = flat.f_narrow(0, rows * chunk, rest)?;
        columns.f_select(0, rows)?.f_narrow(0, 0, rest)?.f_copy_(&source)?;
    }
    Ok(())
}

/// The inverse of [`copy_into_columns`]: the first `numel` elements of `columns`, in
/// row-major order, into `flat`.
fn copy_from_columns(columns: &Tensor, flat: &Tensor, numel: i64, chunk: i64) -> Result<()> {
    let (rows, rest) = (numel / chunk.max(1), numel % chunk.max(1));
    if rows > 0 {
        let mut target = flat.f_narrow(0, 0, rows * chunk)?.f_view([rows, chunk])?;
        target.f_copy_(&columns.f_narrow(0, 0, rows)?)?;
    }
    if rest > 0 {
        let source = columns.f_select(0, rows)?.f_narrow(0, 0, rest)?;
        flat.f_narrow(0, rows * chunk, rest)?.f_copy_(&source)?;
    }
    Ok(())
}

/// For each parameter, the innermost module prefix holding at least `min` elements (none:
/// the root); the distinct prefixes, for [`unit_of`].
fn size_based_units(params: &[(&str, i64)], min: i64) -> Vec<String> {
    let mut totals: std::collections::BTreeMap<String, i64> = Default::default();
    for (name, numel) in params {
        let parts: Vec<&str> = name.split('.').collect();
        for end in 1..parts.len() {
            *totals.entry(parts[..end].join(".")).or_default() += numel;
        }
    }
    let mut units = BTreeSet::new();
    for (name, _) in params {
        let parts: Vec<&str> = name.split('.').collect();
        if let Some(end) =
            (1..parts.len()).rev().find(|&end| totals[&parts[..end].join(".")] >= min)
        {
            units.insert(parts[..end].join("."));
        }
    }
    units.into_iter().collect()
}

/// The unit prefix of parameter `name`: the longest matching explicit or wrapped prefix,
/// else the longest size-based one (when `sized` is given), else its repeated-layer
/// element (`....layers.3`), else the root (`""`).
fn unit_of(
    name: &str,
    explicit: Option<&[String]>,
    wrapped: &BTreeSet<String>,
    sized: Option<&[String]>,
) -> String {
    let longest = |prefixes: &mut dyn Iterator<Item = &String>| {
        prefixes.filter(|p| name.starts_with(&format!("{p}."))).max_by_key(|p| p.len()).cloned()
    };
    if let Some(list) = explicit {
        return longest(&mut list.iter()).unwrap_or_default();
    }
    if let Some(p) = longest(&mut wrapped.iter()) {
        return p;
    }
    if let Some(list) = sized {
        return longest(&mut list.iter()).unwrap_or_default();
    }
    let parts: Vec<&str> = name.split('.').collect();
    for i in 0..parts.len().saturating_sub(2) {
        if REPEATED.contains(&parts[i]) && parts[i + 1].parse::<u64>().is_ok() {
            return parts[..i + 2].join(".");
        }
    }
    String::new()
}

impl ShardedModel {
    /// Broadcasts rank 0's values, keeps this rank's share of every trainable parameter as
    /// a master shard, releases the full parameters of zero3 units and hooks the rest.
    pub(crate) fn new(
        params: &[Param],
        everyone: &ProcessGroup,
        groups: (ProcessGroup, Option<ProcessGroup>),
        stage: Stage,
        options: ShardOptions,
    ) -> Result<Self> {
        let (group, replicas) = groups;
        tch::no_grad(|| -> Result<()> {
            for p in params {
                everyone.broadcast(&p.tensor, 0)?;
            }
            Ok(())
        })?;
        let (world, rank) = (group.size() as i64, group.rank() as i64);
        let wrapped = wrapped().clone();
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
            let numel = p.tensor.numel() as i64;
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
                Ok(chunk_of(&flat, rank as usize, world as usize)?
                    .f_to_kind(Kind::Float)?
                    .f_to_device(device)?
                    .f_detach_copy()?)
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
            });
        }
        let mut engine = Engine {
            group,
            replicas,
            options,
            shards,
            units,
            error: None,
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
                if unit.ready == unit.members.len() {
                    if let Err(e) = guard.reduce(u) {
                        guard.error.get_or_insert(e.to_string());
                    }
                }
            };
            hooks.push(add_post_accumulate_grad_hook(&param, hook)?);
        }
        Ok(Self { engine, _hooks: Mutex::new(hooks) })
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

    /// The processes each parameter is split across.
    pub(crate) fn group(&self) -> ProcessGroup {
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
            let prefix = lock(&self.engine).units[unit].prefix.clone();
            add_grad_hook(output, move |_| {
                if let Err(e) = model.before_backward(unit) {
                    panic!("zero3: gathering unit `{prefix}` for its backward failed: {e}");
                }
                None
            })?;
        }
        Ok(())
    }

    /// After each backward: launches the reductions no hook launched (units some of whose
    /// parameters got no gradient), waits for all, and adds this rank's averaged share into
    /// the master shards' gradients.
    pub(crate) fn finish(&self) -> Result<()> {
        let mut guard = lock(&self.engine);
        let engine = &mut *guard;
        if let Some(e) = engine.error.take() {
            return Err(Error::Training(format!("sharded gradient hook failed: {e}")));
        }
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
    /// master shards (a collective: every rank must call it).
    pub(crate) fn full_parameters(&self) -> Result<Vec<(usize, Tensor)>> {
        let mut engine = lock(&self.engine);
        let mut out = Vec::new();
        for u in 0..engine.units.len() {
            let full = engine.gathered(u)?;
            for (s, full) in engine.units[u].members.iter().zip(full) {
                out.push((engine.shards[*s].id, full));
            }
        }
        Ok(out)
    }
}

impl Engine {
    /// Flattens the unit's gradients rank-major (every rank's chunks of every member
    /// side by side), drops the full gradients and launches the reduce-scatter.
    fn reduce(&mut self, u: usize) -> Result<()> {
        let world = self.group.size() as i64;
        let unit = &mut self.units[u];
        let kind = match (self.options.reduce_dtype, unit.members.first()) {
            (Some(kind), _) => kind,
            (None, Some(&s)) => self.shards[s].param.kind(),
            (None, None) => Kind::Float,
        };
        // Zeros: padding, and parameters that got no gradient, contribute nothing.
        let buffer = Tensor::f_zeros([world * unit.segment], (kind, Device::Cpu))?;
        tch::no_grad(|| -> Result<()> {
            for (&s, &offset) in unit.members.iter().zip(&unit.offsets) {
                let shard = &self.shards[s];
                let grad = shard.param.grad();
                if grad.defined() {
                    let columns = columns(&buffer, world, unit.segment, offset, shard.chunk)?;
                    copy_into_columns(&columns, &grad.f_reshape([-1])?, shard.numel, shard.chunk)?;
                }
                shim::set_grad(&shard.param, None)?;
            }
            Ok(())
        })?;
        unit.fired.iter_mut().for_each(|f| *f = false);
        unit.ready = 0;
        let work = self.group.reduce_scatter_in_place_async(&buffer)?;
        self.units[u].reducing = Some((work, buffer));
        self.units[u].reduced = true;
        self.in_flight.push_back(u);
        if self.units[u].managed {
            self.release(u)?;
        }
        while self.in_flight.len() > MAX_IN_FLIGHT {
            let oldest = self.in_flight.pop_front().expect("non-empty");
            self.complete(oldest)?;
        }
        Ok(())
    }

    /// Waits for unit `u`'s reduce-scatter and adds this rank's averaged share into the
    /// master shards' gradients (the buffer is then dropped).
    fn complete(&mut self, u: usize) -> Result<()> {
        let unit = &mut self.units[u];
        let Some((work, buffer)) = unit.reducing.take() else { return Ok(()) };
        work.wait()?;
        let rank = self.group.rank() as i64;
        let mine = buffer.f_narrow(0, rank * unit.segment, unit.segment)?;
        let mut world = self.group.size() as i64;
        if let Some(replicas) = &self.replicas {
            // Every machine reduced its own processes' gradients; sum the machines'.
            replicas.all_reduce(&mine, crate::comm::ReduceOp::Sum)?;
            world *= replicas.size() as i64;
        }
        tch::no_grad(|| -> Result<()> {
            for (&s, &offset) in unit.members.iter().zip(&unit.offsets) {
                let shard = &self.shards[s];
                let part = mine
                    .f_narrow(0, offset, shard.chunk)?
                    .f_to_kind(Kind::Float)?
                    .f_to_device(shard.master.device())?
                    .f_div_scalar(world as f64)?;
                let mut grad = shard.master.grad();
                if grad.defined() {
                    let _ = grad.f_add_(&part)?;
                } else {
                    shim::set_grad(&shard.master, Some(&part))?;
                }
            }
            Ok(())
        })
    }

    /// The unit's flat buffer holding this rank's master shards in its segment.
    fn own_shards_buffer(&self, u: usize) -> Result<Tensor> {
        let unit = &self.units[u];
        let (world, rank) = (self.group.size() as i64, self.group.rank() as i64);
        let buffer = Tensor::f_empty([world * unit.segment], (Kind::Float, Device::Cpu))?;
        let mine = buffer.f_narrow(0, rank * unit.segment, unit.segment)?;
        for (&s, &offset) in unit.members.iter().zip(&unit.offsets) {
            let shard = &self.shards[s];
            mine.f_narrow(0, offset, shard.chunk)?.f_copy_(&shard.master.f_detach()?)?;
        }
        Ok(buffer)
    }

    /// The unit's flat buffer with every rank's master shards, all-gathered (or the
    /// prefetched one).
    fn all_gathered(&mut self, u: usize) -> Result<Tensor> {
        if let Some((work, buffer)) = self.units[u].prefetched.take() {
            work.wait()?;
            return Ok(buffer);
        }
        let buffer = self.own_shards_buffer(u)?;
        self.group.all_gather_in_place_async(&buffer)?.wait()?;
        Ok(buffer)
    }

    /// The unit's full parameters as new tensors.
    fn gathered(&mut self, u: usize) -> Result<Vec<Tensor>> {
        let buffer = self.all_gathered(u)?;
        let unit = &self.units[u];
        let world = self.group.size() as i64;
        unit.members
            .iter()
            .zip(&unit.offsets)
            .map(|(&s, &offset)| {
                let shard = &self.shards[s];
                let whole = Tensor::f_empty([shard.numel], (Kind::Float, Device::Cpu))?;
                let columns = columns(&buffer, world, unit.segment, offset, shard.chunk)?;
                copy_from_columns(&columns, &whole, shard.numel, shard.chunk)?;
                Ok(whole.f_view(shard.param.size().as_slice())?)
            })
            .collect()
    }

    /// Writes the gathered values into the unit's parameters (allocating them first if
    /// they were released).
    fn gather(&mut self, u: usize) -> Result<()> {
        let buffer = self.all_gathered(u)?;
        let unit = &self.units[u];
        let world = self.group.size() as i64;
        tch::no_grad(|| -> Result<()> {
            for (&s, &offset) in unit.members.iter().zip(&unit.offsets) {
                let shard = &self.shards[s];
                let param = &shard.param;
                if !unit.gathered {
                    let bytes = param.numel() * param.kind().elt_size_in_bytes();
                    shim::allocate_storage(param, bytes as u64)?;
                }
                // Through `.data`: autograd saved these parameters in the forward, and a
                // write that bumped their version would make backward refuse them.
                let target = param.f_data()?.f_view([-1])?;
                let columns = columns(&buffer, world, unit.segment, offset, shard.chunk)?;
                copy_from_columns(&columns, &target, shard.numel, shard.chunk)?;
            }
            Ok(())
        })?;
        self.units[u].gathered = true;
        Ok(())
    }

    /// Launches the all-gather of a released zero3 unit without waiting; `gather` uses it.
    fn prefetch(&mut self, u: usize) -> Result<()> {
        let unit = &self.units[u];
        if !unit.managed || unit.gathered || unit.prefetched.is_some() {
            return Ok(());
        }
        let buffer = self.own_shards_buffer(u)?;
        let work = self.group.all_gather_in_place_async(&buffer)?;
        self.units[u].prefetched = Some((work, buffer));
        Ok(())
    }

    /// Releases the memory of a zero3 unit's full parameters.
    fn release(&mut self, u: usize) -> Result<()> {
        if let Some((work, _)) = self.units[u].prefetched.take() {
            // Gathered ahead but not used: finish the collective (every rank launched it).
            work.wait()?;
        }
        let unit = &mut self.units[u];
        if !unit.gathered {
            return Ok(());
        }
        for &s in &unit.members {
            let param = &self.shards[s].param;
            let whole = param.numel() * param.kind().elt_size_in_bytes();
            if !param.is_contiguous() || shim::storage_nbytes(param)? != whole as u64 {
                return Err(Error::Unsupported(format!(
                    "zero3: parameter {} shares its storage with other tensors, so its memory \
                     cannot be released on its own; give it a storage of its own",
                    self.shards[s].name
                )));
            }
            // SAFETY: the unit is marked released; nothing reads it until `gather`
            // allocates it again (a [`Unit`] does before its forward and its backward).
            unsafe { shim::free_storage(param)? };
        }
        unit.gathered = false;
        Ok(())
    }
}

#[cfg(test)]
mod tests;
