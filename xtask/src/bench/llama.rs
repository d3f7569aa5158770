//! `cargo xtask bench llama` (and the second half of `cargo xtask bench memory`): a 106M
//! Llama loading, resuming and fine-tuning on 4 processes beside PyTorch, and the README's
//! `strategy = "fsdp"` example; written to bench/llama.json.

use std::path::{Path, PathBuf};
use std::process::Command;

use super::{highest, load_peak, memory_figures, rank_results};
use crate::results::{IN_BACKWARD_RESULTS, LLAMA_RESULTS, Report, write_block_results};
use crate::{cargo, root, run};

/// Bytes per process, in the figures.
const MIB: f64 = 1024.0 * 1024.0;

/// A ~100M-parameter Llama on 4 processes: peak memory per process while loading under ddp
/// and zero3, and while training under zero3 with and without activation checkpointing,
/// beside PyTorch FSDP2 (+ checkpoint_wrapper) on the same model.
pub(crate) fn llama_memory_bench() -> Result<(), String> {
    cargo(
        &["build", "--release", "-p", "accel-core", "--bin", "accel", "-p", "accel-examples"],
        &["--example".into(), "llama".into(), "--example".into(), "fsdp_unchanged".into()],
    )?;
    let root = root();
    let runs = LlamaRuns::new(&root);
    runs.make_inputs()?;
    eprintln!(
        "xtask: measuring the Llama: loading and training on 4 processes (several minutes) ..."
    );
    let mut report = Report::default();
    loading_rows(&mut report, &runs)?;
    resume_rows(&mut report, &runs)?;
    readme_example_rows(&mut report, &root)?;
    fine_tuning_rows(&mut report, &runs)?;
    write_block_results(LLAMA_RESULTS, "cargo xtask bench llama", &report, None)
}

/// Where the Llama benchmark's inputs and programs are, and the commands it runs.
struct LlamaRuns {
    /// target/bench-llama: the model, the tokens, the runs' outputs and saved states.
    dir: PathBuf,
    python: PathBuf,
    script: PathBuf,
    model: PathBuf,
    /// Rows of 128 tokens; `long`: of 1024.
    tokens: PathBuf,
    long: PathBuf,
    accel: PathBuf,
    llama: PathBuf,
    torchrun: PathBuf,
}

impl LlamaRuns {
    fn new(root: &Path) -> Self {
        let dir = root.join("target/bench-llama");
        LlamaRuns {
            python: root.join(".venv/bin/python"),
            script: root.join("python/reference/llama_reference.py"),
            model: dir.join("model-100m"),
            tokens: dir.join("tokens.safetensors"),
            long: dir.join("tokens-1024.safetensors"),
            accel: root.join("target/release/accel"),
            llama: root.join("target/release/examples/llama"),
            torchrun: root.join(".venv/bin/torchrun"),
            dir,
        }
    }

    /// The model (made once, kept under target/) and the tokens (made every run).
    fn make_inputs(&self) -> Result<(), String> {
        if !self.model.join("config.json").exists() {
            run(Command::new(&self.python)
                .arg(&self.script)
                .args(["make", "--size", "100m", "--out"])
                .arg(&self.model))?;
        }
        for (len, path) in [("128", &self.tokens), ("1024", &self.long)] {
            run(Command::new(&self.python)
                .arg(&self.script)
                .args(["tokens", "--rows", "16", "--len", len, "--vocab", "32000", "--out"])
                .arg(path))?;
        }
        Ok(())
    }

    /// The token file of rows of `len` tokens (128 or 1024).
    fn tokens_of(&self, len: usize) -> &Path {
        if len == 1024 { &self.long } else { &self.tokens }
    }

    /// accel's run of the Llama example on `n` processes.
    fn ours(&self, n: usize, strategy: &str, steps: &str, checkpointing: bool) -> Command {
        self.ours_on(128, n, strategy, steps, checkpointing)
    }

    /// [`LlamaRuns::ours`] on rows of `len` tokens.
    fn ours_on(&self, len: usize, n: usize, strategy: &str, steps: &str, ckpt: bool) -> Command {
        let checkpointing = ckpt;
        let mut c = Command::new(&self.accel);
        c.args(["launch", "--num-processes", &n.to_string(), "--main-process-port", "0", "--cpu"])
            .arg(&self.llama)
            .arg("--model")
            .arg(&self.model)
            .arg("--data")
            .arg(self.tokens_of(len))
            .args(["--steps", steps, "--batch-size", "2", "--lr", "1e-4", "--strategy", strategy])
            .arg("--out")
            .arg(self.dir.join("out"))
            .env("MALLOC_MMAP_THRESHOLD_", "65536");
        if checkpointing {
            c.arg("--activation-checkpointing");
        }
        c
    }

