//! `cargo xtask bench overhead`: instructions per training step under callgrind, accel's
//! explicit API and attribute against the raw loop, per model.

use std::path::Path;
use std::process::Command;

use crate::results::{OVERHEAD_RESULTS, Report, cpu_name, today, write_block_results};
use crate::{cargo, root};

/// Instructions one training step costs, under callgrind (valgrind from Debian's packages):
/// each program runs twice with different step counts and the difference per step is the
/// step's cost, start-up and warm-up cancelled out. The figure this noisy VM cannot blur:
/// accel's explicit API and the attribute against the raw loop (the same ATen work, no
/// accelerator), on the MLP and the transformer of the speed benchmark, one process.
/// `only` picks one model ("mlp" or "transformer"); all of them when `None`.
pub(crate) fn overhead_bench(only: Option<&str>) -> Result<(), String> {
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
    let instructions =
        |program: &str, args: &[String]| callgrind_instructions(&examples, &out, program, args);
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
    append_kept_rows(&mut report.text, &title, &kept);
    // The models' rows kept too, for the next run that counts only some of them.
    write_block_results(OVERHEAD_RESULTS, "cargo xtask bench overhead", &report, Some(kept))
}

/// Instructions of one run of `program` (under `examples`), from callgrind's "Collected : N"
/// line; callgrind's own output file `out` is removed after.
fn callgrind_instructions(
    examples: &Path,
    out: &Path,
    program: &str,
    args: &[String],
) -> Result<f64, String> {
    let output = Command::new("valgrind")
        .arg("--tool=callgrind")
        .arg(format!("--callgrind-out-file={}", out.display()))
        .arg(examples.join(program))
        .args(args)
        .env("OMP_NUM_THREADS", "1")
        .output()
        .map_err(|e| format!("cannot run valgrind: {e}"))?;
    let _ = std::fs::remove_file(out);
    let stderr = String::from_utf8_lossy(&output.stderr);
    if !output.status.success() {
        return Err(format!("{program} {args:?} under callgrind failed:\n{stderr}"));
    }
    stderr
        .lines()
        .find_map(|l| l.split("Collected :").nth(1))
        .and_then(|n| n.trim().parse::<f64>().ok())
        .ok_or_else(|| format!("no instruction count from callgrind:\n{stderr}"))
}

/// The page's block: `title`, then every model counted so far (`kept`), each with the date of
/// its count.
fn append_kept_rows(
    text: &mut String,
    title: &str,
    kept: &serde_json::Map<String, serde_json::Value>,
) {
    text.push_str(title);
    text.push('\n');
    for (model, rows) in kept {
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
}
