//! Nested epoch loops, a loss used inline, accel's own AdamW, and a chosen binding name.
#![deny(warnings)]

use accel_core::optim::{AdamConfig, AdamW, named_params};
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

#[accel_core::accelerate(name = acc, strategy = "ddp", seed = 3, cpu = true)]
fn train(epochs: usize) -> anyhow::Result<u64> {
    let vs = nn::VarStore::new(Device::Cpu);
    let net = nn::linear(vs.root() / "lin", 2, 1, Default::default());
    let mut opt = AdamW::new(named_params(&vs), AdamConfig { lr: 1e-2, ..AdamConfig::adamw() })?;
    for _epoch in 0..epochs {
        for x in (0..3).map(|_| Tensor::ones([4, 2], (Kind::Float, Device::Cpu))).collect::<Vec<_>>() {
            net.forward(&x).square().mean(Kind::Float).backward();
            opt.step();
            opt.zero_grad();
        }
    }
    Ok(acc.counters().optimizer_steps)
}

fn main() -> anyhow::Result<()> {
    assert_eq!(train(2)?, 6);
    Ok(())
}
