//! The GPT-style character model of the `char_lm` example and the `lm_bench` benchmark
//! (python/reference/accelerate_lm.py builds the same in PyTorch), written once for every
//! layout: with a [`TensorParallel`] of one rank it is an ordinary transformer; with more,
//! its attention heads, MLP and vocabulary are split Megatron-style (and with sequence
//! parallelism its norms run on a part of the sequence); a pipeline stage builds only its
//! own layers (embeddings, blocks, head); with a [`ContextParallel`] of several ranks each
//! runs on its part of every sequence, attention exchanging heads by all-to-all.
//!
//! Each layer is initialised from `seed + its index`, so every layout holds exactly the
//! weights of the one-process model built with the same seed.

use std::ops::Range;

use accel_core::strategy::cp::ContextParallel;
use accel_core::strategy::tp::{
    ColumnParallelLinear, LinearOptions, RowParallelLinear, TensorParallel, VocabParallelEmbedding,
    gather_from_region, parallel_layer_norm, vocab_parallel_token_losses,
};
use accel_core::{PendingUnits, Unit};
use anyhow::{Result, bail};
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
    /// Layer `i` is initialised from `seed + i`.
    pub seed: u64,
}

impl GptConfig {
    /// Layers of the model as pipeline stages see it: embeddings, each block, the head.
    pub fn layers(&self) -> usize {
        self.blocks as usize + 2
    }
}

/// A pre-norm transformer block: causal self-attention, then a 4x MLP. Its heads and the
/// MLP's hidden units are split across the tensor ranks; the query, key and value rows of
/// each head are side by side (`[heads, q k v, head width]`), so a rank's slice of the rows
/// holds whole heads.
#[derive(Debug)]
pub struct Block {
    ln1: nn::LayerNorm,
    qkv: ColumnParallelLinear,
    proj: RowParallelLinear,
    ln2: nn::LayerNorm,
    up: ColumnParallelLinear,
    down: RowParallelLinear,
    /// Heads on this rank.
    heads: i64,
    /// The ranks holding the other parts of each sequence (attention spans them all).
    cp: ContextParallel,
}

impl Block {
    /// The block's variables under `p`.
    pub fn new(
        tp: &TensorParallel,
        cp: &ContextParallel,
        p: &nn::Path,
        width: i64,
        heads: i64,
    ) -> Result<Self> {
        if heads % tp.size() as i64 != 0 {
            bail!("{heads} heads do not divide among {} tensor-parallel ranks", tp.size());
        }
        let local = heads / tp.size() as i64;
        let options = LinearOptions::default();
        Ok(Self {
            ln1: parallel_layer_norm(tp, &(p / "ln1"), width)?,
            qkv: ColumnParallelLinear::new(tp, &(p / "qkv"), width, 3 * width, options)?,
            proj: RowParallelLinear::new(tp, &(p / "proj"), width, width, options)?,
            ln2: parallel_layer_norm(tp, &(p / "ln2"), width)?,
            up: ColumnParallelLinear::new(tp, &(p / "up"), width, 4 * width, options)?,
            down: RowParallelLinear::new(tp, &(p / "down"), 4 * width, width, options)?,
            heads: local,
            cp: cp.clone(),
        })
    }
}

impl Module for Block {
    fn forward(&self, x: &Tensor) -> Tensor {
        let qkv = x.apply(&self.ln1).apply(&self.qkv);
        let (b, t, local) = qkv.size3().expect("[batch, time, 3 × local width]");
        let head_width = local / 3 / self.heads;
        let qkv = qkv.view([b, t, self.heads, 3, head_width]);
        let part = |i: i64| qkv.select(3, i);
        // Causal attention over the whole sequence (with context parallelism, the other
        // ranks' positions too) for this rank's positions: [batch, time, heads, width].
        let attended = (self.cp.attention(&part(0), &part(1), &part(2), true))
            .unwrap_or_else(|e| panic!("attention: {e}"));
        let merged = attended.contiguous().view([b, t, self.heads * head_width]);
        let x = x + merged.apply(&self.proj);
        let mlp = x.apply(&self.ln2).apply(&self.up).gelu("tanh").apply(&self.down);
        x + mlp
    }
}

/// Token and position embeddings, blocks (each an [`Unit`]), a final norm and the head — or
/// the part of them one pipeline stage holds.
#[derive(Debug)]
pub struct Gpt {
    tp: TensorParallel,
    cp: ContextParallel,
    tokens: Option<(VocabParallelEmbedding, nn::Embedding)>,
    blocks: Vec<Unit<Block>>,
    head: Option<(nn::LayerNorm, ColumnParallelLinear)>,
}

impl Gpt {
    /// The whole model's variables under `p`, its blocks units of `acc` (the accelerator
    /// that prepares it).
    pub fn new(acc: &impl AsRef<PendingUnits>, p: &nn::Path, c: &GptConfig) -> Result<Self> {
        Self::stage(acc, p, c, &TensorParallel::single(), 0..c.layers())
    }

