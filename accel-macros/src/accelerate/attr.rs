//! Parsing the attribute's arguments (syntax only): `key = value, ...` into raw values that
//! keep their spans. Validation of values and of combinations lives in `check.rs`.

use accel_choices::{DataSharding, Literal, SettingValue, Sharding, Strategy};
use proc_macro2::{Span, TokenStream};
use syn::parse::Parser;
use syn::punctuated::Punctuated;
use syn::{Expr, ExprLit, Lit, MetaNameValue, Token};

/// The keys that are not settings of the run (the settings' keys come from the table,
/// `accel_choices::SETTINGS`, where `attribute` is true).
const OWN_KEYS: &[&str] = &[
    "sharding",
    "data",
    "broadcast_buffers",
    "sync_batchnorm",
    "fp32_gathers",
    "config",
    "name",
    "model",
    "crate",
];

/// Every key, for "did you mean" and the list in messages: the table's, then the
/// attribute's own.
pub(crate) fn keys() -> Vec<&'static str> {
    let settings = accel_choices::SETTINGS.iter().filter(|s| s.attribute).map(|s| s.name);
    settings.chain(OWN_KEYS.iter().copied()).collect()
}

/// A setting of the table as written in the attribute.
#[derive(Clone)]
pub(crate) struct SettingArg {
    pub setting: &'static accel_choices::Setting,
    /// Its value as the environment would write it.
    pub text: String,
    /// The Rust expression of its value (`$config::Strategy::Ddp`).
    pub rust: String,
    pub span: Span,
}

/// A value as written, with where it was written.
#[derive(Clone)]
pub(crate) struct Spanned<T> {
    pub value: T,
    pub span: Span,
}

/// The arguments as written; each `None` when left out.
#[derive(Default)]
pub(crate) struct RawArgs {
    /// The settings of the table given, in the order written.
    pub settings: Vec<SettingArg>,
    pub sharding: Option<Spanned<Sharding>>,
    /// Who deals the data: the accelerator (`"prepared"`) or the program (`"manual"`).
    pub data: Option<Spanned<DataSharding>>,
    pub broadcast_buffers: Option<Spanned<bool>>,
    pub sync_batchnorm: Option<Spanned<bool>>,
    pub fp32_gathers: Option<Spanned<bool>>,
    pub config: Option<Spanned<String>>,
    pub name: Option<syn::Ident>,
    /// The model's VarStore: a variable or a field (`vs`, `self.vs`).
    pub model: Option<Expr>,
    pub krate: Option<syn::Path>,
}

impl RawArgs {
    /// The value of setting `name`, if given (read as `T`: the table's type, or a wider
    /// one for a check, e.g. `u64` for a count).
    pub fn setting<T: SettingValue>(&self, name: &str) -> Option<Spanned<T>> {
        let arg = self.settings.iter().find(|a| a.setting.name == name)?;
        let value = T::parse_setting(&arg.text).ok()?;
        Some(Spanned { value, span: arg.span })
    }

    /// The strategy as written.
    pub fn written_strategy(&self) -> Option<Spanned<Strategy>> {
        self.setting("strategy")
    }

    /// The strategy the arguments ask for, resolved once for the checks and the expansion:
    /// FSDP with a sharding strategy is the strategy that sharding is (`full_shard`: zero3,
    /// `hybrid_shard`: hybrid), at the span of what said it.
    pub fn strategy(&self) -> Option<Spanned<Strategy>> {
        match (self.written_strategy(), &self.sharding) {
            (Some(s), Some(sharding)) if s.value == Strategy::Fsdp => {
                Some(Spanned { value: sharding.value.strategy(), span: sharding.span })
            }
            (s, _) => s,
        }
    }
}

/// A value of setting `setting`, checked at compile time as the runtime will read it: the
/// literal its type takes, then its value (the choices named, the nearest suggested).
fn expect_setting(
    expr: &Expr,
    setting: &'static accel_choices::Setting,
) -> syn::Result<SettingArg> {
    let key = setting.name;
    let (text, span) = match (setting.literal, lit(expr)) {
        (Literal::Bool, _) => {
            let b = expect_bool(expr, key)?;
            (b.value.to_string(), b.span)
        }
        (Literal::Integer, _) => {
            let n = expect_u64(expr, key, "4")?;
            (n.value.to_string(), n.span)
        }
        (Literal::Number, _) => {
            let x = expect_f64(expr, key, "1.0")?;
            (format!("{:?}", x.value), x.span)
        }
        (Literal::Choice { names, .. }, Some(Lit::Str(s))) => {
            let text = s.value();
            if text.split(',').all(|p| p.trim().is_empty()) {
                let e = format!("`{key}` names nothing; e.g. `{key} = \"{}\"`", names[0]);
                return Err(syn::Error::new(s.span(), e));
            }
            (text, s.span())
        }
        (Literal::Choice { names, .. }, _) => {
            let e = format!("`{key}` takes a string, e.g. `{key} = \"{}\"`", names[0]);
            return Err(syn::Error::new_spanned(expr, e));
        }
        (Literal::Text, _) => {
            let t = expect_str(expr, key, "\"..\"")?;
            (t.value, t.span)
        }
    };
    // The value read as the runtime will read it: its message names the choices and the
    // nearest one.
    let rust = (setting.parse)(&text).map_err(|why| syn::Error::new(span, why))?;
    Ok(SettingArg { setting, text, rust, span })
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
    text.value
        .parse::<T>()
        .map(|value| Spanned { value, span: text.span })
        .map_err(|e| syn::Error::new(text.span, e.to_string()))
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
                "sharding" => raw.sharding = Some(expect_choice(v, &key, "\"full_shard\"")?),
                "data" => raw.data = Some(expect_choice(v, &key, "\"manual\"")?),
                "broadcast_buffers" => raw.broadcast_buffers = Some(expect_bool(v, &key)?),
                "sync_batchnorm" => raw.sync_batchnorm = Some(expect_bool(v, &key)?),
                "fp32_gathers" => raw.fp32_gathers = Some(expect_bool(v, &key)?),
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
                key if accel_choices::setting(key).is_some_and(|s| s.attribute) => {
                    let setting = accel_choices::setting(key).expect("matched");
                    raw.settings.push(expect_setting(v, setting)?);
                }
                other => {
                    let keys = keys();
                    let list = keys.iter().map(|k| format!("`{k}`")).collect::<Vec<_>>().join(", ");
                    let hint = did_you_mean(other, &keys);
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

/// " — did you mean `x`?" when a valid choice is close to what was written.
fn did_you_mean(got: &str, valid: &[&str]) -> String {
    accel_choices::closest(got, valid)
        .map(|v| format!(" — did you mean \"{v}\"?"))
        .unwrap_or_default()
}
