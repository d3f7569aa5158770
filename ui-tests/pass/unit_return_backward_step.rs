//! A function returning `()` (failures panic with their message), tch's `Iter2` and
//! `backward_step`, accumulation over 2 batches, the accelerator's counters.
#![deny(warnings)]

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Tensor};

use crate::common::{Data, mlp, weights};

#[accel_core::accelerate(strategy = "ddp", accumulate = 2, cpu = true)]
fn train(vs: &nn::VarStore, data: &Data) {
    let device = Device::cuda_if_available();
    let (x, y): (Vec<Tensor>, Vec<Tensor>) = data.batches().into_iter().unzip();
    let (x, y) = (Tensor::cat(&x, 0).to_device(device), Tensor::cat(&y, 0).to_device(device));
    let net = mlp(&vs.root());
    let mut opt = nn::Sgd::default().build(vs, 0.1).unwrap();
    for _ in 0..data.epochs {
        for (xb, yb) in tch::data::Iter2::new(&x, &y, data.batch_size) {
            let loss = net.forward(&xb).cross_entropy_for_logits(&yb);
            opt.backward_step(&loss);
        }
    }
    let per_epoch = 128 / data.batch_size as u64 / accelerator.num_processes() as u64;
    assert_eq!(accelerator.counters().optimizer_steps, data.epochs as u64 * per_epoch / 2);
}

pub fn run(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    let vs = nn::VarStore::new(Device::Cpu);
    train(&vs, data);
    Ok(weights(&vs, ""))
}
