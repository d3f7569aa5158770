//! Validation: each value against its choices, each combination that makes no sense, and
//! the shape of the annotated function. One small function per rule, each saying why.

use proc_macro2::Span;
use syn::spanned::Spanned as _;

use accel_choices::{Fp8Recipe, Precision, Strategy};

use super::attr::RawArgs;

/// Accumulating zero micro-batches per step would never step the optimizer.
fn accumulate_positive(raw: &RawArgs, errors: &mut Vec<syn::Error>) {
    if let Some(a) = raw.setting::<u64>("accumulate") {
        if a.value == 0 {
            errors.push(syn::Error::new(a.span, "`accumulate = 0`: the number of micro-batches per optimizer step must be at least 1"));
        }
    }
}

/// Tensor, pipeline and context parallelism split each model replica (or each sequence)
/// over this many processes; 0 processes cannot hold one.
fn parallel_sizes_positive(raw: &RawArgs, errors: &mut Vec<syn::Error>) {
    for key in ["tensor_parallel", "pipeline_parallel", "context_parallel"] {
        if let Some(n) = raw.setting::<u64>(key) {
            if n.value == 0 || n.value > 1 << 20 {
                errors.push(syn::Error::new(
                    n.span,
                    format!("`{key} = {}`: the processes each model replica is split over must be at least 1 (1: not split)", n.value),
                ));
            }
        }
    }
}

/// Sequence parallelism splits along the sequence what tensor parallelism leaves whole; with
/// one tensor rank there is nothing to split it across.
fn sequence_parallel_needs_tensor_parallel(raw: &RawArgs, errors: &mut Vec<syn::Error>) {
    if let Some(sp) = raw.setting::<bool>("sequence_parallel") {
        if sp.value && raw.setting::<u64>("tensor_parallel").is_none_or(|t| t.value < 2) {
            errors.push(syn::Error::new(
                sp.span,
                "`sequence_parallel = true` needs `tensor_parallel = 2` or more: it splits the \
                 activations that tensor parallelism keeps whole across the tensor ranks",
            ));
        }
    }
}

/// Hybrid sharding lays its own two dimensions (machines × processes per machine) over the
/// processes; tensor and pipeline dimensions do not fit beside them.
fn hybrid_alone(raw: &RawArgs, errors: &mut Vec<syn::Error>) {
    let hybrid = raw.strategy().filter(|s| s.value == Strategy::HybridShard).map(|s| s.span);
    let split = ["tensor_parallel", "pipeline_parallel", "context_parallel"]
        .into_iter()
        .filter_map(|key| raw.setting::<u64>(key))
        .find(|n| n.value > 1);
    if let (Some(span), Some(n)) = (hybrid, split) {
        let mut e = syn::Error::new(
            span,
            "hybrid sharding cannot be combined with tensor, pipeline or context parallelism; \
             use \"zero3\" (or \"fsdp\") across the data-parallel replicas instead",
        );
        e.combine(syn::Error::new(n.span, "tensor, pipeline or context parallelism is set here"));
        errors.push(e);
    }
}

/// A norm limit of zero or less would zero every gradient.
fn clip_positive(raw: &RawArgs, errors: &mut Vec<syn::Error>) {
    if let Some(c) = raw.setting::<f64>("clip_grad_norm") {
        if !(c.value > 0.0 && c.value.is_finite()) {
            errors
                .push(syn::Error::new(c.span, "`clip_grad_norm` must be a finite number above 0"));
        }
    }
}

/// FSDP's sharding strategies are an FSDP option; other strategies already say how they shard.
fn sharding_needs_fsdp(raw: &RawArgs, errors: &mut Vec<syn::Error>) {
    if let Some(s) = &raw.sharding {
        let strategy = raw.written_strategy().map(|s| s.value.as_str());
        if strategy != Some(Strategy::Fsdp.as_str()) {
            errors.push(syn::Error::new(
                s.span,
                format!(
                    "`sharding` applies to `strategy = \"fsdp\"` only (the strategy here is {}); for \
                     other strategies the name says the sharding: zero1, zero2, zero3",
                    strategy.map_or("not set".to_owned(), |s| format!("\"{s}\""))
                ),
            ));
        }
    }
}

/// Offloading moves sharded state to CPU; without sharding there is nothing to offload.
fn offload_needs_sharding(raw: &RawArgs, errors: &mut Vec<syn::Error>) {
    if let Some(o) = raw.setting::<bool>("offload") {
        if o.value && !raw.written_strategy().is_some_and(|s| s.value.can_offload()) {
            errors.push(syn::Error::new(
                o.span,
                format!(
                    "`offload = true` needs a strategy that shards parameters or gradients: {}",
                    Strategy::offload_choices()
                ),
            ));
        }
    }
}

