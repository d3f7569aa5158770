//! A VarStore passed by reference and given to `build` as it is (`build(vs, ..)`, no `&`),
//! `anyhow::Result`, clipping from the attribute, a value returned through the body.
#![deny(warnings)]
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Tensor};
use crate::common::{Data, mlp, weights};
fn train(vs: &nn::VarStore, data: &Data) -> anyhow::Result<usize> {
    let accelerator = ::accel_core::Accelerator::builder()
        .strategy(::accel_core::Strategy::Ddp)
        .clip_grad_norm(1.0_f64)
        .cpu(true)
        .attribute_data_loops(1usize)
        .attribute_call(concat!("`train`", " at ", file!(), ":", line!()))
        .build()?;
    let __accel_exit = accelerator.exit_guard();
    let __accel_result: anyhow::Result<usize> = (|| {
        use OptimizerConfig as _;
        let net = mlp(&vs.root());
        let mut opt = accelerator.build_optimizer(nn::AdamW::default(), vs, 1e-2)?;
        let mut steps = 0;
        for _ in 0..data.epochs {
            for (x, y) in accelerator.prepare_iter(data.batches()) {
                let __accel_autocast = accelerator.autocast_step()?;
                let loss = net.forward(&x).cross_entropy_for_logits(&y);
                opt.zero_grad()?;
                accelerator.backward(&loss)?;
                opt.step()?;
                steps += 1;
            }
        }
        Ok(steps)
    })();
    if __accel_result.is_ok() {
        accelerator.attribute_summon().and_then(|_| __accel_exit.finish())?;
    }
    __accel_result
}
pub fn run(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    let vs = nn::VarStore::new(Device::Cpu);
    let steps = train(&vs, data)?;
    let processes = accel_core::topology::Topology::from_env()?.world_size;
    anyhow::ensure!(
        steps as i64 == data.epochs as i64 * 128 / data.batch_size / processes as i64
    );
    Ok(weights(&vs, ""))
}
