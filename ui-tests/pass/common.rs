//! What every shape shares: the data, the model, and the weights it ends with.

use tch::nn;
use tch::{Device, Kind, Tensor};

/// Samples in the data set: 8 batches of 16 on one process, 16 of 8 on two.
pub const SAMPLES: i64 = 128;

/// The run's data: the same samples whatever the batch size, so that one process with
/// batches of 16 sees, step by step, what two processes with batches of 8 see together
/// (batches are dealt round-robin: rank 0 takes batches 0, 2, ..., rank 1 takes 1, 3, ...).
pub struct Data {
    pub batch_size: i64,
    pub epochs: usize,
    /// Where the run writes (every process is given the same folder).
    pub dir: std::path::PathBuf,
}

impl Data {
    /// Every sample: (inputs of 6 features, labels of 3 classes).
    pub fn all(&self) -> (Tensor, Tensor) {
        let x = (Tensor::arange(SAMPLES * 6, (Kind::Float, Device::Cpu)).view([SAMPLES, 6]) * 0.37)
            .sin();
        let y = (Tensor::arange(SAMPLES, (Kind::Int64, Device::Cpu)) * 7).remainder(3);
        (x, y)
    }

    /// (inputs of 6 features, labels of 3 classes), in batches.
    pub fn batches(&self) -> Vec<(Tensor, Tensor)> {
        let (x, y) = self.all();
        (0..SAMPLES / self.batch_size)
            .map(|b| {
                let (start, n) = (b * self.batch_size, self.batch_size);
                (x.narrow(0, start, n), y.narrow(0, start, n))
            })
            .collect()
    }
}

/// 6 → 16 → batch norm → 3, named `layers.0`, `norm` and `layers.1`: a model with buffers
/// (the batch norm's running statistics). `norm` is made by `norm(path, 16)`.
pub fn mlp_with_norm<N: nn::ModuleT + 'static>(
    root: &nn::Path,
    norm: impl FnOnce(nn::Path, i64) -> N,
) -> nn::SequentialT {
    nn::seq_t()
        .add(nn::linear(root / "layers" / 0, 6, 16, Default::default()))
        .add(norm(root / "norm", 16))
        .add_fn(|x| x.tanh())
        .add(nn::linear(root / "layers" / 1, 16, 3, Default::default()))
}

/// 6 → 16 → 3, named `layers.0` and `layers.1`.
pub fn mlp(root: &nn::Path) -> nn::Sequential {
    nn::seq()
        .add(nn::linear(root / "layers" / 0, 6, 16, Default::default()))
        .add_fn(|x| x.tanh())
        .add(nn::linear(root / "layers" / 1, 16, 3, Default::default()))
}

/// Copies of every variable, sorted by name, with `prefix` before each name.
pub fn weights(vs: &nn::VarStore, prefix: &str) -> Vec<(String, Tensor)> {
    let mut all: Vec<(String, Tensor)> = vs
        .variables()
        .into_iter()
        .map(|(name, t)| (format!("{prefix}{name}"), t.detach().copy()))
        .collect();
    all.sort_by(|a, b| a.0.cmp(&b.0));
    all
}
