//! Context parallelism: each sequence split across the mesh's context dimension, so that
//! activations (and attention's cost) per process shrink with the number of context ranks.
//! Accelerate's `parallelism_config` cp_size; the attention exchange is DeepSpeed-Ulysses'
//! (Accelerate's sp_size), an all-to-all over heads.
//!
//! Every layer but attention works on positions independently, so a rank runs it on its
//! own part of the sequence. Attention needs every position: before it, an all-to-all turns
//! "this rank's positions, every head" into "every position, this rank's heads"
//! ([`ContextParallel::sequence_to_heads`]); each rank attends over the whole sequence for
//! its heads (causal masking as without context parallelism); a second all-to-all turns the
//! result back ([`ContextParallel::heads_to_sequence`]). Backward exchanges the gradients
//! the opposite way (an all-to-all is its own inverse). Each rank does the same work (a
//! whole causal sequence for the same number of heads), so the ring schedule's load
//! balancing (torch's head-tail chunks, Megatron's) has nothing to balance here. Where the
//! heads (per tensor rank) do not divide among the context ranks, [`ContextParallel::attention`]
//! all-gathers the keys and values instead (torch's `allgather` rotation, not load-balanced:
//! the masked scores are computed and discarded, as the math kernel does anyway).
//!
//! To a strategy the context ranks are data-parallel ranks: they hold the same weights and
//! their gradients (from different positions of one batch) are averaged over the mesh's
//! data dimension, which includes them. The data loader deals batches over
//! [`crate::mesh::Dim::Batch`], which does not: the ranks of a context group get the same
//! batch and each keeps its part ([`ContextParallel::shard`]). With the loss a mean over a
//! rank's positions, the average of the ranks' gradients is the gradient of the mean over
//! the whole sequence.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tch::{Device, Kind, Tensor};

use crate::comm::{Communicator, LocalComm, ReduceOp};
use crate::error::{Error, Result};
use crate::shim::add_grad_hook;
use crate::strategy::tp::{concat_gathered, straight_through, sum_grad_in_backward};

/// The context dimension of the run (from [`crate::Accelerator::context_parallel`]): which
/// part of each sequence this process holds, and the exchanges attention needs. Cheap to
/// clone; with one rank every method is the identity.
#[derive(Clone)]
pub struct ContextParallel {
    comm: Arc<dyn Communicator>,
    /// Whether a sequence was split ([`shard`](Self::shard)) through this handle or a
    /// clone: the accelerator refuses a context-parallel step that split nothing.
    split: Arc<AtomicBool>,
}

impl std::fmt::Debug for ContextParallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ContextParallel")
            .field("rank", &self.rank())
            .field("size", &self.size())
            .finish_non_exhaustive()
    }
}

impl ContextParallel {
    /// Context parallelism over `comm` (its ranks hold consecutive parts of each sequence,
    /// in rank order).
    pub fn new(comm: Arc<dyn Communicator>) -> Self {
        Self { comm, split: Arc::default() }
    }

    /// No context parallelism: one rank holding whole sequences.
    pub fn single() -> Self {
        Self::new(Arc::new(LocalComm))
    }

    /// This process's context rank.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// Number of context ranks.
    pub fn size(&self) -> usize {
        self.comm.size()
    }

    /// The context dimension's communicator.
    pub fn comm(&self) -> &Arc<dyn Communicator> {
        &self.comm
    }

    /// This rank's part of `x` along `dim` (the sequence): what it feeds the model of a
    /// batch all context ranks were dealt (inputs, labels, masks). The length must divide
    /// among the ranks. The part is contiguous.
    pub fn shard(&self, x: &Tensor, dim: i64) -> Result<Tensor> {
        if self.size() == 1 {
            return Ok(x.shallow_clone());
        }
        self.split.store(true, Ordering::Relaxed);
        let length = x.size().get(dim as usize).copied().unwrap_or(0);
        let n = self.size() as i64;
        if length % n != 0 {
            return Err(Error::Config(format!(
                "context parallelism: the sequence (dimension {dim} of shape {:?}) has {length} \
                 positions, which do not divide among the {n} context ranks; pad it to a \
                 multiple of {n}",
                x.size()
            )));
        }
        // Contiguous: what is fed the model is viewed in any shape (targets flattened).
        Ok(x.f_narrow(dim, self.rank() as i64 * (length / n), length / n)?.f_contiguous()?)
    }

