//! `cargo xtask bench speed` (and the first part of `cargo xtask bench`): accel, the raw tch
//! loop and PyTorch + Accelerate on the same MLP and transformer in the same run, with the
//! smaller comparisons after them; written to bench/results.json.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use crate::results::{Report, readme_from_results, write_results};
use crate::{cargo, root};

/// Runs `command` and returns its `samples_per_s=` and `peak_rss_mib=` figures.
fn mlp_figures(command: &mut Command) -> Result<Figures, String> {
    let text = super::stdout_of(command)?;
    let figure = |key: &str| -> Result<f64, String> {
        text.split_whitespace()
            .find_map(|w| w.strip_prefix(key))
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| format!("{command:?} printed no {key}\n{text}"))
    };
    Ok((figure("samples_per_s=")?, figure("peak_rss_mib=")?))
}

/// A benchmark run's figures: (rate, peak resident MiB).
type Figures = (f64, f64);
type Measure<'a> = Box<dyn FnMut() -> Result<Figures, String> + 'a>;

/// The median of `runs` runs of each of `measures` (this VM's figures vary by ±20% between
/// runs), taken in turn (run 1 of each, then run 2 of each, ...), so that its drift over the
/// minutes falls on every row alike.
fn interleaved_medians(
    runs: usize,
    mut measures: Vec<Measure<'_>>,
) -> Result<Vec<Figures>, String> {
    let mut all: Vec<Vec<Figures>> = vec![Vec::new(); measures.len()];
    for _ in 0..runs {
        for (measure, figures) in measures.iter_mut().zip(&mut all) {
            figures.push(measure()?);
        }
    }
    Ok(all
        .into_iter()
        .map(|mut figures| {
            figures.sort_by(|a, b| a.0.total_cmp(&b.0));
            figures[runs / 2]
        })
        .collect())
}

/// Seconds to rebuild `example` after touching its source; the attribute's share shows as
/// the difference between the annotated example and its plain twin.
fn rebuild_seconds(example: &str) -> Result<f64, String> {
    // Everything it depends on up to date first: only the example's own crate is timed.
    cargo(&["build", "--quiet", "-p", "accel-examples", "--example", example], &[])?;
    let source = root().join("examples").join(format!("{example}.rs"));
    let text = std::fs::read(&source).map_err(|e| format!("{}: {e}", source.display()))?;
    std::fs::write(&source, &text).map_err(|e| format!("{}: {e}", source.display()))?;
    let started = Instant::now();
    cargo(&["build", "--quiet", "-p", "accel-examples", "--example", example], &[])?;
    Ok(started.elapsed().as_secs_f64())
}

/// `(1 − ours / limit)` as a percentage: how much slower than the raw loop (negative:
/// faster, e.g. when accel overlaps what the raw loop does in sequence).
fn overhead(ours: f64, limit: f64) -> f64 {
    100.0 * (limit / ours - 1.0)
}

/// accel_core::heap's malloc thresholds (32 MiB, 1 GiB) as glibc reads them from the
/// environment: given to the Python side, it shows what the setting alone is worth there.
const KEPT_HEAP: (&str, &str) = (
    "GLIBC_TUNABLES",
    "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=1073741824",
);

/// How many runs of each program a median is taken over.
const RUNS: usize = 3;

/// The rows of the MLP's and the transformer's tables: (name, key in bench/results.json).
const NAMES: [(&str, &str); 6] = [
    ("raw tch loop (the limit)", "raw"),
    ("accel, explicit API", "accel"),
    ("accel, #[accelerate]", "attribute"),
    ("Accelerate (AdamW default)", "accelerate"),
    ("Accelerate (AdamW fused)", "accelerate_fused"),
    ("Accelerate fused, kept heap", "accelerate_fused_kept_heap"),
];

/// The speed benchmark: accel, the raw tch loop and PyTorch + Accelerate on the MLP and the
/// transformer, then the collective check, batch norm's broadcast, fp8, the attribute's
/// compile time and the all-reduce; writes bench/results.json and the page's block.
pub(crate) fn bench() -> Result<(), String> {
    cargo(
        &["build", "--release", "-p", "accel-core", "--bin", "accel", "-p", "accel-examples"],
        &["--example".into(), "mlp_bench".into(), "--example".into(), "lm_bench".into()],
    )?;
    cargo(&["build", "--quiet", "-p", "accel-examples", "--example", "existing_function"], &[])?;
    cargo(
        &["build", "--quiet", "-p", "accel-examples", "--example", "existing_function_plain"],
        &[],
    )?;
    let programs = Programs::new(&root());
    let mut report = Report::default();
    eprintln!("xtask: measuring, {RUNS} runs of each (a quarter of an hour) ...");
    mlp_rows(&mut report, &programs)?;
    collective_check_row(&mut report, &programs)?;
    batch_norm_row(&mut report, &programs)?;
    transformer_rows(&mut report, &programs)?;
    precision_rows(&mut report, &programs)?;
    compile_time_row(&mut report)?;
    allreduce_rows(&mut report, &programs.accel)?;
    write_results(&report)?;
    readme_from_results()
}

