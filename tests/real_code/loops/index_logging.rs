//! The most common hand-written tch loop: `for i in 0..n_batches` slicing the data with
//! `narrow`, printing every k-th batch's loss and a running average that is reset after it is
//! printed. The index picks the batch and otherwise only decides what is printed: the loop is
//! dealt, and each line is printed by the process that took that batch, with its index.
use tch::nn::{self, Module, OptimizerConfig};
use tch::Device;

use crate::data;

#[accel_core::accelerate(strategy = "ddp")]
fn train() -> anyhow::Result<()> {
    let d = data::load()?;
    let bs = data::batch_size();
    let n_batches = data::TRAIN / bs;
    let vs = nn::VarStore::new(Device::Cpu);
    let net = data::mlp(&vs.root());
    let mut opt = nn::Sgd { momentum: 0.9, ..Default::default() }.build(&vs, 0.05)?;
    let mut running = 0.0;
    for epoch in 0..2 {
        for i in 0..n_batches {
            let xb = d.train_x.narrow(0, i * bs, bs);
            let yb = d.train_y.narrow(0, i * bs, bs);
            let loss = net.forward(&xb).cross_entropy_for_logits(&yb);
            opt.zero_grad();
            loss.backward();
            opt.step();
            let l = loss.double_value(&[]);
            running += l;
            if i % 4 == 0 {
                println!("epoch {epoch} batch {i} loss {l:.4} (average {:.4})", running / 4.0);
                running = 0.0;
            }
        }
    }
    Ok(())
}

pub fn run() -> anyhow::Result<()> {
    tch::manual_seed(0);
    train()
}
