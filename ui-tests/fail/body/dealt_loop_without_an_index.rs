// `data = "dealt"` on a loop that has nothing to deal.
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

#[accel_core::accelerate(strategy = "ddp", data = "dealt")]
fn train(x: &Tensor) -> anyhow::Result<()> {
    let vs = nn::VarStore::new(Device::Cpu);
    let net = nn::linear(vs.root() / "lin", 2, 1, Default::default());
    let mut opt = nn::Sgd::default().build(&vs, 0.1)?;
    let mut step = 0;
    while step < 10 {
        let loss = net.forward(x).sum(Kind::Float);
        opt.backward_step(&loss);
        step += 1;
    }
    Ok(())
}

fn main() {}
