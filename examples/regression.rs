//! Accelerate's own correctness model: y = 2x + 3 + noise, fitted by `y = a·x + b` with
//! SGD (lr 0.1) for 3 epochs. One process with batch 8·N and N processes with batch 8 must
//! end with the same a and b (examples/tests/parity.rs checks it to 1e-6).
//!
//! One process:    cargo run -p accel-examples --example regression -- --batch-size 16
//! Two processes:  accel launch --num-processes 2 target/debug/examples/regression --batch-size 8

use std::path::PathBuf;

use accel_core::data::{DataLoader, LoaderOptions, TensorDataset};
use accel_core::optim::{Sgd, SgdConfig, named_params};
use accel_core::{Accelerator, Precision};
use anyhow::Result;
use clap::Parser;
use tch::nn::{self, Init};
use tch::{Device, Kind, Tensor};

/// Fit y = 2x + 3.
#[derive(Debug, Parser)]
struct Args {
    /// Batch size per process (the whole batch with --split-batches).
    #[arg(long, default_value_t = 16)]
    batch_size: usize,
    /// Micro-batches per optimizer step.
    #[arg(long, default_value_t = 1)]
    accumulate: u32,
    /// Cut each batch across the processes.
    #[arg(long)]
    split_batches: bool,
    /// Mixed precision.
    #[arg(long, default_value = "no")]
    precision: Precision,
    /// Samples.
    #[arg(long, default_value_t = 64)]
    samples: i64,
    /// Where rank 0 writes `{"a": .., "b": ..}`.
    #[arg(long)]
    out: Option<PathBuf>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let acc = Accelerator::builder()
        .accumulate(args.accumulate)
        .precision(args.precision)
        .cpu(true)
        .build()?;
    // The same data on every process (seeded), as Accelerate's RegressionDataset.
    tch::manual_seed(42);
    let x = Tensor::randn([args.samples, 1], (Kind::Float, Device::Cpu));
    let y = &x * 2.0 + 3.0 + Tensor::randn([args.samples, 1], (Kind::Float, Device::Cpu)) * 0.1;

    let vs = nn::VarStore::new(Device::Cpu);
    let a = vs.root().var("a", &[1], Init::Const(0.0));
    let b = vs.root().var("b", &[1], Init::Const(0.0));
    acc.prepare_model(&vs)?;
    let mut opt = acc.prepare_optimizer(Sgd::new(
        named_params(&vs),
        SgdConfig { lr: 0.1, ..Default::default() },
    )?);
    let options = LoaderOptions {
        batch_size: args.batch_size,
        split_batches: args.split_batches,
        prefetch: 0,
        ..Default::default()
    };
    let mut loader =
        acc.prepare_loader(DataLoader::new(TensorDataset::new(vec![x, y])?, options)?)?;
    for _epoch in 0..3 {
        for batch in loader.iter() {
            let batch = batch?;
            let prediction = acc.forward(|| &batch[0] * &a + &b)?;
            let loss = prediction.mse_loss(&batch[1], tch::Reduction::Mean);
            acc.backward(&loss)?;
            opt.step()?;
            opt.zero_grad()?;
        }
    }
    let (a, b) = (a.double_value(&[0]), b.double_value(&[0]));
    acc.print(format!("a = {a:.6}, b = {b:.6} (target 2, 3)"));
    if let (Some(out), true) = (&args.out, acc.is_main_process()) {
        std::fs::write(out, serde_json::json!({ "a": a, "b": b }).to_string())?;
    }
    acc.wait_for_everyone()?;
    Ok(())
}
