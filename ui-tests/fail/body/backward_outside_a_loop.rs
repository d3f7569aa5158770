// One training step, in no loop: there is no data loop to prepare.
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Tensor};

#[accel_core::accelerate(strategy = "ddp")]
fn train(x: &Tensor, y: &Tensor) -> anyhow::Result<()> {
    let vs = nn::VarStore::new(Device::Cpu);
    let net = nn::linear(vs.root() / "lin", 4, 2, Default::default());
    let mut opt = nn::Sgd::default().build(&vs, 0.1)?;
    let loss = net.forward(x).cross_entropy_for_logits(y);
    opt.zero_grad();
    loss.backward();
    opt.step();
    Ok(())
}

fn main() {}
