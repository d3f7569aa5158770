//! Gradient accumulation written by hand with a counter of one's own (`step += 1;
//! if step % 2 == 0`), the loss divided by the accumulation steps.
use tch::nn::{self, Module, OptimizerConfig};
use tch::Device;

use crate::data;

const ACCUMULATION_STEPS: usize = 2;

#[accel_core::accelerate(strategy = "ddp")]
fn train() -> anyhow::Result<()> {
    let d = data::load()?;
    let vs = nn::VarStore::new(Device::Cpu);
    let net = data::mlp(&vs.root());
    let mut opt = nn::Sgd::default().build(&vs, 0.1)?;
    let mut step = 0;
    for _ in 0..2 {
        for (x, y) in data::batches(&d, data::batch_size()) {
            let loss = net.forward(&x).cross_entropy_for_logits(&y) / ACCUMULATION_STEPS as f64;
            loss.backward();
            step += 1;
            if step % ACCUMULATION_STEPS == 0 {
                opt.step();
                opt.zero_grad();
            }
        }
    }
    Ok(())
}

pub fn run() -> anyhow::Result<()> {
    tch::manual_seed(0);
    train()
}