/// The programs and scripts the speed benchmark runs (built or installed before).
struct Programs {
    accel: PathBuf,
    /// examples/mlp_bench.rs, release build.
    example: PathBuf,
    python: PathBuf,
    torchrun: PathBuf,
    /// The MLP on Accelerate's side.
    script: PathBuf,
    /// examples/lm_bench.rs, release build.
    lm: PathBuf,
    /// The transformer on Accelerate's side.
    lm_script: PathBuf,
}

impl Programs {
    fn new(root: &Path) -> Self {
        Programs {
            accel: root.join("target/release/accel"),
            example: root.join("target/release/examples/mlp_bench"),
            python: root.join(".venv/bin/python"),
            torchrun: root.join(".venv/bin/torchrun"),
            script: root.join("python/reference/accelerate_mlp.py"),
            lm: root.join("target/release/examples/lm_bench"),
            lm_script: root.join("python/reference/accelerate_lm.py"),
        }
    }

    /// One run of the MLP example (accel or, with `--raw`, the raw loop) on `procs` processes.
    fn once(&self, procs: usize, flags: &[&str], env: &[(&str, &str)]) -> Result<Figures, String> {
        let mut command = if procs == 1 {
            Command::new(&self.example)
        } else {
            let mut c = Command::new(&self.accel);
            c.args(["launch", "--num-processes", "2", "--main-process-port", "0"])
                .args(["--rank0-only"])
                .arg(&self.example);
            c
        };
        mlp_figures(command.args(flags).envs(env.iter().copied()))
    }

    /// One run of the MLP on PyTorch + Accelerate on `procs` processes (torchrun for 2).
    fn theirs(&self, procs: usize, fused: bool, env: &[(&str, &str)]) -> Result<Figures, String> {
        let mut command = if procs == 1 {
            let mut c = Command::new(&self.python);
            c.arg(&self.script);
            c
        } else {
            let mut c = Command::new(&self.torchrun);
            c.args(["--nproc-per-node", "2", "--master-port", "29731"]).arg(&self.script);
            c
        };
        if fused {
            command.arg("fused");
        }
        mlp_figures(command.envs(env.iter().copied()))
    }

    /// One run of the transformer on Accelerate's side.
    fn lm_theirs(&self, fused: bool, env: &[(&str, &str)]) -> Result<Figures, String> {
        let mut command = Command::new(&self.python);
        command.arg(&self.lm_script);
        if fused {
            command.arg("--fused");
        }
        mlp_figures(command.envs(env.iter().copied()))
    }

    /// One run of the transformer example (accel, or the raw loop with `--raw`).
    fn lm_ours(&self, flag: Option<&str>) -> Result<Figures, String> {
        mlp_figures(Command::new(&self.lm).args(flag))
    }

    /// One run of the transformer under `precision`, accel's or Accelerate's (fused AdamW).
    fn lm_with(&self, precision: &str, accelerate: bool) -> Result<Figures, String> {
        let mut command = if accelerate {
            let mut c = Command::new(&self.python);
            c.args([self.lm_script.as_os_str(), "--fused".as_ref()]);
            c
        } else {
            Command::new(&self.lm)
        };
        mlp_figures(command.args(["--precision", precision]))
    }
}

