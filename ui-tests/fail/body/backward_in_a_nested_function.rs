// The step in a function defined inside the annotated one, which the attribute does not
// rewrite.
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Tensor};

#[accel_core::accelerate(strategy = "ddp")]
fn train(batches: Vec<(Tensor, Tensor)>) -> anyhow::Result<()> {
    fn step(net: &nn::Linear, opt: &mut nn::Optimizer, x: &Tensor, y: &Tensor) {
        let loss = net.forward(x).cross_entropy_for_logits(y);
        opt.backward_step(&loss);
    }
    let vs = nn::VarStore::new(Device::Cpu);
    let net = nn::linear(vs.root() / "lin", 4, 2, Default::default());
    let mut opt = nn::Sgd::default().build(&vs, 0.1)?;
    for (x, y) in &batches {
        step(&net, &mut opt, x, y);
    }
    Ok(())
}

fn main() {}
