//! The dimensions that split the model or its activations (tensor and sequence, context,
//! pipeline) as one piece that the accelerator and the prepared optimizer call at each point
//! of training, so that neither branches on the mesh's sizes. The data-parallel side is the
//! [`Strategy`](super::Strategy); this is the rest.
//!
//! Megatron-LM's counterparts: `finalize_model_grads` (the gradient sums a dimension owes
//! before the step: here the sequence-parallel parameters' sums across the tensor ranks),
//! and `get_grad_stats_parallel_group` (here: where the fp16 overflow flag is reduced; the
//! gradient norm's partial sums go over the shards, the tensor ranks and the stages, each
//! parameter counted once). Where each process's tensors sit in the whole model (what checkpoints
//! save, cut back on load and put together for the full weights) is here too.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tch::{Kind, Tensor};

use super::Placement;
use super::cp::ContextParallel;
use super::tp::TensorParallel;
use crate::comm::{Communicator, ProcessGroup, ReduceOp};
use crate::error::{Error, Result};
use crate::mesh::{DeviceMesh, Dim};
use crate::optim::{Param, clip_grad_norm, clip_grad_norm_sharded};

/// The tensor, context and pipeline dimensions of a run, and what each asks of training.
pub(crate) struct ModelParallel {
    pub(crate) tp: TensorParallel,
    pub(crate) cp: ContextParallel,
    stages: Arc<dyn Communicator>,
    /// Where the gradients live (and the norm's partial sums are reduced).
    device: tch::Device,
    /// Every process: an fp16 overflow on any stage or tensor rank skips the step everywhere.
    everyone: Arc<dyn Communicator>,
    /// The world's group for gathers of objects (`None` with one process).
    world: Option<ProcessGroup>,
    /// Whether this process is first along the data dimension, and whether it is the first
    /// of its stage's copies (data and tensor index 0).
    first_of_data: bool,
    first_of_stage: bool,
    /// Set while a pipeline step runs: its backward passes are the only ones allowed when
    /// the model is cut into stages.
    in_pipeline_step: AtomicBool,
}

/// Marks a pipeline step as running until dropped (see [`ModelParallel::pipeline_step`]).
#[must_use = "the pipeline step ends when this guard drops"]
pub(crate) struct PipelineStep<'a>(&'a AtomicBool);

impl Drop for PipelineStep<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Relaxed);
    }
}

impl ModelParallel {
    pub(crate) fn new(
        mesh: &DeviceMesh,
        device: tch::Device,
        tp: TensorParallel,
        cp: ContextParallel,
    ) -> Self {
        let dims = mesh.dims();
        let index = |dim| dims.index(dim, mesh.rank());
        Self {
            tp,
            cp,
            stages: mesh.comm(Dim::Pipeline),
            device,
            everyone: mesh.everyone(),
            world: mesh.world().cloned(),
            first_of_data: index(Dim::Data) == 0,
            first_of_stage: index(Dim::Data) == 0 && index(Dim::Tensor) == 0,
            in_pipeline_step: AtomicBool::new(false),
        }
    }

    /// The pipeline's stages, as one communicator (the one place that holds it: the
    /// pipeline schedule and the checks over stages use this).
    pub(crate) fn stages(&self) -> Arc<dyn Communicator> {
        self.stages.clone()
    }

    /// Whether no process holds the whole model: tensor parallelism splits parameters, or a
    /// pipeline cuts the layers into stages.
    pub(crate) fn splits_model(&self) -> bool {
        self.tp.size() > 1 || self.stages.size() > 1
    }

