//! A VarStore passed by reference, `anyhow::Result`, a value returned through the closure.
#![deny(warnings)]

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

#[accel_core::accelerate(precision = "bf16", clip_grad_norm = 1.0, cpu = true)]
fn train(vs: &nn::VarStore, batches: Vec<(Tensor, Tensor)>) -> anyhow::Result<usize> {
    let net = nn::linear(vs.root() / "lin", 3, 1, Default::default());
    let mut opt = nn::AdamW::default().build(vs, 1e-2)?;
    let mut steps = 0;
    for (x, y) in batches {
        let loss = net.forward(&x).to_kind(Kind::Float).mse_loss(&y, tch::Reduction::Mean);
        opt.zero_grad();
        loss.backward();
        opt.step();
        steps += 1;
    }
    Ok(steps)
}

fn main() -> anyhow::Result<()> {
    let vs = nn::VarStore::new(Device::Cpu);
    let batches = (0..3).map(|_| (Tensor::ones([4, 3], (Kind::Float, Device::Cpu)), Tensor::ones([4, 1], (Kind::Float, Device::Cpu)))).collect();
    assert_eq!(train(&vs, batches)?, 3);
    Ok(())
}
