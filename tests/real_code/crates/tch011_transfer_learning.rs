//! From the crates.io package tch 0.11.0 (`tch-0.11.0.crate`): `examples/transfer-learning/
//! main.rs` (`main`), MIT or Apache-2.0 (`Cargo.toml`: `license = "MIT/Apache-2.0"`;
//! licenses/tch-0.11.0-LICENSE-MIT, licenses/tch-0.11.0-LICENSE-APACHE). Not among tch-rs's
//! examples in tests/real_code.
//!
//! The loop: fine-tuning a linear head on features of a frozen pre-trained network. A first
//! VarStore holds the pre-trained network, loaded with `vs.load(weights)?`; the features of
//! the whole training and test sets are computed once under `no_grad`; a second VarStore
//! (shadowing the first, also named `vs`) holds the head, trained full-batch by
//! `sgd.backward_step(&loss)` in `for epoch_idx in 1..1001`, test accuracy printed each time.
//!
//! Changed: the command-line arguments (`resnet18.ot`, a dataset folder; `bail!` on a bad
//! usage) became the parameter `weights`; ImageNet-style images (`imagenet::load_from_dir`)
//! replaced by the digits as a tch `Dataset` (`load_from_dir()` below), and ResNet-18 without
//! its last layer (512 features) by `resnet18_no_final_layer` below, one layer of 32
//! features whose "pre-trained" weights `run` saves first (to a file per process, so that two
//! processes do not write and read the same file at once); 1000 epochs -> 20;
//! `f64::from` -> `f64::try_from(..)?` (tch 0.24).
//!
//! Expected: **FailsOnTwo { says: "computed the same loss", line: None }**. `vs.load` becomes
//! the accelerator's load into the (unprepared) feature VarStore, and `sgd` prepares the
//! head's. The loop counts (`epoch_idx` is only printed), so it draws its own batches; but
//! every process computes the same full-batch loss on the same features, which the
//! first-step check refuses (docs/attribute.md, "The first-step check"; as mnist_nn).
use anyhow::Result;
use tch::nn::{self, OptimizerConfig};
use tch::vision::dataset::Dataset;

use crate::data;

/// Stand-in for `tch::vision::resnet::resnet18_no_final_layer`: a pre-trained feature
/// extractor over the digits' 64 pixels.
fn resnet18_no_final_layer(p: &nn::Path) -> nn::Sequential {
    nn::seq().add(nn::linear(p / "features", 64, 32, Default::default())).add_fn(|x| x.relu())
}

/// Stand-in for `tch::vision::imagenet::load_from_dir(dataset_dir)`.
fn load_from_dir() -> Result<Dataset> {
    let d = data::load()?;
    Ok(Dataset {
        train_images: d.train_x,
        train_labels: d.train_y,
        test_images: d.test_x,
        test_labels: d.test_y,
        labels: 10,
    })
}

#[accel_core::accelerate(strategy = "ddp")]
fn train(weights: &std::path::Path) -> Result<()> {
    // Load the dataset and resize it to the usual imagenet dimension of 224x224.
    let dataset = load_from_dir()?;
    println!("{dataset:?}");

    // Create the model and load the weights from the file.
    let mut vs = tch::nn::VarStore::new(tch::Device::Cpu);
    let net = resnet18_no_final_layer(&vs.root());
    vs.load(weights)?;

    // Pre-compute the final activations.
    let train_images = tch::no_grad(|| dataset.train_images.apply_t(&net, false));
    let test_images = tch::no_grad(|| dataset.test_images.apply_t(&net, false));

    let vs = nn::VarStore::new(tch::Device::Cpu);
    let linear = nn::linear(vs.root(), 32, dataset.labels, Default::default());
    let mut sgd = nn::Sgd::default().build(&vs, 1e-3)?;

    for epoch_idx in 1..21 {
        let predicted = train_images.apply(&linear);
        let loss = predicted.cross_entropy_for_logits(&dataset.train_labels);
        sgd.backward_step(&loss);

        let test_accuracy = test_images.apply(&linear).accuracy_for_logits(&dataset.test_labels);
        println!("{} {:.2}%", epoch_idx, 100. * f64::try_from(test_accuracy)?);
    }
    Ok(())
}

pub fn run() -> anyhow::Result<()> {
    tch::manual_seed(0);
    // The "pre-trained" weights, as `resnet18.ot` was downloaded before the example ran.
    let weights = std::path::PathBuf::from(format!("resnet18.{}.ot", std::process::id()));
    let pretrained = nn::VarStore::new(tch::Device::Cpu);
    let _ = resnet18_no_final_layer(&pretrained.root());
    pretrained.save(&weights)?;
    train(&weights)
}
