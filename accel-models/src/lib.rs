//! The decoder families people fine-tune — Llama 1–3.x, Qwen2/2.5, Qwen3, Mistral — as
//! transformers computes them, loaded from and saved to Hugging Face folders by their own
//! tensor names, with accel's [`Unit`](accel_core::Unit) boundaries marked (each decoder
//! layer, the embedding, the head) for zero3 sharding and activation checkpointing; their
//! generation as transformers' `generate` does it ([`Llama::generate`]); and big-model
//! inference by a device map ([`device_map`], [`Llama::dispatch`]).
//!
//! ```no_run
//! # fn main() -> anyhow::Result<()> {
//! use accel_models::llama::Llama;
//!
//! let acc = accel_core::Accelerator::builder().strategy(accel_core::Strategy::Zero3).build()?;
//! let vs = tch::nn::VarStore::new(acc.device());
//! // The family is read from config.json; anything the model does not compute exactly
//! // (another model_type, an unknown config key, a tensor it has no place for) is refused.
//! let model = Llama::from_pretrained(&acc, &vs, "checkpoints/Qwen2.5-0.5B")?;
//! let ids = tch::Tensor::from_slice(&[1i64, 2, 3]).view([1, 3]).to_device(acc.device());
//! model.config.check_ids(&ids)?;
//! let logits = acc.forward(|| model.forward(&ids))?;
//! # let _ = logits;
//! model.save_pretrained(&acc, &vs, "out", 5_000_000_000)?;
//! # Ok(()) }
//! ```
//!
//! A model bigger than memory, generating under a budget, the rest on the disk:
//!
//! ```no_run
//! # fn main() -> anyhow::Result<()> {
//! use accel_models::device_map::{MaxMemory, infer_auto_device_map};
//! use accel_models::llama::{GenerationConfig, Llama, LlamaConfig, modules};
//!
//! let acc = accel_core::Accelerator::builder().cpu(true).build()?;
//! let vs = tch::nn::VarStore::new(acc.device());
//! let dir = std::path::Path::new("checkpoints/Llama-3.2-1B");
//! let budget = MaxMemory::parse("2GiB", 0)?;
//! let map = infer_auto_device_map(&modules(&LlamaConfig::read(dir)?, tch::Kind::Float), &budget);
//! println!("{map}"); // {'model.embed_tokens': 'cpu', ..., 'lm_head': 'disk'}
//! let model = Llama::dispatch(&acc, &vs, dir, &map, None, tch::Kind::Float)?;
//! let config = GenerationConfig { max_new_tokens: 32, ..GenerationConfig::for_model(&model, dir)? };
//! let out = model.generate(&[128000, 791, 6460], &config)?;
//! println!("{:?}", out.tokens);
//! # Ok(()) }
//! ```
//!
//! The exact math, per family and RoPE type, with transformers' file:line, is in
//! `python/reference/MODELS.md`; `examples/tests/parity.rs` compares every family with
//! transformers.

pub mod device_map;
pub mod llama;
pub mod lora;

pub use llama::{
    Attention, Family, Generated, GenerationConfig, Init, KvCache, Llama, LlamaConfig, Rope,
};
pub use lora::{LoraConfig, LoraInit};

/// `parse` of the text of file `name` in `dir` (a config.json), errors naming the file.
fn read_config<T>(
    dir: &std::path::Path,
    name: &str,
    parse: impl FnOnce(&str) -> anyhow::Result<T>,
) -> anyhow::Result<T> {
    use anyhow::Context;
    let path = dir.join(name);
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    parse(&text).with_context(|| format!("{}", path.display()))
}
