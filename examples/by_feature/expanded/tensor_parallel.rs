//! By feature: tensor parallelism. `tensor_parallel = 2` splits each model replica over 2
//! processes, Megatron-style: the first layer's output features (column-parallel) and the
//! second's input features (row-parallel) are cut in two, so each process holds and computes
//! half of the hidden layer, and one all-reduce per layer joins the halves. The model must be
//! built from the tensor-parallel layers (`accelerator.tensor_parallel()`); a model of
//! ordinary layers is refused, as it would only repeat the same work on every rank.
//!
//! The check: the same MLP trained whole in one process, from the same initial weights on
//! the same batches, ends with the weights the split run puts back together.
//!
//!     cargo build -p accel-examples --example tensor_parallel
//!     accel launch --num-processes 2 --cpu target/debug/examples/tensor_parallel
use accel_core::strategy::tp::{ColumnParallelLinear, LinearOptions, RowParallelLinear};
use accel_examples::Digits;
use anyhow::Result;
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Tensor};
const HIDDEN: i64 = 32;
const EPOCHS: usize = 2;
/// 64 → 32 → 10 whole, the reference; its initial weights are handed to the split run.
fn whole_mlp(vs: &nn::VarStore) -> (nn::Linear, nn::Linear) {
    let up = nn::linear(vs.root() / "up", 64, HIDDEN, Default::default());
    let down = nn::linear(vs.root() / "down", HIDDEN, 10, Default::default());
    (up, down)
}
fn train(data: &Digits, init: &nn::VarStore) -> Result<Vec<(String, Tensor)>> {
    let acc = ::accel_core::Accelerator::builder()
        .seed(0)
        .cpu(true)
        .tensor_parallel(2)
        .attribute_data_loops(1usize)
        .attribute_call(concat!("`train`", " at ", file!(), ":", line!()))
        .build()?;
    let __accel_exit = acc.exit_guard();
    let __accel_result: Result<Vec<(String, Tensor)>> = (|| {
        use OptimizerConfig as _;
        let tp = acc.tensor_parallel();
        let vs = nn::VarStore::new(Device::Cpu);
        let options = LinearOptions::default();
        let up = ColumnParallelLinear::new(
            &tp,
            &(vs.root() / "up"),
            64,
            HIDDEN,
            options,
        )?;
        let down = RowParallelLinear::new(
            &tp,
            &(vs.root() / "down"),
            HIDDEN,
            10,
            options,
        )?;
        let whole = acc.variables(&init);
        up.load_whole(&whole["up.weight"], Some(&whole["up.bias"]))?;
        down.load_whole(&whole["down.weight"], Some(&whole["down.bias"]))?;
        let mut opt = acc.build_optimizer(nn::Sgd::default(), &vs, 0.1)?;
        for _ in 0..EPOCHS {
            for (x, y) in acc
                .prepare_iter(tch::data::Iter2::new(&data.train_x, &data.train_y, 64))
            {
                let __accel_autocast = acc.autocast_step()?;
                let loss = down
                    .forward(&up.forward(&x).relu())
                    .cross_entropy_for_logits(&y);
                opt.zero_grad()?;
                acc.backward(&loss)?;
                opt.step()?;
            }
        }
        acc.attribute_summon()?;
        acc.print(
            format!(
                "rank {} held {} of the hidden features", acc.process_index(), up.weight
                .size() [0]
            ),
        );
        Ok(acc.full_state_dict(&vs)?)
    })();
    if __accel_result.is_ok() {
        acc.attribute_summon().and_then(|_| __accel_exit.finish())?;
    }
    __accel_result
}
fn main() -> Result<()> {
    let data = Digits::load(Device::Cpu)?;
    tch::manual_seed(0);
    let reference = nn::VarStore::new(Device::Cpu);
    let (up, down) = whole_mlp(&reference);
    let mut init = nn::VarStore::new(Device::Cpu);
    whole_mlp(&init);
    init.copy(&reference)?;
    let split = train(&data, &init)?;
    let mut opt = nn::Sgd::default().build(&reference, 0.1)?;
    for _ in 0..EPOCHS {
        for (x, y) in tch::data::Iter2::new(&data.train_x, &data.train_y, 64) {
            let loss = down.forward(&up.forward(&x).relu()).cross_entropy_for_logits(&y);
            opt.backward_step(&loss);
        }
    }
    let whole = reference.variables();
    for (name, value) in &split {
        let diff = (value - &whole[name]).abs().max().double_value(&[]);
        anyhow::ensure!(
            diff < 1e-5, "{name}: the split run differs from the whole one by {diff}"
        );
    }
    println!(
        "the split MLP ends with the whole one's weights ({} tensors, within 1e-5)",
        split.len()
    );
    Ok(())
}
