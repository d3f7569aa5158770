//! A `Vec<(Tensor, Tensor)>` borrowed with `.iter().enumerate()`, and gradient accumulation
//! written by hand on the enumerate count (this process's batches, the same on every one).
#![deny(warnings)]

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Tensor};

use crate::common::{Data, mlp, weights};

#[accel_core::accelerate(strategy = "ddp", cpu = true)]
fn train(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    let vs = nn::VarStore::new(Device::Cpu);
    let net = mlp(&vs.root());
    let mut opt = nn::Sgd::default().build(&vs, 0.1)?;
    let batches: Vec<(Tensor, Tensor)> = data.batches();
    for _ in 0..data.epochs {
        for (step, (x, y)) in batches.iter().enumerate() {
            let loss = net.forward(x).cross_entropy_for_logits(y) / 2.0;
            loss.backward();
            if (step + 1) % 2 == 0 {
                opt.step();
                opt.zero_grad();
            }
        }
    }
    Ok(weights(&vs, ""))
}

pub fn run(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    train(data)
}
