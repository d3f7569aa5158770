//! A file the function writes, then reads on every process: `vs.save(path)` at the end of
//! each epoch, and after training a fresh model loaded from `path` on every process to be
//! evaluated — the shape in which one process always reads what it wrote, and several
//! processes must too. Under `#[accelerate]` the main process writes the file and every
//! process waits for it, so each loads the last epoch's weights, never an earlier one's.
//! The program checks that and fails, naming the process, if a load saw other weights.
//!
//! One process:    cargo run -p accel-examples --example save_and_load -- target/model.ot
//! Two processes:  accel launch --num-processes 2 target/debug/examples/save_and_load \
//!                     target/model.ot
use accel_examples::Digits;
use anyhow::{Result, bail};
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind};
fn net(root: &nn::Path) -> nn::Sequential {
    nn::seq()
        .add(nn::linear(root / "fc1", 64, 32, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(root / "fc2", 32, 10, Default::default()))
}
fn train(data: &Digits, path: &str, epochs: usize) -> Result<f64> {
    let accelerator = ::accel_core::Accelerator::builder()
        .strategy(::accel_core::Strategy::Ddp)
        .seed(0)
        .cpu(true)
        .attribute_data_loops(1usize)
        .attribute_call(concat!("`train`", " at ", file!(), ":", line!()))
        .build()?;
    let __accel_exit = accelerator.exit_guard();
    let __accel_result: Result<f64> = (|| {
        use OptimizerConfig as _;
        let vs = nn::VarStore::new(Device::Cpu);
        let model = net(&vs.root());
        let mut opt = accelerator.build_optimizer(nn::Sgd::default(), &vs, 0.1)?;
        for _epoch in 0..epochs {
            for (x, y) in accelerator
                .prepare_iter(tch::data::Iter2::new(&data.train_x, &data.train_y, 32))
            {
                let __accel_autocast = accelerator.autocast_step()?;
                let loss = model.forward(&x).cross_entropy_for_logits(&y);
                opt.zero_grad()?;
                accelerator.backward(&loss)?;
                opt.step()?;
            }
            accelerator.save_varstore(&vs, path)?;
        }
        let mut saved = nn::VarStore::new(Device::Cpu);
        accelerator.attribute_summon()?;
        let evaluated = net(&saved.root());
        accelerator.load_varstore(&mut saved, path)?;
        let trained = accelerator.variables(&vs);
        for (name, tensor) in accelerator.variables(&saved) {
            let diff = (&tensor - &trained[&name]).abs().max().double_value(&[]);
            if diff > 0.0 {
                bail!(
                    "process {}: `{name}` loaded from {path} differs from the trained one by {diff}: \
                 the file was not the last epoch's",
                    accelerator.process_index()
                );
            }
        }
        let logits = evaluated.forward(&data.test_x);
        Ok(
            logits
                .argmax(-1, false)
                .eq_tensor(&data.test_y)
                .to_kind(Kind::Float)
                .mean(Kind::Float)
                .double_value(&[]),
        )
    })();
    if __accel_result.is_ok() {
        __accel_exit.finish()?;
    }
    __accel_result
}
/// `save_and_load PATH [EPOCHS]`.
fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let Some(path) = args.get(1) else { bail!("usage: save_and_load PATH [EPOCHS]") };
    let epochs = args.get(2).map_or(Ok(3), |e| e.parse())?;
    let data = Digits::load(Device::Cpu)?;
    let accuracy = train(&data, path, epochs)?;
    println!("test accuracy of the saved model {accuracy:.3}");
    Ok(())
}
