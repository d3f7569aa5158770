//! `sync_batchnorm = true`: the body's `nn::batch_norm1d` becomes the accelerator's, whose
//! statistics span every process's batch, so two processes with batches of 8 compute what
//! one process with batches of 16 does, running statistics included; under zero3.
#![deny(warnings)]
use tch::nn::{self, ModuleT, OptimizerConfig};
use tch::Tensor;
use crate::common::{Data, mlp_with_norm, weights};
fn train(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    let accelerator = ::accel_core::Accelerator::builder()
        .strategy(::accel_core::Strategy::Zero3)
        .accumulate(2)
        .cpu(true)
        .sync_batchnorm(true)
        .attribute_data_loops(1usize)
        .attribute_call(concat!("`train`", " at ", file!(), ":", line!()))
        .build()?;
    let __accel_exit = accelerator.exit_guard();
    let __accel_result: anyhow::Result<Vec<(String, Tensor)>> = (|| {
        use OptimizerConfig as _;
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let net = mlp_with_norm(
            &vs.root(),
            |p, n| accelerator.batch_norm1d(p, n, Default::default()),
        );
        let mut opt = accelerator.build_optimizer(nn::Sgd::default(), &vs, 0.1)?;
        for _ in 0..data.epochs {
            for (x, y) in accelerator.prepare_iter(data.batches()) {
                let __accel_autocast = accelerator.autocast_step()?;
                let loss = net.forward_t(&x, true).cross_entropy_for_logits(&y);
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
    train(data)
}
