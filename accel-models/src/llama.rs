//! The decoder-only families people fine-tune, as transformers 5.22 computes them (eager
//! attention, fp32): `LlamaForCausalLM` (Llama 1, 2, 3.x), `Qwen2ForCausalLM`,
//! `Qwen3ForCausalLM` and `MistralForCausalLM`, with their checkpoint names, so that Hugging
//! Face checkpoints load and save by their own names. RMSNorm in fp32 with the config's eps,
//! rotary embeddings in transformers' `rotate_half` layout with every RoPE type these
//! families use (default, linear, dynamic, llama3, yarn), grouped-query attention
//! (`repeat_kv`), eager attention with the causal mask — within a sliding window on the
//! layers that slide (Qwen2/3 per `layer_types`, Mistral on all) — and an fp32 softmax,
//! Qwen2's q/k/v biases, Qwen3's per-head q/k norms, the SiLU-gated MLP, and the head tied to
//! the embedding or not. Each decoder layer is an `accel_core::Unit` (zero3 gathers it for its
//! forward and backward, and activation checkpointing recomputes it), and so are the
//! embedding and the head.
//!
//! Closed world: a config.json is read only when every key is one this model honours or
//! knows to change nothing (`LlamaConfig::parse`), and a checkpoint only when its tensors are
//! exactly the model's (`Llama::check_checkpoint`); anything else is refused by name.
//!
//! The command line that trains and evaluates it is `examples/llama_cli.rs` (the `llama`
//! example).

use std::path::Path;

use accel_core::Unit;
use anyhow::{Context, Result, bail};
use tch::nn::Path as VarPath;
use tch::{Kind, Tensor};

/// The decoder families this model computes exactly as transformers does (their forwards
/// differ only in biases, Qwen3's per-head q/k norms and sliding windows).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// `LlamaForCausalLM` (Llama 1, 2, 3.x).
    Llama,
    /// `Qwen2ForCausalLM` (Qwen2, Qwen2.5): q/k/v biases, optional sliding windows per layer.
    Qwen2,
    /// `Qwen3ForCausalLM`: RMSNorm of each head's query and key before RoPE.
    Qwen3,
    /// `MistralForCausalLM`: a sliding window on every layer.
    Mistral,
}

impl Family {
    const ALL: [Family; 4] = [Family::Llama, Family::Qwen2, Family::Qwen3, Family::Mistral];

    /// config.json's `model_type`.
    pub fn model_type(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
            Family::Mistral => "mistral",
        }
    }

    /// The class `architectures` names.
    pub fn class(self) -> &'static str {
        match self {
            Family::Llama => "LlamaForCausalLM",
            Family::Qwen2 => "Qwen2ForCausalLM",
            Family::Qwen3 => "Qwen3ForCausalLM",
            Family::Mistral => "MistralForCausalLM",
        }
    }

    /// Keys of config.json that change this family's computation (each is honoured).
    fn math_keys(self) -> Vec<&'static str> {
        const COMMON: &[&str] = &[
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "rms_norm_eps",
            "hidden_act",
            "tie_word_embeddings",
            "rope_parameters",
            "rope_scaling",
            "rope_theta",
            "partial_rotary_factor",
            "max_position_embeddings",
            "original_max_position_embeddings",
        ];
        let extra: &[&str] = match self {
            Family::Llama => &["attention_bias", "mlp_bias"],
            Family::Qwen2 => {
                &["use_sliding_window", "sliding_window", "max_window_layers", "layer_types"]
            }
            Family::Qwen3 => &[
                "attention_bias",
                "use_sliding_window",
                "sliding_window",
                "max_window_layers",
                "layer_types",
            ],
            Family::Mistral => &["sliding_window"],
        };
        extra.iter().chain(COMMON).copied().collect()
    }

    /// Keys transformers' class for this family reads but which change nothing it computes
    /// (or which it ignores: Qwen2 and Mistral have no `attention_bias` field).
    fn inert_keys(self) -> &'static [&'static str] {
        match self {
            Family::Llama | Family::Qwen3 => &["pretraining_tp"],
            Family::Qwen2 => &["pretraining_tp", "attention_bias", "mlp_bias"],
            Family::Mistral => &[
                "pretraining_tp",
                "attention_bias",
                "mlp_bias",
                "use_sliding_window",
                "max_window_layers",
                "layer_types",
            ],
        }
    }
}

/// Keys of every transformers config that change no computation here: names, token ids,
/// generation defaults, output switches, saving metadata.
const GENERIC_KEYS: &[&str] = &[
    "architectures",
    "model_type",
    "transformers_version",
    "dtype",
    "torch_dtype",
    "use_cache",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "sep_token_id",
    "decoder_start_token_id",
    "initializer_range",
    "attention_dropout",
    "_name_or_path",
    "return_dict",
    "output_hidden_states",
    "output_attentions",
    "torchscript",
    "use_bfloat16",
    "tf_legacy_loss",
    "pruned_heads",
    "tie_encoder_decoder",
    "is_decoder",
    "is_encoder_decoder",
    "add_cross_attention",
    "cross_attention_hidden_size",
    "chunk_size_feed_forward",
    "finetuning_task",
    "id2label",
    "label2id",
    "tokenizer_class",
    "prefix",
    "task_specific_params",
    "problem_type",
    "max_length",
    "min_length",
    "do_sample",
    "early_stopping",
    "num_beams",
    "num_beam_groups",
    "diversity_penalty",
    "temperature",
    "top_k",
    "top_p",
    "typical_p",
    "repetition_penalty",
    "length_penalty",
    "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size",
    "bad_words_ids",
    "num_return_sequences",
    "output_scores",
    "return_dict_in_generate",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "remove_invalid_values",
    "exponential_decay_length_penalty",
    "suppress_tokens",
    "begin_suppress_tokens",
];

