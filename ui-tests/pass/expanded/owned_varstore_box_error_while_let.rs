//! An owned VarStore, `Box<dyn Error>`, accumulation over 3 batches, and a `while let` loop
//! over an iterator made just before it.
#![deny(warnings)]
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Tensor};
use crate::common::{Data, mlp, weights};
#[allow(clippy::while_let_on_iterator)]
fn train(
    vs: nn::VarStore,
    data: &Data,
) -> Result<Vec<(String, Tensor)>, Box<dyn std::error::Error>> {
    let accelerator = ::accel_core::Accelerator::builder()
        .strategy(::accel_core::Strategy::Ddp)
        .accumulate(3)
        .cpu(true)
        .attribute_data_loops(1usize)
        .attribute_call(concat!("`train`", " at ", file!(), ":", line!()))
        .build()?;
    let __accel_exit = accelerator.exit_guard();
    let __accel_result: Result<Vec<(String, Tensor)>, Box<dyn std::error::Error>> = (|| {
        use OptimizerConfig as _;
        let net = mlp(&vs.root());
        let mut opt = accelerator
            .build_optimizer(
                nn::Sgd {
                    momentum: 0.9,
                    ..Default::default()
                },
                &vs,
                0.05,
            )?;
        for _ in 0..data.epochs {
            let mut batches = accelerator.prepare_iter(data.batches().into_iter());
            while let Some((x, y)) = batches.next() {
                let __accel_autocast = accelerator.autocast_step()?;
                let loss = net.forward(&x).cross_entropy_for_logits(&y);
                opt.zero_grad()?;
                accelerator.backward(&loss)?;
                opt.step()?;
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
    train(nn::VarStore::new(Device::Cpu), data).map_err(|e| anyhow::anyhow!("{e}"))
}
