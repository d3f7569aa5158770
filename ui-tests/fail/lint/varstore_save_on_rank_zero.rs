use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

#[accel_core::accelerate(strategy = "ddp")]
fn train(data: Vec<Tensor>) -> anyhow::Result<()> {
    let vs = nn::VarStore::new(Device::Cpu);
    let net = nn::linear(vs.root() / "lin", 2, 1, Default::default());
    let mut opt = nn::Sgd::default().build(&vs, 0.1)?;
    for x in data {
        let loss = net.forward(&x).sum(Kind::Float);
        opt.backward_step(&loss);
    }
    if std::env::var("RANK").map_or(true, |r| r == "0") {
        vs.save("model.ot")?;
    }
    Ok(())
}

fn main() {}
