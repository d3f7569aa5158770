//! An index loop counted apart from its index (`for (step, i) in (0..n).enumerate()`): `i`
//! picks the batch and is dealt; `step` counts this process's batches and sets the schedule
//! and the hand-written accumulation, the same on every process.
#![deny(warnings)]
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Tensor};
use crate::common::{Data, SAMPLES, mlp, weights};
fn train(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    let accelerator = ::accel_core::Accelerator::builder()
        .strategy(::accel_core::Strategy::Ddp)
        .cpu(true)
        .attribute_data_loops(1usize)
        .attribute_call(concat!("`train`", " at ", file!(), ":", line!()))
        .build()?;
    let __accel_exit = accelerator.exit_guard();
    let __accel_result: anyhow::Result<Vec<(String, Tensor)>> = (|| {
        use OptimizerConfig as _;
        let vs = nn::VarStore::new(Device::Cpu);
        let net = mlp(&vs.root());
        let mut opt = accelerator.build_optimizer(nn::Sgd::default(), &vs, 0.1)?;
        let (x, y) = data.all();
        let bs = data.batch_size;
        for _ in 0..data.epochs {
            for (step, i) in accelerator.prepare_iter(0..SAMPLES / bs).enumerate() {
                let __accel_autocast = accelerator.autocast_step()?;
                opt.set_lr(0.2 / (1.0 + step as f64));
                let xb = x.narrow(0, i * bs, bs);
                let yb = y.narrow(0, i * bs, bs);
                let loss = net.forward(&xb).cross_entropy_for_logits(&yb);
                accelerator.backward(&loss)?;
                if step % 2 == 1 {
                    opt.step()?;
                    opt.zero_grad()?;
                }
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
