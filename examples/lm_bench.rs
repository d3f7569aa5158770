//! The speed benchmark's transformer, accel side: the `char_lm` model (4 blocks of width
//! 128, 4 heads, context 64, vocabulary 72, 0.8M parameters), batch 16 of random tokens,
//! AdamW, fp32, one thread, 20 warm-up steps then 100 timed ones (as
//! python/reference/accelerate_lm.py does with Accelerate). `cargo xtask bench` runs both.
//!
//!     target/release/examples/lm_bench

use accel_core::Accelerator;
use accel_core::optim::{AdamConfig, AdamW};
use accel_examples::gpt::{Gpt, GptConfig};
use anyhow::Result;
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

const BATCH: i64 = 16;
const WARMUP: usize = 20;
const STEPS: usize = 100;

fn main() -> Result<()> {
    let acc = Accelerator::builder().seed(0).cpu(true).build()?;
    tch::set_num_threads(1);
    let config = GptConfig { vocab: 72, context: 64, width: 128, blocks: 4, heads: 4, seed: 0 };
    let vs = nn::VarStore::new(Device::Cpu);
    let model = Gpt::new(&vs.root(), &config)?;
    acc.prepare_model(&vs)?;
    let mut opt = acc.prepare_optimizer(AdamW::new(
        acc.params(&vs),
        AdamConfig { lr: 1e-3, ..AdamConfig::adamw() },
    )?);
    let ids =
        Tensor::randint(config.vocab, [BATCH, config.context + 1], (Kind::Int64, Device::Cpu));
    let (x, y) = (ids.narrow(1, 0, config.context), ids.narrow(1, 1, config.context));
    let mut step = || -> Result<f64> {
        let logits = acc.forward(|| model.forward(&x))?;
        let loss = logits.view([-1, config.vocab]).cross_entropy_for_logits(&y.reshape([-1]));
        acc.backward(&loss)?;
        opt.step()?;
        opt.zero_grad()?;
        Ok(loss.double_value(&[]))
    };
    for _ in 0..WARMUP {
        step()?;
    }
    let started = std::time::Instant::now();
    let mut last = 0.0;
    for _ in 0..STEPS {
        last = step()?;
    }
    let seconds = started.elapsed().as_secs_f64();
    let peak = accel_examples::proc_status_bytes("VmHWM:").unwrap_or(0.0);
    acc.print(format!(
        "steps={STEPS} samples_per_s={:.1} step_ms={:.2} peak_rss_mib={:.0} loss={last:.4}",
        (STEPS as i64 * BATCH) as f64 / seconds,
        1e3 * seconds / STEPS as f64,
        peak / (1024.0 * 1024.0)
    ));
    Ok(())
}
