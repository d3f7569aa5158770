//! tch-rs's README / mnist_conv loop: `for (bimages, blabels) in m.train_iter(bs).shuffle().to_device(..)`.
use anyhow::Result;
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, data::Iter2};

use crate::data::{self, Digits};

#[accel_core::accelerate(strategy = "ddp")]
fn run_training(m: &Digits) -> Result<()> {
    let vs = nn::VarStore::new(Device::cuda_if_available());
    let net = data::mlp(&vs.root());
    let mut opt = nn::Adam::default().build(&vs, 1e-3)?;
    for epoch in 1..3 {
        for (bimages, blabels) in
            Iter2::new(&m.train_x, &m.train_y, data::batch_size()).shuffle().to_device(vs.device())
        {
            let loss = net.forward(&bimages).cross_entropy_for_logits(&blabels);
            opt.backward_step(&loss);
        }
        let test_accuracy = net.forward(&m.test_x).accuracy_for_logits(&m.test_y);
        println!("epoch: {:4} test acc: {:5.2}%", epoch, 100. * f64::try_from(&test_accuracy)?);
    }
    Ok(())
}

pub fn run() -> Result<()> {
    tch::manual_seed(0);
    let m = data::load()?;
    run_training(&m)
}
