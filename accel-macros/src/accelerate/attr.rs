//! Parsing the attribute's arguments (syntax only): `key = value, ...` into raw values that
//! keep their spans. Validation of values and of combinations lives in `check.rs`.

use accel_choices::{DataSharding, Fp8Recipe, LogWith, Precision, Sharding, Strategy};
use proc_macro2::{Span, TokenStream};
use syn::parse::Parser;
use syn::punctuated::Punctuated;
use syn::{Expr, ExprLit, Lit, MetaNameValue, Token};

/// Every key, for "did you mean" and the list in messages.
pub(crate) const KEYS: &[&str] = &[
    "strategy",
    "sharding",
    "precision",
    "fp8_recipe",
    "accumulate",
    "clip_grad_norm",
    "seed",
    "cpu",
    "offload",
    "tensor_parallel",
    "sequence_parallel",
    "pipeline_parallel",
    "context_parallel",
    "data",
    "broadcast_buffers",
    "sync_batchnorm",
    "activation_checkpointing",
    "fp32_gathers",
    "log_with",
    "config",
    "name",
    "model",
    "crate",
];

/// A value as written, with where it was written.
#[derive(Clone)]
pub(crate) struct Spanned<T> {
    pub value: T,
    pub span: Span,
}

/// The arguments as written; each `None` when left out.
#[derive(Default)]
pub(crate) struct RawArgs {
    pub strategy: Option<Spanned<Strategy>>,
    pub sharding: Option<Spanned<Sharding>>,
    pub precision: Option<Spanned<Precision>>,
    pub fp8_recipe: Option<Spanned<Fp8Recipe>>,
    pub accumulate: Option<Spanned<u64>>,
    pub clip_grad_norm: Option<Spanned<f64>>,
    pub seed: Option<Spanned<u64>>,
    pub cpu: Option<Spanned<bool>>,
    pub offload: Option<Spanned<bool>>,
    pub tensor_parallel: Option<Spanned<u64>>,
    pub sequence_parallel: Option<Spanned<bool>>,
    pub pipeline_parallel: Option<Spanned<u64>>,
    pub context_parallel: Option<Spanned<u64>>,
    /// Who deals the data: the accelerator (`"prepared"`) or the program (`"manual"`).
    pub data: Option<Spanned<DataSharding>>,
    pub broadcast_buffers: Option<Spanned<bool>>,
    pub sync_batchnorm: Option<Spanned<bool>>,
    pub activation_checkpointing: Option<Spanned<bool>>,
    pub fp32_gathers: Option<Spanned<bool>>,
    /// The trackers, as written: `"tensorboard,mlflow"`.
    pub log_with: Option<Spanned<Vec<LogWith>>>,
    pub config: Option<Spanned<String>>,
    pub name: Option<syn::Ident>,
    /// The model's VarStore: a variable or a field (`vs`, `self.vs`).
    pub model: Option<Expr>,
    pub krate: Option<syn::Path>,
}

impl RawArgs {
    /// The strategy the arguments ask for, resolved once for the checks and the expansion:
    /// FSDP with a sharding strategy is the strategy that sharding is (`full_shard`: zero3,
    /// `hybrid_shard`: hybrid), at the span of what said it.
    pub fn strategy(&self) -> Option<Spanned<Strategy>> {
        match (&self.strategy, &self.sharding) {
            (Some(s), Some(sharding)) if s.value == Strategy::Fsdp => {
                Some(Spanned { value: sharding.value.strategy(), span: sharding.span })
            }
            (s, _) => s.clone(),
        }
    }
}

fn lit(expr: &Expr) -> Option<&Lit> {
    match expr {
        Expr::Lit(ExprLit { lit, .. }) => Some(lit),
        _ => None,
    }
}

fn expect_str(expr: &Expr, key: &str, example: &str) -> syn::Result<Spanned<String>> {
    match lit(expr) {
        Some(Lit::Str(s)) => Ok(Spanned { value: s.value(), span: s.span() }),
        _ => Err(syn::Error::new_spanned(
            expr,
            format!("`{key}` takes a string, e.g. `{key} = {example}`"),
        )),
    }
}

