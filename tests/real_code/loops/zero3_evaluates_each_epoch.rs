//! A zero3 loop with an evaluation and a max-norm constraint on the weights after each epoch
//! (#65): the evaluation reads the trained weights whole, the constraint writes into them
//! in place, and the next epoch trains what it wrote, as in one process.
use tch::nn::{self, Module, OptimizerConfig};
use tch::Device;

use crate::data::{self, Digits};

fn clamp_weights(vs: &nn::VarStore, limit: f64) {
    tch::no_grad(|| {
        for mut w in vs.trainable_variables() {
            let _ = w.clamp_(-limit, limit);
        }
    });
}

#[accel_core::accelerate(strategy = "zero3")]
fn train(d: &Digits, epochs: i64) -> anyhow::Result<()> {
    let vs = nn::VarStore::new(Device::cuda_if_available());
    let net = nn::seq()
        .add(nn::linear(vs.root() / "layers" / 0, 64, 32, Default::default()))
        .add_fn(|x| x.tanh())
        .add(nn::linear(vs.root() / "layers" / 1, 32, 10, Default::default()));
    let mut opt = nn::Sgd::default().build(&vs, 0.2)?;
    for epoch in 0..epochs {
        for (x, y) in data::batches(d, data::batch_size()) {
            let loss = net.forward(&x).cross_entropy_for_logits(&y);
            opt.zero_grad();
            loss.backward();
            opt.step();
        }
        let accuracy = tch::no_grad(|| net.forward(&d.test_x).accuracy_for_logits(&d.test_y));
        println!("epoch {epoch}: test accuracy {:.4}", accuracy.double_value(&[]));
        clamp_weights(&vs, 0.15);
    }
    Ok(())
}

pub fn run() -> anyhow::Result<()> {
    tch::manual_seed(0);
    let d = data::load()?;
    train(&d, 3)
}
