//! Profiling, as Accelerate's `accelerator.profile()`: libtorch's profiler (Kineto) records
//! the steps run inside [`Accelerator::profile`]'s guard into one Chrome/Perfetto trace per
//! process (`{dir}/trace_rank{r}.json`), with accel's own ranges among libtorch's operators —
//! `accel::forward`, `accel::backward`, `accel::optimizer_step`, `accel::data_wait`, and every
//! collective by name (`accel::all_reduce(avg) [26122] Float`, on the thread that runs it) —
//! and [`summarize`] (`accel profile summary TRACE`) says where a step's time went and how
//! much of the communication overlapped compute.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::accelerator::Accelerator;
use crate::error::{Error, Result};
pub use crate::shim::{Range, range, recording};

/// What [`Accelerator::profile`] records (torch.profiler's options, Accelerate's
/// `ProfileKwargs`).
#[derive(Debug, Clone, PartialEq)]
pub struct ProfileOptions {
    /// Where the traces go (one per process).
    pub dir: PathBuf,
    /// Operators' input shapes.
    pub record_shapes: bool,
    /// Tensor memory allocated and freed.
    pub profile_memory: bool,
    /// Source locations of operators.
    pub with_stack: bool,
}

impl Default for ProfileOptions {
    fn default() -> Self {
        Self {
            dir: "profile".into(),
            record_shapes: false,
            profile_memory: false,
            with_stack: false,
        }
    }
}

/// The profiler while it records; [`Profiler::finish`] writes the trace (dropping it does
/// too, ignoring errors).
#[derive(Debug)]
pub struct Profiler {
    path: Option<PathBuf>,
}

impl Accelerator {
    /// Records what this process does until the guard finishes, into
    /// `{options.dir}/trace_rank{r}.json` (every process writes its own).
    pub fn profile(&self, options: ProfileOptions) -> Result<Profiler> {
        std::fs::create_dir_all(&options.dir)
            .map_err(|source| Error::Io { path: options.dir.clone(), source })?;
        let path = options.dir.join(format!("trace_rank{}.json", self.process_index()));
        let cuda = matches!(self.device(), tch::Device::Cuda(_));
        crate::shim::profiler_start(
            cuda,
            options.record_shapes,
            options.profile_memory,
            options.with_stack,
        )?;
        Ok(Profiler { path: Some(path) })
    }
}

impl Profiler {
    /// Stops recording and writes the trace; returns its path.
    pub fn finish(mut self) -> Result<PathBuf> {
        let path = self.path.take().expect("finished once");
        crate::shim::profiler_stop(&path)?;
        Ok(path)
    }
}

impl Drop for Profiler {
    fn drop(&mut self) {
        if let Some(path) = self.path.take() {
            let _ = crate::shim::profiler_stop(&path);
        }
    }
}

/// Where one process's traced time went.
#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    /// The trace file.
    pub path: PathBuf,
    /// Optimizer steps traced (`accel::optimizer_step` ranges).
    pub steps: usize,
    /// Microseconds from the first to the last event of the training thread.
    pub wall_us: f64,
    /// Total microseconds per accel phase (`forward`, `backward`, `optimizer_step`,
    /// `data_wait`) and per collective (`all_reduce(avg)`, ...).
    pub phases: BTreeMap<String, f64>,
    /// Microseconds of collectives (their union).
    pub communication_us: f64,
    /// Of those, the microseconds during which forward or backward ran too.
    pub overlapped_us: f64,
}

/// The collectives' names, as accel's ranges start.
const COLLECTIVES: [&str; 8] = [
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "broadcast",
    "send/recv",
    "object exchange",
    "barrier",
    "nccl",
];

