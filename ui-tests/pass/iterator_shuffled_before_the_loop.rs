//! tch's `Iter2`, bound by `let` and shuffled before a `while let` loop over it: it keeps its
//! own type (the loop borrows it through a prepared view).
#![deny(warnings)]

use tch::data::Iter2;
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Tensor};

use crate::common::{Data, mlp, weights};

// The shape under test: tch's own examples write this loop (clippy would have `for`).
#[allow(clippy::while_let_on_iterator)]
#[accel_core::accelerate(strategy = "ddp", cpu = true)]
fn train(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    let vs = nn::VarStore::new(Device::Cpu);
    let net = mlp(&vs.root());
    let mut opt = nn::Adam::default().build(&vs, 1e-2)?;
    let (x, y) = data.all();
    for _ in 0..data.epochs {
        let mut iter = Iter2::new(&x, &y, data.batch_size);
        iter.shuffle();
        while let Some((xb, yb)) = iter.next() {
            let loss = net.forward(&xb).cross_entropy_for_logits(&yb);
            opt.zero_grad();
            loss.backward();
            opt.step();
        }
    }
    Ok(weights(&vs, ""))
}

pub fn run(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    train(data)
}
