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
fn train(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    let accelerator = ::accel_core::Accelerator::builder()
        .strategy(::accel_core::Strategy::Ddp)
        .cpu(true)
        .attribute_data_loops(1usize)
        .attribute_call(concat!("`train`", " at ", file!(), ":", line!()))
        .build()?;
    let __accel_exit = accelerator.exit_guard();
    let __accel_result: anyhow::Result<Vec<(String, Tensor)>> = (|| {
        use OptimizerConfig as _;
        let gen_vs = nn::VarStore::new(Device::Cpu);
        let critic_vs = nn::VarStore::new(Device::Cpu);
        let generator = nn::seq()
            .add(
                accelerator
                    .unit(
                        gen_vs.root() / "layers" / 0,
                        |__accel_path| nn::linear(
                            __accel_path,
                            6,
                            16,
                            Default::default(),
                        ),
                    ),
            )
            .add_fn(|x| x.tanh())
            .add(
                accelerator
                    .unit(
                        gen_vs.root() / "layers" / 1,
                        |__accel_path| nn::linear(
                            __accel_path,
                            16,
                            6,
                            Default::default(),
                        ),
                    ),
            );
        let critic = nn::seq()
            .add(
                accelerator
                    .unit(
                        critic_vs.root() / "layers" / 0,
                        |__accel_path| nn::linear(
                            __accel_path,
                            6,
                            16,
                            Default::default(),
                        ),
                    ),
            )
            .add_fn(|x| x.leaky_relu())
            .add(
                accelerator
                    .unit(
                        critic_vs.root() / "layers" / 1,
                        |__accel_path| nn::linear(
                            __accel_path,
                            16,
                            1,
                            Default::default(),
                        ),
                    ),
            );
        let mut gen_opt = accelerator.build_optimizer(nn::Sgd::default(), &gen_vs, 0.5)?;
        let mut critic_opt = accelerator
            .build_optimizer(nn::RmsProp::default(), &critic_vs, 5e-3)?;
        for _ in 0..data.epochs {
            let mut batches = accelerator.prepare_iter(data.batches().into_iter());
            'epoch: loop {
                let __accel_autocast = accelerator.autocast_step()?;
                let mut last = None;
                for _ in 0..N_CRITIC {
                    let Some((real, _labels)) = batches.next() else { break 'epoch };
                    let fake = generator.forward(&(&real * 1.7).cos()).detach();
                    let critic_loss = critic.forward(&fake).mean(Kind::Float)
                        - critic.forward(&real).mean(Kind::Float);
                    critic_opt.zero_grad()?;
                    accelerator.backward(&critic_loss)?;
                    critic_opt.step()?;
                    tch::no_grad(|| {
                        for mut v in critic_vs.trainable_variables() {
                            let _ = v.clamp_(-CLIP, CLIP);
                        }
                    });
                    last = Some(real);
                }
                let real = last.expect("at least one critic step");
                let gen_loss = -critic
                    .forward(&generator.forward(&(&real * 1.7).cos()))
                    .mean(Kind::Float);
                gen_opt.zero_grad()?;
                accelerator.backward(&gen_loss)?;
                gen_opt.step()?;
            }
        }
        accelerator.attribute_summon()?;
        let mut all = weights(&gen_vs, "generator.");
        all.extend(weights(&critic_vs, "critic."));
        Ok(all)
    })();
    if __accel_result.is_ok() {
        accelerator.attribute_summon().and_then(|_| __accel_exit.finish())?;
    }
    __accel_result
}
pub fn run(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    train(data)
}
