//! The training loop inside a closure called where it is written (its body runs there,
//! once), returning its own `Result`.
#![deny(warnings)]

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Tensor};

use crate::common::{Data, mlp, weights};

#[accel_core::accelerate(strategy = "ddp", cpu = true)]
fn train(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    let vs = nn::VarStore::new(Device::Cpu);
    let net = mlp(&vs.root());
    let mut opt = nn::Adam::default().build(&vs, 1e-2)?;
    (|| -> anyhow::Result<()> {
        for _ in 0..data.epochs {
            for (x, y) in data.batches() {
                let loss = net.forward(&x).cross_entropy_for_logits(&y);
                opt.zero_grad();
                loss.backward();
                opt.step();
            }
        }
        Ok(())
    })()?;
    Ok(weights(&vs, ""))
}

pub fn run(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    train(data)
}
