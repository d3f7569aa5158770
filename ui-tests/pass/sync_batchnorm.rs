//! `sync_batchnorm = true`: the body's `nn::batch_norm1d` becomes the accelerator's, whose
//! statistics span every process's batch, so two processes with batches of 8 compute what
//! one process with batches of 16 does, running statistics included; under zero3.
#![deny(warnings)]

use tch::nn::{self, ModuleT, OptimizerConfig};
use tch::Tensor;

use crate::common::{Data, mlp_with_norm, weights};

#[accel_core::accelerate(strategy = "zero3", sync_batchnorm = true, accumulate = 2, cpu = true)]
fn train(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let net = mlp_with_norm(&vs.root(), |p, n| nn::batch_norm1d(p, n, Default::default()));
    let mut opt = nn::Sgd::default().build(&vs, 0.1)?;
    for _ in 0..data.epochs {
        for (x, y) in data.batches() {
            let loss = net.forward_t(&x, true).cross_entropy_for_logits(&y);
            opt.zero_grad();
            loss.backward();
            opt.step();
        }
    }
    Ok(weights(&vs, ""))
}

pub fn run(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    train(data)
}
