// Accumulation twice: by hand (`% 4`) and by the attribute (`accumulate = 4`).
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

#[accel_core::accelerate(strategy = "ddp", accumulate = 4)]
fn train(data: Vec<Tensor>) -> anyhow::Result<()> {
    let vs = nn::VarStore::new(Device::Cpu);
    let net = nn::linear(vs.root() / "lin", 2, 1, Default::default());
    let mut opt = nn::Sgd::default().build(&vs, 0.1)?;
    for (step, x) in data.into_iter().enumerate() {
        let loss = net.forward(&x).sum(Kind::Float) / 4.0;
        loss.backward();
        if (step + 1) % 4 == 0 {
            opt.step();
            opt.zero_grad();
        }
    }
    Ok(())
}

fn main() {}
