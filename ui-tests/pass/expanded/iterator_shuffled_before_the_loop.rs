//! tch's `Iter2`, bound by `let` and shuffled before a `while let` loop over it: it keeps its
//! own type (the loop borrows it through a prepared view).
#![deny(warnings)]
use tch::data::Iter2;
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Tensor};
use crate::common::{Data, mlp, weights};
#[allow(clippy::while_let_on_iterator)]
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
        let (x, y) = data.all();
        for _ in 0..data.epochs {
            let mut iter = Iter2::new(&x, &y, data.batch_size);
            iter.shuffle();
            {
                let mut __accel_iter = accelerator.prepare_iter(iter.by_ref());
                while let Some((xb, yb)) = __accel_iter.next() {
                    let __accel_autocast = accelerator.autocast_step()?;
                    let loss = net.forward(&xb).cross_entropy_for_logits(&yb);
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
