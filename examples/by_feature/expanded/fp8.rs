//! By feature: fp8 training. `precision = "fp8"` turns the `nn::linear` layers built in the
//! function into the accelerator's fp8 layers (what torchao's `convert_to_float8_training`
//! does to a PyTorch model at run time, done here at compile time): their three matmuls run
//! on fp8 operands with dynamic scales, everything else under bf16 autocast, weights and
//! optimizer state in fp32. As Accelerate does, the first and last linear layers stay in
//! bf16, and so does any layer whose features are not multiples of 16; the main process
//! reports which layers are fp8. On CPU it runs libtorch's reference kernels (slow, exact);
//! on a GPU of compute capability 8.9+ the fp8 tensor cores.
//!
//! The checks: the middle layers are fp8 and the outer ones not, the loss falls, and with
//! several processes every rank ends with the same weights.
//!
//!     cargo run -p accel-examples --example fp8
//!     accel launch --num-processes 2 target/debug/examples/fp8
use accel_examples::Digits;
use anyhow::{Result, ensure};
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};
const WIDTHS: [i64; 5] = [64, 128, 128, 64, 10];
fn train(x: &Tensor, y: &Tensor) -> Result<()> {
    let accelerator = ::accel_core::Accelerator::builder()
        .strategy(::accel_core::Strategy::Ddp)
        .precision(::accel_core::config::Precision::Fp8)
        .seed(0)
        .cpu(true)
        .attribute_data_loops(1usize)
        .attribute_call(concat!("`train`", " at ", file!(), ":", line!()))
        .build()?;
    let __accel_exit = accelerator.exit_guard();
    let __accel_result: Result<()> = (|| {
        use OptimizerConfig as _;
        let vs = nn::VarStore::new(Device::Cpu);
        let layers: Vec<::accel_core::precision::Float8Linear> = (0..4)
            .map(|i| {
                accelerator
                    .linear(
                        vs.root() / "layers" / i,
                        WIDTHS[i],
                        WIDTHS[i + 1],
                        Default::default(),
                    )
            })
            .collect();
        let mut opt = accelerator.build_optimizer(nn::AdamW::default(), &vs, 3e-3)?;
        let forward = |x: &Tensor| {
            layers
                .iter()
                .enumerate()
                .fold(
                    x.shallow_clone(),
                    |h, (i, layer)| {
                        let h = layer.forward(&h);
                        if i + 1 < layers.len() { h.relu() } else { h }
                    },
                )
        };
        let mut losses = Vec::new();
        for _epoch in 0..3 {
            let mut sum = 0.0;
            let mut batches = 0;
            for (xb, yb) in accelerator.prepare_iter(tch::data::Iter2::new(x, y, 32)) {
                let __accel_autocast = accelerator.autocast_step()?;
                let loss = forward(&xb)
                    .to_kind(Kind::Float)
                    .cross_entropy_for_logits(&yb);
                opt.zero_grad()?;
                accelerator.backward(&loss)?;
                opt.step()?;
                sum += loss.double_value(&[]);
                batches += 1;
            }
            losses.push(sum / batches as f64);
        }
        accelerator.attribute_summon()?;
        let fp8: Vec<bool> = layers.iter().map(|l| l.fp8_recipe().is_some()).collect();
        ensure!(fp8 == [false, true, true, false], "fp8 layers: {fp8:?}");
        ensure!(losses[2] < 0.5 * losses[0], "the loss did not fall: {losses:?}");
        let checksum: f64 = accelerator
            .variables(&vs)
            .values()
            .map(|t| t.sum(Kind::Double).double_value(&[]))
            .sum();
        let all = accelerator.gather(&Tensor::from_slice(&[checksum]))?;
        let all = Vec::<f64>::try_from(all)?;
        ensure!(
            all.iter().all(| c | * c == all[0]), "the ranks' weights differ: {all:?}"
        );
        accelerator
            .print(format!("mean loss per epoch {losses:.4?}; fp8 layers {fp8:?}"));
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
