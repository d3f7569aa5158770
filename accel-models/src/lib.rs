//! The decoder families people fine-tune — Llama 1–3.x, Qwen2/2.5, Qwen3, Mistral — as
//! transformers computes them, loaded from and saved to Hugging Face folders by their own
//! tensor names, with accel's [`Unit`](accel_core::Unit) boundaries marked (each decoder
//! layer, the embedding, the head) for zero3 sharding and activation checkpointing.
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
//! The exact math, per family and RoPE type, with transformers' file:line, is in
//! `python/reference/MODELS.md`; `examples/tests/parity.rs` compares every family with
//! transformers.

pub mod llama;
pub mod lora;

pub use llama::{Family, Init, Llama, LlamaConfig, Rope};
pub use lora::{LoraConfig, LoraInit};
