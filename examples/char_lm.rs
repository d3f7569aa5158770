//! A character-level transformer language model (GPT-style: pre-norm blocks of causal
//! self-attention and an MLP) trained on Genesis and Exodus of the King James Version
//! (data/kjv-genesis-exodus.txt, public domain, 367 KB; data/make_kjv.sh made it). The
//! last tenth of the text is held out; the run must bring the held-out loss under a target
//! (nats per character; a uniform guess over the 72 characters is 4.28; 600 steps on 2
//! processes reach about 1.51 in under a minute on 2 cores). Each block is an
//! `accel_core::Unit`, so under zero3 a block's weights exist whole only during its own forward
//! and backward. It prints a sample of generated text at the end.
//!
//!
//! The same model runs tensor-parallel (its heads, MLP and vocabulary split Megatron-style;
//! `--sequence-parallel` splits the rest along the sequence) and pipeline-parallel (its
//! embeddings, blocks and head cut into stages, `--accumulate` micro-batches per step) and
//! context-parallel (each sequence split across `--context-parallel` ranks, attention
//! exchanging heads by all-to-all):
//!
//!     cargo run --release -p accel-examples --example char_lm
//!     accel launch --num-processes 2 --cpu target/release/examples/char_lm
//!     accel launch --num-processes 2 --cpu --strategy zero3 target/release/examples/char_lm --steps 300
//!     accel launch --num-processes 4 --cpu target/release/examples/char_lm \
//!         --tensor-parallel 2 --pipeline-parallel 2 --accumulate 4
//!     accel launch --num-processes 4 --cpu target/release/examples/char_lm --context-parallel 2
//!
//! With `--checkpoint-every N` it saves every N steps and, restarted by `accel launch
//! --max-restarts`, continues from the newest complete checkpoint (`--resume` by hand).

use std::path::PathBuf;

use std::io::Write;

use accel_core::comm::ReduceOp;
use accel_core::data::{DataLoader, LoaderOptions, Sampler, TensorDataset};
use accel_core::mesh::Dim;
use accel_core::optim::{AdamConfig, AdamW, Schedule};
use accel_core::pipeline::{self, Pipeline};
use accel_core::strategy::cp::ContextParallel;
use accel_core::{AcceleratedOptimizer, Accelerator, Precision, PreparedLoader, Strategy};
use accel_examples::gpt::{Gpt, GptConfig};
use anyhow::{Context, Result, bail};
use clap::Parser;
use tch::nn::{self, Module};
use tch::{Kind, Tensor};

/// Train a character-level transformer on the KJV text.
#[derive(Debug, Parser)]
struct Args {
    /// Optimizer steps.
    #[arg(long, default_value_t = 600)]
    steps: u64,
    /// Sequences per micro-batch per process.
    #[arg(long, default_value_t = 16)]
    batch_size: usize,
    /// Characters of context.
    #[arg(long, default_value_t = 64)]
    context: i64,
    /// Model width.
    #[arg(long, default_value_t = 128)]
    width: i64,
    /// Transformer blocks.
    #[arg(long, default_value_t = 4)]
    blocks: i64,
    /// Attention heads.
    #[arg(long, default_value_t = 4)]
    heads: i64,
    /// Peak AdamW learning rate.
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
    /// `no`, `bf16`, `fp16` or `fp8` (default: the launcher's configuration, else no).
    #[arg(long)]
    precision: Option<Precision>,
    /// Held-out loss (nats per character) the run must reach.
    #[arg(long, default_value_t = 1.8)]
    target: f64,
    /// The text (default: data/kjv-genesis-exodus.txt).
    #[arg(long)]
    text: Option<PathBuf>,
    /// Also write the final held-out loss here, as JSON.
    #[arg(long)]
    metrics: Option<PathBuf>,
    /// Micro-batches per optimizer step (with a pipeline: in flight through it; default:
    /// the launcher's configuration, else 1).
    #[arg(long)]
    accumulate: Option<u32>,
    /// Tensor-parallel ranks.
    #[arg(long, default_value_t = 1)]
    tensor_parallel: usize,
    /// Sequence parallelism (with tensor parallelism).
    #[arg(long)]
    sequence_parallel: bool,
    /// Pipeline stages.
    #[arg(long, default_value_t = 1)]
    pipeline_parallel: usize,
    /// Context-parallel ranks: each sequence split among them (default: the launcher's
    /// configuration, else 1).
    #[arg(long)]
    context_parallel: Option<usize>,
    /// Pipeline schedule: `1f1b` or `gpipe`.
    #[arg(long, default_value = "1f1b")]
    schedule: String,
    /// Each step's training loss, one JSON line per step (rank 0).
    #[arg(long)]
    losses: Option<PathBuf>,
    /// The final weights, whole (rank 0).
    #[arg(long)]
    weights: Option<PathBuf>,
    /// Save a checkpoint every N optimizer steps (0: never), so that a restarted run loses
    /// at most N steps.
    #[arg(long, default_value_t = 0)]
    checkpoint_every: u64,
    /// Where the checkpoints go (the newest two are kept).
    #[arg(long, default_value = "target/char-lm/checkpoints")]
    checkpoint_dir: PathBuf,
    /// Continue from the newest complete checkpoint in CHECKPOINT_DIR. A run restarted by
    /// `accel launch --max-restarts` does so by itself.
    #[arg(long)]
    resume: bool,
    /// Fault injection for the restart tests: rank 1 dies (abort) after this step, on the
    /// first attempt only.
    #[arg(long, hide = true)]
    kill_after_step: Option<u64>,
}

