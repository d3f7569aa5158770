//! The backward pass inside an `if` (every other batch trains), `enumerate` counting this
//! process's batches.
#![deny(warnings)]

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Tensor};

use crate::common::{Data, mlp, weights};

#[accel_core::accelerate(strategy = "ddp", cpu = true)]
fn train(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    let vs = nn::VarStore::new(Device::Cpu);
    let net = mlp(&vs.root());
    let mut opt = nn::Adam::default().build(&vs, 1e-2)?;
    for _ in 0..data.epochs {
        for (step, (x, y)) in data.batches().into_iter().enumerate() {
            let loss = net.forward(&x).cross_entropy_for_logits(&y);
            if step % 2 == 0 {
                opt.zero_grad();
                loss.backward();
                opt.step();
            }
        }
    }
    Ok(weights(&vs, ""))
}

pub fn run(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    train(data)
}
