//! A labeled outer loop and a fixed step budget: `break 'training` after N steps, the
//! budget counted on this process's batches (the same on every process).
use tch::nn::{self, Module, OptimizerConfig};
use tch::Device;

use crate::data;

#[accel_core::accelerate(strategy = "ddp")]
fn train() -> anyhow::Result<()> {
    let d = data::load()?;
    let vs = nn::VarStore::new(Device::Cpu);
    let net = data::mlp(&vs.root());
    let mut opt = nn::Adam::default().build(&vs, 1e-2)?;
    let max_steps = 12;
    let mut steps = 0;
    'training: for _epoch in 0..10 {
        for (x, y) in data::batches(&d, data::batch_size()) {
            let loss = net.forward(&x).cross_entropy_for_logits(&y);
            opt.backward_step(&loss);
            steps += 1;
            if steps == max_steps {
                break 'training;
            }
        }
    }
    Ok(())
}

pub fn run() -> anyhow::Result<()> {
    tch::manual_seed(0);
    train()
}