/// The per-step loss log, keeping the lines of steps up to `step` (those a resumed run
/// does not repeat).
fn loss_log_from(path: &std::path::Path, step: u64) -> Result<std::fs::File> {
    let kept: Vec<String> = match std::fs::read_to_string(path) {
        Ok(old) if step > 0 => old
            .lines()
            .filter(|line| {
                serde_json::from_str::<serde_json::Value>(line)
                    .is_ok_and(|v| v["step"].as_u64().is_some_and(|s| s <= step))
            })
            .map(|line| format!("{line}\n"))
            .collect(),
        _ => Vec::new(),
    };
    std::fs::write(path, kept.concat()).with_context(|| format!("writing {}", path.display()))?;
    Ok(std::fs::OpenOptions::new().append(true).open(path)?)
}

/// Windows of `context + 1` characters starting every `stride`: inputs and next characters.
fn windows(ids: &Tensor, context: i64, stride: i64) -> Result<TensorDataset> {
    let starts = (ids.size()[0] - context - 1) / stride;
    let all = ids.unfold(0, context + 1, stride).narrow(0, 0, starts);
    Ok(TensorDataset::new(vec![all.narrow(1, 0, context), all.narrow(1, 1, context)])?)
}

/// The text as character ids: the vocabulary (sorted distinct characters), every
/// character's id, and the training and held-out windows.
struct Corpus {
    vocab: Vec<char>,
    ids: Tensor,
    train: TensorDataset,
    held_out: TensorDataset,
}

impl Corpus {
    fn read(args: &Args) -> Result<Self> {
        let path = (args.text.clone())
            .unwrap_or_else(|| accel_examples::data_dir().join("kjv-genesis-exodus.txt"));
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        let mut vocab: Vec<char> = text.chars().collect();
        vocab.sort_unstable();
        vocab.dedup();
        let ids: Vec<i64> = text.chars().map(|c| index(&vocab, c)).collect();
        let ids = Tensor::from_slice(&ids);
        let split = ids.size()[0] * 9 / 10;
        let train = windows(&ids.narrow(0, 0, split), args.context, args.context / 2)?;
        let held_out =
            windows(&ids.narrow(0, split, ids.size()[0] - split), args.context, args.context)?;
        Ok(Self { vocab, ids, train, held_out })
    }
}

fn index(vocab: &[char], c: char) -> i64 {
    vocab.binary_search(&c).expect("in the vocabulary") as i64
}

