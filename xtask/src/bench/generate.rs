//! `cargo xtask bench generate`: generation with the 106M Llama in one process on the CPU —
//! `llama generate` beside transformers' `generate` on the same checkpoint and prompt, with
//! the key/value cache, in fp32 and bf16, and under a 150 MiB budget with the rest of the
//! model on the disk beside Accelerate's `device_map="auto"` with an offload folder;
//! written to bench/generate.json. Runs alternate, two rounds each; both figures kept.

use std::path::Path;
use std::process::Command;

use crate::results::{GENERATE_RESULTS, Report, write_block_results};
use crate::{cargo, root, run};

/// Tokens per second that `command` printed on its standard error ("... (N tokens/s ...").
fn tokens_per_s(command: &mut Command) -> Result<f64, String> {
    let output = command.output().map_err(|e| format!("cannot run {command:?}: {e}"))?;
    let said = String::from_utf8_lossy(&output.stderr).into_owned();
    if !output.status.success() {
        return Err(format!("{command:?} failed:\n{said}"));
    }
    said.lines()
        .find_map(|l| {
            let (before, _) = l.split_once(" tokens/s")?;
            before.rsplit('(').next()?.trim().parse().ok()
        })
        .ok_or_else(|| format!("{command:?} printed no tokens/s:\n{said}"))
}

pub(crate) fn generate_bench() -> Result<(), String> {
    cargo(&["build", "--release", "-p", "accel-examples"], &["--example".into(), "llama".into()])?;
    let root = root();
    let dir = root.join("target/bench-llama");
    let model = dir.join("model-100m");
    let python = root.join(".venv/bin/python");
    if !model.join("config.json").exists() {
        run(Command::new(&python)
            .arg(root.join("python/reference/llama_reference.py"))
            .args(["make", "--size", "100m", "--out"])
            .arg(&model))?;
    }
    let (prompt, new) =
        ("1,100,200,300,400,500,600,700,800,900,1000,1100,1200,1300,1400,1500", "64");
    let ours = |extra: &[&str]| {
        let mut c = Command::new(root.join("target/release/examples/llama"));
        c.args(["generate", "--model"]).arg(&model);
        c.args(["--prompt-ids", prompt, "--max-new-tokens", new, "--eos-ids", ""]).args(extra);
        c.env("OMP_NUM_THREADS", "2");
        c
    };
    let theirs = |extra: &[&str]| {
        let mut c = Command::new(&python);
        c.arg(root.join("python/reference/hf_families.py"));
        c.args(["generate", "--model"]).arg(&model);
        c.args(["--prompt-ids", prompt, "--max-new-tokens", new, "--eos-ids", ""]).args(extra);
        c.env("OMP_NUM_THREADS", "2");
        c
    };
    let offload = dir.join("offload");
    let offload_theirs = dir.join("offload-accelerate");
    let (ours_folder, theirs_folder) = (folder(&offload), folder(&offload_theirs));
    let rows: Vec<(&str, Vec<&str>, Vec<&str>)> = vec![
        ("fp32, the model in memory", vec![], vec![]),
        ("bf16, the model in memory", vec!["--precision", "bf16"], vec!["--dtype", "bfloat16"]),
        (
            "fp32, 150 MiB budget, the rest on the disk",
            vec!["--max-memory", "150MiB", "--offload-folder", &ours_folder],
            vec!["--offload-folder", &theirs_folder, "--max-memory", "150MiB"],
        ),
    ];
    let mut report = Report::default();
    report.say(format!(
        "generation, the 106M Llama (fp32 405 MiB), 1 process, CPU, 2 threads: a 16-token \
         prompt and {new} new tokens, greedy, with the key/value cache; tokens per second \
         (prompt included), accel's `llama generate` beside transformers' `generate` (and \
         Accelerate's device_map=\"auto\" with an offload folder for the budget row); two \
         rounds, alternating"
    ));
    report.say(format!("{:<44} {:>16} {:>16} {:>9}", "", "accel tok/s", "transformers", "ratio"));
    for (name, our_flags, their_flags) in rows {
        let (mut ours_seen, mut theirs_seen) = (Vec::new(), Vec::new());
        for _ in 0..2 {
            ours_seen.push(tokens_per_s(&mut ours(&our_flags))?);
            theirs_seen.push(tokens_per_s(&mut theirs(&their_flags))?);
        }
        let best = |v: &[f64]| v.iter().copied().fold(f64::MIN, f64::max);
        let pair = |v: &[f64]| format!("{:.1}/{:.1}", v[0], v[1]);
        report.say(format!(
            "{name:<44} {:>16} {:>16} {:>8.2}x",
            pair(&ours_seen),
            pair(&theirs_seen),
            best(&ours_seen) / best(&theirs_seen)
        ));
        let key: String = name
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_lowercase() } else { '_' })
            .collect();
        report.figure(&format!("{key}.accel_tokens_per_s"), best(&ours_seen));
        report.figure(&format!("{key}.transformers_tokens_per_s"), best(&theirs_seen));
    }
    write_block_results(GENERATE_RESULTS, "cargo xtask bench generate", &report, None)
}

/// `path` as a string, emptied first (each run writes its offloaded modules afresh).
fn folder(path: &Path) -> String {
    let _ = std::fs::remove_dir_all(path);
    path.display().to_string()
}
