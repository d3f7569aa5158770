use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

#[accel_core::accelerate(strategy = "ddp")]
fn evaluate() -> anyhow::Result<f64> {
    let vs = nn::VarStore::new(Device::Cpu);
    let net = nn::linear(vs.root() / "lin", 2, 1, Default::default());
    let x = Tensor::ones([4, 2], (Kind::Float, Device::Cpu));
    Ok(net.forward(&x).sum(Kind::Float).double_value(&[]))
}

fn main() {}
