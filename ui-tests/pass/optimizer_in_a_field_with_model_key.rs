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

    #[accel_core::accelerate(strategy = "ddp", cpu = true, model = self.vs)]
    fn fit(&mut self, data: &Data) -> anyhow::Result<()> {
        for epoch in 0..data.epochs {
            self.opt.set_lr(1e-2 / (1 + epoch) as f64);
            for (x, y) in data.batches() {
                let loss = self.net.forward(&x).cross_entropy_for_logits(&y);
                self.opt.zero_grad();
                loss.backward();
                self.opt.step();
            }
        }
        Ok(())
    }
}

pub fn run(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    let mut trainer = Trainer::new()?;
    trainer.fit(data)?;
    Ok(weights(&trainer.vs, ""))
}
