//! From the crates.io package tch 0.11.0 (`tch-0.11.0.crate`): `examples/neural-style-transfer/
//! main.rs` (`main`, with `gram_matrix`, `style_loss`), MIT or Apache-2.0 (`Cargo.toml`:
//! `license = "MIT/Apache-2.0"`; licenses/tch-0.11.0-LICENSE-MIT,
//! licenses/tch-0.11.0-LICENSE-APACHE). Not among tch-rs's examples in tests/real_code.
//!
//! The loop: what is trained is the input image itself, a variable of its own VarStore
//! (`vs.root().var_copy("img", &content_img)`), through a frozen pre-trained VGG-16 (its own
//! VarStore, loaded with `net_vs.load(..)` and `net_vs.freeze()`); each step runs the
//! network's first layers (`forward_all_t`), adds the style losses (Gram matrices) and the
//! content loss, `opt.backward_step(&loss)`, and every 1000 steps prints the loss and saves
//! the image (`imagenet::save_image(.., format!("out{step_idx}.jpg"))`).
//!
//! Changed: the command-line arguments (style image, content image, `vgg16.ot`; `bail!` on a
//! bad usage) became parameters; the images are two digits of the training set made into
//! ImageNet-normalised 3x8x8 images (`load_image` below, for `imagenet::load_image`); VGG-16
//! replaced by `vgg16` below, a small conv stack over 3x8x8 images laid out as VGG's first
//! layers (conv, relu, conv, relu, max-pool, ...: the style indexes 0, 2, 5, 7, 10 and the
//! content index 7 are convolutions, as in VGG-16) whose "pre-trained" weights `run` saves
//! first (one file per process); 3000 steps -> 20, printing and saving every 10 instead of
//! 1000; `f64::from` -> `f64::try_from(..)?` (tch 0.24).
//!
//! Expected: **FailsOnTwo { says: "computed the same loss", line: None }**. `step_idx` picks
//! no batch (it decides the branch and is formatted into a file name, but nothing is
//! selected with it), so the loop counts and draws its own batches; but there are no
//! batches: every process optimises the same image against the same targets and computes
//! the same first loss, which the first-step check refuses. On 1 process it runs (the
//! frozen network's `net_vs.load` becomes the accelerator's load into an unprepared
//! VarStore; `opt` prepares the image's VarStore).
use anyhow::Result;
use tch::vision::imagenet;
use tch::{nn, nn::OptimizerConfig, Device, TchError, Tensor};

use crate::data;

const STYLE_WEIGHT: f64 = 1e6;
const LEARNING_RATE: f64 = 1e-1;
const TOTAL_STEPS: i64 = 20;
const STYLE_INDEXES: [usize; 5] = [0, 2, 5, 7, 10];
const CONTENT_INDEXES: [usize; 1] = [7];

fn gram_matrix(m: &Tensor) -> Tensor {
    let (a, b, c, d) = m.size4().unwrap();
    let m = m.view([a * b, c * d]);
    let g = m.matmul(&m.tr());
    g / (a * b * c * d)
}

fn style_loss(m1: &Tensor, m2: &Tensor) -> Tensor {
    gram_matrix(m1).mse_loss(&gram_matrix(m2), tch::Reduction::Mean)
}

/// Stand-in for `tch::vision::vgg::vgg16`: VGG's layer order (conv 0, relu 1, conv 2, relu 3,
/// pool 4, conv 5, relu 6, conv 7, relu 8, pool 9, conv 10, relu 11, then the classifier)
/// at the size of 3x8x8 images.
fn vgg16(p: &nn::Path, nclasses: i64) -> nn::SequentialT {
    let c = nn::ConvConfig { padding: 1, ..Default::default() };
    nn::seq_t()
        .add(nn::conv2d(p / "c0", 3, 8, 3, c))
        .add_fn(|xs| xs.relu())
        .add(nn::conv2d(p / "c2", 8, 8, 3, c))
        .add_fn(|xs| xs.relu())
        .add_fn(|xs| xs.max_pool2d_default(2))
        .add(nn::conv2d(p / "c5", 8, 16, 3, c))
        .add_fn(|xs| xs.relu())
        .add(nn::conv2d(p / "c7", 16, 16, 3, c))
        .add_fn(|xs| xs.relu())
        .add_fn(|xs| xs.max_pool2d_default(2))
        .add(nn::conv2d(p / "c10", 16, 32, 3, c))
        .add_fn(|xs| xs.relu())
        .add_fn(|xs| xs.flat_view())
        .add(nn::linear(p / "classifier", 32 * 2 * 2, nclasses, Default::default()))
}

/// Stand-in for `imagenet::load_image(path)`: training digit `index` as a 3x8x8 image with
/// the ImageNet normalisation.
fn load_image(index: usize) -> Result<Tensor, TchError> {
    let d = data::load().map_err(|e| TchError::FileFormat(e.to_string()))?;
    let digit = d.train_x.get(index as i64).view([1, 8, 8]).repeat([3, 1, 1]) * 255.0;
    imagenet::normalize(&digit)
}

#[accel_core::accelerate(strategy = "ddp")]
fn train(style_img: usize, content_img: usize, weights: String) -> Result<()> {
    let device = Device::cuda_if_available();

    let mut net_vs = tch::nn::VarStore::new(device);
    let net = vgg16(&net_vs.root(), imagenet::CLASS_COUNT);
    net_vs.load(&weights).unwrap_or_else(|_| panic!("Could not load weights file {}", &weights));
    net_vs.freeze();

    let style_img = load_image(style_img)
        .unwrap_or_else(|_| panic!("Could not load the style file {}", &style_img))
        .unsqueeze(0)
        .to_device(device);
    let content_img = load_image(content_img)
        .unwrap_or_else(|_| panic!("Could not load the content file {}", &content_img))
        .unsqueeze(0)
        .to_device(device);
    let max_layer = STYLE_INDEXES.iter().max().unwrap() + 1;
    let style_layers = net.forward_all_t(&style_img, false, Some(max_layer));
    let content_layers = net.forward_all_t(&content_img, false, Some(max_layer));

    let vs = nn::VarStore::new(device);
    let input_var = vs.root().var_copy("img", &content_img);
    let mut opt = nn::Adam::default().build(&vs, LEARNING_RATE)?;

    for step_idx in 1..(1 + TOTAL_STEPS) {
        let input_layers = net.forward_all_t(&input_var, false, Some(max_layer));
        let style_loss: Tensor =
            STYLE_INDEXES.iter().map(|&i| style_loss(&input_layers[i], &style_layers[i])).sum();
        let content_loss: Tensor = CONTENT_INDEXES
            .iter()
            .map(|&i| input_layers[i].mse_loss(&content_layers[i], tch::Reduction::Mean))
            .sum();
        let loss = style_loss * STYLE_WEIGHT + content_loss;
        opt.backward_step(&loss);
        if step_idx % 10 == 0 {
            println!("{} {}", step_idx, f64::try_from(loss)?);
            imagenet::save_image(&input_var, format!("out{step_idx}.jpg"))?;
        }
    }

    Ok(())
}

pub fn run() -> anyhow::Result<()> {
    tch::manual_seed(0);
    // The "pre-trained" weights, as `vgg16.ot` was downloaded before the example ran.
    let weights = format!("vgg16.{}.ot", std::process::id());
    let pretrained = nn::VarStore::new(Device::Cpu);
    let _ = vgg16(&pretrained.root(), imagenet::CLASS_COUNT);
    pretrained.save(&weights)?;
    train(3, 0, weights)
}
