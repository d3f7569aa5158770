//! From the crates.io package tch 0.11.0 (`tch-0.11.0.crate`): `tests/nn_tests.rs`
//! (`gradient_descent_test`, with `my_module`), MIT or Apache-2.0 (`Cargo.toml`:
//! `license = "MIT/Apache-2.0"`; licenses/tch-0.11.0-LICENSE-MIT,
//! licenses/tch-0.11.0-LICENSE-APACHE).
//!
//! The loop: a module made by `nn::func` over two zero vectors of a VarStore path
//! (`xs * x1 + exp(xs) * x2`), SGD built after it, then 49 `opt.backward_step(&loss)` on a
//! squared error against zeros, from zero inputs made inside the loop.
//!
//! Changed: nothing but tch 0.24 names (sizes as arrays); `#[test]` dropped (called by `run`).
//!
//! Expected (`FailsOnTwo`): runs on 1 process. The loop counts and its body makes its own
//! (constant) batch, so it draws; on 2 processes every process computes the same first loss
//! (0, by construction: the output starts at zero and so does the target), stopped with
//! "computed the same loss", whose message names `data = "manual"` for losses equal by
//! construction.
use tch::nn::{Module, OptimizerConfig};
use tch::{kind, nn, Device, Kind, Tensor};

fn my_module(p: nn::Path, dim: i64) -> impl nn::Module {
    let x1 = p.zeros("x1", &[dim]);
    let x2 = p.zeros("x2", &[dim]);
    nn::func(move |xs| xs * &x1 + xs.exp() * &x2)
}

#[accel_core::accelerate(strategy = "ddp")]
fn gradient_descent_test() {
    let vs = nn::VarStore::new(Device::Cpu);
    let my_module = my_module(vs.root(), 7);
    let mut opt = nn::Sgd::default().build(&vs, 1e-2).unwrap();
    for _idx in 1..50 {
        let xs = Tensor::zeros([7], kind::FLOAT_CPU);
        let ys = Tensor::zeros([7], kind::FLOAT_CPU);
        let loss = (my_module.forward(&xs) - ys).pow_tensor_scalar(2).sum(Kind::Float);
        opt.backward_step(&loss);
    }
}

pub fn run() -> anyhow::Result<()> {
    gradient_descent_test();
    Ok(())
}
