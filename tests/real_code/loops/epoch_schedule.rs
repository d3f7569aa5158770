//! A cosine schedule set from the epoch of the outer loop, the batches in the inner one.
use tch::nn::{self, Module, OptimizerConfig};
use tch::Device;

use crate::data;

#[accel_core::accelerate(strategy = "ddp")]
fn train() -> anyhow::Result<()> {
    let d = data::load()?;
    let vs = nn::VarStore::new(Device::Cpu);
    let net = data::mlp(&vs.root());
    let (base, epochs) = (0.1, 3);
    let mut opt = nn::Sgd::default().build(&vs, base)?;
    for epoch in 0..epochs {
        let progress = epoch as f64 / epochs as f64;
        opt.set_lr(base * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()));
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
