//! Batch norm between two layers under DDP: its running statistics (variables of the
//! VarStore that are not parameters) end equal on every process, as torch's DDP keeps them
//! (`broadcast_buffers=True`). Each process normalises by its own batch, so two processes
//! are not one process with twice the batch: `tests/ui.rs` checks that the ranks agree on
//! every variable, not parity with one process.
#![deny(warnings)]
use tch::nn::{self, ModuleT, OptimizerConfig};
use tch::Tensor;
use crate::common::{Data, mlp_with_norm, weights};
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
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let net = mlp_with_norm(
            &vs.root(),
            |p, n| nn::batch_norm1d(p, n, Default::default()),
        );
        let mut opt = accelerator.build_optimizer(nn::Sgd::default(), &vs, 0.1)?;
        for _ in 0..data.epochs {
            for (x, y) in accelerator.prepare_iter(data.batches()) {
                let __accel_autocast = accelerator.autocast_step()?;
                let loss = net.forward_t(&x, true).cross_entropy_for_logits(&y);
                opt.backward_step(&loss)?;
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
