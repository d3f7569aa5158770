//! By feature: mixed precision. `precision = "bf16"` runs the forward pass under bf16
//! autocast (matmuls in bf16, reductions and the loss in fp32) while the weights and the
//! optimizer stay fp32; `"fp16"` adds dynamic loss scaling. Both work on CPU.
//!
//!     cargo run -p accel-examples --example mixed_precision
use accel_examples::Digits;
use anyhow::Result;
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};
fn train(x: &Tensor, y: &Tensor) -> Result<Kind> {
    let accelerator = ::accel_core::Accelerator::builder()
        .precision(::accel_core::config::Precision::Bf16)
        .seed(0)
        .cpu(true)
        .attribute_data_loops(1usize)
        .attribute_call(concat!("`train`", " at ", file!(), ":", line!()))
        .build()?;
    let __accel_exit = accelerator.exit_guard();
    let __accel_result: Result<Kind> = (|| {
        use OptimizerConfig as _;
        let vs = nn::VarStore::new(Device::Cpu);
        let net = nn::linear(vs.root() / "classifier", 64, 10, Default::default());
        let mut opt = accelerator.build_optimizer(nn::AdamW::default(), &vs, 1e-2)?;
        let mut logits_kind = Kind::Float;
        for (xb, yb) in accelerator.prepare_iter(tch::data::Iter2::new(x, y, 64)) {
            let __accel_autocast = accelerator.autocast_step()?;
            let logits = net.forward(&xb);
            logits_kind = logits.kind();
            let loss = logits.to_kind(Kind::Float).cross_entropy_for_logits(&yb);
            opt.zero_grad()?;
            accelerator.backward(&loss)?;
            opt.step()?;
        }
        accelerator.attribute_summon()?;
        let weight = accelerator.variables(&vs)["classifier.weight"].kind();
        accelerator
            .print(
                format!("logits computed in {logits_kind:?}, weights kept in {weight:?}"),
            );
        Ok(logits_kind)
    })();
    if __accel_result.is_ok() {
        __accel_exit.finish()?;
    }
    __accel_result
}
fn main() -> Result<()> {
    let data = Digits::load(Device::Cpu)?;
    anyhow::ensure!(train(& data.train_x, & data.train_y) ? == Kind::BFloat16);
    Ok(())
}
