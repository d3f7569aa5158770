//! A model's buffers — the variables of its `VarStore` that are not parameters, such as
//! batch norm's running statistics — kept equal across the data-parallel processes.
//!
//! Each process updates its buffers from its own batches in the forward pass, so without
//! this the replicas' buffers drift apart: evaluation in `train = false` mode, metrics and
//! checkpoints would depend on the process. torch's DDP broadcasts rank 0's buffers before
//! each forward pass that follows a synchronising one (`broadcast_buffers=True`); here the
//! broadcast follows each sync step's backward, which leaves the first rank's values (the
//! ones torch's rank 0 has) on every rank, including after the last step. Rank 0's own
//! values are never changed by it, so they equal torch's rank 0 exactly. One collective per
//! dtype per sync step (a flat copy of every buffer of that dtype).
//!
//! A buffer is a variable made with `zeros_no_train`/`ones_no_train`/`var_copy(.., false)`:
//! one that is not in the `VarStore`'s list of trainable variables. A frozen parameter
//! (`vs.freeze()`) is not a buffer; it stays equal because every process broadcast it at
//! `prepare_model` and nothing changes it.

use std::collections::HashSet;
use std::sync::Arc;

use tch::{Kind, Tensor};

use crate::comm::Communicator;
use crate::error::Result;
use crate::sync::Locked;

/// The buffers of one model and the group they are kept equal across.
pub struct BufferSync {
    group: Arc<dyn Communicator>,
    /// Buffers of one dtype each, sorted by name (the same order on every rank).
    by_kind: Vec<(Kind, Vec<Tensor>)>,
}

impl std::fmt::Debug for BufferSync {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let counts: Vec<(Kind, usize)> = self.by_kind.iter().map(|(k, b)| (*k, b.len())).collect();
        f.debug_struct("BufferSync").field("group", &self.group).field("buffers", &counts).finish()
    }
}

/// The buffers of `vs` by name, sorted: its variables that are not in its list of
/// trainable variables.
pub fn buffers_of(vs: &tch::nn::VarStore) -> Result<Vec<(String, Tensor)>> {
    let variables = vs.variables_.locked();
    let trainable: HashSet<usize> = variables
        .trainable_variables
        .iter()
        .map(|v| crate::shim::tensor_id(&v.tensor))
        .collect::<Result<_>>()?;
    let mut buffers = Vec::new();
    for (name, tensor) in &variables.named_variables {
        if !trainable.contains(&crate::shim::tensor_id(tensor)?) {
            buffers.push((name.clone(), tensor.shallow_clone()));
        }
    }
    buffers.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(buffers)
}

impl BufferSync {
    /// The buffers of `vs`, kept equal across `group`.
    pub fn new(vs: &tch::nn::VarStore, group: Arc<dyn Communicator>) -> Result<Self> {
        let mut by_kind: Vec<(Kind, Vec<Tensor>)> = Vec::new();
        for (_, tensor) in buffers_of(vs)? {
            match by_kind.iter_mut().find(|(k, _)| *k == tensor.kind()) {
                Some((_, list)) => list.push(tensor),
                None => by_kind.push((tensor.kind(), vec![tensor])),
            }
        }
        Ok(Self { group, by_kind })
    }

    /// Whether the model has no buffers.
    pub fn is_empty(&self) -> bool {
        self.by_kind.is_empty()
    }

    /// The first rank's buffers to every rank of the group (every rank calls it).
    pub fn sync(&self) -> Result<()> {
        tch::no_grad(|| -> Result<()> {
            for (_, buffers) in &self.by_kind {
                if let [only] = buffers.as_slice() {
                    self.group.broadcast(only, 0)?;
                    continue;
                }
                let flat: Vec<Tensor> = buffers
                    .iter()
                    .map(|b| b.f_reshape([-1]))
                    .collect::<std::result::Result<_, _>>()?;
                let flat = Tensor::f_cat(&flat, 0)?;
                self.group.broadcast(&flat, 0)?;
                if self.group.rank() != 0 {
                    let mut offset = 0;
                    for b in buffers {
                        let n = b.numel() as i64;
                        let value = flat.f_narrow(0, offset, n)?.f_view(b.size().as_slice())?;
                        b.shallow_clone().f_copy_(&value)?;
                        offset += n;
                    }
                }
            }
            Ok(())
        })
    }
}
