//! Two VarStores, one trained: a frozen teacher distilled into a student. Only the model
//! the optimizer is built over is prepared.
#![deny(warnings)]
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};
use crate::common::{Data, mlp, weights};
fn train(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    let accelerator = ::accel_core::Accelerator::builder()
        .strategy(::accel_core::Strategy::Ddp)
        .cpu(true)
        .attribute_data_loops(1usize)
        .attribute_call(concat!("`train`", " at ", file!(), ":", line!()))
        .build()?;
    let __accel_exit = accelerator.exit_guard();
    let __accel_result: anyhow::Result<Vec<(String, Tensor)>> = (|| {
        use OptimizerConfig as _;
        let teacher = nn::VarStore::new(Device::Cpu);
        let student = nn::VarStore::new(Device::Cpu);
        let t = mlp(&teacher.root());
        let s = mlp(&student.root());
        let mut opt = accelerator.build_optimizer(nn::Adam::default(), &student, 1e-2)?;
        for _ in 0..data.epochs {
            for (x, _labels) in accelerator.prepare_iter(data.batches()) {
                let __accel_autocast = accelerator.autocast_step()?;
                let target = t.forward(&x).detach().softmax(-1, Kind::Float);
                let loss = (s.forward(&x).log_softmax(-1, Kind::Float) * target)
                    .sum(Kind::Float) / -(x.size()[0] as f64);
                opt.zero_grad()?;
                accelerator.backward(&loss)?;
                opt.step()?;
            }
        }
        accelerator.attribute_summon()?;
        Ok(weights(&student, ""))
    })();
    if __accel_result.is_ok() {
        accelerator.attribute_summon().and_then(|_| __accel_exit.finish())?;
    }
    __accel_result
}
pub fn run(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    train(data)
}
