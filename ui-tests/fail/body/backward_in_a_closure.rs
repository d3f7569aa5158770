// A training step in a closure called from the loop: the closure may run anywhere, so the
// attribute cannot prepare its data or its autocast.
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Tensor};

#[accel_core::accelerate(strategy = "ddp")]
fn train(batches: Vec<(Tensor, Tensor)>) -> anyhow::Result<()> {
    let vs = nn::VarStore::new(Device::Cpu);
    let net = nn::linear(vs.root() / "lin", 4, 2, Default::default());
    let mut opt = nn::Sgd::default().build(&vs, 0.1)?;
    let mut step = |x: &Tensor, y: &Tensor| {
        let loss = net.forward(x).cross_entropy_for_logits(y);
        opt.zero_grad();
        loss.backward();
        opt.step();
    };
    for (x, y) in &batches {
        step(x, y);
    }
    Ok(())
}

fn main() {}
