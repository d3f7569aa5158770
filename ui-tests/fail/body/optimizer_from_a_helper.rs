// An optimizer made by a helper given two models: which one it trains is not visible.
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, TchError, Tensor};

fn make_opt(student: &nn::VarStore, _teacher: &nn::VarStore) -> Result<nn::Optimizer, TchError> {
    nn::Adam::default().build(student, 1e-3)
}

#[accel_core::accelerate(strategy = "ddp")]
fn train(data: Vec<Tensor>) -> anyhow::Result<()> {
    let vs = nn::VarStore::new(Device::Cpu);
    let teacher = nn::VarStore::new(Device::Cpu);
    let net = nn::linear(vs.root() / "lin", 2, 1, Default::default());
    let _frozen = nn::linear(teacher.root() / "lin", 2, 1, Default::default());
    let mut opt = make_opt(&vs, &teacher)?;
    for x in data {
        let loss = net.forward(&x).sum(Kind::Float);
        opt.zero_grad();
        loss.backward();
        opt.step();
    }
    Ok(())
}

fn main() {}
