//! The backward pass inside an `if` (every other batch trains), `enumerate` counting this
//! process's batches.
#![deny(warnings)]
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Tensor};
use crate::common::{Data, mlp, weights};
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
        let mut opt = accelerator.build_optimizer(nn::Adam::default(), &vs, 1e-2)?;
        for _ in 0..data.epochs {
            for (step, (x, y)) in accelerator
                .prepare_iter(data.batches().into_iter())
                .enumerate()
            {
                let __accel_autocast = accelerator.autocast_step()?;
                let loss = net.forward(&x).cross_entropy_for_logits(&y);
                if step % 2 == 0 {
                    opt.zero_grad()?;
                    accelerator.backward(&loss)?;
                    opt.step()?;
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
