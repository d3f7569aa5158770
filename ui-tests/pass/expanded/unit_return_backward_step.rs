//! A function returning `()` (failures panic with their message), tch's `Iter2` and
//! `backward_step`, accumulation over 2 batches, the accelerator's counters.
#![deny(warnings)]
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Tensor};
use crate::common::{Data, mlp, weights};
fn train(vs: &nn::VarStore, data: &Data) {
    let accelerator = ::accel_core::Accelerator::builder()
        .strategy(::accel_core::Strategy::Ddp)
        .accumulate(2)
        .cpu(true)
        .attribute_data_loops(1usize)
        .attribute_call(concat!("`train`", " at ", file!(), ":", line!()))
        .build()
        .unwrap_or_else(|e| panic!("accel: {e}"));
    let __accel_exit = accelerator.exit_guard();
    let __accel_result: ::core::result::Result<(), ::accel_core::Error> = (|| {
        use Device as _;
        use OptimizerConfig as _;
        let device = accelerator.device();
        let (x, y): (Vec<Tensor>, Vec<Tensor>) = data.batches().into_iter().unzip();
        let (x, y) = (
            Tensor::cat(&x, 0).to_device(device),
            Tensor::cat(&y, 0).to_device(device),
        );
        let net = mlp(&vs.root());
        let mut opt = accelerator.build_optimizer(nn::Sgd::default(), vs, 0.1).unwrap();
        for _ in 0..data.epochs {
            for (xb, yb) in accelerator
                .prepare_iter(tch::data::Iter2::new(&x, &y, data.batch_size))
            {
                let __accel_autocast = accelerator.autocast_step()?;
                let loss = net.forward(&xb).cross_entropy_for_logits(&yb);
                opt.backward_step(&loss)?;
            }
        }
        let per_epoch = 128 / data.batch_size as u64
            / accelerator.num_processes() as u64;
        assert_eq!(
            accelerator.counters().optimizer_steps, data.epochs as u64 * per_epoch / 2
        );
        ::core::result::Result::Ok(())
    })();
    if let Err(e) = __accel_result
        .and_then(|()| {
            accelerator.attribute_summon().and_then(|_| __accel_exit.finish())
        })
    {
        panic!("accel: {e}");
    }
}
pub fn run(data: &Data) -> anyhow::Result<Vec<(String, Tensor)>> {
    let vs = nn::VarStore::new(Device::Cpu);
    train(&vs, data);
    Ok(weights(&vs, ""))
}
