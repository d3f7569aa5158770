//! An owned VarStore, `Box<dyn Error>`, and a `while let` loop over an iterator.
#![deny(warnings)]
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};
fn train(
    vs: nn::VarStore,
    data: Vec<Tensor>,
) -> Result<f64, Box<dyn std::error::Error>> {
    let accelerator = ::accel_core::Accelerator::builder()
        .accumulate(3u32)
        .cpu(true)
        .build()?;
    let __accel_exit = accelerator.exit_guard();
    let __accel_result: Result<f64, Box<dyn std::error::Error>> = (|| {
        use OptimizerConfig as _;
        let net = nn::linear(vs.root() / "lin", 2, 1, Default::default());
        let mut opt = accelerator
            .build_optimizer(
                nn::Sgd {
                    momentum: 0.9,
                    ..Default::default()
                },
                &vs,
                0.01,
            )?;
        let mut batches = accelerator.prepare_iter(data.into_iter());
        let mut last = 0.0;
        while let Some(x) = batches.next() {
            let __accel_autocast = accelerator.autocast()?;
            let loss = net.forward(&x).square().mean(Kind::Float);
            opt.zero_grad()?;
            drop(__accel_autocast);
            accelerator.backward(&loss)?;
            opt.step()?;
            last = loss.double_value(&[]);
        }
        Ok(last)
    })();
    if __accel_result.is_ok() {
        __accel_exit.finish()?;
    }
    __accel_result
}
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let vs = nn::VarStore::new(Device::Cpu);
    let data = (0..4)
        .map(|_| Tensor::ones([4, 2], (Kind::Float, Device::Cpu)))
        .collect::<Vec<_>>();
    assert!(train(vs, data) ?.is_finite());
    Ok(())
}
