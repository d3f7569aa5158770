//! Data-parallel gradient averaging: the [`DdpStrategy`], over one `Ddp` per model; see
//! README.md beside this file.

use std::sync::{Arc, Mutex, MutexGuard};

use tch::{Kind, Tensor};

use super::{Context, ModelOptions, Strategy};
use crate::accumulation::GradientState;
use crate::comm::{Communicator, ReduceOp, Work};
use crate::error::{Error, Result};
use crate::optim::Param;
use crate::shim::{PostAccumulateGradHook, add_post_accumulate_grad_hook};
use crate::sync::Locked;

/// DDP settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DdpOptions {
    /// Target gradient bytes per bucket (torch: 25 MB).
    pub bucket_bytes: usize,
    /// Parameters may go without a gradient in a step (they contribute zeros).
    pub allow_unused: bool,
    /// All-reduce in this dtype instead of the gradients' own (bf16 or f16).
    pub compression: Option<Kind>,
    /// Keep the model's buffers (variables that are not parameters: batch norm's running
    /// statistics) equal to rank 0's, as torch's `broadcast_buffers=True` (the default) does.
    pub broadcast_buffers: bool,
    /// Gradients become views of the all-reduce buckets after the first step (torch's
    /// `gradient_as_bucket_view`; on by default: one copy fewer per step). Off, they stay
    /// tensors of their own, which an optimizer that is not the accelerator's (tch's own
    /// `zero_grad`, which detaches them) can clear.
    pub gradient_as_bucket_view: bool,
}

impl Default for DdpOptions {
    fn default() -> Self {
        Self {
            bucket_bytes: 25 << 20,
            allow_unused: false,
            compression: None,
            broadcast_buffers: true,
            gradient_as_bucket_view: true,
        }
    }
}

struct Slot {
    name: String,
    param: Tensor,
    offset: i64,
    numel: i64,
}

struct Bucket {
    slots: Vec<Slot>,
    flat: Tensor,
    ready: usize,
    fired: Vec<bool>,
    work: Option<Work>,
}

struct Pending {
    buckets: Vec<Bucket>,
    /// Buckets are launched in index order on every rank (a communicator pairs the ranks'
    /// operations by order): the first bucket not launched yet.
    next: usize,
    error: Option<String>,
}

impl Pending {
    /// Launches every complete bucket from `next` on, in order, up to the first that is
    /// still waiting for a gradient.
    fn launch_ready(&mut self, group: &dyn Communicator) -> Result<()> {
        while let Some(bucket) = self.buckets.get_mut(self.next) {
            if bucket.ready < bucket.slots.len() {
                break;
            }
            launch(bucket, group)?;
            self.next += 1;
        }
        Ok(())
    }
}

/// Installed on a model by the accelerator when the strategy is DDP and there are several
/// processes.
pub(crate) struct Ddp {
    pending: Arc<Mutex<Pending>>,
    group: Arc<dyn Communicator>,
    options: DdpOptions,
    _hooks: Vec<PostAccumulateGradHook>,
}

fn lock(p: &Mutex<Pending>) -> MutexGuard<'_, Pending> {
    p.locked()
}

fn launch(bucket: &mut Bucket, group: &dyn Communicator) -> Result<()> {
    bucket.work = Some(group.all_reduce_async(&bucket.flat, ReduceOp::Avg)?);
    Ok(())
}