/// How positions turn into rotations (transformers' `rope_type`).
#[derive(Debug, Clone, PartialEq)]
pub enum Rope {
    /// `inv_freq = 1/θ^(2k/d)`.
    Default,
    /// Positions divided by `factor`.
    Linear {
        /// The divisor.
        factor: f64,
    },
    /// NTK-aware: θ grows once a sequence is longer than `max_position_embeddings` (as a
    /// fresh transformers model computes it; transformers also keeps the grown θ for later,
    /// shorter calls of the same module).
    Dynamic {
        /// How fast θ grows with the length.
        factor: f64,
    },
    /// Llama 3.1/3.2's: low frequencies divided by `factor`, high ones kept, a ramp between.
    Llama3 {
        /// The divisor of the low frequencies.
        factor: f64,
        /// Wavelengths above `original / low_freq_factor` are divided.
        low_freq_factor: f64,
        /// Wavelengths below `original / high_freq_factor` are kept.
        high_freq_factor: f64,
        /// `original_max_position_embeddings`.
        original: f64,
    },
    /// YaRN: a ramp between interpolated and extrapolated frequencies, cos/sin scaled.
    Yarn {
        /// The interpolation's divisor.
        factor: f64,
        /// `original_max_position_embeddings`.
        original: f64,
        /// The factor on cos and sin.
        attention_factor: f64,
        /// Rotations where the ramp starts.
        beta_fast: f64,
        /// Rotations where the ramp ends.
        beta_slow: f64,
        /// Whether the ramp's ends are rounded to whole frequencies.
        truncate: bool,
    },
}

/// A Llama-family `config.json`, read in a closed world: every key either changes the
/// computation and is honoured, or is known to change nothing; anything else is refused.
#[derive(Debug, Clone)]
pub struct LlamaConfig {
    /// Which family (from `model_type`).
    pub family: Family,
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
    /// Key/value heads (grouped-query attention), with the family's default when absent.
    pub num_key_value_heads: i64,
    /// Width of a head, with the family's default when absent.
    pub head_dim: i64,
    /// RMSNorm's epsilon.
    pub rms_norm_eps: f64,
    /// RoPE's base.
    pub rope_theta: f64,
    /// RoPE's type and parameters.
    pub rope: Rope,
    /// `max_position_embeddings` (read by dynamic RoPE).
    pub max_position_embeddings: i64,
    /// The head shares the embedding's weight.
    pub tie_word_embeddings: bool,
    /// Biases on q, k and v.
    pub qkv_bias: bool,
    /// A bias on o.
    pub o_bias: bool,
    /// Biases in the MLP.
    pub mlp_bias: bool,
    /// Qwen3's RMSNorm of each head's query and key.
    pub qk_norm: bool,
    /// Each layer's sliding window (`None`: full causal attention).
    pub windows: Vec<Option<i64>>,
    /// The embedding row that gets no gradient (`nn.Embedding`'s `padding_idx`).
    pub pad_token_id: Option<i64>,
    /// Standard deviation of fresh weights (transformers' `initializer_range`).
    pub initializer_range: f64,
    /// Dropout on the attention weights in training (refused by the trainer when above 0).
    pub attention_dropout: f64,
    /// The config.json it was read from, written back by [`Llama::save_pretrained`].
    raw: serde_json::Value,
}

type Json = serde_json::Map<String, serde_json::Value>;

fn get_f64(map: &Json, key: &str) -> Result<Option<f64>> {
    match map.get(key) {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(v) => v.as_f64().map(Some).with_context(|| format!("`{key}` is {v}, not a number")),
    }
}

fn get_i64(map: &Json, key: &str) -> Result<Option<i64>> {
    match map.get(key) {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(v) => v.as_i64().map(Some).with_context(|| format!("`{key}` is {v}, not an integer")),
    }
}

fn get_bool(map: &Json, key: &str) -> Result<Option<bool>> {
    match map.get(key) {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(v) => v.as_bool().map(Some).with_context(|| format!("`{key}` is {v}, not true/false")),
    }
}

fn need_i64(map: &Json, key: &str) -> Result<i64> {
    get_i64(map, key)?.with_context(|| format!("`{key}` is missing"))
}

impl LlamaConfig {
    /// Reads `dir/config.json` and checks that this model computes what it describes.
    pub fn read(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        Self::parse(&text).with_context(|| format!("{}", path.display()))
    }

