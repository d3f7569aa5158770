//! Llama as transformers' `LlamaForCausalLM` defines it (models/llama/modeling_llama.py,
//! transformers 5.22), with its checkpoint names, so that Hugging Face checkpoints load and
//! save by their own names: RMSNorm computed in fp32 with the config's eps, rotary embeddings
//! with `rope_theta` in transformers' `rotate_half` layout, grouped-query attention with
//! `num_key_value_heads` (each key/value head repeated for its group, as `repeat_kv`), eager
//! attention with the causal mask and an fp32 softmax, the SiLU-gated MLP, and the head tied
//! to the embedding or not as `tie_word_embeddings` says. Each decoder layer is an
//! `accel::Unit` (zero3 gathers it for its forward and backward, and activation
//! checkpointing recomputes it), and so are the embedding and the head.
//!
//! The command line that trains and evaluates it is `examples/llama_cli.rs` (the `llama`
//! example).

use std::path::Path;

use accel_core::Unit;
use anyhow::{Context, Result, bail};
use serde::Deserialize;
use tch::nn::Path as VarPath;
use tch::{Kind, Tensor};

/// transformers' `rope_parameters` (v5) or `rope_scaling` (v4): only the default RoPE.
#[derive(Debug, Clone, Deserialize)]
struct RopeParameters {
    #[serde(default)]
    rope_type: Option<String>,
    #[serde(default, alias = "type")]
    kind: Option<String>,
    #[serde(default)]
    rope_theta: Option<f64>,
}

/// The fields of a Llama `config.json` this model reads.
#[derive(Debug, Clone, Deserialize)]
pub struct LlamaConfig {
    /// Tokens in the vocabulary.
    pub vocab_size: i64,
    /// Width of the residual stream.
    pub hidden_size: i64,
    /// Width of the MLP.
    pub intermediate_size: i64,
    /// Decoder layers.
    pub num_hidden_layers: i64,
    /// Query heads.
    pub num_attention_heads: i64,
    /// Key/value heads (grouped-query attention); the query heads when absent.
    #[serde(default)]
    pub num_key_value_heads: Option<i64>,
    /// Width of a head; `hidden_size / num_attention_heads` when absent.
    #[serde(default)]
    pub head_dim: Option<i64>,
    /// RMSNorm's epsilon.
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    /// RoPE's base (transformers 4's top-level key).
    #[serde(default)]
    rope_theta: Option<f64>,
    /// RoPE's parameters (transformers 5).
    #[serde(default)]
    rope_parameters: Option<RopeParameters>,
    /// transformers 4's name for non-default RoPE.
    #[serde(default)]
    rope_scaling: Option<RopeParameters>,
    /// The head shares the embedding's weight.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Biases on q, k, v and o.
    #[serde(default)]
    pub attention_bias: bool,
    /// Biases in the MLP.
    #[serde(default)]
    pub mlp_bias: bool,
    /// The MLP's activation (only `silu`).
    #[serde(default = "default_act")]
    pub hidden_act: String,
    /// The embedding row that gets no gradient (`nn.Embedding`'s `padding_idx`).
    #[serde(default)]
    pub pad_token_id: Option<i64>,
    /// Standard deviation of fresh weights (transformers' `initializer_range`).
    #[serde(default = "default_init")]
    pub initializer_range: f64,
}

fn default_eps() -> f64 {
    1e-6
}
fn default_act() -> String {
    "silu".into()
}
fn default_init() -> f64 {
    0.02
}

impl LlamaConfig {
    /// Reads `dir/config.json` and checks what this model supports.
    pub fn read(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        let config: Self =
            serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        config.check().with_context(|| format!("{}", path.display()))?;
        Ok(config)
    }

    fn check(&self) -> Result<()> {
        if self.hidden_act != "silu" {
            bail!("hidden_act is {:?}; this Llama implements \"silu\"", self.hidden_act);
        }
        for rope in [&self.rope_parameters, &self.rope_scaling].into_iter().flatten() {
            let kind = rope.rope_type.as_deref().or(rope.kind.as_deref()).unwrap_or("default");
            if kind != "default" {
                bail!("RoPE type {kind:?}: this Llama implements the default RoPE only");
            }
        }
        if self.num_attention_heads % self.kv_heads() != 0 {
            bail!(
                "num_attention_heads = {} is not a multiple of num_key_value_heads = {}",
                self.num_attention_heads,
                self.kv_heads()
            );
        }
        Ok(())
    }

    /// Key/value heads.
    pub fn kv_heads(&self) -> i64 {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    /// Width of a head.
    pub fn head_dim(&self) -> i64 {
        self.head_dim.unwrap_or(self.hidden_size / self.num_attention_heads)
    }

    /// RoPE's base: `rope_parameters.rope_theta`, else `rope_theta`, else 10,000.
    pub fn rope_theta(&self) -> f64 {
        self.rope_parameters
            .as_ref()
            .and_then(|r| r.rope_theta)
            .or(self.rope_theta)
            .unwrap_or(10_000.0)
    }
}

/// How the model's variables start.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    /// As transformers initialises a fresh model: weights from N(0, initializer_range²), norms
    /// at 1, biases at 0.
    Fresh,
    /// Not at all: memory is reserved but not touched (`accel_core::nn::uninit`), for
    /// variables a checkpoint fills next.
    Uninit,
}