    /// PyTorch's run of the same model on `n` processes: FSDP2, or DDP with `ddp`.
    fn theirs(&self, n: usize, checkpointing: bool, ddp: bool) -> Command {
        self.theirs_on(128, n, checkpointing, ddp)
    }

    /// [`LlamaRuns::theirs`] on rows of `len` tokens.
    fn theirs_on(&self, len: usize, n: usize, checkpointing: bool, ddp: bool) -> Command {
        let mut c = Command::new(&self.torchrun);
        c.args([format!("--nproc-per-node={n}").as_str(), "--master-port=29793"])
            .arg(&self.script)
            .arg("memory")
            .arg("--model")
            .arg(&self.model)
            .arg("--data")
            .arg(self.tokens_of(len))
            .args(["--steps", "3", "--batch-size", "2"])
            .env("MALLOC_MMAP_THRESHOLD_", "65536");
        if checkpointing {
            c.arg("--checkpointing");
        }
        if ddp {
            c.arg("--ddp");
        }
        c
    }
}

/// The update inside backward (`optimizer_in_backward`; torchtune's `optimizer_in_bwd` on
/// FSDP2) beside the ordinary step, on both sides, ± activation checkpointing: the peak per
/// process at 128 tokens on 2 and 4 processes and at 1024 on 2, with each peak's ratio to
/// FSDP2's ordinary step (what users run); written to bench/in-backward.json. Peaks repeat
/// from run to run, so each command runs once; step times are shown, not compared.
pub(crate) fn in_backward_bench() -> Result<(), String> {
    cargo(
        &["build", "--release", "-p", "accel-core", "--bin", "accel", "-p", "accel-examples"],
        &["--example".into(), "llama".into()],
    )?;
    let runs = LlamaRuns::new(&root());
    runs.make_inputs()?;
    eprintln!("xtask: the Llama with the update inside backward, beside PyTorch (~45 minutes) ...");
    let mut report = Report::default();
    report.say(
        "the update inside backward (AdamW, batch 2 rows per process, steps 2-3, sdpa): accel \
         zero3 with optimizer_in_backward beside its ordinary step, and PyTorch FSDP2 with \
         torchtune's optimizer_in_bwd (an AdamW per parameter stepped by its \
         post-accumulate-grad hook) beside its own; accel's rows with the logits computed \
         whole (--loss logits, as transformers computes them) and with the head fused into \
         the loss (the example's default; Llama::forward_loss: no B x T x vocab logits, and \
         under zero3 the head computed on its shards, never gathered); peak \
         resident memory per process above its baseline, and its ratio to FSDP2's ordinary \
         step's:",
    );
    report.say(format!(
        "{:<5} {:<3} {:<66} {:>9} {:>9} {:>7}",
        "len", "N", "", "peak MiB", "vs FSDP2", "step s"
    ));
    for (len, n) in [(128usize, 2usize), (128, 4), (1024, 2)] {
        for ckpt in [false, true] {
            let in_backward = |c| with(c, &["--optimizer-in-backward"]);
            let logits = |c| with(c, &["--loss", "logits"]);
            let suffix = if ckpt { " + activation ckpt" } else { "" };
            let rows = [
                (format!("PyTorch FSDP2{suffix}"), runs.theirs_on(len, n, ckpt, false)),
                (
                    format!("PyTorch FSDP2{suffix} + optimizer_in_bwd"),
                    in_backward(runs.theirs_on(len, n, ckpt, false)),
                ),
                (format!("accel zero3{suffix}"), logits(runs.ours_on(len, n, "zero3", "3", ckpt))),
                (
                    format!("accel zero3{suffix} + optimizer_in_backward"),
                    logits(in_backward(runs.ours_on(len, n, "zero3", "3", ckpt))),
                ),
            ];
            // With the head fused into the loss (the example's default): no B × T × vocab
            // logits, and under zero3 the head computed on its shards.
            let fused_rows = [
                (
                    format!("accel zero3{suffix}, fused loss"),
                    runs.ours_on(len, n, "zero3", "3", ckpt),
                ),
                (
                    format!("accel zero3{suffix} + optimizer_in_backward, fused loss"),
                    in_backward(runs.ours_on(len, n, "zero3", "3", ckpt)),
                ),
            ];
            let rows = rows.into_iter().chain(fused_rows);
            let mut reference = None;
            for (name, mut command) in rows {
                let (peak, step, _) = memory_figures(&mut command, n)?;
                let base = *reference.get_or_insert(peak);
                report.say(format!(
                    "{len:<5} {n:<3} {name:<66} {:>9.0} {:>8.2}x {step:>7.2}",
                    peak / MIB,
                    peak / base
                ));
                let key = figure_key(&name);
                report.figure(&format!("{len}.{n}.{key}.peak_mib"), peak / MIB);
            }
        }
    }
    write_block_results(IN_BACKWARD_RESULTS, "cargo xtask bench in-backward", &report, None)
}

