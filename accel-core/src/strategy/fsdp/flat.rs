//! One sharded model's state and its flat-buffer collectives: every rank's chunks of a
//! unit's members laid out rank-major in one buffer, reduce-scattered for gradients and
//! all-gathered for parameters; zero3's release of a unit's memory and its prefetch.

use std::sync::Arc;

use tch::{Device, Kind, Tensor};

use super::ShardOptions;
use super::layout::{columns, copy_from_columns, copy_into_columns};
use super::spare::Spare;
use crate::comm::{Communicator, ReduceOp, Work};
use crate::error::{Error, Result};
use crate::optim::Param;
use crate::shim;
use crate::strategy::UpdateInBackward;

/// One trainable parameter and this rank's share of it.
pub(super) struct Shard {
    pub(super) name: String,
    /// The model's full parameter (freed between uses under zero3).
    pub(super) param: Tensor,
    pub(super) id: usize,
    /// This rank's `chunk` elements of the flattened, zero-padded parameter, in fp32: what
    /// the optimizer steps.
    pub(super) master: Tensor,
    pub(super) numel: i64,
    pub(super) chunk: i64,
    /// The parameter's dtype as the model made it (before any `param_dtype`).
    pub(super) kind: Kind,
}

pub(super) struct UnitState {
    pub(super) prefix: String,
    /// Indexes into `shards`.
    pub(super) members: Vec<usize>,
    /// Where each member's chunk starts in a rank's segment of the flat buffers.
    pub(super) offsets: Vec<i64>,
    /// Elements per rank in the flat buffers.
    pub(super) segment: i64,
    /// Parameters released outside forward and backward (zero3, wrapped in a [`Unit`]).
    pub(super) managed: bool,
    pub(super) gathered: bool,
    pub(super) fired: Vec<bool>,
    pub(super) ready: usize,
    pub(super) reducing: Option<(Work, Tensor)>,
    /// Reduced in the current backward pass.
    pub(super) reduced: bool,
    /// An all-gather launched ahead of this unit's use (prefetch).
    pub(super) prefetched: Option<(Work, Tensor)>,
    /// Its frozen parameters, sharded too when the unit is released at rest.
    pub(super) frozen: Option<Frozen>,
    /// Its backward in this pass reads its parameters (a forward of it other than
    /// `Unit::linear_cross_entropy` or `Unit::embedding` ran): backward gathers it, and
    /// so prefetches it.
    pub(super) backward_reads: bool,
    /// Its last forward ran on its shards (vocab.rs), never gathered: not prefetched.
    pub(super) on_shards: bool,
    /// A forward of its parameters whose output needs a gradient ran in this pass: their
    /// gradient comes through autograd (an embedding tied to a head computed on its shards
    /// adds its part then, and the update inside backward waits for it).
    pub(super) gets_gradient: bool,
    /// The gradient computed on its shards (vocab.rs) while a forward of its parameters
    /// sends one through autograd: added with that one's reduction, so that the update
    /// inside backward, which applies to every gradient there, sees their sum.
    pub(super) shard_part: Option<Tensor>,
}

/// A zero3 unit's parameters that get no gradient (LoRA's frozen base): sharded as its
/// trainable ones are, in their own dtype, all-gathered with the unit in a flat buffer of
/// their own and never reduced (no gradient, no optimizer state). Their shards are what a
/// checkpoint keeps of them.
pub(super) struct Frozen {
    /// Indexes into `shards`.
    pub(super) members: Vec<usize>,
    pub(super) offsets: Vec<i64>,
    pub(super) segment: i64,
    pub(super) kind: Kind,
    pub(super) prefetched: Option<(Work, Tensor)>,
}

