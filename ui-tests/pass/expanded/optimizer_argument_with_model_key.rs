//! tch's optimizer passed in by `&mut` (made by the caller), driven by the accelerator at
//! each call; `model = vs` names the model it trains.
#![deny(warnings)]
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Tensor};
use crate::common::{Data, mlp, weights};
fn train(
    vs: &nn::VarStore,
    net: &nn::Sequential,
    opt: &mut nn::Optimizer,
    data: &Data,
) -> anyhow::Result<()> {
    let accelerator = ::accel_core::Accelerator::builder()
        .strategy(::accel_core::Strategy::Ddp)
        .cpu(true)
        .attribute_data_loops(1usize)
        .attribute_call(concat!("`train`", " at ", file!(), ":", line!()))
        .build()?;
    let __accel_exit = accelerator.exit_guard();
    let __accel_result: anyhow::Result<()> = (|| {
        accelerator.prepare_model_once(&vs)?;
        for _ in 0..data.epochs {
            for (x, y) in accelerator.prepare_iter(data.batches()) {
                let __accel_autocast = accelerator.autocast_step()?;
                let loss = net.forward(&x).cross_entropy_for_logits(&y);
                accelerator.drive(&mut *opt).zero_grad()?;
                accelerator.backward(&loss)?;
                accelerator.drive(&mut *opt).clip_grad_norm(0.5)?;
                accelerator.drive(&mut *opt).step()?;
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
    let mut opt = nn::Adam::default().build(&vs, 1e-2)?;
    train(&vs, &net, &mut opt, data)?;
    Ok(weights(&vs, ""))
}
