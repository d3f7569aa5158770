//! The speed benchmark's transformer, accel side: the `char_lm` model (by default 4 blocks
//! of width 128, 4 heads, context 64, vocabulary 72, 0.8M parameters), batch 16 of random
//! tokens, AdamW, one thread on CPU, 20 warm-up steps then 100 timed ones (as
//! python/reference/accelerate_lm.py does with Accelerate, given the same flags).
//! `cargo xtask bench` runs both; scripts/gpu-check.sh runs both on a GPU at width 2048.
//!
//!     target/release/examples/lm_bench [--precision no|bf16|fp8] [--width 2048 --heads 16 --device cuda]
//!     target/release/examples/lm_bench --raw      (the limit: the same ATen work, no accelerator)
//!     target/release/examples/lm_bench --attribute (an ordinary tch loop under #[accelerate])
use accel_core::optim::{AdamConfig, AdamW};
use accel_core::{Accelerator, Precision};
use accel_examples::gpt::{Gpt, GptConfig};
use accel_examples::raw::RawAdamW;
use anyhow::Result;
use clap::Parser;
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};
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
    /// Untimed steps first.
    #[arg(long, default_value_t = 20)]
    warmup: usize,
    /// `cpu` (one thread) or `cuda` (cuda:0).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// The same ATen work with no accelerator: tch's forward and backward, ATen's fused
    /// AdamW (fp32, CPU).
    #[arg(long, conflicts_with = "attribute")]
    raw: bool,
    /// The step as an ordinary tch loop with `#[accelerate]` on it (fp32, CPU).
    #[arg(long)]
    attribute: bool,
}
impl Args {
    fn config(&self) -> GptConfig {
        GptConfig {
            vocab: 72,
            context: self.context,
            width: self.width,
            blocks: self.blocks,
            heads: self.heads,
            seed: 0,
        }
    }
    /// `steps=.. samples_per_s=.. step_ms=.. peak_rss_mib=.. loss=..`.
    fn report(&self, seconds: f64, last: f64) -> String {
        let peak = accel_examples::proc_status_bytes("VmHWM:").unwrap_or(0.0);
        format!(
            "steps={} samples_per_s={:.1} step_ms={:.2} peak_rss_mib={:.0} loss={last:.4}",
            self.steps, (self.steps as i64 * self.batch) as f64 / seconds, 1e3 * seconds
            / self.steps as f64, peak / (1024.0 * 1024.0)
        )
    }
    /// The random batch every mode trains on.
    fn batch(&self, device: Device) -> (Tensor, Tensor) {
        let c = self.config();
        let ids = Tensor::randint(
                c.vocab,
                [self.batch, c.context + 1],
                (Kind::Int64, Device::Cpu),
            )
            .to_device(device);
        (ids.narrow(1, 0, c.context), ids.narrow(1, 1, c.context))
    }
}
/// Times `step`: warm-up, then `steps` timed; returns (seconds, last loss).
fn time(args: &Args, mut step: impl FnMut() -> Result<Tensor>) -> Result<(f64, f64)> {
    for _ in 0..args.warmup {
        let _ = step()?;
    }
    step()?.double_value(&[]);
    let started = std::time::Instant::now();
    let mut last = Tensor::zeros([], (Kind::Float, Device::Cpu));
    for _ in 0..args.steps {
        last = step()?;
    }
    let last = last.double_value(&[]);
    Ok((started.elapsed().as_secs_f64(), last))
}
/// The limit: the model's forward and backward and ATen's fused AdamW, nothing else.
fn raw(args: &Args) -> Result<()> {
    anyhow::ensure!(
        args.precision == Precision::No && args.device == "cpu", "--raw: fp32 on CPU"
    );
    tch::set_num_threads(1);
    accel_core::heap::keep_step_memory()?;
    tch::manual_seed(0);
    let config = args.config();
    let vs = nn::VarStore::new(Device::Cpu);
    let model = Gpt::new(&accel_core::PendingUnits::default(), &vs.root(), &config)?;
    let mut opt = RawAdamW::new(vs.trainable_variables(), 1e-3);
    let (x, y) = args.batch(Device::Cpu);
    let (seconds, last) = time(
        args,
        || {
            let logits = model.forward(&x);
            let loss = logits
                .view([-1, config.vocab])
                .cross_entropy_for_logits(&y.reshape([-1]));
            loss.backward();
            opt.step()?;
            Ok(loss)
        },
    )?;
    println!("{}", args.report(seconds, last));
    Ok(())
}
/// The step as an ordinary tch function under the attribute (its AdamW becomes accel's).
fn annotated(args: &Args) -> Result<(f64, f64)> {
    let accelerator = ::accel_core::Accelerator::builder()
        .seed(0)
        .cpu(true)
        .data(::accel_core::DataSharding::Manual)
        .attribute_data_loops(1usize)
        .attribute_call(concat!("`annotated`", " at ", file!(), ":", line!()))
        .build()?;
    let __accel_exit = accelerator.exit_guard();
    let __accel_result: Result<(f64, f64)> = (|| {
        use OptimizerConfig as _;
        tch::set_num_threads(1);
        let config = args.config();
        let vs = nn::VarStore::new(Device::Cpu);
        let model = Gpt::new(&accelerator, &vs.root(), &config)?;
        let mut opt = accelerator.build_optimizer(nn::AdamW::default(), &vs, 1e-3)?;
        let (x, y) = args.batch(Device::Cpu);
        let mut times = Vec::new();
        let warmup = args.warmup;
        for step in 0..warmup + 1 + args.steps {
            let __accel_autocast = accelerator.autocast_step()?;
            if step == warmup + 1 {
                times.push(std::time::Instant::now());
            }
            let logits = model.forward(&x);
            let loss = logits
                .view([-1, config.vocab])
                .cross_entropy_for_logits(&y.reshape([-1]));
            opt.zero_grad()?;
            accelerator.backward(&loss)?;
            opt.step()?;
            if step + 1 == warmup + 1 + args.steps {
                return Ok((times[0].elapsed().as_secs_f64(), loss.double_value(&[])));
            }
        }
        unreachable!("the loop returns at its last step")
    })();
    if __accel_result.is_ok() {
        __accel_exit.finish()?;
    }
    __accel_result
}
fn main() -> Result<()> {
    let args = Args::parse();
    if args.raw {
        return raw(&args);
    }
    if args.attribute {
        anyhow::ensure!(
            args.precision == Precision::No && args.device == "cpu",
            "--attribute: fp32 on CPU"
        );
        let (seconds, last) = annotated(&args)?;
        println!("{}", args.report(seconds, last));
        return Ok(());
    }
    let cpu = args.device == "cpu";
    let acc = Accelerator::builder().precision(args.precision).seed(0).cpu(cpu).build()?;
    if cpu {
        tch::set_num_threads(1);
    } else {
        anyhow::ensure!(
            acc.device() != Device::Cpu, "--device {}: no GPU is visible", args.device
        );
    }
    let config = args.config();
    let vs = nn::VarStore::new(acc.device());
    let model = Gpt::stage(
        &acc,
        &vs.root(),
        &config,
        &acc.tensor_parallel(),
        0..config.layers(),
    )?;
    acc.prepare_model(&vs)?;
    let mut opt = acc
        .prepare_optimizer(
            AdamW::new(
                acc.params(&vs),
                AdamConfig {
                    lr: 1e-3,
                    ..AdamConfig::adamw()
                },
            )?,
        );
    let (x, y) = args.batch(acc.device());
    let (seconds, last) = time(
        &args,
        || {
            let logits = acc.forward(|| model.forward(&x))?;
            let loss = logits
                .view([-1, config.vocab])
                .cross_entropy_for_logits(&y.reshape([-1]));
            acc.backward(&loss)?;
            opt.step()?;
            opt.zero_grad()?;
            Ok(loss)
        },
    )?;
    acc.print(args.report(seconds, last));
    Ok(())
}
