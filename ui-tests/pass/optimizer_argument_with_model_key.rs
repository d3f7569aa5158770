//! tch's optimizer passed in by `&mut` (made by the caller), driven by the accelerator at
//! each call; `model = vs` names the model it trains.
#![deny(warnings)]

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Tensor};

use crate::common::{Data, mlp, weights};

#[accel_core::accelerate(strategy = "ddp", cpu = true, model = vs)]
fn train(
    vs: &nn::VarStore,
    net: &nn::Sequential,
    opt: &mut nn::Optimizer,
    data: &Data,
) -> anyhow::Result<()> {
    for _ in 0..data.epochs {
        for (x, y) in data.batches() {
            let loss = net.forward(&x).cross_entropy_for_logits(&y);
            opt.zero_grad();
            loss.backward();
            opt.clip_grad_norm(0.5);
            opt.step();
        }
    }
    Ok(())
}

pub fn run(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    let vs = nn::VarStore::new(Device::Cpu);
    let net = mlp(&vs.root());
    let mut opt = nn::Adam::default().build(&vs, 1e-2)?;
    train(&vs, &net, &mut opt, data)?;
    Ok(weights(&vs, ""))
}
