//! Where `cargo xtask test`'s time goes: each phase timed (setup, the builds, every test
//! binary, packaging, docs, fmt, clippy), printed as a table at the end with the five
//! slowest tests, and compared with the table of the last fresh clone measured
//! (xtask/phases.json, kept by hand with docs/performance.md).
//!
//! A test's time is read off libtest's ordinary output: libtest starts the tests of a binary
//! in the order of their names, `threads` at a time, and starts the next one as each ends;
//! so the k-th test in that order starts when the (k - threads + 1)-th result is printed.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::process::Command;
use std::time::{Duration, Instant};

/// A fresh clone's run past this is warned about (CI's budget is 30 minutes on the 2-core
/// VMs; the warning leaves room to act).
const WARN_AFTER: Duration = Duration::from_secs(25 * 60);

/// The phases of one run, in order.
#[derive(Default)]
pub(crate) struct Phases {
    rows: Vec<(String, Duration)>,
    /// (test, binary, seconds) of every test that ran.
    tests: Vec<(String, String, f64)>,
}

impl Phases {
    /// Runs `f` as the phase `name`.
    pub(crate) fn time<T>(&mut self, name: &str, f: impl FnOnce() -> T) -> T {
        let started = Instant::now();
        let out = f();
        self.rows.push((name.to_owned(), started.elapsed()));
        out
    }

    /// Runs `command` (a `cargo test`), echoing what it prints, and records a phase per test
    /// binary (`test NAME`) and the time of each test.
    pub(crate) fn run_tests(&mut self, command: &mut Command) -> Result<(), String> {
        let (reader, writer) = std::io::pipe().map_err(|e| format!("pipe: {e}"))?;
        let clone = writer.try_clone().map_err(|e| format!("pipe: {e}"))?;
        command.stdout(clone).stderr(writer);
        let mut child = command.spawn().map_err(|e| format!("cannot run {command:?}: {e}"))?;
        // The command keeps copies of the pipe's writing end: without dropping them the read
        // below would never see its end.
        drop(std::mem::replace(command, Command::new("true")));
        let threads = test_threads();
        let mut binary: Option<Binary> = None;
        let mut out = std::io::stdout().lock();
        for line in BufReader::new(reader).lines() {
            let line = line.map_err(|e| format!("reading cargo test's output: {e}"))?;
            let _ = writeln!(out, "{line}");
            let now = Instant::now();
            let trimmed = line.trim_start();
            let starts = trimmed
                .strip_prefix("Running ")
                .or_else(|| trimmed.strip_prefix("Doc-tests ").map(|_| trimmed));
            if let Some(what) = starts {
                if let Some(done) = binary.take() {
                    self.finish_binary(done, now);
                }
                binary = Some(Binary::new(name_of(what), now, threads));
                continue;
            }
            let Some(b) = binary.as_mut() else { continue };
            if let Some(n) = trimmed.strip_prefix("running ").and_then(|r| r.split(' ').next()) {
                b.expected = n.parse().unwrap_or(0);
                b.started_at = now;
            } else if let Some(rest) = trimmed.strip_prefix("test ") {
                // `test NAME ... ok` (or FAILED); not `test result:` nor a 60 s notice.
                if let Some((name, outcome)) = rest.rsplit_once(" ... ") {
                    if !outcome.starts_with("ignored") {
                        b.finished(name, now);
                    }
                } else if rest.starts_with("result:") {
                    b.done_at = Some(now);
                }
            }
        }
        if let Some(done) = binary.take() {
            self.finish_binary(done, Instant::now());
        }
        let status = child.wait().map_err(|e| format!("cargo test: {e}"))?;
        if status.success() { Ok(()) } else { Err(format!("cargo test failed ({status})")) }
    }

    fn finish_binary(&mut self, b: Binary, now: Instant) {
        let end = b.done_at.unwrap_or(now);
        self.rows.push((format!("test {}", b.name), end - b.opened_at));
        for (test, seconds) in b.durations() {
            self.tests.push((test, b.name.clone(), seconds));
        }
    }

    /// The table, the five slowest tests, and a warning if a fresh clone's run took longer
    /// than [`WARN_AFTER`], naming the phases that grew since the table of reference.
    pub(crate) fn report(&self, total: Duration, fresh: bool) {
        let reference = reference();
        eprintln!("\nxtask: where the time went (seconds; reference: a fresh clone, phases.json)");
        let width = self.rows.iter().map(|(n, _)| n.len()).max().unwrap_or(10).max(10);
        for (name, took) in &self.rows {
            let then = reference.get(name).map_or(String::new(), |r| format!("{r:>8.0}"));
            eprintln!("  {name:<width$} {:>8.1} {then}", took.as_secs_f64());
        }
        let then = reference.get("total").map_or(String::new(), |r| format!("{r:>8.0}"));
        eprintln!("  {:<width$} {:>8.1} {then}", "total", total.as_secs_f64());
        let mut slowest = self.tests.clone();
        slowest.sort_by(|a, b| b.2.total_cmp(&a.2));
        let named: Vec<String> = slowest
            .iter()
            .take(5)
            .map(|(test, binary, s)| format!("{binary}::{test} {s:.0} s"))
            .collect();
        eprintln!("xtask: the five slowest tests: {}", named.join(", "));
        if fresh && total > WARN_AFTER {
            let grew: Vec<String> = self
                .rows
                .iter()
                .filter_map(|(name, took)| {
                    let then = *reference.get(name)?;
                    let now = took.as_secs_f64();
                    (now > then * 1.2 && now - then > 20.0)
                        .then(|| format!("{name} ({then:.0} s -> {now:.0} s)"))
                })
                .collect();
            eprintln!(
                "xtask: warning: this run from a fresh clone took {:.0} min, past {} min of \
                 CI's 30-minute budget on the 2-core VMs. Phases that grew beyond the \
                 reference: {}. Cut them, or say why in docs/performance.md and update \
                 xtask/phases.json",
                total.as_secs_f64() / 60.0,
                WARN_AFTER.as_secs() / 60,
                if grew.is_empty() { "none by more than 20%".to_owned() } else { grew.join(", ") }
            );
        }
    }
}