impl Shard {
    /// The shard of `p` whose fp32 (or frozen) values of this rank are `master`; `kind` is
    /// the dtype the model made `p` in (zero3 may have released it in another since).
    pub(super) fn of(p: &Param, master: Tensor, chunk: i64, kind: Kind) -> Result<Self> {
        Ok(Self {
            name: p.name.clone(),
            param: p.tensor.shallow_clone(),
            id: shim::tensor_id(&p.tensor)?,
            master,
            numel: p.tensor.numel() as i64,
            chunk,
            kind,
        })
    }

    /// Adds `part` (this rank's averaged share of a reduced gradient) into the master's.
    pub(super) fn add_to_grad(&self, part: &Tensor) -> Result<()> {
        let mut grad = self.master.grad();
        if grad.defined() {
            let _ = grad.f_add_(part)?;
            Ok(())
        } else {
            shim::set_grad(&self.master, Some(part))
        }
    }
}

impl UnitState {
    /// A unit with no member yet; a zero3 (`managed`) unit's parameters are placed
    /// released.
    pub(super) fn new(prefix: String, managed: bool) -> Self {
        Self {
            prefix,
            members: Vec::new(),
            offsets: Vec::new(),
            segment: 0,
            managed,
            gathered: !managed,
            fired: Vec::new(),
            ready: 0,
            reducing: None,
            reduced: false,
            prefetched: None,
            frozen: None,
            backward_reads: false,
            on_shards: false,
            gets_gradient: false,
            shard_part: None,
        }
    }
}

impl Frozen {
    /// No member yet; its buffers hold `kind`.
    pub(super) fn new(kind: Kind) -> Self {
        Self { members: Vec::new(), offsets: Vec::new(), segment: 0, kind, prefetched: None }
    }
}

pub(super) struct Engine {
    /// The processes a parameter is split across (all, or one machine's under hybrid).
    pub(super) group: Arc<dyn Communicator>,
    /// Where the flat buffers live: the parameters' device (the GPU under NCCL).
    pub(super) device: Device,
    /// Hybrid sharding: the processes holding the same shard on other machines.
    pub(super) replicas: Option<Arc<dyn Communicator>>,
    pub(super) options: ShardOptions,
    pub(super) shards: Vec<Shard>,
    pub(super) units: Vec<UnitState>,
    /// The first failure inside a hook or an infallible forward, until the next accelerator
    /// call returns it.
    pub(super) error: Option<Error>,
    /// A collective of this model failed: the rest of the pass runs without any (on
    /// zeros), so that the error reaches the caller now instead of after one timeout per
    /// unit.
    pub(super) failed: bool,
    /// Units whose reduce-scatter is in flight, oldest first.
    pub(super) in_flight: std::collections::VecDeque<usize>,
    /// Zero3 units in the order of the first forward pass, once complete: what to
    /// prefetch next (the following unit in forward, the preceding one in backward).
    pub(super) order: Vec<usize>,
    pub(super) order_known: bool,
    /// `optimizer_in_backward`: the optimizer's update, applied once reduced gradient
    /// shards are in the masters' `.grad` (`update_due`).
    pub(super) update: Option<UpdateInBackward>,
    pub(super) update_due: bool,
    /// Memory of released units and finished flat buffers, for the next unit (CPU only).
    pub(super) spare: Spare,
    /// After [`summon`](Engine::summon): each zero3 parameter made whole for the program to
    /// read (shard, its version then, the dtype it is released in), until training resumes.
    pub(super) summoned: Option<Vec<(usize, i64, Kind)>>,
}

/// Makes `param` (named `name`) a parameter of `kind` on `device` whose storage holds no
/// memory and refuses reads with [`released_message`]; its other handles follow it.
pub(super) fn release_as(
    param: &Tensor,
    name: &str,
    kind: Kind,
    device: Device,
    rank: usize,
) -> Result<()> {
    own_storage(param, name)?;
    let like = Tensor::f_empty([0], (kind, device))?;
    let released = shim::released(&like, param)?;
    tch::no_grad(|| param.shallow_clone().set_data(&released));
    shim::set_released_message(param, &released_message(name, rank))
}

