//! The memory benchmark's worker: 8 square Linear layers of width 2560 (52.5M parameters,
//! each layer a sharding unit), AdamW, fp32, batch 8 of random data, 4 optimizer steps.
//! Each process prints one JSON line: its peak resident memory above what it used before
//! the model existed, during the steps after the first, and the time per step.
//! `cargo xtask bench` runs it for every strategy and prints the table.
//!
//! Run as: MALLOC_MMAP_THRESHOLD_=65536 accel launch --num-processes 2 --strategy zero3 \
//!             target/release/examples/memory_bench
//! (the fixed mmap threshold makes freed tensors go back to the system at once, so that
//! resident memory measures what is alive; glibc's default would keep some).
//!
//! With `--device cuda` (scripts/gpu-check.sh) each process trains on its GPU and also
//! reports the GPU's peak of allocated tensor bytes during those steps
//! (`torch.cuda.max_memory_allocated`), beside python/reference/torch_memory.py's.

use std::time::Instant;

use accel_core::optim::{AdamConfig, AdamW};
use accel_core::{Accelerator, Unit};
use accel_examples::proc_status_bytes;
use anyhow::{Context, Result};
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

const WIDTH: i64 = 2560;
const LAYERS: i64 = 8;
const STEPS: usize = 4;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let cuda = match args.as_slice() {
        [] => false,
        [flag, device] if flag == "--device" && (device == "cuda" || device == "cpu") => {
            device == "cuda"
        }
        other => anyhow::bail!("usage: memory_bench [--device cpu|cuda], not {other:?}"),
    };
    // Every process trains on the same random batch: the benchmark measures memory, and
    // says so to the accelerator (nothing deals these batches).
    let acc =
        Accelerator::builder().seed(0).cpu(!cuda).data(accel_core::DataSharding::Manual).build()?;
    tch::set_num_threads(1);
    let device = acc.device();
    let x = Tensor::randn([8, WIDTH], (Kind::Float, device));
    let y = Tensor::randn([8, WIDTH], (Kind::Float, device));
    let before = proc_status_bytes("VmRSS:")?;

    let vs = nn::VarStore::new(device);
    let root = vs.root();
    let mut net = nn::seq();
    for i in 0..LAYERS {
        let path = &root / "layers" / i;
        net = net.add(Unit::new(&acc, &path, nn::linear(&path, WIDTH, WIDTH, Default::default())));
        net = net.add_fn(|x| x.relu());
    }
    acc.prepare_model(&vs)?;
    let params: i64 = vs.trainable_variables().iter().map(|t| t.numel() as i64).sum();
    let mut opt = acc.prepare_optimizer(AdamW::new(acc.params(&vs), AdamConfig::adamw())?);

    let mut step = || -> Result<()> {
        let loss = acc.forward(|| net.forward(&x))?.mse_loss(&y, tch::Reduction::Mean);
        acc.backward(&loss)?;
        opt.step()?;
        opt.zero_grad()?;
        Ok(())
    };
    // The first step creates the optimizer state; the peak is measured over the next ones,
    // from a reset high-water mark (Linux: writing 5 to clear_refs resets VmHWM).
    let synchronize = || {
        if let Device::Cuda(index) = device {
            tch::Cuda::synchronize(index as i64);
        }
    };
    step()?;
    synchronize();
    acc.wait_for_everyone()?;
    std::fs::write("/proc/self/clear_refs", "5").context("resetting the peak RSS")?;
    if let Device::Cuda(index) = device {
        accel_core::shim::cuda_runtime::reset_peak_memory(index)?;
    }
    let start = Instant::now();
    for _ in 1..STEPS {
        step()?;
    }
    synchronize();
    acc.wait_for_everyone()?;
    let step_s = start.elapsed().as_secs_f64() / (STEPS - 1) as f64;
    let peak = proc_status_bytes("VmHWM:")? - before;
    let gpu_peak = match device {
        Device::Cuda(index) => Some(accel_core::shim::cuda_runtime::max_memory_allocated(index)?),
        _ => None,
    };
    println!(
        "{}",
        serde_json::json!({
            "rank": acc.process_index(),
            "processes": acc.num_processes(),
            "strategy": acc.config().strategy.as_str(),
            "params": params,
            "peak_bytes": peak,
            "gpu_peak_bytes": gpu_peak,
            "step_s": step_s,
        })
    );
    Ok(())
}
