// The whole training step in a helper the attribute cannot see into.
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

fn train_step(net: &nn::Linear, opt: &mut nn::Optimizer, x: &Tensor) -> f64 {
    let loss = net.forward(x).sum(Kind::Float);
    opt.backward_step(&loss);
    loss.double_value(&[])
}

#[accel_core::accelerate(strategy = "ddp")]
fn train(data: Vec<Tensor>) -> anyhow::Result<()> {
    let vs = nn::VarStore::new(Device::Cpu);
    let net = nn::linear(vs.root() / "lin", 2, 1, Default::default());
    let mut opt = nn::Sgd::default().build(&vs, 0.1)?;
    for x in data {
        let loss = train_step(&net, &mut opt, &x);
        println!("{loss}");
    }
    Ok(())
}

fn main() {}
