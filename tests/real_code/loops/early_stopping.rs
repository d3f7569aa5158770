//! Early stopping on a validation loss every process computes on the same held-out set:
//! every process leaves the epoch loop together.
use tch::nn::{self, Module, OptimizerConfig};
use tch::Device;

use crate::data;

#[accel_core::accelerate(strategy = "ddp")]
fn train() -> anyhow::Result<()> {
    let d = data::load()?;
    let vs = nn::VarStore::new(Device::Cpu);
    let net = data::mlp(&vs.root());
    let mut opt = nn::Adam::default().build(&vs, 1e-2)?;
    let (mut best, mut bad_epochs, patience) = (f64::INFINITY, 0, 1);
    for epoch in 0..10 {
        for (x, y) in data::batches(&d, data::batch_size()) {
            let loss = net.forward(&x).cross_entropy_for_logits(&y);
            opt.backward_step(&loss);
        }
        let val = tch::no_grad(|| net.forward(&d.test_x).cross_entropy_for_logits(&d.test_y));
        let val = f64::try_from(&val)?;
        println!("epoch {epoch}: validation loss {val:.4}");
        if val < best - 0.05 {
            best = val;
            bad_epochs = 0;
        } else {
            bad_epochs += 1;
            if bad_epochs > patience {
                break;
            }
        }
    }
    Ok(())
}

pub fn run() -> anyhow::Result<()> {
    tch::manual_seed(0);
    train()
}
