//! Megatron-LM's tensor-parallel layers (`tensor_parallel/layers.py`). Each rank initialises
//! the whole weight with the generator as the single-process layer would (bias first, then
//! weight, as `tch::nn::linear`), and keeps its slice: a model built with the same seed holds
//! exactly the slices of the single-process model.

use tch::nn::{self, Init, Module};
use tch::{Kind, Tensor};

use super::TensorParallel;
use super::mappings::{
    copy_to_region, gather_from_region, gather_from_sequence_region, reduce_from_region,
    reduce_scatter_to_sequence_region, scatter_to_region,
};
use crate::error::{Error, Result};
use crate::precision::fp8::{Fp8Switch, switched_linear};

/// What a tensor-parallel linear layer does with its input and output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinearOptions {
    /// Add a bias.
    pub bias: bool,
    /// Column-parallel: all-gather the output (else each rank keeps its slice of the
    /// features, for a row-parallel layer to take).
    pub gather_output: bool,
    /// Row-parallel: the input is already split along its features (the output of a
    /// column-parallel layer); else it is scattered first.
    pub input_is_parallel: bool,
    /// Which dimension of the activations is the sequence (sequence parallelism splits it).
    pub sequence_dim: i64,
}

impl Default for LinearOptions {
    fn default() -> Self {
        Self { bias: true, gather_output: false, input_is_parallel: true, sequence_dim: 1 }
    }
}

fn divide(whole: i64, tp: &TensorParallel, what: &str) -> Result<i64> {
    let n = tp.size() as i64;
    if whole % n != 0 {
        return Err(Error::Config(format!(
            "{what}: {whole} does not divide among the {n} tensor-parallel ranks; choose a \
             width that {n} divides, or fewer tensor-parallel ranks"
        )));
    }
    Ok(whole / n)
}

/// The whole tensor as `init` makes it for a variable of `shape`.
fn whole(init: Init, shape: &[i64]) -> Result<Tensor> {
    Ok(nn::f_init(init, shape, tch::Device::Cpu, Kind::Float)?)
}

/// Registers this rank's slice `rank` of `size` along `dim` of `full` as variable `name`.
fn slice_var(
    tp: &TensorParallel,
    path: &nn::Path,
    name: &str,
    full: &Tensor,
    dim: usize,
) -> Result<Tensor> {
    let size = full.size();
    let part = size[dim] / tp.size() as i64;
    let slice = full.f_narrow(dim as i64, tp.rank() as i64 * part, part)?.f_contiguous()?;
    let var = path.f_var_copy(name, &slice.f_to_device(path.device())?)?;
    tp.mark_split(&var, dim, size)?;
    Ok(var)
}

fn bias_init(fan_in: i64) -> Init {
    let bound = 1.0 / (fan_in as f64).sqrt();
    Init::Uniform { lo: -bound, up: bound }
}

/// A linear layer whose output features are split across the tensor ranks: weight
/// `[out / T, in]`, bias `[out / T]`. Its input is copied to every rank (gradients summed in
/// backward), or under sequence parallelism all-gathered along the sequence.
#[derive(Debug)]
pub struct ColumnParallelLinear {
    tp: TensorParallel,
    /// This rank's rows of the weight.
    pub weight: Tensor,
    /// This rank's part of the bias.
    pub bias: Option<Tensor>,
    options: LinearOptions,
    fp8: Fp8Switch,
}

impl ColumnParallelLinear {
    /// `in_dim → out_dim` under `path` (variables `weight`, `bias`, as `nn::linear`'s).
    pub fn new(
        tp: &TensorParallel,
        path: &nn::Path,
        in_dim: i64,
        out_dim: i64,
        options: LinearOptions,
    ) -> Result<Self> {
        divide(out_dim, tp, &format!("column-parallel {} output features", path.path("")))?;
        let bias = match options.bias {
            true => Some(slice_var(tp, path, "bias", &whole(bias_init(in_dim), &[out_dim])?, 0)?),
            false => None,
        };
        let init = nn::init::DEFAULT_KAIMING_UNIFORM;
        let weight = slice_var(tp, path, "weight", &whole(init, &[out_dim, in_dim])?, 0)?;
        let fp8 = tp.fp8_layer(path, &weight)?;
        Ok(Self { tp: tp.clone(), weight, bias, options, fp8 })
    }

