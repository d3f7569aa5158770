//! The main job: an MLP learns the 8x8 handwritten digits shipped in data/ and must reach
//! 95% accuracy on the 360 held-out images. It uses accel's explicit API: the accelerator
//! (data parallelism, mixed precision, accumulation), accel's AdamW with a cosine schedule,
//! sharded shuffled loaders, evaluation through `gather_for_metrics` (exactly the 360
//! images, whatever the number of processes), a progress bar, trackers (JSONL/CSV by
//! default; `--log-with tensorboard|mlflow|jsonl|all`), a loss-curve PNG and a checkpoint it
//! can resume from.
//!
//!     cargo xtask train                 (2 processes on CPU; installs libtorch on first use)
//!     cargo run -p accel-examples --example train -- --precision bf16 --accumulate 2
//!     accel launch --num-processes 2 target/debug/examples/train --resume
//!     accel launch --num-processes 2 --max-restarts 3 target/debug/examples/train   # resumes itself
//!     MLFLOW_TRACKING_URI=http://127.0.0.1:5000 cargo xtask train --log-with mlflow,jsonl

use std::path::PathBuf;

use accel_core::comm::ReduceOp;
use accel_core::data::{DataLoader, LoaderOptions, Sampler, TensorDataset};
use accel_core::mesh::Dim;
use accel_core::optim::{AdamConfig, AdamW, Schedule};
use accel_core::tracking::{Value, plot};
use accel_core::{AcceleratedOptimizer, Accelerator, LogWith, Precision};
use accel_examples::Digits;
use anyhow::{Result, bail};
use clap::Parser;
use tch::nn::{self, Module};
use tch::{Kind, Tensor};

/// Train an MLP on the 8x8 digits.
#[derive(Debug, Parser)]
struct Args {
    /// Passes over the 1,437 training images.
    #[arg(long, default_value_t = 30)]
    epochs: u64,
    /// Images per micro-batch.
    #[arg(long, default_value_t = 32)]
    batch_size: usize,
    /// Micro-batches per optimizer step (default: the launcher's configuration, else 1).
    #[arg(long)]
    accumulate: Option<u32>,
    /// `no`, `bf16` or `fp16` (default: the launcher's configuration, else no).
    #[arg(long)]
    precision: Option<Precision>,
    /// Peak AdamW learning rate.
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
    /// Width of the two hidden layers.
    #[arg(long, default_value_t = 128)]
    hidden: i64,
    /// Seed of initialisation and shuffling.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Run on CPU even where a GPU is available.
    #[arg(long)]
    cpu: bool,
    /// Where metrics and checkpoints go.
    #[arg(long, default_value = "target/train-digits")]
    out: PathBuf,
    /// Trackers, comma-separated: tensorboard, jsonl, mlflow (MLFLOW_TRACKING_URI names the
    /// server), all (default: the launcher's `--log-with`, else jsonl).
    #[arg(long, value_parser = |s: &str| LogWith::parse_list(s).map(TrackerList).map_err(|e| e.to_string()))]
    log_with: Option<TrackerList>,
    /// Continue from the newest checkpoint in OUT/checkpoints. A run restarted by `accel
    /// launch --max-restarts` does so by itself.
    #[arg(long)]
    resume: bool,
    /// Save a checkpoint every N epochs (and at the end; 0: at the end only), so that a
    /// restarted run loses at most N epochs.
    #[arg(long, default_value_t = 5)]
    checkpoint_every: u64,
    /// Fault injection for the restart test: rank 1 fails after this epoch, on the first
    /// attempt only.
    #[arg(long, hide = true)]
    fail_after_epoch: Option<u64>,
    /// Accuracy on the held-out images that the run must reach.
    #[arg(long, default_value_t = 0.95)]
    target: f64,
}

/// `--log-with`'s value (clap takes a `Vec` field as repeated flags, so it is wrapped).
#[derive(Debug, Clone)]
struct TrackerList(Vec<LogWith>);