    /// The `layers` of the model (0: embeddings, 1..=blocks: the blocks, then the head),
    /// split across `tp`'s ranks.
    pub fn stage(
        acc: &impl AsRef<PendingUnits>,
        p: &nn::Path,
        c: &GptConfig,
        tp: &TensorParallel,
        layers: Range<usize>,
    ) -> Result<Self> {
        Self::split(acc, p, c, tp, &ContextParallel::single(), layers)
    }

    /// [`stage`](Self::stage), each rank of `cp` running on its part of every sequence
    /// (inputs and targets from [`ContextParallel::shard`]).
    pub fn split(
        acc: &impl AsRef<PendingUnits>,
        p: &nn::Path,
        c: &GptConfig,
        tp: &TensorParallel,
        cp: &ContextParallel,
        layers: Range<usize>,
    ) -> Result<Self> {
        let last = c.layers() - 1;
        let seeded = |i: usize| tch::manual_seed((c.seed + i as u64) as i64);
        let tokens = match layers.contains(&0) {
            true => {
                seeded(0);
                let tokens = VocabParallelEmbedding::new(tp, &(p / "tokens"), c.vocab, c.width, 1)?;
                let positions =
                    nn::embedding(p / "positions", c.context, c.width, Default::default());
                if tp.sequence_parallel() {
                    tp.mark_sequence_parallel(&positions.ws)?;
                }
                Some((tokens, positions))
            }
            false => None,
        };
        let mut blocks = Vec::new();
        for i in layers.clone().filter(|&i| i >= 1 && i < last) {
            seeded(i);
            let path = p / "blocks" / (i - 1);
            blocks.push(Unit::new(acc, &path, Block::new(tp, cp, &path, c.width, c.heads)?));
        }
        let head = match layers.contains(&last) {
            true => {
                seeded(last);
                let ln = parallel_layer_norm(tp, &(p / "ln"), c.width)?;
                let options = LinearOptions::default();
                Some((ln, ColumnParallelLinear::new(tp, &(p / "head"), c.width, c.vocab, options)?))
            }
            false => None,
        };
        Ok(Self { tp: tp.clone(), cp: cp.clone(), tokens, blocks, head })
    }

    /// This stage's layers on `x`: token ids `[batch, time]` on the first stage, hidden
    /// states elsewhere; on the last stage the logits `[batch, time, vocab / T]` (this tensor
    /// rank's part of the vocabulary). With context parallelism `time` is this rank's part
    /// of the sequence.
    pub fn forward_stage(&self, x: &Tensor) -> Tensor {
        let mut x = match &self.tokens {
            Some((tokens, positions)) => {
                let t = x.size()[1];
                let mut pos = self.cp.positions(t, x.device()).apply(positions);
                if self.tp.sequence_parallel() {
                    // Each rank adds the positions of its part of the sequence.
                    let part = t / self.tp.size() as i64;
                    pos = pos.narrow(0, self.tp.rank() as i64 * part, part);
                }
                x.apply(tokens) + pos
            }
            None => x.shallow_clone(),
        };
        for block in &self.blocks {
            x = block.forward(&x);
        }
        match &self.head {
            Some((ln, head)) => x.apply(ln).apply(head),
            None => x,
        }
    }

    /// Each token's cross-entropy, from this rank's part of the logits.
    pub fn token_losses(&self, logits: &Tensor, targets: &Tensor) -> Tensor {
        vocab_parallel_token_losses(&self.tp, logits, targets)
            .unwrap_or_else(|e| panic!("vocab-parallel cross-entropy: {e}"))
    }

    /// The mean cross-entropy, from this rank's part of the logits.
    pub fn loss(&self, logits: &Tensor, targets: &Tensor) -> Tensor {
        self.token_losses(logits, targets).mean(Kind::Float)
    }

    /// The logits over the whole vocabulary (gathered from the tensor ranks).
    pub fn whole_logits(&self, logits: &Tensor) -> Tensor {
        gather_from_region(&self.tp, logits).unwrap_or_else(|e| panic!("gathering logits: {e}"))
    }
}

impl Module for Gpt {
    /// Logits `[batch, time, vocab]` for token ids `[batch, time]` (the whole model; with
    /// context parallelism each rank runs its part of the sequence, and the parts are
    /// gathered, without gradients).
    fn forward(&self, ids: &Tensor) -> Tensor {
        let part = self.cp.shard(ids, 1).unwrap_or_else(|e| panic!("{e}"));
        let logits = self.whole_logits(&self.forward_stage(&part));
        self.cp.gather(&logits, 1).unwrap_or_else(|e| panic!("gathering logits: {e}"))
    }
}
