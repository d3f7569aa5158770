//! A zero3 head and its cross-entropy computed where the head's shards live
//! (`Unit::linear_cross_entropy` when the head's rows split evenly over the processes):
//! each process holds whole rows of the head, a slice of the vocabulary, so it computes the
//! logits of every process's rows for its slice, and the processes exchange two numbers per
//! row (the log-sum-exp of their slice and the target's logit) instead of the head. The head
//! is never gathered and its gradient never reduced: each process computes its own shard of
//! the gradient, already summed over every process's rows, and the hidden states' gradients
//! are reduce-scattered (a few MiB, where the head is the vocabulary's size). Megatron's
//! vocabulary-parallel cross-entropy, across the data-parallel group.

use tch::{Device, Kind, Tensor};

use super::flat::Engine;
use crate::error::{Error, Result};
use crate::shim;

impl Engine {
    /// Whether unit `u`'s head `w` can be computed on its shards: a zero3 unit of this one
    /// parameter, 2-d, whose rows divide evenly over more than one process (every shard is
    /// whole rows), not hybrid, with autograd recording and autocast off; `x` `[N, d]`.
    pub(super) fn on_shards_fits(&self, u: usize, w: &Tensor, x: &Tensor) -> Result<bool> {
        let unit = &self.units[u];
        let world = self.group.size() as i64;
        let [s] = unit.members[..] else { return Ok(false) };
        let shard = &self.shards[s];
        let size = shard.param.size();
        Ok(unit.managed
            && !self.failed
            && unit.frozen.is_none()
            && self.replicas.is_none()
            && world > 1
            && size.len() == 2
            && size[0] % world == 0
            && world * unit.segment == shard.numel
            && x.dim() == 2
            && x.size()[1] == size[1]
            && x.device() == shard.master.device()
            && shim::tensor_id(w)? == shard.id
            && shim::autocast_state(x.device())?.is_none()
            && shim::grad_mode_enabled()?)
    }

    /// The mean cross-entropy of this rank's logits `x · wᵀ` against `targets` (rows whose
    /// target is `ignore_index` left out), `w` unit `u`'s head, from the shards
    /// (`on_shards_fits`): the loss, the gradient of `x` (when it needs one) and this rank's
    /// shard of the head's gradient summed over every rank's loss, both for an incoming
    /// gradient of 1. Every rank must call it (collectives).
    pub(super) fn cross_entropy_on_shards(
        &mut self,
        u: usize,
        x: &Tensor,
        targets: &Tensor,
        ignore_index: i64,
    ) -> Result<(Tensor, Option<Tensor>, Tensor)> {
        let (world, rank) = (self.group.size() as i64, self.group.rank() as i64);
        let shard = &self.shards[self.units[u].members[0]];
        let (vocab, d) = (shard.param.size()[0], shard.param.size()[1]);
        let (rows, kind, device) = (vocab / world, x.kind(), x.device());
        let first = rank * rows;
        let group = self.group.clone();
        let gather = |t: &Tensor| group.all_gather_in_place_async(t)?.wait();
        tch::no_grad(|| -> Result<_> {
            let w = shard.master.f_detach()?.f_view([rows, d])?.f_to_kind(kind)?;
            // Every rank's row count and count of rows not ignored.
            let n = x.size()[0];
            let valid = targets.f_ne(ignore_index)?;
            let counts = Tensor::f_zeros([world, 2], (Kind::Int64, device))?;
            let mine = Tensor::from_slice(&[n, valid.f_sum(Kind::Int64)?.f_int64_value(&[])?]);
            counts.f_get(rank)?.f_copy_(&mine)?;
            gather(&counts)?;
            let counts = Vec::<i64>::try_from(counts.f_to_device(Device::Cpu)?.f_view([-1])?)?;
            let most = (0..world as usize).map(|r| counts[2 * r]).max().unwrap_or(0);
            let total = world * most;
            // Every rank's rows, padded to the longest; padding is ignored.
            let xs = Tensor::f_zeros([total, d], (kind, device))?;
            xs.f_narrow(0, rank * most, n)?.f_copy_(x)?;
            gather(&xs)?;
            let ts = Tensor::f_full([total], ignore_index, (Kind::Int64, device))?;
            ts.f_narrow(0, rank * most, n)?.f_copy_(targets)?;
            gather(&ts)?;
            // Each row's weight in its rank's mean: 1 / that rank's count, 0 where ignored. A
            // rank whose rows are all ignored gets zeros, as torch's backward gives it (its
            // loss is NaN), not 1 / 0 × 0 = NaN in every rank's head gradient.
            let per_rank: Vec<f32> = (0..world as usize)
                .map(|r| counts[2 * r + 1])
                .map(|c| if c > 0 { 1.0 / c as f32 } else { 0.0 })
                .collect();
            let weight = Tensor::from_slice(&per_rank)
                .f_to_device(device)?
                .f_repeat_interleave_self_int(most, 0, None)?
                .f_mul(&ts.f_ne(ignore_index)?)?;
            let grad_xs = match x.requires_grad() {
                true => Some(Tensor::f_zeros([total, d], (kind, device))?),
                false => None,
            };
            let mut grad_w: Option<Tensor> = None;
            let ce = Tensor::f_zeros([total], (Kind::Float, device))?;
            let chunk = shim::cross_entropy_chunk(rows);
            for start in (0..total).step_by(chunk.max(1) as usize) {
                let len = chunk.min(total - start);
                let (xc, tc) = (xs.f_narrow(0, start, len)?, ts.f_narrow(0, start, len)?);
                let logits = xc.f_mm(&w.f_tr()?)?.f_to_kind(Kind::Float)?;
                // The rows whose target is in this rank's slice of the vocabulary.
                let local = tc.f_sub_scalar(first)?;
                let here = local.f_ge(0)?.f_logical_and(&local.f_lt(rows)?)?;
                let here = here.f_logical_and(&tc.f_ne(ignore_index)?)?.f_to_kind(Kind::Float)?;
                let index = local.f_clamp(0, rows - 1)?.f_unsqueeze(1)?;
                let picked = logits.f_gather(1, &index, false)?.f_squeeze_dim(1)?.f_mul(&here)?;
                let stats = Tensor::f_zeros([world, 2, len], (Kind::Float, device))?;
                let lse = logits.f_logsumexp([1], false)?;
                stats.f_get(rank)?.f_copy_(&Tensor::f_stack(&[lse, picked], 0)?)?;
                gather(&stats)?;
                let lse = stats.f_select(1, 0)?.f_logsumexp([0], false)?;
                let picked =
                    stats.f_select(1, 1)?.f_sum_dim_intlist([0].as_slice(), false, None)?;
                ce.f_narrow(0, start, len)?.f_copy_(&lse.f_sub(&picked)?)?;
                // The gradient of the rows' losses by these logits: the softmax over the whole
                // vocabulary, less one at the target, times the row's weight.
                let mut p = logits;
                let _ = p.f_sub_(&lse.f_unsqueeze(1)?)?.f_exp_()?;
                let _ = p.f_scatter_add_(1, &index, &here.f_neg()?.f_unsqueeze(1)?)?;
                let _ = p.f_mul_(&weight.f_narrow(0, start, len)?.f_unsqueeze(1)?)?;
                let p = p.f_to_kind(kind)?;
                if let Some(g) = &grad_xs {
                    g.f_narrow(0, start, len)?.f_copy_(&p.f_mm(&w)?)?;
                }
                // As autograd's backward of x · wᵀ lays it out: pᵀ · x.
                grad_w = Some(match grad_w {
                    None => p.f_tr()?.f_mm(&xc)?,
                    Some(mut g) => {
                        let _ = g.f_addmm_(&p.f_tr()?, &xc)?;
                        g
                    }
                });
            }
            let valid = valid.f_to_kind(Kind::Float)?;
            let count = valid.f_sum(Kind::Float)?;
            let loss = ce.f_narrow(0, rank * most, n)?.f_mul(&valid)?.f_sum(Kind::Float)?;
            let loss = loss.f_div(&count)?;
            // Each rank's rows' gradient, summed over every rank's slice of the vocabulary.
            let grad_x = match grad_xs {
                Some(g) => {
                    group.reduce_scatter_in_place_async(&g, crate::comm::ReduceOp::Sum)?.wait()?;
                    Some(g.f_narrow(0, rank * most, n)?)
                }
                None => None,
            };
            let grad_w = match grad_w {
                Some(g) => g,
                None => Tensor::f_zeros([rows, d], (kind, device))?,
            };
            Ok((loss, grad_x, grad_w))
        })
    }

