//! Leaving the batch loop when this process's own batch loss is low enough: the processes
//! part ways (one leaves while the other trains on), reported at the next step with the
//! line of the `break`.
use tch::nn::{self, Module, OptimizerConfig};
use tch::Device;

use crate::data;

#[accel_core::accelerate(strategy = "ddp")]
fn train() -> anyhow::Result<()> {
    let d = data::load()?;
    let vs = nn::VarStore::new(Device::Cpu);
    let net = data::mlp(&vs.root());
    let mut opt = nn::Adam::default().build(&vs, 2e-2)?;
    for _epoch in 0..4 {
        for (x, y) in data::batches(&d, data::batch_size()) {
            let loss = net.forward(&x).cross_entropy_for_logits(&y);
            opt.backward_step(&loss);
            let loss = f64::try_from(&loss)?;
            println!("loss {loss:.4}");
            if loss < 1.42 {
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
