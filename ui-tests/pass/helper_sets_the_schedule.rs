//! A helper taking `&mut nn::Optimizer` sets the learning rate each epoch: the optimizer
//! stays tch's, so the helper compiles as written; the body's calls are the accelerator's.
#![deny(warnings)]

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Tensor};

use crate::common::{Data, mlp, weights};

fn apply_schedule(opt: &mut nn::Optimizer, epoch: usize) {
    opt.set_lr(0.1 / (1.0 + epoch as f64));
}

#[accel_core::accelerate(strategy = "ddp", cpu = true)]
fn train(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    let vs = nn::VarStore::new(Device::Cpu);
    let net = mlp(&vs.root());
    let mut opt = nn::Sgd { momentum: 0.9, ..Default::default() }.build(&vs, 0.1)?;
    for epoch in 0..data.epochs {
        apply_schedule(&mut opt, epoch);
        for (x, y) in data.batches() {
            let loss = net.forward(&x).cross_entropy_for_logits(&y);
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
