//! An MLP classifier trained from files, so that any other implementation can run exactly the
//! same work: python/reference/parity_accelerate.py is PyTorch + Accelerate's version, and
//! examples/tests/parity.rs checks that both give the same losses and weights.
//!
//! `W.safetensors` holds `layers.{i}.weight` ([out, in]) and `layers.{i}.bias` of the i-th
//! Linear (ReLU between them); `D.safetensors` holds `x` (f32 [n, d]) and `y` (i64 [n]).
//! Data are used in file order. Rank 0 writes one JSONL line `{"step": k, "loss": v}` per
//! batch it processes (the loss before division by accumulate) and the final weights.
//!
//! One process:    cargo run -p accel-examples --example parity -- --init W.safetensors \
//!                     --data D.safetensors --out final.safetensors --losses losses.jsonl
//! Two processes:  accel launch --num-processes 2 target/debug/examples/parity --init ...
//! or torchrun:    torchrun --no-python --nproc-per-node 2 target/debug/examples/parity ...

use std::io::Write;
use std::path::PathBuf;

use accel_core::data::{DataLoader, LoaderOptions, TensorDataset};
use accel_core::optim::{AdamConfig, AdamW, Sgd, SgdConfig, named_params};
use accel_core::pipeline::{Pipeline, Schedule};
use accel_core::precision::Float8Linear;
use accel_core::strategy::tp::{ColumnParallelLinear, LinearOptions, RowParallelLinear};
use accel_core::{
    AcceleratedOptimizer, Accelerator, Fp8Recipe, Precision, ShardOptions, Strategy, Unit,
};
use anyhow::{Context, Result, bail};
use clap::Parser;
use tch::nn::{self, Module};
use tch::{Device, Tensor};

/// Train an MLP from W and D files.
#[derive(Debug, Parser)]
struct Args {
    /// Initial weights.
    #[arg(long)]
    init: PathBuf,
    /// Training data.
    #[arg(long)]
    data: PathBuf,
    /// Hidden widths, comma separated (checked against the weights).
    #[arg(long, default_value = "64,64")]
    hidden: String,
    /// `adamw` or `sgd`.
    #[arg(long, default_value = "adamw")]
    optimizer: String,
    /// Learning rate.
    #[arg(long, default_value_t = 1e-3)]
    lr: f64,
    /// Weight decay (decoupled for AdamW, L2 for SGD).
    #[arg(long, default_value_t = 0.01)]
    weight_decay: f64,
    /// Batch size per process.
    #[arg(long, default_value_t = 8)]
    batch_size: usize,
    /// Micro-batches per optimizer step (default: the launcher's configuration, else 1).
    #[arg(long)]
    accumulate: Option<u32>,
    /// Passes over the data.
    #[arg(long, default_value_t = 1)]
    epochs: u64,
    /// Strategy (default: the launcher's configuration, else ddp).
    #[arg(long)]
    strategy: Option<Strategy>,
    /// Mixed precision (default: the launcher's configuration, else no).
    #[arg(long)]
    precision: Option<Precision>,
    /// With `--precision fp8`: `tensorwise` or `rowwise`.
    #[arg(long, default_value = "tensorwise")]
    fp8_recipe: Fp8Recipe,
    /// Clip the global gradient norm (0: off).
    #[arg(long, default_value_t = 0.0)]
    clip_grad_norm: f64,
    /// Apply each unit's update inside backward (zero2/zero3).
    #[arg(long)]
    optimizer_in_backward: bool,
    /// Split each batch across processes instead of dealing whole batches.
    #[arg(long)]
    split_batches: bool,
    /// Final weights (rank 0).
    /// Save the training state (`save_state`) into this folder after `--stop-after`
    /// batches, write the weights reached, and stop.
    #[arg(long, requires = "stop_after")]
    state: Option<PathBuf>,
    #[arg(long)]
    stop_after: Option<u64>,
    /// zero2/zero3: reduce-scatter gradients in bf16.
    #[arg(long)]
    bf16_reductions: bool,
    /// zero3: gather and compute the layers' parameters in bf16 (FSDP's
    /// `MixedPrecision(param_dtype)`); needs `--precision bf16`.
    #[arg(long)]
    bf16_parameters: bool,
    /// zero3 under bf16: gather parameters and reduce gradients in fp32 (by default they are
    /// gathered, computed and reduced in bf16, as Accelerate's FSDP plugin does).
    #[arg(long)]
    fp32_gathers: bool,
    /// Continue from a state saved by `--state` (any strategy, any number of processes).
    #[arg(long)]
    resume: Option<PathBuf>,
    /// After `--resume`, each process writes what it read and placed
    /// (`Accelerator::io_counts`) as JSON to `{this}.{rank}.json`.
    #[arg(long, requires = "resume")]
    io_counts: Option<PathBuf>,
    /// Tensor-parallel ranks: the MLP's layers in Megatron pairs (column-parallel, then
    /// row-parallel; a layer whose width they do not divide stays whole).
    #[arg(long, default_value_t = 1)]
    tensor_parallel: usize,
    /// Pipeline stages: the layers (pairs kept together) cut into stages; each step runs
    /// `--accumulate` micro-batches through them.
    #[arg(long, default_value_t = 1)]
    pipeline_parallel: usize,
    /// Pipeline schedule: `1f1b` or `gpipe`.
    #[arg(long, default_value = "1f1b")]
    schedule: String,
    /// Local SGD instead of `--strategy`: no gradient all-reduce, parameters averaged every
    /// K batches and at the end (accel_examples::local_sgd, a strategy written outside
    /// accel-core).
    #[arg(long, value_name = "K")]
    local_sgd: Option<u64>,
    /// Also write the model with `save_model` into this folder (every process takes part).
    #[arg(long)]
    save_model: Option<PathBuf>,
    #[arg(long)]
    out: PathBuf,
    /// Loss log (rank 0).
    #[arg(long)]
    losses: PathBuf,
    /// `cpu`, or `cuda` (each process on its own GPU; scripts/gpu-check.sh).
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda"])]
    device: String,
    /// Profile the training into DIR/trace_rank{r}.json (`accel profile summary` reads it).
    #[arg(long, value_name = "DIR")]
    profile: Option<PathBuf>,
}

