use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

fn next_batch() -> Option<Tensor> {
    None
}

#[accel_core::accelerate(strategy = "ddp")]
fn train() -> anyhow::Result<()> {
    let vs = nn::VarStore::new(Device::Cpu);
    let net = nn::linear(vs.root() / "lin", 2, 1, Default::default());
    let mut opt = nn::Sgd::default().build(&vs, 0.1)?;
    loop {
        let Some(x) = next_batch() else { break };
        let loss = net.forward(&x).sum(Kind::Float);
        opt.backward_step(&loss);
    }
    Ok(())
}

fn main() {}
