//! A warmup schedule on the step count, the index dealt apart from it:
//! `for (step, i) in (0..n).enumerate()`, as the attribute's message on index loops says.
use tch::nn::{self, Module, OptimizerConfig};
use tch::Device;

use crate::data;

#[accel_core::accelerate(strategy = "ddp")]
fn train() -> anyhow::Result<()> {
    let d = data::load()?;
    let bs = data::batch_size();
    let vs = nn::VarStore::new(Device::Cpu);
    let net = data::mlp(&vs.root());
    let mut opt = nn::Adam::default().build(&vs, 1e-2)?;
    let warmup = 4;
    for _ in 0..2 {
        for (step, i) in (0..data::TRAIN / bs).enumerate() {
            let lr = 1e-2 * ((step + 1) as f64 / warmup as f64).min(1.0);
            opt.set_lr(lr);
            let (x, y) = (d.train_x.narrow(0, i * bs, bs), d.train_y.narrow(0, i * bs, bs));
            let loss = net.forward(&x).cross_entropy_for_logits(&y);
            opt.backward_step(&loss);
        }
    }
    Ok(())
}

pub fn run() -> anyhow::Result<()> {
    tch::manual_seed(0);
    train()
}
