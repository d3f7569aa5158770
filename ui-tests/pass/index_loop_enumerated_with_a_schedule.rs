//! An index loop counted apart from its index (`for (step, i) in (0..n).enumerate()`): `i`
//! picks the batch and is dealt; `step` counts this process's batches and sets the schedule
//! and the hand-written accumulation, the same on every process.
#![deny(warnings)]

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Tensor};

use crate::common::{Data, SAMPLES, mlp, weights};

#[accel_core::accelerate(strategy = "ddp", cpu = true)]
fn train(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    let vs = nn::VarStore::new(Device::Cpu);
    let net = mlp(&vs.root());
    let mut opt = nn::Sgd::default().build(&vs, 0.1)?;
    let (x, y) = data.all();
    let bs = data.batch_size;
    for _ in 0..data.epochs {
        for (step, i) in (0..SAMPLES / bs).enumerate() {
            opt.set_lr(0.2 / (1.0 + step as f64));
            let xb = x.narrow(0, i * bs, bs);
            let yb = y.narrow(0, i * bs, bs);
            let loss = net.forward(&xb).cross_entropy_for_logits(&yb);
            loss.backward();
            if step % 2 == 1 {
                opt.step();
                opt.zero_grad();
            }
        }
    }
    Ok(weights(&vs, ""))
}

pub fn run(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    train(data)
}
