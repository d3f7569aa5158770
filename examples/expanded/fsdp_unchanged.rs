//! The README's one line, `strategy = "fsdp"`, on an ordinary tch loop whose model is an
//! `nn::seq()` built in the annotated function, at a size where sharding matters: by default
//! 24 linear layers of width 1536 (56.7M parameters, 227 MB in fp32), plain SGD. Nothing in
//! the function mentions sharding; the attribute makes each layer of the `nn::seq()` a unit,
//! so each process keeps 1/N of the model at rest and gathers one layer at a time.
//!
//! Each process prints one JSON line: its peak resident memory above what it used before
//! the model existed — over the whole run (`peak_bytes`: building the model, which tch
//! makes whole in every process before it is sharded, is part of it) and over the training
//! steps after the first (`train_peak_bytes`, from a reset high-water mark) — the bytes it
//! placed on its device, the model's parameters and the last loss. `cargo xtask bench
//! llama` runs it on 1, 2 and 4 processes.
//!
//! One process:     cargo run --release -p accel-examples --example fsdp_unchanged
//! Four processes:  MALLOC_MMAP_THRESHOLD_=65536 accel launch --num-processes 4 --cpu \
//!                      target/release/examples/fsdp_unchanged
use accel_examples::proc_status_bytes;
use anyhow::Result;
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};
fn train(
    width: i64,
    layers: i64,
    steps: i64,
    batch: i64,
    out: &str,
) -> Result<serde_json::Value> {
    let accelerator = ::accel_core::Accelerator::builder()
        .strategy(::accel_core::Strategy::Fsdp)
        .seed(0)
        .cpu(true)
        .attribute_data_loops(1usize)
        .attribute_call(concat!("`train`", " at ", file!(), ":", line!()))
        .build()?;
    let __accel_exit = accelerator.exit_guard();
    let __accel_result: Result<serde_json::Value> = (|| {
        use Device as _;
        use OptimizerConfig as _;
        let before = proc_status_bytes("VmRSS:")?;
        let device = accelerator.device();
        let vs = nn::VarStore::new(device);
        let mut net = nn::seq();
        for i in 0..layers {
            net = net
                .add(
                    accelerator
                        .unit(
                            vs.root() / "layers" / i,
                            |__accel_path| nn::linear(
                                __accel_path,
                                width,
                                width,
                                Default::default(),
                            ),
                        ),
                );
            net = net.add_fn(|x| x.tanh());
        }
        let mut opt = accelerator.build_optimizer(nn::Sgd::default(), &vs, 1e-2)?;
        let x = Tensor::randn([steps * batch, width], (Kind::Float, Device::Cpu));
        let y = Tensor::randn([steps * batch, width], (Kind::Float, Device::Cpu));
        let (mut last, mut first_peak) = (f64::NAN, None);
        for (xb, yb) in accelerator.prepare_iter(tch::data::Iter2::new(&x, &y, batch)) {
            let __accel_autocast = accelerator.autocast_step()?;
            let loss = net
                .forward(&xb.to_device(device))
                .mse_loss(&yb.to_device(device), tch::Reduction::Mean);
            opt.zero_grad()?;
            accelerator.backward(&loss)?;
            opt.step()?;
            last = loss.double_value(&[]);
            if first_peak.is_none() {
                first_peak = Some(proc_status_bytes("VmHWM:")? - before);
                std::fs::write("/proc/self/clear_refs", "5")?;
            }
        }
        let train_peak = proc_status_bytes("VmHWM:")? - before;
        if !out.is_empty() {
            accelerator.save_varstore(&vs, out)?;
        }
        let peak = first_peak.unwrap_or(0.0).max(train_peak);
        accelerator.attribute_summon()?;
        let parameters: i64 = vs
            .trainable_variables()
            .iter()
            .map(|t| t.numel() as i64)
            .sum();
        Ok(
            serde_json::json!(
                { "peak_bytes" : peak, "train_peak_bytes" : train_peak, "placed_bytes" :
                accelerator.io_counts().bytes_placed_on_device, "parameters" :
                parameters, "loss" : last, }
            ),
        )
    })();
    if __accel_result.is_ok() {
        accelerator.attribute_summon().and_then(|_| __accel_exit.finish())?;
    }
    __accel_result
}
/// `--width W`, `--layers L`, `--steps S` (batches, each process's share of them dealt),
/// `--batch B`, `--out F` (final weights).
fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let flag = |name: &str, default: &str| -> String {
        let at = args.iter().position(|a| a == name);
        at.and_then(|i| args.get(i + 1)).cloned().unwrap_or(default.to_owned())
    };
    tch::set_num_threads(1);
    let report = train(
        flag("--width", "1536").parse()?,
        flag("--layers", "24").parse()?,
        flag("--steps", "8").parse()?,
        flag("--batch", "8").parse()?,
        &flag("--out", ""),
    )?;
    println!("{report}");
    Ok(())
}