    /// [`LlamaConfig::read`] of the text of a config.json.
    pub fn parse(text: &str) -> Result<Self> {
        let value: serde_json::Value = serde_json::from_str(text).context("not JSON")?;
        let map = value.as_object().context("not a JSON object")?;
        let supported =
            || Family::ALL.iter().map(|f| f.model_type()).collect::<Vec<_>>().join(", ");
        let model_type = map
            .get("model_type")
            .and_then(|v| v.as_str())
            .with_context(|| format!("no `model_type`; this model computes {}", supported()))?;
        let family =
            Family::ALL.into_iter().find(|f| f.model_type() == model_type).with_context(|| {
                format!(
                    "model_type {model_type:?} is not a family this model computes ({}); \
                     refusing to load it as one of them",
                    supported()
                )
            })?;
        if let Some(archs) = map.get("architectures").and_then(|v| v.as_array()) {
            for arch in archs {
                if arch.as_str() != Some(family.class()) {
                    bail!(
                        "architectures names {arch}, but this model is {} (a causal language \
                         model with its head); refusing to load another class's weights",
                        family.class()
                    );
                }
            }
        }
        let unknown: Vec<&str> = map
            .keys()
            .map(String::as_str)
            .filter(|k| {
                !family.math_keys().contains(k)
                    && !family.inert_keys().contains(k)
                    && !GENERIC_KEYS.contains(k)
            })
            .collect();
        if !unknown.is_empty() {
            bail!(
                "{} not a key this {model_type} model knows: it may change what the model \
                 computes, so the checkpoint is refused rather than computed otherwise",
                unknown.iter().map(|k| format!("`{k}`")).collect::<Vec<_>>().join(", ")
                    + if unknown.len() == 1 { " is" } else { " are" }
            );
        }
        let hidden_act = map.get("hidden_act").and_then(|v| v.as_str()).unwrap_or("silu");
        if hidden_act != "silu" && hidden_act != "swish" {
            bail!("hidden_act is {hidden_act:?}; this model implements \"silu\"");
        }
        let hidden_size = need_i64(map, "hidden_size")?;
        let num_attention_heads = need_i64(map, "num_attention_heads")?;
        let num_hidden_layers = need_i64(map, "num_hidden_layers")?;
        let vocab_size = need_i64(map, "vocab_size")?;
        let intermediate_size = need_i64(map, "intermediate_size")?;
        for (key, value) in [
            ("hidden_size", hidden_size),
            ("num_attention_heads", num_attention_heads),
            ("num_hidden_layers", num_hidden_layers),
            ("vocab_size", vocab_size),
            ("intermediate_size", intermediate_size),
        ] {
            if value <= 0 {
                bail!("`{key}` is {value}; it must be at least 1");
            }
        }
        // Absent and null differ: an absent key takes the class's default (transformers'
        // dataclass fields), null means "as many as the query heads".
        let num_key_value_heads = match (map.contains_key("num_key_value_heads"), family) {
            (false, Family::Llama) => num_attention_heads,
            (false, Family::Qwen2 | Family::Qwen3) => 32,
            (false, Family::Mistral) => 8,
            (true, _) => get_i64(map, "num_key_value_heads")?.unwrap_or(num_attention_heads),
        };
        if num_key_value_heads <= 0 || num_attention_heads % num_key_value_heads != 0 {
            bail!(
                "num_attention_heads = {num_attention_heads} is not a multiple of \
                 num_key_value_heads = {num_key_value_heads}{}",
                if map.contains_key("num_key_value_heads") {
                    ""
                } else {
                    " (absent: the family's default)"
                }
            );
        }
        let head_dim = match (get_i64(map, "head_dim")?, family) {
            (Some(d), _) => d,
            (None, Family::Qwen3) if !map.contains_key("head_dim") => 128,
            (None, Family::Qwen2 | Family::Qwen3) if map.contains_key("head_dim") => {
                bail!("`head_dim` is null, which transformers' {} does not accept", family.class())
            }
            (None, _) => hidden_size / num_attention_heads,
        };
        if head_dim <= 0 || head_dim % 2 != 0 {
            bail!("head_dim is {head_dim}; RoPE needs a positive even width");
        }
        let max_position_embeddings =
            get_i64(map, "max_position_embeddings")?.unwrap_or(match family {
                Family::Llama => 2048,
                Family::Qwen2 | Family::Qwen3 => 32768,
                Family::Mistral => 131072,
            });
        let (rope_theta, rope) = Self::rope(map, max_position_embeddings)?;
        let attention_bias = get_bool(map, "attention_bias")?.unwrap_or(false);
        let (qkv_bias, o_bias, mlp_bias) = match family {
            Family::Llama => {
                (attention_bias, attention_bias, get_bool(map, "mlp_bias")?.unwrap_or(false))
            }
            Family::Qwen2 => (true, false, false),
            Family::Qwen3 => (attention_bias, attention_bias, false),
            Family::Mistral => (false, false, false),
        };
        let windows = Self::windows(map, family, num_hidden_layers)?;
        Ok(Self {
            family,
            vocab_size,
            hidden_size,
            intermediate_size,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rms_norm_eps: get_f64(map, "rms_norm_eps")?.unwrap_or(1e-6),
            rope_theta,
            rope,
            max_position_embeddings,
            tie_word_embeddings: get_bool(map, "tie_word_embeddings")?.unwrap_or(false),
            qkv_bias,
            o_bias,
            mlp_bias,
            qk_norm: family == Family::Qwen3,
            windows,
            pad_token_id: get_i64(map, "pad_token_id")?,
            initializer_range: get_f64(map, "initializer_range")?.unwrap_or(0.02),
            attention_dropout: get_f64(map, "attention_dropout")?.unwrap_or(0.0),
            raw: value.clone(),
        })
    }