impl Ddp {
    /// Broadcasts rank 0's parameters and hooks every trainable one into a bucket.
    pub(crate) fn new(
        params: &[Param],
        group: Arc<dyn Communicator>,
        state: Arc<GradientState>,
        options: DdpOptions,
        broadcast: bool,
    ) -> Result<Self> {
        if broadcast {
            tch::no_grad(|| -> Result<()> {
                for p in params {
                    group.broadcast(&p.tensor, 0)?;
                }
                Ok(())
            })?;
        }
        let trainable: Vec<&Param> =
            params.iter().rev().filter(|p| p.tensor.requires_grad()).collect();
        let mut buckets = Vec::new();
        let mut current: Vec<Slot> = Vec::new();
        let mut bytes = 0;
        let mut kinds = Vec::new();
        for p in trainable {
            let kind = options.compression.unwrap_or(p.tensor.kind());
            let size = p.tensor.numel() * kind.elt_size_in_bytes();
            if !current.is_empty()
                && (bytes + size > options.bucket_bytes || kinds.last() != Some(&kind))
            {
                buckets.push(Self::bucket(
                    std::mem::take(&mut current),
                    *kinds.last().expect("kind"),
                )?);
                bytes = 0;
            }
            let offset = current.last().map_or(0, |s| s.offset + s.numel);
            current.push(Slot {
                name: p.name.clone(),
                param: p.tensor.shallow_clone(),
                offset,
                numel: p.tensor.numel() as i64,
            });
            bytes += size;
            kinds.push(kind);
        }
        if !current.is_empty() {
            buckets.push(Self::bucket(current, *kinds.last().expect("kind"))?);
        }
        let pending = Arc::new(Mutex::new(Pending { buckets, next: 0, error: None }));
        let mut hooks = Vec::new();
        let layout: Vec<(usize, usize, Tensor)> = lock(&pending)
            .buckets
            .iter()
            .enumerate()
            .flat_map(|(b, bucket)| {
                bucket.slots.iter().enumerate().map(move |(i, s)| (b, i, s.param.shallow_clone()))
            })
            .collect();
        for (b, i, param) in layout {
            let (pending, group, state) = (pending.clone(), group.clone(), state.clone());
            let as_view = options.gradient_as_bucket_view;
            let hook = move |p: &Tensor| {
                if !state.sync_gradients() {
                    return;
                }
                let mut guard = lock(&pending);
                let pending = &mut *guard;
                let bucket = &mut pending.buckets[b];
                let slot = &bucket.slots[i];
                let copied = tch::no_grad(|| -> Result<()> {
                    let mut view = bucket.flat.f_narrow(0, slot.offset, slot.numel)?;
                    let grad = p.grad();
                    if grad.data_ptr() != view.data_ptr() {
                        view.f_copy_(&grad.f_reshape([-1])?)?;
                        // From now on autograd accumulates straight into the bucket (the
                        // optimizer zeroes grads in place under DDP), so no copy is needed.
                        if as_view && view.kind() == grad.kind() {
                            crate::shim::set_grad(p, Some(&view.f_view(grad.size().as_slice())?))?;
                        }
                    }
                    Ok(())
                });
                let result = copied
                    .map(|()| {
                        bucket.fired[i] = true;
                        bucket.ready += 1;
                    })
                    .and_then(|()| pending.launch_ready(group.as_ref()));
                if let Err(e) = result {
                    pending.error.get_or_insert(e.to_string());
                }
            };
            hooks.push(add_post_accumulate_grad_hook(&param, hook)?);
        }
        Ok(Self { pending, group, options, _hooks: hooks })
    }

    fn bucket(slots: Vec<Slot>, kind: Kind) -> Result<Bucket> {
        let numel = slots.last().map_or(0, |s| s.offset + s.numel);
        let device = slots[0].param.device();
        let fired = vec![false; slots.len()];
        Ok(Bucket {
            slots,
            flat: Tensor::f_zeros([numel], (kind, device))?,
            ready: 0,
            fired,
            work: None,
        })
    }

