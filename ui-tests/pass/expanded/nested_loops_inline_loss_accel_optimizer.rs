//! Nested epoch loops, a loss used inline, accel's own AdamW over `named_params(&vs)` stepped
//! as written for it (`opt.step()?`), and a chosen binding name for the accelerator.
#![deny(warnings)]
use accel_core::optim::{AdamConfig, AdamW, Optimizer as _, named_params};
use tch::nn::{self, Module};
use tch::{Device, Tensor};
use crate::common::{Data, mlp, weights};
fn train(data: &Data) -> anyhow::Result<(u64, Vec<(String, Tensor)>)> {
    let acc = ::accel_core::Accelerator::builder()
        .strategy(::accel_core::Strategy::Ddp)
        .cpu(true)
        .attribute_data_loops(1usize)
        .attribute_call(concat!("`train`", " at ", file!(), ":", line!()))
        .build()?;
    let __accel_exit = acc.exit_guard();
    let __accel_result: anyhow::Result<(u64, Vec<(String, Tensor)>)> = (|| {
        let vs = nn::VarStore::new(Device::Cpu);
        let net = mlp(&vs.root());
        let mut opt = AdamW::new(
                named_params(&vs),
                AdamConfig {
                    lr: 1e-2,
                    ..AdamConfig::adamw()
                },
            )?
            .into_prepared(&acc, &vs)?;
        for _epoch in 0..data.epochs {
            for (x, y) in acc.prepare_iter(data.batches()) {
                let __accel_autocast = acc.autocast_step()?;
                acc.backward(&net.forward(&x).cross_entropy_for_logits(&y))?;
                opt.step()?;
                opt.zero_grad()?;
            }
        }
        acc.attribute_summon()?;
        Ok((acc.counters().optimizer_steps, weights(&vs, "")))
    })();
    if __accel_result.is_ok() {
        acc.attribute_summon().and_then(|_| __accel_exit.finish())?;
    }
    __accel_result
}
pub fn run(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    let (steps, weights) = train(data)?;
    let processes = accel_core::topology::Topology::from_env()?.world_size as u64;
    anyhow::ensure!(
        steps == data.epochs as u64 * 128 / data.batch_size as u64 / processes
    );
    Ok(weights)
}
