//! The optimizer made by a helper taking `&nn::VarStore`.
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, TchError};

use crate::data;

fn configure_optimizer(vs: &nn::VarStore, lr: f64) -> Result<nn::Optimizer, TchError> {
    nn::AdamW { wd: 0.1, ..Default::default() }.build(vs, lr)
}

#[accel_core::accelerate(strategy = "ddp")]
fn train() -> anyhow::Result<()> {
    let d = data::load()?;
    let vs = nn::VarStore::new(Device::Cpu);
    let net = data::mlp(&vs.root());
    let mut opt = configure_optimizer(&vs, 3e-3)?;
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
