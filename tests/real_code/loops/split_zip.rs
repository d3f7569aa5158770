//! `split` into chunks and zip inputs with labels, borrowing the chunks.
use tch::nn::{self, Module, OptimizerConfig};
use tch::Device;

use crate::data;

#[accel_core::accelerate(strategy = "ddp")]
fn train() -> anyhow::Result<()> {
    let d = data::load()?;
    let bs = data::batch_size();
    let vs = nn::VarStore::new(Device::Cpu);
    let net = data::mlp(&vs.root());
    let mut opt = nn::Sgd { momentum: 0.9, nesterov: true, ..Default::default() }.build(&vs, 0.05)?;
    let xs = d.train_x.split(bs, 0);
    let ys = d.train_y.split(bs, 0);
    for _ in 0..2 {
        for (x, y) in xs.iter().zip(ys.iter()) {
            let loss = net.forward(x).cross_entropy_for_logits(y);
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
