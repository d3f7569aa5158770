//! The speed benchmark's transformer, accel side: the `char_lm` model (by default 4 blocks
//! of width 128, 4 heads, context 64, vocabulary 72, 0.8M parameters), batch 16 of random
//! tokens, AdamW, one thread on CPU, 20 warm-up steps then 100 timed ones (as
//! python/reference/accelerate_lm.py does with Accelerate, given the same flags).
//! `cargo xtask bench` runs both; scripts/gpu-check.sh runs both on a GPU at width 2048.
//!
//!     target/release/examples/lm_bench [--precision no|bf16|fp8] [--width 2048 --heads 16 --device cuda]

use accel_core::optim::{AdamConfig, AdamW};
use accel_core::{Accelerator, Precision};
use accel_examples::gpt::{Gpt, GptConfig};
use anyhow::Result;
use clap::Parser;
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

const WARMUP: usize = 20;

/// Time training steps of the GPT-style model.
#[derive(Debug, Parser)]
struct Args {
    /// Mixed precision.
    #[arg(long, default_value = "no")]
    precision: Precision,
    /// Model width.
    #[arg(long, default_value_t = 128)]
    width: i64,
    /// Transformer blocks.
    #[arg(long, default_value_t = 4)]
    blocks: i64,
    /// Attention heads.
    #[arg(long, default_value_t = 4)]
    heads: i64,
    /// Sequence length.
    #[arg(long, default_value_t = 64)]
    context: i64,
    /// Sequences per step.
    #[arg(long, default_value_t = 16)]
    batch: i64,
    /// Timed steps.
    #[arg(long, default_value_t = 100)]
    steps: usize,
    /// `cpu` (one thread) or `cuda` (cuda:0).
    #[arg(long, default_value = "cpu")]
    device: String,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let cpu = args.device == "cpu";
    let acc = Accelerator::builder().precision(args.precision).seed(0).cpu(cpu).build()?;
    if cpu {
        tch::set_num_threads(1);
    } else {
        anyhow::ensure!(acc.device() != Device::Cpu, "--device {}: no GPU is visible", args.device);
    }
    let config = GptConfig {
        vocab: 72,
        context: args.context,
        width: args.width,
        blocks: args.blocks,
        heads: args.heads,
        seed: 0,
    };
    let vs = nn::VarStore::new(acc.device());
    // The accelerator's tensor-parallel handle (one rank here) carries fp8 to the layers.
    let model = Gpt::stage(&vs.root(), &config, &acc.tensor_parallel(), 0..config.layers())?;
    acc.prepare_model(&vs)?;
    let mut opt = acc.prepare_optimizer(AdamW::new(
        acc.params(&vs),
        AdamConfig { lr: 1e-3, ..AdamConfig::adamw() },
    )?);
    let ids =
        Tensor::randint(config.vocab, [args.batch, config.context + 1], (Kind::Int64, Device::Cpu))
            .to_device(acc.device());
    let (x, y) = (ids.narrow(1, 0, config.context), ids.narrow(1, 1, config.context));
    let mut step = || -> Result<Tensor> {
        let logits = acc.forward(|| model.forward(&x))?;
        let loss = logits.view([-1, config.vocab]).cross_entropy_for_logits(&y.reshape([-1]));
        acc.backward(&loss)?;
        opt.step()?;
        opt.zero_grad()?;
        Ok(loss)
    };
    for _ in 0..WARMUP {
        let _ = step()?;
    }
    // The loss's value is read once at the end: reading it each step would wait for the GPU.
    let sync = |t: &Tensor| t.double_value(&[]);
    sync(&step()?);
    let started = std::time::Instant::now();
    let mut last = Tensor::zeros([], (Kind::Float, Device::Cpu));
    for _ in 0..args.steps {
        last = step()?;
    }
    let last = sync(&last);
    let seconds = started.elapsed().as_secs_f64();
    let peak = accel_examples::proc_status_bytes("VmHWM:").unwrap_or(0.0);
    acc.print(format!(
        "steps={} samples_per_s={:.1} step_ms={:.2} peak_rss_mib={:.0} loss={last:.4}",
        args.steps,
        (args.steps as i64 * args.batch) as f64 / seconds,
        1e3 * seconds / args.steps as f64,
        peak / (1024.0 * 1024.0)
    ));
    Ok(())
}
