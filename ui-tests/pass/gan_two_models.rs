//! Two models with two optimizers and two losses per batch (a GAN), with accumulation: both
//! backward passes of a batch are one micro-step, each model's gradients are averaged.
#![deny(warnings)]

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Reduction, Tensor};

use crate::common::{Data, weights};

fn bce(logits: &Tensor, target: &Tensor) -> Tensor {
    logits.binary_cross_entropy_with_logits::<Tensor>(target, None, None, Reduction::Mean)
}

#[accel_core::accelerate(strategy = "ddp", accumulate = 2, cpu = true)]
fn train(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    let gen_vs = nn::VarStore::new(Device::Cpu);
    let disc_vs = nn::VarStore::new(Device::Cpu);
    let generator = nn::seq()
        .add(nn::linear(gen_vs.root() / "layers" / 0, 6, 16, Default::default()))
        .add_fn(|x| x.tanh())
        .add(nn::linear(gen_vs.root() / "layers" / 1, 16, 6, Default::default()));
    let discriminator = nn::seq()
        .add(nn::linear(disc_vs.root() / "layers" / 0, 6, 16, Default::default()))
        .add_fn(|x| x.leaky_relu())
        .add(nn::linear(disc_vs.root() / "layers" / 1, 16, 1, Default::default()));
    let mut gen_opt = nn::Adam::default().build(&gen_vs, 1e-2)?;
    let mut disc_opt = nn::Adam::default().build(&disc_vs, 1e-2)?;
    for _ in 0..data.epochs {
        for (real, _labels) in data.batches() {
            let noise = (&real * 1.7).cos();
            let fake = generator.forward(&noise);
            let ones = Tensor::ones([real.size()[0], 1], (Kind::Float, Device::Cpu));
            let zeros = ones.zeros_like();
            let d_loss = bce(&discriminator.forward(&real), &ones)
                + bce(&discriminator.forward(&fake.detach()), &zeros);
            disc_opt.zero_grad();
            d_loss.backward();
            disc_opt.step();
            let g_loss = bce(&discriminator.forward(&fake), &ones);
            gen_opt.zero_grad();
            g_loss.backward();
            gen_opt.step();
        }
    }
    let mut all = weights(&gen_vs, "generator.");
    all.extend(weights(&disc_vs, "discriminator."));
    Ok(all)
}

pub fn run(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    train(data)
}