/// `command` with `args` added (flags both sides take).
fn with(mut command: Command, args: &[&str]) -> Command {
    command.args(args);
    command
}

/// `command` with LoRA r8 (either side's flag).
fn lora(command: Command) -> Command {
    with(command, &["--lora-r", "8"])
}

/// A row's name as a figure's key: lower case, every other character `_`.
fn figure_key(name: &str) -> String {
    name.chars()
        .map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_lowercase() } else { '_' })
        .collect()
}

/// Loading the checkpoint on 4 processes, ddp beside zero3 (each process reading its shard).
fn loading_rows(report: &mut Report, runs: &LlamaRuns) -> Result<(), String> {
    let model_bytes = 106.0e6 * 4.0;
    let ddp = load_peak(&mut runs.ours(4, "ddp", "0", false), 4)?;
    let zero3 = load_peak(&mut runs.ours(4, "zero3", "0", false), 4)?;
    report.say(
        "Llama, 106M parameters (405 MiB in fp32; vocabulary 32000, width 768, 8 layers; every \
         layer, the embedding and the head a unit), 4 processes, CPU, 1 thread per process;\n\
         peak resident memory per process above its baseline (max over ranks)",
    );
    report.say(format!(
        "loading (`prepare_model_from_checkpoint`, each process reading its own shard under \
         zero3): ddp {:.0} MiB, zero3 {:.0} MiB — zero3 saves {:.0} MiB, {:.0}% of the model's bytes",
        ddp / MIB,
        zero3 / MIB,
        (ddp - zero3) / MIB,
        100.0 * (ddp - zero3) / model_bytes
    ));
    report.figure("load_4_ddp_mib", ddp / MIB);
    report.figure("load_4_zero3_mib", zero3 / MIB);
    Ok(())
}

/// Fine-tuning: each of accel's setups beside its PyTorch counterpart (peak, step time,
/// tokens/s), at 128 tokens per row on 2 and 4 processes and at 1024 on 2; both sides with
/// transformers' default attention (sdpa). Each pair runs twice, alternating; both step
/// times are shown, and the ratio is of the better of each side's two.
fn fine_tuning_rows(report: &mut Report, runs: &LlamaRuns) -> Result<(), String> {
    report.say(
        "fine-tuning (AdamW, batch 2 rows per process, steps 2-3; attention: sdpa on both \
         sides, transformers' default; accel beside torch's FSDP2 (fully_shard per decoder \
         layer, the embedding and the head, as Accelerate's FSDP2 plugin wraps) and DDP — \
         Accelerate itself runs its FSDP plugin as DDP on CPU; LoRA r8 on q_proj and v_proj, \
         the base frozen, beside transformers + peft + Accelerate; accel's loss fused with \
         its head (the example's default, Llama::forward_loss), transformers' from the \
         logits (.loss); two rounds, alternating, step times of both shown, ratio of the \
         better of each):",
    );
    report.say(format!(
        "{:<5} {:<3} {:<34} {:>9} {:>11} {:>9} {:>8}",
        "len", "N", "", "peak MiB", "step s", "tokens/s", "vs torch"
    ));
    for (len, n) in [(128usize, 2usize), (128, 4), (1024, 2)] {
        for (name, ours, their_name, theirs) in setups(runs, len, n) {
            let mut ours_seen = Vec::new();
            let mut theirs_seen = Vec::new();
            for _ in 0..2 {
                ours_seen.push(memory_figures(&mut ours(), n)?);
                theirs_seen.push(memory_figures(&mut theirs(), n)?);
            }
            let tokens = (2 * len * n) as f64;
            let row = |who: &str, seen: &[(f64, f64, f64)]| {
                let peak = seen.iter().map(|r| r.0).fold(0.0, f64::max);
                let best = seen.iter().map(|r| r.1).fold(f64::MAX, f64::min);
                (format!("{:.2}/{:.2}", seen[0].1, seen[1].1), peak, tokens / best, who.to_owned())
            };
            let (ours_steps, peak, speed, _) = row(name, &ours_seen);
            let (their_steps, their_peak, their_speed, _) = row(their_name, &theirs_seen);
            report.say(format!(
                "{len:<5} {n:<3} {name:<34} {:>9.0} {ours_steps:>11} {speed:>9.1} {:>7.2}x",
                peak / MIB,
                speed / their_speed
            ));
            report.say(format!(
                "{len:<5} {n:<3} {their_name:<34} {:>9.0} {their_steps:>11} {their_speed:>9.1}",
                their_peak / MIB
            ));
            for (who, peak, speed) in [(name, peak, speed), (their_name, their_peak, their_speed)] {
                let key = figure_key(who);
                let at = if len == 128 { String::new() } else { format!("{len}.") };
                report.figure(&format!("{at}{n}.{key}.peak_mib"), peak / MIB);
                report.figure(&format!("{at}{n}.{key}.tokens_per_s"), speed);
            }
        }
    }
    Ok(())
}

