//! Code that writes the model's weights in place between epochs (the original WGAN's weight
//! clipping, a max-norm constraint): under zero3 the writes land in what the next steps
//! train, as in one process, and the weights equal one process's.
#![deny(warnings)]

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Tensor};

use crate::common::{Data, weights};

fn clip_weights(vs: &nn::VarStore, limit: f64) {
    tch::no_grad(|| {
        for mut v in vs.trainable_variables() {
            let _ = v.clamp_(-limit, limit);
        }
    });
}

#[accel_core::accelerate(strategy = "zero3", cpu = true)]
fn train(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    let vs = nn::VarStore::new(Device::Cpu);
    let net = nn::seq()
        .add(nn::linear(vs.root() / "layers" / 0, 6, 16, Default::default()))
        .add_fn(|x| x.tanh())
        .add(nn::linear(vs.root() / "layers" / 1, 16, 3, Default::default()));
    let mut opt = nn::Sgd { momentum: 0.5, ..Default::default() }.build(&vs, 0.2)?;
    for _ in 0..data.epochs {
        for (x, y) in data.batches() {
            let loss = net.forward(&x).cross_entropy_for_logits(&y);
            opt.zero_grad();
            loss.backward();
            opt.step();
        }
        clip_weights(&vs, 0.2);
    }
    Ok(weights(&vs, ""))
}

pub fn run(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    train(data)
}
