//! The explicit API used without one of its `prepare_*` calls, or with a model that does not
//! fit the run's parallelism: with several processes each of these trains one model per
//! process (or repeats the same work on each) unless the accelerator refuses, which it must.

use accel_core::Accelerator;
use accel_core::optim::{AdamConfig, AdamW, Optimizer, named_params};
use tch::Device;
use tch::nn::{self, Module};

use crate::common::{Data, mlp};

/// Runs case `name` over 2 epochs of `data`; every case must fail.
pub fn run(name: &str, data: &Data) -> anyhow::Result<()> {
    let builder = Accelerator::builder().cpu(true);
    let acc = match name {
        "tensor_parallel_of_ordinary_layers" => builder.tensor_parallel(2),
        "backward_outside_the_pipeline" => builder.pipeline_parallel(2),
        "variables_released_by_zero3" | "gradients_read_by_hand_zero3" => {
            builder.strategy(accel_core::Strategy::Zero3)
        }
        "gradients_read_by_hand_zero2" => builder.strategy(accel_core::Strategy::Zero2),
        "gradients_read_by_hand_accumulating" => {
            builder.strategy(accel_core::Strategy::Zero2).accumulate(2)
        }
        _ => builder,
    }
    .build()?;
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
        // Model and optimizer prepared, the batches taken as they are: every process
        // would train on all of them.
        "prepare_data" => {
            acc.prepare_model(&vs)?;
            let mut opt = acc.prepare_optimizer(AdamW::new(named_params(&vs), config)?);
            for (x, y) in data.batches() {
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
        // Two tensor ranks, and a model of ordinary layers: both would compute all of it.
        "tensor_parallel_of_ordinary_layers" => acc.prepare_model(&vs)?,
        // Two pipeline stages, each running the whole model's backward on its own.
        "backward_outside_the_pipeline" => {
            acc.prepare_model(&vs)?;
            for (x, y) in acc.prepare_iter(data.batches()) {
                acc.backward(&net.forward(&x).cross_entropy_for_logits(&y))?;
            }
        }
        // zero3 releases a wrapped layer's parameters between uses: reading them as tch's
        // `vs.variables()` would read memory that is not there (the attribute turns
        // `vs.variables()` into this call).
        "variables_released_by_zero3" => {
            let wrapped = nn::VarStore::new(Device::Cpu);
            let p = wrapped.root() / "layers" / 0;
            let layer = accel_core::Unit::new(&acc, &p, nn::linear(&p, 6, 3, Default::default()));
            acc.prepare_model(&wrapped)?;
            let mut opt = acc.prepare_optimizer(AdamW::new(named_params(&wrapped), config)?);
            for (x, y) in acc.prepare_iter(data.batches()) {
                acc.backward(&layer.forward(&x).cross_entropy_for_logits(&y))?;
                opt.step()?;
            }
            let _ = acc.variables(&wrapped);
        }
        // Gradients clipped by hand between backward and step: under zero2/zero3 they live in
        // the shards, and reading one from the parameter is refused, naming the fix (never a
        // silent skip at `grad.defined()`).
        "gradients_read_by_hand_zero2"
        | "gradients_read_by_hand_zero3"
        | "gradients_read_by_hand_accumulating" => {
            let wrapped = nn::VarStore::new(Device::Cpu);
            let p = wrapped.root() / "layers" / 0;
            let layer = accel_core::Unit::new(&acc, &p, nn::linear(&p, 6, 3, Default::default()));
            acc.prepare_model(&wrapped)?;
            let mut opt = acc.prepare_optimizer(AdamW::new(named_params(&wrapped), config)?);
            for (x, y) in acc.prepare_iter(data.batches()) {
                acc.backward(&layer.forward(&x).cross_entropy_for_logits(&y))?;
                let mut total = 0.0;
                for v in wrapped.trainable_variables() {
                    let g = v.grad();
                    if g.defined() {
                        total += g.f_square()?.f_sum(tch::Kind::Float)?.f_double_value(&[])?;
                    }
                }
                anyhow::ensure!(total > 0.0, "the gradients read nothing ({total})");
                opt.step()?;
                opt.zero_grad()?;
            }
        }
        other => anyhow::bail!("no case {other}"),
    }
    acc.wait_for_everyone()?;
    Ok(())
}