/// A row's two commands, made afresh for each round.
type Maker<'a> = Box<dyn Fn() -> Command + 'a>;

/// The setups compared at `len` tokens on `n` processes: accel's name and command, and
/// PyTorch's. At 1024 tokens, the zero3 rows and LoRA (the rest would add half an hour).
fn setups(
    runs: &LlamaRuns,
    len: usize,
    n: usize,
) -> Vec<(&'static str, Maker<'_>, &'static str, Maker<'_>)> {
    let mut rows: Vec<(&'static str, Maker<'_>, &'static str, Maker<'_>)> = vec![
        (
            "accel zero3",
            Box::new(move || runs.ours_on(len, n, "zero3", "3", false)),
            "PyTorch FSDP2",
            Box::new(move || runs.theirs_on(len, n, false, false)),
        ),
        (
            "accel zero3 + activation ckpt",
            Box::new(move || runs.ours_on(len, n, "zero3", "3", true)),
            "PyTorch FSDP2 + checkpoint_wrapper",
            Box::new(move || runs.theirs_on(len, n, true, false)),
        ),
    ];
    if len == 128 {
        rows.push((
            "accel ddp",
            Box::new(move || runs.ours_on(len, n, "ddp", "3", false)),
            "PyTorch DDP",
            Box::new(move || runs.theirs_on(len, n, false, true)),
        ));
        rows.push((
            "accel ddp + LoRA r8",
            Box::new(move || lora(runs.ours_on(len, n, "ddp", "3", false))),
            "Accelerate + peft LoRA r8 (DDP)",
            Box::new(move || lora(runs.theirs_on(len, n, false, false))),
        ));
    }
    rows.push((
        "accel zero3 + LoRA r8 (base sharded)",
        Box::new(move || lora(runs.ours_on(len, n, "zero3", "3", false))),
        "Accelerate + peft LoRA r8 (DDP)",
        Box::new(move || lora(runs.theirs_on(len, n, false, false))),
    ));
    rows
}

