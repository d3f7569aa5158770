//! `data = "manual"`: each process takes its own batches (batch k to process k mod N, as the
//! accelerator would deal them); the loop runs under autocast, nothing is dealt again.
#![deny(warnings)]

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Tensor};

use crate::common::{Data, mlp, weights};

#[accel_core::accelerate(strategy = "ddp", data = "manual", cpu = true)]
fn train(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    let vs = nn::VarStore::new(Device::Cpu);
    let net = mlp(&vs.root());
    let mut opt = nn::Sgd::default().build(&vs, 0.1)?;
    let (rank, world) = (accelerator.process_index(), accelerator.num_processes());
    for _ in 0..data.epochs {
        for (x, y) in data.batches().into_iter().skip(rank).step_by(world) {
            let loss = net.forward(&x).cross_entropy_for_logits(&y);
            opt.backward_step(&loss);
        }
    }
    Ok(weights(&vs, ""))
}

pub fn run(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    train(data)
}