    /// RoPE's base and type, from `rope_parameters` (transformers 5) or `rope_scaling` +
    /// `rope_theta` (transformers 4), as transformers' `convert_rope_params_to_dict` reads
    /// them.
    fn rope(map: &Json, max_positions: i64) -> Result<(f64, Rope)> {
        let nested = match (map.get("rope_scaling"), map.get("rope_parameters")) {
            (Some(serde_json::Value::Object(o)), _) if !o.is_empty() => o.clone(),
            (_, Some(serde_json::Value::Object(o))) => o.clone(),
            (_, None | Some(serde_json::Value::Null)) => Json::new(),
            (_, Some(other)) => bail!("`rope_parameters` is {other}, not an object"),
        };
        const ROPE_KEYS: &[&str] = &[
            "rope_type",
            "type",
            "rope_theta",
            "factor",
            "original_max_position_embeddings",
            "low_freq_factor",
            "high_freq_factor",
            "attention_factor",
            "beta_fast",
            "beta_slow",
            "mscale",
            "mscale_all_dim",
            "truncate",
            "partial_rotary_factor",
        ];
        if nested.keys().any(|k| k == "full_attention" || k == "sliding_attention") {
            bail!("per-layer-type `rope_parameters` are not supported by these families");
        }
        if let Some(k) = nested.keys().find(|k| !ROPE_KEYS.contains(&k.as_str())) {
            bail!("rope parameter `{k}` is not one this model knows; refusing the checkpoint");
        }
        for partial in
            [get_f64(&nested, "partial_rotary_factor")?, get_f64(map, "partial_rotary_factor")?]
                .into_iter()
                .flatten()
        {
            if partial != 1.0 {
                bail!(
                    "partial_rotary_factor = {partial}: only a full rotation (1.0) is implemented"
                );
            }
        }
        let theta =
            get_f64(&nested, "rope_theta")?.or(get_f64(map, "rope_theta")?).unwrap_or(10_000.0);
        let kind = nested
            .get("rope_type")
            .or(nested.get("type"))
            .and_then(|v| v.as_str())
            .unwrap_or("default")
            .to_owned();
        let factor = || -> Result<f64> {
            let f = get_f64(&nested, "factor")?
                .with_context(|| format!("RoPE type {kind:?} needs `factor`"))?;
            if !(f > 0.0 && f.is_finite()) {
                bail!("RoPE `factor` is {f}; it must be positive");
            }
            Ok(f)
        };
        // The top-level key wins once transformers builds the model; then the nested one;
        // then max_position_embeddings.
        let original = get_f64(map, "original_max_position_embeddings")?
            .or(get_f64(&nested, "original_max_position_embeddings")?)
            .unwrap_or(max_positions as f64);
        let rope = match kind.as_str() {
            "default" => Rope::Default,
            "linear" => Rope::Linear { factor: factor()? },
            "dynamic" => Rope::Dynamic { factor: factor()? },
            "llama3" => {
                let need = |k: &str| -> Result<f64> {
                    get_f64(&nested, k)?
                        .with_context(|| format!("RoPE type \"llama3\" needs `{k}`"))
                };
                let (low, high) = (need("low_freq_factor")?, need("high_freq_factor")?);
                if high <= low {
                    bail!("RoPE llama3: high_freq_factor {high} must exceed low_freq_factor {low}");
                }
                Rope::Llama3 {
                    factor: factor()?,
                    low_freq_factor: low,
                    high_freq_factor: high,
                    original,
                }
            }
            "yarn" => {
                let factor = match get_f64(&nested, "factor")? {
                    Some(f) => f,
                    None => max_positions as f64 / original,
                };
                let mscale = |scale: f64, m: f64| {
                    if scale <= 1.0 { 1.0 } else { 0.1 * m * scale.ln() + 1.0 }
                };
                let attention_factor = match get_f64(&nested, "attention_factor")? {
                    Some(a) => a,
                    None => {
                        match (get_f64(&nested, "mscale")?, get_f64(&nested, "mscale_all_dim")?) {
                            (Some(m), Some(a)) if m != 0.0 && a != 0.0 => {
                                mscale(factor, m) / mscale(factor, a)
                            }
                            _ => mscale(factor, 1.0),
                        }
                    }
                };
                let or = |k: &str, d: f64| -> Result<f64> {
                    Ok(get_f64(&nested, k)?.filter(|v| *v != 0.0).unwrap_or(d))
                };
                Rope::Yarn {
                    factor,
                    original,
                    attention_factor,
                    beta_fast: or("beta_fast", 32.0)?,
                    beta_slow: or("beta_slow", 1.0)?,
                    truncate: get_bool(&nested, "truncate")?.unwrap_or(true),
                }
            }
            other => bail!(
                "RoPE type {other:?} is not implemented (default, linear, dynamic, llama3 and \
                 yarn are); refusing the checkpoint"
            ),
        };
        Ok((theta, rope))
    }

    /// Each layer's sliding window, as transformers' Qwen2/Qwen3/Mistral configs decide it.
    fn windows(map: &Json, family: Family, layers: i64) -> Result<Vec<Option<i64>>> {
        let layers = layers as usize;
        let window = |default: Option<i64>| -> Result<Option<i64>> {
            let w = if map.contains_key("sliding_window") {
                get_i64(map, "sliding_window")?
            } else {
                default
            };
            if let Some(w) = w.filter(|w| *w <= 0) {
                bail!("sliding_window is {w}; it must be at least 1");
            }
            Ok(w)
        };
        match family {
            Family::Llama => Ok(vec![None; layers]),
            Family::Mistral => Ok(vec![window(Some(4096))?; layers]),
            Family::Qwen2 | Family::Qwen3 => {
                let use_window = get_bool(map, "use_sliding_window")?.unwrap_or(false);
                let window = if use_window { window(Some(4096))? } else { None };
                let types: Vec<String> = match map.get("layer_types") {
                    None | Some(serde_json::Value::Null) => {
                        let full = get_i64(map, "max_window_layers")?.unwrap_or(28).max(0) as usize;
                        (0..layers)
                            .map(|i| {
                                if window.is_some() && i >= full {
                                    "sliding_attention"
                                } else {
                                    "full_attention"
                                }
                                .to_owned()
                            })
                            .collect()
                    }
                    Some(v) => serde_json::from_value(v.clone())
                        .context("`layer_types` is not a list of strings")?,
                };
                if types.len() != layers {
                    bail!("layer_types has {} entries for {layers} layers", types.len());
                }
                types
                    .iter()
                    .enumerate()
                    .map(|(i, t)| match t.as_str() {
                        "full_attention" => Ok(None),
                        "sliding_attention" => window.map(Some).with_context(|| {
                            format!(
                                "layer {i} is \"sliding_attention\" but there is no window \
                                 (use_sliding_window false or sliding_window null); \
                                 transformers fails on this configuration too"
                            )
                        }),
                        other => bail!("layer {i}'s type {other:?} is not implemented"),
                    })
                    .collect()
            }
        }
    }

    /// Key/value heads.
    pub fn kv_heads(&self) -> i64 {
        self.num_key_value_heads
    }

    /// Width of a head.
    pub fn head_dim(&self) -> i64 {
        self.head_dim
    }

