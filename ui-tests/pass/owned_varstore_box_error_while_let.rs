//! An owned VarStore, `Box<dyn Error>`, accumulation over 3 batches, and a `while let` loop
//! over an iterator made just before it.
#![deny(warnings)]

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Tensor};

use crate::common::{Data, mlp, weights};

// The shape under test, though clippy prefers `for`.
#[allow(clippy::while_let_on_iterator)]
#[accel_core::accelerate(strategy = "ddp", accumulate = 3, cpu = true)]
fn train(vs: nn::VarStore, data: &Data) -> Result<Vec<(String, Tensor)>, Box<dyn std::error::Error>> {
    let net = mlp(&vs.root());
    let mut opt = nn::Sgd { momentum: 0.9, ..Default::default() }.build(&vs, 0.05)?;
    for _ in 0..data.epochs {
        let mut batches = data.batches().into_iter();
        while let Some((x, y)) = batches.next() {
            let loss = net.forward(&x).cross_entropy_for_logits(&y);
            opt.zero_grad();
            loss.backward();
            opt.step();
        }
    }
    Ok(weights(&vs, ""))
}

pub fn run(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    train(nn::VarStore::new(Device::Cpu), data).map_err(|e| anyhow::anyhow!("{e}"))
}
