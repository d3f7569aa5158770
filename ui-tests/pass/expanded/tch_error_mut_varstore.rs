//! A `&mut VarStore` given to `build` as it is, and tch's own error type: the shape the
//! attribute once passed through unprepared.
#![deny(warnings)]
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, TchError, Tensor};
use crate::common::{Data, mlp, weights};
fn train(vs: &mut nn::VarStore, data: &Data) -> Result<(), TchError> {
    let accelerator = ::accel_core::Accelerator::builder()
        .strategy(::accel_core::Strategy::Ddp)
        .cpu(true)
        .attribute_data_loops(1usize)
        .attribute_call(concat!("`train`", " at ", file!(), ":", line!()))
        .build()?;
    let __accel_exit = accelerator.exit_guard();
    let __accel_result: Result<(), TchError> = (|| {
        use OptimizerConfig as _;
        let net = mlp(&vs.root());
        let mut opt = accelerator.build_optimizer(nn::Adam::default(), vs, 1e-2)?;
        for _ in 0..data.epochs {
            for (x, y) in accelerator.prepare_iter(data.batches()) {
                let __accel_autocast = accelerator.autocast_step()?;
                let loss = net.forward(&x).cross_entropy_for_logits(&y);
                opt.zero_grad()?;
                accelerator.backward(&loss)?;
                opt.step()?;
            }
        }
        Ok(())
    })();
    if __accel_result.is_ok() {
        accelerator.attribute_summon().and_then(|_| __accel_exit.finish())?;
    }
    __accel_result
}
pub fn run(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    let mut vs = nn::VarStore::new(Device::Cpu);
    train(&mut vs, data)?;
    Ok(weights(&vs, ""))
}
