//! The speed benchmark's MLP: 784-1024-1024-10, batch 64 per process, AdamW, fp32, one
//! thread per process, 400 batches of random data in all (as
//! python/reference/accelerate_mlp.py does with Accelerate). `cargo xtask bench` runs every
//! mode beside Accelerate and prints the ratios.
//!
//! One process:    target/release/examples/mlp_bench [--raw | --attribute]
//! Two processes:  target/release/accel launch --num-processes 2 target/release/examples/mlp_bench
//!
//! The modes: accel's explicit API (the default), `--attribute` (an ordinary tch loop with
//! `#[accelerate]` on it), and `--raw`: the same ATen work with no accelerator (tch's
//! forward and backward, ATen's fused AdamW, one hand-written all-reduce of the flat
//! gradients per step over accel's CPU transport) — the limit accel's step is measured
//! against. `--batches N` changes the 400; `--batch-norm` puts a batch norm after each
//! hidden layer (4096 running statistics, broadcast after every step);
//! `--no-broadcast-buffers` leaves them per process, for the cost of keeping them equal.
use accel_core::Accelerator;
use accel_core::comm::Communicator;
use accel_core::data::{DataLoader, LoaderOptions, TensorDataset};
use accel_core::optim::{AdamConfig, AdamW};
use accel_examples::raw::{RawAdamW, average_gradients, process_group};
use anyhow::{Context, Result};
use tch::nn::{self, ModuleT, OptimizerConfig};
use tch::{Device, Kind, Tensor};
const BATCH: i64 = 64;
fn mlp(root: &nn::Path, batch_norm: bool) -> nn::SequentialT {
    let mut net = nn::seq_t();
    for (i, (n_in, n_out)) in [(784, 1024), (1024, 1024)].into_iter().enumerate() {
        net = net.add(nn::linear(root / "layers" / i, n_in, n_out, Default::default()));
        if batch_norm {
            net = net
                .add(nn::batch_norm1d(root / "norms" / i, n_out, Default::default()));
        }
        net = net.add_fn(|x| x.relu());
    }
    net.add(nn::linear(root / "layers" / 2, 1024, 10, Default::default()))
}
/// What a run measured: steps on this process, seconds, the last loss, the process count,
/// and the pages the kernel faulted in meanwhile.
struct Measured {
    steps: u64,
    seconds: f64,
    loss: f64,
    procs: usize,
    /// Minor page faults of this process during the timed steps after the first.
    faults: u64,
}
/// Page faults from the end of the first step on (the first allocates the gradients and
/// whatever else a step needs for the first time).
#[derive(Default)]
struct StepFaults(Option<u64>);
impl StepFaults {
    /// Called after each step: the first one starts the count.
    fn step_done(&mut self) -> Result<()> {
        if self.0.is_none() {
            self.0 = Some(accel_examples::minor_page_faults()?);
        }
        Ok(())
    }
    /// Faults since the end of the first step.
    fn since_first(&self) -> Result<u64> {
        match self.0 {
            Some(first) => Ok(accel_examples::minor_page_faults()? - first),
            None => Ok(0),
        }
    }
}
fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let flag = |name: &str| args.iter().any(|a| a == name);
    let batches: i64 = match args.iter().position(|a| a == "--batches") {
        Some(i) => args.get(i + 1).context("--batches takes a number")?.parse()?,
        None => 400,
    };
    tch::set_num_threads(1);
    tch::manual_seed(0);
    let x = Tensor::randn([BATCH * batches, 784], (Kind::Float, Device::Cpu));
    let y = Tensor::randint(10, [BATCH * batches], (Kind::Int64, Device::Cpu));
    let measured = if flag("--raw") {
        raw(x, y)?
    } else if flag("--attribute") {
        let batches: Vec<(Tensor, Tensor)> = x
            .split(BATCH, 0)
            .into_iter()
            .zip(y.split(BATCH, 0))
            .collect();
        annotated(batches)?
    } else {
        explicit(x, y, flag("--batch-norm"), !flag("--no-broadcast-buffers"))?
    };
    let peak = accel_examples::proc_status_bytes("VmHWM:").unwrap_or(0.0);
    let rank: usize = std::env::var("RANK")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(0);
    if rank == 0 {
        println!(
            "procs={} steps_per_proc={} samples_per_s={:.1} peak_rss_mib={:.0} loss={:.4} \
             faults_per_step={:.1}",
            measured.procs, measured.steps, (measured.steps * BATCH as u64 * measured
            .procs as u64) as f64 / measured.seconds, peak / (1024.0 * 1024.0), measured
            .loss, measured.faults as f64 / measured.steps.saturating_sub(1).max(1) as
            f64
        );
    }
    Ok(())
}
/// accel's explicit API: prepared model, optimizer (fused AdamW) and loader.
fn explicit(
    x: Tensor,
    y: Tensor,
    batch_norm: bool,
    broadcast: bool,
) -> Result<Measured> {
    let acc = Accelerator::builder()
        .seed(0)
        .cpu(true)
        .broadcast_buffers(broadcast)
        .build()?;
    let vs = nn::VarStore::new(Device::Cpu);
    let net = mlp(&vs.root(), batch_norm);
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
    let options = LoaderOptions {
        batch_size: BATCH as usize,
        prefetch: 2,
        ..Default::default()
    };
    let mut loader = acc
        .prepare_loader(DataLoader::new(TensorDataset::new(vec![x, y])?, options)?)?;
    let started = std::time::Instant::now();
    let mut faults = StepFaults::default();
    let (mut steps, mut loss) = (0u64, 0.0);
    for batch in loader.iter() {
        let batch = batch?;
        let l = net.forward_t(&batch[0], true).cross_entropy_for_logits(&batch[1]);
        acc.backward(&l)?;
        opt.step()?;
        opt.zero_grad()?;
        steps += 1;
        faults.step_done()?;
        loss = l.double_value(&[]);
    }
    acc.wait_for_everyone()?;
    let (seconds, faults) = (started.elapsed().as_secs_f64(), faults.since_first()?);
    Ok(Measured {
        steps,
        seconds,
        loss,
        procs: acc.num_processes(),
        faults,
    })
}
/// An ordinary tch loop with the attribute on it (its AdamW becomes accel's).
fn annotated(batches: Vec<(Tensor, Tensor)>) -> Result<Measured> {
    let accelerator = ::accel_core::Accelerator::builder()
        .seed(0)
        .cpu(true)
        .attribute_data_loops(1usize)
        .attribute_call(concat!("`annotated`", " at ", file!(), ":", line!()))
        .build()?;
    let __accel_exit = accelerator.exit_guard();
    let __accel_result: Result<Measured> = (|| {
        use OptimizerConfig as _;
        let vs = nn::VarStore::new(Device::Cpu);
        let net = mlp(&vs.root(), false);
        let mut opt = accelerator.build_optimizer(nn::AdamW::default(), &vs, 1e-3)?;
        let started = std::time::Instant::now();
        let mut faults = StepFaults::default();
        let (mut steps, mut loss) = (0u64, 0.0);
        for (x, y) in accelerator.prepare_iter(batches) {
            let __accel_autocast = accelerator.autocast_step()?;
            let l = net.forward_t(&x, true).cross_entropy_for_logits(&y);
            opt.zero_grad()?;
            accelerator.backward(&l)?;
            opt.step()?;
            steps += 1;
            faults.step_done()?;
            loss = l.double_value(&[]);
        }
        let seconds = started.elapsed().as_secs_f64();
        let faults = faults.since_first()?;
        Ok(Measured {
            steps,
            seconds,
            loss,
            procs: accelerator.num_processes(),
            faults,
        })
    })();
    if __accel_result.is_ok() {
        __accel_exit.finish()?;
    }
    __accel_result
}
/// The limit: the same work with no accelerator (see examples/raw.rs).
fn raw(x: Tensor, y: Tensor) -> Result<Measured> {
    accel_core::heap::keep_step_memory()?;
    let group = process_group()?;
    let (rank, procs) = group.as_ref().map_or((0, 1), |g| (g.rank(), g.size()));
    tch::manual_seed(0);
    let vs = nn::VarStore::new(Device::Cpu);
    let net = mlp(&vs.root(), false);
    let params = vs.trainable_variables();
    if let Some(group) = &group {
        tch::no_grad(|| params.iter().try_for_each(|p| group.broadcast(p, 0)))?;
    }
    let mut opt = RawAdamW::new(
        params.iter().map(Tensor::shallow_clone).collect(),
        1e-3,
    );
    let (xs, ys) = (x.split(BATCH, 0), y.split(BATCH, 0));
    let started = std::time::Instant::now();
    let mut faults = StepFaults::default();
    let (mut steps, mut loss) = (0u64, 0.0);
    for (x, y) in xs.iter().zip(&ys).skip(rank).step_by(procs) {
        let l = net.forward_t(x, true).cross_entropy_for_logits(y);
        l.backward();
        if let Some(group) = &group {
            average_gradients(group, &params)?;
        }
        opt.step()?;
        steps += 1;
        faults.step_done()?;
        loss = l.double_value(&[]);
    }
    if let Some(group) = &group {
        group.barrier()?;
    }
    let (seconds, faults) = (started.elapsed().as_secs_f64(), faults.since_first()?);
    Ok(Measured {
        steps,
        seconds,
        loss,
        procs,
        faults,
    })
}
