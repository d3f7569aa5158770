//! tch's `backward_step_clip` (gradient values clamped) with a `&mut VarStore`.
#![deny(warnings)]

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Tensor};

use crate::common::{Data, mlp, weights};

#[accel_core::accelerate(strategy = "ddp", cpu = true)]
fn train(vs: &mut nn::VarStore, data: &Data) -> anyhow::Result<()> {
    let net = mlp(&vs.root());
    let mut opt = nn::Sgd { momentum: 0.9, ..Default::default() }.build(vs, 0.1)?;
    for _ in 0..data.epochs {
        for (x, y) in data.batches() {
            let loss = net.forward(&x).cross_entropy_for_logits(&y);
            opt.backward_step_clip(&loss, 0.02);
        }
    }
    Ok(())
}

pub fn run(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    let mut vs = nn::VarStore::new(Device::Cpu);
    train(&mut vs, data)?;
    Ok(weights(&vs, ""))
}
