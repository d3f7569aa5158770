//! The benchmarks' limit: the same ATen work as an accel step with nothing of accel's around
//! it — tch's forward and backward, ATen's fused AdamW through the shim, and with several
//! processes one hand-written all-reduce of the flat gradients per step over the same
//! transport accel uses (its CPU process group). What a step costs beyond this is accel's
//! overhead (`cargo xtask bench` prints the ratio).

use accel_core::comm::{Communicator, GroupOptions, ProcessGroup, ReduceOp};
use accel_core::shim::{AdamWStep, fused_adamw};
use accel_core::topology::Topology;
use anyhow::Result;
use tch::{Kind, Tensor};

/// AdamW's state for every parameter, stepped by ATen's fused kernel, as
/// `torch.optim.AdamW(fused=True)` holds it.
#[derive(Debug)]
pub struct RawAdamW {
    params: Vec<Tensor>,
    exp_avgs: Vec<Tensor>,
    exp_avg_sqs: Vec<Tensor>,
    steps: Vec<Tensor>,
    hp: AdamWStep,
}

impl RawAdamW {
    /// torch's AdamW defaults (weight decay 0.01) at learning rate `lr`.
    pub fn new(params: Vec<Tensor>, lr: f64) -> Self {
        let zeros = |p: &Tensor| p.zeros_like();
        Self {
            exp_avgs: params.iter().map(zeros).collect(),
            exp_avg_sqs: params.iter().map(zeros).collect(),
            steps: params.iter().map(|p| Tensor::zeros([1], (Kind::Float, p.device()))).collect(),
            params,
            hp: AdamWStep {
                lr,
                beta1: 0.9,
                beta2: 0.999,
                weight_decay: 0.01,
                eps: 1e-8,
                maximize: false,
            },
        }
    }

    /// One step on the parameters' gradients, which are then dropped (torch's default
    /// `zero_grad(set_to_none=True)`, as accel's optimizers and Accelerate's do: the next
    /// backward allocates them afresh, which is part of the work being measured).
    pub fn step(&mut self) -> Result<()> {
        let grads: Vec<Tensor> = self.params.iter().map(Tensor::grad).collect();
        tch::no_grad(|| {
            for s in &mut self.steps {
                let _ = s.g_add_scalar_(1.0);
            }
        });
        fused_adamw(&self.params, &grads, &self.exp_avgs, &self.exp_avg_sqs, &self.steps, self.hp)?;
        for p in &self.params {
            accel_core::shim::set_grad(p, None)?;
        }
        Ok(())
    }
}

/// The processes of an `accel launch`, or none when run alone.
pub fn process_group() -> Result<Option<ProcessGroup>> {
    if std::env::var_os("WORLD_SIZE").is_none() {
        return Ok(None);
    }
    let topology = Topology::from_env()?;
    if topology.world_size == 1 {
        return Ok(None);
    }
    Ok(Some(ProcessGroup::new(&topology, GroupOptions::from_env()?)?))
}

/// Averages the gradients of `params` over `group`: one all-reduce of one flat buffer.
pub fn average_gradients(group: &ProcessGroup, params: &[Tensor]) -> Result<()> {
    let grads: Vec<Tensor> = params.iter().map(|p| p.grad().view([-1])).collect();
    let flat = Tensor::cat(&grads, 0);
    group.all_reduce(&flat, ReduceOp::Avg)?;
    let mut offset = 0;
    for mut g in grads {
        let n = g.size()[0];
        g.copy_(&flat.narrow(0, offset, n));
        offset += n;
    }
    Ok(())
}
