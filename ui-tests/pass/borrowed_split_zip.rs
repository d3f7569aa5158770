//! Batches borrowed from `split(..).iter().zip(..)`: `&Tensor` items, handed out as they are.
#![deny(warnings)]

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Tensor};

use crate::common::{Data, mlp, weights};

#[accel_core::accelerate(strategy = "ddp", cpu = true)]
fn train(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    let vs = nn::VarStore::new(Device::Cpu);
    let net = mlp(&vs.root());
    let mut opt = nn::Adam::default().build(&vs, 1e-2)?;
    let (x, y) = data.all();
    let xs = x.split(data.batch_size, 0);
    let ys = y.split(data.batch_size, 0);
    for _ in 0..data.epochs {
        for (xb, yb) in xs.iter().zip(ys.iter()) {
            let loss = net.forward(xb).cross_entropy_for_logits(yb);
            opt.zero_grad();
            loss.backward();
            opt.step();
        }
    }
    Ok(weights(&vs, ""))
}

pub fn run(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    train(data)
}