fn mlp(root: &nn::Path, hidden: i64) -> impl Module + use<> {
    nn::seq()
        .add(nn::linear(root / "layers" / 0, 64, hidden, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(root / "layers" / 1, hidden, hidden, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(root / "layers" / 2, hidden, 10, Default::default()))
}

/// Accuracy over the whole test set: each process scores its shard, and
/// `gather_for_metrics` brings back exactly the 360 results (the padding dropped).
fn accuracy(
    acc: &Accelerator,
    net: &impl Module,
    test: &mut accel_core::PreparedLoader<TensorDataset>,
) -> Result<(f64, i64)> {
    let (mut correct, mut seen) = (0.0, 0);
    for batch in test.iter() {
        let batch = batch?;
        let logits = tch::no_grad(|| acc.forward(|| net.forward(&batch[0])))?;
        let hits = acc.gather_for_metrics(&logits.argmax(-1, false).eq_tensor(&batch[1]))?;
        correct += hits.to_kind(Kind::Float).sum(Kind::Float).double_value(&[]);
        seen += hits.size()[0];
    }
    Ok((correct / seen.max(1) as f64, seen))
}

/// The test digits the model gets wrong (every process's, gathered), up to 16: one image (a
/// row of the 8x8 digits, each scaled to its own range and enlarged 4 times, a gap between)
/// and a table of their labels and the model's guesses.
fn misclassified(
    acc: &Accelerator,
    net: &impl Module,
    test: &mut accel_core::PreparedLoader<TensorDataset>,
) -> Result<Option<(Tensor, Vec<Vec<serde_json::Value>>)>> {
    let (mut images, mut rows) = (Vec::new(), Vec::new());
    for batch in test.iter() {
        let batch = batch?;
        let logits = tch::no_grad(|| acc.forward(|| net.forward(&batch[0])))?;
        let guess = acc.gather_for_metrics(&logits.argmax(-1, false))?;
        let label = acc.gather_for_metrics(&batch[1])?;
        let pixels = acc.gather_for_metrics(&batch[0])?;
        for i in Vec::<i64>::try_from(guess.ne_tensor(&label).nonzero().view([-1]))? {
            if images.len() < 16 {
                let digit = pixels.get(i).view([8, 8]);
                let (low, high) = (digit.min(), digit.max());
                let scaled = (&digit - &low) / (high - &low).clamp_min(1e-6);
                let big = scaled
                    .repeat_interleave_self_int(4, 0, None)
                    .repeat_interleave_self_int(4, 1, None);
                images.push(big.constant_pad_nd([0, 2]));
                rows.push(vec![label.int64_value(&[i]).into(), guess.int64_value(&[i]).into()]);
            }
        }
    }
    if images.is_empty() {
        return Ok(None);
    }
    Ok(Some((Tensor::cat(&images, 1).unsqueeze(0), rows)))
}

/// The accelerator the command line asks for (what it leaves out comes from `accel launch`'s
/// configuration), and the trackers' project name: OUT's parent is the project folder, OUT
/// the project, so that the trackers write to OUT itself.
fn accelerator(args: &Args) -> Result<(Accelerator, String)> {
    let mut builder =
        Accelerator::builder().seed(args.seed).checkpoints(args.out.join("checkpoints"), Some(2));
    let (project_dir, project) = match (args.out.parent(), args.out.file_name()) {
        (Some(parent), Some(name)) => (parent.to_path_buf(), name.to_string_lossy().into_owned()),
        _ => bail!("--out {} must name a folder", args.out.display()),
    };
    builder = builder.project_dir(project_dir);
    match &args.log_with {
        Some(list) => builder = builder.log_with(list.0.clone()),
        None if std::env::var_os("ACCEL_LOG_WITH").is_none() => {
            builder = builder.log_with([LogWith::Jsonl])
        }
        None => {}
    }
    if args.cpu {
        builder = builder.cpu(true);
    }
    if let Some(precision) = args.precision {
        builder = builder.precision(precision);
    }
    if let Some(accumulate) = args.accumulate {
        builder = builder.accumulate(accumulate);
    }
    Ok((builder.build()?, project))
}

/// AdamW with a cosine schedule over `optimizer_steps`. As in Accelerate, the schedule
/// advances once per data-parallel replica at each optimizer step (it counts the samples of
/// every replica), so its length counts the same way.
fn optimizer(
    acc: &Accelerator,
    vs: &nn::VarStore,
    args: &Args,
    optimizer_steps: u64,
) -> Result<AcceleratedOptimizer> {
    let mut opt = acc.prepare_optimizer(AdamW::new(
        acc.params(vs),
        AdamConfig { lr: args.lr, ..AdamConfig::adamw() },
    )?);
    let schedule_steps = optimizer_steps * acc.mesh().dims().size(Dim::Data) as u64;
    opt.set_schedule(Schedule::CosineWarmup {
        warmup_steps: schedule_steps / 20,
        total_steps: schedule_steps,
        num_cycles: 0.5,
    })?;
    Ok(opt)
}

/// The loss curve drawn from the JSONL metrics, where the main process writes them; its
/// PNG's path.
fn plot_curves(acc: &Accelerator, args: &Args) -> Result<PathBuf> {
    let curve = args.out.join("loss_curve.png");
    let jsonl = args.out.join("metrics.jsonl");
    if acc.is_main_process()
        && acc.config().log_with.iter().any(|w| matches!(w, LogWith::Jsonl | LogWith::All))
    {
        let title = format!("MLP on the 8x8 digits, {} process(es)", acc.num_processes());
        let svg = args.out.join("loss_curve.svg");
        plot::plot_jsonl(&jsonl, &title, &[&curve, &svg])?;
    }
    Ok(curve)
}

/// The trackers, with the run's settings as their configuration.
fn init_trackers(acc: &Accelerator, args: &Args, project: &str) -> Result<()> {
    acc.init_trackers(
        project,
        &serde_json::json!({
            "epochs": args.epochs,
            "batch_size": args.batch_size,
            "accumulate": acc.config().accumulate,
            "precision": acc.config().precision.to_string(),
            "lr": args.lr,
            "hidden": args.hidden,
            "seed": args.seed,
            "processes": acc.num_processes(),
        }),
    )?;
    Ok(())
}

/// Continues from the newest checkpoint when asked (`--resume`) or restarted (`accel launch
/// --max-restarts` counts the attempts); whether this is a restart.
fn resume(acc: &Accelerator, args: &Args) -> Result<bool> {
    let restarted = std::env::var("ACCEL_RESTART_COUNT").is_ok_and(|n| n.trim() != "0");
    if args.resume || restarted {
        match acc.load_latest_checkpoint()? {
            Some(dir) => acc.print(format!("resumed from {}", dir.display())),
            None => acc.print("no checkpoint to resume from; starting afresh"),
        }
    }
    Ok(restarted)
}

fn main() -> Result<()> {
    let args = Args::parse();
    let (acc, project) = accelerator(&args)?;
    let device = acc.device();
    let data = Digits::load(device)?;

    let vs = nn::VarStore::new(device);
    let net = mlp(&vs.root(), args.hidden);
    acc.prepare_model(&vs)?;
    let loader = DataLoader::new(
        TensorDataset::new(vec![data.train_x.shallow_clone(), data.train_y.shallow_clone()])?,
        LoaderOptions {
            batch_size: args.batch_size,
            sampler: Sampler::Shuffled { seed: args.seed },
            ..Default::default()
        },
    )?;
    let mut loader = acc.prepare_loader(loader)?;
    let test = DataLoader::new(
        TensorDataset::new(vec![data.test_x.shallow_clone(), data.test_y.shallow_clone()])?,
        LoaderOptions { batch_size: 64, ..Default::default() },
    )?;
    let mut test = acc.prepare_loader(test)?;
    let micro_steps = args.epochs * loader.len() as u64;
    let optimizer_steps = micro_steps.div_ceil(u64::from(acc.config().accumulate));
    let mut opt = optimizer(&acc, &vs, &args, optimizer_steps)?;
    let restarted = resume(&acc, &args)?;
    acc.print(format!(
        "training a 64-{h}-{h}-10 MLP on {} digits with {} process(es): {} epochs of {} \
         batches of {} per process, accumulate {}, precision {}, on {device:?}",
        data.train_x.size()[0],
        acc.num_processes(),
        args.epochs,
        loader.len(),
        args.batch_size,
        acc.config().accumulate,
        acc.config().precision,
        h = args.hidden,
    ));

    // After a resume, so that the JSONL file is added to rather than started over.
    init_trackers(&acc, &args, &project)?;
    let bar = acc.progress_bar(micro_steps);
    bar.set_position(acc.counters().micro_steps_total);
    let started = std::time::Instant::now();
    for epoch in loader.epoch()..args.epochs {
        let (mut total, mut batches) = (0.0, 0);
        for batch in loader.iter() {
            let batch = batch?;
            let logits = acc.forward(|| net.forward(&batch[0]))?;
            let loss = logits.cross_entropy_for_logits(&batch[1]);
            acc.backward(&loss)?;
            opt.step()?;
            opt.zero_grad()?;
            total += loss.double_value(&[]);
            batches += 1;
            bar.inc(1);
        }
        let (test_accuracy, _) = accuracy(&acc, &net, &mut test)?;
        // The mean training loss over every process's batches.
        let mean_loss = total / f64::from(batches.max(1));
        let mean_loss = acc.reduce(&Tensor::from(mean_loss), ReduceOp::Avg)?.double_value(&[]);
        bar.set_message(format!("loss {mean_loss:.4}"));
        acc.log(
            epoch + 1,
            &[("loss", mean_loss), ("test_accuracy", test_accuracy), ("lr", opt.lr())],
        )?;
        if args.checkpoint_every > 0
            && (epoch + 1) % args.checkpoint_every == 0
            && epoch + 1 < args.epochs
        {
            bar.suspend(|| acc.save_checkpoint()).map(|_| ())?;
        }
        if args.fail_after_epoch == Some(epoch + 1) && !restarted && acc.process_index() == 1 {
            bail!("injected failure after epoch {} (--fail-after-epoch)", epoch + 1);
        }
        if (epoch + 1) % 5 == 0 || epoch == 0 || epoch + 1 == args.epochs {
            bar.suspend(|| {
                acc.print(format!(
                    "epoch {:3}  loss {mean_loss:.4}  test accuracy {:.2}%",
                    epoch + 1,
                    100.0 * test_accuracy
                ))
            });
        }
    }
    bar.finish_and_clear();
    let checkpoint = acc.save_checkpoint()?;
    let (final_accuracy, scored) = accuracy(&acc, &net, &mut test)?;
    // What the model still gets wrong, in every tracker that keeps images and tables.
    if let Some((grid, rows)) = misclassified(&acc, &net, &mut test)? {
        acc.log(
            args.epochs,
            &[
                ("misclassified", Value::image(&grid)?),
                ("misclassified_digits", Value::table(["label", "guess"], rows)?),
            ],
        )?;
    }
    // The trackers finish here (MLflow's run FINISHED); a failure before leaves it FAILED.
    acc.end_training()?;
    let curve = plot_curves(&acc, &args)?;
    acc.print(format!(
        "done in {:.1} s: test accuracy {:.2}% on {scored} images (target {:.0}%)\n  metrics {}, \
         curves {} (and .svg: training loss, test accuracy, learning rate), checkpoint {}",
        started.elapsed().as_secs_f64(),
        100.0 * final_accuracy,
        100.0 * args.target,
        args.out.join("metrics.jsonl").display(),
        curve.display(),
        checkpoint.display()
    ));
    if final_accuracy < args.target {
        bail!(
            "test accuracy {:.2}% is below the target {:.0}%",
            100.0 * final_accuracy,
            100.0 * args.target
        );
    }
    Ok(())
}