/// The MLP's table: every row of `NAMES` on 1 and 2 processes, then accel's overhead over the
/// raw loop and its ratio to Accelerate.
fn mlp_rows(report: &mut Report, programs: &Programs) -> Result<(), String> {
    let mut measures: Vec<Measure> = Vec::new();
    for procs in [1, 2] {
        measures.push(Box::new(move || programs.once(procs, &["--raw"], &[])));
        measures.push(Box::new(move || programs.once(procs, &[], &[])));
        measures.push(Box::new(move || programs.once(procs, &["--attribute"], &[])));
        measures.push(Box::new(move || programs.theirs(procs, false, &[])));
        measures.push(Box::new(move || programs.theirs(procs, true, &[])));
        measures.push(Box::new(move || programs.theirs(procs, true, &[KEPT_HEAP])));
    }
    let figures = interleaved_medians(RUNS, measures)?;
    let rows: Vec<(&str, &str, Figures, Figures)> = NAMES
        .iter()
        .enumerate()
        .map(|(i, &(name, key))| (name, key, figures[i], figures[NAMES.len() + i]))
        .collect();
    report.say(
        "MLP 784-1024-1024-10, batch 64 per process, AdamW (fused where accel or the raw loop \
         step), fp32, 1 thread per process, CPU; median of 3 runs each, taken in turn",
    );
    report.say(format!(
        "{:<28} {:>10} {:>12} {:>8} {:>20}",
        "samples/s", "1 process", "2 processes", "scaling", "peak RSS (rank 0)"
    ));
    for (name, key, one, two) in &rows {
        report.say(format!(
            "{name:<28} {:>10.0} {:>12.0} {:>7.2}x {:>8.0} / {:>4.0} MiB",
            one.0,
            two.0,
            two.0 / one.0,
            one.1,
            two.1
        ));
        report.figure(&format!("mlp.{key}.samples_per_s.1"), one.0);
        report.figure(&format!("mlp.{key}.samples_per_s.2"), two.0);
    }
    let (raw, ours_, attr, acc, accf) = (&rows[0], &rows[1], &rows[2], &rows[3], &rows[4]);
    report.say(format!(
        "accel's overhead over the raw loop: explicit API {:+.1}% (1 process) {:+.1}% (2), \
         attribute {:+.1}% {:+.1}%",
        overhead(ours_.2.0, raw.2.0),
        overhead(ours_.3.0, raw.3.0),
        overhead(attr.2.0, raw.2.0),
        overhead(attr.3.0, raw.3.0)
    ));
    report.say(format!(
        "accel / Accelerate, 2 processes: {:.2}x (Accelerate's default AdamW), {:.2}x (its \
         fused AdamW); 1 process: {:.2}x, {:.2}x",
        ours_.3.0 / acc.3.0,
        ours_.3.0 / accf.3.0,
        ours_.2.0 / acc.2.0,
        ours_.2.0 / accf.2.0
    ));
    let kept = &rows[5];
    report.say(format!(
        "Accelerate given accel's malloc setting (GLIBC_TUNABLES, as accel_core::heap sets it): \
         accel / it {:.2}x on 2 processes, {:.2}x on 1",
        ours_.3.0 / kept.3.0,
        ours_.2.0 / kept.2.0
    ));
    report.figure("mlp.overhead_percent.1", overhead(ours_.2.0, raw.2.0));
    report.figure("mlp.overhead_percent.2", overhead(ours_.3.0, raw.3.0));
    report.figure("mlp.vs_accelerate_fused.2", ours_.3.0 / accf.3.0);
    Ok(())
}