fn weight(p: &VarPath, name: &str, dims: &[i64], init: Init, std: f64) -> Tensor {
    match init {
        Init::Fresh => p.randn(name, dims, 0.0, std),
        Init::Uninit => accel_core::nn::uninit(p, name, dims),
    }
}

fn filled(p: &VarPath, name: &str, dims: &[i64], init: Init, value: f64) -> Tensor {
    match init {
        Init::Fresh => p.var(name, dims, tch::nn::Init::Const(value)),
        Init::Uninit => accel_core::nn::uninit(p, name, dims),
    }
}

/// `y = x Wᵀ + b`.
#[derive(Debug)]
struct Linear {
    w: Tensor,
    b: Option<Tensor>,
}

impl Linear {
    fn new(p: VarPath, n_in: i64, n_out: i64, bias: bool, init: Init, std: f64) -> Self {
        let w = weight(&p, "weight", &[n_out, n_in], init, std);
        let b = bias.then(|| filled(&p, "bias", &[n_out], init, 0.0));
        Self { w, b }
    }

    fn forward(&self, x: &Tensor) -> Tensor {
        x.linear(&self.w, self.b.as_ref())
    }
}

/// transformers' `LlamaRMSNorm`: in fp32, then back to the input's dtype, times the weight.
fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Tensor {
    let kind = x.kind();
    let h = x.to_kind(Kind::Float);
    let variance = h.pow_tensor_scalar(2).mean_dim(-1, true, Kind::Float);
    let h = h * (variance + eps).rsqrt();
    weight * h.to_kind(kind)
}

/// transformers' `rotate_half`: `cat(-x2, x1)` of the two halves of the last dimension.
fn rotate_half(x: &Tensor) -> Tensor {
    let half = x.size()[x.dim() - 1] / 2;
    let (x1, x2) = (x.narrow(-1, 0, half), x.narrow(-1, half, half));
    Tensor::cat(&[-x2, x1], -1)
}

/// One decoder layer: attention and MLP, each after an RMSNorm and added to the residual.
#[derive(Debug)]
pub struct DecoderLayer {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    gate: Linear,
    up: Linear,
    down: Linear,
    input_norm: Tensor,
    post_norm: Tensor,
    heads: i64,
    kv_heads: i64,
    head_dim: i64,
    eps: f64,
}

impl DecoderLayer {
    fn new(p: &VarPath, c: &LlamaConfig, init: Init) -> Self {
        let (h, d, std) = (c.hidden_size, c.head_dim(), c.initializer_range);
        let attn = p / "self_attn";
        let mlp = p / "mlp";
        let ab = c.attention_bias;
        Self {
            q: Linear::new(&attn / "q_proj", h, c.num_attention_heads * d, ab, init, std),
            k: Linear::new(&attn / "k_proj", h, c.kv_heads() * d, ab, init, std),
            v: Linear::new(&attn / "v_proj", h, c.kv_heads() * d, ab, init, std),
            o: Linear::new(&attn / "o_proj", c.num_attention_heads * d, h, ab, init, std),
            gate: Linear::new(&mlp / "gate_proj", h, c.intermediate_size, c.mlp_bias, init, std),
            up: Linear::new(&mlp / "up_proj", h, c.intermediate_size, c.mlp_bias, init, std),
            down: Linear::new(&mlp / "down_proj", c.intermediate_size, h, c.mlp_bias, init, std),
            input_norm: filled(&(p / "input_layernorm"), "weight", &[h], init, 1.0),
            post_norm: filled(&(p / "post_attention_layernorm"), "weight", &[h], init, 1.0),
            heads: c.num_attention_heads,
            kv_heads: c.kv_heads(),
            head_dim: d,
            eps: c.rms_norm_eps,
        }
    }