/// The accelerator the command line asks for; what it leaves out comes from `accel
/// launch`'s configuration.
fn accelerator(args: &Args) -> Result<Accelerator> {
    let mut builder = Accelerator::builder()
        .seed(0)
        .tensor_parallel(args.tensor_parallel)
        .sequence_parallel(args.sequence_parallel)
        .pipeline_parallel(args.pipeline_parallel)
        .checkpoints(&args.checkpoint_dir, Some(2));
    if let Some(precision) = args.precision {
        builder = builder.precision(precision);
    }
    if let Some(accumulate) = args.accumulate {
        builder = builder.accumulate(accumulate);
    }
    if let Some(ranks) = args.context_parallel {
        builder = builder.context_parallel(ranks);
    }
    Ok(builder.build()?)
}

/// The model as this process runs it: its part of the stages, of the heads (tensor
/// parallel) and of each sequence (context parallel).
struct Lm {
    acc: Accelerator,
    pipeline: Pipeline,
    model: Gpt,
    /// Every rank of a context group is dealt the same batches and keeps its part of each
    /// sequence (inputs and targets alike).
    cp: ContextParallel,
    staged: bool,
}

impl Lm {
    /// The mean held-out loss per character.
    fn evaluate(&self, held_out: &mut PreparedLoader<TensorDataset>) -> Result<f64> {
        let (acc, model, cp) = (&self.acc, &self.model, &self.cp);
        if self.staged {
            // Every held-out batch through the stages; each data-parallel replica's sums
            // added up (the padding of a last uneven round counts: a small bias of the metric).
            let batches: Vec<(Tensor, Tensor)> = held_out
                .iter()
                .map(|b| b.map(|b| (b[0].shallow_clone(), b[1].shallow_clone())))
                .collect::<accel_core::Result<_>>()?;
            let count: i64 = batches.iter().map(|(_, y)| y.numel() as i64).sum();
            let sums = self.pipeline.eval_step(
                acc,
                &batches,
                |x| model.forward_stage(x),
                |logits, y| model.token_losses(logits, y).sum(Kind::Float),
            )?;
            let totals = Tensor::from_slice(&[sums.iter().sum::<f64>(), count as f64]);
            acc.mesh().comm(Dim::Batch).all_reduce(&totals, ReduceOp::Sum)?;
            return Ok(totals.double_value(&[0]) / totals.double_value(&[1]));
        }
        let (mut total, mut count) = (0.0, 0i64);
        tch::no_grad(|| -> Result<()> {
            for batch in held_out.iter() {
                let batch = batch?;
                let input = cp.shard(&batch[0], 1)?;
                let logits = acc.forward(|| model.forward_stage(&input))?;
                let losses = model.token_losses(&logits, &cp.shard(&batch[1], 1)?);
                // Whole sequences from the context ranks, then the batches of every replica.
                let losses = acc.gather_for_metrics(&cp.gather(&losses, 1)?.view([-1]))?;
                total += losses.sum(Kind::Double).double_value(&[]);
                count += losses.numel() as i64;
            }
            Ok(())
        })?;
        Ok(total / count as f64)
    }

    /// One step's forward and backward on `batch` (or, through a pipeline, once a step's
    /// micro-batches are in `micro`); the losses it adds to `losses`. Whether the optimizer
    /// steps now.
    fn forward_backward(
        &self,
        batch: &[Tensor],
        micro: &mut Vec<(Tensor, Tensor)>,
        losses: &mut Vec<f64>,
    ) -> Result<bool> {
        let (acc, model, cp) = (&self.acc, &self.model, &self.cp);
        if self.staged {
            micro.push((batch[0].shallow_clone(), batch[1].shallow_clone()));
            if micro.len() < acc.config().accumulate as usize {
                return Ok(false);
            }
            *losses = self.pipeline.train_step(
                acc,
                micro,
                |x| model.forward_stage(x),
                |logits, y| model.loss(logits, y),
            )?;
            micro.clear();
            return Ok(true);
        }
        let input = cp.shard(&batch[0], 1)?;
        let logits = acc.forward(|| model.forward_stage(&input))?;
        let loss = model.loss(&logits, &cp.shard(&batch[1], 1)?);
        acc.backward(&loss)?;
        // The loss of the whole sequences: the mean of the context ranks' means.
        losses.push(cp.average(&loss)?.double_value(&[]));
        Ok(acc.sync_gradients())
    }

