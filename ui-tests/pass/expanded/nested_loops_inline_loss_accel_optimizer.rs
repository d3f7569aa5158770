//! Nested epoch loops, a loss used inline, accel's own AdamW, and a chosen binding name.
#![deny(warnings)]
use accel_core::optim::{AdamConfig, AdamW, named_params};
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};
fn train(epochs: usize) -> anyhow::Result<u64> {
    let acc = ::accel_core::Accelerator::builder()
        .strategy(::accel_core::Strategy::Ddp)
        .seed(3u64)
        .cpu(true)
        .build()?;
    let __accel_exit = acc.exit_guard();
    let __accel_result: anyhow::Result<u64> = (|| {
        let vs = nn::VarStore::new(Device::Cpu);
        let net = nn::linear(vs.root() / "lin", 2, 1, Default::default());
        let mut opt = acc
            .prepare_optimizer_for(
                &vs,
                AdamW::new(
                    named_params(&vs),
                    AdamConfig {
                        lr: 1e-2,
                        ..AdamConfig::adamw()
                    },
                )?,
            )?;
        for _epoch in 0..epochs {
            for x in acc
                .prepare_iter(
                    (0..3)
                        .map(|_| Tensor::ones([4, 2], (Kind::Float, Device::Cpu)))
                        .collect::<Vec<_>>(),
                )
            {
                let __accel_autocast = acc.autocast()?;
                drop(__accel_autocast);
                acc.backward(&net.forward(&x).square().mean(Kind::Float))?;
                opt.step()?;
                opt.zero_grad()?;
            }
        }
        Ok(acc.counters().optimizer_steps)
    })();
    if __accel_result.is_ok() {
        __accel_exit.finish()?;
    }
    __accel_result
}
fn main() -> anyhow::Result<()> {
    assert_eq!(train(2) ?, 6);
    Ok(())
}
