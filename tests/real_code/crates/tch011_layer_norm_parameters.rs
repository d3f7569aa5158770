//! From the crates.io package tch 0.11.0 (`tch-0.11.0.crate`): `tests/nn_tests.rs`
//! (`layer_norm_parameters_test`), MIT or Apache-2.0 (`Cargo.toml`:
//! `license = "MIT/Apache-2.0"`; licenses/tch-0.11.0-LICENSE-MIT,
//! licenses/tch-0.11.0-LICENSE-APACHE).
//!
//! The loop: a layer norm fitted on two rows (full batch) by SGD with learning rate 1, the
//! optimizer built **before** the layer exists (`build(&vs, 1.0)`, then `layer_norm(..)`);
//! 49 `opt.backward_step(&loss)`; an assertion that the loss fell; the weights reset in place
//! under `no_grad` and the initial loss checked again.
//!
//! Changed: nothing but tch 0.24 names (`Tensor::from_slice` for `of_slice`,
//! `f64::try_from(..).unwrap()` for `f64::from`, `nn::layer_norm`); `#[test]` dropped
//! (called by `run`). The data is the test's own.
//!
//! Expected (`FailsEverywhere`): as `tch011_optimizer_test.rs` — accel's optimizer is built
//! over the variables that exist at `build` (none), so its first step stops on 1 process with
//! "created after the optimizer was built"; on 2 processes the full-batch loop is stopped
//! earlier with "computed the same loss".
use tch::nn::OptimizerConfig;
use tch::{nn, Device, Kind, Reduction, Tensor};

#[accel_core::accelerate(strategy = "ddp")]
fn layer_norm_parameters_test() {
    tch::manual_seed(42);
    // Create some linear data.
    let xs = Tensor::from_slice(&[42.0, 42.0, 42.0, 24.0]).to_kind(Kind::Float).view([-1, 2]);
    let ys = &xs * 0.42 + 1.337;

    // Fit a layer normalization layer (with deterministic initialization) on the data.
    let vs = nn::VarStore::new(Device::Cpu);
    let mut opt = nn::Sgd::default().build(&vs, 1.0).unwrap();
    let mut ln = nn::layer_norm(vs.root(), vec![2], Default::default());

    let loss = xs.apply(&ln).mse_loss(&ys, Reduction::Mean);
    let initial_loss = f64::try_from(&loss).unwrap();
    assert!(initial_loss > 1.0, "{}", "initial loss {initial_loss}");

    // Optimization loop.
    for _idx in 1..50 {
        let loss = xs.apply(&ln).mse_loss(&ys, Reduction::Mean);
        opt.backward_step(&loss);
    }
    let loss = xs.apply(&ln).mse_loss(&ys, Reduction::Mean);
    let final_loss = f64::try_from(loss).unwrap();
    assert!(final_loss < 0.25, "{}", "final loss {final_loss:?}");

    //     Reset the weights to their initial values.
    tch::no_grad(|| {
        if let Some(ws) = &mut ln.ws {
            ws.init(nn::Init::Const(1.));
        }
        if let Some(bs) = &mut ln.bs {
            bs.init(nn::Init::Const(0.));
        }
    });
    let initial_loss2 = f64::try_from(xs.apply(&ln).mse_loss(&ys, Reduction::Mean)).unwrap();
    assert_eq!(initial_loss, initial_loss2)
}

pub fn run() -> anyhow::Result<()> {
    layer_norm_parameters_test();
    Ok(())
}
