//! Two annotated functions one after the other on one model (pretraining, then fine-tuning
//! with another optimizer and strategy): one process group for both.
#![deny(warnings)]

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Tensor};

use crate::common::{Data, mlp, weights};

#[accel_core::accelerate(strategy = "ddp", cpu = true)]
fn pretrain(vs: &nn::VarStore, net: &nn::Sequential, data: &Data) -> anyhow::Result<()> {
    let mut opt = nn::Adam::default().build(vs, 1e-2)?;
    for (x, y) in data.batches() {
        let loss = net.forward(&x).cross_entropy_for_logits(&y);
        opt.zero_grad();
        loss.backward();
        opt.step();
    }
    Ok(())
}

#[accel_core::accelerate(strategy = "zero2", cpu = true)]
fn fine_tune(vs: &nn::VarStore, net: &nn::Sequential, data: &Data) -> anyhow::Result<()> {
    let mut opt = nn::Sgd { momentum: 0.9, ..Default::default() }.build(vs, 0.05)?;
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
    let net = mlp(&vs.root());
    if data.epochs > 0 {
        pretrain(&vs, &net, data)?;
    }
    fine_tune(&vs, &net, data)?;
    Ok(weights(&vs, ""))
}
