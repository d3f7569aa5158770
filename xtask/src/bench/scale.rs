//! `cargo xtask bench scale`: 16 to 256 processes meeting and all-reducing on this machine,
//! accel beside torchrun + gloo, and the machine's memory watched meanwhile.

use std::process::Command;
use std::time::Instant;

use crate::results::{Report, SCALE_RESULTS, write_block_results};
use crate::{cargo, root};

/// Rendezvous at scale: N processes on this machine start, meet at the store, form their
/// group, all-reduce 4 bytes (3 + 200 times) and end; the wall-clock from launch to exit and
/// the latency of one all-reduce, accel beside torchrun + gloo (same script shape), where
/// this machine's memory holds the processes. Written to bench/scale.json.
pub(crate) fn scale_bench() -> Result<(), String> {
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
