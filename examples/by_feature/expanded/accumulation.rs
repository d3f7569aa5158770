//! By feature: gradient accumulation. The same loop as a plain tch one; `accumulate = 4`
//! makes every 4 micro-batches one optimizer step (and the end of the data closes a short
//! window), with the loss divided by 4 and no gradient communication in between.
//!
//!     cargo run -p accel-examples --example accumulation
//!     accel launch --num-processes 2 target/debug/examples/accumulation
use accel_examples::Digits;
use anyhow::Result;
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Tensor};
fn train(x: &Tensor, y: &Tensor) -> Result<()> {
    let accelerator = ::accel_core::Accelerator::builder()
        .accumulate(4)
        .seed(0)
        .cpu(true)
        .attribute_data_loops(1usize)
        .attribute_call(concat!("`train`", " at ", file!(), ":", line!()))
        .build()?;
    let __accel_exit = accelerator.exit_guard();
    let __accel_result: Result<()> = (|| {
        use OptimizerConfig as _;
        let vs = nn::VarStore::new(Device::Cpu);
        let net = nn::linear(vs.root() / "classifier", 64, 10, Default::default());
        let mut opt = accelerator
            .build_optimizer(
                nn::Sgd {
                    momentum: 0.9,
                    ..Default::default()
                },
                &vs,
                0.05,
            )?;
        for (xb, yb) in accelerator.prepare_iter(tch::data::Iter2::new(x, y, 16)) {
            let __accel_autocast = accelerator.autocast_step()?;
            let loss = net.forward(&xb).cross_entropy_for_logits(&yb);
            accelerator.backward(&loss)?;
            opt.step()?;
            opt.zero_grad()?;
        }
        let counters = accelerator.counters();
        accelerator
            .print(
                format!(
                    "{} micro-batches on this process, {} optimizer steps (one per 4, the last window short)",
                    counters.micro_steps_total, counters.optimizer_steps
                ),
            );
        anyhow::ensure!(
            counters.optimizer_steps == counters.micro_steps_total.div_ceil(4)
        );
        Ok(())
    })();
    if __accel_result.is_ok() {
        __accel_exit.finish()?;
    }
    __accel_result
}
fn main() -> Result<()> {
    let data = Digits::load(Device::Cpu)?;
    train(&data.train_x, &data.train_y)
}
