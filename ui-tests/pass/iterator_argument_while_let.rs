//! `while let` over an iterator passed in by `&mut`: the loop borrows it through the
//! accelerator's prepared view.
#![deny(warnings)]

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Tensor};

use crate::common::{Data, mlp, weights};

// The shape under test, though clippy prefers `for`.
#[allow(clippy::while_let_on_iterator)]
#[accel_core::accelerate(strategy = "ddp", cpu = true)]
fn train(
    vs: &nn::VarStore,
    batches: &mut std::vec::IntoIter<(Tensor, Tensor)>,
) -> anyhow::Result<()> {
    let net = mlp(&vs.root());
    let mut opt = nn::Adam::default().build(vs, 1e-2)?;
    while let Some((x, y)) = batches.next() {
        let loss = net.forward(&x).cross_entropy_for_logits(&y);
        opt.zero_grad();
        loss.backward();
        opt.step();
    }
    Ok(())
}

pub fn run(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    let vs = nn::VarStore::new(Device::Cpu);
    let all: Vec<(Tensor, Tensor)> = (0..data.epochs).flat_map(|_| data.batches()).collect();
    train(&vs, &mut all.into_iter())?;
    Ok(weights(&vs, ""))
}
