//! tch's AdamW with `amsgrad: true` over two parameter groups (`Path::set_group`), and tch's
//! setters on the prepared optimizer: `set_lr_group`, `set_weight_decay`,
//! `trainable_variables`.
#![deny(warnings)]
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Tensor};
use crate::common::{Data, weights};
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
        let vs = nn::VarStore::new(Device::Cpu);
        let head = vs.root().set_group(1);
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
                        &head / "layers" / 1,
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
                nn::AdamW {
                    amsgrad: true,
                    ..Default::default()
                },
                &vs,
                1e-2,
            )?;
        opt.set_lr_group(1, 3e-3);
        opt.set_weight_decay(0.05);
        anyhow::ensure!(opt.trainable_variables().len() == 4);
        for _ in 0..data.epochs {
            for (x, y) in accelerator.prepare_iter(data.batches()) {
                let __accel_autocast = accelerator.autocast_step()?;
                let loss = net.forward(&x).cross_entropy_for_logits(&y);
                opt.zero_grad()?;
                accelerator.backward(&loss)?;
                opt.step()?;
            }
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
