//! Batch norm between two layers under DDP: its running statistics (variables of the
//! VarStore that are not parameters) end equal on every process, as torch's DDP keeps them
//! (`broadcast_buffers=True`). Each process normalises by its own batch, so two processes
//! are not one process with twice the batch: `tests/ui.rs` checks that the ranks agree on
//! every variable, not parity with one process.
#![deny(warnings)]

use tch::nn::{self, ModuleT, OptimizerConfig};
use tch::Tensor;

use crate::common::{Data, mlp_with_norm, weights};

#[accel_core::accelerate(strategy = "ddp", cpu = true)]
fn train(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let net = mlp_with_norm(&vs.root(), |p, n| nn::batch_norm1d(p, n, Default::default()));
    let mut opt = nn::Sgd::default().build(&vs, 0.1)?;
    for _ in 0..data.epochs {
        for (x, y) in data.batches() {
            let loss = net.forward_t(&x, true).cross_entropy_for_logits(&y);
            opt.backward_step(&loss);
        }
    }
    Ok(weights(&vs, ""))
}

pub fn run(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    train(data)
}