    /// `characters` characters after `prompt`, sampled with a little temperature (not
    /// through a pipeline: its stages would have to pass every character along).
    fn sample(&self, vocab: &[char], prompt: &str, context: i64, characters: usize) -> String {
        let mut text: Vec<i64> = prompt.chars().map(|c| index(vocab, c)).collect();
        let parts = self.acc.tensor_parallel().size() * self.cp.size();
        tch::no_grad(|| {
            tch::manual_seed(1);
            for _ in 0..characters {
                let start = text.len().saturating_sub(context as usize);
                // Sequence and context parallelism split the sequence: pad it on the right
                // (causal attention keeps the padding out of the real positions).
                let mut window = text[start..].to_vec();
                let real = window.len();
                window.resize(real.next_multiple_of(parts), 0);
                let input = Tensor::from_slice(&window).unsqueeze(0).to_device(self.acc.device());
                let logits =
                    self.model.forward(&input).select(1, real as i64 - 1).squeeze_dim(0) / 0.8;
                let next = logits.softmax(-1, Kind::Float).multinomial(1, false).int64_value(&[0]);
                text.push(next);
            }
        });
        text.iter().map(|&i| vocab[i as usize]).collect()
    }
}

/// Where a restarted run continues: the newest complete checkpoint's step (`accel launch
/// --max-restarts` counts the attempts), else 0.
fn resume(acc: &Accelerator, asked: bool, restarted: bool) -> Result<u64> {
    if !(asked || restarted) {
        return Ok(0);
    }
    Ok(match acc.load_latest_checkpoint()? {
        Some(dir) => {
            let counters = acc.counters();
            let step = counters.optimizer_steps + counters.skipped_steps;
            acc.print(format!("resumed from {} at step {step}", dir.display()));
            step
        }
        None => {
            acc.print("no checkpoint to resume from; starting afresh");
            0
        }
    })
}

/// AdamW with a cosine schedule over `args.steps`. As in Accelerate, the schedule advances
/// once per data-parallel replica at each optimizer step, so its length counts the same way.
fn optimizer(acc: &Accelerator, vs: &nn::VarStore, args: &Args) -> Result<AcceleratedOptimizer> {
    let mut opt = acc.prepare_optimizer(AdamW::new(
        acc.params(vs),
        AdamConfig { lr: args.lr, weight_decay: 0.1, ..AdamConfig::adamw() },
    )?);
    let replicas = acc.mesh().dims().size(Dim::Batch) as u64;
    opt.set_schedule(Schedule::CosineWarmup {
        warmup_steps: args.steps * replicas / 20,
        total_steps: args.steps * replicas,
        num_cycles: 0.5,
    })?;
    Ok(opt)
}

