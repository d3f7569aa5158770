//! Two models and two optimizers per batch (an encoder and a head trained with separate
//! learning rates), each stepped on the dealt batch.
use tch::nn::{self, Module, OptimizerConfig};
use tch::Device;

use crate::data;

#[accel_core::accelerate(strategy = "ddp")]
fn train() -> anyhow::Result<()> {
    let d = data::load()?;
    let encoder_vs = nn::VarStore::new(Device::Cpu);
    let head_vs = nn::VarStore::new(Device::Cpu);
    let encoder = nn::seq()
        .add(nn::linear(encoder_vs.root() / "enc", 64, 32, Default::default()))
        .add_fn(|x| x.tanh());
    let head = nn::linear(head_vs.root() / "head", 32, 10, Default::default());
    let mut opt_encoder = nn::Adam::default().build(&encoder_vs, 1e-3)?;
    let mut opt_head = nn::Sgd::default().build(&head_vs, 0.1)?;
    for _ in 0..2 {
        for (x, y) in data::batches(&d, data::batch_size()) {
            let loss = head.forward(&encoder.forward(&x)).cross_entropy_for_logits(&y);
            opt_encoder.zero_grad();
            opt_head.zero_grad();
            loss.backward();
            opt_encoder.step();
            opt_head.step();
        }
    }
    Ok(())
}

pub fn run() -> anyhow::Result<()> {
    tch::manual_seed(0);
    train()
}