    /// Whether anything split a sequence through this handle (or a clone) yet.
    pub(crate) fn has_split(&self) -> bool {
        self.split.load(Ordering::Relaxed)
    }

    /// The positions (in the whole sequence) of this rank's `local` positions, for position
    /// embeddings.
    pub fn positions(&self, local: i64, device: Device) -> Tensor {
        let start = self.rank() as i64 * local;
        Tensor::arange_start(start, start + local, (Kind::Int64, device))
    }

    /// Every rank's part of `x` along `dim`, concatenated in rank order, without gradients:
    /// whole sequences back for metrics or generation.
    pub fn gather(&self, x: &Tensor, dim: i64) -> Result<Tensor> {
        if self.size() == 1 {
            return Ok(x.shallow_clone());
        }
        let parts = self.comm.all_gather_list(&x.f_detach()?.f_contiguous()?)?;
        Ok(Tensor::f_cat(&parts, dim)?)
    }

    /// The mean over the context ranks of a value each computed on its part, without
    /// gradients: a loss over the whole sequence, for logging (each rank's loss is a mean
    /// over as many positions).
    pub fn average(&self, x: &Tensor) -> Result<Tensor> {
        if self.size() == 1 {
            return Ok(x.shallow_clone());
        }
        let mean = x.f_detach()?.f_to_kind(Kind::Float)?.f_contiguous()?.f_detach_copy()?;
        self.comm.all_reduce(&mean, ReduceOp::Avg)?;
        Ok(mean)
    }

    /// `[batch, local positions, heads, …]` (this rank's positions, every head) to
    /// `[batch, positions, heads / size, …]` (every position, this rank's heads: the
    /// `rank`-th group of consecutive heads). Differentiable; the heads must divide among
    /// the context ranks.
    pub fn sequence_to_heads(&self, x: &Tensor) -> Result<Tensor> {
        if self.size() == 1 {
            return Ok(x.shallow_clone());
        }
        let (shape, n) = (x.size(), self.size() as i64);
        if shape.len() < 3 || shape[2] % n != 0 {
            return Err(Error::Config(format!(
                "context parallelism: attention's input {shape:?} must be [batch, positions, \
                 heads, …] with heads divisible by the {n} context ranks (each attends for \
                 heads / {n} of them); use a number of heads (per tensor-parallel rank) \
                 divisible by context_parallel"
            )));
        }
        let (b, t, h) = (shape[0], shape[1], shape[2]);
        let mut parts = vec![b, t, n, h / n];
        parts.extend(&shape[3..]);
        // Part j (heads of group j) to rank j; part i back is rank i's positions.
        let parts = x.f_reshape(&parts)?.f_movedim([2], [0])?.f_contiguous()?;
        let got = self.exchange(&parts)?.f_movedim([0], [1])?;
        let mut whole = vec![b, n * t, h / n];
        whole.extend(&shape[3..]);
        Ok(got.f_reshape(&whole)?)
    }

    /// The inverse of [`sequence_to_heads`](Self::sequence_to_heads): `[batch, positions,
    /// heads / size, …]` to `[batch, local positions, heads, …]`. Differentiable.
    pub fn heads_to_sequence(&self, x: &Tensor) -> Result<Tensor> {
        if self.size() == 1 {
            return Ok(x.shallow_clone());
        }
        let (shape, n) = (x.size(), self.size() as i64);
        if shape.len() < 3 || shape[1] % n != 0 {
            return Err(Error::Config(format!(
                "context parallelism: attention's output {shape:?} must be [batch, positions, \
                 heads, …] with positions divisible by the {n} context ranks"
            )));
        }
        let (b, t, h) = (shape[0], shape[1] / n, shape[2]);
        let mut parts = vec![b, n, t, h];
        parts.extend(&shape[3..]);
        // Part i (positions of part i) to rank i; part j back is rank j's heads.
        let parts = x.f_reshape(&parts)?.f_movedim([1], [0])?.f_contiguous()?;
        let got = self.exchange(&parts)?.f_movedim([0], [2])?;
        let mut local = vec![b, t, n * h];
        local.extend(&shape[3..]);
        Ok(got.f_reshape(&local)?)
    }

