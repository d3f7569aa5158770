//! The data loader's workers against a slow data set: each sample costs `--sample-us` of
//! CPU work (standing for decoding or augmentation), and a small MLP trains on the batches.
//! For each number of workers, one epoch's time and how much of it the training loop spent
//! waiting for data. `cargo xtask bench loader` runs it.
//!
//!     target/release/examples/loader_bench --workers 0,1,2,4

use std::time::{Duration, Instant};

use accel_core::Accelerator;
use accel_core::data::{DataLoader, LoaderOptions, MapDataset, Sampler, stack};
use accel_core::optim::{Sgd, SgdConfig, named_params};
use anyhow::Result;
use clap::Parser;
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

#[derive(Parser)]
struct Args {
    /// Numbers of workers to measure, in turn (0: the one background thread).
    #[arg(long, value_delimiter = ',', default_value = "0,1,2,4")]
    workers: Vec<usize>,
    /// Samples in the epoch.
    #[arg(long, default_value_t = 1024)]
    samples: usize,
    /// Samples per batch.
    #[arg(long, default_value_t = 32)]
    batch: usize,
    /// CPU time each sample costs to make, in microseconds.
    #[arg(long, default_value_t = 100)]
    sample_us: u64,
    /// The MLP's hidden width (the step's cost).
    #[arg(long, default_value_t = 2048)]
    hidden: i64,
}

/// Sample `i`: 256 values, made with about `cost` of arithmetic first (what decoding an image
/// or augmenting it would cost).
fn sample(i: usize, cost: Duration) -> Tensor {
    let started = Instant::now();
    let mut x = i as u64 | 1;
    while started.elapsed() < cost {
        for _ in 0..256 {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        }
    }
    let seed = (x % 1000) as f64 / 1000.0;
    Tensor::arange(256, (Kind::Float, Device::Cpu)) * seed / 256.0
}

fn main() -> Result<()> {
    let args = Args::parse();
    tch::set_num_threads(1);
    let acc = Accelerator::builder().cpu(true).build()?;
    let vs = nn::VarStore::new(Device::Cpu);
    let net = nn::seq()
        .add(nn::linear(vs.root() / "l0", 256, args.hidden, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(vs.root() / "l1", args.hidden, 10, Default::default()));
    acc.prepare_model(&vs)?;
    let sgd = Sgd::new(named_params(&vs), SgdConfig { lr: 0.01, ..Default::default() })?;
    let mut opt = acc.prepare_optimizer(sgd);
    println!(
        "{:>8} {:>10} {:>12} {:>8}   ({} samples of {} us each, batch {})",
        "workers", "epoch s", "waiting s", "waiting", args.samples, args.sample_us, args.batch
    );
    for &workers in &args.workers {
        let cost = Duration::from_micros(args.sample_us);
        let dataset = MapDataset::new(args.samples, move |i| Ok(sample(i, cost)), stack);
        let options = LoaderOptions {
            batch_size: args.batch,
            sampler: Sampler::Shuffled { seed: 1 },
            num_workers: workers,
            ..Default::default()
        };
        let mut loader = acc.prepare_loader(DataLoader::new(dataset, options)?)?;
        let (started, mut waiting) = (Instant::now(), Duration::ZERO);
        let mut batches = loader.iter();
        loop {
            let asked = Instant::now();
            let Some(batch) = batches.next() else { break };
            waiting += asked.elapsed();
            let x = batch?;
            let loss = acc.forward(|| net.forward(&x))?.square().mean(Kind::Float);
            acc.backward(&loss)?;
            opt.step()?;
            opt.zero_grad()?;
        }
        let epoch = started.elapsed().as_secs_f64();
        let waited = waiting.as_secs_f64();
        println!(
            "{workers:>8} {epoch:>10.2} {waited:>12.2} {:>7.0}%",
            100.0 * waited / epoch.max(1e-9)
        );
    }
    Ok(())
}
