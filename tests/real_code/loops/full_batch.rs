//! tch-rs's mnist_nn: full-batch training in a loop that counts epochs. Every process would
//! compute the same gradient on the same data: refused at the first step on 2 processes.
use tch::nn::{self, Module, OptimizerConfig};
use tch::Device;

use crate::data;

#[accel_core::accelerate(strategy = "ddp")]
fn train() -> anyhow::Result<()> {
    let m = data::load()?;
    let vs = nn::VarStore::new(Device::Cpu);
    let net = data::mlp(&vs.root());
    let mut opt = nn::Adam::default().build(&vs, 1e-3)?;
    for epoch in 1..50 {
        let loss = net.forward(&m.train_x).cross_entropy_for_logits(&m.train_y);
        opt.backward_step(&loss);
        let test_accuracy = net.forward(&m.test_x).accuracy_for_logits(&m.test_y);
        println!("epoch: {epoch:4} test acc: {:5.2}%", 100. * f64::try_from(&test_accuracy)?);
    }
    Ok(())
}

pub fn run() -> anyhow::Result<()> {
    tch::manual_seed(0);
    train()
}