    /// The check at `prepare_model`: with several tensor ranks, the model (across its
    /// stages) has tensor-parallel layers. A collective over the pipeline stages.
    pub(crate) fn check_model(&self, params: &[Param]) -> Result<()> {
        let tensor_ranks = self.tp.size();
        if tensor_ranks == 1 || params.is_empty() {
            return Ok(());
        }
        let split = params.iter().any(|p| {
            crate::shim::tensor_id(&p.tensor).is_ok_and(|id| self.tp.split_of(id).is_some())
        });
        // A pipeline stage may hold only whole layers; the model is judged as a whole.
        let anywhere = Tensor::from_slice(&[i64::from(split)]);
        self.stages.all_reduce(&anywhere, ReduceOp::Max)?;
        if anywhere.int64_value(&[0]) == 1 {
            return Ok(());
        }
        Err(Error::Config(format!(
            "tensor_parallel = {tensor_ranks}, but this model has no tensor-parallel layers: \
             each of the {tensor_ranks} tensor ranks would compute the whole model on the same \
             batches, {tensor_ranks}x the work for nothing. Build its layers from \
             `accelerator.tensor_parallel()` (ColumnParallelLinear, RowParallelLinear, \
             VocabParallelEmbedding: accel_core::strategy::tp), or run with tensor_parallel = 1"
        )))
    }

    /// The check before a backward pass of rank `rank`: with the model cut into stages,
    /// only a pipeline step passes gradients between them.
    pub(crate) fn check_backward(&self, rank: usize) -> Result<()> {
        let stages = self.stages.size();
        if stages > 1 && !self.in_pipeline_step.load(Ordering::Relaxed) {
            return Err(Error::Training(format!(
                "backward on rank {rank} with pipeline_parallel = {stages}: the model is cut \
                 into stages, and only a pipeline step passes activations and gradients \
                 between them. Run each step with `Pipeline::train_step` \
                 (accel_core::pipeline), or run with pipeline_parallel = 1"
            )));
        }
        Ok(())
    }

    /// The check at a sync step's backward on rank `rank`: under context parallelism,
    /// something split the sequence, or every context rank would compute all of it (correct,
    /// but not what was asked for, at the cost of the whole sequence).
    pub(crate) fn check_sync_step(&self, rank: usize) -> Result<()> {
        let cp = &self.cp;
        if cp.size() < 2 || cp.has_split() {
            return Ok(());
        }
        Err(Error::Config(format!(
            "context_parallel = {} on rank {rank}, but nothing split a sequence: each context \
             rank would run the whole sequences. Feed the model this rank's part \
             (`accelerator.context_parallel().shard(&inputs, 1)`, the targets likewise) and run \
             attention through `ContextParallel::attention` (or `sequence_to_heads` / \
             `heads_to_sequence`); or run with context_parallel = 1",
            cp.size()
        )))
    }

