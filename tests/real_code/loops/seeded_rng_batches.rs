//! Random batches from a generator of the program's own, seeded alike on every process
//! (`StdRng::seed_from_u64(42)`): every process would draw the same batches — refused at the
//! first step on 2 processes.
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Tensor};

use crate::data;

#[accel_core::accelerate(strategy = "ddp")]
fn train() -> anyhow::Result<()> {
    let d = data::load()?;
    let vs = nn::VarStore::new(Device::Cpu);
    let net = data::mlp(&vs.root());
    let mut opt = nn::Sgd::default().build(&vs, 0.1)?;
    let mut rng = StdRng::seed_from_u64(42);
    for _step in 0..20 {
        let rows: Vec<i64> = (0..16).map(|_| rng.random_range(0..data::TRAIN)).collect();
        let idx = Tensor::from_slice(&rows);
        let (x, y) = (d.train_x.index_select(0, &idx), d.train_y.index_select(0, &idx));
        let loss = net.forward(&x).cross_entropy_for_logits(&y);
        opt.backward_step(&loss);
    }
    Ok(())
}

pub fn run() -> anyhow::Result<()> {
    tch::manual_seed(0);
    train()
}