/// Resuming the Llama under zero3 on 4 processes: the peak while loading the state beside
/// the peak while training (the same run's), and the bytes each process read, beside FSDP2
/// resuming with torch.distributed.checkpoint.
fn resume_rows(report: &mut Report, runs: &LlamaRuns) -> Result<(), String> {
    let (state, dcp) = (runs.dir.join("state-zero3-4"), runs.dir.join("state-fsdp2-4"));
    let _ = std::fs::remove_dir_all(&dcp);
    let mut save = runs.ours(4, "zero3", "3", false);
    rank_results(save.arg("--save-state").arg(&state), 4)?;
    let mut resume = runs.ours(4, "zero3", "3", false);
    let resumed = rank_results(resume.arg("--resume").arg(&state), 4)?;
    let (train, load) = (highest(&resumed, "peak_bytes"), highest(&resumed, "resume_peak_bytes"));
    let read = highest(&resumed, "state_bytes_read");
    let saved: u64 = std::fs::read_dir(&state)
        .map_err(|e| format!("{}: {e}", state.display()))?
        .filter_map(|e| e.ok()?.metadata().ok())
        .map(|m| m.len())
        .sum();
    let mut their_save = runs.theirs(4, false, false);
    rank_results(their_save.arg("--save-state").arg(&dcp), 4)?;
    let mut their_resume = runs.theirs(4, false, false);
    let their = rank_results(their_resume.arg("--resume").arg(&dcp), 4)?;
    let (their_train, their_load) =
        (highest(&their, "peak_bytes"), highest(&their, "resume_peak_bytes"));
    report.say(format!(
        "resuming (zero3, 4 processes, AdamW state): accel's peak while loading {:.0} MiB, \
         {:.2}x its training peak of {:.0} MiB; each process read at most {:.0} MiB of the \
         {:.0} MiB checkpoint. PyTorch FSDP2 + torch.distributed.checkpoint: {:.0} MiB while \
         loading, {:.2}x its training peak of {:.0} MiB",
        load / MIB,
        load / train,
        train / MIB,
        read / MIB,
        saved as f64 / MIB,
        their_load / MIB,
        their_load / their_train,
        their_train / MIB,
    ));
    report.figure("resume_4_zero3_load_mib", load / MIB);
    report.figure("resume_4_zero3_train_mib", train / MIB);
    report.figure("resume_4_zero3_read_mib", read / MIB);
    report.figure("resume_4_fsdp2_load_mib", their_load / MIB);
    report.figure("resume_4_fsdp2_train_mib", their_train / MIB);
    Ok(())
}

/// The README's line (`strategy = "fsdp"`) on its unchanged shape of loop, at 56.7M
/// parameters (examples/fsdp_unchanged.rs): peak per process on 1, 2 and 4 processes, with
/// the attribute's units and without (`ACCEL_WRAP=none`, every parameter whole as under
/// zero2), beside FSDP2 `fully_shard` per layer (python/reference/mlp_fsdp.py).
fn readme_example_rows(report: &mut Report, root: &Path) -> Result<(), String> {
    let ours = |n: usize, wrap: Option<&str>| {
        let mut c = Command::new(root.join("target/release/accel"));
        c.args(["launch", "--num-processes", &n.to_string(), "--main-process-port", "0", "--cpu"])
            .arg(root.join("target/release/examples/fsdp_unchanged"))
            .env("MALLOC_MMAP_THRESHOLD_", "65536");
        if let Some(wrap) = wrap {
            c.env("ACCEL_WRAP", wrap);
        }
        c
    };
    let theirs = |n: usize| {
        let mut c = Command::new(root.join(".venv/bin/torchrun"));
        c.args([format!("--nproc-per-node={n}").as_str(), "--master-port=29794"])
            .arg(root.join("python/reference/mlp_fsdp.py"))
            .env("MALLOC_MMAP_THRESHOLD_", "65536");
        c
    };
    report.say(
        "the README's line, strategy = \"fsdp\", on an unchanged loop over an nn::seq() of 24 \
         linear layers of width 1536 (56.7M parameters, 216 MiB; plain SGD; \
         examples/fsdp_unchanged.rs): peak MiB per process over the steps after the first \
         (and over the whole run, which includes building the model whole)",
    );
    report.say(format!("{:<3} {:<44} {:>10} {:>10}", "N", "", "steps", "whole run"));
    for n in [1usize, 2, 4] {
        let mut rows =
            vec![("accel fsdp (each layer a unit)", rank_results(&mut ours(n, None), n)?)];
        if n == 4 {
            rows.push((
                "accel fsdp, units off (ACCEL_WRAP=none)",
                rank_results(&mut ours(n, Some("none")), n)?,
            ));
        }
        if n > 1 {
            rows.push(("PyTorch FSDP2 fully_shard per layer", rank_results(&mut theirs(n), n)?));
        }
        for (name, objects) in rows {
            let (steps, whole) =
                (highest(&objects, "train_peak_bytes"), highest(&objects, "peak_bytes"));
            report.say(format!("{n:<3} {name:<44} {:>10.0} {:>10.0}", steps / MIB, whole / MIB));
            let key = figure_key(name);
            report.figure(&format!("readme.{n}.{key}.steps_mib"), steps / MIB);
            report.figure(&format!("readme.{n}.{key}.run_mib"), whole / MIB);
        }
    }
    Ok(())
}
