// `get_batch(i)` may pick the batch or only count: the attribute asks.
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

fn get_batch(i: i64) -> Tensor {
    Tensor::full([4, 2], i as f64, (Kind::Float, Device::Cpu))
}

fn log_step(i: i64) {
    println!("{i}");
}

#[accel_core::accelerate(strategy = "ddp")]
fn train(n: i64) -> anyhow::Result<()> {
    let vs = nn::VarStore::new(Device::Cpu);
    let net = nn::linear(vs.root() / "lin", 2, 1, Default::default());
    let mut opt = nn::Sgd::default().build(&vs, 0.1)?;
    for i in 0..n {
        let x = get_batch(i);
        log_step(i);
        let loss = net.forward(&x).sum(Kind::Float);
        opt.backward_step(&loss);
    }
    Ok(())
}

fn main() {}
