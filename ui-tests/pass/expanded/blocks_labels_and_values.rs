//! The training loop in the value of a block, behind a label, in an `if let` chain and an
//! `unsafe` block; `break` with a value out of the labeled block.
#![deny(warnings)]
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Tensor};
use crate::common::{Data, mlp, weights};
fn train(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    let accelerator = ::accel_core::Accelerator::builder()
        .strategy(::accel_core::Strategy::Ddp)
        .cpu(true)
        .attribute_data_loops(1usize)
        .attribute_call(concat!("`train`", " at ", file!(), ":", line!()))
        .build()?;
    let __accel_exit = accelerator.exit_guard();
    let __accel_result: anyhow::Result<Vec<(String, Tensor)>> = (|| {
        use OptimizerConfig as _;
        let vs = nn::VarStore::new(Device::Cpu);
        let net = mlp(&vs.root());
        let mut opt = accelerator.build_optimizer(nn::Adam::default(), &vs, 1e-2)?;
        let limit = if data.epochs > 0 { Some(data.epochs) } else { None };
        let steps = 'run: {
            let Some(epochs) = limit else { break 'run 0usize };
            let mut steps = 0;
            if let Some(_first) = data.batches().first() {
                #[allow(unused_unsafe)]
                unsafe {
                    for _ in 0..epochs {
                        'batches: for (x, y) in accelerator.prepare_iter(data.batches())
                        {
                            let __accel_autocast = accelerator.autocast_step()?;
                            let loss = net.forward(&x).cross_entropy_for_logits(&y);
                            opt.zero_grad()?;
                            accelerator.backward(&loss)?;
                            opt.step()?;
                            steps += 1;
                            continue 'batches;
                        }
                    }
                }
            } else if epochs > 1000 {
                break 'run 0;
            }
            accelerator.attribute_summon()?;
            steps
        };
        accelerator.attribute_summon()?;
        anyhow::ensure!(steps > 0 || data.epochs == 0);
        Ok(weights(&vs, ""))
    })();
    if __accel_result.is_ok() {
        accelerator.attribute_summon().and_then(|_| __accel_exit.finish())?;
    }
    __accel_result
}
pub fn run(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    train(data)
}