    /// Replaces the weights by this rank's slices of whole ones (`[out, in]`, `[out]`).
    pub fn load_whole(&self, weight: &Tensor, bias: Option<&Tensor>) -> Result<()> {
        load_slice(&self.tp, &self.weight, weight, 0)?;
        if let (Some(mine), Some(whole)) = (&self.bias, bias) {
            load_slice(&self.tp, mine, whole, 0)?;
        }
        Ok(())
    }

    /// `x @ Wᵀ + b` on this rank's slice of the output features (gathered whole with
    /// `gather_output`).
    pub fn try_forward(&self, x: &Tensor) -> Result<Tensor> {
        let input = if self.tp.sequence_parallel() {
            gather_from_sequence_region(&self.tp, x, self.options.sequence_dim)?
        } else {
            copy_to_region(&self.tp, x)?
        };
        let y = switched_linear(&input, &self.weight, self.bias.as_ref(), &self.fp8)?;
        if self.options.gather_output { gather_from_region(&self.tp, &y) } else { Ok(y) }
    }
}

impl Module for ColumnParallelLinear {
    fn forward(&self, x: &Tensor) -> Tensor {
        self.try_forward(x).unwrap_or_else(|e| panic!("column-parallel linear: {e}"))
    }
}

/// A linear layer whose input features are split across the tensor ranks: weight
/// `[out, in / T]`, bias `[out]` (whole, added once, after the ranks' partial products are
/// summed — or under sequence parallelism reduce-scattered along the sequence).
#[derive(Debug)]
pub struct RowParallelLinear {
    tp: TensorParallel,
    /// This rank's columns of the weight.
    pub weight: Tensor,
    /// The bias, whole on every rank.
    pub bias: Option<Tensor>,
    options: LinearOptions,
    fp8: Fp8Switch,
}

impl RowParallelLinear {
    /// `in_dim → out_dim` under `path` (variables `weight`, `bias`).
    pub fn new(
        tp: &TensorParallel,
        path: &nn::Path,
        in_dim: i64,
        out_dim: i64,
        options: LinearOptions,
    ) -> Result<Self> {
        divide(in_dim, tp, &format!("row-parallel {} input features", path.path("")))?;
        let bias = match options.bias {
            true => {
                let b = path.f_var_copy("bias", &whole(bias_init(in_dim), &[out_dim])?)?;
                tp.mark_sequence(&b)?;
                Some(b)
            }
            false => None,
        };
        let init = nn::init::DEFAULT_KAIMING_UNIFORM;
        let weight = slice_var(tp, path, "weight", &whole(init, &[out_dim, in_dim])?, 1)?;
        let fp8 = tp.fp8_layer(path, &weight)?;
        Ok(Self { tp: tp.clone(), weight, bias, options, fp8 })
    }

    /// Replaces the weights by this rank's slice of whole ones (`[out, in]`, `[out]`).
    pub fn load_whole(&self, weight: &Tensor, bias: Option<&Tensor>) -> Result<()> {
        load_slice(&self.tp, &self.weight, weight, 1)?;
        if let (Some(mine), Some(whole)) = (&self.bias, bias) {
            tch::no_grad(|| mine.shallow_clone().f_copy_(whole))?;
        }
        Ok(())
    }

    /// `x @ Wᵀ` summed over the ranks, plus `b`.
    pub fn try_forward(&self, x: &Tensor) -> Result<Tensor> {
        let input = if self.options.input_is_parallel {
            x.shallow_clone()
        } else {
            scatter_to_region(&self.tp, x)?
        };
        let partial = switched_linear(&input, &self.weight, None, &self.fp8)?;
        let y = if self.tp.sequence_parallel() {
            reduce_scatter_to_sequence_region(&self.tp, &partial, self.options.sequence_dim)?
        } else {
            reduce_from_region(&self.tp, &partial)?
        };
        match &self.bias {
            Some(b) => Ok(y.f_add(b)?),
            None => Ok(y),
        }
    }
}

