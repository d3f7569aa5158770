//! The optimizer step in a helper (`update(&mut opt)`): under DDP with no loss scaling,
//! accumulation or clipping, gradients are averaged in backward, so tch's own step is the
//! accelerator's; the accelerator checks the call and counts the step.
#![deny(warnings)]

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Tensor};

use crate::common::{Data, mlp, weights};

fn update(opt: &mut nn::Optimizer) {
    opt.step();
    opt.zero_grad();
}

#[accel_core::accelerate(strategy = "ddp", cpu = true)]
fn train(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    let vs = nn::VarStore::new(Device::Cpu);
    let net = mlp(&vs.root());
    let mut opt = nn::Adam::default().build(&vs, 1e-2)?;
    for _ in 0..data.epochs {
        for (x, y) in data.batches() {
            let loss = net.forward(&x).cross_entropy_for_logits(&y);
            loss.backward();
            update(&mut opt);
        }
    }
    Ok(weights(&vs, ""))
}

pub fn run(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    train(data)
}
