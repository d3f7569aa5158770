//! The plain index loop of hand-written tch code: `for i in 0..n_batches` slicing the data
//! with `narrow`; the index picks the batch and nothing else.
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Reduction};

use crate::data;

#[accel_core::accelerate(strategy = "ddp")]
fn train() -> anyhow::Result<()> {
    let d = data::load()?;
    let bs = data::batch_size();
    let n_batches = data::TRAIN / bs;
    let vs = nn::VarStore::new(Device::Cpu);
    let net = data::mlp(&vs.root());
    let mut opt = nn::Sgd { momentum: 0.9, ..Default::default() }.build(&vs, 0.05)?;
    let targets = d.train_y.onehot(10);
    for _epoch in 0..2 {
        for i in 0..n_batches {
            let xb = d.train_x.narrow(0, i * bs, bs);
            let yb = targets.narrow(0, i * bs, bs);
            let loss = net.forward(&xb).softmax(-1, tch::Kind::Float).mse_loss(&yb, Reduction::Mean);
            opt.zero_grad();
            loss.backward();
            opt.step();
        }
    }
    Ok(())
}

pub fn run() -> anyhow::Result<()> {
    tch::manual_seed(0);
    train()
}