/// What a read of zero3 parameter `name` says while it is released on `rank`.
pub(super) fn released_message(name: &str, rank: usize) -> String {
    format!(
        "accel: `{name}` is a zero3 parameter, released on rank {rank} between its unit's uses: \
         it holds no values outside the unit's forward and backward. Read the model after its \
         training loop (#[accelerate] gathers it whole there for code that reads it), or call \
         `accelerator.summon_full_params()?` on every process before reading it (or \
         `accelerator.full_state_dict(&vs)?` for whole copies)"
    )
}

/// Checks that parameter `name` (`tensor`) has a storage of its own, which zero3 can
/// release without taking memory from other tensors.
pub(super) fn own_storage(tensor: &Tensor, name: &str) -> Result<()> {
    let whole = (tensor.numel() * tensor.kind().elt_size_in_bytes()) as u64;
    if tensor.is_contiguous() && shim::storage_nbytes(tensor)? == whole {
        return Ok(());
    }
    Err(Error::Unsupported(format!(
        "zero3: parameter `{name}` is a view into a storage it shares with other tensors (often \
         a tied weight, such as an embedding reused as the output layer, or a tensor cut from \
         another with `narrow`/`view`), so its memory cannot be released on its own. Give it a \
         storage of its own (`.copy()`), or tie weights by using one module in both places and \
         keep its users inside one Unit"
    )))
}

/// Reduce-scatters in flight at once: enough to overlap communication with the backward
/// pass, few enough that their flat buffers (one unit's gradients each) stay a small part
/// of memory.
const MAX_IN_FLIGHT: usize = 2;

impl Engine {
    /// Flattens the unit's gradients rank-major (every rank's chunks of every member
    /// side by side), drops the full gradients and launches the reduce-scatter.
    pub(super) fn reduce(&mut self, u: usize) -> Result<()> {
        let world = self.group.size() as i64;
        let unit = &mut self.units[u];
        if unit.members.is_empty() {
            // Frozen only: nothing to reduce; released once its backward is done.
            unit.reduced = true;
            return if unit.managed { self.release(u) } else { Ok(()) };
        }
        let kind = match (self.options.reduce_dtype, unit.members.first()) {
            (Some(kind), _) => kind,
            (None, Some(&s)) => self.shards[s].param.kind(),
            (None, None) => Kind::Float,
        };
        if let Some(buffer) = self.gradient_as_buffer(u, kind)? {
            return self.launch_reduce(u, buffer);
        }
        // Completed first (as many as after the launch), so that this unit's buffer can be
        // the memory of the one completed.
        while self.in_flight.len() >= MAX_IN_FLIGHT {
            let oldest = self.in_flight.pop_front().expect("non-empty");
            self.complete(oldest)?;
        }
        // Zeros: padding, and parameters that got no gradient, contribute nothing.
        let buffer = self.spare.zeros(world * self.units[u].segment, kind, self.device)?;
        let unit = &self.units[u];
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
        self.launch_reduce(u, buffer)
    }

    /// The gradient of a unit of one parameter, flattened, when it already is the flat
    /// buffer's layout (no padding, contiguous, in `kind`, on the device): reduced where
    /// autograd left it instead of copied, so that the gradient and its copy are never both
    /// in memory (the head and the embedding of a language model: their size each). The
    /// parameter lets go of it; it was autograd's own (accumulated, never a view of another
    /// tensor's values).
    fn gradient_as_buffer(&self, u: usize, kind: Kind) -> Result<Option<Tensor>> {
        let unit = &self.units[u];
        let world = self.group.size() as i64;
        let [s] = unit.members[..] else { return Ok(None) };
        let shard = &self.shards[s];
        let grad = shard.param.grad();
        let fits = grad.defined()
            && world * unit.segment == shard.numel
            && grad.kind() == kind
            && grad.device() == self.device
            && grad.is_contiguous()
            && shim::storage_nbytes(&grad)?
                == (shard.numel as usize * kind.elt_size_in_bytes()) as u64;
        if !fits {
            return Ok(None);
        }
        let buffer = grad.f_detach()?.f_view([-1])?;
        shim::set_grad(&shard.param, None)?;
        Ok(Some(buffer))
    }

