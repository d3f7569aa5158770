use tch::nn::{self, Module, OptimizerConfig};
use tch::{COptimizer, Device, Kind, TchError, Tensor};

struct Lion;

impl OptimizerConfig for Lion {
    fn build_copt(&self, lr: f64) -> Result<COptimizer, TchError> {
        COptimizer::sgd(lr, 0.0, 0.0, 0.0, false)
    }
}

#[accel_core::accelerate(strategy = "ddp")]
fn train(data: Vec<Tensor>) -> anyhow::Result<()> {
    let vs = nn::VarStore::new(Device::Cpu);
    let net = nn::linear(vs.root() / "lin", 2, 1, Default::default());
    let mut opt = Lion.build(&vs, 1e-4)?;
    for x in data {
        let loss = net.forward(&x).sum(Kind::Float);
        opt.backward_step(&loss);
    }
    Ok(())
}

fn main() {}
