//! `fn main` itself, returning `()`, with tch's `Iter2` and `backward_step`; warning-free.
#![deny(warnings)]

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

#[accel_core::accelerate(accumulate = 2, seed = 1, cpu = true)]
fn main() {
    let device = Device::cuda_if_available();
    let x = Tensor::randn([40, 3], (Kind::Float, Device::Cpu));
    let y = x.sum_dim_intlist([1i64].as_slice(), true, Kind::Float);
    let vs = nn::VarStore::new(device);
    let net = nn::linear(vs.root() / "lin", 3, 1, Default::default());
    let mut opt = nn::Sgd::default().build(&vs, 0.05).unwrap();
    for (xb, yb) in tch::data::Iter2::new(&x, &y, 8) {
        let loss = net.forward(&xb).mse_loss(&yb, tch::Reduction::Mean);
        opt.backward_step(&loss);
    }
    assert_eq!(accelerator.counters().micro_steps_total, 5);
    assert_eq!(accelerator.counters().optimizer_steps, 3, "windows 2, 2 and a short 1");
}
