//! What a run is configured with, where each value came from, and every file and variable
//! it can come from: the configuration layer, below the launcher and the accelerator, which
//! both read it.
//!
//! Every setting is one row of `accel_choices::settings!`: [`Config`], [`PartialConfig`], the
//! `ACCEL_*` variables that carry settings ([`ENV_VARS`]), accel's own YAML keys and the
//! launcher's child environment are generated from it here (the builder's methods in
//! `accelerator/builder.rs`, the attribute's keys in accel-macros). Sources, strongest first:
//! the builder (or the `#[accelerate]` attribute, which expands into builder calls), the
//! environment (`ACCEL_*`, set by `accel launch`), a YAML file (`ACCEL_CONFIG_FILE` or
//! [`crate::AcceleratorBuilder::config_file`]), the defaults. When the builder overrides a
//! value that the environment or file also set, that is logged once on the main process.
//!
//! The files: accel's and Accelerate's launch YAML (`yaml.rs`), DeepSpeed's JSON
//! (`deepspeed.rs`), both read into a [`file::LaunchConfig`] (`file.rs`) with a note per key
//! (`check.rs`); every other `ACCEL_*` variable is named once in `env.rs`.

pub mod check;
pub mod deepspeed;
pub mod env;
pub mod file;
mod launch;
mod yaml;

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

pub use accel_choices::{
    DataSharding, Fp8Recipe, Literal, LogWith, Precision, SETTINGS, Setting, SettingValue,
    Sharding, StateDict, Strategy, UnknownChoice, Wrap, closest, parse_bool, setting,
};

/// accel's own keys of a launch file: the launch's, then the settings'.
pub fn launch_file_keys() -> Vec<&'static str> {
    yaml::our_keys()
}

/// The top-level keys of Accelerate's config files that accel reads (each gets a note in
/// `accel config check`).
pub fn accelerate_keys() -> &'static [&'static str] {
    yaml::ACCELERATE
}

/// `tensorboard,mlflow`: how a list of trackers is written in the environment and messages.
pub fn log_with_text(list: &[LogWith]) -> String {
    list.to_vec().setting_text()
}

/// A setting's value read from `text` (the environment's, a file's), the error naming
/// `source` (the variable or the key).
fn parse_setting<T: SettingValue>(source: &str, text: &str) -> Result<T> {
    T::parse_setting(text).map_err(|why| Error::Config(format!("{source}: {why}")))
}

/// Serde for a setting's value: written as in the environment (numbers and booleans as
/// themselves), read from a YAML scalar or a list (joined by commas), through
/// [`SettingValue`].
mod setting_serde {
    use serde::{Deserialize, Deserializer, Serializer};

    use super::SettingValue;

    /// What a file may write for a setting.
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Written {
        Bool(bool),
        Integer(i64),
        Number(f64),
        Text(String),
        List(Vec<String>),
    }

    pub(super) fn serialize<T: SettingValue, S: Serializer>(
        value: &Option<T>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        let Some(value) = value else { return s.serialize_none() };
        let text = value.setting_text();
        if let Ok(b) = text.parse::<bool>() {
            s.serialize_bool(b)
        } else if let Ok(i) = text.parse::<i64>() {
            s.serialize_i64(i)
        } else if let Ok(x) = text.parse::<f64>() {
            s.serialize_f64(x)
        } else {
            s.serialize_str(&text)
        }
    }

    pub(super) fn deserialize<'de, T: SettingValue, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Option<T>, D::Error> {
        let text = match Written::deserialize(d)? {
            Written::Bool(b) => b.to_string(),
            Written::Integer(i) => i.to_string(),
            Written::Number(x) => x.to_string(),
            Written::Text(t) => t,
            Written::List(items) => items.join(","),
        };
        T::parse_setting(&text).map(Some).map_err(serde::de::Error::custom)
    }
}

/// A `Config` field's value from a partial one (`required`: the default where unset;
/// `optional`: unset stays unset).
macro_rules! filled {
    (required $given:expr, $default:expr) => {
        $given.unwrap_or($default)
    };
    (optional $given:expr, $default:expr) => {
        $given.or($default)
    };
}

