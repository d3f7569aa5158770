//! Cross-entropy over logits whose vocabulary is split across the tensor ranks, without
//! gathering them (Megatron-LM's `vocab_parallel_cross_entropy`).

use tch::{Kind, Tensor};

use super::TensorParallel;
use super::mappings::reduce_from_region;
use crate::comm::ReduceOp;
use crate::error::{Error, Result};

/// The mean cross-entropy of `logits` (`[.., vocab / T]`, this rank's slice of the
/// vocabulary, the ranks' slices in rank order) against `targets` (`[..]`, whole on every
/// rank): see [`vocab_parallel_token_losses`].
pub fn vocab_parallel_cross_entropy(
    tp: &TensorParallel,
    logits: &Tensor,
    targets: &Tensor,
) -> Result<Tensor> {
    Ok(vocab_parallel_token_losses(tp, logits, targets)?.f_mean(Kind::Float)?)
}

/// The cross-entropy of each target (shaped like `targets`) from `logits` split along the
/// vocabulary. Each rank gets the gradient of its own slice: `softmax − one-hot` on its part.
///
/// The maximum logit (for stability) is taken over the whole vocabulary without gradient;
/// the sums of exponentials and the target logits are summed over the ranks with the
/// identity as backward, so autograd gives exactly the whole-vocabulary gradient.
pub fn vocab_parallel_token_losses(
    tp: &TensorParallel,
    logits: &Tensor,
    targets: &Tensor,
) -> Result<Tensor> {
    let logits = logits.f_to_kind(Kind::Float)?;
    if tp.size() == 1 {
        let last = logits.size().last().copied().unwrap_or(1);
        return Ok(logits
            .f_view([-1, last])?
            .f_cross_entropy_loss::<Tensor>(
                &targets.f_view([-1])?,
                None,
                tch::Reduction::None,
                -100,
                0.0,
            )?
            .f_view(targets.size().as_slice())?);
    }
    let part = *logits.size().last().ok_or_else(|| Error::Training("scalar logits".into()))?;
    let start = tp.rank() as i64 * part;
    let max = logits.f_detach()?.f_amax([-1i64].as_slice(), true)?;
    tp.comm.all_reduce(&max, ReduceOp::Max)?;
    let shifted = logits.f_sub(&max)?;
    let sum_exp = reduce_from_region(
        tp,
        &shifted.f_exp()?.f_sum_dim_intlist([-1i64].as_slice(), false, Kind::Float)?,
    )?;
    let outside = targets.f_lt(start)?.f_logical_or(&targets.f_ge(start + part)?)?;
    let local = (targets - start).f_masked_fill(&outside, 0)?;
    let picked = shifted
        .f_gather(-1, &local.f_unsqueeze(-1)?, false)?
        .f_squeeze_dim(-1)?
        .f_masked_fill(&outside, 0.0)?;
    let target_logit = reduce_from_region(tp, &picked)?;
    Ok(sum_exp.f_log()?.f_sub(&target_logit)?)
}
