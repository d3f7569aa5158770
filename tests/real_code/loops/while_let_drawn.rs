//! Batches from a sampler of the program's own, read with `while let` — a source the
//! attribute cannot see into, so it asks; `data = "drawn"` answers: each process draws its
//! own batches (seeded per process) and runs every one of them.
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

use crate::data;

/// Hands out `left` batches of 16 random training rows.
struct Sampler<'a> {
    d: &'a data::Digits,
    left: usize,
}

impl Sampler<'_> {
    fn next_batch(&mut self) -> Option<(Tensor, Tensor)> {
        if self.left == 0 {
            return None;
        }
        self.left -= 1;
        let idx = Tensor::randint(data::TRAIN, [16], (Kind::Int64, Device::Cpu));
        Some((self.d.train_x.index_select(0, &idx), self.d.train_y.index_select(0, &idx)))
    }
}

#[accel_core::accelerate(strategy = "ddp", data = "drawn")]
fn train() -> anyhow::Result<()> {
    tch::manual_seed(7);
    let d = data::load()?;
    let vs = nn::VarStore::new(Device::Cpu);
    let net = data::mlp(&vs.root());
    let mut opt = nn::Sgd::default().build(&vs, 0.1)?;
    let mut sampler = Sampler { d: &d, left: 20 };
    while let Some((x, y)) = sampler.next_batch() {
        let loss = net.forward(&x).cross_entropy_for_logits(&y);
        opt.backward_step(&loss);
    }
    Ok(())
}

pub fn run() -> anyhow::Result<()> {
    train()
}
