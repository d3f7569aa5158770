//! `fn main` itself, returning `()`, with tch's `Iter2` and `backward_step`; warning-free.
#![deny(warnings)]
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};
fn main() {
    let accelerator = ::accel_core::Accelerator::builder()
        .accumulate(2u32)
        .seed(1u64)
        .cpu(true)
        .build()
        .unwrap_or_else(|e| panic!("accel: {e}"));
    let __accel_exit = accelerator.exit_guard();
    let __accel_result: ::core::result::Result<(), ::accel_core::Error> = (|| {
        use OptimizerConfig as _;
        let device = accelerator.device();
        let x = Tensor::randn([40, 3], (Kind::Float, Device::Cpu));
        let y = x.sum_dim_intlist([1i64].as_slice(), true, Kind::Float);
        let vs = nn::VarStore::new(device);
        let net = nn::linear(vs.root() / "lin", 3, 1, Default::default());
        let mut opt = accelerator
            .build_optimizer(nn::Sgd::default(), &vs, 0.05)
            .unwrap();
        for (xb, yb) in accelerator.prepare_iter(tch::data::Iter2::new(&x, &y, 8)) {
            let __accel_autocast = accelerator.autocast()?;
            let loss = net.forward(&xb).mse_loss(&yb, tch::Reduction::Mean);
            drop(__accel_autocast);
            {
                opt.zero_grad()?;
                accelerator.backward(&loss)?;
                opt.step()?
            };
        }
        assert_eq!(accelerator.counters().micro_steps_total, 5);
        assert_eq!(
            accelerator.counters().optimizer_steps, 3, "windows 2, 2 and a short 1"
        );
        ::core::result::Result::Ok(())
    })();
    if let Err(e) = __accel_result.and_then(|()| __accel_exit.finish()) {
        panic!("accel: {e}");
    }
}
