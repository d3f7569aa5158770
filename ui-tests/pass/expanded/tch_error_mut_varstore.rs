//! A `&mut VarStore` and tch's own error type.
#![deny(warnings)]
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, TchError, Tensor};
fn train(vs: &mut nn::VarStore) -> Result<(), TchError> {
    let accelerator = ::accel_core::Accelerator::builder().cpu(true).build()?;
    let __accel_exit = accelerator.exit_guard();
    let __accel_result: Result<(), TchError> = (|| {
        let net = nn::linear(vs.root() / "lin", 2, 1, Default::default());
        let mut opt = nn::Adam::default().build(vs, 1e-2)?;
        for x in accelerator
            .prepare_iter(
                (0..2)
                    .map(|_| Tensor::ones([4, 2], (Kind::Float, Device::Cpu)))
                    .collect::<Vec<_>>(),
            )
        {
            let __accel_autocast = accelerator.autocast()?;
            let loss = net.forward(&x).sum(Kind::Float);
            opt.zero_grad();
            drop(__accel_autocast);
            accelerator.backward(&loss)?;
            opt.step();
        }
        Ok(())
    })();
    if __accel_result.is_ok() {
        __accel_exit.finish()?;
    }
    __accel_result
}
fn main() {
    let mut vs = nn::VarStore::new(Device::Cpu);
    train(&mut vs).unwrap();
}
