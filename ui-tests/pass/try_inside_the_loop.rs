//! `?` inside the training loop, an epoch `loop` with an early `return`, `Box<dyn Error>`.
#![deny(warnings)]

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Reduction, Tensor};

use crate::common::{Data, mlp, weights};

type Weights = Vec<(String, Tensor)>;

#[accel_core::accelerate(strategy = "ddp", cpu = true)]
fn train(data: &Data) -> Result<Weights, Box<dyn std::error::Error>> {
    let vs = nn::VarStore::new(Device::Cpu);
    let net = mlp(&vs.root());
    let mut opt = nn::Adam::default().build(&vs, 1e-2)?;
    let mut epoch = 0;
    loop {
        if epoch == data.epochs {
            return Ok(weights(&vs, ""));
        }
        for (x, y) in data.batches() {
            let logits = net.forward(&x);
            let loss = logits.f_log_softmax(-1, Kind::Float)?.f_nll_loss::<Tensor>(&y, None, Reduction::Mean, -100)?;
            opt.zero_grad();
            loss.backward();
            opt.step();
        }
        epoch += 1;
    }
}

pub fn run(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    train(data).map_err(|e| anyhow::anyhow!("{e}"))
}