    /// Marks a pipeline step as running (its backward passes allowed) until dropped.
    pub(crate) fn pipeline_step(&self) -> PipelineStep<'_> {
        self.in_pipeline_step.store(true, Ordering::Relaxed);
        PipelineStep(&self.in_pipeline_step)
    }

    /// Megatron's `finalize_model_grads` for these dimensions, once per step before anything
    /// reads the gradients: a parameter replicated across the tensor ranks whose gradient
    /// each rank computed on its part of the sequence (sequence parallelism) is summed
    /// across them. `grads[i]` holds the gradient of `trainable[i]`.
    pub(crate) fn finalize_grads(&self, trainable: &[Tensor], grads: &[Tensor]) -> Result<()> {
        if !self.tp.sequence_parallel() {
            return Ok(());
        }
        for (grad, param) in grads.iter().zip(trainable) {
            let g = grad.grad();
            if g.defined() && self.tp.is_sequence(crate::shim::tensor_id(param)?) {
                self.tp.comm().all_reduce(&g, ReduceOp::Sum)?;
            }
        }
        Ok(())
    }

    /// Where the fp16 overflow flag is reduced, given the strategy's gradient group (the
    /// ranks across which gradients are sharded, if they are): with the model split, every
    /// process, since an overflow on any stage or tensor rank must skip the step everywhere.
    pub(crate) fn grad_stats_group(
        &self,
        gradient_group: Option<Arc<dyn Communicator>>,
    ) -> Option<Arc<dyn Communicator>> {
        if self.splits_model() { Some(self.everyone.clone()) } else { gradient_group }
    }

    /// Clips the global gradient norm to `max_norm`, each parameter counted once across the
    /// run: split across `gradient_group` (shards), the tensor ranks (split parameters only),
    /// the pipeline stages (each holds its own layers). Returns the norm before clipping.
    pub(crate) fn clip_grad_norm(
        &self,
        trainable: &[Tensor],
        grads: &[Tensor],
        gradient_group: Option<&dyn Communicator>,
        max_norm: f64,
    ) -> Result<f64> {
        if !self.splits_model() {
            // torch's own arithmetic (`clip_grad_norm_`), bit for bit.
            return match gradient_group {
                Some(group) => clip_grad_norm_sharded(grads, max_norm, group),
                None => clip_grad_norm(grads, max_norm),
            };
        }
        // Sums of squares: [split by tensor parallelism, not split]. On the gradients'
        // device (NCCL reduces device memory); one host read at the end.
        let device = self.device;
        let sums = Tensor::f_zeros([2], (Kind::Double, device))?;
        for (grad, param) in grads.iter().zip(trainable) {
            let g = grad.grad();
            if !g.defined() {
                continue;
            }
            let split = self.tp.split_of(crate::shim::tensor_id(param)?).is_some();
            let square = g.f_to_kind(Kind::Double)?.f_square()?.f_sum(Kind::Double)?;
            let _ = sums.get(i64::from(!split)).f_add_(&square.f_to_device(device)?)?;
        }
        if let Some(group) = gradient_group {
            group.all_reduce(&sums, ReduceOp::Sum)?;
        }
        self.tp.comm().all_reduce(&sums.get(0), ReduceOp::Sum)?;
        let total = sums.f_sum(Kind::Double)?.f_reshape([1])?;
        self.stages.all_reduce(&total, ReduceOp::Sum)?;
        let norm = total.f_double_value(&[0])?.sqrt();
        let coef = (max_norm / (norm + 1e-6)).min(1.0);
        tch::no_grad(|| -> Result<()> {
            for g in grads.iter().map(Tensor::grad).filter(Tensor::defined) {
                let _ = g.shallow_clone().f_mul_scalar_(coef)?;
            }
            Ok(())
        })?;
        Ok(norm)
    }

    /// A strategy's placement of a tensor that no tensor-parallel layer split: replicated
    /// everywhere, unless pipeline stages hold different tensors.
    pub(crate) fn placement_unsplit(&self, placement: Placement) -> Placement {
        match placement {
            Placement::Replicated if self.stages.size() > 1 => {
                Placement::Whole { write: self.first_of_stage }
            }
            other => other,
        }
    }

    /// Where this process's part of `param` (or of a tensor shaped like it, e.g. its
    /// optimizer state) sits in the whole, given `placement`, the strategy's placement of it
    /// across the data-parallel processes.
    pub(crate) fn placement(&self, param: &Tensor, placement: Placement) -> Result<Placement> {
        let Some(split) = self.tp.split_of(crate::shim::tensor_id(param)?) else {
            return Ok(self.placement_unsplit(placement));
        };
        let inner = match placement {
            // Each slice's copies: the first data-parallel process saves it.
            Placement::Replicated => Placement::Whole { write: self.first_of_data },
            other => other,
        };
        Ok(Placement::Slice {
            dim: split.dim,
            index: self.tp.rank(),
            count: self.tp.size(),
            shape: split.whole,
            inner: Box::new(inner),
        })
    }

    /// The shape of `param` whole (across the tensor ranks).
    pub(crate) fn whole_shape(&self, param: &Tensor) -> Result<Vec<i64>> {
        Ok(match self.tp.split_of(crate::shim::tensor_id(param)?) {
            Some(split) => split.whole,
            None => param.size(),
        })
    }

    /// This tensor rank's slice of `whole`, the whole value of `param` (itself if `param` is
    /// not split).
    pub(crate) fn cut(&self, param: &Tensor, whole: &Tensor) -> Result<Tensor> {
        match self.tp.split_of(crate::shim::tensor_id(param)?) {
            Some(split) => {
                let part = split.whole[split.dim] / self.tp.size() as i64;
                Ok(whole.f_narrow(split.dim as i64, self.tp.rank() as i64 * part, part)?)
            }
            None => Ok(whole.shallow_clone()),
        }
    }

    /// `local`, this rank's value of `param` (whole across data parallelism), made whole
    /// across the tensor ranks (a collective over them for split parameters).
    pub(crate) fn whole(&self, param: &Tensor, local: &Tensor) -> Result<Tensor> {
        match self.tp.split_of(crate::shim::tensor_id(param)?) {
            Some(split) => {
                let slices = self.tp.comm().all_gather_list(&local.f_contiguous()?)?;
                Ok(Tensor::f_cat(&slices, split.dim as i64)?)
            }
            None => Ok(local.shallow_clone()),
        }
    }

    /// Every stage's `(name, tensor)`s on every process (names in `mine` are this stage's).
    /// A collective over the whole run: each stage's first process broadcasts its tensors.
    pub(crate) fn pipeline_whole(
        &self,
        mine: Vec<(String, Tensor)>,
    ) -> Result<Vec<(String, Tensor)>> {
        let (Some(world), true) = (&self.world, self.stages.size() > 1) else {
            return Ok(mine);
        };
        let listing: Vec<(String, Vec<i64>, i32)> = if self.first_of_stage {
            mine.iter().map(|(n, t)| (n.clone(), t.size(), kind_code(t.kind()))).collect()
        } else {
            Vec::new()
        };
        let listings = world.all_gather_objects(&listing)?;
        let ours: std::collections::BTreeMap<String, Tensor> = mine.into_iter().collect();
        let mut all = Vec::new();
        for (rank, listing) in listings.iter().enumerate() {
            for (name, shape, kind) in listing {
                let tensor = match ours.get(name) {
                    Some(t) if rank == world.rank() => t.f_contiguous()?,
                    _ => Tensor::f_empty(shape.as_slice(), (kind_of(*kind), tch::Device::Cpu))?,
                };
                let tensor = tensor.f_to_device(tch::Device::Cpu)?;
                world.broadcast(&tensor, rank)?;
                all.push((name.clone(), tensor));
            }
        }
        all.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(all)
    }
}