/// The accelerator the command line asks for. What it leaves out comes from `accel launch`
/// (flags, --config-file: YAML or a DeepSpeed JSON), as the accelerator's builder layers them.
fn accelerator(args: &Args) -> Result<Accelerator> {
    let mut builder = Accelerator::builder()
        .fp8_recipe(args.fp8_recipe)
        .fp32_gathers(args.fp32_gathers)
        .tensor_parallel(args.tensor_parallel)
        .pipeline_parallel(args.pipeline_parallel)
        .optimizer_in_backward(args.optimizer_in_backward)
        .cpu(args.device != "cuda");
    if let Some(strategy) = args.strategy {
        builder = builder.strategy(strategy);
    }
    if let Some(precision) = args.precision {
        builder = builder.precision(precision);
    }
    if let Some(accumulate) = args.accumulate {
        builder = builder.accumulate(accumulate);
    }
    if args.clip_grad_norm > 0.0 {
        builder = builder.clip_grad_norm(args.clip_grad_norm);
    }
    if let Some(every) = args.local_sgd {
        builder = builder.custom_strategy(accel_examples::local_sgd::LocalSgd::new(every));
    }
    if args.bf16_reductions || args.bf16_parameters {
        let bf16 = |on: bool| on.then_some(tch::Kind::BFloat16);
        builder = builder.sharding(ShardOptions {
            reduce_dtype: bf16(args.bf16_reductions),
            param_dtype: bf16(args.bf16_parameters),
            ..Default::default()
        });
    }
    Ok(builder.build()?)
}

/// The initial weights (`--init`) and their number of layers, checked against `--hidden`.
fn read_init(args: &Args) -> Result<(Vec<(String, Tensor)>, usize)> {
    let init: Vec<(String, Tensor)> = Tensor::read_safetensors(&args.init)
        .with_context(|| format!("reading {}", args.init.display()))?;
    let weight =
        |i: usize| init.iter().find(|(n, _)| *n == format!("layers.{i}.weight")).map(|(_, t)| t);
    let layers = (0..).take_while(|&i| weight(i).is_some()).count();
    if layers == 0 {
        bail!("{} has no layers.0.weight", args.init.display());
    }
    let hidden: Vec<i64> = args
        .hidden
        .split(',')
        .filter(|s| !s.is_empty())
        .map(str::parse)
        .collect::<Result<_, _>>()?;
    let widths: Vec<i64> = (0..layers - 1).map(|i| weight(i).expect("counted").size()[0]).collect();
    if hidden != widths {
        bail!("--hidden {hidden:?} does not match the weights' hidden widths {widths:?}");
    }
    Ok((init, layers))
}

/// `--optimizer` over the model's parameters, by name.
fn optimizer(acc: &Accelerator, vs: &nn::VarStore, args: &Args) -> Result<AcceleratedOptimizer> {
    let params = named_params(vs);
    Ok(match args.optimizer.as_str() {
        "adamw" => acc.prepare_optimizer(AdamW::new(
            params,
            AdamConfig { lr: args.lr, weight_decay: args.weight_decay, ..AdamConfig::adamw() },
        )?),
        "sgd" => acc.prepare_optimizer(Sgd::new(
            params,
            SgdConfig { lr: args.lr, weight_decay: args.weight_decay, ..Default::default() },
        )?),
        other => bail!("unknown optimizer `{other}`; use adamw or sgd"),
    })
}

