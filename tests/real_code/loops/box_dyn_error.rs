//! A function returning `Result<(), Box<dyn Error>>`, `?` on tch's fallible calls inside.
use std::error::Error;

use tch::nn::{self, Module, OptimizerConfig};
use tch::Device;

use crate::data;

#[accel_core::accelerate(strategy = "ddp")]
fn train() -> Result<(), Box<dyn Error>> {
    let d = data::load().map_err(|e| e.to_string())?;
    let vs = nn::VarStore::new(Device::Cpu);
    let net = data::mlp(&vs.root());
    let mut opt = nn::RmsProp::default().build(&vs, 1e-3)?;
    for _ in 0..2 {
        for (x, y) in data::batches(&d, data::batch_size()) {
            let logits = net.forward(&x);
            let loss = logits.f_log_softmax(-1, tch::Kind::Float)?.f_nll_loss(&y, None::<tch::Tensor>, tch::Reduction::Mean, -100)?;
            opt.zero_grad();
            loss.backward();
            opt.step();
        }
    }
    Ok(())
}

pub fn run() -> anyhow::Result<()> {
    tch::manual_seed(0);
    train().map_err(|e| anyhow::anyhow!("{e}"))
}
