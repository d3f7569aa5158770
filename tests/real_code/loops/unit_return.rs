//! A function returning nothing, `unwrap` on the optimizer, a `match` on the epoch.
use tch::nn::{self, Module, OptimizerConfig};
use tch::Device;

use crate::data;

#[accel_core::accelerate(strategy = "ddp")]
fn train() {
    let d = data::load().unwrap();
    let vs = nn::VarStore::new(Device::Cpu);
    let net = data::mlp(&vs.root());
    let mut opt = nn::Adam::default().build(&vs, 1e-2).unwrap();
    for epoch in 0..3 {
        match epoch {
            0 => opt.set_lr(1e-2),
            _ => opt.set_lr(5e-3),
        }
        for (x, y) in data::batches(&d, data::batch_size()) {
            let loss = net.forward(&x).cross_entropy_for_logits(&y);
            opt.backward_step(&loss);
        }
    }
}

pub fn run() -> anyhow::Result<()> {
    tch::manual_seed(0);
    train();
    Ok(())
}
