use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

fn model() -> nn::VarStore {
    nn::VarStore::new(Device::Cpu)
}

#[accel_core::accelerate(strategy = "ddp", model = model())]
fn train(data: Vec<Tensor>) -> anyhow::Result<()> {
    let vs = model();
    let net = nn::linear(vs.root() / "lin", 2, 1, Default::default());
    let mut opt = nn::Sgd::default().build(&vs, 0.1)?;
    for x in data {
        let loss = net.forward(&x).sum(Kind::Float);
        opt.backward_step(&loss);
    }
    Ok(())
}

fn main() {}
