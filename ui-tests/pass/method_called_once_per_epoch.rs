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
    #[accel_core::accelerate(strategy = "ddp", cpu = true, model = self.vs)]
    fn train_epoch(&mut self, data: &Data) -> anyhow::Result<()> {
        for (x, y) in data.batches() {
            let loss = self.net.forward(&x).cross_entropy_for_logits(&y);
            self.opt.zero_grad();
            loss.backward();
            self.opt.step();
        }
        Ok(())
    }
}

pub fn run(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    let vs = nn::VarStore::new(Device::Cpu);
    let net = mlp(&vs.root());
    let opt = nn::Sgd { momentum: 0.9, ..Default::default() }.build(&vs, 0.05)?;
    let mut trainer = Trainer { vs, net, opt };
    for _ in 0..data.epochs {
        trainer.train_epoch(data)?;
    }
    Ok(weights(&trainer.vs, ""))
}
