//! WGAN's loop (Arjovsky et al.'s `main.py`): `n_critic` critic steps, each on the next batch
//! of one iterator and each followed by weight clipping, then one generator step, until the
//! batches run out. The outer loop is the step: its iterator is dealt, the critic loop only
//! repeats steps within it.
#![deny(warnings)]

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

use crate::common::{Data, weights};

const N_CRITIC: usize = 2;
const CLIP: f64 = 0.05;

#[accel_core::accelerate(strategy = "ddp", cpu = true)]
fn train(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    let gen_vs = nn::VarStore::new(Device::Cpu);
    let critic_vs = nn::VarStore::new(Device::Cpu);
    let generator = nn::seq()
        .add(nn::linear(gen_vs.root() / "layers" / 0, 6, 16, Default::default()))
        .add_fn(|x| x.tanh())
        .add(nn::linear(gen_vs.root() / "layers" / 1, 16, 6, Default::default()));
    let critic = nn::seq()
        .add(nn::linear(critic_vs.root() / "layers" / 0, 6, 16, Default::default()))
        .add_fn(|x| x.leaky_relu())
        .add(nn::linear(critic_vs.root() / "layers" / 1, 16, 1, Default::default()));
    let mut gen_opt = nn::Sgd::default().build(&gen_vs, 0.5)?;
    let mut critic_opt = nn::RmsProp::default().build(&critic_vs, 5e-3)?;
    for _ in 0..data.epochs {
        let mut batches = data.batches().into_iter();
        'epoch: loop {
            let mut last = None;
            for _ in 0..N_CRITIC {
                let Some((real, _labels)) = batches.next() else { break 'epoch };
                // The generator's input, from the batch (random noise would differ between 1
                // and 2 processes).
                let fake = generator.forward(&(&real * 1.7).cos()).detach();
                let critic_loss =
                    critic.forward(&fake).mean(Kind::Float) - critic.forward(&real).mean(Kind::Float);
                critic_opt.zero_grad();
                critic_loss.backward();
                critic_opt.step();
                tch::no_grad(|| {
                    for mut v in critic_vs.trainable_variables() {
                        let _ = v.clamp_(-CLIP, CLIP);
                    }
                });
                last = Some(real);
            }
            let real = last.expect("at least one critic step");
            let gen_loss = -critic.forward(&generator.forward(&(&real * 1.7).cos())).mean(Kind::Float);
            gen_opt.zero_grad();
            gen_loss.backward();
            gen_opt.step();
        }
    }
    let mut all = weights(&gen_vs, "generator.");
    all.extend(weights(&critic_vs, "critic."));
    Ok(all)
}

pub fn run(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    train(data)
}
