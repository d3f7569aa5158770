//! A `Trainer` struct whose `train_epoch(&mut self)` is annotated and called once per
//! epoch, then `evaluate` (the shape of most "trainer" code).
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Tensor};

use crate::data::{self, Digits};

struct Trainer {
    vs: nn::VarStore,
    model: nn::Sequential,
    opt: nn::Optimizer,
}

impl Trainer {
    fn new() -> anyhow::Result<Self> {
        let vs = nn::VarStore::new(Device::Cpu);
        let model = data::mlp(&vs.root());
        let opt = nn::Adam::default().build(&vs, 1e-2)?;
        Ok(Self { vs, model, opt })
    }

    #[accel_core::accelerate(strategy = "ddp", model = self.vs)]
    fn train_epoch(&mut self, batches: &[(Tensor, Tensor)]) -> anyhow::Result<f64> {
        let mut total = 0.0;
        for (x, y) in batches {
            let loss = self.model.forward(x).cross_entropy_for_logits(y);
            self.opt.zero_grad();
            loss.backward();
            self.opt.step();
            total += f64::try_from(&loss)?;
        }
        Ok(total)
    }

    fn evaluate(&self, d: &Digits) -> f64 {
        let acc = tch::no_grad(|| self.model.forward(&d.test_x).accuracy_for_logits(&d.test_y));
        f64::try_from(acc).unwrap_or(0.0)
    }
}

pub fn run() -> anyhow::Result<()> {
    tch::manual_seed(0);
    let d = data::load()?;
    let batches = data::batches(&d, data::batch_size());
    let mut trainer = Trainer::new()?;
    for epoch in 0..3 {
        let loss = trainer.train_epoch(&batches)?;
        println!("epoch {epoch}: loss {loss:.3}, accuracy {:.3}", trainer.evaluate(&d));
    }
    Ok(())
}