    /// After backward on a sync step: launches what is left, waits, and writes the averaged
    /// gradients back.
    pub(crate) fn finish(&self) -> Result<()> {
        let mut guard = lock(&self.pending);
        let pending = &mut *guard;
        if let Some(e) = pending.error.take() {
            return Err(Error::Training(format!("DDP gradient hook failed: {e}")));
        }
        // A model none of whose parameters got a gradient was not part of this backward
        // (e.g. the discriminator's pass of a GAN): nothing to do.
        if pending.buckets.iter().all(|b| b.ready == 0) {
            return Ok(());
        }
        let unused: Vec<&str> = pending
            .buckets
            .iter()
            .flat_map(|b| {
                b.slots.iter().zip(&b.fired).filter(|(_, f)| !**f).map(|(s, _)| s.name.as_str())
            })
            .collect();
        if !unused.is_empty() && !self.options.allow_unused {
            let message = format!(
                "DDP: parameter(s) {unused:?} received no gradient in this step on rank {}; every \
                 rank must produce a gradient for every parameter. Where some may go without one \
                 (a branch the data chooses), say so: #[accelerate(find_unused_parameters = \
                 true)], `find_unused_parameters: true` in the config file, \
                 ACCEL_FIND_UNUSED_PARAMETERS=1, or .find_unused_parameters(true) on the builder \
                 (torch's find_unused_parameters=True): they then contribute zeros",
                self.group.rank()
            );
            for b in &mut pending.buckets {
                b.ready = 0;
                b.fired.iter_mut().for_each(|f| *f = false);
            }
            pending.next = 0;
            return Err(Error::Training(message));
        }
        for bucket in &mut pending.buckets {
            if bucket.work.is_none() {
                for (slot, fired) in bucket.slots.iter().zip(&bucket.fired) {
                    if !fired {
                        let _ = bucket.flat.f_narrow(0, slot.offset, slot.numel)?.f_zero_()?;
                    }
                }
                launch(bucket, self.group.as_ref())?;
            }
        }
        for bucket in &mut pending.buckets {
            let work = bucket.work.take().expect("launched above");
            work.wait()?;
            tch::no_grad(|| -> Result<()> {
                for slot in &bucket.slots {
                    let averaged = bucket.flat.f_narrow(0, slot.offset, slot.numel)?;
                    let averaged = averaged
                        .f_view(slot.param.size().as_slice())?
                        .f_to_kind(slot.param.kind())?;
                    let grad = slot.param.grad();
                    if grad.defined() && grad.data_ptr() == averaged.data_ptr() {
                        // The gradient is a view of the bucket: already averaged in place.
                    } else if grad.defined() {
                        let mut grad = grad;
                        grad.f_copy_(&averaged)?;
                    } else {
                        crate::shim::set_grad(&slot.param, Some(&averaged))?;
                    }
                }
                Ok(())
            })?;
            bucket.ready = 0;
            bucket.fired.iter_mut().for_each(|f| *f = false);
        }
        pending.next = 0;
        Ok(())
    }
}

/// DDP: every process holds the whole model; gradients are averaged over the mesh's data
/// dimension on sync steps.
pub struct DdpStrategy {
    group: Arc<dyn Communicator>,
    models: Mutex<Vec<Ddp>>,
}

impl std::fmt::Debug for DdpStrategy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DdpStrategy").field("group", &self.group).finish_non_exhaustive()
    }
}

impl DdpStrategy {
    /// DDP over the processes of `group`.
    pub(crate) fn new(group: Arc<dyn Communicator>) -> Self {
        Self { group, models: Mutex::new(Vec::new()) }
    }
}

impl Strategy for DdpStrategy {
    fn name(&self) -> String {
        "ddp".into()
    }

    fn prepare_model(
        &self,
        cx: &Context<'_>,
        params: &[Param],
        options: &ModelOptions,
    ) -> Result<()> {
        let state = cx.state.clone();
        let ddp =
            Ddp::new(params, self.group.clone(), state, options.ddp, options.sync_module_states)?;
        self.models.locked().push(ddp);
        Ok(())
    }

    fn after_backward(&self, _: &Context<'_>, sync: bool) -> Result<()> {
        if sync {
            for ddp in self.models.locked().iter() {
                ddp.finish()?;
            }
        }
        Ok(())
    }

    fn zero_grad_in_place(&self) -> bool {
        true
    }

    fn buffer_group(
        &self,
        _: &Context<'_>,
        options: &ModelOptions,
    ) -> Option<Arc<dyn Communicator>> {
        options.ddp.broadcast_buffers.then(|| self.group.clone())
    }
}
