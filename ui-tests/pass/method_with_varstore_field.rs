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
    #[accel_core::accelerate(strategy = "ddp", cpu = true)]
    fn fit(&mut self, data: &Data) -> anyhow::Result<()> {
        let mut opt = nn::Sgd { momentum: 0.9, ..Default::default() }.build(&self.vs, 0.05)?;
        for _ in 0..data.epochs {
            for (x, y) in data.batches() {
                let loss = self.net.forward(&x).cross_entropy_for_logits(&y);
                opt.zero_grad();
                loss.backward();
                opt.step();
            }
        }
        Ok(())
    }
}

pub fn run(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    let vs = nn::VarStore::new(Device::Cpu);
    let net = mlp(&vs.root());
    let mut trainer = Trainer { vs, net };
    trainer.fit(data)?;
    Ok(weights(&trainer.vs, ""))
}
