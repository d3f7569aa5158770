//! Every setting of a run, declared once: the table in [`settings!`](crate::settings), one
//! row per setting — its name, type, default, environment variable, whether the
//! `#[accelerate]` attribute and the builder take it, and its documentation. Everything that
//! reads or writes settings is generated from it: accel-core's `Config` and `PartialConfig`,
//! the environment's `ACCEL_*` variables and the launcher's child environment, accel's own
//! YAML keys, the builder's methods, the attribute's keys and their compile-time checks, and
//! the reference page of the docs ([`SETTINGS`]). Adding a setting is one row here and the
//! code that uses its value.
//!
//! Each value's type says how it is written ([`SettingValue`]): the same text in a variable,
//! a file and the attribute.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::{Fp8Recipe, LogWith, Precision, Strategy, UnknownChoice};

/// The table. `settings!(callback)` calls `callback! { rows }`, each row:
///
/// ```text
/// /// Documentation, one or more lines (the first is the summary).
/// name: required Type = default, env "ACCEL_NAME", attribute yes|no, builder yes|no;
/// name: optional Type = None, ...;        // a `Config` field of `Option<Type>`
/// ```
///
/// `attribute yes`: a key of `#[accelerate(..)]`; `builder yes`: a method of
/// `AcceleratorBuilder` setting it (the others have methods written by hand, which do more).
#[macro_export]
macro_rules! settings {
    ($callback:ident) => {
        $callback! {
            /// Distribution strategy: how the work is split across processes.
            strategy: required $crate::Strategy = $crate::Strategy::Single,
                env "ACCEL_STRATEGY", attribute yes, builder yes;
            /// Mixed precision of the forward and backward passes (master weights stay fp32).
            precision: required $crate::Precision = $crate::Precision::No,
                env "ACCEL_PRECISION", attribute yes, builder yes;
            /// How fp8 layers scale their operands (with precision fp8).
            fp8_recipe: required $crate::Fp8Recipe = $crate::Fp8Recipe::Tensorwise,
                env "ACCEL_FP8_RECIPE", attribute yes, builder yes;
            /// Micro-batches per optimizer step (gradient accumulation), at least 1.
            accumulate: required u32 = 1,
                env "ACCEL_ACCUMULATE", attribute yes, builder yes;
            /// Clip the global gradient L2 norm (across processes and shards) to this value
            /// before each optimizer step.
            clip_grad_norm: optional f64 = None,
                env "ACCEL_CLIP_GRAD_NORM", attribute yes, builder yes;
            /// Seed of torch's generators and of the loaders' shuffling.
            seed: optional u64 = None,
                env "ACCEL_SEED", attribute yes, builder yes;
            /// Run on the CPU even where a GPU is available.
            cpu: required bool = false,
                env "ACCEL_CPU", attribute yes, builder yes;
            /// Tensor-parallel ranks (Megatron's tensor model parallel size), at least 1.
            tensor_parallel: required usize = 1,
                env "ACCEL_TENSOR_PARALLEL", attribute yes, builder yes;
            /// Pipeline stages, at least 1.
            pipeline_parallel: required usize = 1,
                env "ACCEL_PIPELINE_PARALLEL", attribute yes, builder yes;
            /// Context-parallel ranks: each sequence split among them, attention exchanging
            /// heads by all-to-all (Accelerate's `parallelism_config` cp_size), at least 1.
            context_parallel: required usize = 1,
                env "ACCEL_CONTEXT_PARALLEL", attribute yes, builder yes;
            /// Split the activations outside tensor-parallel regions along the sequence
            /// (needs tensor_parallel of 2 or more).
            sequence_parallel: required bool = false,
                env "ACCEL_SEQUENCE_PARALLEL", attribute yes, builder yes;
            /// Recompute each unit's activations in backward instead of keeping them (FSDP's
            /// `activation_checkpointing`; units are `accel_core::Unit`s run with `run_on`).
            activation_checkpointing: required bool = false,
                env "ACCEL_ACTIVATION_CHECKPOINTING", attribute yes, builder yes;
            /// Keep the fp32 master shards and the optimizer state in CPU memory (zero2,
            /// zero3, fsdp; FSDP's `offload_params`, DeepSpeed's `offload_optimizer`).
            offload: required bool = false,
                env "ACCEL_OFFLOAD", attribute yes, builder no;
            /// Broadcast the first process's initial values of a prepared model to the
            /// others (FSDP's `sync_module_states`).
            sync_module_states: required bool = true,
                env "ACCEL_SYNC_MODULE_STATES", attribute no, builder yes;
            /// Which modules zero2/zero3/fsdp gather and reduce as one unit (FSDP's
            /// auto-wrap policy): `layers`, `size:N` or `none`.
            wrap: required $crate::Wrap = $crate::Wrap::Layers,
                env "ACCEL_WRAP", attribute no, builder no;
            /// How `save_state` writes a sharded model (FSDP's `state_dict_type`):
            /// `sharded` or `full`.
            state_dict: required $crate::StateDict = $crate::StateDict::Sharded,
                env "ACCEL_STATE_DICT", attribute no, builder yes;
            /// Parameters may go without a gradient in a step (a branch the data chooses, a
            /// mixture of experts): on a process where one gets none it contributes zeros to
            /// the average instead of stopping the run (torch DDP's `find_unused_parameters`,
            /// Accelerate's `DistributedDataParallelKwargs`; zero2/zero3 too).
            find_unused_parameters: required bool = false,
                env "ACCEL_FIND_UNUSED_PARAMETERS", attribute yes, builder yes;
            /// Apply the optimizer's update inside backward, each unit's as soon as its
            /// gradient shard is reduced, and free that gradient at once (torchtune's
            /// `optimizer_in_bwd`): no process ever holds the gradients of the whole model.
            /// zero2, zero3, fsdp and hybrid_shard; not with accumulate > 1, clip_grad_norm,
            /// fp16 or model parallelism, and one prepared optimizer.
            optimizer_in_backward: required bool = false,
                env "ACCEL_OPTIMIZER_IN_BACKWARD", attribute yes, builder yes;
            /// The trackers `init_trackers` starts (Accelerate's `log_with`), comma-separated.
            log_with: required ::std::vec::Vec<$crate::LogWith> = ::std::vec::Vec::new(),
                env "ACCEL_LOG_WITH", attribute yes, builder no;
        }
    };
}

