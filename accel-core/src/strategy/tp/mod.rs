//! Tensor parallelism and sequence parallelism, after Megatron-LM's `tensor_parallel`: layers
//! whose weights are split across the mesh's tensor dimension (layers.rs), the collectives
//! between them as autograd-aware mappings (mappings.rs), the loss over a vocabulary split
//! across ranks (loss.rs).
//! See README.md beside this file.
//!
//! A [`TensorParallel`] handle (from [`crate::Accelerator::tensor_parallel`]) builds the
//! layers and remembers which parameters are split, and how, so that checkpoints, full
//! weights and gradient clipping treat them right.

mod layers;
mod loss;
mod mappings;
#[cfg(test)]
mod tests;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};

use tch::Tensor;

use crate::comm::{Communicator, LocalComm};
use crate::error::Result;
use crate::sync::Locked;
pub use layers::{
    ColumnParallelLinear, LinearOptions, RowParallelLinear, VocabParallelEmbedding,
    parallel_layer_norm,
};
pub use loss::{vocab_parallel_cross_entropy, vocab_parallel_token_losses};
pub(crate) use mappings::{concat_gathered, straight_through, sum_grad_in_backward};
pub use mappings::{
    copy_to_region, gather_from_region, gather_from_sequence_region, reduce_from_region,
    reduce_scatter_to_sequence_region, scatter_to_region, scatter_to_sequence_region,
};

/// How a tensor-parallel parameter is split: this rank holds slice `rank` of `size` along
/// `dim` of a whole of shape `whole`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Split {
    pub dim: usize,
    pub whole: Vec<i64>,
}

#[derive(Debug, Default)]
struct Registry {
    /// Split parameters, by [`crate::shim::tensor_id`].
    split: HashMap<usize, Split>,
    /// Parameters replicated across the tensor ranks whose gradients each rank computes on
    /// its part of the sequence only (sequence parallelism): summed across ranks.
    sequence: HashSet<usize>,
}

/// The tensor dimension of the run: its communicator, whether sequence parallelism is on,
/// and which parameters its layers split. Cheap to clone.
#[derive(Clone)]
pub struct TensorParallel {
    comm: Arc<dyn Communicator>,
    sequence_parallel: bool,
    registry: Arc<Mutex<Registry>>,
    /// Under precision fp8: where the layers register (their matmuls then run in fp8).
    fp8: Option<Arc<crate::precision::fp8::Fp8Layers>>,
}

impl std::fmt::Debug for TensorParallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TensorParallel")
            .field("rank", &self.rank())
            .field("size", &self.size())
            .field("sequence_parallel", &self.sequence_parallel)
            .finish_non_exhaustive()
    }
}

impl TensorParallel {
    /// Tensor parallelism over `comm` (its ranks hold the slices), with sequence
    /// parallelism if `sequence_parallel`.
    pub fn new(comm: Arc<dyn Communicator>, sequence_parallel: bool) -> Self {
        Self { comm, sequence_parallel, registry: Arc::default(), fp8: None }
    }

    /// The same with its linear layers in fp8 (`Some`), as the accelerator hands it out
    /// under precision fp8.
    pub(crate) fn with_fp8(mut self, fp8: Option<Arc<crate::precision::fp8::Fp8Layers>>) -> Self {
        self.fp8 = fp8;
        self
    }

    /// Under fp8, registers a layer's weight; its recipe and switch.
    pub(crate) fn fp8_layer(
        &self,
        path: &tch::nn::Path,
        weight: &Tensor,
    ) -> Result<crate::precision::fp8::Fp8Switch> {
        match &self.fp8 {
            Some(fp8) => Ok(Some((fp8.recipe, fp8.register(path, weight)?))),
            None => Ok(None),
        }
    }

    /// No tensor parallelism: one rank, every layer whole.
    pub fn single() -> Self {
        Self::new(Arc::new(LocalComm), false)
    }

    /// This process's tensor rank.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// Number of tensor ranks.
    pub fn size(&self) -> usize {
        self.comm.size()
    }

    /// Whether activations outside the split regions are split along the sequence.
    pub fn sequence_parallel(&self) -> bool {
        self.sequence_parallel && self.size() > 1
    }

    /// The tensor dimension's communicator.
    pub fn comm(&self) -> &Arc<dyn Communicator> {
        &self.comm
    }

    fn registry(&self) -> MutexGuard<'_, Registry> {
        self.registry.locked()
    }

    /// Records that `param` is this rank's slice along `dim` of a whole of shape `whole`.
    pub(crate) fn mark_split(&self, param: &Tensor, dim: usize, whole: Vec<i64>) -> Result<()> {
        let id = crate::shim::tensor_id(param)?;
        self.registry().split.insert(id, Split { dim, whole });
        Ok(())
    }

    /// Records that `param`, whole on every tensor rank, is used on this rank's part of the
    /// sequence only, so its gradients must be summed across the ranks (norms, biases added
    /// after a reduce-scatter, position embeddings of the rank's positions). Does nothing
    /// without sequence parallelism.
    pub fn mark_sequence_parallel(&self, param: &Tensor) -> Result<()> {
        self.mark_sequence(param)
    }

    pub(crate) fn mark_sequence(&self, param: &Tensor) -> Result<()> {
        if self.sequence_parallel() {
            let id = crate::shim::tensor_id(param)?;
            self.registry().sequence.insert(id);
        }
        Ok(())
    }

    /// How parameter `id` ([`crate::shim::tensor_id`]) is split, if it is.
    pub(crate) fn split_of(&self, id: usize) -> Option<Split> {
        self.registry().split.get(&id).cloned()
    }

    /// Whether parameter `id` is one whose gradients are summed across the tensor ranks.
    pub(crate) fn is_sequence(&self, id: usize) -> bool {
        self.registry().sequence.contains(&id)
    }
}
