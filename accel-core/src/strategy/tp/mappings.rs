//! The collectives between tensor-parallel layers, each with its conjugate in backward
//! (Megatron-LM's `mappings.py`): what forward does to the activations, backward does the
//! opposite to their gradients.
//!
//! tch has no custom autograd functions, so each is built from ordinary operations:
//! a gradient hook on an identity view sums the gradient across the tensor ranks; a
//! straight-through sum (`reduced + (x − x.detach())`) gives a forward value exactly the
//! collective's with the gradient of the identity; a concatenation of the gathered pieces
//! with this rank's own piece (which keeps its autograd history) gives an all-gather whose
//! backward takes this rank's slice. Backward all-gathers and reduce-scatters are done as
//! all-reduces of zero-padded gradients: correct, at twice the bytes of a fused kernel.

use std::sync::Arc;

use tch::Tensor;

use super::TensorParallel;
use crate::comm::{Communicator, ReduceOp};
use crate::error::{Error, Result};
use crate::shim::add_grad_hook;

/// What a failed exchange of these mappings is reported as.
const TP: &str = "tensor parallelism";

fn last(x: &Tensor) -> i64 {
    x.dim() as i64 - 1
}

/// `x` itself, whose gradient is summed over `comm`'s ranks in backward (`what` names the
/// parallelism in a failure). Context parallelism uses it too.
pub(crate) fn sum_grad_in_backward(
    comm: &Arc<dyn Communicator>,
    x: &Tensor,
    what: &'static str,
) -> Result<Tensor> {
    let y = x.f_view_as(x)?;
    if y.requires_grad() {
        let comm = comm.clone();
        add_grad_hook(&y, move |grad| {
            let summed = grad.f_contiguous().and_then(|g| g.f_detach_copy());
            let summed = summed.map_err(Error::from).and_then(|g| {
                comm.all_reduce(&g, ReduceOp::Sum)?;
                Ok(g)
            });
            match summed {
                Ok(g) => Some(g),
                Err(e) => panic!("{what}: summing a gradient across ranks: {e}"),
            }
        })?;
    }
    Ok(y)
}

/// A value equal to `value` (computed without autograd) whose gradient flows to `x` as if
/// it were `x` itself.
pub(crate) fn straight_through(value: &Tensor, x: &Tensor) -> Result<Tensor> {
    if !x.requires_grad() {
        return Ok(value.shallow_clone());
    }
    Ok(value.f_add(&x.f_sub(&x.f_detach()?)?)?)
}

/// Every rank of `comm`'s `x` concatenated along `dim`, this rank's piece being `x` itself.
pub(crate) fn concat_gathered(comm: &dyn Communicator, x: &Tensor, dim: i64) -> Result<Tensor> {
    let mut pieces = comm.all_gather_list(&x.f_detach()?.f_contiguous()?)?;
    pieces[comm.rank()] = x.shallow_clone();
    Ok(Tensor::f_cat(&pieces, dim)?)
}

/// This rank's slice of `x` along `dim` (which must divide by the tensor ranks).
fn own_slice(tp: &TensorParallel, x: &Tensor, dim: i64, what: &str) -> Result<Tensor> {
    let size = x.size()[dim as usize];
    let n = tp.size() as i64;
    if size % n != 0 {
        return Err(Error::Config(format!(
            "{what}: dimension {dim} of size {size} does not divide among the {n} tensor ranks"
        )));
    }
    Ok(x.f_narrow(dim, tp.rank() as i64 * (size / n), size / n)?)
}

/// Identity forward; gradients summed over the tensor ranks in backward
/// (`copy_to_tensor_model_parallel_region`): the input of a column-parallel layer.
pub fn copy_to_region(tp: &TensorParallel, x: &Tensor) -> Result<Tensor> {
    if tp.size() == 1 {
        return Ok(x.shallow_clone());
    }
    sum_grad_in_backward(&tp.comm, x, TP)
}

/// Sum over the tensor ranks forward; identity backward
/// (`reduce_from_tensor_model_parallel_region`): the output of a row-parallel layer.
pub fn reduce_from_region(tp: &TensorParallel, x: &Tensor) -> Result<Tensor> {
    if tp.size() == 1 {
        return Ok(x.shallow_clone());
    }
    let summed = x.f_detach()?.f_contiguous()?.f_detach_copy()?;
    tp.comm.all_reduce(&summed, ReduceOp::Sum)?;
    straight_through(&summed, x)
}

/// This rank's slice of the last dimension forward; all-gather backward
/// (`scatter_to_tensor_model_parallel_region`).
pub fn scatter_to_region(tp: &TensorParallel, x: &Tensor) -> Result<Tensor> {
    if tp.size() == 1 {
        return Ok(x.shallow_clone());
    }
    own_slice(tp, &sum_grad_in_backward(&tp.comm, x, TP)?, last(x), "scatter_to_region")
}

/// All-gather along the last dimension forward; this rank's slice backward
/// (`gather_from_tensor_model_parallel_region`).
pub fn gather_from_region(tp: &TensorParallel, x: &Tensor) -> Result<Tensor> {
    if tp.size() == 1 {
        return Ok(x.shallow_clone());
    }
    concat_gathered(tp.comm.as_ref(), x, last(x))
}

/// Sequence parallelism: this rank's part of the sequence (dimension `dim`) forward;
/// all-gather backward (`scatter_to_sequence_parallel_region`).
pub fn scatter_to_sequence_region(tp: &TensorParallel, x: &Tensor, dim: i64) -> Result<Tensor> {
    if tp.size() == 1 {
        return Ok(x.shallow_clone());
    }
    own_slice(tp, &sum_grad_in_backward(&tp.comm, x, TP)?, dim, "scatter_to_sequence_region")
}

/// Sequence parallelism: all-gather of the sequence (dimension `dim`) forward;
/// reduce-scatter backward (`gather_from_sequence_parallel_region`): the input of a
/// column-parallel layer.
pub fn gather_from_sequence_region(tp: &TensorParallel, x: &Tensor, dim: i64) -> Result<Tensor> {
    if tp.size() == 1 {
        return Ok(x.shallow_clone());
    }
    // The gathered tensor's gradient summed over ranks, then sliced back: a reduce-scatter.
    sum_grad_in_backward(&tp.comm, &concat_gathered(tp.comm.as_ref(), x, dim)?, TP)
}

/// Sequence parallelism: sum over the tensor ranks, keeping this rank's part of the
/// sequence (dimension `dim`), forward; all-gather backward
/// (`reduce_scatter_to_sequence_parallel_region`): the output of a row-parallel layer.
pub fn reduce_scatter_to_sequence_region(
    tp: &TensorParallel,
    x: &Tensor,
    dim: i64,
) -> Result<Tensor> {
    if tp.size() == 1 {
        return Ok(x.shallow_clone());
    }
    let moved = x.f_detach()?.f_transpose(0, dim)?.f_contiguous()?;
    let reduced = tp.comm.reduce_scatter(&moved, ReduceOp::Sum)?.f_transpose(0, dim)?;
    let own = scatter_to_sequence_region(tp, x, dim)?;
    straight_through(&reduced, &own)
}