    /// Scaled dot-product attention over the whole sequence for this rank's positions:
    /// `q`, `k`, `v` are `[batch, local positions, heads, head width]`, as is the result.
    /// Causal masking (`causal`) is over positions of the whole sequence. Where the heads
    /// divide among the context ranks, by all-to-all over heads (each rank attends over every
    /// position for its heads); otherwise by all-gather of the keys and values (each rank
    /// attends for its positions over every key, torch's `allgather` context parallelism,
    /// whose backward reduce-scatters their gradients).
    pub fn attention(&self, q: &Tensor, k: &Tensor, v: &Tensor, causal: bool) -> Result<Tensor> {
        let heads = q.size().get(2).copied().unwrap_or(0);
        if self.size() == 1 || heads % self.size() as i64 == 0 {
            let whole = |x: &Tensor| -> Result<Tensor> {
                Ok(self.sequence_to_heads(x)?.f_transpose(1, 2)?)
            };
            let (q, k, v) = (whole(q)?, whole(k)?, whole(v)?);
            // Every position is here: the ordinary causal mask.
            let attended = Tensor::f_scaled_dot_product_attention::<Tensor>(
                &q, &k, &v, None, 0.0, causal, None, false,
            )?;
            return self.heads_to_sequence(&attended.f_transpose(1, 2)?);
        }
        // [batch, heads, positions, width]: this rank's queries, every rank's keys and values.
        let (q, k, v) = (q.f_transpose(1, 2)?, self.gather_keys(k)?, self.gather_keys(v)?);
        let (local, whole) = (q.size()[2], k.size()[2]);
        let mask = causal.then(|| {
            // Query i of this rank is position rank·local + i; it sees keys up to it.
            let queries = self.positions(local, q.device()).unsqueeze(1);
            let keys = Tensor::arange(whole, (Kind::Int64, q.device())).unsqueeze(0);
            keys.less_equal_tensor(&queries)
        });
        let attended =
            Tensor::f_scaled_dot_product_attention(&q, &k, &v, mask, 0.0, false, None, false)?;
        Ok(attended.f_transpose(1, 2)?)
    }

    /// Every rank's `[batch, local positions, heads, width]` keys (or values), as
    /// `[batch, heads, positions, width]`: this rank's part keeps its history, and the
    /// gradient of the whole is summed over the ranks in backward (each rank's queries
    /// reach every part), so that this rank's part gets its share from every rank.
    fn gather_keys(&self, x: &Tensor) -> Result<Tensor> {
        let whole = concat_gathered(self.comm.as_ref(), x, 1)?;
        Ok(sum_grad_in_backward(&self.comm, &whole, "context parallelism")?.f_transpose(1, 2)?)
    }

