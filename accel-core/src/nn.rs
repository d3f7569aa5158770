//! Layers whose computation spans processes — [`SyncBatchNorm`], torch's `SyncBatchNorm` —
//! variables that take no memory until a checkpoint fills them ([`uninit`]), and a language
//! model's head fused with its loss ([`linear_cross_entropy`]).
//!
//! With data parallelism, tch's batch norm normalises each process's batch by that batch's
//! own statistics. `SyncBatchNorm` normalises by the statistics of the batches of every
//! process of the data-parallel group together — what one process with the whole batch
//! would compute — and updates its running statistics with them. Made by
//! [`crate::Accelerator::batch_norm2d`] (and 1d, 3d), with tch's signature and variable
//! names; `#[accelerate(sync_batchnorm = true)]` turns the body's `nn::batch_norm*d` into
//! them.

use std::sync::Arc;

use tch::nn::{BatchNorm, BatchNormConfig, ModuleT};
use tch::{Kind, Tensor};

use crate::comm::{Communicator, ReduceOp};
use crate::shim::add_grad_hook;

pub use crate::shim::cross_entropy_chunk;

/// `logits = x · wᵀ` (a linear layer without bias: a language model's head) followed by the
/// mean cross-entropy against `targets`, rows whose target is `ignore_index` left out —
/// torch's `cross_entropy(x @ w.T, targets, ignore_index=..)` — computed a few rows at a
/// time ([`cross_entropy_chunk`]) so that the `N × V` logits are never in memory whole.
/// Each chunk's gradients are computed in the forward pass (by torch's own backward of
/// `nll_loss` and `log_softmax`) and kept; backward only scales them, so nothing is computed
/// twice and `w` is not read again. `x` is `[N, d]`, `w` `[V, d]`, `targets` `[N]` int64; the
/// gradient reaches both `x` and `w` (one gradient for `w`, summed over the chunks). With one
/// chunk every value is torch's. At 2 × 1024 tokens of a 32000-entry
/// vocabulary the logits, their log-softmax and its gradient are 250 MiB each. Under
/// autocast the products run in its dtype, as the linear layer's would; the loss is fp32.
pub fn linear_cross_entropy(
    x: &Tensor,
    w: &Tensor,
    targets: &Tensor,
    ignore_index: i64,
) -> crate::Result<Tensor> {
    crate::shim::linear_cross_entropy_in_chunks(x, w, targets, ignore_index)
}

/// A trainable variable `name` of shape `dims` under `path` whose values are not set: its
/// memory is reserved but not touched (a large allocation takes no resident memory until
/// written), as PyTorch's meta-device initialisation leaves a model. Build a model of these,
/// then [`crate::Accelerator::prepare_model_from_checkpoint`]: under zero3 each process then
/// fills only its own shard. Reading one before it is loaded reads garbage.
pub fn uninit(path: &tch::nn::Path, name: &str, dims: &[i64]) -> Tensor {
    let empty = Tensor::empty(dims, (path.kind(), path.device()));
    path.add(name, empty, true)
}

/// Batch normalisation over the batches of every data-parallel process (see the module).
/// Its variables are tch's `BatchNorm`'s: `weight`, `bias`, `running_mean`, `running_var`.
#[derive(Debug)]
pub struct SyncBatchNorm {
    config: BatchNormConfig,
    /// The running mean (a buffer).
    pub running_mean: Tensor,
    /// The running variance, unbiased (a buffer).
    pub running_var: Tensor,
    /// The scale, when affine.
    pub ws: Option<Tensor>,
    /// The shift, when affine.
    pub bs: Option<Tensor>,
    /// Spatial dimensions: 1, 2 or 3.
    pub nd: usize,
    /// The processes whose batches are normalised together; `None` for one process.
    group: Option<Arc<dyn Communicator>>,
}

impl SyncBatchNorm {
    /// `bn` (made with `config`), its statistics shared across `group`.
    pub fn new(bn: BatchNorm, config: BatchNormConfig, group: Arc<dyn Communicator>) -> Self {
        let group = (group.size() > 1).then_some(group);
        Self {
            config,
            running_mean: bn.running_mean,
            running_var: bn.running_var,
            ws: bn.ws,
            bs: bn.bs,
            nd: bn.nd,
            group,
        }
    }

    fn check_dims(&self, xs: &Tensor) {
        let dim = xs.dim();
        let ok = if self.nd == 1 { dim == 2 || dim == 3 } else { dim == self.nd + 2 };
        assert!(
            ok,
            "batch_norm{}d expects an input of {} dimensions, got {:?}",
            self.nd,
            if self.nd == 1 { "2 or 3".to_owned() } else { (self.nd + 2).to_string() },
            xs.size()
        );
    }

