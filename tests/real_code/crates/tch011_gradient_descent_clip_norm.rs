//! From the crates.io package tch 0.11.0 (`tch-0.11.0.crate`): `tests/nn_tests.rs`
//! (`gradient_descent_test_clip_norm`, with `my_module`), MIT or Apache-2.0 (`Cargo.toml`:
//! `license = "MIT/Apache-2.0"`; licenses/tch-0.11.0-LICENSE-MIT,
//! licenses/tch-0.11.0-LICENSE-APACHE).
//!
//! The loop: `my_module` (`xs * x1 + exp(xs) * x2` over two zero vectors), SGD built after
//! it, then 49 `opt.backward_step_clip_norm(&loss, 0.1)` on a squared error against ones,
//! from zero inputs made inside the loop.
//!
//! Changed: nothing but tch 0.24 names (sizes as arrays); `#[test]` dropped (called by `run`).
//!
//! Expected (`FailsOnTwo`): runs on 1 process, the clipping taken over by the accelerator
//! (the attribute turns `backward_step_clip_norm` into a backward, a clip of the averaged
//! gradients and a step). The loop counts and makes its own batch; on 2 processes every
//! process computes the same first loss (7): "computed the same loss".
use tch::nn::{Module, OptimizerConfig};
use tch::{kind, nn, Device, Kind, Tensor};

fn my_module(p: nn::Path, dim: i64) -> impl nn::Module {
    let x1 = p.zeros("x1", &[dim]);
    let x2 = p.zeros("x2", &[dim]);
    nn::func(move |xs| xs * &x1 + xs.exp() * &x2)
}

#[accel_core::accelerate(strategy = "ddp")]
fn gradient_descent_test_clip_norm() {
    let vs = nn::VarStore::new(Device::Cpu);
    let my_module = my_module(vs.root(), 7);
    let mut opt = nn::Sgd::default().build(&vs, 1e-2).unwrap();
    for _idx in 1..50 {
        let xs = Tensor::zeros([7], kind::FLOAT_CPU);
        let ys = Tensor::ones([7], kind::FLOAT_CPU);
        let loss = (my_module.forward(&xs) - ys).pow_tensor_scalar(2).sum(Kind::Float);
        opt.backward_step_clip_norm(&loss, 0.1);
    }
}

pub fn run() -> anyhow::Result<()> {
    gradient_descent_test_clip_norm();
    Ok(())
}
