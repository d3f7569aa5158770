//! Between epochs, an evaluation (a forward without gradient over held-out data) and a
//! weight norm logged by a helper, then training resumes: under zero3 the model is gathered
//! whole after the inner loop for them and released again at the next training step; the
//! losses logged and the weights equal one process's.
#![deny(warnings)]

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

use crate::common::{Data, weights};

fn log_norm(vs: &nn::VarStore, norms: &mut Vec<f64>) {
    let sum: f64 =
        vs.trainable_variables().iter().map(|t| t.square().sum(Kind::Float).double_value(&[])).sum();
    norms.push(sum.sqrt());
}

#[accel_core::accelerate(strategy = "zero3", cpu = true)]
fn train(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    let vs = nn::VarStore::new(Device::Cpu);
    let net = nn::seq()
        .add(nn::linear(vs.root() / "layers" / 0, 6, 16, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(vs.root() / "layers" / 1, 16, 3, Default::default()));
    let mut opt = nn::Sgd::default().build(&vs, 0.1)?;
    let (held_x, held_y) = data.all();
    let (mut losses, mut norms) = (Vec::new(), Vec::new());
    for _ in 0..data.epochs {
        for (x, y) in data.batches() {
            let loss = net.forward(&x).cross_entropy_for_logits(&y);
            opt.zero_grad();
            loss.backward();
            opt.step();
        }
        let held = tch::no_grad(|| net.forward(&held_x).cross_entropy_for_logits(&held_y));
        losses.push(held.double_value(&[]));
        log_norm(&vs, &mut norms);
    }
    let mut all = weights(&vs, "");
    // Summed, so that a run of no epoch has them too (as zeros).
    all.push(("held_out_losses".into(), Tensor::from(losses.iter().sum::<f64>())));
    all.push(("norms".into(), Tensor::from(norms.iter().sum::<f64>())));
    Ok(all)
}

pub fn run(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    train(data)
}