/// A `Config` field's value as a partial one's (`Some` for a required setting).
macro_rules! given {
    (required $value:expr) => {
        Some($value)
    };
    (optional $value:expr) => {
        $value
    };
}

/// Everything generated from the table (see the module's documentation).
macro_rules! configuration {
    ($(
        $(#[doc = $doc:literal])+
        $name:ident : $mode:ident $ty:ty = $default:expr,
            env $env:literal, attribute $attr:ident, builder $builder:ident;
    )+) => {
        /// The validated configuration of a run: one field per setting (docs/reference.md).
        #[derive(Debug, Clone, PartialEq)]
        pub struct Config {
            $(
                $(#[doc = $doc])+
                pub $name: accel_choices::__setting_config_ty!($mode $ty),
            )+
        }

        impl Default for Config {
            fn default() -> Self {
                Self { $($name: $default,)+ }
            }
        }

        /// A configuration with every value optional: one source's contribution. This is
        /// also accel's own YAML file format; unknown keys are an error naming the valid
        /// ones.
        #[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
        #[serde(deny_unknown_fields)]
        pub struct PartialConfig {
            $(
                #[doc = concat!("See [`Config::", stringify!($name), "`].")]
                #[serde(default, skip_serializing_if = "Option::is_none", with = "setting_serde")]
                pub $name: Option<$ty>,
            )+
        }

        /// The environment variables that carry settings, by setting (`accel launch` sets
        /// them for the processes it starts; [`PartialConfig::from_env`] reads them).
        pub const ENV_VARS: &[(&str, &str)] = &[$(($env, stringify!($name)),)+];

        impl PartialConfig {
            /// Reads the variables of [`ENV_VARS`] through `get`.
            pub fn from_env_with(get: impl Fn(&str) -> Option<String>) -> Result<Self> {
                let mut config = Self::default();
                $(
                    if let Some(text) = get($env) {
                        config.$name = Some(parse_setting($env, text.trim())?);
                    }
                )+
                Ok(config)
            }

            /// The variables carrying these settings to a program (what `accel launch` sets).
            pub fn env(&self) -> Vec<(&'static str, String)> {
                let mut env = Vec::new();
                $(
                    if let Some(value) = &self.$name {
                        env.push(($env, value.setting_text()));
                    }
                )+
                env
            }

            /// Sets setting `key` from `text` (a file's value, `source` naming it for
            /// errors); `Ok(false)` when `key` is no setting.
            pub fn set(&mut self, key: &str, text: &str, source: &str) -> Result<bool> {
                match key {
                    $(stringify!($name) => self.$name = Some(parse_setting(source, text)?),)+
                    _ => return Ok(false),
                }
                Ok(true)
            }

            /// `self` with the values of `stronger` on top.
            pub fn overlay(self, stronger: &PartialConfig) -> PartialConfig {
                PartialConfig { $($name: stronger.$name.clone().or(self.$name),)+ }
            }

            /// Values set in both `self` (explicit) and `weaker` that differ: (key, ours,
            /// theirs).
            pub fn conflicts(&self, weaker: &PartialConfig) -> Vec<(&'static str, String, String)> {
                let mut out = Vec::new();
                $(
                    if let (Some(a), Some(b)) = (&self.$name, &weaker.$name) {
                        if a != b {
                            out.push((stringify!($name), format!("{a:?}"), format!("{b:?}")));
                        }
                    }
                )+
                out
            }

            /// The values set, with the defaults for the rest (unchecked).
            fn filled(&self) -> Config {
                let default = Config::default();
                Config { $($name: filled!($mode self.$name.clone(), default.$name),)+ }
            }
        }

        impl Config {
            /// This configuration as a partial one, every value set.
            pub fn as_partial(&self) -> PartialConfig {
                PartialConfig { $($name: given!($mode self.$name.clone()),)+ }
            }
        }
    };
}

accel_choices::settings!(configuration);

/// A configuration is written as its settings' values (the unset optional ones left out),
/// as in a file.
impl Serialize for Config {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        self.as_partial().serialize(s)
    }
}

impl<'de> Deserialize<'de> for Config {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        PartialConfig::deserialize(d)?.build().map_err(serde::de::Error::custom)
    }
}

/// The longest wait accepted anywhere (a year): beyond it a number is a typo, and
/// `Duration::from_secs_f64` would panic somewhat further on.
const MAX_SECONDS: f64 = 365.0 * 24.0 * 3600.0;

