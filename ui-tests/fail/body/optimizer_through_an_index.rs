use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

#[accel_core::accelerate(strategy = "ddp")]
fn train(data: Vec<Tensor>) -> anyhow::Result<()> {
    let vs = nn::VarStore::new(Device::Cpu);
    let net = nn::linear(vs.root() / "lin", 2, 1, Default::default());
    let mut opts = vec![nn::Sgd::default().build(&vs, 0.1)?];
    for x in data {
        let loss = net.forward(&x).sum(Kind::Float);
        opts[0].backward_step(&loss);
    }
    Ok(())
}

fn main() {}
