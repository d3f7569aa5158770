//! Gradient accumulation by hand under `accumulate = 4`: refused, naming both.
use tch::nn::{self, Module, OptimizerConfig};
use tch::Device;

use crate::data;

#[accel_core::accelerate(strategy = "ddp", accumulate = 4)]
fn train() -> anyhow::Result<()> {
    let d = data::load()?;
    let vs = nn::VarStore::new(Device::Cpu);
    let net = data::mlp(&vs.root());
    let mut opt = nn::Sgd::default().build(&vs, 0.1)?;
    for (i, (x, y)) in data::batches(&d, data::batch_size()).into_iter().enumerate() {
        let loss = net.forward(&x).cross_entropy_for_logits(&y) / 4.0;
        loss.backward();
        if (i + 1) % 4 == 0 {
            opt.step();
            opt.zero_grad();
        }
    }
    Ok(())
}

pub fn run() -> anyhow::Result<()> {
    tch::manual_seed(0);
    train()
}
