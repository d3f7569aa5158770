//! moe_unused.rs without `find_unused_parameters`: on 2 processes the first step where a
//! process's batch holds no seven stops the run, the message naming the key to set.
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

use crate::data;

#[accel_core::accelerate(strategy = "ddp")]
fn train() -> anyhow::Result<()> {
    let d = data::load()?;
    let vs = nn::VarStore::new(Device::Cpu);
    let root = vs.root();
    let trunk = nn::linear(&root / "trunk", 64, 32, Default::default());
    let experts = [
        nn::linear(&root / "expert_a", 32, 10, Default::default()),
        nn::linear(&root / "expert_b", 32, 10, Default::default()),
    ];
    let mut opt = nn::Sgd::default().build(&vs, 0.1)?;
    for _ in 0..2 {
        for (x, y) in data::batches(&d, data::batch_size()) {
            let hidden = trunk.forward(&x).relu();
            let sevens = y.eq(7);
            let mut logits = Tensor::zeros([x.size()[0], 10], (Kind::Float, Device::Cpu));
            for (k, expert) in experts.iter().enumerate() {
                let routed = if k == 1 { sevens.shallow_clone() } else { sevens.logical_not() };
                let rows = routed.nonzero().squeeze_dim(1);
                if rows.numel() > 0 {
                    let out = expert.forward(&hidden.index_select(0, &rows));
                    logits = logits.index_add(0, &rows, &out);
                }
            }
            let loss = logits.cross_entropy_for_logits(&y);
            opt.zero_grad();
            loss.backward();
            opt.step();
        }
    }
    Ok(())
}

pub fn run() -> anyhow::Result<()> {
    tch::manual_seed(0);
    train()
}
