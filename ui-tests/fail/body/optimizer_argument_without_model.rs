use tch::nn::{self, Module};
use tch::{Kind, Tensor};

#[accel_core::accelerate(strategy = "ddp")]
fn train(net: &nn::Linear, opt: &mut nn::Optimizer, data: Vec<Tensor>) -> anyhow::Result<()> {
    for x in data {
        let loss = net.forward(&x).sum(Kind::Float);
        opt.zero_grad();
        loss.backward();
        opt.step();
    }
    Ok(())
}

fn main() {}
