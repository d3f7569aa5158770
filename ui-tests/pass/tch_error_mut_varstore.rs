//! A `&mut VarStore` and tch's own error type.
#![deny(warnings)]

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, TchError, Tensor};

#[accel_core::accelerate(cpu = true)]
fn train(vs: &mut nn::VarStore) -> Result<(), TchError> {
    let net = nn::linear(vs.root() / "lin", 2, 1, Default::default());
    let mut opt = nn::Adam::default().build(vs, 1e-2)?;
    for x in (0..2).map(|_| Tensor::ones([4, 2], (Kind::Float, Device::Cpu))).collect::<Vec<_>>() {
        let loss = net.forward(&x).sum(Kind::Float);
        opt.zero_grad();
        loss.backward();
        opt.step();
    }
    Ok(())
}

fn main() {
    let mut vs = nn::VarStore::new(Device::Cpu);
    train(&mut vs).unwrap();
}
