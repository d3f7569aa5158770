//! Checkpoint and resume inside an epoch (Accelerate's by_feature/checkpointing.py):
//! `STOP_AFTER=N` saves the state after N batches and stops; a run with `CHECKPOINT=dir`
//! and no `STOP_AFTER` resumes from it — the epoch from `accelerator.resumed_epoch()`, the
//! position inside it by itself.
use tch::nn::{self, Module, OptimizerConfig};
use tch::Device;

use crate::data;

#[accel_core::accelerate(strategy = "ddp")]
fn train() -> anyhow::Result<()> {
    let d = data::load()?;
    let vs = nn::VarStore::new(Device::Cpu);
    let net = data::mlp(&vs.root());
    let mut opt = nn::Adam::default().build(&vs, 1e-2)?;
    let checkpoint = std::env::var("CHECKPOINT").ok();
    let stop_after: Option<u64> = std::env::var("STOP_AFTER").ok().and_then(|v| v.parse().ok());
    if let (Some(dir), None) = (&checkpoint, stop_after) {
        accelerator.load_state(dir)?;
    }
    let mut seen = 0;
    for _epoch in accelerator.resumed_epoch()..3 {
        for (x, y) in data::batches(&d, data::batch_size()) {
            let loss = net.forward(&x).cross_entropy_for_logits(&y);
            opt.zero_grad();
            loss.backward();
            opt.step();
            seen += 1;
            if let (Some(dir), Some(stop)) = (&checkpoint, stop_after) {
                if seen == stop {
                    accelerator.save_state(dir)?;
                    return Ok(());
                }
            }
        }
    }
    Ok(())
}

pub fn run() -> anyhow::Result<()> {
    tch::manual_seed(0);
    train()
}