/// The batches of `--data` (its tensors `x` and `y`).
fn loader(args: &Args) -> Result<DataLoader<TensorDataset>> {
    let data: Vec<(String, Tensor)> = Tensor::read_safetensors(&args.data)
        .with_context(|| format!("reading {}", args.data.display()))?;
    let get = |name: &str| {
        data.iter()
            .find(|(n, _)| n == name)
            .map(|(_, t)| t.shallow_clone())
            .with_context(|| format!("{} lacks `{name}`", args.data.display()))
    };
    let options = LoaderOptions {
        batch_size: args.batch_size,
        split_batches: args.split_batches,
        prefetch: 0,
        ..Default::default()
    };
    Ok(DataLoader::new(TensorDataset::new(vec![get("x")?, get("y")?])?, options)?)
}

fn main() -> Result<()> {
    let args = Args::parse();
    let acc = accelerator(&args)?;
    acc.print(format!(
        "parity: {} on {} process(es), collectives over {:?}{}",
        acc.strategy().name(),
        acc.num_processes(),
        acc.mesh().everyone().backend(),
        acc.process_group().map(|g| format!(" by {}", g.transport())).unwrap_or_default()
    ));

    let (init, layers) = read_init(&args)?;

    let vs = nn::VarStore::new(acc.device());
    let net = build(&acc, &vs, &init, layers)?;
    acc.prepare_model(&vs)?;
    let mut opt = optimizer(&acc, &vs, &args)?;

    let mut loader = acc.prepare_loader(loader(&args)?)?;

    if let Some(dir) = &args.resume {
        acc.load_state(dir)?;
        if let Some(prefix) = &args.io_counts {
            let path = format!("{}.{}.json", prefix.display(), acc.process_index());
            std::fs::write(path, serde_json::to_string(&acc.io_counts())?)?;
        }
    }
    let mut log = acc.is_main_process().then(|| std::fs::File::create(&args.losses)).transpose()?;
    let mut write = |step: u64, loss: f64| -> Result<()> {
        if let Some(log) = &mut log {
            writeln!(log, "{}", serde_json::json!({ "step": step, "loss": loss }))?;
        }
        Ok(())
    };
    let mut step = 0u64;
    let profiler = match &args.profile {
        Some(dir) => Some(acc.profile(accel_core::profile::ProfileOptions {
            dir: dir.clone(),
            ..Default::default()
        })?),
        None => None,
    };
    if args.pipeline_parallel > 1 {
        let schedule = match args.schedule.as_str() {
            "1f1b" => Schedule::OneForwardOneBackward,
            "gpipe" => Schedule::GPipe,
            other => bail!("unknown schedule `{other}`; use 1f1b or gpipe"),
        };
        let pipeline = Pipeline::new(&acc, schedule);
        // One optimizer step over a window of micro-batches (emptied).
        let window = |batches: &mut Vec<(Tensor, Tensor)>,
                      opt: &mut AcceleratedOptimizer,
                      write: &mut dyn FnMut(u64, f64) -> Result<()>,
                      step: &mut u64|
         -> Result<()> {
            let losses = pipeline.train_step(
                &acc,
                batches,
                |x| net.forward(x),
                |logits, y| logits.cross_entropy_for_logits(y),
            )?;
            for loss in losses {
                write(*step, loss)?;
                *step += 1;
            }
            opt.step()?;
            opt.zero_grad()?;
            batches.clear();
            Ok(())
        };
        for _ in loader.epoch()..args.epochs {
            let mut batches = Vec::new();
            for batch in loader.iter() {
                let batch = batch?;
                batches.push((batch[0].shallow_clone(), batch[1].shallow_clone()));
                if batches.len() < acc.config().accumulate as usize {
                    continue;
                }
                window(&mut batches, &mut opt, &mut write, &mut step)?;
                if let (Some(dir), Some(n)) = (&args.state, args.stop_after)
                    && acc.counters().micro_steps_total == n
                {
                    acc.save_state(dir)?;
                    return finish(&acc, &vs, &args);
                }
            }
            // The epoch's short last window, stepped as accumulation without a pipeline ends
            // an epoch.
            if !batches.is_empty() {
                window(&mut batches, &mut opt, &mut write, &mut step)?;
            }
        }
        if let Some(p) = profiler {
            p.finish()?;
        }
        return finish(&acc, &vs, &args);
    }
    'train: for _ in loader.epoch()..args.epochs {
        for batch in loader.iter() {
            let batch = batch?;
            let logits = acc.forward(|| net.forward(&batch[0]))?;
            let loss = logits.cross_entropy_for_logits(&batch[1]);
            write(step, loss.double_value(&[]))?;
            acc.backward(&loss)?;
            opt.step()?;
            opt.zero_grad()?;
            step += 1;
            if let (Some(dir), Some(n)) = (&args.state, args.stop_after)
                && acc.counters().micro_steps_total == n
            {
                acc.save_state(dir)?;
                break 'train;
            }
        }
    }
    if let Some(p) = profiler {
        p.finish()?;
    }
    finish(&acc, &vs, &args)
}

