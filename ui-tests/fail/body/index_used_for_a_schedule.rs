// The index loop: `i` picks the batch (so the loop is dealt), and also sets the
// learning rate and decides the step — values that would differ from process to process.
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Reduction, Tensor};

#[accel_core::accelerate(strategy = "ddp")]
fn train(x: &Tensor, y: &Tensor, n_batches: i64, bs: i64) -> anyhow::Result<()> {
    let vs = nn::VarStore::new(Device::Cpu);
    let net = nn::linear(vs.root() / "lin", 4, 1, Default::default());
    let mut opt = nn::Sgd::default().build(&vs, 0.05)?;
    for i in 0..n_batches {
        opt.set_lr(0.05 * (1.0 - i as f64 / n_batches as f64));
        let xb = x.narrow(0, i * bs, bs);
        let yb = y.narrow(0, i * bs, bs);
        let loss = net.forward(&xb).mse_loss(&yb, Reduction::Mean);
        loss.backward();
        if (i + 1) % 4 == 0 {
            opt.step();
            opt.zero_grad();
        }
    }
    Ok(())
}

fn main() {}
