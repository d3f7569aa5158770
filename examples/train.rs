//! The main job: an MLP learns the 8x8 handwritten digits shipped in data/ and must reach
//! 95% accuracy on the 360 held-out images.
//!
//! One process (CPU, or a GPU with `--device cuda`):
//!     cargo xtask train            (installs libtorch on first use)
//!     cargo run -p accel-examples --example train -- --epochs 40
//!
//! Several processes arrive with the launcher (`accel launch`), which is not built yet.

use accel_core::cuda::check_device;
use accel_examples::Digits;
use anyhow::{Result, bail};
use clap::Parser;
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

/// Train an MLP on the 8x8 digits.
#[derive(Debug, Parser)]
struct Args {
    /// Passes over the 1,437 training images.
    #[arg(long, default_value_t = 40)]
    epochs: usize,
    /// Images per optimizer step.
    #[arg(long, default_value_t = 32)]
    batch_size: i64,
    /// AdamW learning rate.
    #[arg(long, default_value_t = 2e-3)]
    lr: f64,
    /// Width of the two hidden layers.
    #[arg(long, default_value_t = 128)]
    hidden: i64,
    /// Seed of initialisation and shuffling.
    #[arg(long, default_value_t = 0)]
    seed: i64,
    /// `cpu`, `cuda` or `cuda:N`.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Accuracy on the held-out images that the run must reach.
    #[arg(long, default_value_t = 0.95)]
    target: f64,
}

fn parse_device(name: &str) -> Result<Device> {
    Ok(match name {
        "cpu" => Device::Cpu,
        "cuda" => Device::Cuda(0),
        other => match other.strip_prefix("cuda:").and_then(|i| i.parse().ok()) {
            Some(index) => Device::Cuda(index),
            None => bail!("unknown device `{other}`; use cpu, cuda or cuda:N"),
        },
    })
}

fn mlp(root: &nn::Path, hidden: i64) -> impl Module + use<> {
    nn::seq()
        .add(nn::linear(root / "layers" / 0, 64, hidden, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(root / "layers" / 1, hidden, hidden, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(root / "layers" / 2, hidden, 10, Default::default()))
}

fn accuracy(net: &impl Module, x: &Tensor, y: &Tensor) -> f64 {
    tch::no_grad(|| {
        let predicted = net.forward(x).argmax(-1, false);
        predicted.eq_tensor(y).to_kind(Kind::Float).mean(Kind::Float).double_value(&[])
    })
}

fn main() -> Result<()> {
    let args = Args::parse();
    let device = check_device(parse_device(&args.device)?)?;
    tch::manual_seed(args.seed);
    let data = Digits::load(device)?;
    let vs = nn::VarStore::new(device);
    let net = mlp(&vs.root(), args.hidden);
    let mut opt = nn::AdamW::default().build(&vs, args.lr)?;
    let n = data.train_x.size()[0];
    println!(
        "training a 64-{h}-{h}-10 MLP on {n} digits, {} epochs, batch {}, on {device:?}",
        args.epochs,
        args.batch_size,
        h = args.hidden
    );
    let started = std::time::Instant::now();
    for epoch in 1..=args.epochs {
        let order = Tensor::randperm(n, (Kind::Int64, device));
        let (mut total, mut batches) = (0.0, 0);
        for start in (0..n).step_by(args.batch_size as usize) {
            let index = order.narrow(0, start, args.batch_size.min(n - start));
            let (x, y) =
                (data.train_x.index_select(0, &index), data.train_y.index_select(0, &index));
            let loss = net.forward(&x).cross_entropy_for_logits(&y);
            opt.backward_step(&loss);
            total += loss.double_value(&[]);
            batches += 1;
        }
        if epoch % 5 == 0 || epoch == 1 || epoch == args.epochs {
            println!(
                "epoch {epoch:3}  loss {:.4}  test accuracy {:.2}%",
                total / batches as f64,
                100.0 * accuracy(&net, &data.test_x, &data.test_y)
            );
        }
    }
    let final_accuracy = accuracy(&net, &data.test_x, &data.test_y);
    println!(
        "done in {:.1} s: test accuracy {:.2}% (target {:.0}%)",
        started.elapsed().as_secs_f64(),
        100.0 * final_accuracy,
        100.0 * args.target
    );
    if final_accuracy < args.target {
        bail!(
            "test accuracy {:.2}% is below the target {:.0}%",
            100.0 * final_accuracy,
            100.0 * args.target
        );
    }
    Ok(())
}
