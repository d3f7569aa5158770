//! A regression (the pixel mean from the image) with `mse_loss`, batches from a closure-free
//! function the program calls, a counting epoch loop around them.
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Reduction, Tensor};

use crate::data;

fn get_batches(x: &Tensor, bs: i64) -> Vec<(Tensor, Tensor)> {
    let y = x.mean_dim(1, true, Kind::Float);
    x.split(bs, 0).into_iter().zip(y.split(bs, 0)).collect()
}

#[accel_core::accelerate(strategy = "ddp")]
fn train() -> anyhow::Result<()> {
    let d = data::load()?;
    let vs = nn::VarStore::new(Device::Cpu);
    let net = nn::seq()
        .add(nn::linear(vs.root() / "l1", 64, 16, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(vs.root() / "l2", 16, 1, Default::default()));
    let mut opt = nn::Adam::default().build(&vs, 1e-2)?;
    for epoch in 1..=3 {
        for (x, y) in get_batches(&d.train_x, data::batch_size()) {
            let loss = net.forward(&x).mse_loss(&y, Reduction::Mean);
            opt.backward_step(&loss);
        }
        println!("epoch {epoch} done");
    }
    Ok(())
}

pub fn run() -> anyhow::Result<()> {
    tch::manual_seed(0);
    train()
}