/// A number of seconds as typed on a command line or in a variable: finite, at most a year,
/// and positive (or, with `zero_ok`, non-negative). The error says what was wrong.
pub fn parse_seconds(text: &str, zero_ok: bool) -> std::result::Result<f64, String> {
    let value: f64 =
        text.trim().parse().map_err(|_| format!("`{text}` is not a number of seconds"))?;
    let low_ok = if zero_ok { value >= 0.0 } else { value > 0.0 };
    if !value.is_finite() || !low_ok || value > MAX_SECONDS {
        let low = if zero_ok { "0" } else { "above 0" };
        return Err(format!(
            "{text} seconds: expected a number from {low} to {MAX_SECONDS} (a year)"
        ));
    }
    Ok(value)
}

/// Names the config file through the environment.
pub const CONFIG_FILE_ENV: &str = env::CONFIG_FILE;

impl PartialConfig {
    /// Reads a YAML config file.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
        serde_yaml_ng::from_str(&text)
            .map_err(|e| Error::Config(format!("{}: {e}", path.display())))
    }

    /// Reads the process environment.
    pub fn from_env() -> Result<Self> {
        Self::from_env_with(|k| std::env::var(k).ok())
    }

    /// Fills in defaults and checks every value.
    pub fn build(&self) -> Result<Config> {
        let config = self.filled();
        if config.tensor_parallel == 0 || config.pipeline_parallel == 0 {
            return Err(Error::Config(format!(
                "tensor_parallel = {}, pipeline_parallel = {}: each degree must be >= 1",
                config.tensor_parallel, config.pipeline_parallel
            )));
        }
        if config.context_parallel == 0 {
            return Err(Error::Config(
                "context_parallel = 0: the degree must be >= 1 (1: no context parallelism)".into(),
            ));
        }
        if config.sequence_parallel && config.tensor_parallel == 1 {
            return Err(Error::Config(
                "sequence_parallel splits the activations among the tensor-parallel ranks: it \
                 needs tensor_parallel >= 2"
                    .into(),
            ));
        }
        check_offload(config.offload, config.strategy)?;
        if config.accumulate == 0 {
            return Err(Error::Config(
                "accumulate = 0: the number of micro-batches per optimizer step must be >= 1"
                    .into(),
            ));
        }
        if let Some(max) = config.clip_grad_norm {
            if !(max > 0.0 && max.is_finite()) {
                return Err(Error::Config(format!(
                    "clip_grad_norm = {max}: the maximum gradient norm must be a finite number > 0"
                )));
            }
        }
        if config.optimizer_in_backward {
            check_optimizer_in_backward(&config)?;
        }
        Ok(config)
    }
}

/// What `optimizer_in_backward` cannot go with: each unit's update is applied as its
/// gradient arrives, so nothing may need every gradient first, or keep one for later.
fn check_optimizer_in_backward(config: &Config) -> Result<()> {
    let refuse = |why: String| {
        Err(Error::Config(format!(
            "optimizer_in_backward = true {why}; set optimizer_in_backward = false for it \
             (the ordinary step, after backward)"
        )))
    };
    if !config.strategy.shards() {
        return refuse(format!(
            "applies each unit's update as its gradient shard is reduced: it needs zero2, \
             zero3, fsdp or hybrid_shard, and the strategy is {}",
            config.strategy
        ));
    }
    if config.accumulate > 1 {
        return refuse(format!(
            "applies the update in every backward, so it cannot accumulate {} micro-batches \
             into one step (accumulate = {0})",
            config.accumulate
        ));
    }
    if let Some(max) = config.clip_grad_norm {
        return refuse(format!(
            "applies each unit's update before the next unit's gradient exists, so the global \
             norm that clip_grad_norm = {max} needs is never known in time"
        ));
    }
    if config.precision == Precision::Fp16 {
        return refuse(
            "cannot go with precision fp16, whose loss scaling must check every gradient for \
             inf/NaN before any update is applied (bf16 needs no scaling)"
                .into(),
        );
    }
    let split = [
        ("tensor_parallel", config.tensor_parallel),
        ("pipeline_parallel", config.pipeline_parallel),
        ("context_parallel", config.context_parallel),
    ];
    if let Some((key, n)) = split.into_iter().find(|(_, n)| *n > 1) {
        return refuse(format!(
            "is not combined with model parallelism ({key} = {n}), whose gradients are \
             finished across its ranks after backward"
        ));
    }
    Ok(())
}

