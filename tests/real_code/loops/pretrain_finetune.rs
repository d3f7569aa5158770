//! Pretraining then fine-tuning: two annotated functions, one model, two strategies.
use tch::nn::{self, Module, OptimizerConfig};
use tch::Device;

use crate::data::{self, Digits};

#[accel_core::accelerate(strategy = "ddp")]
fn pretrain(vs: &nn::VarStore, net: &nn::Sequential, d: &Digits) -> anyhow::Result<()> {
    let mut opt = nn::Adam::default().build(vs, 1e-2)?;
    for (x, y) in data::batches(d, data::batch_size()) {
        let loss = net.forward(&x).cross_entropy_for_logits(&y);
        opt.backward_step(&loss);
    }
    Ok(())
}

#[accel_core::accelerate(strategy = "zero2")]
fn finetune(vs: &nn::VarStore, net: &nn::Sequential, d: &Digits) -> anyhow::Result<()> {
    let mut opt = nn::Sgd { momentum: 0.9, ..Default::default() }.build(vs, 0.02)?;
    for _ in 0..2 {
        for (x, y) in data::batches(d, data::batch_size()) {
            let loss = net.forward(&x).cross_entropy_for_logits(&y);
            opt.zero_grad();
            loss.backward();
            opt.step();
        }
    }
    Ok(())
}

pub fn run() -> anyhow::Result<()> {
    tch::manual_seed(0);
    let d = data::load()?;
    let vs = nn::VarStore::new(Device::Cpu);
    let net = data::mlp(&vs.root());
    pretrain(&vs, &net, &d)?;
    finetune(&vs, &net, &d)
}
