//! The optimizer's step and zero_grad in a helper after `loss.backward()`.
use tch::nn::{self, Module, OptimizerConfig};
use tch::Device;

use crate::data;

fn update(opt: &mut nn::Optimizer) {
    opt.step();
    opt.zero_grad();
}

#[accel_core::accelerate(strategy = "ddp")]
fn train() -> anyhow::Result<()> {
    let d = data::load()?;
    let vs = nn::VarStore::new(Device::Cpu);
    let net = data::mlp(&vs.root());
    let mut opt = nn::Adam::default().build(&vs, 1e-2)?;
    for _ in 0..2 {
        for (x, y) in data::batches(&d, data::batch_size()) {
            let loss = net.forward(&x).cross_entropy_for_logits(&y);
            loss.backward();
            update(&mut opt);
        }
    }
    Ok(())
}

pub fn run() -> anyhow::Result<()> {
    tch::manual_seed(0);
    train()
}
