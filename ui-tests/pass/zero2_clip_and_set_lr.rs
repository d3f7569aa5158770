//! ZeRO stage 2 through the attribute, with tch's `clip_grad_norm` between backward and
//! step (the global norm across shards) and `set_lr` each epoch.
#![deny(warnings)]

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Tensor};

use crate::common::{Data, mlp};

#[accel_core::accelerate(strategy = "zero2", cpu = true)]
fn train(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    let vs = nn::VarStore::new(Device::Cpu);
    let net = mlp(&vs.root());
    let mut opt = nn::AdamW::default().build(&vs, 1e-2)?;
    for epoch in 0..data.epochs {
        opt.set_lr(1e-2 / (1 + epoch) as f64);
        for (x, y) in data.batches() {
            let loss = net.forward(&x).cross_entropy_for_logits(&y);
            opt.zero_grad();
            loss.backward();
            opt.clip_grad_norm(0.1);
            opt.step();
        }
    }
    let full = accelerator.full_state_dict(&vs)?;
    Ok(full)
}

pub fn run(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    train(data)
}
