//! By feature: evaluation with `gather_for_metrics`. Each process scores its shard of the
//! 360 test images; the last round is padded so that every process has as many batches,
//! and `gather_for_metrics` drops that padding again: exactly 360 results come back,
//! whatever the number of processes.
//!
//!     cargo run -p accel-examples --example evaluation
//!     accel launch --num-processes 3 target/debug/examples/evaluation

use accel_core::Accelerator;
use accel_core::data::{DataLoader, LoaderOptions, TensorDataset};
use accel_examples::Digits;
use anyhow::Result;
use tch::Kind;
use tch::nn::{self, Module};

fn main() -> Result<()> {
    let acc = Accelerator::builder().seed(0).cpu(true).build()?;
    let data = Digits::load(acc.device())?;
    let vs = nn::VarStore::new(acc.device());
    let net = nn::linear(vs.root() / "classifier", 64, 10, Default::default());
    acc.prepare_model(&vs)?;
    let options = LoaderOptions { batch_size: 50, ..Default::default() };
    let mut test = acc.prepare_loader(DataLoader::new(
        TensorDataset::new(vec![data.test_x, data.test_y])?,
        options,
    )?)?;
    let (mut correct, mut scored) = (0.0, 0);
    for batch in test.iter() {
        let batch = batch?;
        let hits = tch::no_grad(|| net.forward(&batch[0]).argmax(-1, false).eq_tensor(&batch[1]));
        let hits = acc.gather_for_metrics(&hits)?;
        correct += hits.to_kind(Kind::Float).sum(Kind::Float).double_value(&[]);
        scored += hits.size()[0];
    }
    acc.print(format!(
        "{} process(es) scored {scored} images (an untrained model: {:.1}% right)",
        acc.num_processes(),
        100.0 * correct / scored as f64
    ));
    anyhow::ensure!(scored == 360, "gather_for_metrics returned {scored} results, not 360");
    Ok(())
}
