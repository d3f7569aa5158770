//! Procedural macros of accel, used through `accel-core` (which re-exports them):
//! the `#[accelerate(...)]` attribute and `#[derive(ToDevice)]`.
//!
//! Each macro is a thin entry that forwards to an `expand` function over
//! `proc_macro2::TokenStream`, so the logic can be unit-tested.

mod accelerate;
mod to_device;

use proc_macro::TokenStream;

/// Implements `accel_core::ToDevice` for a struct or enum by moving every field to the
/// device (`to_device`), or pinning it for a GPU (`pin_memory`). Fields marked `#[to_device(skip)]` are kept as they are (for fields that hold
/// no tensor and do not implement `ToDevice`). Type parameters get a `ToDevice` bound.
///
/// ```text
/// #[derive(ToDevice)]
/// struct Batch { images: Tensor, labels: Tensor, #[to_device(skip)] ids: Vec<String> }
/// ```
#[proc_macro_derive(ToDevice, attributes(to_device))]
pub fn derive_to_device(input: TokenStream) -> TokenStream {
    to_device::expand(input.into()).unwrap_or_else(syn::Error::into_compile_error).into()
}

/// Turns a single-device tch training function into one that runs on any setup: one CPU,
/// one GPU, or the processes of `accel launch` / torchrun, with the given strategy,
/// precision and gradient accumulation. See the README of accel-core for the rules.
///
/// ```text
/// #[accelerate(strategy = "ddp", precision = "bf16", accumulate = 4)]
/// fn train(data: &Data) -> anyhow::Result<()> { ... }
/// ```
///
/// Keys: `strategy` (single, ddp, zero1, zero2, zero3, fsdp), `sharding` (fsdp only),
/// `precision` (no, fp16, bf16, fp8; under fp8 the body's `nn::linear(..)` calls become
/// `accelerator.linear(..)`), `fp8_recipe` (tensorwise, rowwise), `accumulate`, `clip_grad_norm`, `seed`, `cpu`,
/// `offload`, `data` (prepared, manual: who deals the batches), `broadcast_buffers`,
/// `sync_batchnorm` (the body's `nn::batch_norm*d` become the accelerator's),
/// `activation_checkpointing` (units recompute their activations in backward),
/// `fp32_gathers` (zero3/fsdp under bf16: fp32 gathers and reductions instead of bf16),
/// `log_with` (trackers, comma-separated: tensorboard, jsonl, mlflow, all; the body starts
/// them with `accelerator.init_trackers(..)` and the run's end closes them), `config` (a YAML file read at run time), `name` (the accelerator's binding in
/// the body, default `accelerator`), `model` (which VarStore is the model, when there are
/// several), `crate` (path to accel-core). Keys left out come from `accel launch`, the
/// config file or the defaults at run time.
#[proc_macro_attribute]
pub fn accelerate(args: TokenStream, item: TokenStream) -> TokenStream {
    accelerate::expand(args.into(), item.into()).into()
}
