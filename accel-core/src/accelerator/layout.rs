//! Where a model's tensors live across the mesh, combining the strategy's placement (data
//! parallelism) with the tensor dimension (slices of split parameters) and the pipeline
//! dimension (each stage holds its own layers): what checkpoints save, cut back on load, and
//! put together for the full weights.

use tch::Tensor;

use super::Accelerator;
use crate::comm::Communicator;
use crate::error::Result;
use crate::mesh::Dim;
use crate::strategy::Placement;

impl Accelerator {
    /// Whether this process is the first of its pipeline stage's copies (data and tensor
    /// index 0): the one that saves what the stage's processes all hold.
    fn first_of_stage(&self) -> bool {
        self.index_along(Dim::Data) == 0 && self.index_along(Dim::Tensor) == 0
    }

    /// A strategy's placement of a tensor that no tensor-parallel layer split: replicated
    /// everywhere, unless pipeline stages hold different tensors.
    pub(crate) fn model_placement_unsplit(&self, placement: Placement) -> Placement {
        match placement {
            Placement::Replicated if self.inner.mesh.dims().pipeline > 1 => {
                Placement::Whole { write: self.first_of_stage() }
            }
            other => other,
        }
    }

    /// The placement of `param` (or a tensor shaped like it, e.g. its optimizer state) given
    /// the strategy's placement of this process's `placement`.
    pub(crate) fn model_placement(
        &self,
        param: &Tensor,
        placement: Placement,
    ) -> Result<Placement> {
        let tp = &self.inner.tp;
        let Some(split) = tp.split_of(crate::shim::tensor_id(param)?) else {
            return Ok(self.model_placement_unsplit(placement));
        };
        let inner = match placement {
            // Each slice's copies: the first data-parallel process saves it.
            Placement::Replicated => Placement::Whole { write: self.index_along(Dim::Data) == 0 },
            other => other,
        };
        Ok(Placement::Slice {
            dim: split.dim,
            index: tp.rank(),
            count: tp.size(),
            shape: split.whole,
            inner: Box::new(inner),
        })
    }

    /// The shape of `param` whole (across the tensor ranks).
    pub(crate) fn whole_shape(&self, param: &Tensor) -> Result<Vec<i64>> {
        Ok(match self.inner.tp.split_of(crate::shim::tensor_id(param)?) {
            Some(split) => split.whole,
            None => param.size(),
        })
    }

    /// This tensor rank's slice of `whole`, the whole value of `param` (itself if `param` is
    /// not split).
    pub(crate) fn tensor_parallel_cut(&self, param: &Tensor, whole: &Tensor) -> Result<Tensor> {
        let tp = &self.inner.tp;
        match tp.split_of(crate::shim::tensor_id(param)?) {
            Some(split) => {
                let part = split.whole[split.dim] / tp.size() as i64;
                Ok(whole.f_narrow(split.dim as i64, tp.rank() as i64 * part, part)?)
            }
            None => Ok(whole.shallow_clone()),
        }
    }

    /// `local`, this rank's value of `param` (whole across data parallelism), made whole
    /// across the tensor ranks (a collective over them for split parameters).
    pub(crate) fn tensor_parallel_whole(&self, param: &Tensor, local: &Tensor) -> Result<Tensor> {
        let tp = &self.inner.tp;
        match tp.split_of(crate::shim::tensor_id(param)?) {
            Some(split) => {
                let slices = tp.comm().all_gather_list(&local.f_contiguous()?)?;
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
        let (Some(world), true) = (self.process_group(), self.inner.mesh.dims().pipeline > 1)
        else {
            return Ok(mine);
        };
        let first = self.first_of_stage();
        let listing: Vec<(String, Vec<i64>, i32)> = if first {
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
const KINDS: [tch::Kind; 8] = [
    tch::Kind::Float,
    tch::Kind::Double,
    tch::Kind::Half,
    tch::Kind::BFloat16,
    tch::Kind::Int64,
    tch::Kind::Int,
    tch::Kind::Uint8,
    tch::Kind::Bool,
];

fn kind_code(kind: tch::Kind) -> i32 {
    KINDS.iter().position(|k| *k == kind).map_or(0, |i| i as i32)
}

fn kind_of(code: i32) -> tch::Kind {
    KINDS.get(code as usize).copied().unwrap_or(tch::Kind::Float)
}
