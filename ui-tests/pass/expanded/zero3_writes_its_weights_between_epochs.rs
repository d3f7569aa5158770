//! Code that writes the model's weights in place between epochs (the original WGAN's weight
//! clipping, a max-norm constraint): under zero3 the writes land in what the next steps
//! train, as in one process, and the weights equal one process's.
#![deny(warnings)]
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Tensor};
use crate::common::{Data, weights};
fn clip_weights(vs: &nn::VarStore, limit: f64) {
    tch::no_grad(|| {
        for mut v in vs.trainable_variables() {
            let _ = v.clamp_(-limit, limit);
        }
    });
}
fn train(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    let accelerator = ::accel_core::Accelerator::builder()
        .strategy(::accel_core::Strategy::Zero3)
        .cpu(true)
        .attribute_data_loops(1usize)
        .attribute_call(concat!("`train`", " at ", file!(), ":", line!()))
        .build()?;
    let __accel_exit = accelerator.exit_guard();
    let __accel_result: anyhow::Result<Vec<(String, Tensor)>> = (|| {
        use OptimizerConfig as _;
        let vs = nn::VarStore::new(Device::Cpu);
        let net = nn::seq()
            .add(
                accelerator
                    .unit(
                        vs.root() / "layers" / 0,
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
                        vs.root() / "layers" / 1,
                        |__accel_path| nn::linear(
                            __accel_path,
                            16,
                            3,
                            Default::default(),
                        ),
                    ),
            );
        let mut opt = accelerator
            .build_optimizer(
                nn::Sgd {
                    momentum: 0.5,
                    ..Default::default()
                },
                &vs,
                0.2,
            )?;
        for _ in 0..data.epochs {
            for (x, y) in accelerator.prepare_iter(data.batches()) {
                let __accel_autocast = accelerator.autocast_step()?;
                let loss = net.forward(&x).cross_entropy_for_logits(&y);
                opt.zero_grad()?;
                accelerator.backward(&loss)?;
                opt.step()?;
            }
            accelerator.attribute_summon()?;
            clip_weights(&vs, 0.2);
        }
        accelerator.attribute_summon()?;
        Ok(weights(&vs, ""))
    })();
    if __accel_result.is_ok() {
        accelerator.attribute_summon().and_then(|_| __accel_exit.finish())?;
    }
    __accel_result
}
pub fn run(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    train(data)
}
