//! The README's fsdp shape as users write it (#65): an `nn::seq()` of layers built in the
//! function, which zero3 releases between uses, plain SGD, and after the loop the code users
//! add around it — a weight norm from a helper handed `&vs`, an evaluation, its own save of
//! `vs.variables()` — all reading the trained weights, whole.
use std::collections::HashMap;

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

use crate::data::{self, Digits};

fn weight_norm(vs: &nn::VarStore) -> f64 {
    let squares: f64 =
        vs.variables().values().map(|t| t.square().sum(Kind::Float).double_value(&[])).sum();
    squares.sqrt()
}

#[accel_core::accelerate(strategy = "fsdp")]
fn train(d: &Digits, epochs: i64) -> anyhow::Result<()> {
    let vs = nn::VarStore::new(Device::cuda_if_available());
    let mut net = nn::seq();
    for (i, (inputs, outputs)) in [(64, 32), (32, 32), (32, 10)].into_iter().enumerate() {
        net = net.add(nn::linear(vs.root() / "layers" / i, inputs, outputs, Default::default()));
        if i < 2 {
            net = net.add_fn(|x| x.relu());
        }
    }
    let mut opt = nn::Sgd::default().build(&vs, 0.1)?;
    for _ in 0..epochs {
        for (x, y) in data::batches(d, data::batch_size()) {
            let loss = net.forward(&x).cross_entropy_for_logits(&y);
            opt.zero_grad();
            loss.backward();
            opt.step();
        }
    }
    println!("weight norm {:.6}", weight_norm(&vs));
    let accuracy = tch::no_grad(|| net.forward(&d.test_x).accuracy_for_logits(&d.test_y));
    println!("test accuracy {:.4}", accuracy.double_value(&[]));
    let copies: HashMap<String, Tensor> =
        vs.variables().into_iter().map(|(name, t)| (name, t.detach().copy())).collect();
    anyhow::ensure!(copies.values().all(|t| t.isfinite().all().int64_value(&[]) == 1));
    Ok(())
}

pub fn run() -> anyhow::Result<()> {
    tch::manual_seed(0);
    let d = data::load()?;
    train(&d, 2)
}
