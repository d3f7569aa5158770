//! tch's AdamW with `amsgrad: true` over two parameter groups (`Path::set_group`), and tch's
//! setters on the prepared optimizer: `set_lr_group`, `set_weight_decay`,
//! `trainable_variables`.
#![deny(warnings)]

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Tensor};

use crate::common::{Data, weights};

#[accel_core::accelerate(strategy = "ddp", cpu = true)]
fn train(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    let vs = nn::VarStore::new(Device::Cpu);
    let head = vs.root().set_group(1);
    let net = nn::seq()
        .add(nn::linear(vs.root() / "layers" / 0, 6, 16, Default::default()))
        .add_fn(|x| x.tanh())
        .add(nn::linear(&head / "layers" / 1, 16, 3, Default::default()));
    let mut opt = nn::AdamW { amsgrad: true, ..Default::default() }.build(&vs, 1e-2)?;
    opt.set_lr_group(1, 3e-3);
    opt.set_weight_decay(0.05);
    anyhow::ensure!(opt.trainable_variables().len() == 4);
    for _ in 0..data.epochs {
        for (x, y) in data.batches() {
            let loss = net.forward(&x).cross_entropy_for_logits(&y);
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
