//! The data and the model every program here shares, as a user's own `data.rs` would hold
//! them: the 8x8 digits of the repository's data/digits.safetensors (the first 512
//! training images, pixels scaled to 0..1), a batch size read from `BATCH_SIZE` (the test
//! runs one process with twice the batch of each of two), and a small MLP.

use tch::{Device, Kind, Tensor, nn};

pub struct Digits {
    pub train_x: Tensor,
    pub train_y: Tensor,
    pub test_x: Tensor,
    pub test_y: Tensor,
}

/// Training images used (16 batches of 32 on one process with batches of 32).
pub const TRAIN: i64 = 512;

pub fn load() -> anyhow::Result<Digits> {
    let all: std::collections::HashMap<String, Tensor> =
        Tensor::read_safetensors("data/digits.safetensors")?.into_iter().collect();
    let x = |k: &str| all[k].to_kind(Kind::Float) / 16.0;
    Ok(Digits {
        train_x: x("train.x").narrow(0, 0, TRAIN),
        train_y: all["train.y"].narrow(0, 0, TRAIN),
        test_x: x("test.x"),
        test_y: all["test.y"].shallow_clone(),
    })
}

pub fn batch_size() -> i64 {
    std::env::var("BATCH_SIZE").ok().and_then(|v| v.parse().ok()).unwrap_or(32)
}

pub fn mlp(p: &nn::Path) -> nn::Sequential {
    nn::seq()
        .add(nn::linear(p / "fc1", 64, 32, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(p / "fc2", 32, 10, Default::default()))
}

/// The training set in batches of `bs`, in order.
pub fn batches(d: &Digits, bs: i64) -> Vec<(Tensor, Tensor)> {
    (0..TRAIN / bs).map(|i| (d.train_x.narrow(0, i * bs, bs), d.train_y.narrow(0, i * bs, bs))).collect()
}

#[allow(dead_code)]
pub fn device() -> Device {
    Device::Cpu
}
