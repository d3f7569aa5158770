//! From the crates.io package tch 0.11.0 (`tch-0.11.0.crate`): `tests/var_store.rs`
//! (`param_group_weight_decay`), MIT or Apache-2.0 (`Cargo.toml`:
//! `license = "MIT/Apache-2.0"`; licenses/tch-0.11.0-LICENSE-MIT,
//! licenses/tch-0.11.0-LICENSE-APACHE).
//!
//! The loops: SGD built with learning rate 0 (then `set_lr(0.1)`) **before** two scalar
//! variables are made in parameter groups 0 and 7; three loops of 99 `opt.backward_step` on
//! `(foo + bar - 1)^2`, with `set_weight_decay(0.1)` and then `set_weight_decay_group(7, 0.)`
//! between them, and assertions on the variables' values after each.
//!
//! Changed: nothing but tch 0.24 names (`f64::try_from(..).unwrap()` for `f64::from`, sizes
//! as arrays); `#[test]` dropped (called by `run`).
//!
//! Expected (`FailsEverywhere`): as `tch011_optimizer_test.rs` — the variables are made after
//! the optimizer, so its first step stops on 1 process with "created after the optimizer was
//! built"; on 2 processes the first loop (full batch, drawn) is stopped earlier with "computed
//! the same loss".
use tch::nn::{OptimizerConfig, VarStore};
use tch::{Device, Tensor};

#[accel_core::accelerate(strategy = "ddp")]
fn param_group_weight_decay() {
    tch::manual_seed(42);
    let vs = VarStore::new(Device::Cpu);
    let mut opt = tch::nn::Sgd::default().build(&vs, 0.0).unwrap();
    opt.set_lr(0.1);
    let root = vs.root();
    let var_foo = root.set_group(0).zeros("var_foo", &[]);
    let var_bar = root.set_group(7).zeros("var_bar", &[]);
    for _idx in 1..100 {
        let loss = (&var_foo + &var_bar).mse_loss(&Tensor::from(1f32), tch::Reduction::Mean);
        opt.backward_step(&loss);
    }
    assert_eq!(format!("{:.2}", f64::try_from(&var_foo).unwrap()), "0.50");
    assert_eq!(format!("{:.2}", f64::try_from(&var_bar).unwrap()), "0.50");
    opt.set_weight_decay(0.1);
    for _idx in 1..100 {
        let loss = (&var_foo + &var_bar).mse_loss(&Tensor::from(1f32), tch::Reduction::Mean);
        opt.backward_step(&loss);
    }
    assert_eq!(format!("{:.2}", f64::try_from(&var_foo).unwrap()), "0.49");
    assert_eq!(format!("{:.2}", f64::try_from(&var_bar).unwrap()), "0.49");
    opt.set_weight_decay_group(7, 0.);
    for _idx in 1..100 {
        let loss = (&var_foo + &var_bar).mse_loss(&Tensor::from(1f32), tch::Reduction::Mean);
        opt.backward_step(&loss);
    }
    assert_eq!(format!("{:.2}", f64::try_from(&var_foo).unwrap()), "0.30");
    assert_eq!(format!("{:.2}", f64::try_from(&var_bar).unwrap()), "0.69");
}

pub fn run() -> anyhow::Result<()> {
    param_group_weight_decay();
    Ok(())
}
