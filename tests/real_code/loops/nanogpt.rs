//! nanoGPT's training loop (github.com/karpathy/nanoGPT, train.py), ported to tch by hand on
//! a character model small enough for a test: `for iter in 0..max_iters`, the learning
//! rate from `get_lr(iter)` (linear warmup, cosine decay), random batches from
//! `get_batch(split)`, an evaluation every `eval_interval` iterations, AdamW and gradient
//! clipping at 1.0. The loop counts and draws its own batches: under #[accelerate] every
//! process runs every iteration on batches of its own, from torch's generator seeded with
//! 1337 + its rank (nanoGPT's `seed_offset`).
//!
//! `INIT=w.safetensors` starts from given weights and `LOSSES=dir` writes each process's
//! losses (`losses.rank{R}.json`), for the comparison with python/reference/nanogpt_accelerate.py.
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

const BLOCK_SIZE: i64 = 16;
const BATCH_SIZE: i64 = 8;
const N_EMBD: i64 = 24;
const LEARNING_RATE: f64 = 3e-3;
const WARMUP_ITERS: i64 = 4;
const LR_DECAY_ITERS: i64 = 30;
const MIN_LR: f64 = 3e-4;
const EVAL_INTERVAL: i64 = 10;

struct Gpt {
    wte: nn::Embedding,
    ln: nn::LayerNorm,
    lm_head: nn::Linear,
}

impl Gpt {
    fn new(p: &nn::Path, vocab: i64) -> Self {
        Self {
            wte: nn::embedding(p / "wte", vocab, N_EMBD, Default::default()),
            ln: nn::layer_norm(p / "ln_f", vec![N_EMBD], Default::default()),
            lm_head: nn::linear(p / "lm_head", N_EMBD, vocab, Default::default()),
        }
    }

    fn forward(&self, idx: &Tensor) -> Tensor {
        self.lm_head.forward(&self.ln.forward(&self.wte.forward(idx)).gelu("none"))
    }
}

fn get_batch(data: &Tensor) -> (Tensor, Tensor) {
    let n = data.size()[0];
    let ix = Tensor::randint(n - BLOCK_SIZE - 1, [BATCH_SIZE], (Kind::Int64, Device::Cpu));
    let ix = Vec::<i64>::try_from(&ix).unwrap();
    let x: Vec<Tensor> = ix.iter().map(|&i| data.narrow(0, i, BLOCK_SIZE)).collect();
    let y: Vec<Tensor> = ix.iter().map(|&i| data.narrow(0, i + 1, BLOCK_SIZE)).collect();
    (Tensor::stack(&x, 0), Tensor::stack(&y, 0))
}

fn get_lr(it: i64) -> f64 {
    if it < WARMUP_ITERS {
        return LEARNING_RATE * (it + 1) as f64 / (WARMUP_ITERS + 1) as f64;
    }
    if it > LR_DECAY_ITERS {
        return MIN_LR;
    }
    let decay_ratio = (it - WARMUP_ITERS) as f64 / (LR_DECAY_ITERS - WARMUP_ITERS) as f64;
    let coeff = 0.5 * (1.0 + (std::f64::consts::PI * decay_ratio).cos());
    MIN_LR + coeff * (LEARNING_RATE - MIN_LR)
}

#[accel_core::accelerate(strategy = "ddp")]
fn train(train_data: &Tensor, val_data: &Tensor, vocab: i64, max_iters: i64) -> anyhow::Result<Vec<f64>> {
    let mut vs = nn::VarStore::new(Device::Cpu);
    let model = Gpt::new(&vs.root(), vocab);
    if let Ok(init) = std::env::var("INIT") {
        vs.load(init)?;
    }
    tch::manual_seed(1337);
    let mut opt = nn::AdamW { wd: 0.1, beta2: 0.99, ..Default::default() }.build(&vs, LEARNING_RATE)?;
    let mut losses = Vec::new();
    for iter in 0..max_iters {
        opt.set_lr(get_lr(iter));
        if iter % EVAL_INTERVAL == 0 {
            let (x, y) = get_batch(val_data);
            let val = tch::no_grad(|| {
                model.forward(&x).view([-1, vocab]).cross_entropy_for_logits(&y.view([-1]))
            });
            println!("step {iter}: val loss {:.4}", f64::try_from(&val)?);
        }
        let (xb, yb) = get_batch(train_data);
        let logits = model.forward(&xb);
        let loss = logits.view([-1, vocab]).cross_entropy_for_logits(&yb.view([-1]));
        opt.zero_grad();
        loss.backward();
        opt.clip_grad_norm(1.0);
        opt.step();
        losses.push(f64::try_from(&loss)?);
    }
    Ok(losses)
}

pub fn run() -> anyhow::Result<()> {
    let text = std::fs::read_to_string("data/input.txt")?;
    let mut chars: Vec<char> = text.chars().collect();
    chars.sort();
    chars.dedup();
    let ids: Vec<i64> = text.chars().map(|c| chars.binary_search(&c).unwrap() as i64).collect();
    let data = Tensor::from_slice(&ids);
    let n = (0.9 * ids.len() as f64) as i64;
    let (train_data, val_data) = (data.narrow(0, 0, n), data.narrow(0, n, ids.len() as i64 - n));
    let max_iters = std::env::var("MAX_ITERS").ok().and_then(|v| v.parse().ok()).unwrap_or(20);
    let losses = train(&train_data, &val_data, chars.len() as i64, max_iters)?;
    if let Ok(dir) = std::env::var("LOSSES") {
        let rank = std::env::var("RANK").unwrap_or_else(|_| "0".into());
        std::fs::write(format!("{dir}/losses.rank{rank}.json"), format!("{losses:?}"))?;
    }
    Ok(())
}
