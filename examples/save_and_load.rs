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

#[accel_core::accelerate(strategy = "ddp", seed = 0, cpu = true)]
fn train(data: &Digits, path: &str, epochs: usize) -> Result<f64> {
    let vs = nn::VarStore::new(Device::Cpu);
    let model = net(&vs.root());
    let mut opt = nn::Sgd::default().build(&vs, 0.1)?;
    for _epoch in 0..epochs {
        for (x, y) in tch::data::Iter2::new(&data.train_x, &data.train_y, 32) {
            let loss = model.forward(&x).cross_entropy_for_logits(&y);
            opt.zero_grad();
            loss.backward();
            opt.step();
        }
        vs.save(path)?;
    }
    // Evaluate what was saved, as a separate program would: a fresh model from the file.
    let mut saved = nn::VarStore::new(Device::Cpu);
    let evaluated = net(&saved.root());
    saved.load(path)?;
    let trained = vs.variables();
    for (name, tensor) in saved.variables() {
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
    Ok(logits
        .argmax(-1, false)
        .eq_tensor(&data.test_y)
        .to_kind(Kind::Float)
        .mean(Kind::Float)
        .double_value(&[]))
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
