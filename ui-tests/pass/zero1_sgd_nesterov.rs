//! ZeRO stage 1 through the attribute: tch's SGD with Nesterov momentum becomes accel's,
//! its state split across the processes.
#![deny(warnings)]

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Tensor};

use crate::common::{Data, mlp, weights};

#[accel_core::accelerate(strategy = "zero1", cpu = true)]
fn train(vs: &nn::VarStore, data: &Data) -> anyhow::Result<()> {
    let net = mlp(&vs.root());
    let mut opt = nn::Sgd { momentum: 0.9, nesterov: true, ..Default::default() }.build(vs, 0.05)?;
    for _ in 0..data.epochs {
        for (x, y) in data.batches() {
            let loss = net.forward(&x).cross_entropy_for_logits(&y);
            opt.zero_grad();
            loss.backward();
            opt.step();
        }
    }
    Ok(())
}

pub fn run(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    let vs = nn::VarStore::new(Device::Cpu);
    train(&vs, data)?;
    Ok(weights(&vs, ""))
}
