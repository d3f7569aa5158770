// tch-rs's mnist_nn: full-batch training in a loop that counts epochs. The loop has no
// batches to deal, so every process would train on the same data.
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Tensor};

#[accel_core::accelerate(strategy = "ddp")]
fn train(images: &Tensor, labels: &Tensor) -> anyhow::Result<()> {
    let vs = nn::VarStore::new(Device::Cpu);
    let net = nn::linear(vs.root() / "lin", 784, 10, Default::default());
    let mut opt = nn::Adam::default().build(&vs, 1e-3)?;
    for epoch in 1..200 {
        let loss = net.forward(images).cross_entropy_for_logits(labels);
        opt.backward_step(&loss);
        println!("epoch: {epoch:4} train loss: {:8.5}", f64::try_from(&loss)?);
    }
    Ok(())
}

fn main() {}