/// The dtypes a model's variables come in, by a code that travels as an object.
const KINDS: [Kind; 8] = [
    Kind::Float,
    Kind::Double,
    Kind::Half,
    Kind::BFloat16,
    Kind::Int64,
    Kind::Int,
    Kind::Uint8,
    Kind::Bool,
];

fn kind_code(kind: Kind) -> i32 {
    KINDS.iter().position(|k| *k == kind).map_or(0, |i| i as i32)
}

fn kind_of(code: i32) -> Kind {
    KINDS.get(code as usize).copied().unwrap_or(Kind::Float)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tch::{Device, Kind, Tensor};

    use super::*;
    use crate::comm::tests::on_ranks;
    use crate::mesh::ParallelDims;

    /// A parameter of `whole`'s slice `part` (all of it if `None`) along dim 0, given the
    /// gradient of the same slice of `grad`.
    fn param_with_grad(whole: &Tensor, grad: &Tensor, part: Option<(i64, i64)>) -> Tensor {
        let cut = |t: &Tensor| match part {
            Some((index, count)) => {
                let n = t.size()[0] / count;
                t.narrow(0, index * n, n).copy()
            }
            None => t.copy(),
        };
        let p = cut(whole).set_requires_grad(true);
        (&p * cut(grad)).sum(Kind::Double).backward();
        p
    }

    /// On 2 stages of 2 tensor ranks, sequence parallel: the sequence-parallel bias's
    /// gradients are summed across the tensor ranks; the clipped norm counts the split weight
    /// once (its slices) and the bias once (not per tensor rank) across both stages; an
    /// overflow is seen by all 4 processes.
    #[test]
    fn the_norm_counts_each_parameter_once_across_tensor_ranks_and_stages() {
        let results = on_ranks(4, Duration::from_secs(30), |g| {
            let dims = ParallelDims::new(4, 2, 1, 1, 1, 2).unwrap();
            let mesh = DeviceMesh::new(dims, &g, Device::Cpu).unwrap();
            let tp = TensorParallel::new(mesh.comm(Dim::Tensor), true);
            let cp = ContextParallel::new(mesh.comm(Dim::Context));
            let parallel = ModelParallel::new(&mesh, Device::Cpu, tp.clone(), cp);
            let stage = dims.index(Dim::Pipeline, g.rank()) as f64;
            let tensor_rank = tp.rank() as f64;
            let opts = (Kind::Double, Device::Cpu);
            // Stage s: a weight [4, 3] split along dim 0, a bias [3] whole on each tensor rank
            // whose gradient each rank computed on its half of the sequence.
            let w = Tensor::zeros([4, 3], opts);
            let w_grad = Tensor::arange(12, opts).reshape([4, 3]) + stage;
            let weight = param_with_grad(&w, &w_grad, Some((tp.rank() as i64, 2)));
            tp.mark_split(&weight, 0, vec![4, 3]).unwrap();
            let b_grad = Tensor::from_slice(&[1.0, 2.0, 3.0]) * (tensor_rank + 1.0) + stage;
            let bias = param_with_grad(&Tensor::zeros([3], opts), &b_grad, None);
            tp.mark_sequence(&bias).unwrap();
            let trainable = [weight.shallow_clone(), bias.shallow_clone()];
            parallel.finalize_grads(&trainable, &trainable).unwrap();
            let summed = Vec::<f64>::try_from(bias.grad()).unwrap();
            let norm = parallel.clip_grad_norm(&trainable, &trainable, None, 1.0).unwrap();
            let clipped = weight.grad().copy();
            let stats = parallel.grad_stats_group(None).map(|c| c.size());
            (stage, summed, norm, clipped, w_grad.narrow(0, tp.rank() as i64 * 2, 2), stats)
        });
        // The whole model's gradients: 2 weights of arange(12) + s, 2 biases summed over the
        // tensor ranks: [1, 2, 3] * (1 + 2) + 2s.
        let mut squares = 0.0;
        for s in [0.0, 1.0] {
            squares += (Tensor::arange(12, (Kind::Double, Device::Cpu)) + s)
                .square()
                .sum(Kind::Double)
                .double_value(&[]);
            squares += [1.0, 2.0, 3.0].iter().map(|v| (v * 3.0 + 2.0 * s).powi(2)).sum::<f64>();
        }
        let expected = squares.sqrt();
        for (stage, summed, norm, clipped, unclipped, stats) in &results {
            let want: Vec<f64> = [1.0, 2.0, 3.0].iter().map(|v| v * 3.0 + 2.0 * stage).collect();
            assert_eq!(summed, &want, "the sequence-parallel bias's gradient, summed");
            assert!((norm - expected).abs() < 1e-9, "norm {norm} vs the whole model's {expected}");
            let coef = 1.0 / (expected + 1e-6);
            let apart = (clipped - unclipped * coef).abs().max().double_value(&[]);
            assert!(apart < 1e-12, "every rank clips by the whole model's norm ({apart:e})");
            assert_eq!(*stats, Some(4), "an overflow anywhere is seen everywhere");
        }
    }

    /// Without tensor or pipeline parallelism nothing is split: the norm is torch's, and the
    /// overflow flag goes where the strategy's gradients are sharded (or nowhere).
    #[test]
    fn an_unsplit_model_keeps_the_strategys_group_and_torchs_norm() {
        let mesh = DeviceMesh::single();
        let parallel = ModelParallel::new(
            &mesh,
            Device::Cpu,
            TensorParallel::single(),
            ContextParallel::new(mesh.comm(Dim::Context)),
        );
        assert!(!parallel.splits_model());
        assert!(parallel.grad_stats_group(None).is_none());
        let group: Arc<dyn Communicator> = Arc::new(crate::comm::LocalComm);
        assert!(parallel.grad_stats_group(Some(group)).is_some());
        let g = Tensor::from_slice(&[3.0f32, 4.0]);
        let p = param_with_grad(&Tensor::zeros([2], (Kind::Float, Device::Cpu)), &g, None);
        let norm = parallel.clip_grad_norm(&[p.shallow_clone()], &[p.shallow_clone()], None, 1.0);
        assert_eq!(norm.unwrap(), 5.0);
        let torch = Tensor::from_slice(&[3.0f32, 4.0]) * (1.0 / (5.0 + 1e-6));
        assert_eq!(p.grad(), torch, "scaled as torch.nn.utils.clip_grad_norm_ scales");
    }
}