/// One row of the table, as the docs and the attribute read it.
#[derive(Debug, Clone, Copy)]
pub struct Setting {
    /// The key: the attribute's, the YAML file's and the builder method's name.
    pub name: &'static str,
    /// The environment variable (`accel launch` sets it for the processes it starts).
    pub env: &'static str,
    /// The documentation (its first line is the summary).
    pub doc: &'static str,
    /// The default, as written in the environment ("" for none).
    pub default: fn() -> String,
    /// What a valid value is, for messages.
    pub expected: fn() -> String,
    /// Parses a value as written anywhere; gives the Rust expression of the value (what
    /// the attribute's expansion passes to the builder), or what is wrong with it.
    pub parse: fn(&str) -> Result<String, String>,
    /// What a literal of the attribute must be.
    pub literal: Literal,
    /// Whether `#[accelerate(..)]` takes it.
    pub attribute: bool,
}

/// The literal a setting takes in `#[accelerate(..)]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Literal {
    /// `true` or `false`.
    Bool,
    /// An integer.
    Integer,
    /// A number.
    Number,
    /// A string, one of the names (several, comma-separated, with `list`).
    Choice {
        /// The valid names.
        names: &'static [&'static str],
        /// Whether several may be given, comma-separated.
        list: bool,
    },
    /// A string.
    Text,
}

/// How a value of a setting is written: the same text in an environment variable, a YAML
/// file (scalars as text, lists joined by commas) and the attribute.
pub trait SettingValue: Sized {
    /// What a valid value is: "true or false", "an integer", "one of ...".
    fn expected() -> String;
    /// The literal the attribute takes.
    const LITERAL: Literal;
    /// The value of `text`, or what is wrong with it.
    fn parse_setting(text: &str) -> Result<Self, String>;
    /// The text `parse_setting` reads back.
    fn setting_text(&self) -> String;
    /// A Rust expression of the value (`$config::Strategy::Ddp`, `4`, with `$config` for
    /// the path of the runtime's `config` module): what the attribute's expansion writes.
    fn rust(&self) -> String;
}

/// Whether `text` is true or false, as the environment writes it (`1`/`0`, `yes`/`no`,
/// `true`/`false`; empty is false).
pub fn parse_bool(text: &str) -> Option<bool> {
    match text.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" => Some(true),
        "0" | "false" | "no" | "" => Some(false),
        _ => None,
    }
}

impl SettingValue for bool {
    fn expected() -> String {
        "true or false".into()
    }
    const LITERAL: Literal = Literal::Bool;
    fn parse_setting(text: &str) -> Result<Self, String> {
        parse_bool(text).ok_or_else(|| format!("`{text}` is not true or false"))
    }
    fn setting_text(&self) -> String {
        self.to_string()
    }
    fn rust(&self) -> String {
        self.to_string()
    }
}

