//! nanoGPT's loop as train.py writes it: `while True`, `iter_num += 1`, leaving at
//! `max_iters`; the learning rate bound by `let` first. Each process draws its own batches.
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

fn get_batch(data: &Tensor, block: i64, batch: i64) -> (Tensor, Tensor) {
    let ix = Tensor::randint(data.size()[0] - block - 1, [batch], (Kind::Int64, Device::Cpu));
    let rows: Vec<i64> = Vec::try_from(&ix).unwrap();
    let x = Tensor::stack(&rows.iter().map(|&i| data.narrow(0, i, block)).collect::<Vec<_>>(), 0);
    let y = Tensor::stack(&rows.iter().map(|&i| data.narrow(0, i + 1, block)).collect::<Vec<_>>(), 0);
    (x, y)
}

fn get_lr(it: i64) -> f64 {
    1e-2 / (1.0 + it as f64 / 10.0)
}

#[accel_core::accelerate(strategy = "ddp")]
fn train(data: &Tensor, vocab: i64) -> anyhow::Result<()> {
    tch::manual_seed(1337);
    let vs = nn::VarStore::new(Device::Cpu);
    let wte = nn::embedding(vs.root() / "wte", vocab, 16, Default::default());
    let head = nn::linear(vs.root() / "lm_head", 16, vocab, Default::default());
    let mut optimizer = nn::AdamW::default().build(&vs, 1e-2)?;
    let max_iters = 15;
    let mut iter_num = 0;
    loop {
        let lr = get_lr(iter_num);
        optimizer.set_lr(lr);
        let (x, y) = get_batch(data, 8, 4);
        let logits = head.forward(&wte.forward(&x));
        let loss = logits.view([-1, vocab]).cross_entropy_for_logits(&y.view([-1]));
        optimizer.zero_grad();
        loss.backward();
        optimizer.step();
        iter_num += 1;
        if iter_num > max_iters {
            break;
        }
    }
    Ok(())
}

pub fn run() -> anyhow::Result<()> {
    let text = std::fs::read_to_string("data/input.txt")?;
    let bytes: Vec<i64> = text.bytes().map(i64::from).collect();
    train(&Tensor::from_slice(&bytes), 256)
}
