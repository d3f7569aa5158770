//! accel-models' Llama from a Hugging Face checkpoint folder: one forward pass, or a
//! fine-tune whose result is written back as a Hugging Face folder that transformers'
//! `from_pretrained` loads. python/reference/llama_reference.py is transformers +
//! Accelerate's side; examples/tests/parity.rs compares them.
//!
//! Logits:     llama --model DIR --eval TOKENS.safetensors --logits-out OUT.safetensors
//!                 [--attention sdpa|eager]
//! Generate:   llama generate --model DIR --prompt-ids 1,2,3 --max-new-tokens N [...]
//!                 (llama_cli/generate.rs)
//! Fine-tune:  accel launch --num-processes 2 target/debug/examples/llama --model DIR \
//!                 --data TOKENS.safetensors --steps 10 --batch-size 2 --lr 1e-3 \
//!                 --weight-decay 0.01 --out DIR2 --losses losses.jsonl --strategy zero3 \
//!                 [--precision bf16] [--activation-checkpointing] [--optimizer-in-backward]
//!                 [--loss fused|logits] [--profile TRACES]
//!
//! `TOKENS.safetensors` holds `input_ids` (int64 [N, T]). The fine-tune uses AdamW (betas
//! 0.9/0.999, eps 1e-8) on the rows in order, dealt as Accelerate's prepared DataLoader deals
//! them (batch i to rank i mod processes, no shuffle), epochs repeating until `--steps`
//! optimizer steps; its loss is transformers' with `labels = input_ids`. Rank 0 writes its own
//! loss of every step to `--losses`; the main process writes the model to `--out`.
//! `--steps 0` loads and prepares the model and stops (for memory checks). Every process
//! prints one JSON line: its peak resident memory above its baseline (libtorch loaded, no
//! model) while loading and preparing (`load_peak_bytes`) and, from a reset high-water mark,
//! during the training steps after the first (`train_peak_bytes`), and the time per step.

use std::io::Write;
use std::path::PathBuf;

use accel_core::data::{DataLoader, LoaderOptions, TensorDataset};
use accel_core::optim::{AdamConfig, AdamW};
use accel_core::profile::ProfileOptions;
use accel_core::{Accelerator, Precision, Strategy};
use accel_models::llama::{Attention, Llama};
use accel_models::lora::{self, LoraConfig, LoraInit};
use anyhow::{Context, Result, bail};
use clap::Parser;
use tch::Tensor;

/// How the fine-tune computes its loss (`--loss`).
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum Loss {
    Fused,
    Logits,
}

/// Llama from a Hugging Face checkpoint folder: logits, or a fine-tune.
#[derive(Debug, Parser)]
struct Args {
    /// The checkpoint folder (`config.json`, `model.safetensors` or an index and shards).
    #[arg(long)]
    model: PathBuf,
    /// Token ids (`input_ids`, int64 [B, T]) for one forward pass in fp32.
    #[arg(long, requires = "logits_out", conflicts_with = "data")]
    eval: Option<PathBuf>,
    /// Where the forward pass's `logits` (f32 [B, T, vocab]) go.
    #[arg(long)]
    logits_out: Option<PathBuf>,
    /// The `attention_mask` (int64 [B, T], 0 where padded) of `--eval`'s rows.
    #[arg(long, requires = "eval")]
    eval_mask: Option<PathBuf>,
    /// Token ids (`input_ids`, int64 [N, T]) to fine-tune on.
    #[arg(long, requires = "out")]
    data: Option<PathBuf>,
    /// Optimizer steps per process.
    #[arg(long, default_value_t = 10)]
    steps: u64,
    /// Rows per batch per process.
    #[arg(long, default_value_t = 2)]
    batch_size: usize,
    /// Learning rate.
    #[arg(long, default_value_t = 1e-3)]
    lr: f64,
    /// AdamW's decoupled weight decay.
    #[arg(long, default_value_t = 0.0)]
    weight_decay: f64,
    /// The fine-tuned model, as a Hugging Face folder (main process).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Largest safetensors file of `--out`, in bytes (more are written, with an index).
    #[arg(long, default_value_t = 5_000_000_000)]
    max_shard_size: u64,
    /// Rank 0's loss per step (JSONL).
    #[arg(long)]
    losses: Option<PathBuf>,
    /// Strategy (default: the launcher's configuration, else ddp).
    #[arg(long)]
    strategy: Option<Strategy>,
    /// Mixed precision (default: the launcher's configuration, else no).
    #[arg(long)]
    precision: Option<Precision>,
    /// Recompute each decoder layer in backward instead of keeping its activations.
    #[arg(long)]
    activation_checkpointing: bool,
    /// Apply each layer's AdamW update inside backward and drop its gradient shard at once
    /// (zero2/zero3).
    #[arg(long)]
    optimizer_in_backward: bool,
    /// How the loss is computed: `fused`, the head fused into it a few hundred rows at a
    /// time (`Llama::forward_loss`: the B × T × vocab logits never exist whole, about 480
    /// MiB less at 2 × 1024 tokens of the bench's Llama), or `logits`, the logits first
    /// (`Llama::forward`, then `Llama::loss`, as transformers' `.loss`). The same values.
    #[arg(long, value_enum, default_value = "fused")]
    loss: Loss,
    /// How attention is computed: `sdpa` (fused, transformers' default) or `eager`.
    #[arg(long, default_value = "sdpa")]
    attention: Attention,
    /// LoRA: train fresh adapters of this rank on the base frozen (PEFT's initialisation);
    /// `--out` then gets PEFT's adapter folder.
    #[arg(long, conflicts_with = "lora_adapter")]
    lora_r: Option<i64>,
    /// LoRA's alpha (scale alpha / r).
    #[arg(long, default_value_t = 16.0)]
    lora_alpha: f64,
    /// The projections LoRA adapts, comma separated.
    #[arg(long, default_value = "q_proj,v_proj")]
    lora_target: String,
    /// A PEFT adapter folder (adapter_config.json + adapter_model.safetensors) on top of the
    /// model: evaluated with it, fine-tuned from it, or merged by `--merge-out`.
    #[arg(long)]
    lora_adapter: Option<PathBuf>,
    /// Fold `--lora-adapter` into the base weights and write the plain model here (PEFT's
    /// `merge_and_unload`), for `from_pretrained`.
    #[arg(long, requires = "lora_adapter")]
    merge_out: Option<PathBuf>,
    /// After the last step, save the training state here (`save_state`).
    #[arg(long, requires = "data")]
    save_state: Option<PathBuf>,
    /// Before the first step, load the training state saved here (`load_state`, on any
    /// number of processes); the report then says the peak while loading it
    /// (`resume_peak_bytes`).
    #[arg(long, requires = "data")]
    resume: Option<PathBuf>,
    /// Profile the steps after the first into TRACES/trace_rank{r}.json (`accel profile
    /// summary` reads it); the time per step then includes writing the trace.
    #[arg(long, requires = "data", value_name = "TRACES")]
    profile: Option<PathBuf>,
}

