//! tch's `IndexOp`: `x.i(start..end)` slices with ranges computed from the index.
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, IndexOp};

use crate::data;

#[accel_core::accelerate(strategy = "ddp")]
fn train() -> anyhow::Result<()> {
    let d = data::load()?;
    let bs = data::batch_size();
    let vs = nn::VarStore::new(Device::Cpu);
    let net = data::mlp(&vs.root());
    let mut opt = nn::AdamW::default().build(&vs, 1e-2)?;
    for _ in 0..2 {
        for i in 0..data::TRAIN / bs {
            let start = i * bs;
            let end = start + bs;
            let logits = net.forward(&d.train_x.i(start..end));
            let loss = logits.cross_entropy_for_logits(&d.train_y.i(start..end));
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
