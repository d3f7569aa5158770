//! An iterator bound first and configured (`shuffle`), then drained by `while let`.
use tch::data::Iter2;
use tch::nn::{self, Module, OptimizerConfig};
use tch::Device;

use crate::data;

#[accel_core::accelerate(strategy = "ddp")]
fn train() -> anyhow::Result<()> {
    let d = data::load()?;
    let vs = nn::VarStore::new(Device::Cpu);
    let net = data::mlp(&vs.root());
    let mut opt = nn::Adam::default().build(&vs, 1e-2)?;
    for _ in 0..2 {
        let mut iter = Iter2::new(&d.train_x, &d.train_y, data::batch_size());
        iter.shuffle();
        while let Some((x, y)) = iter.next() {
            let loss = net.forward(&x).cross_entropy_for_logits(&y);
            opt.zero_grad();
            loss.backward();
            opt.step();
        }
    }
    Ok(())
}

pub fn run() -> anyhow::Result<()> {
    tch::manual_seed(1);
    train()
}
