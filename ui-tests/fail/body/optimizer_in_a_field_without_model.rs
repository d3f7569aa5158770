use tch::nn::{self, Module};
use tch::{Kind, Tensor};

struct Trainer {
    net: nn::Linear,
    opt: nn::Optimizer,
}

impl Trainer {
    #[accel_core::accelerate(strategy = "ddp")]
    fn fit(&mut self, data: Vec<Tensor>) -> anyhow::Result<()> {
        for x in data {
            let loss = self.net.forward(&x).sum(Kind::Float);
            self.opt.zero_grad();
            loss.backward();
            self.opt.step();
        }
        Ok(())
    }
}

fn main() {}
