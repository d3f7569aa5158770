use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, TchError, Tensor};

fn make_opt(vs: &nn::VarStore) -> Result<nn::Optimizer, TchError> {
    nn::Adam::default().build(vs, 1e-3)
}

#[accel_core::accelerate(strategy = "ddp")]
fn train(data: Vec<Tensor>) -> anyhow::Result<()> {
    let vs = nn::VarStore::new(Device::Cpu);
    let net = nn::linear(vs.root() / "lin", 2, 1, Default::default());
    let mut opt = make_opt(&vs)?;
    for x in data {
        let loss = net.forward(&x).sum(Kind::Float);
        opt.zero_grad();
        loss.backward();
        opt.step();
    }
    Ok(())
}

fn main() {}