    /// RoPE's inverse frequencies for sequences of `t` tokens, and the factor on cos/sin.
    fn inv_freq(&self, t: i64, device: tch::Device) -> (Tensor, f64) {
        let d = self.head_dim;
        let exponents = Tensor::arange_start_step(0, d, 2, (Kind::Int64, device))
            .to_kind(Kind::Float)
            / d as f64;
        let base = |theta: f64| Tensor::pow_scalar(theta, &exponents).reciprocal();
        let inv = base(self.rope_theta);
        match self.rope {
            Rope::Default => (inv, 1.0),
            Rope::Linear { factor } => (inv / factor, 1.0),
            Rope::Dynamic { factor } => {
                let mpe = self.max_position_embeddings as f64;
                if (t as f64) <= mpe {
                    return (inv, 1.0);
                }
                let d = d as f64;
                let theta = self.rope_theta
                    * ((factor * t as f64 / mpe) - (factor - 1.0)).powf(d / (d - 2.0));
                (base(theta), 1.0)
            }
            Rope::Llama3 { factor, low_freq_factor, high_freq_factor, original } => {
                let (low_wavelen, high_wavelen) =
                    (original / low_freq_factor, original / high_freq_factor);
                let wavelen = inv.reciprocal() * (2.0 * std::f64::consts::PI);
                let divided = &inv / factor;
                let smooth = (wavelen.reciprocal() * original - low_freq_factor)
                    / (high_freq_factor - low_freq_factor);
                let smoothed: Tensor = (-&smooth + 1.0) * &divided + &smooth * &inv;
                let low = wavelen.gt(low_wavelen);
                let high = wavelen.lt(high_wavelen);
                let out = smoothed.where_self(&high.logical_not(), &inv);
                (divided.where_self(&low, &out), 1.0)
            }
            Rope::Yarn { factor, original, attention_factor, beta_fast, beta_slow, truncate } => {
                let dim = d as f64;
                let ln_theta = self.rope_theta.ln();
                let corr = |rot: f64| {
                    dim * (original / (rot * 2.0 * std::f64::consts::PI)).ln() / (2.0 * ln_theta)
                };
                let (mut low, mut high) = (corr(beta_fast), corr(beta_slow));
                if truncate {
                    (low, high) = (low.floor(), high.ceil());
                }
                let (low, mut high) = (low.max(0.0), high.min(dim - 1.0));
                if low == high {
                    high += 0.001;
                }
                let ramp = ((Tensor::arange(d / 2, (Kind::Float, device)) - low) / (high - low))
                    .clamp(0.0, 1.0);
                let extrapolation = 1.0 - ramp;
                let interpolation = &inv / factor;
                let inv = interpolation * (1.0 - &extrapolation) + &inv * &extrapolation;
                (inv, attention_factor)
            }
        }
    }

