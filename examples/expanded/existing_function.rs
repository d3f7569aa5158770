//! "Your existing function": an ordinary tch training loop with one line added on top.
//! examples/existing_function_plain.rs is the same file without that line (a test keeps
//! the two in step), the single-device program it started as.
//!
//! One process:    cargo run -p accel-examples --example existing_function
//! Two processes:  accel launch --num-processes 2 target/debug/examples/existing_function
//! See what the attribute generates: cargo expand -p accel-examples --example existing_function
use accel_examples::Digits;
use anyhow::Result;
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Tensor};
fn train(
    x: &Tensor,
    y: &Tensor,
    epochs: usize,
    batch_size: i64,
    out: &str,
) -> Result<f64> {
    let accelerator = ::accel_core::Accelerator::builder()
        .strategy(::accel_core::Strategy::Ddp)
        .accumulate(2)
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
        let net = nn::seq()
            .add(
                accelerator
                    .unit(
                        vs.root() / "layers" / 0,
                        |__accel_path| nn::linear(
                            __accel_path,
                            64,
                            128,
                            Default::default(),
                        ),
                    ),
            )
            .add_fn(|x| x.relu())
            .add(
                accelerator
                    .unit(
                        vs.root() / "layers" / 1,
                        |__accel_path| nn::linear(
                            __accel_path,
                            128,
                            10,
                            Default::default(),
                        ),
                    ),
            );
        let mut opt = accelerator.build_optimizer(nn::AdamW::default(), &vs, 3e-3)?;
        let mut last = f64::NAN;
        for _epoch in 0..epochs {
            for (xb, yb) in accelerator
                .prepare_iter(tch::data::Iter2::new(x, y, batch_size))
            {
                let __accel_autocast = accelerator.autocast_step()?;
                let logits = net.forward(&xb.to_device(device));
                let loss = logits.cross_entropy_for_logits(&yb.to_device(device));
                opt.zero_grad()?;
                accelerator.backward(&loss)?;
                opt.step()?;
                last = loss.double_value(&[]);
            }
        }
        if !out.is_empty() {
            accelerator.save_varstore(&vs, out)?;
        }
        Ok(last)
    })();
    if __accel_result.is_ok() {
        __accel_exit.finish()?;
    }
    __accel_result
}
/// `--epochs N`, `--batch-size B`, `--samples S` (the first S training images), `--out F`
/// (final weights, written by the main process).
fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let flag = |name: &str, default: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
            .unwrap_or(default.to_owned())
    };
    let data = Digits::load(Device::Cpu)?;
    let samples: i64 = flag("--samples", "1437").parse()?;
    let (x, y) = (
        data.train_x.narrow(0, 0, samples),
        data.train_y.narrow(0, 0, samples),
    );
    let out = flag("--out", "");
    let last = train(
        &x,
        &y,
        flag("--epochs", "10").parse()?,
        flag("--batch-size", "32").parse()?,
        &out,
    )?;
    println!("final training loss {last:.4}");
    anyhow::ensure!(last.is_finite(), "the loss is {last}");
    Ok(())
}
