//! The README's fsdp shape, as users write it: an `nn::seq()` built in the function (its
//! layers become zero3 units, released between uses), trained with plain SGD, then read
//! after the loop by a helper handed `&vs` (a weight norm) and by `vs.variables()` (the
//! weights returned). Under zero3 those reads must see the trained values, whole, as one
//! process would — they read freed memory before (SIGSEGV on 2 processes).
#![deny(warnings)]
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};
use crate::common::{Data, weights};
/// A helper of the user's, out of the attribute's sight.
fn weight_norm(vs: &nn::VarStore) -> f64 {
    vs.variables().values().map(|t| t.abs().sum(Kind::Float).double_value(&[])).sum()
}
fn train(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    let accelerator = ::accel_core::Accelerator::builder()
        .strategy(::accel_core::Strategy::Fsdp)
        .cpu(true)
        .attribute_data_loops(1usize)
        .attribute_call(concat!("`train`", " at ", file!(), ":", line!()))
        .build()?;
    let __accel_exit = accelerator.exit_guard();
    let __accel_result: anyhow::Result<Vec<(String, Tensor)>> = (|| {
        use OptimizerConfig as _;
        let vs = nn::VarStore::new(Device::Cpu);
        let mut net = nn::seq();
        for i in 0..3 {
            let (inputs, outputs) = ([6, 16, 16][i], [16, 16, 3][i]);
            net = net
                .add(
                    accelerator
                        .unit(
                            vs.root() / "layers" / i,
                            |__accel_path| nn::linear(
                                __accel_path,
                                inputs,
                                outputs,
                                Default::default(),
                            ),
                        ),
                );
            if i < 2 {
                net = net.add_fn(|x| x.tanh());
            }
        }
        let mut opt = accelerator.build_optimizer(nn::Sgd::default(), &vs, 0.1)?;
        for _ in 0..data.epochs {
            for (x, y) in accelerator.prepare_iter(data.batches()) {
                let __accel_autocast = accelerator.autocast_step()?;
                let loss = net.forward(&x).cross_entropy_for_logits(&y);
                opt.zero_grad()?;
                accelerator.backward(&loss)?;
                opt.step()?;
            }
        }
        accelerator.attribute_summon()?;
        let norm = weight_norm(&vs);
        anyhow::ensure!(norm.is_finite() && norm > 1.0, "the weights read {norm}");
        let mut all = weights(&vs, "");
        all.push(("norm".into(), Tensor::from(norm)));
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
