//! An owned VarStore, `Box<dyn Error>`, and a `while let` loop over an iterator.
#![deny(warnings)]

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

#[accel_core::accelerate(accumulate = 3, cpu = true)]
fn train(vs: nn::VarStore, data: Vec<Tensor>) -> Result<f64, Box<dyn std::error::Error>> {
    let net = nn::linear(vs.root() / "lin", 2, 1, Default::default());
    let mut opt = nn::Sgd { momentum: 0.9, ..Default::default() }.build(&vs, 0.01)?;
    let mut batches = data.into_iter();
    let mut last = 0.0;
    while let Some(x) = batches.next() {
        let loss = net.forward(&x).square().mean(Kind::Float);
        opt.zero_grad();
        loss.backward();
        opt.step();
        last = loss.double_value(&[]);
    }
    Ok(last)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let vs = nn::VarStore::new(Device::Cpu);
    let data = (0..4).map(|_| Tensor::ones([4, 2], (Kind::Float, Device::Cpu))).collect::<Vec<_>>();
    assert!(train(vs, data)?.is_finite());
    Ok(())
}