/// The tensor `name` of safetensors file `path`.
fn named_tensor(path: &PathBuf, name: &str) -> Result<Tensor> {
    let tensors =
        Tensor::read_safetensors(path).with_context(|| format!("reading {}", path.display()))?;
    tensors
        .into_iter()
        .find(|(n, _)| n == name)
        .map(|(_, t)| t)
        .with_context(|| format!("{} has no `{name}`", path.display()))
}

fn input_ids(path: &PathBuf) -> Result<Tensor> {
    let ids = named_tensor(path, "input_ids")?;
    if ids.kind() != tch::Kind::Int64 || ids.dim() != 2 {
        bail!(
            "{}: input_ids must be int64 [rows, tokens], is {:?} {:?}",
            path.display(),
            ids.kind(),
            ids.size()
        );
    }
    Ok(ids)
}

/// A `--resume`: the peak memory above the baseline until the state was loaded, and the
/// bytes `load_state` read.
type Resumed = (f64, u64);

/// Resident memory now, and its high-water mark.
fn rss() -> (f64, f64) {
    let now = accel_examples::proc_status_bytes("VmRSS:").unwrap_or(0.0);
    (now, accel_examples::proc_status_bytes("VmHWM:").unwrap_or(0.0))
}

#[path = "llama_cli/generate.rs"]
mod generate;

fn main() -> Result<()> {
    // `llama generate ...`: its own flags.
    let mut words = std::env::args();
    if std::env::args().nth(1).as_deref() == Some("generate") {
        let program = words.next().unwrap_or_default();
        return generate::run(std::iter::once(program).chain(words.skip(1)));
    }
    let args = Args::parse();
    let mut builder = Accelerator::builder()
        .activation_checkpointing(args.activation_checkpointing)
        .optimizer_in_backward(args.optimizer_in_backward);
    if let Some(strategy) = args.strategy {
        builder = builder.strategy(strategy);
    }
    if let Some(precision) = args.precision {
        builder = builder.precision(precision);
    }
    let acc = builder.build()?;
    let (baseline, _) = rss();
    let mut vs = tch::nn::VarStore::new(acc.device());
    let lora = match (&args.lora_adapter, args.lora_r) {
        (Some(dir), _) => Some((LoraConfig::read(dir)?, LoraInit::Uninit)),
        (None, Some(r)) => {
            let targets = args.lora_target.split(',').map(|t| t.trim().to_owned()).collect();
            let config =
                LoraConfig { r, alpha: args.lora_alpha, targets, rslora: false, dropout: 0.0 };
            Some((config, LoraInit::Fresh))
        }
        (None, None) => None,
    };
    if let Some((lora_config, lora_init)) = lora {
        return with_lora(&args, &acc, &mut vs, &lora_config, lora_init, baseline);
    }

    if args.eval.is_some() && args.logits_out.is_some() {
        let mut model = Llama::load_pretrained(&acc, &vs, &args.model)?;
        model.attention = args.attention;
        return evaluate(&acc, &model, &args);
    }
    let Some(data) = &args.data else { bail!("give --eval (with --logits-out) or --data") };

    let mut model = Llama::from_pretrained(&acc, &vs, &args.model)?;
    model.attention = args.attention;
    if !fine_tune_and_report(&args, &acc, &model, &vs, data, baseline)? {
        return Ok(());
    }
    let out = args.out.as_ref().expect("clap requires --out with --data");
    model.save_pretrained(&acc, &vs, out, args.max_shard_size)?;
    acc.end_training()?;
    Ok(())
}

