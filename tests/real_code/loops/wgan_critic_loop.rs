//! WGAN as its paper's code trains it (Arjovsky et al., `main.py`): `n_critic` critic steps,
//! each on the next batch of the data iterator and each followed by weight clipping, then one
//! generator step on fresh noise, until the iterator runs out.
use tch::data::Iter2;
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

use crate::data;

const N_CRITIC: usize = 4;
const CLAMP: f64 = 0.01;
const LATENT: i64 = 16;

#[accel_core::accelerate(strategy = "ddp")]
fn train() -> anyhow::Result<()> {
    let d = data::load()?;
    let g_vs = nn::VarStore::new(Device::Cpu);
    let c_vs = nn::VarStore::new(Device::Cpu);
    let generator = nn::seq()
        .add(nn::linear(g_vs.root() / "g1", LATENT, 64, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(g_vs.root() / "g2", 64, 64, Default::default()))
        .add_fn(|x| x.sigmoid());
    let critic = nn::seq()
        .add(nn::linear(c_vs.root() / "c1", 64, 64, Default::default()))
        .add_fn(|x| x.leaky_relu())
        .add(nn::linear(c_vs.root() / "c2", 64, 1, Default::default()));
    let mut opt_g = nn::RmsProp::default().build(&g_vs, 5e-4)?;
    let mut opt_c = nn::RmsProp::default().build(&c_vs, 5e-4)?;
    let bs = data::batch_size();
    let mut gen_iterations = 0;
    for epoch in 0..2 {
        let mut batches = Iter2::new(&d.train_x, &d.train_y, bs);
        'data: loop {
            let mut critic_loss = 0.0;
            for _ in 0..N_CRITIC {
                let Some((real, _)) = batches.next() else { break 'data };
                let noise = Tensor::randn([real.size()[0], LATENT], (Kind::Float, Device::Cpu));
                let fake = generator.forward(&noise).detach();
                let loss = critic.forward(&fake).mean(Kind::Float) - critic.forward(&real).mean(Kind::Float);
                opt_c.zero_grad();
                loss.backward();
                opt_c.step();
                tch::no_grad(|| {
                    for mut p in c_vs.trainable_variables() {
                        let _ = p.clamp_(-CLAMP, CLAMP);
                    }
                });
                critic_loss = f64::try_from(&loss)?;
            }
            let noise = Tensor::randn([bs, LATENT], (Kind::Float, Device::Cpu));
            let g_loss = -critic.forward(&generator.forward(&noise)).mean(Kind::Float);
            opt_g.zero_grad();
            g_loss.backward();
            opt_g.step();
            gen_iterations += 1;
            if gen_iterations % 4 == 0 {
                println!("[{epoch}][{gen_iterations}] critic {critic_loss:.5} generator {:.5}", f64::try_from(&g_loss)?);
            }
        }
    }
    Ok(())
}

pub fn run() -> anyhow::Result<()> {
    tch::manual_seed(3);
    train()
}