    /// The forward pass of training with several processes: statistics over all of their
    /// batches, running statistics updated with them.
    fn synchronised(&self, xs: &Tensor, group: &Arc<dyn Communicator>) -> Tensor {
        let channels = xs.size()[1];
        let dims: Vec<i64> = (0..xs.dim() as i64).filter(|&d| d != 1).collect();
        let mut shape = vec![1i64; xs.dim()];
        shape[1] = channels;
        // Statistics in fp32 whatever autocast made the input.
        let x = xs.to_kind(Kind::Float);
        let count = (x.numel() as i64 / channels) as f64;
        let local = Tensor::cat(
            &[
                x.sum_dim_intlist(dims.as_slice(), false, Kind::Float),
                Tensor::from_slice(&[count as f32]),
            ],
            0,
        );
        let totals = all_reduce_sum(group, &local);
        let total = totals.get(channels).double_value(&[]);
        let mean = totals.narrow(0, 0, channels) / total;
        let centred = &x - mean.view(shape.as_slice());
        let squares = centred.square().sum_dim_intlist(dims.as_slice(), false, Kind::Float);
        let var = all_reduce_sum(group, &squares) / total;
        let invstd = (&var + self.config.eps).rsqrt();
        let y = centred * invstd.view(shape.as_slice());
        let y = match &self.ws {
            Some(w) => y * w.view(shape.as_slice()),
            None => y,
        };
        let y = match &self.bs {
            Some(b) => y + b.view(shape.as_slice()),
            None => y,
        };
        tch::no_grad(|| {
            let m = self.config.momentum;
            let unbiased = var.detach() * (total / (total - 1.0).max(1.0));
            let rm = &self.running_mean * (1.0 - m) + mean.detach() * m;
            let rv = &self.running_var * (1.0 - m) + unbiased * m;
            self.running_mean.shallow_clone().copy_(&rm);
            self.running_var.shallow_clone().copy_(&rv);
        });
        y.to_kind(xs.kind())
    }
}

/// `x` summed across `group`, as an autograd operation: the gradient of the sum reaching
/// this process is summed across the group too (each process's loss depends on every
/// process's input through the shared statistics). A failed collective panics, as a
/// failure inside `Module::forward` cannot be returned; the accelerator reports it.
fn all_reduce_sum(group: &Arc<dyn Communicator>, x: &Tensor) -> Tensor {
    let summed = x.detach().contiguous().copy();
    if let Err(e) = group.all_reduce(&summed, ReduceOp::Sum) {
        panic!("SyncBatchNorm: summing batch statistics across processes: {e}");
    }
    if !x.requires_grad() {
        return summed;
    }
    let through = x.view_as(x);
    let comm = group.clone();
    let hooked = add_grad_hook(&through, move |grad| {
        let g = grad.contiguous().copy();
        match comm.all_reduce(&g, ReduceOp::Sum) {
            Ok(()) => Some(g),
            Err(e) => panic!("SyncBatchNorm: summing gradients across processes: {e}"),
        }
    });
    if let Err(e) = hooked {
        panic!("SyncBatchNorm: {e}");
    }
    // The value of the sum, the gradient of `through`.
    summed + (&through - through.detach())
}

impl ModuleT for SyncBatchNorm {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        self.check_dims(xs);
        match &self.group {
            Some(group) if train => self.synchronised(xs, group),
            _ => Tensor::batch_norm(
                xs,
                self.ws.as_ref(),
                self.bs.as_ref(),
                Some(&self.running_mean),
                Some(&self.running_var),
                train,
                self.config.momentum,
                self.config.eps,
                self.config.cudnn_enabled,
            ),
        }
    }
}

impl crate::Accelerator {
    fn batch_norm(&self, bn: BatchNorm, config: BatchNormConfig) -> SyncBatchNorm {
        let group = if self.inner.sync_batchnorm {
            self.mesh().comm(crate::mesh::Dim::Data)
        } else {
            Arc::new(crate::comm::LocalComm)
        };
        SyncBatchNorm::new(bn, config, group)
    }

    /// tch's `nn::batch_norm1d`, with statistics over every data-parallel process's batch
    /// when the accelerator is built with `sync_batchnorm(true)` (else tch's, per process).
    pub fn batch_norm1d<'a, T: std::borrow::Borrow<tch::nn::Path<'a>>>(
        &self,
        vs: T,
        out_dim: i64,
        config: BatchNormConfig,
    ) -> SyncBatchNorm {
        self.batch_norm(tch::nn::batch_norm1d(vs, out_dim, config), config)
    }

    /// tch's `nn::batch_norm2d`; see [`batch_norm1d`](Self::batch_norm1d).
    pub fn batch_norm2d<'a, T: std::borrow::Borrow<tch::nn::Path<'a>>>(
        &self,
        vs: T,
        out_dim: i64,
        config: BatchNormConfig,
    ) -> SyncBatchNorm {
        self.batch_norm(tch::nn::batch_norm2d(vs, out_dim, config), config)
    }

    /// tch's `nn::batch_norm3d`; see [`batch_norm1d`](Self::batch_norm1d).
    pub fn batch_norm3d<'a, T: std::borrow::Borrow<tch::nn::Path<'a>>>(
        &self,
        vs: T,
        out_dim: i64,
        config: BatchNormConfig,
    ) -> SyncBatchNorm {
        self.batch_norm(tch::nn::batch_norm3d(vs, out_dim, config), config)
    }
}
