//! A trainer struct that keeps its optimizer in a field (made in `new`), its method
//! annotated with `model = self.vs`: each call on `self.opt` is driven by the accelerator.
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
    fn new() -> anyhow::Result<Self> {
        let vs = nn::VarStore::new(Device::Cpu);
        let net = mlp(&vs.root());
        let opt = nn::Adam::default().build(&vs, 1e-2)?;
        Ok(Self { vs, net, opt })
    }
    fn fit(&mut self, data: &Data) -> anyhow::Result<()> {
        let accelerator = ::accel_core::Accelerator::builder()
            .strategy(::accel_core::Strategy::Ddp)
            .cpu(true)
            .attribute_data_loops(1usize)
            .attribute_call(concat!("`fit`", " at ", file!(), ":", line!()))
            .build()?;
        let __accel_exit = accelerator.exit_guard();
        let __accel_result: anyhow::Result<()> = (|| {
            accelerator.prepare_model_once(&self.vs)?;
            for epoch in 0..data.epochs {
                accelerator.drive(&mut self.opt).set_lr(1e-2 / (1 + epoch) as f64);
                for (x, y) in accelerator.prepare_iter(data.batches()) {
                    let __accel_autocast = accelerator.autocast_step()?;
                    let loss = self.net.forward(&x).cross_entropy_for_logits(&y);
                    accelerator.drive(&mut self.opt).zero_grad()?;
                    accelerator.backward(&loss)?;
                    accelerator.drive(&mut self.opt).step()?;
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
    let mut trainer = Trainer::new()?;
    trainer.fit(data)?;
    Ok(weights(&trainer.vs, ""))
}
