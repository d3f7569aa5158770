//! Between epochs, an evaluation (a forward without gradient over held-out data) and a
//! weight norm logged by a helper, then training resumes: under zero3 the model is gathered
//! whole after the inner loop for them and released again at the next training step; the
//! losses logged and the weights equal one process's.
#![deny(warnings)]
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};
use crate::common::{Data, weights};
fn log_norm(vs: &nn::VarStore, norms: &mut Vec<f64>) {
    let sum: f64 = vs
        .trainable_variables()
        .iter()
        .map(|t| t.square().sum(Kind::Float).double_value(&[]))
        .sum();
    norms.push(sum.sqrt());
}
fn train(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    let accelerator = ::accel_core::Accelerator::builder()
        .strategy(::accel_core::Strategy::Zero3)
        .cpu(true)
        .attribute_data_loops(1usize)
        .attribute_call(concat!("`train`", " at ", file!(), ":", line!()))
        .build()?;
    let __accel_exit = accelerator.exit_guard();
    let __accel_result: anyhow::Result<Vec<(String, Tensor)>> = (|| {
        use OptimizerConfig as _;
        let vs = nn::VarStore::new(Device::Cpu);
        let net = nn::seq()
            .add(
                accelerator
                    .unit(
                        vs.root() / "layers" / 0,
                        |__accel_path| nn::linear(
                            __accel_path,
                            6,
                            16,
                            Default::default(),
                        ),
                    ),
            )
            .add_fn(|x| x.relu())
            .add(
                accelerator
                    .unit(
                        vs.root() / "layers" / 1,
                        |__accel_path| nn::linear(
                            __accel_path,
                            16,
                            3,
                            Default::default(),
                        ),
                    ),
            );
        let mut opt = accelerator.build_optimizer(nn::Sgd::default(), &vs, 0.1)?;
        let (held_x, held_y) = data.all();
        let (mut losses, mut norms) = (Vec::new(), Vec::new());
        for _ in 0..data.epochs {
            for (x, y) in accelerator.prepare_iter(data.batches()) {
                let __accel_autocast = accelerator.autocast_step()?;
                let loss = net.forward(&x).cross_entropy_for_logits(&y);
                opt.zero_grad()?;
                accelerator.backward(&loss)?;
                opt.step()?;
            }
            accelerator.attribute_summon()?;
            let held = tch::no_grad(|| {
                net.forward(&held_x).cross_entropy_for_logits(&held_y)
            });
            losses.push(held.double_value(&[]));
            log_norm(&vs, &mut norms);
        }
        accelerator.attribute_summon()?;
        let mut all = weights(&vs, "");
        all.push(("held_out_losses".into(), Tensor::from(losses.iter().sum::<f64>())));
        all.push(("norms".into(), Tensor::from(norms.iter().sum::<f64>())));
        Ok(all)
    })();
    if __accel_result.is_ok() {
        accelerator.attribute_summon().and_then(|_| __accel_exit.finish())?;
    }
    __accel_result
}
pub fn run(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    train(data)
}
