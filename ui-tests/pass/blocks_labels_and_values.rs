//! The training loop in the value of a block, behind a label, in an `if let` chain and an
//! `unsafe` block; `break` with a value out of the labeled block.
#![deny(warnings)]

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Tensor};

use crate::common::{Data, mlp, weights};

#[accel_core::accelerate(strategy = "ddp", cpu = true)]
fn train(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    let vs = nn::VarStore::new(Device::Cpu);
    let net = mlp(&vs.root());
    let mut opt = nn::Adam::default().build(&vs, 1e-2)?;
    let limit = if data.epochs > 0 { Some(data.epochs) } else { None };
    let steps = 'run: {
        let Some(epochs) = limit else { break 'run 0usize };
        let mut steps = 0;
        if let Some(_first) = data.batches().first() {
            // SAFETY: nothing unsafe; the block is here to be searched.
            #[allow(unused_unsafe)]
            unsafe {
                for _ in 0..epochs {
                    'batches: for (x, y) in data.batches() {
                        let loss = net.forward(&x).cross_entropy_for_logits(&y);
                        opt.zero_grad();
                        loss.backward();
                        opt.step();
                        steps += 1;
                        continue 'batches;
                    }
                }
            }
        } else if epochs > 1000 {
            break 'run 0;
        }
        steps
    };
    anyhow::ensure!(steps > 0 || data.epochs == 0);
    Ok(weights(&vs, ""))
}

pub fn run(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    train(data)
}
