//! By feature: ZeRO/FSDP sharding. `strategy = "zero3"` (FSDP's full_shard) keeps 1/N of
//! every parameter, gradient and optimizer state on each of N processes; a layer wrapped in
//! `accel_core::Unit` exists whole only while it computes (forward and backward). The state is
//! saved as one shard per process and merged back into one weights file. With one process
//! it is ordinary training.
//!
//!     cargo run -p accel-examples --example sharding
//!     accel launch --num-processes 2 target/debug/examples/sharding
use accel_core::Unit;
use accel_examples::Digits;
use anyhow::Result;
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Tensor};
fn train(x: &Tensor, y: &Tensor, test_x: &Tensor, test_y: &Tensor) -> Result<()> {
    let accelerator = ::accel_core::Accelerator::builder()
        .strategy(::accel_core::Strategy::Zero3)
        .seed(0)
        .cpu(true)
        .attribute_data_loops(1usize)
        .attribute_call(concat!("`train`", " at ", file!(), ":", line!()))
        .build()?;
    let __accel_exit = accelerator.exit_guard();
    let __accel_result: Result<()> = (|| {
        use OptimizerConfig as _;
        let vs = nn::VarStore::new(Device::Cpu);
        let layer = |i: i64, inputs: i64, outputs: i64| {
            let path = vs.root() / "layers" / i;
            Unit::new(
                &accelerator,
                &path,
                nn::linear(&path, inputs, outputs, Default::default()),
            )
        };
        let net = nn::seq()
            .add(layer(0, 64, 128))
            .add_fn(|x| x.relu())
            .add(layer(1, 128, 10));
        let mut opt = accelerator.build_optimizer(nn::AdamW::default(), &vs, 3e-3)?;
        for _ in 0..10 {
            for (xb, yb) in accelerator.prepare_iter(tch::data::Iter2::new(x, y, 32)) {
                let __accel_autocast = accelerator.autocast_step()?;
                let loss = net.forward(&xb).cross_entropy_for_logits(&yb);
                accelerator.backward(&loss)?;
                opt.step()?;
                opt.zero_grad()?;
            }
        }
        accelerator.attribute_summon()?;
        let accuracy = tch::no_grad(|| net.forward(test_x).accuracy_for_logits(test_y));
        let accuracy = accuracy.double_value(&[]);
        let dir = std::path::PathBuf::from("target/by-feature-sharding");
        accelerator.save_state(&dir)?;
        if accelerator.is_main_process() {
            let weights = accel_core::merge_weights(&dir, 0)?;
            let names: Vec<&str> = weights.iter().map(|(n, _)| n.as_str()).collect();
            println!(
                "test accuracy {:.1}% with {} process(es); state saved in {} shard file(s), merged: \
             {names:?}",
                100.0 * accuracy, accelerator.num_processes(), accelerator
                .num_processes(),
            );
        }
        anyhow::ensure!(accuracy > 0.9, "test accuracy {accuracy} is below 90%");
        Ok(())
    })();
    if __accel_result.is_ok() {
        __accel_exit.finish()?;
    }
    __accel_result
}
fn main() -> Result<()> {
    let data = Digits::load(Device::Cpu)?;
    train(&data.train_x, &data.train_y, &data.test_x, &data.test_y)
}
