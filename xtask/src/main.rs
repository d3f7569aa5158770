//! Project chores, so that a fresh clone needs two commands and nothing installed by hand:
//!
//! - `cargo xtask setup`  creates `.venv` (torch 2.11.0 from PyPI, accelerate, safetensors)
//!   and links `.venv/libtorch` to the torch package, which `.cargo/config.toml` hands to
//!   torch-sys as `LIBTORCH`. Runs once; later calls only check it.
//! - `cargo xtask test [ARGS]`   setup, then `cargo test --workspace [ARGS]`.
//! - `cargo xtask train [ARGS]`  setup, then the main job: the `train` example on 2 local
//!   processes (`accel launch`), on CPU.
//! - `cargo xtask bench`         setup, release build, then accel, a raw tch loop and PyTorch +
//!   Accelerate on the same work in the same run, as a table of ratios; writes
//!   bench/results.json and the bench block of docs/performance.md from it (`bench speed`:
//!   without the memory benchmarks; `bench readme`: only that block, from the file).
//!
//! Only std and serde_json are used so that this builds in seconds, before libtorch exists.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::Instant;

const REQUIREMENTS: &str = "python/requirements.txt";
const VENV: &str = ".venv";
/// Written after a successful install; holds the requirements it was made from.
const STAMP: &str = ".venv/.accel-requirements";
const LIBTORCH_LINK: &str = ".venv/libtorch";
const MAIN_EXAMPLE: &str = "train";

fn main() -> ExitCode {
    let mut args = std::env::args_os().skip(1);
    let command = args.next().and_then(|a| a.into_string().ok()).unwrap_or_default();
    let rest: Vec<OsString> = args.collect();
    let result = match command.as_str() {
        "setup" => setup().map(|_| ()),
        "test" => setup().and_then(|_| test(&rest)),
        "train" => setup().and_then(|_| train(&rest)),
        "bench" if rest.first().is_some_and(|a| a == "memory") => {
            setup().and_then(|_| memory_bench()).and_then(|_| llama_memory_bench())
        }
        "bench" if rest.first().is_some_and(|a| a == "speed") => setup().and_then(|_| bench()),
        "bench" if rest.first().is_some_and(|a| a == "readme") => readme_from_results(),
        "bench" if rest.first().is_some_and(|a| a == "overhead") => {
            setup().and_then(|_| overhead_bench(rest.get(1).and_then(|m| m.to_str())))
        }
        "bench" if rest.first().is_some_and(|a| a == "llama") => {
            setup().and_then(|_| llama_memory_bench())
        }
        "bench" if rest.first().is_some_and(|a| a == "loader") => {
            setup().and_then(|_| loader_bench())
        }
        "bench" if rest.first().is_some_and(|a| a == "scale") => {
            setup().and_then(|_| scale_bench()).and_then(|_| readme_from_results())
        }
        "bench" => setup()
            .and_then(|_| bench())
            .and_then(|_| scale_bench())
            .and_then(|_| loader_bench())
            .and_then(|_| readme_from_results())
            .and_then(|_| memory_bench())
            .and_then(|_| llama_memory_bench()),
        _ => Err(format!(
            "unknown command `{command}`; the commands are:\n  \
             cargo xtask setup         install libtorch into .venv (once)\n  \
             cargo xtask test [ARGS]   every test (cargo test --workspace ARGS)\n  \
             cargo xtask train [ARGS]  the main job\n  \
             cargo xtask bench         accel vs a raw tch loop and PyTorch + Accelerate, same run\n  \
             cargo xtask bench speed   the same without the memory benchmarks\n  \
             cargo xtask bench readme  docs/performance.md's readings, from bench/results.json\n  \
             cargo xtask bench scale   rendezvous of 16 to 256 processes, accel and torchrun\n  \
             cargo xtask bench loader  the data loader's workers against a slow data set\n  \
             cargo xtask bench llama   a 106M Llama: loading and fine-tuning, beside PyTorch\n  \
             cargo xtask bench overhead [mlp|transformer]  accel's instructions per step over the raw loop's (callgrind)\n  \
             cargo xtask bench memory  peak memory per process of ddp and zero1/2/3"
        )),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("xtask: {message}");
            ExitCode::FAILURE
        }
    }
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("xtask lives in the workspace").into()
}

/// Makes sure a libtorch is there; returns its directory.
fn setup() -> Result<PathBuf, String> {
    let root = root();
    let ours = root.join(LIBTORCH_LINK);
    // `cargo run` passes on the LIBTORCH of .cargo/config.toml; only a different one is the
    // user's own choice.
    if let Some(theirs) = std::env::var_os("LIBTORCH").map(PathBuf::from)
        && theirs != ours
    {
        if !theirs.join("lib/libtorch.so").exists() {
            return Err(format!(
                "LIBTORCH={} has no lib/libtorch.so; point it at a libtorch 2.11.0 \
                 (the folder that holds lib/ and include/), or unset it to let \
                 `cargo xtask setup` install one into {VENV}",
                theirs.display()
            ));
        }
        eprintln!("xtask: using LIBTORCH={} (set in the environment)", theirs.display());
        return Ok(theirs);
    }
    let requirements = std::fs::read_to_string(root.join(REQUIREMENTS))
        .map_err(|e| format!("cannot read {REQUIREMENTS}: {e}"))?;
    let stamp = root.join(STAMP);
    if std::fs::read_to_string(&stamp).ok().as_deref() == Some(requirements.as_str())
        && ours.join("lib/libtorch.so").exists()
    {
        return Ok(ours);
    }

    let started = Instant::now();
    let python = find_python()?;
    let venv = root.join(VENV);
    let venv_python = venv.join("bin/python");
    if !venv_python.exists() {
        eprintln!("xtask: creating {} with {}", venv.display(), python.display());
        run(Command::new(&python).args(["-m", "venv"]).arg(&venv)).map_err(|e| {
            format!(
                "{e}\n`{} -m venv` failed: on Debian/Ubuntu install the venv module \
                 (apt-get install python3-venv), or set LIBTORCH to an existing libtorch 2.11.0",
                python.display()
            )
        })?;
    }
    // pip's own "No space left on device" comes minutes in; say it before starting.
    if let Some(free) = free_gib(&root).filter(|free| *free < NEEDED_GIB) {
        eprintln!(
            "xtask: warning: {free:.1} GiB free under {}; the venv and a debug build need \
             about {NEEDED_GIB} GiB",
            root.display()
        );
    }
    eprintln!(
        "xtask: installing {} into {VENV} (first time only; torch with its CUDA libraries \
         is about 4.7 GB)",
        requirements.lines().filter(|l| !l.trim().is_empty() && !l.starts_with('#')).count()
    );
    run(Command::new(&venv_python)
        // No cache: it would keep a second copy of the ~3 GB of wheels for nothing.
        .args(["-m", "pip", "install", "--disable-pip-version-check", "--no-cache-dir", "-q", "-r"])
        .arg(root.join(REQUIREMENTS)))
    .map_err(|e| {
        format!(
            "{e}\npip could not install {REQUIREMENTS}: its message above says why (PyPI \
             not reachable, or no space left). Ways out: make PyPI reachable (or set \
             PIP_INDEX_URL to a mirror), free disk space (about {NEEDED_GIB} GiB in all), or \
             set LIBTORCH to an existing libtorch 2.11.0 and run cargo directly"
        )
    })?;
    let torch_dir =
        python_output(&venv_python, "import os, torch; print(os.path.dirname(torch.__file__))")?;
    // A relative link keeps working when the checkout is moved.
    let torch_dir = PathBuf::from(torch_dir.trim());
    let target = torch_dir.strip_prefix(&venv).unwrap_or(&torch_dir);
    let _ = std::fs::remove_file(&ours);
    std::os::unix::fs::symlink(target, &ours)
        .map_err(|e| format!("cannot link {} -> {}: {e}", ours.display(), target.display()))?;
    std::fs::write(&stamp, &requirements).map_err(|e| format!("cannot write {STAMP}: {e}"))?;
    eprintln!(
        "xtask: libtorch ready at {} -> {} ({:.0} s)",
        ours.display(),
        torch_dir.display(),
        started.elapsed().as_secs_f64()
    );
    Ok(ours)
}

