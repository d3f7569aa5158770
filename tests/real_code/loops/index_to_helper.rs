//! The index passed to a helper the attribute cannot see into: it asks whether the loop
//! deals its batches or draws them.
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Tensor};

use crate::data::{self, Digits};

fn get_batch(d: &Digits, i: i64, bs: i64) -> (Tensor, Tensor) {
    (d.train_x.narrow(0, i * bs, bs), d.train_y.narrow(0, i * bs, bs))
}

fn log_progress(i: i64, loss: f64) {
    println!("batch {i}: {loss:.4}");
}

#[accel_core::accelerate(strategy = "ddp")]
fn train() -> anyhow::Result<()> {
    let d = data::load()?;
    let bs = data::batch_size();
    let vs = nn::VarStore::new(Device::Cpu);
    let net = data::mlp(&vs.root());
    let mut opt = nn::Sgd::default().build(&vs, 0.1)?;
    for i in 0..data::TRAIN / bs {
        let (x, y) = get_batch(&d, i, bs);
        let loss = net.forward(&x).cross_entropy_for_logits(&y);
        opt.backward_step(&loss);
        log_progress(i, f64::try_from(&loss)?);
    }
    Ok(())
}

pub fn run() -> anyhow::Result<()> {
    tch::manual_seed(0);
    train()
}