/// A string naming one of `T`'s choices, typed here so that the attribute accepts exactly
/// what the runtime runs (the lists live in accel-choices).
fn expect_choice<T: std::str::FromStr<Err = accel_choices::UnknownChoice>>(
    expr: &Expr,
    key: &str,
    example: &str,
) -> syn::Result<Spanned<T>> {
    let text = expect_str(expr, key, example)?;
    text.value.parse::<T>().map(|value| Spanned { value, span: text.span }).map_err(|e| {
        let list = e.valid.iter().map(|c| format!("\"{c}\"")).collect::<Vec<_>>().join(", ");
        let hint = super::check::did_you_mean(&e.got, e.valid);
        syn::Error::new(
            text.span,
            format!("unknown {} \"{}\"; the {} are {list}{hint}", e.what, e.got, e.plural),
        )
    })
}

/// A comma-separated list of `T`'s choices (`log_with = "tensorboard,mlflow"`).
fn expect_choices(expr: &Expr, key: &str, example: &str) -> syn::Result<Spanned<Vec<LogWith>>> {
    let text = expect_str(expr, key, example)?;
    let value = LogWith::parse_list(&text.value).map_err(|e| {
        let list = e.valid.iter().map(|c| format!("\"{c}\"")).collect::<Vec<_>>().join(", ");
        let hint = super::check::did_you_mean(&e.got, e.valid);
        syn::Error::new(
            text.span,
            format!(
                "unknown {} \"{}\"; the {} are {list} (several: comma-separated){hint}",
                e.what, e.got, e.plural
            ),
        )
    })?;
    if value.is_empty() {
        return Err(syn::Error::new(
            text.span,
            format!("`{key}` names no tracker; e.g. `{key} = {example}`"),
        ));
    }
    Ok(Spanned { value, span: text.span })
}

fn expect_u64(expr: &Expr, key: &str, example: &str) -> syn::Result<Spanned<u64>> {
    match lit(expr) {
        Some(Lit::Int(i)) => {
            i.base10_parse::<u64>().map(|value| Spanned { value, span: i.span() }).map_err(|_| {
                syn::Error::new(
                    i.span(),
                    format!("`{key}` takes a non-negative integer, e.g. `{key} = {example}`"),
                )
            })
        }
        _ => Err(syn::Error::new_spanned(
            expr,
            format!("`{key}` takes a non-negative integer, e.g. `{key} = {example}`"),
        )),
    }
}

fn expect_f64(expr: &Expr, key: &str, example: &str) -> syn::Result<Spanned<f64>> {
    let parsed = match lit(expr) {
        Some(Lit::Float(f)) => f.base10_parse::<f64>().ok().map(|v| (v, f.span())),
        Some(Lit::Int(i)) => i.base10_parse::<f64>().ok().map(|v| (v, i.span())),
        _ => None,
    };
    parsed.map(|(value, span)| Spanned { value, span }).ok_or_else(|| {
        syn::Error::new_spanned(expr, format!("`{key}` takes a number, e.g. `{key} = {example}`"))
    })
}

fn expect_bool(expr: &Expr, key: &str) -> syn::Result<Spanned<bool>> {
    match lit(expr) {
        Some(Lit::Bool(b)) => Ok(Spanned { value: b.value, span: b.span }),
        _ => Err(syn::Error::new_spanned(expr, format!("`{key}` takes `true` or `false`"))),
    }
}

fn expect_ident(expr: &Expr, key: &str) -> syn::Result<syn::Ident> {
    match expr {
        Expr::Path(p) if p.path.get_ident().is_some() => {
            Ok(p.path.get_ident().cloned().expect("checked"))
        }
        Expr::Lit(ExprLit { lit: Lit::Str(s), .. }) => s.parse::<syn::Ident>(),
        _ => Err(syn::Error::new_spanned(
            expr,
            format!("`{key}` takes an identifier, e.g. `{key} = acc`"),
        )),
    }
}

fn expect_place(expr: &Expr, key: &str) -> syn::Result<Expr> {
    let place = match expr {
        Expr::Lit(ExprLit { lit: Lit::Str(s), .. }) => s.parse::<Expr>()?,
        other => other.clone(),
    };
    if super::body::place_key(&place).is_some() {
        Ok(place)
    } else {
        Err(syn::Error::new_spanned(
            expr,
            format!(
                "`{key}` takes the model's VarStore as a variable or a field, e.g. `{key} = vs` or \
                 `{key} = self.vs`"
            ),
        ))
    }
}