/// GradScaler's settings (fp16's dynamic loss scaling: `precision::GradScaler`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ScalerConfig {
    /// Starting scale (torch: 2^16).
    pub init_scale: f64,
    /// Growth factor after `growth_interval` clean steps (torch: 2.0).
    pub growth_factor: f64,
    /// Factor applied on overflow (torch: 0.5).
    pub backoff_factor: f64,
    /// Clean steps before growing (torch: 2000).
    pub growth_interval: i64,
    /// Overflows before the scale backs off, counted since the last growth (DeepSpeed's
    /// `hysteresis`; torch: 1).
    #[serde(default = "one")]
    pub hysteresis: u32,
    /// The scale never backs off below this (DeepSpeed's `min_loss_scale`; torch: 0).
    #[serde(default)]
    pub min_scale: f64,
    /// Whether the scale changes at all (DeepSpeed's `loss_scale` > 0 fixes it).
    #[serde(default = "yes")]
    pub dynamic: bool,
    /// A clean step restores the hysteresis allowance (DeepSpeed's
    /// `consecutive_hysteresis`: only consecutive overflows back off).
    #[serde(default)]
    pub consecutive_hysteresis: bool,
}

fn one() -> u32 {
    1
}

fn yes() -> bool {
    true
}

impl Default for ScalerConfig {
    fn default() -> Self {
        Self {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            hysteresis: 1,
            min_scale: 0.0,
            dynamic: true,
            consecutive_hysteresis: false,
        }
    }
}

/// The config file named by `ACCEL_CONFIG_FILE`, if any.
pub fn config_file_from_env() -> Option<PathBuf> {
    std::env::var_os(CONFIG_FILE_ENV).map(PathBuf::from)
}