impl Module for RowParallelLinear {
    fn forward(&self, x: &Tensor) -> Tensor {
        self.try_forward(x).unwrap_or_else(|e| panic!("row-parallel linear: {e}"))
    }
}

/// An embedding whose rows (the vocabulary) are split across the tensor ranks: each looks
/// up the ids in its range, zeros for the others, and the ranks' results are summed (or
/// under sequence parallelism reduce-scattered along the sequence).
#[derive(Debug)]
pub struct VocabParallelEmbedding {
    tp: TensorParallel,
    /// This rank's rows, `[vocab / T, dim]`.
    pub weight: Tensor,
    start: i64,
    rows: i64,
    sequence_dim: i64,
}

impl VocabParallelEmbedding {
    /// `vocab` embeddings of `dim` under `path` (variable `weight`, as `nn::embedding`'s);
    /// `sequence_dim` is the ids' sequence dimension.
    pub fn new(
        tp: &TensorParallel,
        path: &nn::Path,
        vocab: i64,
        dim: i64,
        sequence_dim: i64,
    ) -> Result<Self> {
        let rows = divide(vocab, tp, &format!("vocabulary of {}", path.path("")))?;
        let init = Init::Randn { mean: 0.0, stdev: 1.0 };
        let weight = slice_var(tp, path, "weight", &whole(init, &[vocab, dim])?, 0)?;
        Ok(Self { tp: tp.clone(), weight, start: tp.rank() as i64 * rows, rows, sequence_dim })
    }

    /// Embeddings of `ids` (whole on every rank).
    pub fn try_forward(&self, ids: &Tensor) -> Result<Tensor> {
        if self.tp.size() == 1 {
            return Ok(Tensor::f_embedding(&self.weight, ids, -1, false, false)?);
        }
        let outside = ids.f_lt(self.start)?.f_logical_or(&ids.f_ge(self.start + self.rows)?)?;
        let local = (ids - self.start).f_masked_fill(&outside, 0)?;
        let found = Tensor::f_embedding(&self.weight, &local, -1, false, false)?
            .f_masked_fill(&outside.f_unsqueeze(-1)?, 0.0)?;
        if self.tp.sequence_parallel() {
            reduce_scatter_to_sequence_region(&self.tp, &found, self.sequence_dim)
        } else {
            reduce_from_region(&self.tp, &found)
        }
    }
}

impl Module for VocabParallelEmbedding {
    fn forward(&self, ids: &Tensor) -> Tensor {
        self.try_forward(ids).unwrap_or_else(|e| panic!("vocab-parallel embedding: {e}"))
    }
}

/// A layer norm, whole on every tensor rank; under sequence parallelism its gradients are
/// summed across the ranks (each normalises its part of the sequence).
pub fn parallel_layer_norm(
    tp: &TensorParallel,
    path: &nn::Path,
    dim: i64,
) -> Result<nn::LayerNorm> {
    let norm = nn::layer_norm(path, vec![dim], Default::default());
    if let Some(ws) = &norm.ws {
        tp.mark_sequence(ws)?;
    }
    if let Some(bs) = &norm.bs {
        tp.mark_sequence(bs)?;
    }
    Ok(norm)
}

/// Copies this rank's slice along `dim` of `whole` into `mine`.
fn load_slice(tp: &TensorParallel, mine: &Tensor, whole: &Tensor, dim: usize) -> Result<()> {
    let part = mine.size()[dim];
    if whole.size()[dim] != part * tp.size() as i64 {
        return Err(Error::Config(format!(
            "a whole tensor of shape {:?} cut {} ways along dimension {dim} does not give this \
             rank's {:?}",
            whole.size(),
            tp.size(),
            mine.size()
        )));
    }
    let slice = whole.f_narrow(dim as i64, tp.rank() as i64 * part, part)?;
    tch::no_grad(|| mine.shallow_clone().f_copy_(&slice))?;
    Ok(())
}
