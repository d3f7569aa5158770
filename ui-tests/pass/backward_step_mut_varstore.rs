//! A `&mut VarStore` given to `build` as it is, and tch's `backward_step` (no `.backward()`
//! call anywhere).
#![deny(warnings)]

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Tensor};

use crate::common::{Data, mlp, weights};

#[accel_core::accelerate(strategy = "ddp", cpu = true)]
fn train(vs: &mut nn::VarStore, data: &Data) -> anyhow::Result<()> {
    let net = mlp(&vs.root());
    let mut opt = nn::Sgd { momentum: 0.9, wd: 1e-3, ..Default::default() }.build(vs, 0.05)?;
    for _ in 0..data.epochs {
        for (x, y) in data.batches() {
            let loss = net.forward(&x).cross_entropy_for_logits(&y);
            opt.backward_step(&loss);
        }
    }
    Ok(())
}

pub fn run(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    let mut vs = nn::VarStore::new(Device::Cpu);
    train(&mut vs, data)?;
    Ok(weights(&vs, ""))
}
