//! PyTorch's "Quickstart" tutorial loop (pytorch.org/tutorials/beginner/basics/quickstart_tutorial):
//! `train(dataloader, model, loss_fn, optimizer)` over the batches, a progress print every
//! few batches, then `test` on the held-out set.
use tch::nn::{self, Module, OptimizerConfig};
use tch::Device;

use crate::data::{self, Digits};

#[accel_core::accelerate(strategy = "ddp")]
fn train(d: &Digits, epochs: i64) -> anyhow::Result<()> {
    let vs = nn::VarStore::new(Device::cuda_if_available());
    let model = data::mlp(&vs.root());
    let mut optimizer = nn::Sgd::default().build(&vs, 1e-1)?;
    for t in 0..epochs {
        println!("Epoch {}", t + 1);
        for (batch, (x, y)) in data::batches(d, data::batch_size()).into_iter().enumerate() {
            let pred = model.forward(&x);
            let loss = pred.cross_entropy_for_logits(&y);
            optimizer.zero_grad();
            loss.backward();
            optimizer.step();
            if batch % 4 == 0 {
                println!("loss: {:>7.4}  [{batch:>3}]", f64::try_from(&loss)?);
            }
        }
        let correct = model.forward(&d.test_x).accuracy_for_logits(&d.test_y);
        println!("Test accuracy: {:.1}%", 100.0 * f64::try_from(&correct)?);
    }
    Ok(())
}

pub fn run() -> anyhow::Result<()> {
    tch::manual_seed(0);
    let d = data::load()?;
    train(&d, 2)
}
