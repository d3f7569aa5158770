//! `?` inside the training loop, an epoch `loop` with an early `return`, `Box<dyn Error>`.
#![deny(warnings)]
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Reduction, Tensor};
use crate::common::{Data, mlp, weights};
type Weights = Vec<(String, Tensor)>;
fn train(data: &Data) -> Result<Weights, Box<dyn std::error::Error>> {
    let accelerator = ::accel_core::Accelerator::builder()
        .strategy(::accel_core::Strategy::Ddp)
        .cpu(true)
        .attribute_data_loops(1usize)
        .attribute_call(concat!("`train`", " at ", file!(), ":", line!()))
        .build()?;
    let __accel_exit = accelerator.exit_guard();
    let __accel_result: Result<Weights, Box<dyn std::error::Error>> = (|| {
        use OptimizerConfig as _;
        let vs = nn::VarStore::new(Device::Cpu);
        let net = mlp(&vs.root());
        let mut opt = accelerator.build_optimizer(nn::Adam::default(), &vs, 1e-2)?;
        let mut epoch = 0;
        loop {
            if epoch == data.epochs {
                return Ok(weights(&vs, ""));
            }
            for (x, y) in accelerator.prepare_iter(data.batches()) {
                let __accel_autocast = accelerator.autocast_step()?;
                let logits = net.forward(&x);
                let loss = logits
                    .f_log_softmax(-1, Kind::Float)?
                    .f_nll_loss::<Tensor>(&y, None, Reduction::Mean, -100)?;
                opt.zero_grad()?;
                accelerator.backward(&loss)?;
                opt.step()?;
            }
            epoch += 1;
        }
    })();
    if __accel_result.is_ok() {
        accelerator.attribute_summon().and_then(|_| __accel_exit.finish())?;
    }
    __accel_result
}
pub fn run(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    train(data).map_err(|e| anyhow::anyhow!("{e}"))
}