/// The run in one line: the model, the text, the processes and the steps.
fn describe(acc: &Accelerator, args: &Args, corpus: &Corpus, parameters: i64) -> String {
    format!(
        "{parameters} parameters here ({} blocks of width {}), {} characters ({} distinct), {} \
         process(es) ({}), strategy {}, {} steps of {} x {} characters per replica",
        args.blocks,
        args.width,
        corpus.ids.size()[0],
        corpus.vocab.len(),
        acc.num_processes(),
        acc.mesh().dims(),
        match acc.config().strategy {
            Strategy::Single if acc.num_processes() > 1 => Strategy::Ddp,
            other => other,
        },
        args.steps,
        args.batch_size,
        args.context
    )
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.width % args.heads != 0 {
        bail!("--width {} is not divisible by --heads {}", args.width, args.heads);
    }
    let acc = accelerator(&args)?;
    let cp = acc.context_parallel();
    let schedule = match args.schedule.as_str() {
        "1f1b" => pipeline::Schedule::OneForwardOneBackward,
        "gpipe" => pipeline::Schedule::GPipe,
        other => bail!("unknown schedule `{other}`; use 1f1b or gpipe"),
    };
    let pipeline = Pipeline::new(&acc, schedule);
    let corpus = Corpus::read(&args)?;

    let vs = nn::VarStore::new(acc.device());
    let config = GptConfig {
        vocab: corpus.vocab.len() as i64,
        context: args.context,
        width: args.width,
        blocks: args.blocks,
        heads: args.heads,
        seed: 0,
    };
    let layers = pipeline.layers(config.layers())?;
    let model = Gpt::split(&acc, &vs.root(), &config, &acc.tensor_parallel(), &cp, layers)?;
    acc.prepare_model(&vs)?;
    let parameters: i64 = vs.trainable_variables().iter().map(|t| t.numel() as i64).sum();
    let mut opt = optimizer(&acc, &vs, &args)?;
    acc.print(describe(&acc, &args, &corpus, parameters));
    let options = |shuffle: bool| LoaderOptions {
        batch_size: args.batch_size,
        sampler: if shuffle { Sampler::Shuffled { seed: 0 } } else { Sampler::Sequential },
        ..Default::default()
    };
    let mut loader = acc.prepare_loader(DataLoader::new(corpus.train, options(true))?)?;
    let mut held_out = acc.prepare_loader(DataLoader::new(corpus.held_out, options(false))?)?;
    let staged = pipeline.stages() > 1;
    let lm = Lm { acc, pipeline, model, cp, staged };
    let acc = &lm.acc;

    let restarted = std::env::var("ACCEL_RESTART_COUNT").is_ok_and(|n| n.trim() != "0");
    let mut step = resume(acc, args.resume, restarted)?;
    let mut loss_log = match (&args.losses, acc.is_main_process()) {
        (Some(path), true) => Some(loss_log_from(path, step)?),
        _ => None,
    };
    let bar = acc.progress_bar(args.steps);
    bar.set_position(step);
    let started = std::time::Instant::now();
    // A pipeline takes its step's micro-batches at once; otherwise each batch runs its
    // backward as it comes and the optimizer steps when the accumulation window closes.
    let mut micro: Vec<(Tensor, Tensor)> = Vec::new();
    let mut losses: Vec<f64> = Vec::new();
    'train: loop {
        for batch in loader.iter() {
            if !lm.forward_backward(&batch?, &mut micro, &mut losses)? {
                continue;
            }
            opt.step()?;
            opt.zero_grad()?;
            step += 1;
            bar.inc(1);
            let mean = losses.iter().sum::<f64>() / losses.len() as f64;
            losses.clear();
            if let Some(log) = &mut loss_log {
                writeln!(log, "{}", serde_json::json!({ "step": step, "loss": mean }))?;
            }
            if step % 100 == 0 || step == args.steps {
                let train_loss =
                    acc.reduce(&Tensor::from_slice(&[mean]), ReduceOp::Avg)?.double_value(&[0]);
                let held = lm.evaluate(&mut held_out)?;
                bar.suspend(|| {
                    acc.print(format!(
                        "step {step:5}  train loss {train_loss:.3}  held-out loss {held:.3}"
                    ))
                });
            }
            if args.checkpoint_every > 0 && step % args.checkpoint_every == 0 && step < args.steps {
                bar.suspend(|| acc.save_checkpoint())?;
            }
            if args.kill_after_step == Some(step) && !restarted && acc.process_index() == 1 {
                eprintln!("rank 1 aborts after step {step} (--kill-after-step)");
                std::process::abort();
            }
            if step >= args.steps {
                break 'train;
            }
        }
    }
    bar.finish_and_clear();
    let held = lm.evaluate(&mut held_out)?;
    acc.end_training()?;
    let weights = acc.full_state_dict(&vs)?;
    if let (Some(path), true) = (&args.weights, acc.is_main_process()) {
        Tensor::write_safetensors(&weights, path)?;
    }

    let sample =
        lm.sample(&corpus.vocab, "And God said", args.context, if staged { 0 } else { 300 });
    acc.print(format!(
        "done in {:.1} s: held-out loss {held:.3} nats/char (target {:.2}); sample:\n{sample}",
        started.elapsed().as_secs_f64(),
        args.target
    ));
    if let (Some(path), true) = (&args.metrics, acc.is_main_process()) {
        std::fs::write(path, serde_json::json!({ "held_out_loss": held }).to_string())?;
    }
    if held > args.target {
        bail!("held-out loss {held:.3} is above the target {:.2}", args.target);
    }
    Ok(())
}