    /// Backward reached the loss of `cross_entropy_on_shards` with gradient `g`: adds
    /// `grad` (its head gradient shard), scaled by `g` and averaged over the ranks as a
    /// reduced gradient is, into the master shard's gradient, and counts the unit reduced.
    /// An error if the ranks' `g` differ: the shard sums every rank's rows, so one scale
    /// must hold for all (a collective: every rank's backward reaches it).
    pub(super) fn add_gradient_on_shards(
        &mut self,
        u: usize,
        grad: &Tensor,
        g: &Tensor,
    ) -> Result<()> {
        let (world, rank) = (self.group.size() as i64, self.group.rank() as i64);
        let scales = Tensor::f_zeros([world], (Kind::Double, g.device()))?;
        scales.f_narrow(0, rank, 1)?.f_copy_(&g.f_reshape([1])?.f_to_kind(Kind::Double)?)?;
        self.group.all_gather_in_place_async(&scales)?.wait()?;
        let scales = Vec::<f64>::try_from(scales.f_to_device(Device::Cpu)?)?;
        let shard = &self.shards[self.units[u].members[0]];
        if scales.iter().any(|s| s.to_bits() != scales[0].to_bits()) {
            return Err(Error::Training(format!(
                "zero3: the head `{}` computes its gradient on each process's slice of the \
                 vocabulary, summed over every process's rows, so the loss's gradient must be \
                 the same on every process; it came as {scales:?} (by rank). Scale every \
                 process's loss alike (a loss weighted per process can be weighted by an \
                 all-reduced figure instead)",
                shard.name
            )));
        }
        tch::no_grad(|| -> Result<()> {
            let mut part = grad.f_reshape([-1])?.f_to_kind(Kind::Float)?;
            if scales[0] != 1.0 {
                part = part.f_mul_scalar(scales[0])?;
            }
            let part = part.f_to_device(shard.master.device())?.f_div_scalar(world as f64)?;
            let unit = &mut self.units[u];
            unit.reduced = true;
            if !unit.gets_gradient {
                self.update_due = self.update.is_some();
                return shard.add_to_grad(&part);
            }
            // An embedding tied to this head sends its part later: added with it.
            unit.shard_part = Some(match unit.shard_part.take() {
                Some(earlier) => earlier.f_add(&part)?,
                None => part,
            });
            Ok(())
        })
    }
}