    /// `x` [B, T, hidden] → [B, T, hidden]; `cos`, `sin` [T, head_dim]; `mask` [T, T] (0 or
    /// the dtype's lowest value above the diagonal).
    pub fn forward(&self, x: &Tensor, cos: &Tensor, sin: &Tensor, mask: &Tensor) -> Tensor {
        let (b, t) = (x.size()[0], x.size()[1]);
        let h = rms_norm(x, &self.input_norm, self.eps);
        let split = |y: Tensor, n: i64| y.view([b, t, n, self.head_dim]).transpose(1, 2);
        let q = split(self.q.forward(&h), self.heads);
        let k = split(self.k.forward(&h), self.kv_heads);
        let v = split(self.v.forward(&h), self.kv_heads);
        let (cos, sin) = (cos.to_kind(q.kind()), sin.to_kind(q.kind()));
        let q = &q * &cos + rotate_half(&q) * &sin;
        let k = &k * &cos + rotate_half(&k) * &sin;
        // `repeat_kv`: each key/value head serves `heads / kv_heads` consecutive query heads.
        let groups = self.heads / self.kv_heads;
        let repeat =
            |y: Tensor| {
                if groups == 1 {
                    return y;
                }
                y.unsqueeze(2)
                    .expand([b, self.kv_heads, groups, t, self.head_dim], false)
                    .reshape([b, self.heads, t, self.head_dim])
            };
        let (k, v) = (repeat(k), repeat(v));
        let scores = q.matmul(&k.transpose(2, 3)) * (self.head_dim as f64).powf(-0.5);
        let mask = mask.to_kind(scores.kind());
        let scores = scores + mask;
        let weights = scores.softmax(-1, Kind::Float).to_kind(q.kind());
        let attn = weights.matmul(&v).transpose(1, 2).contiguous().reshape([b, t, -1]);
        let x = x + self.o.forward(&attn);
        let h = rms_norm(&x, &self.post_norm, self.eps);
        let mlp = self.down.forward(&(self.gate.forward(&h).silu() * self.up.forward(&h)));
        x + mlp
    }
}

/// `LlamaForCausalLM`.
#[derive(Debug)]
pub struct Llama {
    /// The configuration it was built from.
    pub config: LlamaConfig,
    /// The embedding's weight, a unit of its own (zero3 shards it like a layer's).
    embed: Unit<Tensor>,
    layers: Vec<Unit<DecoderLayer>>,
    norm: Tensor,
    /// `None` when tied to the embedding.
    lm_head: Option<Unit<Tensor>>,
}

impl Llama {
    /// The model's variables under `root`, by transformers' names (`model.layers.{i}.…`,
    /// `lm_head.weight`), started as `init` says.
    pub fn new(root: &VarPath, config: &LlamaConfig, init: Init) -> Self {
        let model = root / "model";
        let (h, std) = (config.hidden_size, config.initializer_range);
        let embed_path = &model / "embed_tokens";
        let embed = weight(&embed_path, "weight", &[config.vocab_size, h], init, std);
        let embed = Unit::new(&embed_path, embed);
        let layers = (0..config.num_hidden_layers)
            .map(|i| {
                let p = &model / "layers" / i;
                Unit::new(&p, DecoderLayer::new(&p, config, init))
            })
            .collect();
        let norm = filled(&(&model / "norm"), "weight", &[h], init, 1.0);
        let lm_head = (!config.tie_word_embeddings).then(|| {
            let path = root / "lm_head";
            Unit::new(&path, weight(&path, "weight", &[config.vocab_size, h], init, std))
        });
        Self { config: config.clone(), embed, layers, norm, lm_head }
    }

    /// Logits [B, T, vocab] of `input_ids` [B, T] (int64).
    pub fn forward(&self, input_ids: &Tensor) -> Tensor {
        let t = input_ids.size()[1];
        let device = input_ids.device();
        let padding = self.config.pad_token_id.unwrap_or(-1);
        let x = self.embed.run(|w| Tensor::embedding(w, input_ids, padding, false, false));
        // RoPE: inv_freq = 1 / theta^(2i/d); emb = cat(freqs, freqs) for positions 0..T.
        let d = self.config.head_dim();
        let exponents = Tensor::arange_start_step(0, d, 2, (Kind::Int64, device))
            .to_kind(Kind::Float)
            / d as f64;
        let inv_freq = Tensor::pow_scalar(self.config.rope_theta(), &exponents).reciprocal();
        let positions = Tensor::arange(t, (Kind::Float, device));
        let freqs = positions.unsqueeze(-1) * inv_freq.unsqueeze(0);
        let emb = Tensor::cat(&[&freqs, &freqs], -1);
        let (cos, sin) = (emb.cos(), emb.sin());
        let mask = Tensor::full([t, t], f32::MIN as f64, (Kind::Float, device)).triu(1);
        let mut x = x;
        for layer in &self.layers {
            // Owned copies: a checkpointed layer runs its forward again in backward.
            let (cos, sin, mask) = (cos.shallow_clone(), sin.shallow_clone(), mask.shallow_clone());
            x = layer.run_on(&x, move |l, x| l.forward(x, &cos, &sin, &mask));
        }
        let x = rms_norm(&x, &self.norm, self.config.rms_norm_eps);
        self.lm_head.as_ref().unwrap_or(&self.embed).run(|w| x.linear::<Tensor>(w, None))
    }

    /// transformers' loss with `labels = input_ids`: the mean cross-entropy of the logits at
    /// positions 0..T-1 against the ids at 1..T, in fp32.
    pub fn loss(logits: &Tensor, input_ids: &Tensor) -> Tensor {
        let (b, t, v) = (logits.size()[0], logits.size()[1], logits.size()[2]);
        let logits = logits.narrow(1, 0, t - 1).to_kind(Kind::Float).reshape([b * (t - 1), v]);
        let targets = input_ids.narrow(1, 1, t - 1).reshape([b * (t - 1)]);
        logits.cross_entropy_for_logits(&targets)
    }
}
