//! An optimizer made by a helper given the function's only VarStore: that is its model.
#![deny(warnings)]

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, TchError, Tensor};

use crate::common::{Data, mlp, weights};

fn make_opt(vs: &nn::VarStore) -> Result<nn::Optimizer, TchError> {
    nn::Adam { wd: 1e-3, ..Default::default() }.build(vs, 1e-2)
}

#[accel_core::accelerate(strategy = "ddp", cpu = true)]
fn train(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    let vs = nn::VarStore::new(Device::Cpu);
    let net = mlp(&vs.root());
    let mut opt = make_opt(&vs)?;
    for _ in 0..data.epochs {
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
