// The training loop written with `for_each`.
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Tensor};

#[accel_core::accelerate(strategy = "ddp")]
fn train(batches: Vec<(Tensor, Tensor)>) -> anyhow::Result<()> {
    let vs = nn::VarStore::new(Device::Cpu);
    let net = nn::linear(vs.root() / "lin", 4, 2, Default::default());
    let mut opt = nn::Sgd::default().build(&vs, 0.1)?;
    batches.iter().for_each(|(x, y)| {
        let loss = net.forward(x).cross_entropy_for_logits(y);
        opt.backward_step(&loss);
    });
    Ok(())
}

fn main() {}