/// The final weights, whole, written by rank 0 (and by `save_model` if asked).
fn finish(acc: &Accelerator, vs: &nn::VarStore, args: &Args) -> Result<()> {
    // The strategy's last word (Local SGD averages the replicas once more).
    acc.end_training()?;
    // Under zero2/zero3 every rank holds a shard: all take part in gathering them.
    let named: Vec<(String, Tensor)> = acc
        .full_state_dict(vs)?
        .into_iter()
        .map(|(name, t)| (name, t.to_device(Device::Cpu)))
        .collect();
    if acc.is_main_process() {
        Tensor::write_safetensors(&named, &args.out)?;
    }
    if let Some(dir) = &args.save_model {
        acc.save_model(vs, dir, u64::MAX)?;
    }
    acc.wait_for_everyone()?;
    Ok(())
}

/// One layer of the MLP as this process holds it.
enum Layer {
    Whole(Float8Linear),
    Column(ColumnParallelLinear),
    Row(RowParallelLinear),
}

/// The MLP's layers on this process's pipeline stage, initialised from `init`: Megatron
/// pairs where the tensor ranks divide the width between them (column-parallel without
/// gathering its output, then row-parallel taking it as it is), whole layers elsewhere. A
/// pair stays on one stage. Each layer is an [`Unit`], so under zero3 its weights exist whole
/// only during its own forward and backward (elsewhere `Unit` changes nothing).
fn build(
    acc: &Accelerator,
    vs: &nn::VarStore,
    init: &[(String, Tensor)],
    layers: usize,
) -> Result<impl Module> {
    let tp = acc.tensor_parallel();
    let get = |name: String| init.iter().find(|(n, _)| *n == name).map(|(_, t)| t);
    let weight = |i: usize| get(format!("layers.{i}.weight")).expect("counted");
    // Units of one or two layers, so that a pair is never cut between stages.
    let mut units: Vec<Vec<usize>> = Vec::new();
    let mut i = 0;
    while i < layers {
        let paired = tp.size() > 1 && i + 1 < layers && weight(i).size()[0] % tp.size() as i64 == 0;
        units.push(if paired { vec![i, i + 1] } else { vec![i] });
        i += if paired { 2 } else { 1 };
    }
    let pipeline = Pipeline::new(acc, Schedule::OneForwardOneBackward);
    let mine = pipeline.layers(units.len())?;
    let root = vs.root();
    let mut net = nn::seq();
    for unit in &units[mine] {
        for (k, &i) in unit.iter().enumerate() {
            let [out, inp] = weight(i).size()[..] else { bail!("layers.{i}.weight is not 2-D") };
            let path = &root / "layers" / i;
            let bias =
                get(format!("layers.{i}.bias")).with_context(|| format!("no layers.{i}.bias"))?;
            let options = LinearOptions::default();
            let layer = match (unit.len(), k) {
                (2, 0) => {
                    let l = ColumnParallelLinear::new(&tp, &path, inp, out, options)?;
                    l.load_whole(weight(i), Some(bias))?;
                    Layer::Column(l)
                }
                (2, _) => {
                    let l = RowParallelLinear::new(&tp, &path, inp, out, options)?;
                    l.load_whole(weight(i), Some(bias))?;
                    Layer::Row(l)
                }
                _ => {
                    // nn::linear's layer, whose matmuls run in fp8 under `--precision fp8`.
                    let l = acc.linear(&path, inp, out, Default::default());
                    tch::no_grad(|| -> Result<()> {
                        l.ws.shallow_clone().f_copy_(weight(i))?;
                        l.bs.as_ref().expect("a bias").shallow_clone().f_copy_(bias)?;
                        Ok(())
                    })?;
                    Layer::Whole(l)
                }
            };
            net = match layer {
                Layer::Whole(l) => net.add(Unit::new(acc, &path, l)),
                Layer::Column(l) => net.add(Unit::new(acc, &path, l)),
                Layer::Row(l) => net.add(Unit::new(acc, &path, l)),
            };
            if i + 1 < layers {
                net = net.add_fn(|x| x.relu());
            }
        }
    }
    Ok(net)
}
