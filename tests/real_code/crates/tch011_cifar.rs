//! From the crates.io package tch 0.11.0 (`tch-0.11.0.crate`): `examples/cifar/main.rs`
//! (`main`, with `conv_bn`, `layer`, `fast_resnet`, `learning_rate`), MIT or Apache-2.0
//! (`Cargo.toml`: `license = "MIT/Apache-2.0"`; licenses/tch-0.11.0-LICENSE-MIT,
//! licenses/tch-0.11.0-LICENSE-APACHE). Not among tch-rs's examples in tests/real_code.
//!
//! The loop: a fast ResNet (conv + batch norm, residual blocks) trained with Nesterov SGD,
//! weight decay, the learning rate set once per epoch by a step schedule
//! (`opt.set_lr(learning_rate(epoch))`), batches from `m.train_iter(64).shuffle().to_device(..)`,
//! each augmented (random flip, padded random crop, cutout) before `forward_t(.., true)` and
//! `opt.backward_step`, test accuracy by `batch_accuracy_for_logits` after each epoch.
//!
//! Changed: CIFAR-10 (`tch::vision::cifar::load_dir("data")`) replaced by the digits as a tch
//! `Dataset` of 1x8x8 images (`load_dir()` below); the network kept, shrunk to fit them
//! (channels 3/64/128/256/512 -> 1/8/16/32/64; the last pooling, 4 over CIFAR's 4x4 maps, is
//! 1 over these 1x1 maps); augmentation padding 4 -> 1 and cutout 8 -> 2 (8x8 images);
//! batch size 64 -> `data::batch_size()`; epochs 1..150 -> 1..4 and the schedule's steps at
//! epochs 50/100 -> 2/3; `main` renamed `train`.
//!
//! Expected (`RanksEqual`): **runs on 1 and 2 processes, ranks equal, but not equal to 1
//! process with twice the batch**. The
//! `for (bimages, blabels) in m.train_iter(..).shuffle()..` loop is dealt (the epoch loop
//! around it only counts, and `set_lr` outside the dealt loop is allowed); every process
//! shuffles alike (torch's generator, seeded by `run`). But
//! `tch::vision::dataset::augmentation` draws its flips, crops and cutouts from rand's
//! `thread_rng()` (seeded by the OS, different on every run and process), and batch norm
//! normalises over each process's 32 rows, not the 64 of one process, so parity with one
//! process cannot hold. Ranks stay equal: gradients are averaged, buffers (running
//! statistics) broadcast.
use tch::nn::{FuncT, ModuleT, OptimizerConfig, SequentialT};
use tch::vision::dataset::Dataset;
use tch::{nn, Device};

use crate::data;

fn conv_bn(vs: &nn::Path, c_in: i64, c_out: i64) -> SequentialT {
    let conv2d_cfg = nn::ConvConfig { padding: 1, bias: false, ..Default::default() };
    nn::seq_t()
        .add(nn::conv2d(vs, c_in, c_out, 3, conv2d_cfg))
        .add(nn::batch_norm2d(vs, c_out, Default::default()))
        .add_fn(|x| x.relu())
}

fn layer<'a>(vs: &nn::Path, c_in: i64, c_out: i64) -> FuncT<'a> {
    let pre = conv_bn(&vs.sub("pre"), c_in, c_out);
    let block1 = conv_bn(&vs.sub("b1"), c_out, c_out);
    let block2 = conv_bn(&vs.sub("b2"), c_out, c_out);
    nn::func_t(move |xs, train| {
        let pre = xs.apply_t(&pre, train).max_pool2d_default(2);
        let ys = pre.apply_t(&block1, train).apply_t(&block2, train);
        pre + ys
    })
}

fn fast_resnet(vs: &nn::Path) -> SequentialT {
    nn::seq_t()
        .add(conv_bn(&vs.sub("pre"), 1, 8))
        .add(layer(&vs.sub("layer1"), 8, 16))
        .add(conv_bn(&vs.sub("inter"), 16, 32))
        .add_fn(|x| x.max_pool2d_default(2))
        .add(layer(&vs.sub("layer2"), 32, 64))
        .add_fn(|x| x.max_pool2d_default(1).flat_view())
        .add(nn::linear(vs.sub("linear"), 64, 10, Default::default()))
        .add_fn(|x| x * 0.125)
}

fn learning_rate(epoch: i64) -> f64 {
    if epoch < 2 {
        0.1
    } else if epoch < 3 {
        0.01
    } else {
        0.001
    }
}

/// Stand-in for `tch::vision::cifar::load_dir("data")`: the digits as 1x8x8 images.
fn load_dir() -> anyhow::Result<Dataset> {
    let d = data::load()?;
    Ok(Dataset {
        train_images: d.train_x.view([-1, 1, 8, 8]),
        train_labels: d.train_y,
        test_images: d.test_x.view([-1, 1, 8, 8]),
        test_labels: d.test_y,
        labels: 10,
    })
}

#[accel_core::accelerate(strategy = "ddp")]
fn train() -> anyhow::Result<()> {
    let m = load_dir()?;
    let vs = nn::VarStore::new(Device::cuda_if_available());
    let net = fast_resnet(&vs.root());
    let mut opt =
        nn::Sgd { momentum: 0.9, dampening: 0., wd: 5e-4, nesterov: true }.build(&vs, 0.)?;
    for epoch in 1..4 {
        opt.set_lr(learning_rate(epoch));
        for (bimages, blabels) in m.train_iter(data::batch_size()).shuffle().to_device(vs.device())
        {
            let bimages = tch::vision::dataset::augmentation(&bimages, true, 1, 2);
            let loss = net.forward_t(&bimages, true).cross_entropy_for_logits(&blabels);
            opt.backward_step(&loss);
        }
        let test_accuracy =
            net.batch_accuracy_for_logits(&m.test_images, &m.test_labels, vs.device(), 512);
        println!("epoch: {:4} test acc: {:5.2}%", epoch, 100. * test_accuracy,);
    }
    Ok(())
}

pub fn run() -> anyhow::Result<()> {
    tch::manual_seed(0);
    train()
}