    /// The all-to-all of `parts` (`[size, …]`, part j to rank j) with its gradient: the
    /// same exchange of the gradient in backward, an all-to-all being its own inverse
    /// (what rank r sent to j as part j comes back from j as part r).
    fn exchange(&self, parts: &Tensor) -> Result<Tensor> {
        let value = self.comm.all_to_all(&parts.f_detach()?)?;
        if !parts.requires_grad() {
            return Ok(value);
        }
        let through = parts.f_view_as(parts)?;
        let comm = self.comm.clone();
        add_grad_hook(&through, move |grad| {
            match grad.f_contiguous().map_err(Error::from).and_then(|g| comm.all_to_all(&g)) {
                Ok(g) => Some(g),
                Err(e) => panic!("context parallelism: exchanging a gradient: {e}"),
            }
        })?;
        // The exchanged value, with the gradient flowing to `through` (and its hook).
        straight_through(&value, &through)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::comm::tests::on_ranks;

    fn tensor(values: &[f64], shape: [i64; 4]) -> Tensor {
        Tensor::from_slice(values).view(shape)
    }

    /// A context-parallel step on which nothing split a sequence is refused, naming what to
    /// do; once the program splits its inputs, the same step runs.
    #[test]
    fn a_step_that_split_no_sequence_is_refused_under_context_parallelism() {
        use crate::mesh::{DeviceMesh, Dim, ParallelDims};
        let outcomes = on_ranks(2, Duration::from_secs(30), |group| {
            let rank = group.rank();
            let process = crate::comm::tests::topology(rank, 2, 0);
            let dims = ParallelDims::new(2, 1, 1, 1, 2, 1).unwrap();
            let comm: Arc<dyn Communicator> = Arc::new(group.clone());
            let comms = [Dim::Data, Dim::DataShard, Dim::Context].map(|d| (d, comm.clone()));
            let mesh = DeviceMesh::from_parts(dims, rank, Some(group), comms);
            let acc = crate::Accelerator::builder()
                .strategy(crate::Strategy::Ddp)
                .cpu(true)
                .thread_rank(process, mesh)
                .build()
                .unwrap();
            let vs = tch::nn::VarStore::new(Device::Cpu);
            let linear = tch::nn::linear(vs.root() / "l", 3, 1, Default::default());
            acc.prepare_model(&vs).unwrap();
            let x = Tensor::ones([2, 4, 3], (Kind::Float, Device::Cpu));
            let loss = |x: &Tensor| x.apply(&linear).mean(Kind::Float);
            let refused = acc.backward(&loss(&x)).unwrap_err().to_string();
            let cp = acc.context_parallel();
            let part = cp.shard(&x, 1).unwrap();
            (refused, acc.backward(&loss(&part)).is_ok(), part.size())
        });
        for (refused, ran, shape) in outcomes {
            assert!(refused.contains("nothing split a sequence"), "{refused}");
            assert!(refused.contains("context_parallel().shard"), "{refused}");
            assert!(ran, "the step after the inputs were split failed");
            assert_eq!(shape, [2, 2, 3]);
        }
    }

    /// Attention of 2 context ranks, each holding half of every sequence, equals attention
    /// on the whole sequences on one process, forward and backward.
    #[test]
    fn attention_split_across_context_ranks_equals_the_whole_sequence_with_gradients() {
        // 4 heads divide among 2 ranks (all-to-all); 3 do not (all-gather of keys, values).
        for heads in [4, 3] {
            attention_on_2_ranks_equals_the_whole(heads);
        }
    }

    fn attention_on_2_ranks_equals_the_whole(heads: i64) {
        let shape = [2, 8, heads, 5];
        let random = |seed: i64| -> Vec<f64> {
            tch::manual_seed(seed);
            Vec::try_from(Tensor::randn(shape, (Kind::Double, Device::Cpu)).view([-1])).unwrap()
        };
        let inputs: Arc<[Vec<f64>; 4]> = Arc::new([random(1), random(2), random(3), random(4)]);
        let run = move |cp: &ContextParallel, inputs: &[Vec<f64>; 4]| -> [Tensor; 4] {
            let part =
                |x: &[f64]| cp.shard(&tensor(x, shape), 1).unwrap().copy().set_requires_grad(true);
            let (q, k, v) = (part(&inputs[0]), part(&inputs[1]), part(&inputs[2]));
            let out = cp.attention(&q, &k, &v, true).unwrap();
            let weights = cp.shard(&tensor(&inputs[3], shape), 1).unwrap();
            (&out * weights).sum(Kind::Double).backward();
            [out, q.grad(), k.grad(), v.grad()].map(|x| cp.gather(&x, 1).unwrap())
        };
        let expected = run(&ContextParallel::single(), &inputs);
        let results = on_ranks(2, Duration::from_secs(30), move |g| {
            let cp = ContextParallel::new(Arc::new(g));
            run(&cp, &inputs).map(|t| Vec::<f64>::try_from(t.view([-1])).unwrap())
        });
        for got in results {
            for (name, got, want) in ["output", "dq", "dk", "dv"]
                .into_iter()
                .zip(got)
                .zip(&expected)
                .map(|((n, g), w)| (n, g, w))
            {
                let diff = (tensor(&got, shape) - want).abs().max().double_value(&[]);
                assert!(diff < 1e-12, "{heads} heads: {name} differs by {diff}");
            }
        }
    }
}
