//! A helper taking `&mut nn::Optimizer` sets the learning rate each epoch: the optimizer
//! stays tch's, so the helper compiles as written; the body's calls are the accelerator's.
#![deny(warnings)]
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Tensor};
use crate::common::{Data, mlp, weights};
fn apply_schedule(opt: &mut nn::Optimizer, epoch: usize) {
    opt.set_lr(0.1 / (1.0 + epoch as f64));
}
fn train(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    let accelerator = ::accel_core::Accelerator::builder()
        .strategy(::accel_core::Strategy::Ddp)
        .cpu(true)
        .attribute_data_loops(1usize)
        .attribute_call(concat!("`train`", " at ", file!(), ":", line!()))
        .build()?;
    let __accel_exit = accelerator.exit_guard();
    let __accel_result: anyhow::Result<Vec<(String, Tensor)>> = (|| {
        let vs = nn::VarStore::new(Device::Cpu);
        let net = mlp(&vs.root());
        let mut opt = accelerator
            .keep_optimizer(
                &vs,
                nn::Sgd {
                    momentum: 0.9,
                    ..Default::default()
                }
                    .build(&vs, 0.1)?,
            )?;
        for epoch in 0..data.epochs {
            {
                let __accel_lent = accelerator.lend(&opt, "`apply_schedule(..)`")?;
                let __accel_value = apply_schedule(&mut opt, epoch);
                __accel_lent.returned()?;
                __accel_value
            };
            for (x, y) in accelerator.prepare_iter(data.batches()) {
                let __accel_autocast = accelerator.autocast_step()?;
                let loss = net.forward(&x).cross_entropy_for_logits(&y);
                accelerator.drive(&mut opt).zero_grad()?;
                accelerator.backward(&loss)?;
                accelerator.drive(&mut opt).step()?;
            }
        }
        accelerator.attribute_summon()?;
        Ok(weights(&vs, ""))
    })();
    if __accel_result.is_ok() {
        accelerator.attribute_summon().and_then(|_| __accel_exit.finish())?;
    }
    __accel_result
}
pub fn run(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    train(data)
}
