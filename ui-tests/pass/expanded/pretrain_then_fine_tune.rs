//! Two annotated functions one after the other on one model (pretraining, then fine-tuning
//! with another optimizer and strategy): one process group for both.
#![deny(warnings)]
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Tensor};
use crate::common::{Data, mlp, weights};
fn pretrain(vs: &nn::VarStore, net: &nn::Sequential, data: &Data) -> anyhow::Result<()> {
    let accelerator = ::accel_core::Accelerator::builder()
        .strategy(::accel_core::Strategy::Ddp)
        .cpu(true)
        .attribute_data_loops(1usize)
        .attribute_call(concat!("`pretrain`", " at ", file!(), ":", line!()))
        .build()?;
    let __accel_exit = accelerator.exit_guard();
    let __accel_result: anyhow::Result<()> = (|| {
        use OptimizerConfig as _;
        let mut opt = accelerator.build_optimizer(nn::Adam::default(), vs, 1e-2)?;
        for (x, y) in accelerator.prepare_iter(data.batches()) {
            let __accel_autocast = accelerator.autocast_step()?;
            let loss = net.forward(&x).cross_entropy_for_logits(&y);
            opt.zero_grad()?;
            accelerator.backward(&loss)?;
            opt.step()?;
        }
        Ok(())
    })();
    if __accel_result.is_ok() {
        accelerator.attribute_summon().and_then(|_| __accel_exit.finish())?;
    }
    __accel_result
}
fn fine_tune(
    vs: &nn::VarStore,
    net: &nn::Sequential,
    data: &Data,
) -> anyhow::Result<()> {
    let accelerator = ::accel_core::Accelerator::builder()
        .strategy(::accel_core::Strategy::Zero2)
        .cpu(true)
        .attribute_data_loops(1usize)
        .attribute_call(concat!("`fine_tune`", " at ", file!(), ":", line!()))
        .build()?;
    let __accel_exit = accelerator.exit_guard();
    let __accel_result: anyhow::Result<()> = (|| {
        use OptimizerConfig as _;
        let mut opt = accelerator
            .build_optimizer(
                nn::Sgd {
                    momentum: 0.9,
                    ..Default::default()
                },
                vs,
                0.05,
            )?;
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
    let vs = nn::VarStore::new(Device::Cpu);
    let net = mlp(&vs.root());
    if data.epochs > 0 {
        pretrain(&vs, &net, data)?;
    }
    fine_tune(&vs, &net, data)?;
    Ok(weights(&vs, ""))
}
