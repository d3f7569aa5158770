//! ZeRO stage 3 with the optimizer's update applied inside backward, on unchanged tch code
//! with plain SGD (whose update sees the gradients' scale): the weights equal the ordinary
//! step's, on 1 process and on 2.
#![deny(warnings)]

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Tensor};

use crate::common::{Data, mlp};

#[accel_core::accelerate(strategy = "zero3", optimizer_in_backward = true, cpu = true)]
fn train(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    let vs = nn::VarStore::new(Device::Cpu);
    let net = mlp(&vs.root());
    let mut opt = nn::Sgd::default().build(&vs, 0.1)?;
    for _ in 0..data.epochs {
        for (x, y) in data.batches() {
            let loss = net.forward(&x).cross_entropy_for_logits(&y);
            opt.zero_grad();
            loss.backward();
            opt.step();
        }
    }
    let full = accelerator.full_state_dict(&vs)?;
    Ok(full)
}

pub fn run(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    train(data)
}
