//! Helpers the examples share: the data sets shipped in `data/`, the GPT model, and Local SGD
//! (a strategy written outside accel-core).

pub mod gpt;
pub use accel_models::llama;
pub mod local_sgd;
pub mod raw;

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use tch::{Device, Kind, Tensor};

/// A field of /proc/self/status in bytes (`VmRSS:`, or `VmHWM:` for the peak).
pub fn proc_status_bytes(field: &str) -> Result<f64> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    let line = status
        .lines()
        .find(|l| l.starts_with(field))
        .with_context(|| format!("no {field} in /proc/self/status"))?;
    let kib: f64 = line.split_whitespace().nth(1).context("malformed")?.parse()?;
    Ok(kib * 1024.0)
}

/// Minor page faults of this process so far (`/proc/self/stat`'s tenth field): mostly,
/// in a training step, pages of freshly allocated tensors the kernel maps in zeroed.
pub fn minor_page_faults() -> Result<u64> {
    let stat = std::fs::read_to_string("/proc/self/stat")?;
    // The command name (field 2) is in parentheses and may hold spaces: count after it.
    let after_name = stat.rsplit_once(')').context("malformed /proc/self/stat")?.1;
    Ok(after_name.split_whitespace().nth(7).context("malformed /proc/self/stat")?.parse()?)
}

/// `data/` at the root of the repository.
pub fn data_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../data")
}

/// The 8x8 handwritten digits (data/digits.safetensors, made by python/make_digits.py):
/// pixels scaled to [0, 1] as f32 `[n, 64]`, labels i64 `[n]`.
#[derive(Debug)]
pub struct Digits {
    /// Training images.
    pub train_x: Tensor,
    /// Training labels.
    pub train_y: Tensor,
    /// Held-out images.
    pub test_x: Tensor,
    /// Held-out labels.
    pub test_y: Tensor,
}

impl Digits {
    /// Loads the digits onto `device`.
    pub fn load(device: Device) -> Result<Self> {
        let path = data_dir().join("digits.safetensors");
        let tensors = Tensor::read_safetensors(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        let get = |name: &str| -> Result<Tensor> {
            tensors
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, t)| t.to_device(device))
                .with_context(|| format!("{} has no tensor `{name}`", path.display()))
        };
        let pixels = |name: &str| -> Result<Tensor> { Ok(get(name)?.to_kind(Kind::Float) / 16.0) };
        Ok(Self {
            train_x: pixels("train.x")?,
            train_y: get("train.y")?,
            test_x: pixels("test.x")?,
            test_y: get("test.y")?,
        })
    }
}
