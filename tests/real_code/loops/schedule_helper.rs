//! A step-decay schedule in a helper taking `&mut nn::Optimizer`, called once per epoch.
use tch::nn::{self, Module, OptimizerConfig};
use tch::Device;

use crate::data;

fn adjust_learning_rate(optimizer: &mut nn::Optimizer, epoch: i64, base_lr: f64) {
    let lr = base_lr * 0.5f64.powi(epoch as i32);
    optimizer.set_lr(lr);
}

#[accel_core::accelerate(strategy = "ddp")]
fn train() -> anyhow::Result<()> {
    let d = data::load()?;
    let vs = nn::VarStore::new(Device::Cpu);
    let net = data::mlp(&vs.root());
    let base_lr = 0.2;
    let mut opt = nn::Sgd { momentum: 0.9, ..Default::default() }.build(&vs, base_lr)?;
    for epoch in 0..2 {
        adjust_learning_rate(&mut opt, epoch, base_lr);
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