macro_rules! integers {
    ($($t:ty),*) => {$(
        impl SettingValue for $t {
            fn expected() -> String {
                format!("an integer from {} to {}", <$t>::MIN, <$t>::MAX)
            }
            const LITERAL: Literal = Literal::Integer;
            fn parse_setting(text: &str) -> Result<Self, String> {
                text.trim().parse().map_err(|_| format!("`{text}` is not {}", Self::expected()))
            }
            fn setting_text(&self) -> String {
                self.to_string()
            }
            fn rust(&self) -> String {
                self.to_string()
            }
        }
    )*};
}
integers!(u32, u64, usize);

impl SettingValue for f64 {
    fn expected() -> String {
        "a number".into()
    }
    const LITERAL: Literal = Literal::Number;
    fn parse_setting(text: &str) -> Result<Self, String> {
        text.trim().parse().map_err(|_| format!("`{text}` is not a number"))
    }
    fn setting_text(&self) -> String {
        self.to_string()
    }
    fn rust(&self) -> String {
        format!("{self:?}_f64")
    }
}

macro_rules! named_choices {
    ($($t:ident),*) => {$(
        impl SettingValue for $t {
            fn expected() -> String {
                format!("one of {}", $t::NAMES.join(", "))
            }
            const LITERAL: Literal = Literal::Choice { names: $t::NAMES, list: false };
            fn parse_setting(text: &str) -> Result<Self, String> {
                text.trim().parse().map_err(|e: UnknownChoice| e.to_string())
            }
            fn setting_text(&self) -> String {
                self.as_str().into()
            }
            fn rust(&self) -> String {
                format!("$config::{}::{}", stringify!($t), self.variant_name())
            }
        }
    )*};
}
named_choices!(Strategy, Precision, Fp8Recipe);

impl SettingValue for Vec<LogWith> {
    fn expected() -> String {
        format!("a comma-separated list of {}", LogWith::NAMES.join(", "))
    }
    const LITERAL: Literal = Literal::Choice { names: LogWith::NAMES, list: true };
    fn parse_setting(text: &str) -> Result<Self, String> {
        LogWith::parse_list(text).map_err(|e| e.to_string())
    }
    fn setting_text(&self) -> String {
        self.iter().map(|w| w.as_str()).collect::<Vec<_>>().join(",")
    }
    fn rust(&self) -> String {
        let items: Vec<String> =
            self.iter().map(|w| format!("$config::LogWith::{}", w.variant_name())).collect();
        format!("[{}]", items.join(", "))
    }
}

/// Which modules zero2/zero3/fsdp gather and reduce as one unit: FSDP's auto-wrap policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Wrap {
    /// `accel_core::Unit` wrappers, then each element of a repeated layer list
    /// (`layers.{i}`, `h.{i}` ...): the transformer blocks (`TRANSFORMER_BASED_WRAP`).
    #[default]
    Layers,
    /// The innermost module holding at least this many elements (`SIZE_BASED_WRAP` with
    /// `min_num_params`).
    Size(i64),
    /// The whole model as one unit (`NO_WRAP`).
    None,
}

impl fmt::Display for Wrap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Wrap::Layers => f.write_str("layers"),
            Wrap::Size(n) => write!(f, "size:{n}"),
            Wrap::None => f.write_str("none"),
        }
    }
}

/// A value of a setting that is not one (the message says what was expected).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadValue(pub String);

impl fmt::Display for BadValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for BadValue {}

impl FromStr for Wrap {
    type Err = BadValue;
    fn from_str(s: &str) -> Result<Self, BadValue> {
        match s.trim().to_ascii_lowercase().as_str() {
            "layers" => Ok(Wrap::Layers),
            "none" => Ok(Wrap::None),
            other => match other.strip_prefix("size:").map(str::parse::<i64>) {
                Some(Ok(n)) if n > 0 => Ok(Wrap::Size(n)),
                _ => Err(BadValue(format!(
                    "wrap `{s}`: expected layers, none or size:N (N parameters at least per unit)"
                ))),
            },
        }
    }
}

/// How `save_state` writes a model whose parameters are sharded (FSDP's `state_dict_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StateDict {
    /// Each process writes its own shard (`SHARDED_STATE_DICT`).
    #[default]
    Sharded,
    /// The parameters are gathered and the main process writes them whole
    /// (`FULL_STATE_DICT`).
    Full,
}

impl fmt::Display for StateDict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            StateDict::Sharded => "sharded",
            StateDict::Full => "full",
        })
    }
}

impl FromStr for StateDict {
    type Err = BadValue;
    fn from_str(s: &str) -> Result<Self, BadValue> {
        match s.trim().to_ascii_lowercase().as_str() {
            "sharded" => Ok(StateDict::Sharded),
            "full" => Ok(StateDict::Full),
            _ => Err(BadValue(format!("state_dict `{s}`: expected sharded or full"))),
        }
    }
}

