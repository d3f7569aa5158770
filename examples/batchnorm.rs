//! A model with batch norm trained data-parallel with plain SGD, from files, so that its
//! every variable — weights and running statistics — can be compared with PyTorch +
//! Accelerate's (python/reference/batchnorm_accelerate.py; examples/tests/parity.rs).
//!
//! `--model mlp` is 6 → 16 → batch norm 1d → tanh → 3; `--model conv` is a 3×3 convolution
//! to 4 channels on 1×6×6 inputs → batch norm 2d → relu → 3. `W.safetensors` holds torch's
//! names (`fc1.weight`, `bn1.running_mean`, ...); `D.safetensors` holds `x` and `y`. Every
//! process writes all its variables to `OUT/rank{r}.safetensors`. `--sync-batchnorm`
//! computes the statistics over every process's batch (torch's SyncBatchNorm).
//!
//! One process:    cargo run -p accel-examples --example batchnorm -- --init W.safetensors \
//!                     --data D.safetensors --out-dir out
//! Two processes:  accel launch --num-processes 2 target/debug/examples/batchnorm --init ...

use std::path::PathBuf;

use accel_core::data::{DataLoader, LoaderOptions, TensorDataset};
use accel_core::optim::{Sgd, SgdConfig, named_params};
use accel_core::{Accelerator, Strategy};
use anyhow::{Context, Result};
use clap::Parser;
use tch::Tensor;
use tch::nn::{self, ModuleT};

/// Train a batch-norm model from W and D files.
#[derive(Debug, Parser)]
struct Args {
    /// `mlp` (batch norm 1d) or `conv` (batch norm 2d).
    #[arg(long, default_value = "mlp", value_parser = ["mlp", "conv"])]
    model: String,
    /// Initial variables.
    #[arg(long)]
    init: PathBuf,
    /// Training data.
    #[arg(long)]
    data: PathBuf,
    /// Strategy.
    #[arg(long, default_value = "ddp")]
    strategy: Strategy,
    /// Batch norm statistics over every process's batch.
    #[arg(long)]
    sync_batchnorm: bool,
    /// Keep buffers as each process computes them (torch's `broadcast_buffers=False`).
    #[arg(long)]
    no_broadcast_buffers: bool,
    /// Batch size per process.
    #[arg(long, default_value_t = 8)]
    batch_size: usize,
    /// Micro-batches per optimizer step.
    #[arg(long, default_value_t = 1)]
    accumulate: u32,
    /// Passes over the data.
    #[arg(long, default_value_t = 2)]
    epochs: u64,
    /// Learning rate.
    #[arg(long, default_value_t = 0.1)]
    lr: f64,
    /// Where every process writes `rank{r}.safetensors`.
    #[arg(long)]
    out_dir: PathBuf,
    /// After training: `save_state` into this folder, scramble every variable on every
    /// process (differently on each), `load_state` it back; what is written is what the
    /// load restored.
    #[arg(long)]
    state: Option<PathBuf>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let acc = Accelerator::builder()
        .cpu(true)
        .strategy(args.strategy)
        .accumulate(args.accumulate)
        .sync_batchnorm(args.sync_batchnorm)
        .broadcast_buffers(!args.no_broadcast_buffers)
        .build()?;
    let mut vs = nn::VarStore::new(acc.device());
    let root = vs.root();
    let bn = Default::default();
    let net = if args.model == "mlp" {
        nn::seq_t()
            .add(nn::linear(&root / "fc1", 6, 16, Default::default()))
            .add(acc.batch_norm1d(&root / "bn1", 16, bn))
            .add_fn(|x| x.tanh())
            .add(nn::linear(&root / "fc2", 16, 3, Default::default()))
    } else {
        let conv = nn::ConvConfig { padding: 1, ..Default::default() };
        nn::seq_t()
            .add(nn::conv2d(&root / "conv1", 1, 4, 3, conv))
            .add(acc.batch_norm2d(&root / "bn1", 4, bn))
            .add_fn(|x| x.relu().flatten(1, -1))
            .add(nn::linear(&root / "fc2", 4 * 6 * 6, 3, Default::default()))
    };
    vs.load(&args.init).with_context(|| format!("reading {}", args.init.display()))?;
    acc.prepare_model(&vs)?;
    let config = SgdConfig { lr: args.lr, ..Default::default() };
    let mut opt = acc.prepare_optimizer(Sgd::new(named_params(&vs), config)?);

    let data: std::collections::HashMap<String, Tensor> =
        Tensor::read_safetensors(&args.data)?.into_iter().collect();
    let (x, y) = (&data["x"], &data["y"]);
    let dataset = TensorDataset::new(vec![x.shallow_clone(), y.shallow_clone()])?;
    let options = LoaderOptions { batch_size: args.batch_size, ..Default::default() };
    let mut loader = acc.prepare_loader(DataLoader::new(dataset, options)?)?;
    for _ in 0..args.epochs {
        for batch in loader.iter() {
            let batch = batch?;
            let logits = acc.forward(|| net.forward_t(&batch[0], true))?;
            acc.backward(&logits.cross_entropy_for_logits(&batch[1]))?;
            opt.step()?;
            opt.zero_grad()?;
        }
    }
    if let Some(dir) = &args.state {
        acc.save_state(dir)?;
        tch::no_grad(|| {
            for (_, mut var) in vs.variables() {
                let _ = var.fill_(1.0 + acc.process_index() as f64);
            }
        });
        acc.load_state(dir)?;
    }
    std::fs::create_dir_all(&args.out_dir)?;
    let mut all: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    all.sort_by(|a, b| a.0.cmp(&b.0));
    let path = args.out_dir.join(format!("rank{}.safetensors", acc.process_index()));
    Tensor::write_safetensors(&all, path)?;
    acc.end_training()?;
    Ok(())
}
