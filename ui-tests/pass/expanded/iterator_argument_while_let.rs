//! `while let` over an iterator passed in by `&mut`: the loop borrows it through the
//! accelerator's prepared view.
#![deny(warnings)]
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Tensor};
use crate::common::{Data, mlp, weights};
#[allow(clippy::while_let_on_iterator)]
fn train(
    vs: &nn::VarStore,
    batches: &mut std::vec::IntoIter<(Tensor, Tensor)>,
) -> anyhow::Result<()> {
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
        let mut opt = accelerator.build_optimizer(nn::Adam::default(), vs, 1e-2)?;
        {
            let mut __accel_batches = accelerator.prepare_iter(batches.by_ref());
            while let Some((x, y)) = __accel_batches.next() {
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
    let all: Vec<(Tensor, Tensor)> = (0..data.epochs)
        .flat_map(|_| data.batches())
        .collect();
    train(&vs, &mut all.into_iter())?;
    Ok(weights(&vs, ""))
}