/// Serde through `Display`/`FromStr`, for the small string-valued settings above.
macro_rules! serde_as_string {
    ($($t:ty),*) => {$(
        impl Serialize for $t {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.collect_str(self)
            }
        }
        impl<'de> Deserialize<'de> for $t {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let text = String::deserialize(d)?;
                text.parse().map_err(serde::de::Error::custom)
            }
        }
        impl SettingValue for $t {
            fn expected() -> String {
                match stringify!($t) {
                    "Wrap" => "layers, none or size:N".into(),
                    _ => "sharded or full".into(),
                }
            }
            const LITERAL: Literal = Literal::Text;
            fn parse_setting(text: &str) -> Result<Self, String> {
                text.parse().map_err(|e: BadValue| e.0)
            }
            fn setting_text(&self) -> String {
                self.to_string()
            }
            fn rust(&self) -> String {
                format!("$config::{}::from_text({:?})", stringify!($t), self.to_string())
            }
        }
    )*};
}
serde_as_string!(Wrap, StateDict);

impl Wrap {
    /// The value written `text` (for generated code; `text` is known to be valid).
    pub fn from_text(text: &str) -> Self {
        text.parse().unwrap_or_default()
    }
}

impl StateDict {
    /// The value written `text` (for generated code; `text` is known to be valid).
    pub fn from_text(text: &str) -> Self {
        text.parse().unwrap_or_default()
    }
}

/// The value type of a row: `Option<T>`'s `T` for an optional setting.
#[doc(hidden)]
#[macro_export]
macro_rules! __setting_config_ty {
    (required $ty:ty) => { $ty };
    (optional $ty:ty) => { ::std::option::Option<$ty> };
}

macro_rules! setting_rows {
    ($(
        $(#[doc = $doc:literal])+
        $name:ident : $mode:ident $ty:ty = $default:expr,
            env $env:literal, attribute $attr:ident, builder $builder:ident;
    )+) => {
        /// Every setting, in the table's order.
        pub const SETTINGS: &[Setting] = &[$(
            Setting {
                name: stringify!($name),
                env: $env,
                doc: concat!($($doc, "\n"),+),
                default: || {
                    let default: $crate::__setting_config_ty!($mode $ty) = $default;
                    setting_default_text!($mode default)
                },
                expected: <$ty as SettingValue>::expected,
                parse: |text| <$ty as SettingValue>::parse_setting(text).map(|v| v.rust()),
                literal: <$ty as SettingValue>::LITERAL,
                attribute: setting_flag!($attr),
            },
        )+];
    };
}

macro_rules! setting_default_text {
    (required $value:ident) => {
        SettingValue::setting_text(&$value)
    };
    (optional $value:ident) => {
        $value.as_ref().map(SettingValue::setting_text).unwrap_or_default()
    };
}

macro_rules! setting_flag {
    (yes) => {
        true
    };
    (no) => {
        false
    };
}

settings!(setting_rows);

impl Setting {
    /// Its documentation as one paragraph.
    pub fn text(&self) -> String {
        self.doc.lines().map(str::trim).filter(|l| !l.is_empty()).collect::<Vec<_>>().join(" ")
    }

    /// Its first sentence.
    pub fn summary(&self) -> String {
        let text = self.text();
        match text.find(". ") {
            Some(end) => text[..=end].to_owned(),
            None => text,
        }
    }
}

/// The setting named `name`.
pub fn setting(name: &str) -> Option<&'static Setting> {
    SETTINGS.iter().find(|s| s.name == name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_setting_parses_its_default_and_names_what_it_expects() {
        for s in SETTINGS {
            let default = (s.default)();
            if !default.is_empty() || s.name == "log_with" {
                assert!((s.parse)(&default).is_ok(), "{}: its default `{default}`", s.name);
            }
            assert!(s.env.starts_with("ACCEL_") && s.env[6..] == s.name.to_uppercase());
            assert!(!s.doc.trim().is_empty());
        }
        let accumulate = setting("accumulate").unwrap();
        assert_eq!((accumulate.parse)("4"), Ok("4".into()));
        assert!((accumulate.parse)("four").unwrap_err().contains("`four` is not an integer"));
        let strategy = setting("strategy").unwrap();
        assert_eq!((strategy.parse)("zero3"), Ok("$config::Strategy::Zero3".into()));
        assert!((strategy.parse)("fdsp").unwrap_err().contains("did you mean `fsdp`"));
        assert_eq!(
            (setting("wrap").unwrap().parse)("size:10"),
            Ok("$config::Wrap::from_text(\"size:10\")".into())
        );
        let trackers = (setting("log_with").unwrap().parse)("jsonl,mlflow").unwrap();
        assert_eq!(trackers, "[$config::LogWith::Jsonl, $config::LogWith::MlFlow]");
    }
}
