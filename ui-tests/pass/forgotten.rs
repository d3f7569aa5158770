//! The explicit API used without one of its `prepare_*` calls: with several processes each
//! of these trains one model per process unless the accelerator refuses, which it must.

use accel_core::Accelerator;
use accel_core::optim::{AdamConfig, AdamW, Optimizer, named_params};
use tch::Device;
use tch::nn::{self, Module};

use crate::common::{Data, mlp};

/// Runs case `name` over 2 epochs of `data`; every case must fail.
pub fn run(name: &str, data: &Data) -> anyhow::Result<()> {
    let acc = Accelerator::builder().cpu(true).build()?;
    let vs = nn::VarStore::new(Device::Cpu);
    let net = mlp(&vs.root());
    let config = AdamConfig { lr: 1e-2, ..AdamConfig::adamw() };
    match name {
        // The optimizer is prepared, the model never is.
        "prepare_model" => {
            let mut opt = acc.prepare_optimizer(AdamW::new(named_params(&vs), config)?);
            for (x, y) in acc.prepare_iter(data.batches()) {
                acc.backward(&net.forward(&x).cross_entropy_for_logits(&y))?;
                opt.step()?;
            }
        }
        // The model is prepared, the optimizer is stepped as it was built.
        "prepare_optimizer" => {
            acc.prepare_model(&vs)?;
            let mut opt = AdamW::new(named_params(&vs), config)?;
            for (x, y) in acc.prepare_iter(data.batches()) {
                acc.backward(&net.forward(&x).cross_entropy_for_logits(&y))?;
                opt.step()?;
            }
        }
        // Another model is prepared; the one trained is not.
        "the_trained_model" => {
            let other = nn::VarStore::new(Device::Cpu);
            let _ = mlp(&other.root());
            acc.prepare_model(&other)?;
            let mut opt = acc.prepare_optimizer(AdamW::new(named_params(&vs), config)?);
            for (x, y) in acc.prepare_iter(data.batches()) {
                acc.backward(&net.forward(&x).cross_entropy_for_logits(&y))?;
                opt.step()?;
            }
        }
        other => anyhow::bail!("no case {other}"),
    }
    acc.wait_for_everyone()?;
    Ok(())
}