/// Reads a trace written by [`Accelerator::profile`].
pub fn summarize(path: &Path) -> Result<Summary> {
    let text = std::fs::read_to_string(path)
        .map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
    let trace: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| Error::Config(format!("{}: not a Chrome trace ({e})", path.display())))?;
    let events = trace["traceEvents"].as_array().ok_or_else(|| {
        Error::Config(format!("{}: no traceEvents: not a Chrome trace", path.display()))
    })?;
    let mut phases: BTreeMap<String, f64> = BTreeMap::new();
    // Spans (start, end) in microseconds.
    let mut compute: Vec<(f64, f64)> = Vec::new();
    let mut comm: Vec<(f64, f64)> = Vec::new();
    let (mut first, mut last) = (f64::INFINITY, f64::NEG_INFINITY);
    let mut steps = 0;
    for e in events.iter().filter(|e| e["ph"] == "X") {
        let Some(name) = e["name"].as_str().and_then(|n| n.strip_prefix("accel::")) else {
            continue;
        };
        let (ts, dur) = (e["ts"].as_f64().unwrap_or(0.0), e["dur"].as_f64().unwrap_or(0.0));
        // "all_reduce(avg) [26122] Float" → "all_reduce(avg)".
        let phase = name.split(" [").next().unwrap_or(name).trim().to_owned();
        *phases.entry(phase.clone()).or_default() += dur;
        if COLLECTIVES.iter().any(|c| phase.starts_with(c)) {
            comm.push((ts, ts + dur));
        } else {
            first = first.min(ts);
            last = last.max(ts + dur);
            if phase == "forward" || phase == "backward" {
                compute.push((ts, ts + dur));
            }
            if phase == "optimizer_step" {
                steps += 1;
            }
        }
    }
    let (comm, compute) = (union(comm), union(compute));
    let communication_us = comm.iter().map(|(a, b)| b - a).sum();
    let overlapped_us = intersection(&comm, &compute);
    Ok(Summary {
        path: path.to_path_buf(),
        steps,
        wall_us: if last > first { last - first } else { 0.0 },
        phases,
        communication_us,
        overlapped_us,
    })
}

/// Sorted, merged intervals.
fn union(mut spans: Vec<(f64, f64)>) -> Vec<(f64, f64)> {
    spans.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut out: Vec<(f64, f64)> = Vec::new();
    for (a, b) in spans {
        match out.last_mut() {
            Some(last) if a <= last.1 => last.1 = last.1.max(b),
            _ => out.push((a, b)),
        }
    }
    out
}

/// Total length of the overlap of two unions of intervals.
fn intersection(a: &[(f64, f64)], b: &[(f64, f64)]) -> f64 {
    let (mut i, mut j, mut total) = (0, 0, 0.0);
    while i < a.len() && j < b.len() {
        let (lo, hi) = (a[i].0.max(b[j].0), a[i].1.min(b[j].1));
        if hi > lo {
            total += hi - lo;
        }
        if a[i].1 < b[j].1 { i += 1 } else { j += 1 }
    }
    total
}

impl std::fmt::Display for Summary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let per = self.steps.max(1) as f64;
        writeln!(
            f,
            "{}: {} step(s) in {:.1} ms of training thread ({:.2} ms a step)",
            self.path.display(),
            self.steps,
            self.wall_us / 1e3,
            self.wall_us / 1e3 / per
        )?;
        writeln!(f, "  {:<28} {:>12} {:>12} {:>8}", "phase", "ms in all", "ms a step", "share")?;
        for (phase, us) in &self.phases {
            writeln!(
                f,
                "  {phase:<28} {:>12.2} {:>12.3} {:>7.1}%",
                us / 1e3,
                us / 1e3 / per,
                100.0 * us / self.wall_us.max(1e-9)
            )?;
        }
        let share = if self.communication_us > 0.0 {
            100.0 * self.overlapped_us / self.communication_us
        } else {
            0.0
        };
        write!(
            f,
            "  communication {:.2} ms, of which {:.2} ms ({share:.0}%) overlapped forward/backward",
            self.communication_us / 1e3,
            self.overlapped_us / 1e3
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_steps_and_overlap_come_out_of_a_trace() {
        let dir = std::env::temp_dir().join(format!("accel-profile-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("trace.json");
        let x = |name: &str, ts: f64, dur: f64, tid: u64| serde_json::json!({"ph": "X", "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid});
        let trace = serde_json::json!({"traceEvents": [
            x("accel::forward", 0.0, 100.0, 1),
            x("accel::backward", 100.0, 200.0, 1),
            x("aten::mm", 10.0, 20.0, 1),
            // A bucket's all-reduce on the worker: half under backward, half after.
            x("accel::all_reduce(avg) [1000] Float", 200.0, 200.0, 2),
            x("accel::optimizer_step", 400.0, 50.0, 1),
        ]});
        std::fs::write(&path, trace.to_string()).unwrap();
        let s = summarize(&path).unwrap();
        assert_eq!(s.steps, 1);
        assert_eq!(s.wall_us, 450.0);
        assert_eq!(s.phases["all_reduce(avg)"], 200.0);
        assert_eq!((s.communication_us, s.overlapped_us), (200.0, 100.0));
        let text = s.to_string();
        assert!(text.contains("of which 0.10 ms (50%) overlapped forward/backward"), "{text}");
        let _ = std::fs::remove_dir_all(dir);
    }
}
