//! The GPT-style character model of the `char_lm` example and the `lm_bench` benchmark
//! (python/reference/accelerate_lm.py builds the same in PyTorch).

use accel_core::Unit;
use tch::nn::{self, Module};
use tch::{Kind, Tensor};

/// Sizes of a [`Gpt`].
#[derive(Debug, Clone, Copy)]
pub struct GptConfig {
    /// Distinct tokens.
    pub vocab: i64,
    /// Positions (the longest input).
    pub context: i64,
    /// Model width.
    pub width: i64,
    /// Transformer blocks.
    pub blocks: i64,
    /// Attention heads (divide the width).
    pub heads: i64,
}

/// A pre-norm transformer block: causal self-attention, then a 4x MLP.
#[derive(Debug)]
pub struct Block {
    ln1: nn::LayerNorm,
    qkv: nn::Linear,
    proj: nn::Linear,
    ln2: nn::LayerNorm,
    up: nn::Linear,
    down: nn::Linear,
    heads: i64,
}

impl Block {
    /// The block's variables under `p`.
    pub fn new(p: &nn::Path, width: i64, heads: i64) -> Self {
        let linear = |name: &str, i, o| nn::linear(p / name, i, o, Default::default());
        Self {
            ln1: nn::layer_norm(p / "ln1", vec![width], Default::default()),
            qkv: linear("qkv", width, 3 * width),
            proj: linear("proj", width, width),
            ln2: nn::layer_norm(p / "ln2", vec![width], Default::default()),
            up: linear("up", width, 4 * width),
            down: linear("down", 4 * width, width),
            heads,
        }
    }
}

impl Module for Block {
    fn forward(&self, x: &Tensor) -> Tensor {
        let (b, t, c) = x.size3().expect("[batch, time, width]");
        let heads = |y: &Tensor| y.view([b, t, self.heads, c / self.heads]).transpose(1, 2);
        let qkv = x.apply(&self.ln1).apply(&self.qkv).split(c, 2);
        let attended = Tensor::scaled_dot_product_attention::<Tensor>(
            &heads(&qkv[0]),
            &heads(&qkv[1]),
            &heads(&qkv[2]),
            None,
            0.0,
            true,
            None,
            false,
        );
        let x = x + attended.transpose(1, 2).contiguous().view([b, t, c]).apply(&self.proj);
        let mlp = x.apply(&self.ln2).apply(&self.up).gelu("tanh").apply(&self.down);
        x + mlp
    }
}

/// Token and position embeddings, blocks (each an [`Unit`]), a final norm and the head.
#[derive(Debug)]
pub struct Gpt {
    tokens: nn::Embedding,
    positions: nn::Embedding,
    blocks: Vec<Unit<Block>>,
    ln: nn::LayerNorm,
    head: nn::Linear,
}

impl Gpt {
    /// The model's variables under `p`.
    pub fn new(p: &nn::Path, c: &GptConfig) -> Self {
        let blocks = (0..c.blocks)
            .map(|i| {
                let path = p / "blocks" / i;
                Unit::new(&path, Block::new(&path, c.width, c.heads))
            })
            .collect();
        Self {
            tokens: nn::embedding(p / "tokens", c.vocab, c.width, Default::default()),
            positions: nn::embedding(p / "positions", c.context, c.width, Default::default()),
            blocks,
            ln: nn::layer_norm(p / "ln", vec![c.width], Default::default()),
            head: nn::linear(p / "head", c.width, c.vocab, Default::default()),
        }
    }
}

impl Module for Gpt {
    /// Logits `[batch, time, vocab]` for token ids `[batch, time]`.
    fn forward(&self, ids: &Tensor) -> Tensor {
        let t = ids.size()[1];
        let positions = Tensor::arange(t, (Kind::Int64, ids.device()));
        let mut x = ids.apply(&self.tokens) + positions.apply(&self.positions);
        for block in &self.blocks {
            x = block.forward(&x);
        }
        x.apply(&self.ln).apply(&self.head)
    }
}
