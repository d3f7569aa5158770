//! The index loop: the index picks the batch and also sets the learning rate and
//! decides when to step. Refused at compile time, at the schedule's line.
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Reduction};

use crate::data;

#[accel_core::accelerate(strategy = "ddp")]
fn train() -> anyhow::Result<()> {
    let d = data::load()?;
    let (bs, targets) = (data::batch_size(), d.train_y.onehot(10));
    let n_batches = data::TRAIN / bs;
    let vs = nn::VarStore::new(Device::Cpu);
    let net = data::mlp(&vs.root());
    let mut opt = nn::Sgd::default().build(&vs, 0.05)?;
    for i in 0..n_batches {
        opt.set_lr(0.05 * (1.0 - i as f64 / n_batches as f64));
        let xb = d.train_x.narrow(0, i * bs, bs);
        let yb = targets.narrow(0, i * bs, bs);
        let loss = net.forward(&xb).mse_loss(&yb, Reduction::Mean);
        loss.backward();
        if (i + 1) % 4 == 0 {
            opt.step();
            opt.zero_grad();
        }
    }
    Ok(())
}

pub fn run() -> anyhow::Result<()> {
    tch::manual_seed(0);
    train()
}