/// The update inside backward applies each unit's gradient shard as it is reduced: it
/// needs a strategy that shards gradients, and nothing that wants every gradient first
/// (clipping by the global norm, fp16's overflow check) or keeps one for later
/// (accumulation, model parallelism's finishing reductions).
fn optimizer_in_backward_alone(raw: &RawArgs, errors: &mut Vec<syn::Error>) {
    let Some(on) = raw.setting::<bool>("optimizer_in_backward").filter(|o| o.value) else {
        return;
    };
    let mut refuse = |other: Option<Span>, why: &str| {
        let mut e = syn::Error::new(on.span, format!("`optimizer_in_backward = true` {why}"));
        if let Some(span) = other {
            e.combine(syn::Error::new(span, "set here"));
        }
        errors.push(e);
    };
    if !raw.written_strategy().is_some_and(|s| s.value.shards()) {
        refuse(
            None,
            "needs a strategy that shards gradients: \"zero2\", \"zero3\", \"fsdp\" or \"hybrid_shard\"",
        );
    }
    if let Some(a) = raw.setting::<u64>("accumulate").filter(|a| a.value > 1) {
        refuse(
            Some(a.span),
            "applies the update in every backward, so it cannot accumulate micro-batches into one step (`accumulate` > 1)",
        );
    }
    if let Some(c) = raw.setting::<f64>("clip_grad_norm") {
        refuse(
            Some(c.span),
            "applies each unit's update before the next unit's gradient exists, so the global norm `clip_grad_norm` needs is never known in time",
        );
    }
    if let Some(p) = raw.setting::<Precision>("precision").filter(|p| p.value == Precision::Fp16) {
        refuse(
            Some(p.span),
            "cannot go with `precision = \"fp16\"`, whose loss scaling must check every gradient for inf/NaN before any update (bf16 needs no scaling)",
        );
    }
    for key in ["tensor_parallel", "pipeline_parallel", "context_parallel"] {
        if let Some(n) = raw.setting::<u64>(key).filter(|n| n.value > 1) {
            refuse(
                Some(n.span),
                &format!(
                    "is not combined with model parallelism (`{key}` > 1), whose gradients are finished across its ranks after backward"
                ),
            );
        }
    }
}

/// An fp8 recipe means nothing without fp8.
fn fp8_recipe_needs_fp8(raw: &RawArgs, errors: &mut Vec<syn::Error>) {
    if let Some(r) = raw.setting::<Fp8Recipe>("fp8_recipe") {
        if !raw.setting::<Precision>("precision").is_some_and(|p| p.value == Precision::Fp8) {
            errors.push(syn::Error::new(
                r.span,
                "`fp8_recipe` chooses how fp8 layers scale their operands: it needs `precision = \"fp8\"`",
            ));
        }
    }
}

/// Checks values and combinations.
pub(crate) fn args(raw: &RawArgs) -> Vec<syn::Error> {
    let mut errors = Vec::new();
    accumulate_positive(raw, &mut errors);
    parallel_sizes_positive(raw, &mut errors);
    sequence_parallel_needs_tensor_parallel(raw, &mut errors);
    hybrid_alone(raw, &mut errors);
    clip_positive(raw, &mut errors);
    sharding_needs_fsdp(raw, &mut errors);
    offload_needs_sharding(raw, &mut errors);
    fp8_recipe_needs_fp8(raw, &mut errors);
    optimizer_in_backward_alone(raw, &mut errors);
    errors
}

/// What the function returns, as far as the rewrite cares.
pub(crate) enum Returns {
    /// `()`: failures panic with the message.
    Unit,
    /// `Result<_, E>` (any path ending in `Result`): failures come back through `?`.
    Result(Box<syn::Type>),
}

/// The function must be something a training loop can run in: a plain, synchronous fn
/// with a body, returning `()` or a `Result`.
pub(crate) fn function(f: &syn::ItemFn) -> (Option<Returns>, Vec<syn::Error>) {
    let mut errors = Vec::new();
    if let Some(a) = &f.sig.asyncness {
        errors.push(syn::Error::new(a.span, "#[accelerate] does not support async fn: training steps run synchronously; remove `async`"));
    }
    if let Some(c) = &f.sig.constness {
        errors.push(syn::Error::new(
            c.span,
            "#[accelerate] cannot go on a const fn: training cannot run at compile time",
        ));
    }
    let returns = match &f.sig.output {
        syn::ReturnType::Default => Some(Returns::Unit),
        syn::ReturnType::Type(_, ty) => match &**ty {
            syn::Type::Tuple(t) if t.elems.is_empty() => Some(Returns::Unit),
            syn::Type::Path(p) if p.path.segments.last().is_some_and(|s| s.ident == "Result") => {
                Some(Returns::Result(ty.clone()))
            }
            other => {
                errors.push(syn::Error::new(
                    other.span(),
                    "#[accelerate] needs a function returning `()` or a `Result` (e.g. \
                     `anyhow::Result<()>`), so that failures can end the run cleanly",
                ));
                None
            }
        },
    };
    (returns, errors)
}

/// The span of the function's name, for errors about its body.
pub(crate) fn name_span(f: &syn::ItemFn) -> Span {
    f.sig.ident.span()
}
