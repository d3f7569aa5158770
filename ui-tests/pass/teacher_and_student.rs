//! Two VarStores, one trained: a frozen teacher distilled into a student. Only the model
//! the optimizer is built over is prepared.
#![deny(warnings)]

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

use crate::common::{Data, mlp, weights};

#[accel_core::accelerate(strategy = "ddp", cpu = true)]
fn train(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    let teacher = nn::VarStore::new(Device::Cpu);
    let student = nn::VarStore::new(Device::Cpu);
    let t = mlp(&teacher.root());
    let s = mlp(&student.root());
    let mut opt = nn::Adam::default().build(&student, 1e-2)?;
    for _ in 0..data.epochs {
        for (x, _labels) in data.batches() {
            let target = t.forward(&x).detach().softmax(-1, Kind::Float);
            let loss = (s.forward(&x).log_softmax(-1, Kind::Float) * target).sum(Kind::Float)
                / -(x.size()[0] as f64);
            opt.zero_grad();
            loss.backward();
            opt.step();
        }
    }
    Ok(weights(&student, ""))
}

pub fn run(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    train(data)
}
