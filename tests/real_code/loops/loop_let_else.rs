//! `loop` with `let Some(..) = it.next() else { break }`.
use tch::nn::{self, Module, OptimizerConfig};
use tch::Device;

use crate::data;

#[accel_core::accelerate(strategy = "ddp")]
fn train() -> anyhow::Result<()> {
    let d = data::load()?;
    let vs = nn::VarStore::new(Device::Cpu);
    let net = data::mlp(&vs.root());
    let mut opt = nn::Sgd::default().build(&vs, 0.2)?;
    for _ in 0..2 {
        let mut batches = data::batches(&d, data::batch_size()).into_iter();
        loop {
            let Some((x, y)) = batches.next() else { break };
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
