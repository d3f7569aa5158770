//! From the crates.io package tch 0.11.0 (`tch-0.11.0.crate`): `tests/nn_tests.rs`
//! (`optimizer_test`), MIT or Apache-2.0 (`Cargo.toml`: `license = "MIT/Apache-2.0"`;
//! licenses/tch-0.11.0-LICENSE-MIT, licenses/tch-0.11.0-LICENSE-APACHE).
//!
//! The loops: a linear model fitted on 14 points (full batch) by SGD built with learning rate
//! 0 **before the layer exists** (`build(&vs, 0.)`, then `nn::linear(vs.root(), ..)`; tch's
//! optimizer adds variables created after `build` at its next step), `opt.set_lr(1e-2)`, a
//! first loop of 49 `opt.backward_step(&loss)`, an assertion that the loss fell below 0.25;
//! then the weights reset in place under `no_grad` (`linear.ws.init(..)`), `set_lr(1e-10)`,
//! a second loop, and an assertion that the loss did not move.
//!
//! Changed: nothing but tch 0.24 names (`Tensor::from_slice` for `of_slice`,
//! `f64::try_from(..).unwrap()` for `f64::from`); `#[test]` dropped (called by `run`). The
//! data is the test's own.
//!
//! Expected (`FailsEverywhere`): `build` becomes
//! `accelerator.build_optimizer(nn::Sgd::default(), &vs, 0.)`, which prepares the VarStore
//! and builds accel's SGD over the variables it holds **then**: none, since the linear layer
//! is created on the next line. tch's `nn::Optimizer` adds late variables at its next step
//! (`add_missing_variables`); accel's optimizer does not (a variable appearing after the
//! model was prepared was never sharded, broadcast or bucketed), so its first `step` stops
//! on 1 process with "trainable variable(s) were created after the optimizer was built"
//! and says to build the optimizer after the model. On 2 processes the first loop (it counts;
//! the batch is the same full batch on every process) is stopped before that, at its first
//! step, with "computed the same loss".
use tch::nn::OptimizerConfig;
use tch::{nn, Device, Kind, Reduction, Tensor};

#[accel_core::accelerate(strategy = "ddp")]
fn optimizer_test() {
    tch::manual_seed(42);
    // Create some linear data.
    let xs = Tensor::from_slice(&(1..15).collect::<Vec<_>>()).to_kind(Kind::Float).view([-1, 1]);
    let ys = &xs * 0.42 + 1.337;

    // Fit a linear model (with deterministic initialization) on the data.
    let vs = nn::VarStore::new(Device::Cpu);
    let mut opt = nn::Sgd::default().build(&vs, 0.).unwrap();
    let cfg = nn::LinearConfig {
        ws_init: nn::Init::Const(0.),
        bs_init: Some(nn::Init::Const(0.)),
        bias: true,
    };
    let mut linear = nn::linear(vs.root(), 1, 1, cfg);

    let loss = xs.apply(&linear).mse_loss(&ys, Reduction::Mean);
    let initial_loss = f64::try_from(&loss).unwrap();
    assert!(initial_loss > 1.0, "{}", "initial loss {initial_loss}");

    opt.set_lr(1e-2);
    // Optimization loop.
    for _idx in 1..50 {
        let loss = xs.apply(&linear).mse_loss(&ys, Reduction::Mean);
        opt.backward_step(&loss);
    }
    let loss = xs.apply(&linear).mse_loss(&ys, Reduction::Mean);
    let final_loss = f64::try_from(loss).unwrap();
    assert!(final_loss < 0.25, "{}", "final loss {final_loss}");

    // Reset the weights to their initial values.
    tch::no_grad(|| {
        linear.ws.init(nn::Init::Const(0.));
        linear.bs.as_mut().unwrap().init(nn::Init::Const(0.));
    });
    let initial_loss2 = f64::try_from(xs.apply(&linear).mse_loss(&ys, Reduction::Mean)).unwrap();
    assert_eq!(initial_loss, initial_loss2);

    // Set the learning-rate to be very small and check that the loss does not change
    // much.
    opt.set_lr(1e-10);
    for _idx in 1..50 {
        let loss = xs.apply(&linear).mse_loss(&ys, Reduction::Mean);
        opt.backward_step(&loss);
    }
    let loss = xs.apply(&linear).mse_loss(&ys, Reduction::Mean);
    let final_loss = f64::try_from(loss).unwrap();
    assert!((final_loss - initial_loss) < 1e-5, "{}", "final loss {final_loss}")
}

pub fn run() -> anyhow::Result<()> {
    optimizer_test();
    Ok(())
}
