//! By feature: a strategy of one's own. Local SGD (accel_examples::local_sgd, written with
//! accel-core's public API only) replaces DDP: each process steps on its own gradients, and
//! the replicas are averaged every 8 batches and at the end. Communication drops from every
//! step to every eighth; the model still reaches 90%+ on the held-out digits.
//!
//!     cargo run -p accel-examples --example local_sgd
//!     accel launch --num-processes 2 target/debug/examples/local_sgd

use accel_core::Accelerator;
use accel_core::comm::Communicator;
use accel_core::data::{DataLoader, LoaderOptions, Sampler, TensorDataset};
use accel_core::optim::{AdamConfig, AdamW, named_params};
use accel_examples::Digits;
use accel_examples::local_sgd::LocalSgd;
use anyhow::Result;
use tch::Kind;
use tch::nn::{self, Module};

fn main() -> Result<()> {
    let acc = Accelerator::builder().seed(0).cpu(true).custom_strategy(LocalSgd::new(8)).build()?;
    let data = Digits::load(acc.device())?;
    let vs = nn::VarStore::new(acc.device());
    let net = nn::seq()
        .add(nn::linear(vs.root() / "layers" / 0, 64, 64, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(vs.root() / "layers" / 1, 64, 10, Default::default()));
    acc.prepare_model(&vs)?;
    let config = AdamConfig { lr: 3e-3, ..AdamConfig::adamw() };
    let mut opt = acc.prepare_optimizer(AdamW::new(named_params(&vs), config)?);
    let options = LoaderOptions {
        batch_size: 32,
        sampler: Sampler::Shuffled { seed: 0 },
        ..Default::default()
    };
    let mut train = acc.prepare_loader(DataLoader::new(
        TensorDataset::new(vec![data.train_x, data.train_y])?,
        options,
    )?)?;
    for _epoch in 0..10 {
        for batch in train.iter() {
            let batch = batch?;
            acc.backward(&net.forward(&batch[0]).cross_entropy_for_logits(&batch[1]))?;
            opt.step()?;
            opt.zero_grad()?;
        }
    }
    // The last average: every replica ends equal.
    acc.end_training()?;
    if let Some(group) = acc.process_group() {
        let weights = vs.variables()["layers.0.weight"].unsqueeze(0);
        let all = group.all_gather(&weights)?;
        let spread = (&all - all.get(0)).abs().max().double_value(&[]);
        anyhow::ensure!(spread == 0.0, "the replicas differ by {spread} after the last average");
    }
    let hits = tch::no_grad(|| net.forward(&data.test_x).argmax(-1, false).eq_tensor(&data.test_y));
    let accuracy = hits.to_kind(Kind::Float).mean(Kind::Float).double_value(&[]);
    acc.print(format!(
        "{}: {:.1}% of the held-out digits on {} process(es)",
        acc.strategy().name(),
        100.0 * accuracy,
        acc.num_processes()
    ));
    anyhow::ensure!(accuracy > 0.9, "accuracy {accuracy} below 90%");
    Ok(())
}
