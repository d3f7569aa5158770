use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

#[accel_core::accelerate(strategy = "ddp")]
fn train() -> anyhow::Result<()> {
    let teacher = nn::VarStore::new(Device::Cpu);
    let student = nn::VarStore::new(Device::Cpu);
    let t = nn::linear(teacher.root() / "lin", 2, 1, Default::default());
    let s = nn::linear(student.root() / "lin", 2, 1, Default::default());
    let mut opt = nn::Sgd::default().build(&student, 0.1)?;
    for x in [Tensor::ones([4, 2], (Kind::Float, Device::Cpu))] {
        let loss = (s.forward(&x) - t.forward(&x).detach()).square().mean(Kind::Float);
        opt.zero_grad();
        loss.backward();
        opt.step();
    }
    Ok(())
}

fn main() {}
