//! A small convolutional network on the 8x8 digits, written as a plain tch loop with the
//! one added line. Must reach 97% on the 360 held-out images.
//!
//!     cargo run -p accel-examples --example cnn
//!     accel launch --num-processes 2 target/debug/examples/cnn
use accel_examples::Digits;
use anyhow::Result;
use tch::nn::{self, ModuleT, OptimizerConfig};
use tch::{Device, Kind};
fn cnn(root: &nn::Path) -> nn::SequentialT {
    let conv = |c| nn::ConvConfig { padding: 1, ..c };
    nn::seq_t()
        .add_fn(|x| x.view([-1, 1, 8, 8]))
        .add(nn::conv2d(root / "conv1", 1, 16, 3, conv(Default::default())))
        .add_fn(|x| x.relu())
        .add(nn::conv2d(root / "conv2", 16, 32, 3, conv(Default::default())))
        .add_fn(|x| x.relu().max_pool2d_default(2).flatten(1, -1))
        .add_fn_t(|x, train| x.dropout(0.25, train))
        .add(nn::linear(root / "head", 32 * 4 * 4, 10, Default::default()))
}
fn train(data: &Digits, epochs: usize) -> Result<f64> {
    let accelerator = ::accel_core::Accelerator::builder()
        .accumulate(1)
        .seed(0)
        .cpu(true)
        .attribute_data_loops(1usize)
        .attribute_call(concat!("`train`", " at ", file!(), ":", line!()))
        .build()?;
    let __accel_exit = accelerator.exit_guard();
    let __accel_result: Result<f64> = (|| {
        use Device as _;
        use OptimizerConfig as _;
        let device = accelerator.device();
        let vs = nn::VarStore::new(device);
        let net = cnn(&vs.root());
        let mut opt = accelerator.build_optimizer(nn::AdamW::default(), &vs, 3e-3)?;
        for _epoch in 0..epochs {
            for (x, y) in accelerator
                .prepare_iter(
                    tch::data::Iter2::new(&data.train_x, &data.train_y, 32).shuffle(),
                )
            {
                let __accel_autocast = accelerator.autocast_step()?;
                let loss = net
                    .forward_t(&x.to_device(device), true)
                    .cross_entropy_for_logits(&y.to_device(device));
                opt.zero_grad()?;
                accelerator.backward(&loss)?;
                opt.step()?;
            }
        }
        accelerator.attribute_summon()?;
        let logits = tch::no_grad(|| {
            net.forward_t(&data.test_x.to_device(device), false)
        });
        let right = logits.argmax(-1, false).eq_tensor(&data.test_y.to_device(device));
        Ok(right.to_kind(Kind::Float).mean(Kind::Float).double_value(&[]))
    })();
    if __accel_result.is_ok() {
        __accel_exit.finish()?;
    }
    __accel_result
}
fn main() -> Result<()> {
    let data = Digits::load(Device::Cpu)?;
    let accuracy = train(&data, 12)?;
    println!("test accuracy {:.2}% (target 97%)", 100.0 * accuracy);
    anyhow::ensure!(accuracy >= 0.97, "below the target");
    Ok(())
}
