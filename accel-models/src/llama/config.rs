//! A family's `config.json`, read in a closed world ([`LlamaConfig::parse`]): the family, its
//! shapes, RoPE's type and parameters (and the inverse frequencies they give), sliding
//! windows per layer.

use std::path::Path;

use anyhow::{Context, Result, bail};
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
    pub(super) raw: serde_json::Value,
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
        crate::read_config(dir, "config.json", Self::parse)
    }

    /// [`LlamaConfig::read`] of the text of a config.json.
    pub fn parse(text: &str) -> Result<Self> {
        let value: serde_json::Value = serde_json::from_str(text).context("not JSON")?;
        let map = value.as_object().context("not a JSON object")?;
        let family = Self::family(map)?;
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
        let (num_key_value_heads, head_dim) =
            Self::heads(map, family, hidden_size, num_attention_heads)?;
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

    /// The family `map` (a config.json) names, once its class and every key are ones this
    /// model knows.
    fn family(map: &Json) -> Result<Family> {
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
        Ok(family)
    }

    /// Key/value heads and the width of a head, with the family's defaults where absent.
    fn heads(
        map: &Json,
        family: Family,
        hidden_size: i64,
        num_attention_heads: i64,
    ) -> Result<(i64, i64)> {
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
        Ok((num_key_value_heads, head_dim))
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
    pub(super) fn inv_freq(&self, t: i64, device: tch::Device) -> (Tensor, f64) {
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
