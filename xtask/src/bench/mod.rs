//! The benchmarks of `cargo xtask bench`, one file each, and what the memory benchmarks
//! share: reading the figures each rank prints as a JSON object.

mod generate;
mod llama;
mod loader;
mod memory;
mod overhead;
mod scale;
mod speed;

use std::process::Command;

pub(crate) use generate::generate_bench;
pub(crate) use llama::{in_backward_bench, llama_memory_bench};
pub(crate) use loader::loader_bench;
pub(crate) use memory::memory_bench;
pub(crate) use overhead::overhead_bench;
pub(crate) use scale::scale_bench;
pub(crate) use speed::bench;

/// Runs `command` and returns what it printed on stdout; an error with both outputs if it
/// fails.
fn stdout_of(command: &mut Command) -> Result<String, String> {
    let output = command.output().map_err(|e| format!("cannot run {command:?}: {e}"))?;
    let text = String::from_utf8_lossy(&output.stdout).into_owned();
    if !output.status.success() {
        return Err(format!(
            "{command:?} failed:\n{text}{}",
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    Ok(text)
}

/// Runs a memory benchmark command of `n` processes; returns each rank's JSON object (as
/// text: ranks print concurrently, so objects may share a line).
fn rank_results(command: &mut Command, n: usize) -> Result<Vec<String>, String> {
    let text = stdout_of(command)?;
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

/// The highest value of `key` among a memory benchmark's ranks.
fn highest(objects: &[String], key: &str) -> f64 {
    objects.iter().filter_map(|o| field(o, key)).fold(0.0, f64::max)
}
