use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Tensor};

#[accel_core::accelerate(strategy = "zero3", accumulate = 4, optimizer_in_backward = true)]
fn train() -> anyhow::Result<()> {
    let vs = nn::VarStore::new(Device::Cpu);
    let net = nn::linear(vs.root() / "lin", 2, 1, Default::default());
    let mut opt = nn::Sgd::default().build(&vs, 0.1)?;
    for x in [Tensor::ones([4, 2], (tch::Kind::Float, Device::Cpu))] {
        let loss = net.forward(&x).sum(tch::Kind::Float);
        opt.zero_grad();
        loss.backward();
        opt.step();
    }
    Ok(())
}

fn main() {}
