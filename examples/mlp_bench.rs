//! The speed benchmark's accel side: MLP 784-1024-1024-10, batch 64 per process, AdamW,
//! fp32, one thread per process, 400 batches of random data in all (as
//! python/reference/accelerate_mlp.py does with Accelerate). `cargo xtask bench` runs both.
//!
//! One process:    target/release/examples/mlp_bench
//! Two processes:  target/release/accel launch --num-processes 2 target/release/examples/mlp_bench
//!
//! `--batch-norm` puts a batch norm after each hidden layer (buffers: 4096 running
//! statistics, broadcast after every step); `--no-broadcast-buffers` leaves them per process,
//! for the cost of keeping them equal.

use accel_core::Accelerator;
use accel_core::data::{DataLoader, LoaderOptions, TensorDataset};
use accel_core::optim::{AdamConfig, AdamW};
use anyhow::Result;
use tch::nn::{self, ModuleT};
use tch::{Device, Kind, Tensor};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let batch_norm = args.iter().any(|a| a == "--batch-norm");
    let broadcast = !args.iter().any(|a| a == "--no-broadcast-buffers");
    let acc = Accelerator::builder().seed(0).cpu(true).broadcast_buffers(broadcast).build()?;
    tch::set_num_threads(1);
    let x = Tensor::randn([64 * 400, 784], (Kind::Float, Device::Cpu));
    let y = Tensor::randint(10, [64 * 400], (Kind::Int64, Device::Cpu));
    let vs = nn::VarStore::new(Device::Cpu);
    let root = vs.root();
    let mut net = nn::seq_t();
    for (i, (n_in, n_out)) in [(784, 1024), (1024, 1024)].into_iter().enumerate() {
        net = net.add(nn::linear(&root / "layers" / i, n_in, n_out, Default::default()));
        if batch_norm {
            net = net.add(nn::batch_norm1d(&root / "norms" / i, n_out, Default::default()));
        }
        net = net.add_fn(|x| x.relu());
    }
    let net = net.add(nn::linear(&root / "layers" / 2, 1024, 10, Default::default()));
    acc.prepare_model(&vs)?;
    let mut opt = acc.prepare_optimizer(AdamW::new(
        acc.params(&vs),
        AdamConfig { lr: 1e-3, ..AdamConfig::adamw() },
    )?);
    let options = LoaderOptions { batch_size: 64, prefetch: 2, ..Default::default() };
    let mut loader =
        acc.prepare_loader(DataLoader::new(TensorDataset::new(vec![x, y])?, options)?)?;
    let started = std::time::Instant::now();
    let (mut steps, mut last) = (0u64, 0.0);
    for batch in loader.iter() {
        let batch = batch?;
        let loss = net.forward_t(&batch[0], true).cross_entropy_for_logits(&batch[1]);
        acc.backward(&loss)?;
        opt.step()?;
        opt.zero_grad()?;
        steps += 1;
        last = loss.double_value(&[]);
    }
    acc.wait_for_everyone()?;
    let seconds = started.elapsed().as_secs_f64();
    // Peak resident memory of this process (the main one's is printed).
    let peak = accel_examples::proc_status_bytes("VmHWM:").unwrap_or(0.0);
    acc.print(format!(
        "procs={} steps_per_proc={steps} samples_per_s={:.1} peak_rss_mib={:.0} loss={last:.4}",
        acc.num_processes(),
        (steps * 64 * acc.num_processes() as u64) as f64 / seconds,
        peak / (1024.0 * 1024.0)
    ));
    Ok(())
}
