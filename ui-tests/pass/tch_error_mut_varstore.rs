//! A `&mut VarStore` given to `build` as it is, and tch's own error type: the shape the
//! attribute once passed through unprepared.
#![deny(warnings)]

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, TchError, Tensor};

use crate::common::{Data, mlp, weights};

#[accel_core::accelerate(strategy = "ddp", cpu = true)]
fn train(vs: &mut nn::VarStore, data: &Data) -> Result<(), TchError> {
    let net = mlp(&vs.root());
    let mut opt = nn::Adam::default().build(vs, 1e-2)?;
    for _ in 0..data.epochs {
        for (x, y) in data.batches() {
            let loss = net.forward(&x).cross_entropy_for_logits(&y);
            opt.zero_grad();
            loss.backward();
            opt.step();
        }
    }
    Ok(())
}

pub fn run(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    let mut vs = nn::VarStore::new(Device::Cpu);
    train(&mut vs, data)?;
    Ok(weights(&vs, ""))
}
