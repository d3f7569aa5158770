//! A `&mut VarStore` given to `build` as it is, and tch's `backward_step` (no `.backward()`
//! call anywhere).
#![deny(warnings)]
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Tensor};
use crate::common::{Data, mlp, weights};
fn train(vs: &mut nn::VarStore, data: &Data) -> anyhow::Result<()> {
    let accelerator = ::accel_core::Accelerator::builder()
        .strategy(::accel_core::Strategy::Ddp)
        .cpu(true)
        .attribute_data_loops(1usize)
        .attribute_call(concat!("`train`", " at ", file!(), ":", line!()))
        .build()?;
    let __accel_exit = accelerator.exit_guard();
    let __accel_result: anyhow::Result<()> = (|| {
        use OptimizerConfig as _;
        let net = mlp(&vs.root());
        let mut opt = accelerator
            .build_optimizer(
                nn::Sgd {
                    momentum: 0.9,
                    wd: 1e-3,
                    ..Default::default()
                },
                vs,
                0.05,
            )?;
        for _ in 0..data.epochs {
            for (x, y) in accelerator.prepare_iter(data.batches()) {
                let __accel_autocast = accelerator.autocast_step()?;
                let loss = net.forward(&x).cross_entropy_for_logits(&y);
                opt.backward_step(&loss)?;
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