/// The collective sequence check (a ledger compared through the store each step): with
/// and without, alternated run by run, so that the machine's drift falls on both alike.
fn collective_check_row(report: &mut Report, programs: &Programs) -> Result<(), String> {
    let (mut with, mut without) = (Vec::new(), Vec::new());
    for _ in 0..2 * RUNS - 1 {
        with.push(programs.once(2, &[], &[("ACCEL_CHECK_COLLECTIVES", "1")])?.0);
        without.push(programs.once(2, &[], &[("ACCEL_CHECK_COLLECTIVES", "0")])?.0);
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (checked, unchecked) = (median(&mut with), median(&mut without));
    report.say(format!(
        "the collective sequence check, 2 processes, alternated: {checked:.0} samples/s with it, \
         {unchecked:.0} without: it costs {:.1}%",
        overhead(checked, unchecked)
    ));
    report.figure("mlp.collective_check_percent", overhead(checked, unchecked));
    Ok(())
}

/// Batch norm after each hidden layer: its running statistics are broadcast from rank 0
/// after every step (one collective of 4096 floats), or left per process.
fn batch_norm_row(report: &mut Report, programs: &Programs) -> Result<(), String> {
    let batch_norm = interleaved_medians(
        RUNS,
        vec![
            Box::new(|| programs.once(2, &["--batch-norm"], &[])),
            Box::new(|| programs.once(2, &["--batch-norm", "--no-broadcast-buffers"], &[])),
        ],
    )?;
    let (synced, local) = (batch_norm[0].0, batch_norm[1].0);
    report.say(format!(
        "with batch norm, 2 processes: {synced:.0} samples/s keeping the running statistics \
         equal, {local:.0} without: the broadcast costs {:.1}%",
        100.0 * (local - synced) / local
    ));
    Ok(())
}

/// The transformer's table (every row of `NAMES`, 1 process), accel's overhead over the raw
/// loop and its ratio to Accelerate.
fn transformer_rows(report: &mut Report, programs: &Programs) -> Result<(), String> {
    let lm_figures = interleaved_medians(
        RUNS,
        vec![
            Box::new(|| programs.lm_ours(Some("--raw"))),
            Box::new(|| programs.lm_ours(None)),
            Box::new(|| programs.lm_ours(Some("--attribute"))),
            Box::new(|| programs.lm_theirs(false, &[])),
            Box::new(|| programs.lm_theirs(true, &[])),
            Box::new(|| programs.lm_theirs(true, &[KEPT_HEAP])),
        ],
    )?;
    let lm_rows: Vec<(&str, &str, Figures)> =
        NAMES.iter().zip(lm_figures).map(|(&(name, key), f)| (name, key, f)).collect();
    report.say(format!(
        "\nGPT-style transformer (examples/gpt.rs: 4 blocks of width 128, context 64, 0.8M \
         parameters), batch 16, AdamW, fp32, 1 process, 1 thread; median of {RUNS} runs each, \
         taken in turn"
    ));
    report.say(format!(
        "{:<28} {:>12} {:>10} {:>14}",
        "sequences/s", "1 process", "step ms", "peak RSS MiB"
    ));
    for (name, key, (rate, rss)) in &lm_rows {
        report.say(format!("{name:<28} {rate:>12.1} {:>10.2} {rss:>14.0}", 16e3 / rate));
        report.figure(&format!("lm.{key}.step_ms"), 16e3 / rate);
    }
    let rate = |i: usize| lm_rows[i].2.0;
    report.say(format!(
        "accel's overhead over the raw loop: explicit API {:+.1}%, attribute {:+.1}%",
        overhead(rate(1), rate(0)),
        overhead(rate(2), rate(0))
    ));
    report.say(format!(
        "accel / Accelerate, transformer step: {:.2}x (Accelerate's default AdamW), {:.2}x (its \
         fused AdamW), {:.2}x (fused, given accel's malloc setting)\n",
        rate(1) / rate(3),
        rate(1) / rate(4),
        rate(1) / rate(5)
    ));
    report.figure("lm.overhead_percent", overhead(rate(1), rate(0)));
    report.figure("lm.vs_accelerate_fused", rate(1) / rate(4));
    Ok(())
}

/// fp8 beside bf16, both sides: on CPU fp8 runs libtorch's reference kernels, so this
/// measures the recipe's overhead there; the speed-up belongs to fp8 GPUs.
fn precision_rows(report: &mut Report, programs: &Programs) -> Result<(), String> {
    let precision_names =
        ["accel bf16", "accel fp8", "Accelerate bf16 (fused AdamW)", "Accelerate fp8 (torchao)"];
    let precision_figures = interleaved_medians(
        RUNS,
        vec![
            Box::new(|| programs.lm_with("bf16", false)),
            Box::new(|| programs.lm_with("fp8", false)),
            Box::new(|| programs.lm_with("bf16", true)),
            Box::new(|| programs.lm_with("fp8", true)),
        ],
    )?;
    let precision_rows: Vec<(&str, Figures)> =
        precision_names.into_iter().zip(precision_figures).collect();
    report.say(format!(
        "The same transformer under bf16 and fp8 (tensor-wise recipe, all but the first and last \
         linear layers), CPU; median of {RUNS} runs each, taken in turn"
    ));
    report.say(format!("{:<30} {:>10} {:>14}", "step ms", "1 process", "peak RSS MiB"));
    for (name, (rate, rss)) in &precision_rows {
        report.say(format!("{name:<30} {:>10.2} {rss:>14.0}", 16e3 / rate));
    }
    let ms = |i: usize| 16e3 / precision_rows[i].1.0;
    report.say(format!(
        "fp8 / bf16 step time: accel {:.2}x, Accelerate {:.2}x; accel / Accelerate in fp8: {:.2}x \
         the speed\n",
        ms(1) / ms(0),
        ms(3) / ms(2),
        ms(3) / ms(1)
    ));
    Ok(())
}

/// The attribute's compile time: a debug rebuild of the annotated example and of its plain
/// twin.
fn compile_time_row(report: &mut Report) -> Result<(), String> {
    let (annotated, plain) =
        (rebuild_seconds("existing_function")?, rebuild_seconds("existing_function_plain")?);
    report.say(format!(
        "compile time of #[accelerate] (debug rebuild of examples/existing_function after a \
         touch): {annotated:.1} s with the attribute, {plain:.1} s without ({:+.1} s)\n",
        annotated - plain
    ));
    Ok(())
}

/// `accel bench allreduce` on 2 processes beside gloo; its lines go into the report as printed.
fn allreduce_rows(report: &mut Report, accel: &Path) -> Result<(), String> {
    let text = super::stdout_of(
        Command::new(accel)
            .args(["bench", "allreduce", "--num-processes", "2", "--main-process-port", "0"])
            .args(["--sizes", "1MiB,4MiB,16MiB,64MiB", "--compare-gloo"]),
    )?;
    for line in text.lines() {
        report.say(line);
    }
    Ok(())
}
