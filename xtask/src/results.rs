//! What the benchmarks write: bench/*.json, and docs/performance.md's blocks made from them.

use std::process::Command;

use crate::root;

/// Where the scale benchmark's results are kept.
pub(crate) const SCALE_RESULTS: &str = "bench/scale.json";

/// Where the Llama benchmark's results are kept.
pub(crate) const LLAMA_RESULTS: &str = "bench/llama.json";
/// `cargo xtask bench in-backward`'s figures (the Llama with the update inside backward).
pub(crate) const IN_BACKWARD_RESULTS: &str = "bench/in-backward.json";
/// Where `cargo xtask bench generate` writes its figures.
pub(crate) const GENERATE_RESULTS: &str = "bench/generate.json";

/// Where the overhead benchmark's results are kept, per model (each run of
/// `cargo xtask bench overhead [model]` replaces its models' rows).
pub(crate) const OVERHEAD_RESULTS: &str = "bench/overhead.json";

/// Where the speed benchmark's results are kept (docs/performance.md's bench block is made
/// from it).
const RESULTS: &str = "bench/results.json";

/// The page whose block between the bench markers `cargo xtask bench readme` rewrites.
const BENCH_PAGE: &str = "docs/performance.md";

/// What the speed benchmark printed, and its figures by name (for bench/results.json).
#[derive(Default)]
pub(crate) struct Report {
    pub(crate) text: String,
    pub(crate) figures: serde_json::Map<String, serde_json::Value>,
}

impl Report {
    /// Prints `line` and keeps it.
    pub(crate) fn say(&mut self, line: impl AsRef<str>) {
        println!("{}", line.as_ref());
        self.text.push_str(line.as_ref());
        self.text.push('\n');
    }

    pub(crate) fn figure(&mut self, key: &str, value: f64) {
        let rounded = (value * 1000.0).round() / 1000.0;
        self.figures.insert(key.into(), serde_json::json!(rounded));
    }
}

/// Today's date (UTC), as `date -u +%Y-%m-%d` gives it.
pub(crate) fn today() -> String {
    Command::new("date")
        .args(["-u", "+%Y-%m-%d"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default()
}

/// This machine's CPU, from /proc/cpuinfo.
pub(crate) fn cpu_name() -> String {
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
pub(crate) fn write_block_results(
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

/// Writes bench/results.json: the figures, the printed report, the commit, the CPU, the date.
pub(crate) fn write_results(report: &Report) -> Result<(), String> {
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

/// Rewrites the block between the bench markers of docs/performance.md from
/// bench/results.json. Reads the file only; runs nothing.
pub(crate) fn readme_from_results() -> Result<(), String> {
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
    for (name, file) in [
        ("scale", SCALE_RESULTS),
        ("llama", LLAMA_RESULTS),
        ("in-backward", IN_BACKWARD_RESULTS),
        ("overhead", OVERHEAD_RESULTS),
        ("generate", GENERATE_RESULTS),
    ] {
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
