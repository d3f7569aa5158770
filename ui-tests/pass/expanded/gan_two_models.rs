//! Two models with two optimizers and two losses per batch (a GAN), with accumulation: both
//! backward passes of a batch are one micro-step, each model's gradients are averaged.
#![deny(warnings)]
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Reduction, Tensor};
use crate::common::{Data, weights};
fn bce(logits: &Tensor, target: &Tensor) -> Tensor {
    logits
        .binary_cross_entropy_with_logits::<Tensor>(target, None, None, Reduction::Mean)
}
fn train(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    let accelerator = ::accel_core::Accelerator::builder()
        .strategy(::accel_core::Strategy::Ddp)
        .accumulate(2)
        .cpu(true)
        .attribute_data_loops(1usize)
        .attribute_call(concat!("`train`", " at ", file!(), ":", line!()))
        .build()?;
    let __accel_exit = accelerator.exit_guard();
    let __accel_result: anyhow::Result<Vec<(String, Tensor)>> = (|| {
        use OptimizerConfig as _;
        let gen_vs = nn::VarStore::new(Device::Cpu);
        let disc_vs = nn::VarStore::new(Device::Cpu);
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
        let discriminator = nn::seq()
            .add(
                accelerator
                    .unit(
                        disc_vs.root() / "layers" / 0,
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
                        disc_vs.root() / "layers" / 1,
                        |__accel_path| nn::linear(
                            __accel_path,
                            16,
                            1,
                            Default::default(),
                        ),
                    ),
            );
        let mut gen_opt = accelerator
            .build_optimizer(nn::Adam::default(), &gen_vs, 1e-2)?;
        let mut disc_opt = accelerator
            .build_optimizer(nn::Adam::default(), &disc_vs, 1e-2)?;
        for _ in 0..data.epochs {
            for (real, _labels) in accelerator.prepare_iter(data.batches()) {
                let __accel_autocast = accelerator.autocast_step()?;
                let noise = (&real * 1.7).cos();
                let fake = generator.forward(&noise);
                let ones = Tensor::ones([real.size()[0], 1], (Kind::Float, Device::Cpu));
                let zeros = ones.zeros_like();
                let d_loss = bce(&discriminator.forward(&real), &ones)
                    + bce(&discriminator.forward(&fake.detach()), &zeros);
                disc_opt.zero_grad()?;
                accelerator.backward(&d_loss)?;
                disc_opt.step()?;
                let g_loss = bce(&discriminator.forward(&fake), &ones);
                gen_opt.zero_grad()?;
                accelerator.backward(&g_loss)?;
                gen_opt.step()?;
            }
        }
        accelerator.attribute_summon()?;
        let mut all = weights(&gen_vs, "generator.");
        all.extend(weights(&disc_vs, "discriminator."));
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
