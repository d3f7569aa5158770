//! From the crates.io package tch 0.11.0 (`tch-0.11.0.crate`): `examples/jit-train/main.rs`
//! (`train_and_save_model`, with `load_trained_and_test_acc` and `main`), MIT or Apache-2.0
//! (`Cargo.toml`: `license = "MIT/Apache-2.0"`; licenses/tch-0.11.0-LICENSE-MIT,
//! licenses/tch-0.11.0-LICENSE-APACHE). Not among tch-rs's examples in tests/real_code.
//!
//! The loop: a TorchScript model loaded for training (`TrainableCModule::load("model.pt",
//! vs.root())`, its parameters put in `vs`), `set_train()`, its accuracy printed before
//! training, Adam over `vs`, then per epoch at most 50 shuffled batches
//! (`dataset.train_iter(128).shuffle().to_device(..).take(50)`) with `opt.backward_step`, test
//! accuracy after each epoch, and the trained module saved (`trainable.save(..)`, not
//! `vs.save`); `main` then loads the saved module and prints its accuracy.
//!
//! Changed: `model.pt` is a TorchScript file made by PyTorch (a conv net for MNIST), which
//! cannot be made here; `TrainableCModule` (and `CModule` in `load_trained_and_test_acc`) are
//! replaced by the local `TrainableCModule` below: the digits MLP (64 -> 32 -> 10) whose
//! weights it reads from a file, putting them in the VarStore as `TrainableCModule::load`
//! does (names with `.` -> `_`), and whose `save` writes them back. `run` writes `model.pt`
//! first (written beside and renamed, so that two processes never read a half-written
//! file). MNIST (`tch::vision::mnist::load_dir`, viewed as 1x28x28) replaced by the digits
//! as a tch `Dataset`; batch size 128 -> `data::batch_size()`; epochs 1..20 -> 1..4;
//! `main` became `run`.
//!
//! Expected: **Equal**. `dataset.train_iter(..).shuffle().to_device(..).take(50)` is an
//! iterator, so the loop is dealt; every process shuffles alike (torch's generator, seeded by
//! `run`), so 2 processes with batches of 32 see, at each step, the 64 rows 1 process sees
//! (`take(50)` caps nothing: 8 or 16 batches). The model is the same on every process (read
//! from the same file, then broadcast by `build`), and the forward pass is deterministic.
//! `trainable.save(..)` is not a VarStore's save, so it is not rewritten: every process
//! writes the same `trained_model.pt` (before the exit barrier, so `load_trained_and_test_acc`
//! reads a finished file).
use std::collections::HashMap;

use anyhow::Result;
use tch::nn::{self, Adam, ModuleT, OptimizerConfig, VarStore};
use tch::vision::dataset::Dataset;
use tch::{Device, Tensor};

use crate::data;

/// Stand-in for tch's `TrainableCModule` over a TorchScript file: the digits MLP, its
/// parameters read from `module_path` and added to the VarStore at `path`.
#[derive(Debug)]
struct TrainableCModule {
    params: Vec<(String, Tensor)>,
    train: bool,
}

impl TrainableCModule {
    fn load(module_path: &str, path: nn::Path) -> Result<TrainableCModule> {
        let mut file: HashMap<String, Tensor> = Tensor::load_multi(module_path)?.into_iter().collect();
        let mut params = Vec::new();
        for name in ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"] {
            let tensor = file.remove(name).ok_or_else(|| anyhow::anyhow!("{name} missing"))?;
            params.push((name.to_string(), path.var_copy(&name.replace('.', "_"), &tensor)));
        }
        Ok(TrainableCModule { params, train: false })
    }

    fn set_train(&mut self) {
        self.train = true;
    }

    fn set_eval(&mut self) {
        self.train = false;
    }

    fn save(&self, module_path: &str) -> Result<()> {
        Tensor::save_multi(&self.params, module_path)?;
        Ok(())
    }
}

impl ModuleT for TrainableCModule {
    fn forward_t(&self, xs: &Tensor, _train: bool) -> Tensor {
        let p = |i: usize| &self.params[i].1;
        xs.linear(p(0), Some(p(1))).relu().linear(p(2), Some(p(3)))
    }
}

#[accel_core::accelerate(strategy = "ddp")]
fn train_and_save_model(dataset: &Dataset, device: Device) -> Result<()> {
    let vs = VarStore::new(device);
    let mut trainable = TrainableCModule::load("model.pt", vs.root())?;
    trainable.set_train();
    let initial_acc = trainable.batch_accuracy_for_logits(
        &dataset.test_images,
        &dataset.test_labels,
        vs.device(),
        1024,
    );
    println!("Initial accuracy: {:5.2}%", 100. * initial_acc);

    let mut opt = Adam::default().build(&vs, 1e-4)?;
    for epoch in 1..4 {
        for (images, labels) in
            dataset.train_iter(data::batch_size()).shuffle().to_device(vs.device()).take(50)
        {
            let loss = trainable.forward_t(&images, true).cross_entropy_for_logits(&labels);
            opt.backward_step(&loss);
        }
        let test_accuracy = trainable.batch_accuracy_for_logits(
            &dataset.test_images,
            &dataset.test_labels,
            vs.device(),
            1024,
        );
        println!("epoch: {:4} test acc: {:5.2}%", epoch, 100. * test_accuracy,);
    }
    trainable.save("trained_model.pt")?;
    Ok(())
}

fn load_trained_and_test_acc(dataset: &Dataset, device: Device) -> Result<()> {
    let vs = VarStore::new(device);
    let mut module = TrainableCModule::load("trained_model.pt", vs.root())?;
    module.set_eval();
    let accuracy =
        module.batch_accuracy_for_logits(&dataset.test_images, &dataset.test_labels, device, 1024);
    println!("Updated accuracy: {:5.2}%", 100. * accuracy);
    Ok(())
}

pub fn run() -> Result<()> {
    tch::manual_seed(0);
    // `model.pt`, which the example expects to find: the MLP's initial weights.
    let init = VarStore::new(Device::Cpu);
    let _ = data::mlp(&init.root());
    let tmp = format!("model.pt.{}", std::process::id());
    init.save(&tmp)?;
    std::fs::rename(&tmp, "model.pt")?;

    let d = data::load()?;
    let dataset = Dataset {
        train_images: d.train_x,
        train_labels: d.train_y,
        test_images: d.test_x,
        test_labels: d.test_y,
        labels: 10,
    };
    let device = Device::Cpu;
    train_and_save_model(&dataset, device)?;
    load_trained_and_test_acc(&dataset, device)?;
    Ok(())
}
