//! Text generation as transformers' `generate` does it for one prompt: the prompt run once
//! into a key/value cache (prefill), then one token at a time; greedy or sampled, through the
//! logits processors transformers applies, in its order — repetition penalty, then (when
//! sampling) temperature, top-k and top-p — and stopped by a stop token or the length.
//!
//! Sampling draws with `multinomial` from libtorch's default generator, seeded as
//! `torch.manual_seed(seed)` seeds it: the same draws as transformers wherever the
//! probabilities agree.

use std::path::Path;

use anyhow::{Context, Result, bail};
use tch::{Kind, Tensor};

use super::{KvCache, Llama};

/// What `generate` does: transformers' `GenerationConfig`, for the keys that change which
/// tokens come out.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerationConfig {
    /// Tokens to add at most.
    pub max_new_tokens: usize,
    /// Sample from the processed distribution (else the most likely token).
    pub do_sample: bool,
    /// Logits divided by this before sampling (1: unchanged).
    pub temperature: f64,
    /// Sampling keeps the `top_k` most likely tokens (0: all). transformers' default is 50.
    pub top_k: i64,
    /// Sampling keeps the most likely tokens whose probabilities add up to `top_p` (1: all).
    pub top_p: f64,
    /// A token already in the sequence has its logit divided by this (multiplied when
    /// negative); 1: off. Applied when sampling and when greedy.
    pub repetition_penalty: f64,
    /// Generation stops after any of these (it is kept in the output).
    pub eos_token_ids: Vec<i64>,
    /// Seeds the generator before the first draw (`torch.manual_seed`).
    pub seed: Option<u64>,
}

impl Default for GenerationConfig {
    /// transformers' defaults: greedy, temperature 1, top-k 50, top-p 1, no penalty.
    fn default() -> Self {
        Self {
            max_new_tokens: 20,
            do_sample: false,
            temperature: 1.0,
            top_k: 50,
            top_p: 1.0,
            repetition_penalty: 1.0,
            eos_token_ids: Vec::new(),
            seed: None,
        }
    }
}

/// Keys of generation_config.json that change nothing here, whatever their value
/// (bookkeeping, what is returned besides the tokens, lengths the caller gives).
const INERT: &[&str] = &[
    "_from_model_config",
    "transformers_version",
    "bos_token_id",
    "pad_token_id",
    "use_cache",
    "output_attentions",
    "output_hidden_states",
    "output_scores",
    "output_logits",
    "return_dict_in_generate",
    "max_length",
    "max_new_tokens",
    "max_time",
    "length_penalty",
    "early_stopping",
];

/// Keys that would change the tokens, accepted at the value that changes nothing (null, or
/// this).
const NEUTRAL: &[(&str, f64)] = &[
    ("num_beams", 1.0),
    ("num_return_sequences", 1.0),
    ("num_beam_groups", 1.0),
    ("no_repeat_ngram_size", 0.0),
    ("encoder_no_repeat_ngram_size", 0.0),
    ("min_length", 0.0),
    ("min_new_tokens", 0.0),
    ("typical_p", 1.0),
    ("epsilon_cutoff", 0.0),
    ("eta_cutoff", 0.0),
    ("diversity_penalty", 0.0),
    ("encoder_repetition_penalty", 1.0),
    ("guidance_scale", 1.0),
];

/// Whether `value` is null, false, or the neutral `number`.
fn neutral(value: &serde_json::Value, number: Option<f64>) -> bool {
    value.is_null() || value == &serde_json::Value::Bool(false) || value.as_f64() == number
}

impl GenerationConfig {
    /// transformers' defaults overlaid with the checkpoint's `generation_config.json` (if
    /// any), its stop tokens from there or from config.json's `eos_token_id`. A key that
    /// would change the tokens and is not implemented here is refused by name.
    pub fn for_model(model: &Llama, dir: &Path) -> Result<Self> {
        let mut config =
            Self { eos_token_ids: ids(model.config.raw.get("eos_token_id"))?, ..Self::default() };
        let path = dir.join("generation_config.json");
        let Ok(text) = std::fs::read_to_string(&path) else { return Ok(config) };
        let json: serde_json::Value =
            serde_json::from_str(&text).with_context(|| format!("{}", path.display()))?;
        let map = json.as_object().with_context(|| format!("{}: not an object", path.display()))?;
        for (key, value) in map {
            let number = || {
                value.as_f64().with_context(|| format!("{}: `{key}` is {value}", path.display()))
            };
            match key.as_str() {
                "do_sample" => config.do_sample = value.as_bool().unwrap_or(false),
                "temperature" => config.temperature = number()?,
                "top_k" => config.top_k = number()? as i64,
                "top_p" => config.top_p = number()?,
                "repetition_penalty" => config.repetition_penalty = number()?,
                "eos_token_id" => config.eos_token_ids = ids(Some(value))?,
                k if INERT.contains(&k) => {}
                k if neutral(value, NEUTRAL.iter().find(|(n, _)| *n == k).map(|(_, v)| *v)) => {}
                other => bail!(
                    "{}: `{other}` = {value} is not implemented by this generator (it \
                     implements greedy and sampled decoding with temperature, top_k, top_p \
                     and repetition_penalty); refusing to generate otherwise than transformers",
                    path.display()
                ),
            }
        }
        Ok(config)
    }