/// The reference table: phase name → seconds, from xtask/phases.json.
fn reference() -> BTreeMap<String, f64> {
    let path = crate::root().join("xtask/phases.json");
    let Ok(text) = std::fs::read_to_string(path) else { return BTreeMap::new() };
    let Ok(serde_json::Value::Object(map)) = serde_json::from_str(&text) else {
        return BTreeMap::new();
    };
    map.get("phases")
        .and_then(|p| p.as_object())
        .map(|p| p.iter().filter_map(|(k, v)| Some((k.clone(), v.as_f64()?))).collect())
        .unwrap_or_default()
}

/// libtest's threads: RUST_TEST_THREADS, or the machine's parallelism.
fn test_threads() -> usize {
    std::env::var("RUST_TEST_THREADS")
        .ok()
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        .max(1)
}

/// `unittests src/lib.rs (target/debug/deps/accel_core-…)` → `accel_core`;
/// `tests/parity.rs (…)` → `parity`; `Doc-tests accel_core` → `doc accel_core`.
fn name_of(what: &str) -> String {
    if let Some(krate) = what.strip_prefix("Doc-tests ") {
        return format!("doc {}", krate.trim());
    }
    let file = what.rsplit_once('(').map_or(what, |(_, f)| f).trim_end_matches(')');
    let stem = file.rsplit('/').next().unwrap_or(file);
    let stem = stem.rsplit_once('-').map_or(stem, |(s, _)| s);
    if what.starts_with("unittests") { format!("{stem} (unit)") } else { stem.to_owned() }
}

/// One test binary's run, as its output goes by.
struct Binary {
    name: String,
    opened_at: Instant,
    started_at: Instant,
    done_at: Option<Instant>,
    expected: usize,
    threads: usize,
    /// Results in the order they were printed.
    results: Vec<(String, Instant)>,
}

impl Binary {
    fn new(name: String, now: Instant, threads: usize) -> Self {
        Binary {
            name,
            opened_at: now,
            started_at: now,
            done_at: None,
            expected: 0,
            threads,
            results: Vec::new(),
        }
    }

    fn finished(&mut self, test: &str, at: Instant) {
        self.results.push((test.to_owned(), at));
    }

    /// Each test's seconds: the k-th test by name started at the start, for the first
    /// `threads`, else when the (k - threads + 1)-th result came.
    fn durations(&self) -> Vec<(String, f64)> {
        let mut order: Vec<&str> = self.results.iter().map(|(n, _)| n.as_str()).collect();
        order.sort_unstable();
        let ends: BTreeMap<&str, Instant> =
            self.results.iter().map(|(n, at)| (n.as_str(), *at)).collect();
        order
            .iter()
            .enumerate()
            .map(|(k, name)| {
                let start = if k < self.threads {
                    self.started_at
                } else {
                    self.results.get(k - self.threads).map_or(self.started_at, |(_, at)| *at)
                };
                let end = ends[name];
                (name.to_string(), end.saturating_duration_since(start).as_secs_f64())
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binaries_are_named_by_their_file() {
        assert_eq!(
            name_of("unittests src/lib.rs (target/debug/deps/accel_core-2b0327f8ebe38940)"),
            "accel_core (unit)"
        );
        assert_eq!(
            name_of("tests/parity.rs (target/debug/deps/parity-5079b1b5e45e40eb)"),
            "parity"
        );
        assert_eq!(name_of("Doc-tests accel_core"), "doc accel_core");
    }

    #[test]
    fn a_test_starts_when_a_thread_frees_up_in_the_order_of_names() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut b = Binary::new("x".into(), t0, 2);
        // a (10 s) and b (3 s) start at 0; c starts when b ends (3), d when a ends (10).
        b.finished("b", at(3));
        b.finished("a", at(10));
        b.finished("c", at(12));
        b.finished("d", at(11));
        let d: BTreeMap<String, f64> = b.durations().into_iter().collect();
        assert_eq!((d["a"], d["b"], d["c"], d["d"]), (10.0, 3.0, 9.0, 1.0));
    }
}