    /// Launches unit `u`'s reduce-scatter of `buffer` (its gradients, laid out flat) and
    /// releases a zero3 unit's parameters.
    fn launch_reduce(&mut self, u: usize, buffer: Tensor) -> Result<()> {
        let unit = &mut self.units[u];
        unit.fired.iter_mut().for_each(|f| *f = false);
        unit.ready = 0;
        let work = self.group.reduce_scatter_in_place_async(&buffer, ReduceOp::Sum)?;
        self.units[u].reducing = Some((work, buffer));
        self.units[u].reduced = true;
        self.in_flight.push_back(u);
        if self.units[u].managed {
            self.release(u)?;
            if self.order.first() == Some(&u) {
                // The backward pass's last unit: no gather follows.
                self.spare.trim();
            }
        }
        while self.in_flight.len() > MAX_IN_FLIGHT {
            let oldest = self.in_flight.pop_front().expect("non-empty");
            self.complete(oldest)?;
        }
        Ok(())
    }

    /// Waits for unit `u`'s reduce-scatter and adds this rank's averaged share into the
    /// master shards' gradients (the buffer is then dropped).
    pub(super) fn complete(&mut self, u: usize) -> Result<()> {
        let unit = &mut self.units[u];
        let Some((work, buffer)) = unit.reducing.take() else { return Ok(()) };
        work.wait()?;
        let rank = self.group.rank() as i64;
        let mine = buffer.f_narrow(0, rank * unit.segment, unit.segment)?;
        let mut world = self.group.size() as i64;
        if let Some(replicas) = &self.replicas {
            // Every machine reduced its own processes' gradients; sum the machines'.
            replicas.all_reduce(&mine, ReduceOp::Sum)?;
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
                shard.add_to_grad(&part)?;
            }
            match (unit.shard_part.take(), unit.members.first()) {
                (Some(part), Some(&s)) => self.shards[s].add_to_grad(&part),
                _ => Ok(()),
            }
        })?;
        drop(mine);
        self.spare.recycle(buffer)?;
        self.update_due = self.update.is_some();
        Ok(())
    }

    /// The update to apply now, once (optimizer_in_backward, after a unit's shards got
    /// their gradient). Called under the engine's lock; applied after it is dropped, since
    /// the update locks the optimizer, whose step locks this engine.
    pub(super) fn due_update(&mut self) -> Option<UpdateInBackward> {
        if !self.update_due || self.failed {
            return None;
        }
        self.update_due = false;
        self.update.clone()
    }

    /// The dtype unit `u`'s parameters are gathered and computed in: `param_dtype` for
    /// zero3 units, fp32 for the rest.
    fn compute_kind(&self, u: usize) -> Kind {
        match (self.units[u].managed, self.options.param_dtype) {
            (true, Some(kind)) => kind,
            _ => Kind::Float,
        }
    }

    /// The unit's flat buffer (in `kind`) holding this rank's master shards in its segment.
    fn own_shards_buffer(&mut self, u: usize, kind: Kind) -> Result<Tensor> {
        let (world, rank) = (self.group.size() as i64, self.group.rank() as i64);
        let buffer = self.spare.empty(world * self.units[u].segment, kind, self.device)?;
        let unit = &self.units[u];
        let mine = buffer.f_narrow(0, rank * unit.segment, unit.segment)?;
        for (&s, &offset) in unit.members.iter().zip(&unit.offsets) {
            let shard = &self.shards[s];
            mine.f_narrow(0, offset, shard.chunk)?.f_copy_(&shard.master.f_detach()?)?;
        }
        Ok(buffer)
    }

    /// The flat buffer of unit `u`'s frozen parameters holding this rank's shards.
    fn own_frozen_buffer(&mut self, u: usize) -> Result<Option<Tensor>> {
        let Some(frozen) = &self.units[u].frozen else { return Ok(None) };
        let (world, rank) = (self.group.size() as i64, self.group.rank() as i64);
        let (numel, kind) = (world * frozen.segment, frozen.kind);
        let buffer = self.spare.empty(numel, kind, self.device)?;
        let frozen = self.units[u].frozen.as_ref().expect("checked above");
        let mine = buffer.f_narrow(0, rank * frozen.segment, frozen.segment)?;
        for (&s, &offset) in frozen.members.iter().zip(&frozen.offsets) {
            let shard = &self.shards[s];
            mine.f_narrow(0, offset, shard.chunk)?.f_copy_(&shard.master)?;
        }
        Ok(Some(buffer))
    }

    /// The flat buffer of unit `u`'s frozen parameters with every rank's shards (the
    /// prefetched one, or gathered now); `None` for a unit without any.
    fn frozen_gathered(&mut self, u: usize) -> Result<Option<Tensor>> {
        if let Some((work, buffer)) =
            self.units[u].frozen.as_mut().and_then(|f| f.prefetched.take())
        {
            work.wait()?;
            return Ok(Some(buffer));
        }
        let Some(buffer) = self.own_frozen_buffer(u)? else { return Ok(None) };
        self.group.all_gather_in_place_async(&buffer)?.wait()?;
        Ok(Some(buffer))
    }

    /// Unit `u`'s frozen parameters as new tensors, whole (their own dtype).
    pub(super) fn gathered_frozen(&mut self, u: usize) -> Result<Vec<(usize, Tensor)>> {
        let Some(buffer) = self.frozen_gathered(u)? else { return Ok(Vec::new()) };
        let frozen = self.units[u].frozen.as_ref().expect("gathered above");
        let world = self.group.size() as i64;
        let wholes = frozen
            .members
            .iter()
            .zip(&frozen.offsets)
            .map(|(&s, &offset)| {
                let shard = &self.shards[s];
                let whole = Tensor::f_empty([shard.numel], (frozen.kind, self.device))?;
                let columns = columns(&buffer, world, frozen.segment, offset, shard.chunk)?;
                copy_from_columns(&columns, &whole, shard.numel, shard.chunk)?;
                Ok((s, whole.f_view(shard.param.size().as_slice())?))
            })
            .collect::<Result<_>>()?;
        self.spare.recycle(buffer)?;
        Ok(wholes)
    }

    /// The unit's flat buffer with every rank's master shards, all-gathered in `kind` (or
    /// the prefetched one, if it is in `kind`).
    fn all_gathered(&mut self, u: usize, kind: Kind) -> Result<Tensor> {
        if let Some((work, buffer)) = self.units[u].prefetched.take() {
            // Every rank launched it: it completes even when its dtype is not the one wanted.
            work.wait()?;
            if buffer.kind() == kind {
                return Ok(buffer);
            }
            self.spare.recycle(buffer)?;
        }
        let buffer = self.own_shards_buffer(u, kind)?;
        // (A unit of frozen parameters only has nothing here to gather.)
        if self.units[u].segment > 0 {
            self.group.all_gather_in_place_async(&buffer)?.wait()?;
        }
        Ok(buffer)
    }

    /// The unit's full parameters as new fp32 tensors (the masters' values, whatever dtype
    /// the unit computes in).
    pub(super) fn gathered(&mut self, u: usize) -> Result<Vec<Tensor>> {
        let buffer = self.all_gathered(u, Kind::Float)?;
        let unit = &self.units[u];
        let world = self.group.size() as i64;
        let wholes = unit
            .members
            .iter()
            .zip(&unit.offsets)
            .map(|(&s, &offset)| {
                let shard = &self.shards[s];
                let whole = Tensor::f_empty([shard.numel], (Kind::Float, self.device))?;
                let columns = columns(&buffer, world, unit.segment, offset, shard.chunk)?;
                copy_from_columns(&columns, &whole, shard.numel, shard.chunk)?;
                Ok(whole.f_view(shard.param.size().as_slice())?)
            })
            .collect::<Result<_>>()?;
        self.spare.recycle(buffer)?;
        Ok(wholes)
    }

    /// Writes the gathered values into the unit's parameters (giving them memory first if
    /// they were released).
    pub(super) fn gather(&mut self, u: usize) -> Result<()> {
        if !self.units[u].gathered {
            // Before the flat buffers: a kept block of the last unit's parameters is taken
            // by these ones.
            for s in self.released_members(u) {
                let param = &self.shards[s].param;
                let bytes = param.numel() * param.kind().elt_size_in_bytes();
                self.spare.allocate(param, bytes as u64)?;
            }
        }
        let buffer = self.all_gathered(u, self.compute_kind(u))?;
        let frozen = self.frozen_gathered(u)?;
        let unit = &self.units[u];
        let world = self.group.size() as i64;
        let mut parts = vec![(&unit.members, &unit.offsets, unit.segment, &buffer)];
        if let (Some(f), Some(buffer)) = (&unit.frozen, &frozen) {
            parts.push((&f.members, &f.offsets, f.segment, buffer));
        }
        tch::no_grad(|| -> Result<()> {
            for (members, offsets, segment, buffer) in parts {
                for (&s, &offset) in members.iter().zip(offsets) {
                    let shard = &self.shards[s];
                    let param = &shard.param;
                    // Through `.data`: autograd saved these parameters in the forward, and a
                    // write that bumped their version would make backward refuse them.
                    let target = param.f_data()?.f_view([-1])?;
                    let columns = columns(buffer, world, segment, offset, shard.chunk)?;
                    copy_from_columns(&columns, &target, shard.numel, shard.chunk)?;
                }
            }
            Ok(())
        })?;
        self.units[u].gathered = true;
        self.spare.recycle(buffer)?;
        frozen.map_or(Ok(()), |buffer| self.spare.recycle(buffer))
    }

    /// Launches the all-gather of a released zero3 unit without waiting; `gather` uses it.
    pub(super) fn prefetch(&mut self, u: usize) -> Result<()> {
        let unit = &self.units[u];
        let frozen_pending = unit.frozen.as_ref().is_some_and(|f| f.prefetched.is_some());
        if !unit.managed
            || unit.gathered
            || unit.prefetched.is_some()
            || frozen_pending
            || unit.on_shards
        {
            return Ok(());
        }
        if unit.segment > 0 {
            let buffer = self.own_shards_buffer(u, self.compute_kind(u))?;
            let work = self.group.all_gather_in_place_async(&buffer)?;
            self.units[u].prefetched = Some((work, buffer));
        }
        if let Some(buffer) = self.own_frozen_buffer(u)? {
            let work = self.group.all_gather_in_place_async(&buffer)?;
            self.units[u].frozen.as_mut().expect("has frozen").prefetched = Some((work, buffer));
        }
        Ok(())
    }

    /// The members of unit `u` whose memory it releases: trainable, then frozen.
    fn released_members(&self, u: usize) -> Vec<usize> {
        let unit = &self.units[u];
        let frozen = unit.frozen.iter().flat_map(|f| f.members.iter());
        unit.members.iter().chain(frozen).copied().collect()
    }

    /// Records unit `u` in the order of the forward pass, until the first pass is complete.
    pub(super) fn note_forward(&mut self, u: usize) {
        if !self.order_known {
            if self.order.contains(&u) {
                self.order_known = true;
            } else {
                self.order.push(u);
            }
        }
    }

    /// Keeps the first failure and stops this model's collectives (see `failed`).
    pub(super) fn record(&mut self, error: Error) {
        self.failed = true;
        self.error.get_or_insert(error);
    }

    /// The kept failure, once; after it, an error saying that the model is unusable (its
    /// parameters hold zeros, not the shards' values).
    pub(super) fn take_error(&mut self) -> Result<()> {
        if let Some(e) = self.error.take() {
            return Err(e);
        }
        if self.failed {
            return Err(Error::Training(
                "a collective of this sharded model failed earlier (its error was returned \
                 then); the model cannot be used after it: stop and restart from the last \
                 checkpoint"
                    .into(),
            ));
        }
        Ok(())
    }

    /// After a failure: gives a released unit's parameters memory again, zero-filled,
    /// without a collective, so that the forward or backward under way can finish (on
    /// values nobody uses) and the error reach the caller at the next accelerator call.
    pub(super) fn fill_locally(&mut self, u: usize) -> Result<()> {
        // Not waited for: the peers it needs may be gone.
        self.units[u].prefetched = None;
        if let Some(f) = &mut self.units[u].frozen {
            f.prefetched = None;
        }
        if self.units[u].gathered {
            return Ok(());
        }
        let members = self.released_members(u);
        tch::no_grad(|| -> Result<()> {
            for &s in &members {
                let param = &self.shards[s].param;
                let bytes = param.numel() * param.kind().elt_size_in_bytes();
                shim::allocate_storage(param, bytes as u64)?;
                let _ = param.f_data()?.f_zero_()?;
            }
            Ok(())
        })?;
        self.units[u].gathered = true;
        Ok(())
    }

    /// Makes every zero3 parameter whole, in the dtype the model made it, with the values
    /// of the master shards (a collective, unit by unit): what a program reads outside
    /// forward and backward is then what one process would read. They stay whole, and
    /// units use them as they are in forwards without gradient (an evaluation), until
    /// [`unsummon`](Self::unsummon).
    pub(super) fn summon(&mut self) -> Result<()> {
        if self.summoned.is_some() || self.failed {
            return Ok(());
        }
        let mut summoned = Vec::new();
        for u in 0..self.units.len() {
            if !self.units[u].managed {
                continue;
            }
            // Gathered for a pass under way: released first, then made whole from the masters.
            self.release(u)?;
            let trainable = self.gathered(u)?;
            let frozen = self.gathered_frozen(u)?;
            let compute = self.compute_kind(u);
            let unit = &self.units[u];
            let wholes = unit.members.iter().copied().zip(trainable).map(|(s, w)| (s, w, compute));
            let frozen = frozen.into_iter().map(|(s, w)| (s, w, self.shards[s].kind));
            tch::no_grad(|| -> Result<()> {
                for (s, whole, released_kind) in wholes.chain(frozen) {
                    let shard = &self.shards[s];
                    let whole = whole.f_to_kind(shard.kind)?;
                    shard.param.shallow_clone().set_data(&whole);
                    summoned.push((s, shim::tensor_version(&shard.param)?, released_kind));
                }
                Ok(())
            })?;
        }
        self.spare.trim();
        self.summoned = Some(summoned);
        Ok(())
    }

    /// Ends [`summon`](Self::summon): a parameter the program wrote into meanwhile (its
    /// version moved) gives its values to its master shard, as the parameter itself would
    /// keep them in one process; then each is released again.
    pub(super) fn unsummon(&mut self) -> Result<()> {
        self.write_back()?;
        let Some(summoned) = self.summoned.take() else { return Ok(()) };
        let rank = self.group.rank();
        tch::no_grad(|| -> Result<()> {
            for (s, _, released_kind) in summoned {
                let shard = &self.shards[s];
                let param = &shard.param;
                // Views the program kept of the whole values refuse reads from now on.
                shim::set_released_message(param, &released_message(&shard.name, rank))?;
                // SAFETY: the storage is the one `summon` made; its other holders are views
                // the program took of it, whose reads now fail with the message above.
                unsafe { shim::free_storage(param)? };
                if param.kind() != released_kind {
                    release_as(param, &shard.name, released_kind, self.device, rank)?;
                }
            }
            Ok(())
        })
    }

    /// While summoned: the values of each parameter the program wrote into since (its
    /// version moved) become its master shard's, as the parameter itself would keep them in
    /// one process.
    pub(super) fn write_back(&mut self) -> Result<()> {
        let Some(summoned) = &mut self.summoned else { return Ok(()) };
        let (rank, world) = (self.group.rank(), self.group.size());
        tch::no_grad(|| -> Result<()> {
            for (s, version, _) in summoned.iter_mut() {
                let shard = &self.shards[*s];
                let now = shim::tensor_version(&shard.param)?;
                if now != *version {
                    let mine = super::layout::chunk_of(&shard.param.f_detach()?, rank, world)?;
                    let master = shard.master.f_detach()?;
                    master.shallow_clone().f_copy_(&mine.f_to_kind(master.kind())?)?;
                    *version = now;
                }
            }
            Ok(())
        })
    }

    /// After a backward pass whose gradients went into the master shards: each trainable
    /// parameter's `.grad` becomes a tensor of its shape that holds no memory and refuses to
    /// be read, naming the fix — where it held nothing before, so that code reading it
    /// between backward and step (clipping or logging by hand) stopped silently at
    /// `grad.defined()` or on an undefined tensor. A hook on each parameter takes them away
    /// before the next backward accumulates (engine.rs, `unguard_before_accumulating`).
    pub(super) fn guard_gradients(&self) -> Result<()> {
        let rank = self.group.rank();
        let stage = if self.units.iter().any(|u| u.managed) { "zero3" } else { "zero2" };
        for unit in &self.units {
            for &s in &unit.members {
                let shard = &self.shards[s];
                let param = &shard.param;
                if param.grad().defined() {
                    continue;
                }
                let like = Tensor::f_empty([0], (param.kind(), param.device()))?;
                let guarded = shim::released(&like, param)?;
                shim::set_released_message(
                    &guarded,
                    &format!(
                        "accel: the gradient of `{}` on rank {rank} was reduced into shards \
                         after backward under {stage} (each process keeps its averaged share in \
                         the optimizer's master shard), so the parameter holds none to read. \
                         Clip with the optimizer's `opt.clip_grad_norm(max)` (or \
                         `clip_grad_value`), which works over every shard, as FSDP's \
                         `clip_grad_norm_` does; or use strategy = \"ddp\" or \"zero1\", \
                         where each process holds the whole averaged gradient",
                        shard.name
                    ),
                )?;
                shim::set_grad(param, Some(&guarded))?;
            }
        }
        Ok(())
    }

    /// Releases the memory of a zero3 unit's full parameters.
    pub(super) fn release(&mut self, u: usize) -> Result<()> {
        if self.failed {
            // Nothing more is computed that matters; waiting on a prefetch could hang.
            self.units[u].prefetched = None;
            if let Some(f) = &mut self.units[u].frozen {
                f.prefetched = None;
            }
            return Ok(());
        }
        let frozen = self.units[u].frozen.as_mut().and_then(|f| f.prefetched.take());
        for (work, buffer) in self.units[u].prefetched.take().into_iter().chain(frozen) {
            // Gathered ahead but not used: finish the collective (every rank launched it).
            work.wait()?;
            self.spare.recycle(buffer)?;
        }
        if !self.units[u].gathered {
            return Ok(());
        }
        for s in self.released_members(u) {
            let param = &self.shards[s].param;
            own_storage(param, &self.shards[s].name)?;
            // SAFETY: the unit is marked released; nothing reads it until `gather`
            // allocates it again (a [`Unit`] does before its forward and its backward).
            unsafe { self.spare.release(param)? };
        }
        self.units[u].gathered = false;
        Ok(())
    }
}
