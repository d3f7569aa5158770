//! The whole step in a helper (`train_step(&net, &mut opt, &x, &y)`): refused, naming it.
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Tensor};

use crate::data;

fn train_step(net: &nn::Sequential, opt: &mut nn::Optimizer, x: &Tensor, y: &Tensor) -> f64 {
    let loss = net.forward(x).cross_entropy_for_logits(y);
    opt.backward_step(&loss);
    f64::try_from(&loss).unwrap()
}

#[accel_core::accelerate(strategy = "ddp")]
fn train() -> anyhow::Result<()> {
    let d = data::load()?;
    let vs = nn::VarStore::new(Device::Cpu);
    let net = data::mlp(&vs.root());
    let mut opt = nn::Adam::default().build(&vs, 1e-2)?;
    for (x, y) in data::batches(&d, data::batch_size()) {
        let loss = train_step(&net, &mut opt, &x, &y);
        println!("{loss:.4}");
    }
    Ok(())
}

pub fn run() -> anyhow::Result<()> {
    tch::manual_seed(0);
    train()
}
