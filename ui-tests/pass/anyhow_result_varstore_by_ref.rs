//! A VarStore passed by reference and given to `build` as it is (`build(vs, ..)`, no `&`),
//! `anyhow::Result`, clipping from the attribute, a value returned through the body.
#![deny(warnings)]

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Tensor};

use crate::common::{Data, mlp, weights};

#[accel_core::accelerate(strategy = "ddp", clip_grad_norm = 1.0, cpu = true)]
fn train(vs: &nn::VarStore, data: &Data) -> anyhow::Result<usize> {
    let net = mlp(&vs.root());
    let mut opt = nn::AdamW::default().build(vs, 1e-2)?;
    let mut steps = 0;
    for _ in 0..data.epochs {
        for (x, y) in data.batches() {
            let loss = net.forward(&x).cross_entropy_for_logits(&y);
            opt.zero_grad();
            loss.backward();
            opt.step();
            steps += 1;
        }
    }
    Ok(steps)
}

pub fn run(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    let vs = nn::VarStore::new(Device::Cpu);
    let steps = train(&vs, data)?;
    let processes = accel_core::topology::Topology::from_env()?.world_size;
    anyhow::ensure!(steps as i64 == data.epochs as i64 * 128 / data.batch_size / processes as i64);
    Ok(weights(&vs, ""))
}
