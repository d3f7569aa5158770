//! A GAN step per iteration (tch-rs's relativistic GAN, reduced): random latents and random
//! real samples drawn each step, two optimizers, `index % k` for progress.
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

use crate::data;

#[accel_core::accelerate(strategy = "ddp")]
fn train(real: &Tensor) -> anyhow::Result<()> {
    let g_vs = nn::VarStore::new(Device::Cpu);
    let d_vs = nn::VarStore::new(Device::Cpu);
    let generator = nn::seq()
        .add(nn::linear(g_vs.root() / "g1", 8, 32, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(g_vs.root() / "g2", 32, 64, Default::default()))
        .add_fn(|x| x.sigmoid());
    let discriminator = nn::seq()
        .add(nn::linear(d_vs.root() / "d1", 64, 32, Default::default()))
        .add_fn(|x| x.leaky_relu())
        .add(nn::linear(d_vs.root() / "d2", 32, 1, Default::default()));
    let mut opt_g = nn::adam(0.5, 0.999, 0.).build(&g_vs, 1e-3)?;
    let mut opt_d = nn::adam(0.5, 0.999, 0.).build(&d_vs, 1e-3)?;
    let n = real.size()[0];
    for index in 0..20 {
        let idx = Tensor::randint(n, [16], (Kind::Int64, Device::Cpu));
        let batch = real.index_select(0, &idx);
        let fake = generator.forward(&Tensor::randn([16, 8], (Kind::Float, Device::Cpu)));
        let d_loss = (discriminator.forward(&fake.detach()) - discriminator.forward(&batch))
            .mean(Kind::Float);
        opt_d.backward_step(&d_loss);
        let z = Tensor::randn([16, 8], (Kind::Float, Device::Cpu));
        let g_loss = -discriminator.forward(&generator.forward(&z)).mean(Kind::Float);
        opt_g.backward_step(&g_loss);
        if index % 5 == 0 {
            println!("{index}: d {:.4} g {:.4}", f64::try_from(&d_loss)?, f64::try_from(&g_loss)?);
        }
    }
    Ok(())
}

pub fn run() -> anyhow::Result<()> {
    tch::manual_seed(7);
    let d = data::load()?;
    train(&d.train_x)
}
