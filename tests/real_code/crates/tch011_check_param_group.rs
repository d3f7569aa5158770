//! From the crates.io package tch 0.11.0 (`tch-0.11.0.crate`): `tests/var_store.rs`
//! (`check_param_group`, called by the test `param_group`), MIT or Apache-2.0
//! (`Cargo.toml`: `license = "MIT/Apache-2.0"`; licenses/tch-0.11.0-LICENSE-MIT,
//! licenses/tch-0.11.0-LICENSE-APACHE).
//!
//! The loops: an optimizer over two parameter groups (`root.set_group(0)` and
//! `root.set_group(7)`) is passed **by value** to a function that runs five loops of 99
//! `opt.backward_step(&loss)` on the two scalar variables, changing the learning rate of one
//! group or of all between loops (`set_lr_group(0, 0.)`, `set_lr_group(7, 0.)`, `set_lr(..)`)
//! and asserting the variables' values after each.
//!
//! Changed: only tch 0.24 names (`f64::try_from(..).unwrap()` for `f64::from`); `#[test]`
//! dropped, the test's body is `run`. The data is the test's own.
//!
//! Expected: **Refused { line: 27, says: "is passed in" }**, at `mut opt` in the signature:
//! "`opt` is stepped in the training loop, but it is passed in, so #[accelerate] cannot see
//! which model it trains" (docs/attribute.md: an optimizer passed in as an argument is
//! refused unless the model is named with `model = vs`; here no VarStore is in scope to
//! name, only two tensors). Were it accepted (the VarStore passed and named), the loops
//! (full batch, counted) would stop on 2 processes with "computed the same loss"; and as in
//! tch011_optimizer_test.rs the optimizer is built before its variables exist, which tch's
//! own optimizer absorbs when it is driven.
use tch::nn::{OptimizerConfig, VarStore};
use tch::{Device, Tensor};

#[accel_core::accelerate(strategy = "ddp")]
fn check_param_group(mut opt: tch::nn::Optimizer, var_foo: Tensor, var_bar: Tensor) {
    opt.set_lr(0.1);
    opt.set_lr_group(0, 0.);
    for _idx in 1..100 {
        let loss = (&var_foo + &var_bar).mse_loss(&Tensor::from(0.42f32), tch::Reduction::Mean);
        opt.backward_step(&loss);
    }
    assert_eq!(format!("{:.2}", f64::try_from(&var_foo).unwrap()), "0.00");
    assert_eq!(format!("{:.2}", f64::try_from(&var_bar).unwrap()), "0.42");
    opt.set_lr_group(0, 0.1);
    for _idx in 1..100 {
        let loss = (&var_foo + &var_bar).mse_loss(&Tensor::from(0f32), tch::Reduction::Mean);
        opt.backward_step(&loss);
    }
    assert_eq!(format!("{:.2}", f64::try_from(&var_foo).unwrap()), "-0.21");
    assert_eq!(format!("{:.2}", f64::try_from(&var_bar).unwrap()), "0.21");
    opt.set_lr_group(7, 0.);
    for _idx in 1..100 {
        let loss = (&var_foo + &var_bar).mse_loss(&Tensor::from(0.22f32), tch::Reduction::Mean);
        opt.backward_step(&loss);
    }
    assert_eq!(format!("{:.2}", f64::try_from(&var_foo).unwrap()), "0.01");
    assert_eq!(format!("{:.2}", f64::try_from(&var_bar).unwrap()), "0.21");
    // The following sets the learning rate for both groups.
    opt.set_lr(0.);
    for _idx in 1..100 {
        let loss = (&var_foo + &var_bar).mse_loss(&Tensor::from(0.42f32), tch::Reduction::Mean);
        opt.backward_step(&loss);
    }
    assert_eq!(format!("{:.2}", f64::try_from(&var_foo).unwrap()), "0.01");
    assert_eq!(format!("{:.2}", f64::try_from(&var_bar).unwrap()), "0.21");
    opt.set_lr(0.1);
    for _idx in 1..100 {
        let loss = (&var_foo + &var_bar).mse_loss(&Tensor::from(0.42f32), tch::Reduction::Mean);
        opt.backward_step(&loss);
    }
    assert_eq!(format!("{:.2}", f64::try_from(&var_foo).unwrap()), "0.11");
    assert_eq!(format!("{:.2}", f64::try_from(&var_bar).unwrap()), "0.31");
}

pub fn run() -> anyhow::Result<()> {
    tch::manual_seed(42);
    let vs = VarStore::new(Device::Cpu);
    let opt = tch::nn::Sgd::default().build(&vs, 1.0)?;
    let root = vs.root();
    let var_foo = root.set_group(0).zeros("var_foo", &[]);
    let var_bar = root.set_group(7).zeros("var_bar", &[]);
    check_param_group(opt, var_foo, var_bar);
    Ok(())
}
