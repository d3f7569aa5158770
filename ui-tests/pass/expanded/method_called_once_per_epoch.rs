//! A method that trains one epoch, called once per epoch: every call after the first
//! reuses the process's group (no second rendezvous).
#![deny(warnings)]
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Tensor};
use crate::common::{Data, mlp, weights};
struct Trainer {
    vs: nn::VarStore,
    net: nn::Sequential,
    opt: nn::Optimizer,
}
impl Trainer {
    fn train_epoch(&mut self, data: &Data) -> anyhow::Result<()> {
        let accelerator = ::accel_core::Accelerator::builder()
            .strategy(::accel_core::Strategy::Ddp)
            .cpu(true)
            .attribute_data_loops(1usize)
            .attribute_call(concat!("`train_epoch`", " at ", file!(), ":", line!()))
            .build()?;
        let __accel_exit = accelerator.exit_guard();
        let __accel_result: anyhow::Result<()> = (|| {
            accelerator.prepare_model_once(&self.vs)?;
            for (x, y) in accelerator.prepare_iter(data.batches()) {
                let __accel_autocast = accelerator.autocast_step()?;
                let loss = self.net.forward(&x).cross_entropy_for_logits(&y);
                accelerator.drive(&mut self.opt).zero_grad()?;
                accelerator.backward(&loss)?;
                accelerator.drive(&mut self.opt).step()?;
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
    let opt = nn::Sgd {
        momentum: 0.9,
        ..Default::default()
    }
        .build(&vs, 0.05)?;
    let mut trainer = Trainer { vs, net, opt };
    for _ in 0..data.epochs {
        trainer.train_epoch(data)?;
    }
    Ok(weights(&trainer.vs, ""))
}
