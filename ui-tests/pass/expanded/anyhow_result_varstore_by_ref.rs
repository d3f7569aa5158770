//! A VarStore passed by reference, `anyhow::Result`, a value returned through the closure.
#![deny(warnings)]
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};
fn train(vs: &nn::VarStore, batches: Vec<(Tensor, Tensor)>) -> anyhow::Result<usize> {
    let accelerator = ::accel_core::Accelerator::builder()
        .precision(::accel_core::Precision::Bf16)
        .clip_grad_norm(1f64)
        .cpu(true)
        .build()?;
    let __accel_exit = accelerator.exit_guard();
    let __accel_result: anyhow::Result<usize> = (|| {
        let net = nn::linear(vs.root() / "lin", 3, 1, Default::default());
        let mut opt = nn::AdamW::default().build(vs, 1e-2)?;
        let mut steps = 0;
        for (x, y) in accelerator.prepare_iter(batches) {
            let __accel_autocast = accelerator.autocast()?;
            let loss = net
                .forward(&x)
                .to_kind(Kind::Float)
                .mse_loss(&y, tch::Reduction::Mean);
            opt.zero_grad();
            drop(__accel_autocast);
            accelerator.backward(&loss)?;
            opt.step();
            steps += 1;
        }
        Ok(steps)
    })();
    if __accel_result.is_ok() {
        __accel_exit.finish()?;
    }
    __accel_result
}
fn main() -> anyhow::Result<()> {
    let vs = nn::VarStore::new(Device::Cpu);
    let batches = (0..3)
        .map(|_| (
            Tensor::ones([4, 3], (Kind::Float, Device::Cpu)),
            Tensor::ones([4, 1], (Kind::Float, Device::Cpu)),
        ))
        .collect();
    assert_eq!(train(& vs, batches) ?, 3);
    Ok(())
}
