//! Helpers the examples share: the data sets shipped in `data/`, the GPT model, and Local SGD
//! (a strategy written outside accel-core).

pub mod gpt;
pub mod local_sgd;

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

/// Draws `series` (each a list of values over the same x steps, with an RGB colour) as
/// lines on a white `width`×`height` PNG, each scaled to its own range, over a light grid.
/// No text: the caller says in words what the lines are.
pub fn plot_png(path: &Path, series: &[(&[f64], [u8; 3])], width: u32, height: u32) -> Result<()> {
    let (w, h) = (width as usize, height as usize);
    let mut pixels = vec![255u8; w * h * 3];
    let mut put = |x: i64, y: i64, rgb: [u8; 3]| {
        if x >= 0 && y >= 0 && (x as usize) < w && (y as usize) < h {
            let i = (y as usize * w + x as usize) * 3;
            pixels[i..i + 3].copy_from_slice(&rgb);
        }
    };
    let margin = 20i64;
    let (x0, x1, y0, y1) = (margin, w as i64 - margin, h as i64 - margin, margin);
    for k in 0..=4 {
        let y = y0 + (y1 - y0) * k / 4;
        (x0..=x1).for_each(|x| put(x, y, [225, 225, 225]));
    }
    (y1..=y0).for_each(|y| put(x0, y, [120, 120, 120]));
    (x0..=x1).for_each(|x| put(x, y0, [120, 120, 120]));
    for (values, rgb) in series {
        let finite: Vec<f64> = values.iter().copied().filter(|v| v.is_finite()).collect();
        let (lo, hi) = finite.iter().fold((f64::MAX, f64::MIN), |(a, b), &v| (a.min(v), b.max(v)));
        let span = if hi > lo { hi - lo } else { 1.0 };
        let point = |i: usize, v: f64| {
            let x = x0 + ((x1 - x0) as f64 * i as f64 / (values.len().max(2) - 1) as f64) as i64;
            let y = y0 + ((y1 - y0) as f64 * (v - lo) / span) as i64;
            (x, y)
        };
        for i in 1..values.len() {
            let ((ax, ay), (bx, by)) = (point(i - 1, values[i - 1]), point(i, values[i]));
            let steps = (bx - ax).abs().max((by - ay).abs()).max(1);
            for s in 0..=steps {
                let (x, y) = (ax + (bx - ax) * s / steps, ay + (by - ay) * s / steps);
                for (dx, dy) in [(0, 0), (0, 1), (1, 0)] {
                    put(x + dx, y + dy, *rgb);
                }
            }
        }
    }
    let file =
        std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut encoder = png::Encoder::new(std::io::BufWriter::new(file), width, height);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    encoder.write_header()?.write_image_data(&pixels)?;
    Ok(())
}