/// [`fine_tune`] (nothing with `--steps 0`), then this process's report: memory above
/// `baseline` after loading and while training, and the seconds per step after the first.
/// Whether it trained.
fn fine_tune_and_report(
    args: &Args,
    acc: &Accelerator,
    model: &Llama,
    trained: &tch::nn::VarStore,
    data: &PathBuf,
    baseline: f64,
) -> Result<bool> {
    let load_peak = rss().1 - baseline;
    if args.steps == 0 {
        report(acc, trained, load_peak, None, None, None);
        return Ok(false);
    }
    let (started, resume_peak) = fine_tune(args, acc, model, trained, data, baseline)?;
    let step_s = started
        .filter(|_| args.steps > 1)
        .map(|t| t.elapsed().as_secs_f64() / (args.steps - 1) as f64);
    report(acc, trained, load_peak, Some(rss().1 - baseline), step_s, resume_peak);
    Ok(true)
}

/// This process's JSON line: its trained parameters, memory peaks and time per step.
fn report(
    acc: &Accelerator,
    trained: &tch::nn::VarStore,
    load_peak: f64,
    train_peak: Option<f64>,
    step_s: Option<f64>,
    resume: Option<Resumed>,
) {
    let params: i64 = trained.trainable_variables().iter().map(|t| t.numel() as i64).sum();
    println!(
        "{}",
        serde_json::json!({
            "rank": acc.process_index(),
            "strategy": acc.strategy().name(),
            "activation_checkpointing": acc.config().activation_checkpointing,
            "params": params,
            "load_peak_bytes": load_peak,
            "peak_bytes": train_peak.unwrap_or(load_peak),
            "resume_peak_bytes": resume.map(|r| r.0),
            "state_bytes_read": resume.map(|r| r.1),
            "step_s": step_s,
        })
    );
}

/// Writes the logits of `--eval`'s ids to `out` (the main process).
fn evaluate(acc: &Accelerator, model: &Llama, args: &Args) -> Result<()> {
    let (eval, out) =
        (args.eval.as_ref().expect("--eval"), args.logits_out.as_ref().expect("--logits-out"));
    let ids = input_ids(eval)?;
    model.config.check_ids(&ids).with_context(|| format!("{}", eval.display()))?;
    let mask = match &args.eval_mask {
        Some(path) => Some(named_tensor(path, "attention_mask")?.to_device(acc.device())),
        None => None,
    };
    let logits = tch::no_grad(|| model.forward_padded(&ids.to_device(acc.device()), mask.as_ref()));
    if acc.is_main_process() {
        Tensor::write_safetensors(&[("logits", &logits.to_kind(tch::Kind::Float))], out)?;
    }
    Ok(())
}

