//! tch-rs's min-gpt shape: the training loop in a `match` arm, `backward_step_clip`, the
//! VarStore saved inside the loop with tch's `vs.save` (one file, written once, by the main
//! process) and loaded back with `vs.load` (by every process, into the prepared model).
#![deny(warnings)]
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Tensor};
use crate::common::{Data, mlp, weights};
fn train(data: &Data, mode: &str) -> anyhow::Result<Vec<(String, Tensor)>> {
    let accelerator = ::accel_core::Accelerator::builder()
        .strategy(::accel_core::Strategy::Ddp)
        .cpu(true)
        .attribute_data_loops(1usize)
        .attribute_call(concat!("`train`", " at ", file!(), ":", line!()))
        .build()?;
    let __accel_exit = accelerator.exit_guard();
    let __accel_result: anyhow::Result<Vec<(String, Tensor)>> = (|| {
        use OptimizerConfig as _;
        let mut vs = nn::VarStore::new(Device::Cpu);
        let net = mlp(&vs.root());
        let path = data.dir.join("net.safetensors");
        match mode {
            "train" => {
                let mut opt = accelerator
                    .build_optimizer(nn::AdamW::default(), &vs, 1e-2)?;
                let mut idx = 0;
                for _epoch in 0..data.epochs {
                    for (x, y) in accelerator.prepare_iter(data.batches()) {
                        let __accel_autocast = accelerator.autocast_step()?;
                        let loss = net.forward(&x).cross_entropy_for_logits(&y);
                        opt.backward_step_clip(&loss, 0.5)?;
                        idx += 1;
                        if let Err(err) = accelerator.save_varstore(&vs, &path) {
                            println!("error while saving {err}");
                        }
                    }
                }
                anyhow::ensure!(idx > 0 || data.epochs == 0);
                accelerator.attribute_summon()?;
                let trained = weights(&vs, "");
                accelerator.wait_for_everyone()?;
                if idx > 0 {
                    let missing = accelerator.load_varstore_partial(&mut vs, &path)?;
                    anyhow::ensure!(missing.is_empty(), "not in the file: {missing:?}");
                    for ((_, a), (_, b)) in trained.iter().zip(weights(&vs, "")) {
                        anyhow::ensure!(
                            a.equal(& b), "a weight changed on a save and load"
                        );
                    }
                }
            }
            "predict" => accelerator.load_varstore(&mut vs, &path)?,
            _ => anyhow::bail!("usage: train | predict"),
        };
        accelerator.attribute_summon()?;
        Ok(weights(&vs, ""))
    })();
    if __accel_result.is_ok() {
        accelerator.attribute_summon().and_then(|_| __accel_exit.finish())?;
    }
    __accel_result
}
pub fn run(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    train(data, "train")
}