fn find_python() -> Result<PathBuf, String> {
    let candidate = std::env::var_os("PYTHON").map(PathBuf::from).unwrap_or("python3".into());
    let version = python_output(&candidate, "import sys; print('%d.%d' % sys.version_info[:2])")
        .map_err(|e| {
            format!(
                "{e}\nPython 3.10 or newer is needed to install torch==2.11.0 from PyPI, and \
             `{}` did not run. Install python3 (with its venv module), set PYTHON to one, or \
             set LIBTORCH to an existing libtorch 2.11.0 (the folder with lib/libtorch.so)",
                candidate.display()
            )
        })?;
    let (major, minor) = version.trim().split_once('.').unwrap_or(("0", "0"));
    let (major, minor): (u32, u32) = (major.parse().unwrap_or(0), minor.parse().unwrap_or(0));
    if (major, minor) < (3, 10) {
        return Err(format!(
            "{} is Python {}; torch==2.11.0 needs 3.10 or newer. Set PYTHON to a newer one \
             or LIBTORCH to an existing libtorch 2.11.0",
            candidate.display(),
            version.trim()
        ));
    }
    Ok(candidate)
}

fn python_output(python: &Path, code: &str) -> Result<String, String> {
    let output = Command::new(python)
        .args(["-c", code])
        .output()
        .map_err(|e| format!("cannot run {}: {e}", python.display()))?;
    if !output.status.success() {
        return Err(format!(
            "{} -c {code:?} failed: {}",
            python.display(),
            String::from_utf8_lossy(&output.stderr).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// Disk a fresh checkout needs: the venv (5.7 GB) and `cargo xtask test`'s debug build.
const NEEDED_GIB: f64 = 12.0;

/// Free space on the file system holding `dir`, from `df` (None if it cannot tell).
fn free_gib(dir: &Path) -> Option<f64> {
    let output = Command::new("df").args(["-Pk"]).arg(dir).output().ok()?;
    let text = String::from_utf8_lossy(&output.stdout).into_owned();
    let kib: f64 = text.lines().nth(1)?.split_whitespace().nth(3)?.parse().ok()?;
    Some(kib / (1024.0 * 1024.0))
}

fn run(command: &mut Command) -> Result<(), String> {
    let status = command.status().map_err(|e| format!("cannot run {command:?}: {e}"))?;
    if status.success() { Ok(()) } else { Err(format!("{command:?} failed ({status})")) }
}

/// `cargo test --workspace`. The builds the tests start themselves (trybuild's, the user
/// crates') do not read this workspace's `[profile.dev]`; the environment gives them its
/// debug level, which halves their size. Same value, so the workspace does not rebuild.
fn test(rest: &[OsString]) -> Result<(), String> {
    run(cargo_command(&["test", "--workspace"], rest)
        .env("CARGO_PROFILE_DEV_DEBUG", "line-tables-only"))?;
    if !rest.is_empty() {
        // A filtered run (`cargo xtask test NAME`) tests that, not the packages.
        return Ok(());
    }
    // The crates as crates.io would take them: packaged in dependency order (versions on the
    // path dependencies, the `include` lists), each then built from its package alone.
    eprintln!("xtask: packaging accel-choices, accel-macros, accel-core and accel-models");
    run(cargo_command(&["package", "--allow-dirty", "--quiet"], &[])
        .args(["-p", "accel-choices", "-p", "accel-macros", "-p", "accel-core"])
        .args(["-p", "accel-models"])
        .env("CARGO_PROFILE_DEV_DEBUG", "line-tables-only"))?;
    // The API docs as docs.rs builds them: no warning, every intra-doc link resolved.
    eprintln!("xtask: cargo doc --no-deps, warnings denied");
    run(cargo_command(&["doc", "--no-deps", "--workspace", "--quiet"], &[])
        .env("RUSTDOCFLAGS", "-D warnings")
        .env("CARGO_PROFILE_DEV_DEBUG", "line-tables-only"))
}

fn cargo(args: &[&str], rest: &[OsString]) -> Result<(), String> {
    run(&mut cargo_command(args, rest))
}

/// `cargo args rest` in the workspace's root.
fn cargo_command(args: &[&str], rest: &[OsString]) -> Command {
    let cargo = std::env::var_os("CARGO").unwrap_or("cargo".into());
    let mut command = Command::new(cargo);
    command.current_dir(root()).args(args).args(rest);
    command
}

/// Runs `command` and returns its `samples_per_s=` and `peak_rss_mib=` figures.
fn mlp_figures(command: &mut Command) -> Result<Figures, String> {
    let output = command.output().map_err(|e| format!("cannot run {command:?}: {e}"))?;
    let text = String::from_utf8_lossy(&output.stdout).into_owned();
    if !output.status.success() {
        return Err(format!(
            "{command:?} failed:\n{text}{}",
            String::from_utf8_lossy(&output.stderr)
        ));
    }
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

/// What the speed benchmark printed, and its figures by name (for bench/results.json).
#[derive(Default)]
struct Report {
    text: String,
    figures: serde_json::Map<String, serde_json::Value>,
}

impl Report {
    /// Prints `line` and keeps it.
    fn say(&mut self, line: impl AsRef<str>) {
        println!("{}", line.as_ref());
        self.text.push_str(line.as_ref());
        self.text.push('\n');
    }

    fn figure(&mut self, key: &str, value: f64) {
        let rounded = (value * 1000.0).round() / 1000.0;
        self.figures.insert(key.into(), serde_json::json!(rounded));
    }
}

/// `(1 − ours / limit)` as a percentage: how much slower than the raw loop (negative:
/// faster, e.g. when accel overlaps what the raw loop does in sequence).
fn overhead(ours: f64, limit: f64) -> f64 {
    100.0 * (limit / ours - 1.0)
}

fn bench() -> Result<(), String> {
    const RUNS: usize = 3;
    let root = root();
    cargo(
        &["build", "--release", "-p", "accel-core", "--bin", "accel", "-p", "accel-examples"],
        &["--example".into(), "mlp_bench".into(), "--example".into(), "lm_bench".into()],
    )?;
    cargo(&["build", "--quiet", "-p", "accel-examples", "--example", "existing_function"], &[])?;
    cargo(
        &["build", "--quiet", "-p", "accel-examples", "--example", "existing_function_plain"],
        &[],
    )?;
    let accel = root.join("target/release/accel");
    let example = root.join("target/release/examples/mlp_bench");
    let python = root.join(".venv/bin/python");
    let torchrun = root.join(".venv/bin/torchrun");
    let script = root.join("python/reference/accelerate_mlp.py");
    let mut report = Report::default();
    eprintln!("xtask: measuring, {RUNS} runs of each (a quarter of an hour) ...");
    let once = |procs: usize, flags: &[&str], env: &[(&str, &str)]| {
        let mut command = if procs == 1 {
            Command::new(&example)
        } else {
            let mut c = Command::new(&accel);
            c.args(["launch", "--num-processes", "2", "--main-process-port", "0"])
                .args(["--rank0-only"])
                .arg(&example);
            c
        };
        mlp_figures(command.args(flags).envs(env.iter().copied()))
    };
    let theirs = |procs: usize, fused: bool, env: &[(&str, &str)]| {
        let mut command = if procs == 1 {
            let mut c = Command::new(&python);
            c.arg(&script);
            c
        } else {
            let mut c = Command::new(&torchrun);
            c.args(["--nproc-per-node", "2", "--master-port", "29731"]).arg(&script);
            c
        };
        if fused {
            command.arg("fused");
        }
        mlp_figures(command.envs(env.iter().copied()))
    };
    let names = [
        ("raw tch loop (the limit)", "raw"),
        ("accel, explicit API", "accel"),
        ("accel, #[accelerate]", "attribute"),
        ("Accelerate (AdamW default)", "accelerate"),
        ("Accelerate (AdamW fused)", "accelerate_fused"),
        ("Accelerate fused, kept heap", "accelerate_fused_kept_heap"),
    ];
    let mut measures: Vec<Measure> = Vec::new();
    for procs in [1, 2] {
        measures.push(Box::new(move || once(procs, &["--raw"], &[])));
        measures.push(Box::new(move || once(procs, &[], &[])));
        measures.push(Box::new(move || once(procs, &["--attribute"], &[])));
        measures.push(Box::new(move || theirs(procs, false, &[])));
        measures.push(Box::new(move || theirs(procs, true, &[])));
        measures.push(Box::new(move || theirs(procs, true, &[KEPT_HEAP])));
    }
    let figures = interleaved_medians(RUNS, measures)?;
    let rows: Vec<(&str, &str, Figures, Figures)> = names
        .iter()
        .enumerate()
        .map(|(i, &(name, key))| (name, key, figures[i], figures[names.len() + i]))
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
    // The collective sequence check (a ledger compared through the store each step): with
    // and without, alternated run by run, so that the machine's drift falls on both alike.
    let (mut with, mut without) = (Vec::new(), Vec::new());
    for _ in 0..2 * RUNS - 1 {
        with.push(once(2, &[], &[("ACCEL_CHECK_COLLECTIVES", "1")])?.0);
        without.push(once(2, &[], &[("ACCEL_CHECK_COLLECTIVES", "0")])?.0);
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
    // Batch norm after each hidden layer: its running statistics are broadcast from rank 0
    // after every step (one collective of 4096 floats), or left per process.
    let batch_norm = interleaved_medians(
        RUNS,
        vec![
            Box::new(|| once(2, &["--batch-norm"], &[])),
            Box::new(|| once(2, &["--batch-norm", "--no-broadcast-buffers"], &[])),
        ],
    )?;
    let (synced, local) = (batch_norm[0].0, batch_norm[1].0);
    report.say(format!(
        "with batch norm, 2 processes: {synced:.0} samples/s keeping the running statistics \
         equal, {local:.0} without: the broadcast costs {:.1}%",
        100.0 * (local - synced) / local
    ));
    let lm = root.join("target/release/examples/lm_bench");
    let lm_script = root.join("python/reference/accelerate_lm.py");
    let lm_theirs = |fused: bool, env: &[(&str, &str)]| {
        let mut command = Command::new(&python);
        command.arg(&lm_script);
        if fused {
            command.arg("--fused");
        }
        mlp_figures(command.envs(env.iter().copied()))
    };
    let lm_ours = |flag: Option<&str>| mlp_figures(Command::new(&lm).args(flag));
    let lm_figures = interleaved_medians(
        RUNS,
        vec![
            Box::new(|| lm_ours(Some("--raw"))),
            Box::new(|| lm_ours(None)),
            Box::new(|| lm_ours(Some("--attribute"))),
            Box::new(|| lm_theirs(false, &[])),
            Box::new(|| lm_theirs(true, &[])),
            Box::new(|| lm_theirs(true, &[KEPT_HEAP])),
        ],
    )?;
    let lm_rows: Vec<(&str, &str, Figures)> =
        names.iter().zip(lm_figures).map(|(&(name, key), f)| (name, key, f)).collect();
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
    // fp8 beside bf16, both sides: on CPU fp8 runs libtorch's reference kernels, so this
    // measures the recipe's overhead there; the speed-up belongs to fp8 GPUs.
    let lm_with = |precision: &'static str, accelerate: bool| {
        let mut command = if accelerate {
            let mut c = Command::new(&python);
            c.args([lm_script.as_os_str(), "--fused".as_ref()]);
            c
        } else {
            Command::new(&lm)
        };
        mlp_figures(command.args(["--precision", precision]))
    };
    let precision_names =
        ["accel bf16", "accel fp8", "Accelerate bf16 (fused AdamW)", "Accelerate fp8 (torchao)"];
    let precision_figures = interleaved_medians(
        RUNS,
        vec![
            Box::new(|| lm_with("bf16", false)),
            Box::new(|| lm_with("fp8", false)),
            Box::new(|| lm_with("bf16", true)),
            Box::new(|| lm_with("fp8", true)),
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
    let (annotated, plain) =
        (rebuild_seconds("existing_function")?, rebuild_seconds("existing_function_plain")?);
    report.say(format!(
        "compile time of #[accelerate] (debug rebuild of examples/existing_function after a \
         touch): {annotated:.1} s with the attribute, {plain:.1} s without ({:+.1} s)\n",
        annotated - plain
    ));
    let output = Command::new(&accel)
        .args(["bench", "allreduce", "--num-processes", "2", "--main-process-port", "0"])
        .args(["--sizes", "1MiB,4MiB,16MiB,64MiB", "--compare-gloo"])
        .output()
        .map_err(|e| format!("cannot run accel bench allreduce: {e}"))?;
    let text = String::from_utf8_lossy(&output.stdout).into_owned();
    if !output.status.success() {
        return Err(format!(
            "accel bench allreduce failed:\n{text}{}",
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    for line in text.lines() {
        report.say(line);
    }
    write_results(&report)?;
    readme_from_results()
}

/// Memory this machine has free, in bytes (MemAvailable).
fn available_bytes() -> f64 {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|r| r.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(0.0, |kb| kb * 1024.0)
}

/// Runs `command` to its end; returns its stdout, its wall-clock seconds, and how far the
/// machine's available memory fell meanwhile (sampled every 50 ms), in bytes.
fn timed_with_memory(command: &mut Command, what: &str) -> Result<(String, f64, f64), String> {
    use std::sync::atomic::{AtomicBool, Ordering};
    let before = available_bytes();
    let done = std::sync::Arc::new(AtomicBool::new(false));
    let sampler = {
        let done = done.clone();
        std::thread::spawn(move || {
            let mut lowest = f64::MAX;
            while !done.load(Ordering::SeqCst) {
                lowest = lowest.min(available_bytes());
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            lowest
        })
    };
    let started = Instant::now();
    let output = command.output().map_err(|e| format!("cannot run {what}: {e}"));
    let seconds = started.elapsed().as_secs_f64();
    done.store(true, std::sync::atomic::Ordering::SeqCst);
    let lowest = sampler.join().unwrap_or(before);
    let output = output?;
    if !output.status.success() {
        return Err(format!(
            "{what} failed:\n{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    Ok((String::from_utf8_lossy(&output.stdout).into_owned(), seconds, (before - lowest).max(0.0)))
}

/// Rendezvous at scale: N processes on this machine start, meet at the store, form their
/// group, all-reduce 4 bytes (3 + 200 times) and end; the wall-clock from launch to exit and
/// the latency of one all-reduce, accel beside torchrun + gloo (same script shape), where
/// this machine's memory holds the processes. Written to bench/scale.json.
fn scale_bench() -> Result<(), String> {
    cargo(&["build", "--release", "-p", "accel-core", "--bin", "accel"], &[])?;
    let root = root();
    let accel = root.join("target/release/accel");
    let torchrun = root.join(".venv/bin/torchrun");
    let script = root.join("python/reference/allreduce_torch.py");
    let mut report = Report::default();
    report.say(
        "Rendezvous at scale: N processes on this machine start, meet, form their group, \
         all-reduce 4 bytes 203 times and exit\n(accel: `accel bench allreduce \
         --num-processes N --sizes 4`; torch: torchrun + gloo, python/reference/allreduce_torch.py).\n\
         Wall = launch to exit; memory = how far MemAvailable fell, per process.",
    );
    report.say(format!(
        "{:>5} {:>9} {:>9} {:>7} {:>12} {:>12} {:>10} {:>10}",
        "N", "accel s", "torch s", "ratio", "accel us/op", "torch us/op", "accel MiB", "torch MiB"
    ));
    // Per-process memory at start, as this benchmark measured it here: accel 0.19 GiB
    // (libtorch with its CUDA libraries), torchrun's processes 0.23 GiB. A run is tried only
    // where it fits with a margin.
    const GIB: f64 = 1024.0 * 1024.0 * 1024.0;
    let fits = |n: usize, per_process: f64| n as f64 * per_process * GIB < 0.8 * available_bytes();
    let latency = |text: &str| -> f64 {
        // accel: "[rank0]  0KiB  0.060 ..." (ms); torch: {"bytes": 4, "seconds": s}
        text.lines()
            .find_map(|l| {
                let l = l.trim_start_matches("[rank0]").trim();
                if let Ok(v) = serde_json::from_str::<serde_json::Value>(l) {
                    return v["seconds"].as_f64().map(|s| s * 1e6);
                }
                let mut words = l.split_whitespace();
                (words.next() == Some("0KiB"))
                    .then(|| words.next()?.parse::<f64>().ok())
                    .flatten()
                    .map(|ms| ms * 1e3)
            })
            .unwrap_or(f64::NAN)
    };
    for n in [16usize, 32, 64, 128, 256] {
        if !fits(n, 0.19) {
            report.say(format!(
                "{n:>5} not run: {n} processes need about {:.0} GiB at start (0.19 GiB each, \
                 libtorch with its CUDA libraries); {:.0} GiB available",
                n as f64 * 0.19,
                available_bytes() / GIB
            ));
            continue;
        }
        let mut ours = Command::new(&accel);
        ours.args(["bench", "allreduce", "--num-processes", &n.to_string()]).args([
            "--main-process-port",
            "0",
            "--sizes",
            "4",
        ]);
        let (text, ours_s, ours_mem) = timed_with_memory(&mut ours, &format!("accel on {n}"))?;
        let ours_us = latency(&text);
        let (theirs_s, theirs_us, theirs_mem) = if fits(n, 0.23) {
            let mut theirs = Command::new(&torchrun);
            theirs
                .arg(format!("--nproc-per-node={n}"))
                .arg(format!("--master-port={}", 29900 + n))
                .arg(&script)
                .arg("4");
            let (text, s, mem) = timed_with_memory(&mut theirs, &format!("torchrun on {n}"))?;
            (s, latency(&text), mem)
        } else {
            (f64::NAN, f64::NAN, f64::NAN)
        };
        const MIB: f64 = 1024.0 * 1024.0;
        // "-" where torch's run did not fit.
        let shown = |v: f64, width: usize, digits: usize| {
            if v.is_finite() { format!("{v:>width$.digits$}") } else { format!("{:>width$}", "-") }
        };
        report.say(format!(
            "{n:>5} {ours_s:>9.1} {} {} {ours_us:>12.0} {} {:>10.0} {}",
            shown(theirs_s, 9, 1),
            shown(theirs_s / ours_s, 7, 2),
            shown(theirs_us, 12, 0),
            ours_mem / n as f64 / MIB,
            shown(theirs_mem / n as f64 / MIB, 10, 0)
        ));
        report.figure(&format!("scale_{n}_accel_s"), ours_s);
        report.figure(&format!("scale_{n}_accel_us"), ours_us);
        if theirs_s.is_finite() {
            report.figure(&format!("scale_{n}_torch_s"), theirs_s);
            report.figure(&format!("scale_{n}_torch_us"), theirs_us);
        }
    }
    write_block_results(SCALE_RESULTS, "cargo xtask bench scale", &report, None)
}

/// Today's date (UTC), as `date -u +%Y-%m-%d` gives it.
fn today() -> String {
    Command::new("date")
        .args(["-u", "+%Y-%m-%d"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default()
}

/// This machine's CPU, from /proc/cpuinfo.
fn cpu_name() -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name").and_then(|r| r.split_once(':')))
        .map(|(_, name)| name.trim().to_owned())
        .unwrap_or_else(|| "unknown CPU".into())
}

/// Writes `file` (under bench/): the date, the machine, the command, the report's figures and
/// text, which `cargo xtask bench readme` shows in docs/performance.md's block of the same
/// name, and `models` when given (the overhead bench's rows per model).
fn write_block_results(
    file: &str,
    command: &str,
    report: &Report,
    models: Option<serde_json::Map<String, serde_json::Value>>,
) -> Result<(), String> {
    let mut results = serde_json::json!({
        "date": today(),
        "cpu": cpu_name(),
        "cores": std::thread::available_parallelism().map(usize::from).unwrap_or(1),
        "command": command,
        "figures": report.figures,
        "report": report.text,
    });
    if let Some(models) = models {
        results["models"] = serde_json::Value::Object(models);
    }
    let path = root().join(file);
    std::fs::write(&path, serde_json::to_string_pretty(&results).expect("json") + "\n")
        .map_err(|e| format!("{}: {e}", path.display()))?;
    eprintln!("xtask: wrote {file}");
    Ok(())
}

/// The data loader's workers (`num_workers`) against a data set whose samples cost CPU time
/// to make: an epoch's time and the share of it the training loop waited for data.
fn loader_bench() -> Result<(), String> {
    cargo(&["build", "--release", "-p", "accel-examples", "--example", "loader_bench"], &[])?;
    run(&mut Command::new(root().join("target/release/examples/loader_bench")))
}

/// Instructions one training step costs, under callgrind (valgrind from Debian's packages):
/// each program runs twice with different step counts and the difference per step is the
/// step's cost, start-up and warm-up cancelled out. The figure this noisy VM cannot blur:
/// accel's explicit API and the attribute against the raw loop (the same ATen work, no
/// accelerator), on the MLP and the transformer of the speed benchmark, one process.
/// `only` picks one model ("mlp" or "transformer"); all of them when `None`.
fn overhead_bench(only: Option<&str>) -> Result<(), String> {
    let valgrind = Command::new("valgrind").arg("--version").output();
    if !valgrind.is_ok_and(|o| o.status.success()) {
        return Err(
            "valgrind is not installed: `apt-get install valgrind` (Debian's package)".into()
        );
    }
    cargo(
        &["build", "--release", "-p", "accel-examples"],
        &["--example".into(), "mlp_bench".into(), "--example".into(), "lm_bench".into()],
    )?;
    let examples = root().join("target/release/examples");
    let out = std::env::temp_dir().join(format!("accel-callgrind-{}", std::process::id()));
    // Instructions of one run, from callgrind's "Collected : N" line.
    let instructions = |program: &str, args: &[String]| -> Result<f64, String> {
        let output = Command::new("valgrind")
            .arg("--tool=callgrind")
            .arg(format!("--callgrind-out-file={}", out.display()))
            .arg(examples.join(program))
            .args(args)
            .env("OMP_NUM_THREADS", "1")
            .output()
            .map_err(|e| format!("cannot run valgrind: {e}"))?;
        let _ = std::fs::remove_file(&out);
        let stderr = String::from_utf8_lossy(&output.stderr);
        if !output.status.success() {
            return Err(format!("{program} {args:?} under callgrind failed:\n{stderr}"));
        }
        stderr
            .lines()
            .find_map(|l| l.split("Collected :").nth(1))
            .and_then(|n| n.trim().parse::<f64>().ok())
            .ok_or_else(|| format!("no instruction count from callgrind:\n{stderr}"))
    };
    eprintln!(
        "xtask: counting instructions under callgrind (6 runs per model, about 3-6 minutes each) ..."
    );
    // Rows of earlier runs, kept for the models this run does not count.
    let path = root().join(OVERHEAD_RESULTS);
    let earlier: serde_json::Value = std::fs::read_to_string(&path)
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or_default();
    let mut kept = earlier["models"].as_object().cloned().unwrap_or_default();
    let figures = earlier["figures"].as_object().cloned().unwrap_or_default();
    let mut report = Report { text: String::new(), figures };
    let title = format!(
        "Instructions per training step (callgrind, 1 process, one thread; the difference of \
         two runs of different lengths, per step)\n{:<12} {:<10} {:>16} {:>12}",
        "model", "mode", "instructions", "vs raw"
    );
    println!("\n{title}");
    // (model, program, its fixed flags, the flag of the run length, the two lengths)
    type Model = (&'static str, &'static str, &'static [&'static str], &'static str, [usize; 2]);
    let models: [Model; 2] = [
        ("MLP", "mlp_bench", &[], "--batches", [10, 20]),
        ("transformer", "lm_bench", &["--warmup", "0"], "--steps", [2, 4]),
    ];
    if let Some(only) = only.filter(|o| !models.iter().any(|m| m.0.eq_ignore_ascii_case(o))) {
        return Err(format!("no model `{only}` in the overhead bench: mlp or transformer"));
    }
    for (model, program, fixed, flag, [short, long]) in models {
        if only.is_some_and(|o| !model.eq_ignore_ascii_case(o)) {
            continue;
        }
        let mut raw = f64::NAN;
        let mut rows = Vec::new();
        for (mode, extra) in
            [("raw", Some("--raw")), ("explicit", None), ("attribute", Some("--attribute"))]
        {
            let run = |n: usize| {
                let mut args: Vec<String> = fixed.iter().map(|a| a.to_string()).collect();
                args.extend([flag.to_owned(), n.to_string()]);
                args.extend(extra.map(str::to_owned));
                instructions(program, &args)
            };
            let per_step = (run(long)? - run(short)?) / (long - short) as f64;
            if mode == "raw" {
                raw = per_step;
            }
            let percent = 100.0 * (per_step / raw - 1.0);
            let row = format!("{model:<12} {mode:<10} {per_step:>16.0} {percent:>+11.2}%");
            println!("{row}");
            rows.push(row);
            report.figure(&format!("{model}.{mode}.instructions"), per_step);
            report.figure(&format!("{model}.{mode}.percent_over_raw"), percent);
        }
        kept.insert(
            model.into(),
            serde_json::json!({ "date": today(), "cpu": cpu_name(), "rows": rows }),
        );
    }
    // The page's block: every model counted so far, each with the date of its count.
    let text = &mut report.text;
    text.push_str(&title);
    text.push('\n');
    for (model, rows) in &kept {
        for row in rows["rows"].as_array().into_iter().flatten() {
            text.push_str(row.as_str().unwrap_or_default());
            text.push('\n');
        }
        text.push_str(&format!(
            "({model}: counted {} on {})\n",
            rows["date"].as_str().unwrap_or("?"),
            rows["cpu"].as_str().unwrap_or("a machine not recorded")
        ));
    }
    // The models' rows kept too, for the next run that counts only some of them.
    write_block_results(OVERHEAD_RESULTS, "cargo xtask bench overhead", &report, Some(kept))
}

/// Where the scale benchmark's results are kept.
const SCALE_RESULTS: &str = "bench/scale.json";

/// Where the Llama benchmark's results are kept.
const LLAMA_RESULTS: &str = "bench/llama.json";

/// Where the overhead benchmark's results are kept, per model (each run of
/// `cargo xtask bench overhead [model]` replaces its models' rows).
const OVERHEAD_RESULTS: &str = "bench/overhead.json";

/// Where the speed benchmark's results are kept (docs/performance.md's bench block is made
/// from it).
const RESULTS: &str = "bench/results.json";

/// The page whose block between the bench markers `cargo xtask bench readme` rewrites.
const BENCH_PAGE: &str = "docs/performance.md";

/// Writes bench/results.json: the figures, the printed report, the commit, the CPU, the date.
fn write_results(report: &Report) -> Result<(), String> {
    let root = root();
    let capture = |program: &str, args: &[&str]| -> String {
        Command::new(program)
            .args(args)
            .current_dir(&root)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
            .unwrap_or_default()
    };
    let dirty = !capture("git", &["status", "--porcelain", "--untracked-files=no"]).is_empty();
    let commit = capture("git", &["rev-parse", "--short=12", "HEAD"]);
    let cpu = cpu_name();
    let results = serde_json::json!({
        "date": today(),
        "commit": if dirty { format!("{commit} (with uncommitted changes)") } else { commit },
        "cpu": cpu,
        "cores": std::thread::available_parallelism().map(usize::from).unwrap_or(1),
        "command": "cargo xtask bench",
        "figures": report.figures,
        "report": report.text,
    });
    let path = root.join(RESULTS);
    std::fs::create_dir_all(path.parent().expect("bench/"))
        .and_then(|()| {
            std::fs::write(&path, serde_json::to_string_pretty(&results).expect("json") + "\n")
        })
        .map_err(|e| format!("{}: {e}", path.display()))?;
    eprintln!("xtask: wrote {RESULTS}");
    Ok(())
}

/// accel_core::heap's malloc thresholds (32 MiB, 1 GiB) as glibc reads them from the
/// environment: given to the Python side, it shows what the setting alone is worth there.
const KEPT_HEAP: (&str, &str) = (
    "GLIBC_TUNABLES",
    "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=1073741824",
);

/// Rewrites the block between the bench markers of docs/performance.md from
/// bench/results.json. Reads the file only; runs nothing.
fn readme_from_results() -> Result<(), String> {
    const BEGIN: &str = "<!-- bench:begin -->";
    const END: &str = "<!-- bench:end -->";
    let root = root();
    let text = std::fs::read_to_string(root.join(RESULTS))
        .map_err(|e| format!("{RESULTS}: {e} (run `cargo xtask bench` first)"))?;
    let results: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("{RESULTS}: {e}"))?;
    let field = |k: &str| results[k].as_str().unwrap_or("?").to_owned();
    let block = format!(
        "{BEGIN}\n`cargo xtask bench` on {}, commit {}: {} ({} cores, no GPU). Generated from \
         `{RESULTS}` by `cargo xtask bench readme`.\n\n```\n{}```\n{END}",
        field("date"),
        field("commit"),
        field("cpu"),
        results["cores"],
        field("report")
    );
    let path = root.join(BENCH_PAGE);
    let page = std::fs::read_to_string(&path).map_err(|e| format!("{BENCH_PAGE}: {e}"))?;
    let (Some(start), Some(end)) = (page.find(BEGIN), page.find(END)) else {
        return Err(format!("{BENCH_PAGE} has no {BEGIN} … {END} block"));
    };
    let mut updated = format!("{}{block}{}", &page[..start], &page[end + END.len()..]);
    // The blocks of the other benchmarks, where they have run.
    for (name, file) in
        [("scale", SCALE_RESULTS), ("llama", LLAMA_RESULTS), ("overhead", OVERHEAD_RESULTS)]
    {
        let (begin, end) = (format!("<!-- {name}:begin -->"), format!("<!-- {name}:end -->"));
        let (Ok(text), Some(start), Some(stop)) =
            (std::fs::read_to_string(root.join(file)), updated.find(&begin), updated.find(&end))
        else {
            continue;
        };
        let results: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| format!("{file}: {e}"))?;
        let field = |k: &str| results[k].as_str().unwrap_or("?").to_owned();
        let machine = match (results["cpu"].as_str(), results["cores"].as_u64()) {
            (Some(cpu), Some(cores)) => format!("{cpu} ({cores} cores)"),
            _ => "machine not recorded".into(),
        };
        let block = format!(
            "{begin}\n`{}` on {}, {machine}. Generated from `{file}` by `cargo xtask bench \
             readme`.\n\n```\n{}```\n{end}",
            field("command"),
            field("date"),
            field("report")
        );
        updated = format!("{}{block}{}", &updated[..start], &updated[stop + end.len()..]);
    }
    std::fs::write(&path, updated).map_err(|e| format!("{BENCH_PAGE}: {e}"))?;
    eprintln!("xtask: {BENCH_PAGE}'s bench block now shows {RESULTS}");
    Ok(())
}

/// Peak memory per process of each strategy on a 52M-parameter model, accel beside
/// PyTorch (DDP, ZeroRedundancyOptimizer, FSDP2) and the ZeRO paper's formulas.
fn memory_bench() -> Result<(), String> {
    cargo(
        &["build", "--release", "-p", "accel-core", "--bin", "accel", "-p", "accel-examples"],
        &["--example".into(), "memory_bench".into(), "--example".into(), "llama".into()],
    )?;
    let root = root();
    let accel = root.join("target/release/accel");
    let example = root.join("target/release/examples/memory_bench");
    let torchrun = root.join(".venv/bin/torchrun");
    let script = root.join("python/reference/torch_memory.py");
    eprintln!("xtask: measuring memory, 4 strategies x 2 and 4 processes, accel and PyTorch ...");
    const MIB: f64 = 1024.0 * 1024.0;
    // The largest unit: one 2560x2560 Linear with its bias.
    let unit = 2560.0 * 2560.0 + 2560.0;
    println!(
        "\nPeak resident memory per process above the process's own baseline, during training \
         steps 2-4 (max over ranks);\n8 Linear 2560x2560 units (52.4M parameters), AdamW \
         (fused) fp32, batch 8, CPU, 1 thread per process. PyTorch: DDP, DDP + \
         ZeroRedundancyOptimizer,\nFSDP2 fully_shard with reshard_after_forward False / True. \
         Formula = ZeRO paper's model state (16Ψ, 8Ψ+8Ψ/N, 4Ψ+12Ψ/N, 16Ψ/N)\n+ the working \
         set, in copies of the largest unit (4 bytes x 6.6M): zero2 4 (the gradients being \
         computed, their reduce-scatter buffer, two more in flight), zero3 6 (also its \
         gathered parameters and the next unit's, prefetched)"
    );
    println!(
        "{:<8} {:>3} {:>10} {:>10} {:>8} {:>12} {:>9} {:>9} {:>9}",
        "strategy",
        "N",
        "accel MiB",
        "torch MiB",
        "vs torch",
        "formula MiB",
        "vs form.",
        "accel s",
        "torch s"
    );
    for n in [2usize, 4] {
        for strategy in ["ddp", "zero1", "zero2", "zero3"] {
            let mut ours = Command::new(&accel);
            ours.args(["launch", "--num-processes", &n.to_string(), "--main-process-port", "0"])
                .args(["--cpu", "--strategy", strategy])
                .arg(&example)
                .env("MALLOC_MMAP_THRESHOLD_", "65536");
            let mut theirs = Command::new(&torchrun);
            theirs
                .args([format!("--nproc-per-node={n}"), "--master-port=29791".into()])
                .arg(&script)
                .arg(strategy)
                .env("MALLOC_MMAP_THRESHOLD_", "65536");
            let (peak, step, psi) = memory_figures(&mut ours, n)?;
            let (torch_peak, torch_step, _) = memory_figures(&mut theirs, n)?;
            let n_f = n as f64;
            let formula = match strategy {
                "ddp" => 16.0 * psi,
                "zero1" => 8.0 * psi + 8.0 * psi / n_f,
                "zero2" => 4.0 * psi + 12.0 * psi / n_f + 4.0 * 4.0 * unit,
                _ => 16.0 * psi / n_f + 6.0 * 4.0 * unit,
            };
            println!(
                "{strategy:<8} {n:>3} {:>10.0} {:>10.0} {:>7.2}x {:>12.0} {:>8.2}x {:>9.3} {:>9.3}",
                peak / MIB,
                torch_peak / MIB,
                peak / torch_peak,
                formula / MIB,
                peak / formula,
                step,
                torch_step
            );
        }
    }
    Ok(())
}

/// Runs a memory benchmark command of `n` processes; returns each rank's JSON object (as
/// text: ranks print concurrently, so objects may share a line).
fn rank_results(command: &mut Command, n: usize) -> Result<Vec<String>, String> {
    let output = command.output().map_err(|e| format!("cannot run {command:?}: {e}"))?;
    let text = String::from_utf8_lossy(&output.stdout).into_owned();
    if !output.status.success() {
        return Err(format!(
            "{command:?} failed:\n{text}{}",
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    let objects: Vec<String> = text
        .split('{')
        .filter(|o| o.contains("\"peak_bytes\""))
        .map(|o| o.split('}').next().unwrap_or("").to_owned())
        .collect();
    if objects.len() != n {
        return Err(format!("expected {n} results from {command:?}, got:\n{text}"));
    }
    Ok(objects)
}

/// The number under `key` in a rank's JSON object.
fn field(object: &str, key: &str) -> Option<f64> {
    let at = object.find(&format!("\"{key}\":"))? + key.len() + 3;
    object[at..].split([',', '}']).next()?.trim().parse().ok()
}

/// The highest peak bytes, the slowest step time and the parameter count of a memory
/// benchmark command's ranks.
fn memory_figures(command: &mut Command, n: usize) -> Result<(f64, f64, f64), String> {
    let objects = rank_results(command, n)?;
    let peak = objects.iter().filter_map(|o| field(o, "peak_bytes")).fold(0.0, f64::max);
    let step = objects.iter().filter_map(|o| field(o, "step_s")).fold(0.0, f64::max);
    let psi = objects.iter().find_map(|o| field(o, "params")).unwrap_or(0.0);
    Ok((peak, step, psi))
}

/// The highest `load_peak_bytes` of a memory benchmark command's ranks (Llama's).
fn load_peak(command: &mut Command, n: usize) -> Result<f64, String> {
    let objects = rank_results(command, n)?;
    Ok(objects.iter().filter_map(|o| field(o, "load_peak_bytes")).fold(0.0, f64::max))
}

/// A ~100M-parameter Llama on 4 processes: peak memory per process while loading under ddp
/// and zero3, and while training under zero3 with and without activation checkpointing,
/// beside PyTorch FSDP2 (+ checkpoint_wrapper) on the same model.
fn llama_memory_bench() -> Result<(), String> {
    cargo(
        &["build", "--release", "-p", "accel-core", "--bin", "accel", "-p", "accel-examples"],
        &["--example".into(), "llama".into(), "--example".into(), "fsdp_unchanged".into()],
    )?;
    const MIB: f64 = 1024.0 * 1024.0;
    let root = root();
    let dir = root.join("target/bench-llama");
    let python = root.join(".venv/bin/python");
    let script = root.join("python/reference/llama_reference.py");
    let (model, tokens) = (dir.join("model-100m"), dir.join("tokens.safetensors"));
    if !model.join("config.json").exists() {
        run(Command::new(&python)
            .arg(&script)
            .args(["make", "--size", "100m", "--out"])
            .arg(&model))?;
    }
    run(Command::new(&python)
        .arg(&script)
        .args(["tokens", "--rows", "16", "--len", "128", "--vocab", "32000", "--out"])
        .arg(&tokens))?;
    let accel = root.join("target/release/accel");
    let llama = root.join("target/release/examples/llama");
    let ours = |n: usize, strategy: &str, steps: &str, checkpointing: bool| {
        let mut c = Command::new(&accel);
        c.args(["launch", "--num-processes", &n.to_string(), "--main-process-port", "0", "--cpu"])
            .arg(&llama)
            .arg("--model")
            .arg(&model)
            .arg("--data")
            .arg(&tokens)
            .args(["--steps", steps, "--batch-size", "2", "--lr", "1e-4", "--strategy", strategy])
            .arg("--out")
            .arg(dir.join("out"))
            .env("MALLOC_MMAP_THRESHOLD_", "65536");
        if checkpointing {
            c.arg("--activation-checkpointing");
        }
        c
    };
    let lora = |mut c: Command| {
        c.args(["--lora-r", "8"]);
        c
    };
    let theirs = |n: usize, checkpointing: bool, ddp: bool| {
        let mut c = Command::new(root.join(".venv/bin/torchrun"));
        c.args([format!("--nproc-per-node={n}").as_str(), "--master-port=29793"])
            .arg(&script)
            .arg("memory")
            .arg("--model")
            .arg(&model)
            .arg("--data")
            .arg(&tokens)
            .args(["--steps", "3", "--batch-size", "2"])
            .env("MALLOC_MMAP_THRESHOLD_", "65536");
        if checkpointing {
            c.arg("--checkpointing");
        }
        if ddp {
            c.arg("--ddp");
        }
        c
    };
    eprintln!(
        "xtask: measuring the Llama: loading and training on 4 processes (several minutes) ..."
    );
    let model_bytes = 106.0e6 * 4.0;
    let mut report = Report::default();
    let ddp = load_peak(&mut ours(4, "ddp", "0", false), 4)?;
    let zero3 = load_peak(&mut ours(4, "zero3", "0", false), 4)?;
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
    resume_rows(&mut report, &dir, &ours, &theirs)?;
    readme_example_rows(&mut report, &root)?;
    report.say(
        "fine-tuning (AdamW, batch 2 x 128 tokens per process, steps 2-3; accel beside torch's \
         FSDP2 (fully_shard per decoder layer, the embedding and the head, as Accelerate's \
         FSDP2 plugin wraps) and DDP — Accelerate itself runs its FSDP plugin as DDP on CPU; \
         LoRA r8 on q_proj and v_proj, the base frozen, beside transformers + peft + Accelerate):",
    );
    report.say(format!(
        "{:<3} {:<34} {:>10} {:>8} {:>9} {:>8}",
        "N", "", "peak MiB", "step s", "tokens/s", "vs torch"
    ));
    for n in [2usize, 4] {
        let tokens = (2 * 128 * n) as f64;
        let rows = [
            ("accel zero3", ours(n, "zero3", "3", false), "PyTorch FSDP2", theirs(n, false, false)),
            (
                "accel zero3 + activation ckpt",
                ours(n, "zero3", "3", true),
                "PyTorch FSDP2 + checkpoint_wrapper",
                theirs(n, true, false),
            ),
            ("accel ddp", ours(n, "ddp", "3", false), "PyTorch DDP", theirs(n, false, true)),
            (
                "accel ddp + LoRA r8",
                lora(ours(n, "ddp", "3", false)),
                "Accelerate + peft LoRA r8 (DDP)",
                lora(theirs(n, false, false)),
            ),
            (
                "accel zero3 + LoRA r8 (base sharded)",
                lora(ours(n, "zero3", "3", false)),
                "Accelerate + peft LoRA r8 (DDP)",
                lora(theirs(n, false, false)),
            ),
        ];
        for (name, mut command, their_name, mut their_command) in rows {
            let (peak, step, _) = memory_figures(&mut command, n)?;
            let (their_peak, their_step, _) = memory_figures(&mut their_command, n)?;
            let speed = tokens / step;
            let their_speed = tokens / their_step;
            report.say(format!(
                "{n:<3} {name:<34} {:>10.0} {step:>8.2} {speed:>9.1} {:>7.2}x",
                peak / MIB,
                speed / their_speed
            ));
            report.say(format!(
                "{n:<3} {their_name:<34} {:>10.0} {their_step:>8.2} {their_speed:>9.1}",
                their_peak / MIB
            ));
            for (who, peak, speed) in [(name, peak, speed), (their_name, their_peak, their_speed)] {
                let key: String = who
                    .chars()
                    .map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_lowercase() } else { '_' })
                    .collect();
                report.figure(&format!("{n}.{key}.peak_mib"), peak / MIB);
                report.figure(&format!("{n}.{key}.tokens_per_s"), speed);
            }
        }
    }
    write_block_results(LLAMA_RESULTS, "cargo xtask bench llama", &report, None)
}

/// The highest value of `key` among a memory benchmark's ranks.
fn highest(objects: &[String], key: &str) -> f64 {
    objects.iter().filter_map(|o| field(o, key)).fold(0.0, f64::max)
}

/// Resuming the Llama under zero3 on 4 processes: the peak while loading the state beside
/// the peak while training (the same run's), and the bytes each process read, beside FSDP2
/// resuming with torch.distributed.checkpoint.
fn resume_rows(
    report: &mut Report,
    dir: &Path,
    ours: &dyn Fn(usize, &str, &str, bool) -> Command,
    theirs: &dyn Fn(usize, bool, bool) -> Command,
) -> Result<(), String> {
    const MIB: f64 = 1024.0 * 1024.0;
    let (state, dcp) = (dir.join("state-zero3-4"), dir.join("state-fsdp2-4"));
    let _ = std::fs::remove_dir_all(&dcp);
    let mut save = ours(4, "zero3", "3", false);
    rank_results(save.arg("--save-state").arg(&state), 4)?;
    let mut resume = ours(4, "zero3", "3", false);
    let resumed = rank_results(resume.arg("--resume").arg(&state), 4)?;
    let (train, load) = (highest(&resumed, "peak_bytes"), highest(&resumed, "resume_peak_bytes"));
    let read = highest(&resumed, "state_bytes_read");
    let saved: u64 = std::fs::read_dir(&state)
        .map_err(|e| format!("{}: {e}", state.display()))?
        .filter_map(|e| e.ok()?.metadata().ok())
        .map(|m| m.len())
        .sum();
    let mut their_save = theirs(4, false, false);
    rank_results(their_save.arg("--save-state").arg(&dcp), 4)?;
    let mut their_resume = theirs(4, false, false);
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
    const MIB: f64 = 1024.0 * 1024.0;
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
            let key: String = name
                .chars()
                .map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_lowercase() } else { '_' })
                .collect();
            report.figure(&format!("readme.{n}.{key}.steps_mib"), steps / MIB);
            report.figure(&format!("readme.{n}.{key}.run_mib"), whole / MIB);
        }
    }
    Ok(())
}

/// The main job: the `train` example on 2 processes of this machine, on CPU.
fn train(rest: &[OsString]) -> Result<(), String> {
    cargo(
        &["build", "--quiet", "-p", "accel-core", "--bin", "accel", "-p", "accel-examples"],
        &["--example".into(), MAIN_EXAMPLE.into()],
    )?;
    let root = root();
    run(Command::new(root.join("target/debug/accel"))
        .args([
            "launch",
            "--num-processes",
            "2",
            "--main-process-port",
            "0",
            "--cpu",
            "--rank0-only",
        ])
        .arg(root.join("target/debug/examples").join(MAIN_EXAMPLE))
        .args(rest))
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;
    use std::path::{Path, PathBuf};

    use super::root;

    /// Every `.rs` file under `dir`, recursively.
    fn rust_files(dir: &Path) -> Vec<PathBuf> {
        let mut out = Vec::new();
        for entry in std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()) {
            if entry.is_dir() {
                out.extend(rust_files(&entry));
            } else if entry.extension().is_some_and(|e| e == "rs") {
                out.push(entry);
            }
        }
        out
    }

    /// docs/architecture.md, the tour, names every source file of the crates.
    #[test]
    fn the_tour_names_every_source_file() {
        let tour = std::fs::read_to_string(root().join("docs/architecture.md")).unwrap();
        let mut missing = Vec::new();
        for krate in ["accel-core", "accel-macros", "accel-models", "accel-choices", "xtask"] {
            for file in rust_files(&root().join(krate).join("src")) {
                let name = file.file_name().unwrap().to_string_lossy().into_owned();
                if !tour.contains(&name) {
                    missing.push(file.strip_prefix(root()).unwrap().display().to_string());
                }
            }
        }
        assert!(missing.is_empty(), "docs/architecture.md does not name {missing:?}");
    }

    /// Code without comments and without what follows `#[cfg(test)]` (the tests).
    fn code_of(text: &str) -> String {
        let text = text.split("#[cfg(test)]").next().unwrap_or_default();
        text.lines()
            .map(|l| l.split("//").next().unwrap_or_default())
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Every `ACCEL_*` variable is named once: a row of the settings' table
    /// (accel-choices/src/settings.rs) or a constant of accel-core/src/config/env.rs, whose
    /// docs the reference page lists. Elsewhere the code uses the constants (tests aside,
    /// and `env!` of a build script's variable).
    #[test]
    fn every_accel_variable_is_named_in_the_registry() {
        let allowed = ["accel-core/src/config/env.rs", "accel-choices/src/settings.rs"];
        for crate_dir in ["accel-core/src", "accel-models/src", "accel-macros/src"] {
            for file in rust_files(&root().join(crate_dir)) {
                let test_module = file.file_name().is_some_and(|n| n == "tests.rs");
                if test_module || allowed.iter().any(|a| rel(&file) == *a) {
                    continue;
                }
                let text = std::fs::read_to_string(&file).unwrap();
                let code = text.split("#[cfg(test)]").next().unwrap_or_default();
                for (n, line) in code.lines().enumerate() {
                    let line = line.split("//").next().unwrap_or_default();
                    let mut rest = line;
                    while let Some(at) = rest.find("\"ACCEL_") {
                        let name: String = rest[at + 1..]
                            .chars()
                            .take_while(|c| {
                                c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_'
                            })
                            .collect();
                        let closed = rest[at + 1 + name.len()..].starts_with('"');
                        let build_variable = rest[..at].ends_with("env!(");
                        assert!(
                            !closed || name.len() <= "ACCEL_".len() || build_variable,
                            "{}:{}: `{name}` spelled out; use its constant in config/env.rs (or \
                             its row of the settings' table)",
                            rel(&file),
                            n + 1
                        );
                        rest = &rest[at + 1..];
                    }
                }
            }
        }
    }

    /// Configuration is its own layer: the accelerator and tracking read settings and files
    /// through `config`, never through the launcher (`launch` starts processes, and is above
    /// both).
    #[test]
    fn the_accelerator_and_tracking_import_nothing_of_the_launcher() {
        for module in ["accelerator", "tracking", "config"] {
            for file in rust_files(&root().join("accel-core/src").join(module)) {
                let code = code_of(&std::fs::read_to_string(&file).unwrap());
                assert!(
                    !code.contains("crate::launch"),
                    "{} imports the launcher; read settings through crate::config",
                    rel(&file)
                );
            }
        }
    }

    /// The top-level modules of accel-core (files and folders of src/, lib.rs and bin/ aside)
    /// import each other in no cycle: each `crate::module` path, and each `crate::Name`
    /// re-exported at the root by lib.rs's `pub use module::..`, is an edge.
    #[test]
    fn accel_cores_modules_import_each_other_in_no_cycle() {
        let src = root().join("accel-core/src");
        let mut modules: std::collections::BTreeMap<String, Vec<PathBuf>> = Default::default();
        for entry in std::fs::read_dir(&src).unwrap().map(|e| e.unwrap().path()) {
            let name = entry.file_stem().unwrap().to_string_lossy().into_owned();
            if name == "lib" || name == "bin" {
                continue;
            }
            let files = if entry.is_dir() { rust_files(&entry) } else { vec![entry] };
            modules.entry(name).or_default().extend(files);
        }
        // What lib.rs re-exports at the root, by the module it comes from.
        let lib = code_of(&std::fs::read_to_string(src.join("lib.rs")).unwrap());
        let mut reexported: std::collections::HashMap<String, String> = Default::default();
        for statement in lib.split(';') {
            let Some(rest) = statement.trim().strip_prefix("pub use ") else { continue };
            let module = rest.split("::").next().unwrap_or_default().trim().to_owned();
            if !modules.contains_key(&module) {
                continue;
            }
            for word in rest.split(|c: char| !(c.is_alphanumeric() || c == '_')) {
                if word.chars().next().is_some_and(char::is_uppercase) {
                    reexported.insert(word.to_owned(), module.clone());
                }
            }
        }
        let mut edges: std::collections::BTreeMap<String, HashSet<String>> = Default::default();
        for (module, files) in &modules {
            for file in files.iter().filter(|f| !f.ends_with("tests.rs")) {
                let code = code_of(&std::fs::read_to_string(file).unwrap());
                for (i, _) in code.match_indices("crate::") {
                    let word: String = code[i + 7..]
                        .chars()
                        .take_while(|c| c.is_alphanumeric() || *c == '_')
                        .collect();
                    let target = if modules.contains_key(&word) {
                        Some(word)
                    } else {
                        reexported.get(&word).cloned()
                    };
                    if let Some(target) = target.filter(|t| t != module) {
                        edges.entry(module.clone()).or_default().insert(target);
                    }
                }
            }
        }
        // A cycle: a module that reaches itself.
        for start in modules.keys() {
            let mut seen = HashSet::new();
            let mut stack: Vec<(String, Vec<String>)> = vec![(start.clone(), vec![start.clone()])];
            while let Some((at, path)) = stack.pop() {
                for next in edges.get(&at).into_iter().flatten() {
                    if next == start {
                        panic!(
                            "accel-core's modules import each other in a cycle: {} -> {start}",
                            path.join(" -> ")
                        );
                    }
                    if seen.insert(next.clone()) {
                        let mut longer = path.clone();
                        longer.push(next.clone());
                        stack.push((next.clone(), longer));
                    }
                }
            }
        }
        assert!(edges.len() > 10, "the modules were found: {edges:?}");
    }

    /// The README is the front door (what accel is, the two commands, the one line, the
    /// limits); the rest lives in docs/.
    const README_MAX_LINES: usize = 400;

    #[test]
    fn the_readme_stays_a_front_door() {
        let text = std::fs::read_to_string(root().join("README.md")).expect("README.md");
        let lines = text.lines().count();
        assert!(
            lines <= README_MAX_LINES,
            "README.md has {lines} lines, more than {README_MAX_LINES}: move the detail into a \
             guide under docs/ and link to it"
        );
    }

    /// README.md and every docs/*.md.
    fn pages() -> Vec<PathBuf> {
        let root = root();
        let mut pages = vec![root.join("README.md")];
        let mut docs: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
            .expect("docs/")
            .map(|e| e.expect("docs/ entry").path())
            .filter(|p| p.extension().is_some_and(|e| e == "md"))
            .collect();
        docs.sort();
        pages.extend(docs);
        pages
    }

    /// `text` with fenced code blocks and code spans blanked out (newlines kept, so that
    /// positions still give line numbers): `](` in code is not a link.
    fn prose(text: &str) -> String {
        let mut out = String::with_capacity(text.len());
        let mut fenced = false;
        for line in text.split_inclusive('\n') {
            let fence = line.trim_start().starts_with("```");
            if fence || fenced {
                out.extend(line.chars().map(|c| if c == '\n' { '\n' } else { ' ' }));
            } else {
                out.push_str(line);
            }
            fenced ^= fence;
        }
        // Code spans (CommonMark): a run of n backticks up to the next run of exactly n;
        // an unmatched run is literal.
        let chars: Vec<char> = out.chars().collect();
        let run_at = |i: usize| chars[i..].iter().take_while(|&&c| c == '`').count();
        let mut blank = vec![false; chars.len()];
        let mut i = 0;
        while i < chars.len() {
            if chars[i] != '`' {
                i += 1;
                continue;
            }
            let n = run_at(i);
            let mut j = i + n;
            let mut close = None;
            while j < chars.len() {
                if chars[j] == '`' {
                    let m = run_at(j);
                    if m == n {
                        close = Some(j + m);
                        break;
                    }
                    j += m;
                } else {
                    j += 1;
                }
            }
            match close {
                Some(end) => {
                    blank[i..end].iter_mut().for_each(|b| *b = true);
                    i = end;
                }
                None => i += n,
            }
        }
        chars.iter().zip(&blank).map(|(&c, &b)| if b && c != '\n' { ' ' } else { c }).collect()
    }

    /// The link targets of `text` (`](target)`), with their line numbers.
    fn links(text: &str) -> Vec<(usize, String)> {
        let prose = prose(text);
        let mut found = Vec::new();
        let mut from = 0;
        while let Some(at) = prose[from..].find("](") {
            let start = from + at + 2;
            let Some(close) = prose[start..].find(')') else { break };
            let target = prose[start..start + close].split_whitespace().next().unwrap_or("");
            let line = prose[..start].matches('\n').count() + 1;
            found.push((line, target.trim_matches(['<', '>']).to_owned()));
            from = start + close;
        }
        found
    }

    /// The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces
    /// made hyphens.
    fn anchors(text: &str) -> HashSet<String> {
        prose(text)
            .lines()
            .zip(text.lines())
            .filter(|(blanked, _)| blanked.starts_with('#'))
            .map(|(_, heading)| {
                heading
                    .trim_start_matches('#')
                    .trim()
                    .to_lowercase()
                    .chars()
                    .filter_map(|c| match c {
                        ' ' => Some('-'),
                        c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
                        _ => None,
                    })
                    .collect()
            })
            .collect()
    }

    #[test]
    fn every_relative_link_of_the_readme_and_the_guides_points_at_something_that_exists() {
        let mut broken = Vec::new();
        for page in pages() {
            let text = std::fs::read_to_string(&page).expect("a page");
            let dir = page.parent().expect("a folder");
            let name = page.strip_prefix(root()).unwrap_or(&page).display().to_string();
            for (line, target) in links(&text) {
                if target.contains("://") || target.starts_with("mailto:") || target.is_empty() {
                    continue;
                }
                let (path, anchor) = match target.split_once('#') {
                    Some((path, anchor)) => (path, Some(anchor)),
                    None => (target.as_str(), None),
                };
                let file: PathBuf = if path.is_empty() { page.clone() } else { dir.join(path) };
                if !file.exists() {
                    broken.push(format!("{name}:{line}: `{target}`: no {}", rel(&file)));
                    continue;
                }
                let markdown = file.extension().is_some_and(|e| e == "md");
                if let (Some(anchor), true) = (anchor, markdown) {
                    let heads = anchors(&std::fs::read_to_string(&file).expect("a page"));
                    if !heads.contains(anchor) {
                        broken.push(format!(
                            "{name}:{line}: `{target}`: no heading with anchor #{anchor} in {}",
                            rel(&file)
                        ));
                    }
                }
            }
        }
        assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
    }

    fn rel(path: &Path) -> String {
        let root = root();
        let normal: PathBuf = path.components().fold(PathBuf::new(), |mut acc, c| {
            match c {
                std::path::Component::ParentDir => {
                    acc.pop();
                }
                other => acc.push(other),
            }
            acc
        });
        normal.strip_prefix(&root).unwrap_or(&normal).display().to_string()
    }

    #[test]
    fn links_in_code_are_not_links_and_anchors_follow_github() {
        let text = "# Top: the `data` key\n[a](x.md) `[b](y.md)` ``[c](z.md)``\n\
                    ```\n[d](w.md)\n```\n[e](v.md#top-the-data-key)\n";
        let found: Vec<String> = links(text).into_iter().map(|(_, t)| t).collect();
        assert_eq!(found, ["x.md", "v.md#top-the-data-key"]);
        assert!(anchors(text).contains("top-the-data-key"));
    }
}