/// `--steps` AdamW steps on the variables of `trainable` (prepared), the rows of `data` dealt
/// in order, epochs repeating; rank 0's loss of every step to `--losses`. Returns when the
/// steps after the first began (the first makes the optimizer state; memory peaks are
/// measured after it), and with `--resume` the peak memory above `baseline` until the state
/// was loaded and the bytes `load_state` read.
fn fine_tune(
    args: &Args,
    acc: &Accelerator,
    model: &Llama,
    trainable: &tch::nn::VarStore,
    data: &PathBuf,
    baseline: f64,
) -> Result<(Option<std::time::Instant>, Option<Resumed>)> {
    if model.config.attention_dropout != 0.0 {
        bail!(
            "{}: attention_dropout is {}; this trainer implements none (set it to 0.0 to \
             fine-tune without it)",
            args.model.join("config.json").display(),
            model.config.attention_dropout
        );
    }
    let adamw = AdamConfig {
        lr: args.lr,
        weight_decay: args.weight_decay,
        eps: 1e-8,
        ..AdamConfig::adamw()
    };
    let mut opt = acc.prepare_optimizer(AdamW::new(acc.params(trainable), adamw)?);
    let ids = input_ids(data)?;
    model.config.check_ids(&ids).with_context(|| format!("{}", data.display()))?;
    let options = LoaderOptions { batch_size: args.batch_size, ..Default::default() };
    let mut loader =
        acc.prepare_loader(DataLoader::new(TensorDataset::new(vec![ids])?, options)?)?;
    let resume_peak = match &args.resume {
        Some(dir) => {
            let before = acc.io_counts().checkpoint_bytes_read;
            acc.load_state(dir)?;
            let read = acc.io_counts().checkpoint_bytes_read - before;
            Some((rss().1 - baseline, read))
        }
        None => None,
    };
    let mut log = match (&args.losses, acc.is_main_process()) {
        (Some(path), true) => Some(std::fs::File::create(path)?),
        _ => None,
    };
    let mut step = 0;
    let mut started = None;
    let mut profiler = None;
    'training: loop {
        for batch in loader.iter() {
            let batch = batch?;
            // transformers' loss with labels = input_ids; fused, the logits never exist
            // whole; otherwise they are dropped once it is computed, as `.loss` drops them.
            let loss = match args.loss {
                Loss::Fused => acc.forward(|| model.forward_loss(&batch[0]))?,
                Loss::Logits => Llama::loss(&acc.forward(|| model.forward(&batch[0]))?, &batch[0]),
            };
            acc.backward(&loss)?;
            opt.step()?;
            opt.zero_grad()?;
            if let Some(log) = &mut log {
                writeln!(
                    log,
                    "{}",
                    serde_json::json!({ "step": step, "loss": loss.double_value(&[]) })
                )?;
            }
            step += 1;
            if step == 1 {
                acc.wait_for_everyone()?;
                let _ = std::fs::write("/proc/self/clear_refs", "5");
                started = Some(std::time::Instant::now());
                if let Some(dir) = &args.profile {
                    let options = ProfileOptions { dir: dir.clone(), ..Default::default() };
                    profiler = Some(acc.profile(options)?);
                }
            }
            if step == args.steps {
                break 'training;
            }
        }
    }
    if let Some(profiler) = profiler {
        profiler.finish()?;
    }
    if let Some(dir) = &args.save_state {
        acc.save_state(dir)?;
    }
    acc.wait_for_everyone()?;
    Ok((started, resume_peak))
}

/// The base frozen (whole on every process, or sharded under zero3/fsdp when training), the
/// adapters the only trained variables: evaluation with an adapter, a merge, or a LoRA
/// fine-tune whose `--out` is PEFT's folder.
fn with_lora(
    args: &Args,
    acc: &Accelerator,
    vs: &mut tch::nn::VarStore,
    lora_config: &LoraConfig,
    init: LoraInit,
    baseline: f64,
) -> Result<()> {
    let configured = acc.config().strategy;
    // ddp replicates the frozen base and the adapters; zero3 (and fsdp's full shard) shards
    // both, the base at rest (gathered a layer at a time), the adapters and their optimizer
    // state.
    if !matches!(configured, Strategy::Single | Strategy::Ddp | Strategy::Zero3 | Strategy::Fsdp) {
        bail!(
            "LoRA runs under single, ddp, zero3 or fsdp here, not {configured}: only those \
             strategies are tested with it"
        );
    }
    let training = args.data.is_some() && args.merge_out.is_none() && args.eval.is_none();
    let mut model = if training && matches!(configured, Strategy::Zero3 | Strategy::Fsdp) {
        Llama::from_pretrained_frozen(acc, vs, &args.model)?
    } else {
        let model = Llama::load_pretrained(acc, vs, &args.model)?;
        vs.freeze();
        model
    };
    model.attention = args.attention;
    let adapters = tch::nn::VarStore::new(acc.device());
    model.attach_lora(&adapters, lora_config, init)?;
    if let Some(dir) = &args.lora_adapter {
        lora::load_adapter(&adapters, dir)?;
    }
    if let Some(out) = &args.merge_out {
        model.merge_lora()?;
        model.save_pretrained(acc, vs, out, args.max_shard_size)?;
        return Ok(());
    }
    if args.eval.is_some() && args.logits_out.is_some() {
        return evaluate(acc, &model, args);
    }
    let Some(data) = &args.data else { bail!("give --eval, --merge-out or --data") };
    if lora_config.dropout != 0.0 {
        bail!("lora_dropout is {}; this trainer implements none", lora_config.dropout);
    }
    acc.prepare_model(&adapters)?;
    if !fine_tune_and_report(args, acc, &model, &adapters, data, baseline)? {
        return Ok(());
    }
    let out = args.out.as_ref().expect("clap requires --out with --data");
    lora::save_adapter(acc, &adapters, lora_config, &args.model.display().to_string(), out)?;
    acc.end_training()?;
    Ok(())
}