/// Parses `key = value, ...`, collecting every error rather than stopping at the first.
pub(crate) fn parse(args: TokenStream) -> (RawArgs, Option<syn::Error>) {
    let mut raw = RawArgs::default();
    let mut errors: Option<syn::Error> = None;
    let mut push = |e: syn::Error| match &mut errors {
        Some(all) => all.combine(e),
        None => errors = Some(e),
    };
    let pairs = match Punctuated::<MetaNameValue, Token![,]>::parse_terminated.parse2(args) {
        Ok(pairs) => pairs,
        Err(e) => {
            let hint = syn::Error::new(
                e.span(),
                format!(
                    "{e}; #[accelerate] takes `key = value` pairs, e.g. `#[accelerate(strategy = \"ddp\", precision = \"bf16\")]`"
                ),
            );
            return (raw, Some(hint));
        }
    };
    let mut seen: Vec<(String, Span)> = Vec::new();
    for pair in pairs {
        let key = match pair.path.get_ident() {
            Some(ident) => ident.to_string(),
            None if pair.path.segments.len() == 1 => pair.path.segments[0].ident.to_string(),
            None => {
                push(syn::Error::new_spanned(
                    &pair.path,
                    "a key is a single word, e.g. `strategy`",
                ));
                continue;
            }
        };
        let key = key.trim_start_matches("r#").to_owned();
        let span = pair.path.segments[0].ident.span();
        if let Some((_, first)) = seen.iter().find(|(k, _)| *k == key) {
            let mut e =
                syn::Error::new(span, format!("duplicate key `{key}`: each key may be given once"));
            e.combine(syn::Error::new(*first, format!("`{key}` is first set here")));
            push(e);
            continue;
        }
        seen.push((key.clone(), span));
        let v = &pair.value;
        let result: syn::Result<()> = (|| {
            match key.as_str() {
                "strategy" => raw.strategy = Some(expect_choice(v, &key, "\"ddp\"")?),
                "sharding" => raw.sharding = Some(expect_choice(v, &key, "\"full_shard\"")?),
                "precision" => raw.precision = Some(expect_choice(v, &key, "\"bf16\"")?),
                "fp8_recipe" => raw.fp8_recipe = Some(expect_choice(v, &key, "\"rowwise\"")?),
                "accumulate" => raw.accumulate = Some(expect_u64(v, &key, "4")?),
                "clip_grad_norm" => raw.clip_grad_norm = Some(expect_f64(v, &key, "1.0")?),
                "seed" => raw.seed = Some(expect_u64(v, &key, "42")?),
                "cpu" => raw.cpu = Some(expect_bool(v, &key)?),
                "offload" => raw.offload = Some(expect_bool(v, &key)?),
                "tensor_parallel" => raw.tensor_parallel = Some(expect_u64(v, &key, "2")?),
                "sequence_parallel" => raw.sequence_parallel = Some(expect_bool(v, &key)?),
                "pipeline_parallel" => raw.pipeline_parallel = Some(expect_u64(v, &key, "2")?),
                "context_parallel" => raw.context_parallel = Some(expect_u64(v, &key, "2")?),
                "data" => raw.data = Some(expect_choice(v, &key, "\"manual\"")?),
                "broadcast_buffers" => raw.broadcast_buffers = Some(expect_bool(v, &key)?),
                "sync_batchnorm" => raw.sync_batchnorm = Some(expect_bool(v, &key)?),
                "activation_checkpointing" => {
                    raw.activation_checkpointing = Some(expect_bool(v, &key)?)
                }
                "fp32_gathers" => raw.fp32_gathers = Some(expect_bool(v, &key)?),
                "log_with" => {
                    raw.log_with = Some(expect_choices(v, &key, "\"tensorboard,mlflow\"")?)
                }
                "config" => raw.config = Some(expect_str(v, &key, "\"accel.yaml\"")?),
                "name" => raw.name = Some(expect_ident(v, &key)?),
                "model" => raw.model = Some(expect_place(v, &key)?),
                "crate" => {
                    raw.krate = Some(match v {
                        Expr::Path(p) => p.path.clone(),
                        Expr::Lit(ExprLit { lit: Lit::Str(s), .. }) => s.parse()?,
                        other => {
                            return Err(syn::Error::new_spanned(
                                other,
                                "`crate` takes a path, e.g. `crate = ::accel_core`",
                            ));
                        }
                    })
                }
                other => {
                    let list = KEYS.iter().map(|k| format!("`{k}`")).collect::<Vec<_>>().join(", ");
                    let hint = super::check::did_you_mean(other, KEYS);
                    let hint = hint.replace('"', "`");
                    return Err(syn::Error::new(
                        span,
                        format!("unknown key `{other}`; the keys are {list}{hint}"),
                    ));
                }
            }
            Ok(())
        })();
        if let Err(e) = result {
            push(e);
        }
    }
    (raw, errors)
}
