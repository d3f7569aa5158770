//! The optimizer step in a helper (`update(&mut opt)`): under DDP with no loss scaling,
//! accumulation or clipping, gradients are averaged in backward, so tch's own step is the
//! accelerator's; the accelerator checks the call and counts the step.
#![deny(warnings)]
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Tensor};
use crate::common::{Data, mlp, weights};
fn update(opt: &mut nn::Optimizer) {
    opt.step();
    opt.zero_grad();
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
            .keep_optimizer(&vs, nn::Adam::default().build(&vs, 1e-2)?)?;
        for _ in 0..data.epochs {
            for (x, y) in accelerator.prepare_iter(data.batches()) {
                let __accel_autocast = accelerator.autocast_step()?;
                let loss = net.forward(&x).cross_entropy_for_logits(&y);
                accelerator.backward(&loss)?;
                {
                    let __accel_lent = accelerator.lend(&opt, "`update(..)`")?;
                    let __accel_value = update(&mut opt);
                    __accel_lent.returned()?;
                    __accel_value
                };
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
