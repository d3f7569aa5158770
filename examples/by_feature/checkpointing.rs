//! By feature: checkpoint and resume. `save_checkpoint` writes the model, optimizer,
//! schedule, step counters, data position and every RNG state after each epoch; with
//! `--resume` the run continues from the newest one, mid-epoch included, exactly as if it
//! had not stopped. `--stop-after N` ends the run after N batches, to try it.
//!
//!     cargo run -p accel-examples --example checkpointing -- --stop-after 30
//!     cargo run -p accel-examples --example checkpointing -- --resume

use accel_core::Accelerator;
use accel_core::data::{DataLoader, LoaderOptions, Sampler, TensorDataset};
use accel_core::optim::{AdamConfig, AdamW};
use accel_examples::Digits;
use anyhow::Result;
use tch::nn::{self, Module};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let resume = args.iter().any(|a| a == "--resume");
    let stop_after: Option<u64> = args
        .iter()
        .position(|a| a == "--stop-after")
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok());
    let dir =
        std::env::var("CHECKPOINT_DIR").unwrap_or_else(|_| "target/by-feature-checkpoints".into());
    let acc = Accelerator::builder().seed(0).cpu(true).checkpoints(&dir, Some(3)).build()?;
    let data = Digits::load(acc.device())?;
    let vs = nn::VarStore::new(acc.device());
    let net = nn::linear(vs.root() / "classifier", 64, 10, Default::default());
    acc.prepare_model(&vs)?;
    let mut opt = acc.prepare_optimizer(AdamW::new(
        acc.params(&vs),
        AdamConfig { lr: 1e-2, ..AdamConfig::adamw() },
    )?);
    let options = LoaderOptions {
        batch_size: 32,
        sampler: Sampler::Shuffled { seed: 0 },
        ..Default::default()
    };
    let mut loader = acc.prepare_loader(DataLoader::new(
        TensorDataset::new(vec![data.train_x, data.train_y])?,
        options,
    )?)?;
    if resume && let Some(from) = acc.load_latest_checkpoint()? {
        acc.print(format!("resumed from {} at epoch {}", from.display(), loader.epoch()));
    }
    for _ in loader.epoch()..3 {
        for batch in loader.iter() {
            let batch = batch?;
            let loss = net.forward(&batch[0]).cross_entropy_for_logits(&batch[1]);
            acc.backward(&loss)?;
            opt.step()?;
            opt.zero_grad()?;
            if stop_after == Some(acc.counters().micro_steps_total) {
                let saved = acc.save_checkpoint()?;
                acc.print(format!(
                    "stopped after {} batches; saved {}",
                    acc.counters().micro_steps_total,
                    saved.display()
                ));
                return Ok(());
            }
        }
        acc.save_checkpoint()?;
    }
    acc.print(format!("finished: {} batches in all", acc.counters().micro_steps_total));
    Ok(())
}
