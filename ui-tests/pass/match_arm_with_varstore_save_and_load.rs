//! tch-rs's min-gpt shape: the training loop in a `match` arm, `backward_step_clip`, the
//! VarStore saved inside the loop with tch's `vs.save` (one file, written once, by the main
//! process) and loaded back with `vs.load` (by every process, into the prepared model).
#![deny(warnings)]

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Tensor};

use crate::common::{Data, mlp, weights};

#[accel_core::accelerate(strategy = "ddp", cpu = true)]
fn train(data: &Data, mode: &str) -> anyhow::Result<Vec<(String, Tensor)>> {
    let mut vs = nn::VarStore::new(Device::Cpu);
    let net = mlp(&vs.root());
    let path = data.dir.join("net.safetensors");
    match mode {
        "train" => {
            let mut opt = nn::AdamW::default().build(&vs, 1e-2)?;
            let mut idx = 0;
            for _epoch in 0..data.epochs {
                for (x, y) in data.batches() {
                    let loss = net.forward(&x).cross_entropy_for_logits(&y);
                    opt.backward_step_clip(&loss, 0.5);
                    idx += 1;
                    if let Err(err) = vs.save(&path) {
                        println!("error while saving {err}");
                    }
                }
            }
            anyhow::ensure!(idx > 0 || data.epochs == 0);
            // The weights come back from the file on every process.
            let trained = weights(&vs, "");
            accelerator.wait_for_everyone()?;
            if idx > 0 {
                let missing = vs.load_partial(&path)?;
                anyhow::ensure!(missing.is_empty(), "not in the file: {missing:?}");
                for ((_, a), (_, b)) in trained.iter().zip(weights(&vs, "")) {
                    anyhow::ensure!(a.equal(&b), "a weight changed on a save and load");
                }
            }
        }
        "predict" => vs.load(&path)?,
        _ => anyhow::bail!("usage: train | predict"),
    };
    Ok(weights(&vs, ""))
}

pub fn run(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    train(data, "train")
}
