use accel_core::optim::{Optimizer as _, Sgd, SgdConfig, unnamed_params};
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

#[accel_core::accelerate(strategy = "ddp")]
fn train(data: Vec<Tensor>) -> anyhow::Result<()> {
    let teacher = nn::VarStore::new(Device::Cpu);
    let student = nn::VarStore::new(Device::Cpu);
    let t = nn::linear(teacher.root() / "lin", 2, 1, Default::default());
    let s = nn::linear(student.root() / "lin", 2, 1, Default::default());
    let params = unnamed_params(&[s.ws.shallow_clone()]);
    let mut opt = Sgd::new(params, SgdConfig::default())?;
    for x in data {
        let loss = (s.forward(&x) - t.forward(&x).detach()).square().sum(Kind::Float);
        opt.zero_grad()?;
        loss.backward();
        opt.step()?;
    }
    Ok(())
}

fn main() {}