    fn check(&self) -> Result<()> {
        if self.do_sample && self.temperature <= 0.0 {
            bail!("temperature {} must be above 0 when sampling", self.temperature);
        }
        if !(0.0..=1.0).contains(&self.top_p) {
            bail!("top_p {} must be within 0..=1", self.top_p);
        }
        if self.top_k < 0 || self.repetition_penalty <= 0.0 {
            bail!("top_k must be >= 0 and repetition_penalty > 0");
        }
        Ok(())
    }

    /// transformers' logits processors on `scores` [1, vocab] (fp32), given the `sequence`
    /// so far [1, T].
    pub fn process(&self, sequence: &Tensor, scores: Tensor) -> Tensor {
        let mut scores = scores;
        if self.repetition_penalty != 1.0 {
            let seen = scores.gather(1, sequence, false);
            // torch.where(score < 0, score * penalty, score / penalty)
            let seen = (&seen * self.repetition_penalty)
                .where_self(&seen.lt(0.0), &(&seen / self.repetition_penalty));
            scores = scores.scatter(1, sequence, &seen);
        }
        if !self.do_sample {
            return scores;
        }
        if self.temperature != 1.0 {
            scores /= self.temperature;
        }
        let vocab = scores.size()[1];
        if self.top_k != 0 {
            let k = self.top_k.min(vocab);
            let (top, _) = scores.topk(k, -1, true, true);
            let remove = scores.lt_tensor(&top.narrow(-1, k - 1, 1));
            scores = scores.masked_fill(&remove, f64::NEG_INFINITY);
        }
        if self.top_p < 1.0 {
            let (sorted, indices) = scores.sort(-1, false);
            let cumulative = sorted.softmax(-1, Kind::Float).cumsum(-1, Kind::Float);
            let sorted_remove = cumulative.le(1.0 - self.top_p);
            // Keep at least one token (min_tokens_to_keep).
            let _ = sorted_remove.narrow(-1, vocab - 1, 1).fill_(0);
            let remove = sorted_remove.scatter(1, &indices, &sorted_remove);
            scores = scores.masked_fill(&remove, f64::NEG_INFINITY);
        }
        scores
    }
}

/// `eos_token_id`: absent or null, one id, or a list.
fn ids(value: Option<&serde_json::Value>) -> Result<Vec<i64>> {
    match value {
        None | Some(serde_json::Value::Null) => Ok(Vec::new()),
        Some(v) if v.is_i64() => Ok(vec![v.as_i64().expect("checked")]),
        Some(serde_json::Value::Array(a)) => a
            .iter()
            .map(|i| i.as_i64().with_context(|| format!("eos_token_id holds {i}")))
            .collect(),
        Some(other) => bail!("eos_token_id is {other}, not an id or a list of ids"),
    }
}

/// What [`Llama::generate`] produced.
#[derive(Debug)]
pub struct Generated {
    /// The new tokens (a stop token included, as transformers returns it).
    pub tokens: Vec<i64>,
    /// Each step's processed scores (`[vocab]`, fp32), as transformers' `output_scores` gives
    /// them: what the choice was made from.
    pub scores: Vec<Tensor>,
    /// Bytes the key/value cache held at the end.
    pub cache_bytes: u64,
}

impl Llama {
    /// Up to `config.max_new_tokens` tokens after `prompt` (token ids), as transformers'
    /// `generate` makes them for one sequence: a key/value cache, the logits processors, a
    /// stop token ends it. No gradient is recorded.
    pub fn generate(&self, prompt: &[i64], config: &GenerationConfig) -> Result<Generated> {
        config.check()?;
        if prompt.is_empty() {
            bail!("the prompt has no tokens");
        }
        let mut sequence = Tensor::from_slice(prompt).view([1, -1]);
        self.config.check_ids(&sequence)?;
        if let Some(seed) = config.seed {
            tch::manual_seed(seed as i64);
        }
        let mut cache = KvCache::new(self.layers.len());
        let (mut tokens, mut scores) = (Vec::new(), Vec::new());
        let mut input = sequence.shallow_clone();
        tch::no_grad(|| -> Result<()> {
            for _ in 0..config.max_new_tokens {
                let logits = self.forward_cached(&input, None, &mut cache)?;
                let last = logits.select(1, -1).to_kind(Kind::Float).to_device(sequence.device());
                let processed = config.process(&sequence, last);
                let next = if config.do_sample {
                    processed.softmax(-1, Kind::Float).multinomial(1, false).view([1])
                } else {
                    processed.argmax(-1, false)
                };
                let token = next.int64_value(&[0]);
                scores.push(processed.squeeze_dim(0));
                tokens.push(token);
                input = next.view([1, 1]);
                sequence = Tensor::cat(&[&sequence, &input], 1);
                if config.eos_token_ids.contains(&token) {
                    break;
                }
            }
            Ok(())
        })?;
        Ok(Generated { tokens, scores, cache_bytes: cache.bytes() })
    }
}
