//! Batches prepared once into a `Vec<(Tensor, Tensor)>` and borrowed every epoch.
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Tensor};

use crate::data;

#[accel_core::accelerate(strategy = "ddp")]
fn train() -> anyhow::Result<()> {
    let d = data::load()?;
    let batches: Vec<(Tensor, Tensor)> = data::batches(&d, data::batch_size());
    let vs = nn::VarStore::new(Device::Cpu);
    let net = data::mlp(&vs.root());
    let mut opt = nn::Adam::default().build(&vs, 1e-2)?;
    for epoch in 0..2 {
        let mut total = 0.0;
        for (x, y) in batches.iter() {
            let loss = net.forward(x).cross_entropy_for_logits(y);
            opt.backward_step(&loss);
            total += f64::try_from(&loss)?;
        }
        println!("epoch {epoch}: {:.4}", total / batches.len() as f64);
    }
    Ok(())
}

pub fn run() -> anyhow::Result<()> {
    tch::manual_seed(0);
    train()
}
