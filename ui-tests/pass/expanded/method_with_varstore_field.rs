//! A method (`&mut self`) whose VarStore is a field: `build(&self.vs, lr)`.
#![deny(warnings)]
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Tensor};
use crate::common::{Data, mlp, weights};
struct Trainer {
    vs: nn::VarStore,
    net: nn::Sequential,
}
impl Trainer {
    fn fit(&mut self, data: &Data) -> anyhow::Result<()> {
        let accelerator = ::accel_core::Accelerator::builder()
            .strategy(::accel_core::Strategy::Ddp)
            .cpu(true)
            .attribute_data_loops(1usize)
            .attribute_call(concat!("`fit`", " at ", file!(), ":", line!()))
            .build()?;
        let __accel_exit = accelerator.exit_guard();
        let __accel_result: anyhow::Result<()> = (|| {
            use OptimizerConfig as _;
            let mut opt = accelerator
                .build_optimizer(
                    nn::Sgd {
                        momentum: 0.9,
                        ..Default::default()
                    },
                    &self.vs,
                    0.05,
                )?;
            for _ in 0..data.epochs {
                for (x, y) in accelerator.prepare_iter(data.batches()) {
                    let __accel_autocast = accelerator.autocast_step()?;
                    let loss = self.net.forward(&x).cross_entropy_for_logits(&y);
                    opt.zero_grad()?;
                    accelerator.backward(&loss)?;
                    opt.step()?;
                }
            }
            Ok(())
        })();
        if __accel_result.is_ok() {
            __accel_exit.finish()?;
        }
        __accel_result
    }
}
pub fn run(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    let vs = nn::VarStore::new(Device::Cpu);
    let net = mlp(&vs.root());
    let mut trainer = Trainer { vs, net };
    trainer.fit(data)?;
    Ok(weights(&trainer.vs, ""))
}