/// Offloading moves sharded state to the CPU; without sharding there is nothing to offload.
/// Checked where the setting is resolved, whichever source set it (code, file, DeepSpeed).
pub(crate) fn check_offload(offload: bool, strategy: Strategy) -> Result<()> {
    if offload && !strategy.can_offload() {
        return Err(Error::Config(format!(
            "offload needs a sharded strategy ({}); the strategy is {strategy}",
            Strategy::offload_choices()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_choices_list_the_valid_ones_and_guess() {
        let err = "bf61".parse::<Precision>().unwrap_err().to_string();
        assert!(err.contains("`no`, `fp16`, `bf16`, `fp8`"), "{err}");
        assert!(err.contains("did you mean `bf16`"), "{err}");
        let err = "fdsp".parse::<Strategy>().unwrap_err().to_string();
        assert!(err.contains("did you mean `fsdp`"), "{err}");
        assert_eq!("DDP".parse::<Strategy>().unwrap(), Strategy::Ddp);
    }

    #[test]
    fn explicit_beats_environment_beats_file_beats_default() {
        let file: PartialConfig =
            serde_yaml_ng::from_str("precision: fp16\naccumulate: 8\nseed: 1\n").unwrap();
        let env = PartialConfig::from_env_with(|k| match k {
            "ACCEL_ACCUMULATE" => Some("4".into()),
            "ACCEL_SEED" => Some("2".into()),
            _ => None,
        })
        .unwrap();
        let explicit = PartialConfig { seed: Some(3), ..Default::default() };
        let merged = file.overlay(&env).overlay(&explicit);
        let config = merged.build().unwrap();
        assert_eq!(config.precision, Precision::Fp16);
        assert_eq!(config.accumulate, 4);
        assert_eq!(config.seed, Some(3));
        assert_eq!(config.strategy, Strategy::Single);
        assert_eq!(explicit.conflicts(&env), vec![("seed", "3".into(), "2".into())]);
    }

    #[test]
    fn the_update_inside_backward_refuses_what_needs_every_gradient_first() {
        let on = |p: PartialConfig| {
            let p = PartialConfig { optimizer_in_backward: Some(true), ..p };
            p.build().map(|_| ()).map_err(|e| e.to_string())
        };
        let zero3 = || PartialConfig { strategy: Some(Strategy::Zero3), ..Default::default() };
        on(zero3()).unwrap();
        for strategy in [Strategy::Zero2, Strategy::Fsdp, Strategy::HybridShard] {
            on(PartialConfig { strategy: Some(strategy), ..Default::default() }).unwrap();
        }
        let refused = [
            (PartialConfig { strategy: Some(Strategy::Ddp), ..Default::default() }, "is ddp"),
            (PartialConfig::default(), "it needs zero2, zero3, fsdp or hybrid_shard"),
            (PartialConfig { accumulate: Some(4), ..zero3() }, "(accumulate = 4)"),
            (PartialConfig { clip_grad_norm: Some(1.0), ..zero3() }, "clip_grad_norm = 1"),
            (PartialConfig { precision: Some(Precision::Fp16), ..zero3() }, "precision fp16"),
            (PartialConfig { tensor_parallel: Some(2), ..zero3() }, "(tensor_parallel = 2)"),
        ];
        for (config, says) in refused {
            let err = on(config).unwrap_err();
            assert!(err.contains("optimizer_in_backward = true") && err.contains(says), "{err}");
        }
        on(PartialConfig { precision: Some(Precision::Bf16), ..zero3() }).unwrap();
    }

    #[test]
    fn bad_values_are_errors_that_name_them() {
        let err = PartialConfig { accumulate: Some(0), ..Default::default() }.build().unwrap_err();
        assert!(err.to_string().contains("accumulate = 0"), "{err}");
        let err = PartialConfig::from_env_with(|k| (k == "ACCEL_PRECISION").then(|| "fp61".into()))
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("invalid configuration: ACCEL_PRECISION: unknown precision `fp61`"),
            "{err}"
        );
        let err =
            serde_yaml_ng::from_str::<PartialConfig>("precison: bf16\n").unwrap_err().to_string();
        assert!(err.contains("unknown field `precison`") && err.contains("precision"), "{err}");
        let env = |k: &str, v: &str| {
            let (k, v) = (k.to_owned(), v.to_owned());
            PartialConfig::from_env_with(move |var| (var == k).then(|| v.clone()))
        };
        assert_eq!(env("ACCEL_WRAP", "size:1000").unwrap().wrap, Some(Wrap::Size(1000)));
        assert_eq!(env("ACCEL_STATE_DICT", "FULL").unwrap().state_dict, Some(StateDict::Full));
        assert_eq!(
            env("ACCEL_LOG_WITH", "mlflow,jsonl").unwrap().log_with,
            Some(vec![LogWith::MlFlow, LogWith::Jsonl])
        );
        assert_eq!(env("ACCEL_LOG_WITH", "wandb").unwrap().log_with, Some(vec![LogWith::Wandb]));
        let err = env("ACCEL_LOG_WITH", "comet_ml").unwrap_err().to_string();
        assert!(err.contains("ACCEL_LOG_WITH: unknown tracker `comet_ml`"), "{err}");
        // A file takes a list or one comma-separated string, and writes the latter.
        for text in ["log_with: [tensorboard, mlflow]\n", "log_with: tensorboard,mlflow\n"] {
            let file: PartialConfig = serde_yaml_ng::from_str(text).unwrap();
            assert_eq!(file.log_with, Some(vec![LogWith::TensorBoard, LogWith::MlFlow]));
            let built = file.build().unwrap();
            assert_eq!(
                serde_yaml_ng::to_string(&built).unwrap().lines().last(),
                Some("log_with: tensorboard,mlflow")
            );
        }
        let err = env("ACCEL_WRAP", "size:-3").unwrap_err().to_string();
        assert!(
            err.contains("ACCEL_WRAP: wrap `size:-3`: expected layers, none or size:N"),
            "{err}"
        );
        let err = PartialConfig { offload: Some(true), ..Default::default() }.build().unwrap_err();
        assert!(err.to_string().contains("offload needs a sharded strategy"), "{err}");
        let err =
            PartialConfig { clip_grad_norm: Some(-1.0), ..Default::default() }.build().unwrap_err();
        assert!(err.to_string().contains("clip_grad_norm"), "{err}");
    }
}