    /// Refuses token ids outside the vocabulary, naming the first one and where it is.
    pub fn check_ids(&self, ids: &Tensor) -> Result<()> {
        if ids.kind() != Kind::Int64 || ids.dim() != 2 {
            bail!("input_ids must be int64 [rows, tokens], is {:?} {:?}", ids.kind(), ids.size());
        }
        let bad = ids.lt(0).logical_or(&ids.ge(self.vocab_size));
        if bad.any().int64_value(&[]) != 0 {
            let at = bad.nonzero();
            let (row, col) = (at.int64_value(&[0, 0]), at.int64_value(&[0, 1]));
            bail!(
                "token id {} at row {row}, position {col} is outside the vocabulary (0..{})",
                ids.int64_value(&[row, col]),
                self.vocab_size
            );
        }
        Ok(())
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

/// `y = x Wᵀ + b`, plus `(x Aᵀ Bᵀ) · scale` once a LoRA adapter is attached.
#[derive(Debug)]
pub(crate) struct Linear {
    w: Tensor,
    b: Option<Tensor>,
    /// A [r, in], B [out, r] and the scale (crate::lora).
    lora: std::sync::Mutex<Option<(Tensor, Tensor, f64)>>,
}

impl Linear {
    fn new(p: VarPath, n_in: i64, n_out: i64, bias: bool, init: Init, std: f64) -> Self {
        let w = weight(&p, "weight", &[n_out, n_in], init, std);
        let b = bias.then(|| filled(&p, "bias", &[n_out], init, 0.0));
        Self { w, b, lora: Default::default() }
    }

    fn forward(&self, x: &Tensor) -> Tensor {
        let y = x.linear(&self.w, self.b.as_ref());
        match &*self.lora.lock().unwrap_or_else(|e| e.into_inner()) {
            Some((a, b, scale)) => {
                y + x.linear::<Tensor>(a, None).linear::<Tensor>(b, None) * *scale
            }
            None => y,
        }
    }

    /// (out, in).
    pub(crate) fn shape(&self) -> (i64, i64) {
        let size = self.w.size();
        (size[0], size[1])
    }

    pub(crate) fn attach(&self, a: Tensor, b: Tensor, scale: f64) -> Result<()> {
        let mut lora = self.lora.lock().unwrap_or_else(|e| e.into_inner());
        if lora.is_some() {
            bail!("this projection already has an adapter");
        }
        *lora = Some((a, b, scale));
        Ok(())
    }

    /// `W ← W + scale · B A`; the adapter is detached.
    pub(crate) fn merge(&self) -> Result<()> {
        if let Some((a, b, scale)) = self.lora.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let delta = b.to_kind(self.w.kind()).matmul(&a.to_kind(self.w.kind())) * scale;
            let _ = self.w.shallow_clone().f_add_(&delta)?;
        }
        Ok(())
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
    /// Qwen3's per-head RMSNorm weights of queries and keys ([head_dim] each).
    qk_norm: Option<(Tensor, Tensor)>,
    /// This layer's sliding window (index into the masks `forward` gets).
    sliding: bool,
    heads: i64,
    kv_heads: i64,
    head_dim: i64,
    eps: f64,
}

impl DecoderLayer {
    fn new(p: &VarPath, c: &LlamaConfig, index: usize, init: Init) -> Self {
        let (h, d, std) = (c.hidden_size, c.head_dim(), c.initializer_range);
        let attn = p / "self_attn";
        let mlp = p / "mlp";
        let (qkv, o, m) = (c.qkv_bias, c.o_bias, c.mlp_bias);
        let qk_norm = c.qk_norm.then(|| {
            (
                filled(&(&attn / "q_norm"), "weight", &[d], init, 1.0),
                filled(&(&attn / "k_norm"), "weight", &[d], init, 1.0),
            )
        });
        Self {
            q: Linear::new(&attn / "q_proj", h, c.num_attention_heads * d, qkv, init, std),
            k: Linear::new(&attn / "k_proj", h, c.kv_heads() * d, qkv, init, std),
            v: Linear::new(&attn / "v_proj", h, c.kv_heads() * d, qkv, init, std),
            o: Linear::new(&attn / "o_proj", c.num_attention_heads * d, h, o, init, std),
            gate: Linear::new(&mlp / "gate_proj", h, c.intermediate_size, m, init, std),
            up: Linear::new(&mlp / "up_proj", h, c.intermediate_size, m, init, std),
            down: Linear::new(&mlp / "down_proj", c.intermediate_size, h, m, init, std),
            input_norm: filled(&(p / "input_layernorm"), "weight", &[h], init, 1.0),
            post_norm: filled(&(p / "post_attention_layernorm"), "weight", &[h], init, 1.0),
            qk_norm,
            sliding: c.windows.get(index).copied().flatten().is_some(),
            heads: c.num_attention_heads,
            kv_heads: c.kv_heads(),
            head_dim: d,
            eps: c.rms_norm_eps,
        }
    }

    /// `x` [B, T, hidden] → [B, T, hidden]; `cos`, `sin` [T, head_dim]; `masks` [T, T] (0 or
    /// the dtype's lowest value where a query may not look): causal, and causal within the
    /// sliding window for layers that slide.
    pub fn forward(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        masks: &(Tensor, Tensor),
    ) -> Tensor {
        let (b, t) = (x.size()[0], x.size()[1]);
        let h = rms_norm(x, &self.input_norm, self.eps);
        let split = |y: Tensor, n: i64| y.view([b, t, n, self.head_dim]).transpose(1, 2);
        let (mut q, mut k) =
            (split(self.q.forward(&h), self.heads), split(self.k.forward(&h), self.kv_heads));
        if let Some((q_norm, k_norm)) = &self.qk_norm {
            // Over each head's width, before RoPE (Qwen3).
            q = rms_norm(&q, q_norm, self.eps);
            k = rms_norm(&k, k_norm, self.eps);
        }
        let mask = if self.sliding { &masks.1 } else { &masks.0 };
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
    /// `lm_head.weight`), started as `init` says; the embedding, each decoder layer and the
    /// head are units of `acc`, the accelerator that prepares the model.
    pub fn new(
        acc: &impl AsRef<accel_core::PendingUnits>,
        root: &VarPath,
        config: &LlamaConfig,
        init: Init,
    ) -> Self {
        let model = root / "model";
        let (h, std) = (config.hidden_size, config.initializer_range);
        let embed_path = &model / "embed_tokens";
        let embed = weight(&embed_path, "weight", &[config.vocab_size, h], init, std);
        let embed = Unit::new(acc, &embed_path, embed);
        let layers = (0..config.num_hidden_layers)
            .map(|i| {
                let p = &model / "layers" / i;
                Unit::new(acc, &p, DecoderLayer::new(&p, config, i as usize, init))
            })
            .collect();
        let norm = filled(&(&model / "norm"), "weight", &[h], init, 1.0);
        let lm_head = (!config.tie_word_embeddings).then(|| {
            let path = root / "lm_head";
            Unit::new(acc, &path, weight(&path, "weight", &[config.vocab_size, h], init, std))
        });
        Self { config: config.clone(), embed, layers, norm, lm_head }
    }

    /// Logits [B, T, vocab] of `input_ids` [B, T] (int64).
    pub fn forward(&self, input_ids: &Tensor) -> Tensor {
        let t = input_ids.size()[1];
        let device = input_ids.device();
        let padding = self.config.pad_token_id.unwrap_or(-1);
        let x = self.embed.run(|w| Tensor::embedding(w, input_ids, padding, false, false));
        // RoPE: positions × inv_freq; emb = cat(freqs, freqs) for positions 0..T.
        let (inv_freq, scale) = self.config.inv_freq(t, device);
        let positions = Tensor::arange(t, (Kind::Float, device));
        let freqs = positions.unsqueeze(-1) * inv_freq.unsqueeze(0);
        let emb = Tensor::cat(&[&freqs, &freqs], -1);
        let (cos, sin) = if scale == 1.0 {
            (emb.cos(), emb.sin())
        } else {
            (emb.cos() * scale, emb.sin() * scale)
        };
        let causal = Tensor::full([t, t], f32::MIN as f64, (Kind::Float, device)).triu(1);
        // Query i sees key j when j <= i and i - j < window (transformers' masking_utils).
        let window = self.config.windows.iter().flatten().next().copied();
        let sliding = match window {
            Some(w) => {
                let far = Tensor::full([t, t], f32::MIN as f64, (Kind::Float, device)).tril(-w);
                causal.minimum(&far)
            }
            None => causal.shallow_clone(),
        };
        let masks = (causal, sliding);
        let mut x = x;
        for layer in &self.layers {
            // Owned copies: a checkpointed layer runs its forward again in backward.
            let (cos, sin) = (cos.shallow_clone(), sin.shallow_clone());
            let masks = (masks.0.shallow_clone(), masks.1.shallow_clone());
            x = layer.run_on(&x, move |l, x| l.forward(x, &cos, &sin, &masks));
        }
        let x = rms_norm(&x, &self.norm, self.config.rms_norm_eps);
        self.lm_head
            .as_ref()
            .unwrap_or(&self.embed)
            .run_with(&x, |w, x| x.linear::<Tensor>(w, None))
    }

    /// The model of Hugging Face folder `dir` (config.json, `model.safetensors` or an index
    /// and its shards), its variables in `vs`, prepared by `acc` for training: under zero3
    /// each process reads only its shards' bytes. The family comes from config.json; what
    /// the model does not compute exactly is refused ([`LlamaConfig::parse`],
    /// [`Llama::check_checkpoint`]). Every process calls it.
    pub fn from_pretrained(
        acc: &accel_core::Accelerator,
        vs: &tch::nn::VarStore,
        dir: impl AsRef<Path>,
    ) -> Result<Self> {
        let dir = dir.as_ref();
        let model = Self::new(acc, &vs.root(), &LlamaConfig::read(dir)?, Init::Uninit);
        model.check_checkpoint(vs, dir)?;
        acc.prepare_model_from_checkpoint(vs, dir)?;
        Ok(model)
    }

    /// The base of a LoRA fine-tune: the model of folder `dir` (as
    /// [`Llama::from_pretrained`]) with every variable frozen before `acc` prepares it, so
    /// that under zero3/fsdp the base is sharded at rest — each process reads and keeps only
    /// its shards, and gathers one layer at a time — and gets no gradient or optimizer
    /// state. Attach the adapters to it ([`Llama::attach_lora`]) in a VarStore of their own.
    pub fn from_pretrained_frozen(
        acc: &accel_core::Accelerator,
        vs: &mut tch::nn::VarStore,
        dir: impl AsRef<Path>,
    ) -> Result<Self> {
        let dir = dir.as_ref();
        let model = Self::new(acc, &vs.root(), &LlamaConfig::read(dir)?, Init::Uninit);
        model.check_checkpoint(vs, dir)?;
        vs.freeze();
        acc.prepare_model_from_checkpoint(vs, dir)?;
        Ok(model)
    }

    /// [`Llama::from_pretrained`] without preparing: each process holds the whole model
    /// (evaluation).
    pub fn load_pretrained(
        acc: &accel_core::Accelerator,
        vs: &tch::nn::VarStore,
        dir: impl AsRef<Path>,
    ) -> Result<Self> {
        let dir = dir.as_ref();
        let model = Self::new(acc, &vs.root(), &LlamaConfig::read(dir)?, Init::Uninit);
        model.check_checkpoint(vs, dir)?;
        acc.load_checkpoint_in_model(vs, dir)?;
        Ok(model)
    }

    /// Writes the model in `vs` as a folder transformers' `from_pretrained` loads: the
    /// weights by their names (in files of at most `max_shard_size` bytes, with an index
    /// beyond one), and the config.json it came from, its `dtype` saying what the files
    /// hold. Every process calls it; the main process writes.
    pub fn save_pretrained(
        &self,
        acc: &accel_core::Accelerator,
        vs: &tch::nn::VarStore,
        out: impl AsRef<Path>,
        max_shard_size: u64,
    ) -> Result<()> {
        let out = out.as_ref();
        acc.save_model(vs, out, max_shard_size)?;
        if acc.is_main_process() {
            let saved = vs.variables().values().next().map_or(Kind::Float, |t| t.kind());
            let dtype = match saved {
                Kind::BFloat16 => "bfloat16",
                Kind::Half => "float16",
                _ => "float32",
            };
            let mut json = self.config.raw.clone();
            if let Some(map) = json.as_object_mut() {
                map.insert("dtype".into(), dtype.into());
                if map.contains_key("torch_dtype") {
                    map.insert("torch_dtype".into(), dtype.into());
                }
            }
            let path = out.join("config.json");
            std::fs::write(&path, serde_json::to_string_pretty(&json)? + "\n")
                .with_context(|| format!("writing {}", path.display()))?;
        }
        Ok(())
    }

    /// Every projection by its module name (`model.layers.0.self_attn.q_proj`), in order.
    pub(crate) fn projections(&self) -> Vec<(String, &Linear)> {
        let mut all = Vec::new();
        for (i, layer) in self.layers.iter().enumerate() {
            let l = layer.inner();
            let attn = format!("model.layers.{i}.self_attn");
            let mlp = format!("model.layers.{i}.mlp");
            for (name, linear) in
                [("q_proj", &l.q), ("k_proj", &l.k), ("v_proj", &l.v), ("o_proj", &l.o)]
            {
                all.push((format!("{attn}.{name}"), linear));
            }
            for (name, linear) in
                [("gate_proj", &l.gate), ("up_proj", &l.up), ("down_proj", &l.down)]
            {
                all.push((format!("{mlp}.{name}"), linear));
            }
        }
        all
    }

    /// Refuses a checkpoint folder whose tensors are not exactly this model's: every tensor
    /// of the folder must be a variable of `vs` (built by [`Llama::new`], before preparing)
    /// and every variable must be in the folder — named as transformers' load report names
    /// them (`model.layers.{0, 1}.self_attn.q_norm.weight`). transformers drops unexpected
    /// tensors and initialises missing ones at random; a model that computes something else
    /// than its checkpoint says is refused here instead. (`rotary_emb.inv_freq`, which old
    /// checkpoints hold and transformers ignores, is ignored too.) With tied embeddings, an
    /// `lm_head.weight` equal to the embedding is accepted.
    pub fn check_checkpoint(&self, vs: &tch::nn::VarStore, dir: &Path) -> Result<()> {
        let checkpoint = accel_core::HfCheckpoint::open(dir)?;
        let variables = vs.variables();
        let mut unexpected: Vec<String> = checkpoint
            .names()
            .filter(|n| !variables.contains_key(*n) && !n.ends_with("rotary_emb.inv_freq"))
            .map(str::to_owned)
            .collect();
        if self.config.tie_word_embeddings && unexpected.iter().any(|n| n == "lm_head.weight") {
            let head = checkpoint.read("lm_head.weight")?;
            let embed = checkpoint.read("model.embed_tokens.weight")?;
            if head.size() == embed.size() && head.equal(&embed) {
                unexpected.retain(|n| n != "lm_head.weight");
            }
        }
        let mut missing: Vec<String> =
            variables.keys().filter(|n| checkpoint.shape(n).is_none()).cloned().collect();
        missing.sort();
        if unexpected.is_empty() && missing.is_empty() {
            return Ok(());
        }
        let mut why = Vec::new();
        if !unexpected.is_empty() {
            why.push(format!(
                "UNEXPECTED (in the checkpoint, not in this {} model): {}",
                self.config.family.class(),
                group_layers(&unexpected)
            ));
        }
        if !missing.is_empty() {
            why.push(format!(
                "MISSING (in the model, not in the checkpoint): {}",
                group_layers(&missing)
            ));
        }
        bail!(
            "{}: the checkpoint's tensors are not this model's; {}. Nothing was loaded",
            dir.display(),
            why.join("; ")
        )
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

/// `model.layers.{0, 1}.self_attn.q_norm.weight`: names that differ only in the layer index,
/// merged as transformers' load report merges them.
fn group_layers(names: &[String]) -> String {
    let mut groups: Vec<(String, Vec<String>)> = Vec::new();
    for name in names {
        let (pattern, index) = match name.split_once(".layers.") {
            Some((head, rest)) => match rest.split_once('.') {
                Some((i, tail)) if i.parse::<usize>().is_ok() => {
                    (format!("{head}.layers.{{}}.{tail}"), Some(i.to_owned()))
                }
                _ => (name.clone(), None),
            },
            None => (name.clone(), None),
        };
        match groups.iter_mut().find(|(p, _)| *p == pattern) {
            Some((_, indices)) => indices.extend(index),
            None => groups.push((pattern, index.into_iter().collect())),
        }
    }
    groups
        .into_iter()
        .map(|(pattern, indices)| {
            if indices.is_empty() {
                pattern
            } else {
                pattern.replace("{}", &format!("{{{}}}", indices.join(", ")))
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// meta-llama/Llama-3.1-8B's config.json as published (transformers 4 keys).
    const LLAMA_3_1_8B: &str = r#"{
      "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
      "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
      "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072,
      "mlp_bias": false, "model_type": "llama", "num_attention_heads": 32,
      "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
      "rms_norm_eps": 1e-05,
      "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192, "rope_type": "llama3"},
      "rope_theta": 500000.0, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
      "transformers_version": "4.43.0.dev0", "use_cache": true, "vocab_size": 128256}"#;

    /// Qwen/Qwen2.5-0.5B's config.json as published.
    const QWEN2_5_0_5B: &str = r#"{
      "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
      "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 896,
      "initializer_range": 0.02, "intermediate_size": 4864, "max_position_embeddings": 32768,
      "max_window_layers": 24, "model_type": "qwen2", "num_attention_heads": 14,
      "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
      "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": true,
      "torch_dtype": "bfloat16", "transformers_version": "4.40.1", "use_cache": true,
      "use_sliding_window": false, "vocab_size": 151936}"#;

    #[test]
    fn published_configs_read_as_transformers_reads_them() {
        let c = LlamaConfig::parse(LLAMA_3_1_8B).unwrap();
        assert_eq!(
            (c.family, c.head_dim, c.num_key_value_heads, c.rope_theta),
            (Family::Llama, 128, 8, 5e5)
        );
        assert_eq!(
            c.rope,
            Rope::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original: 8192.0
            }
        );
        assert!(!c.qkv_bias && c.windows.iter().all(Option::is_none));
        let c = LlamaConfig::parse(QWEN2_5_0_5B).unwrap();
        assert_eq!((c.family, c.head_dim, c.num_key_value_heads), (Family::Qwen2, 64, 2));
        // use_sliding_window false: no layer slides, whatever sliding_window says.
        assert!(c.qkv_bias && !c.o_bias && c.tie_word_embeddings);
        assert!(c.windows.iter().all(Option::is_none));
    }

    #[test]
    fn absent_keys_take_each_familys_defaults() {
        let base = |t: &str| {
            format!(
                r#"{{"model_type": "{t}", "hidden_size": 64, "num_attention_heads": 32,
                "num_hidden_layers": 2, "vocab_size": 10, "intermediate_size": 8}}"#
            )
        };
        let c = LlamaConfig::parse(&base("llama")).unwrap();
        assert_eq!((c.num_key_value_heads, c.head_dim, c.max_position_embeddings), (32, 2, 2048));
        let c = LlamaConfig::parse(&base("mistral")).unwrap();
        assert_eq!((c.num_key_value_heads, c.windows[0]), (8, Some(4096)));
        let c = LlamaConfig::parse(&base("qwen3")).unwrap();
        assert_eq!((c.num_key_value_heads, c.head_dim, c.qk_norm), (32, 128, true));
    }

    #[test]
    fn what_the_model_does_not_compute_is_refused_by_name() {
        let refused = |edit: &str| {
            let text = LLAMA_3_1_8B.replacen('{', &format!("{{{edit},"), 1);
            format!("{:#}", LlamaConfig::parse(&text).unwrap_err())
        };
        assert!(refused(r#""logits_scaling": 8"#).contains("`logits_scaling` is not a key"));
        let e = format!(
            "{:#}",
            LlamaConfig::parse(&LLAMA_3_1_8B.replace("\"llama\"", "\"gemma\"")).unwrap_err()
        );
        assert!(e.contains("model_type \"gemma\" is not a family"), "{e}");
        let e = format!(
            "{:#}",
            LlamaConfig::parse(
                &LLAMA_3_1_8B.replace("\"rope_type\": \"llama3\"", "\"rope_type\": \"longrope\"")
            )
            .unwrap_err()
        );
        assert!(e.contains("\"longrope\" is not implemented"), "{e}");
        let e = format!(
            "{:#}",
            LlamaConfig::parse(
                &LLAMA_3_1_8B.replace("\"num_key_value_heads\": 8", "\"num_key_value_heads\": 5")
            )
            .unwrap_err()
        );
        assert!(e.contains("not a multiple of num_key_value_heads = 5"), "{e}");
        assert!(refused(r#""partial_rotary_factor": 0.5"#).contains("partial_rotary_factor = 0.5"));
    }

    #[test]
    fn load_report_names_merge_layer_indices() {
        let names: Vec<String> = ["model.layers.0.a.bias", "model.layers.1.a.bias", "model.extra"]
            .map(String::from)
            .to_vec();
        assert_eq!(group_layers(&names), "model.layers.{0, 1}.a.bias, model.extra");
    }
}
