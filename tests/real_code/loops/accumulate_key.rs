//! Accelerate's way of accumulating: step every batch, `accumulate = 2` in the attribute.
use tch::nn::{self, Module, OptimizerConfig};
use tch::Device;

use crate::data;

#[accel_core::accelerate(strategy = "ddp", accumulate = 2)]
fn train() -> anyhow::Result<()> {
    let d = data::load()?;
    let vs = nn::VarStore::new(Device::Cpu);
    let net = data::mlp(&vs.root());
    let mut opt = nn::Sgd::default().build(&vs, 0.1)?;
    for _ in 0..2 {
        for (x, y) in data::batches(&d, data::batch_size()) {
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
    train()
}
