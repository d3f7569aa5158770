//! What a run is configured with, and where each value came from.
//!
//! Sources, strongest first: the builder (or the `#[accelerate]` attribute, which expands
//! into builder calls), the environment (`ACCEL_*`, set by `accel launch`), a YAML file
//! (`ACCEL_CONFIG_FILE` or [`crate::AcceleratorBuilder::config_file`]), the defaults. When
//! the builder overrides a value that the environment or file also set, that is logged
//! once on the main process.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

pub use accel_choices::{
    DataSharding, Fp8Recipe, LogWith, Precision, Sharding, Strategy, UnknownChoice,
};

pub use accel_choices::closest;

/// The validated configuration of a run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Config {
    /// Distribution strategy.
    pub strategy: Strategy,
    /// Mixed precision mode.
    pub precision: Precision,
    /// How fp8 layers scale their operands (used when `precision` is fp8).
    #[serde(default)]
    pub fp8_recipe: Fp8Recipe,
    /// Micro-batches per optimizer step (gradient accumulation), >= 1.
    pub accumulate: u32,
    /// Clip the global gradient L2 norm to this value before each optimizer step.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub clip_grad_norm: Option<f64>,
    /// Seed for torch's generators and data shuffling.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    /// Run on CPU even where a GPU is available.
    pub cpu: bool,
    /// Tensor-parallel ranks (Megatron's tensor model parallel size), >= 1.
    pub tensor_parallel: usize,
    /// Pipeline stages, >= 1.
    pub pipeline_parallel: usize,
    /// Context-parallel ranks: each sequence split among them, attention exchanging heads
    /// by all-to-all (Accelerate's `parallelism_config` cp_size), >= 1.
    #[serde(default = "one")]
    pub context_parallel: usize,
    /// Split the activations outside tensor-parallel regions along the sequence.
    pub sequence_parallel: bool,
    /// Recompute each unit's activations in backward instead of keeping them (FSDP's
    /// `activation_checkpointing`; units are `accel::Unit`s run with `run_on`).
    #[serde(default)]
    pub activation_checkpointing: bool,
    /// Keep the fp32 master shards and the optimizer state in CPU memory (zero2, zero3,
    /// fsdp; FSDP's `offload_params`, DeepSpeed's `offload_optimizer`).
    #[serde(default)]
    pub offload: bool,
    /// Broadcast the first process's initial values of a prepared model to the others
    /// (FSDP's `sync_module_states`, on by default).
    #[serde(default = "yes")]
    pub sync_module_states: bool,
    /// Which modules zero2/zero3/fsdp gather and reduce as one unit (FSDP's auto-wrap policy).
    #[serde(default)]
    pub wrap: Wrap,
    /// How `save_state` writes a sharded model (FSDP's `state_dict_type`).
    #[serde(default)]
    pub state_dict: StateDict,
    /// The trackers `init_trackers` starts (Accelerate's `log_with`).
    #[serde(default, skip_serializing_if = "Vec::is_empty", with = "log_with_list")]
    pub log_with: Vec<LogWith>,
}

/// `log_with` in a file: a list (`[tensorboard, mlflow]`) or one comma-separated string.
mod log_with_list {
    use super::LogWith;
    use serde::{Deserialize, Deserializer, Serializer};

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Written {
        One(String),
        Many(Vec<String>),
    }

    fn parse<'de, D: Deserializer<'de>>(written: Written) -> Result<Vec<LogWith>, D::Error> {
        let text = match written {
            Written::One(text) => text,
            Written::Many(list) => list.join(","),
        };
        LogWith::parse_list(&text).map_err(serde::de::Error::custom)
    }

    pub(super) fn serialize<S: Serializer>(list: &[LogWith], s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(&super::log_with_text(list))
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<LogWith>, D::Error> {
        parse::<D>(Written::deserialize(d)?)
    }

    /// For `Option<Vec<LogWith>>` fields.
    pub(super) mod option {
        use super::*;

        pub(crate) fn serialize<S: Serializer>(
            list: &Option<Vec<LogWith>>,
            s: S,
        ) -> Result<S::Ok, S::Error> {
            match list {
                Some(list) => super::serialize(list, s),
                None => s.serialize_none(),
            }
        }

        pub(crate) fn deserialize<'de, D: Deserializer<'de>>(
            d: D,
        ) -> Result<Option<Vec<LogWith>>, D::Error> {
            super::deserialize(d).map(Some)
        }
    }
}

/// `tensorboard,mlflow`: how a list of trackers is written in the environment and messages.
pub fn log_with_text(list: &[LogWith]) -> String {
    list.iter().map(|w| w.as_str()).collect::<Vec<_>>().join(",")
}

fn one() -> usize {
    1
}

fn yes() -> bool {
    true
}

/// Which modules zero2/zero3/fsdp gather and reduce as one unit: FSDP's auto-wrap policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Wrap {
    /// `accel::Unit` wrappers, then each element of a repeated layer list (`layers.{i}`,
    /// `h.{i}` ...): the transformer blocks (`TRANSFORMER_BASED_WRAP`).
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

impl FromStr for Wrap {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let bad = || {
            Error::Config(format!(
                "wrap `{s}`: expected layers, none or size:N (N parameters at least per unit)"
            ))
        };
        match s.trim().to_ascii_lowercase().as_str() {
            "layers" => Ok(Wrap::Layers),
            "none" => Ok(Wrap::None),
            other => match other.strip_prefix("size:").map(str::parse::<i64>) {
                Some(Ok(n)) if n > 0 => Ok(Wrap::Size(n)),
                _ => Err(bad()),
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
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "sharded" => Ok(StateDict::Sharded),
            "full" => Ok(StateDict::Full),
            _ => Err(Error::Config(format!("state_dict `{s}`: expected sharded or full"))),
        }
    }
}

/// Serde through `Display`/`FromStr`, for the small string-valued settings above.
macro_rules! serde_as_string {
    ($($t:ty),*) => {$(
        impl Serialize for $t {
            fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
                s.collect_str(self)
            }
        }
        impl<'de> Deserialize<'de> for $t {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
                let text = String::deserialize(d)?;
                text.parse().map_err(serde::de::Error::custom)
            }
        }
    )*};
}
serde_as_string!(Wrap, StateDict);

impl Default for Config {
    fn default() -> Self {
        Self {
            strategy: Strategy::Single,
            precision: Precision::No,
            fp8_recipe: Fp8Recipe::Tensorwise,
            accumulate: 1,
            clip_grad_norm: None,
            seed: None,
            cpu: false,
            tensor_parallel: 1,
            pipeline_parallel: 1,
            context_parallel: 1,
            sequence_parallel: false,
            activation_checkpointing: false,
            offload: false,
            sync_module_states: true,
            wrap: Wrap::Layers,
            state_dict: StateDict::Sharded,
            log_with: Vec::new(),
        }
    }
}

/// A configuration with every value optional: one source's contribution. This is also the
/// YAML file format; unknown keys are an error naming the valid ones.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PartialConfig {
    /// See [`Config::strategy`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub strategy: Option<Strategy>,
    /// See [`Config::precision`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub precision: Option<Precision>,
    /// See [`Config::fp8_recipe`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fp8_recipe: Option<Fp8Recipe>,
    /// See [`Config::accumulate`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub accumulate: Option<u32>,
    /// See [`Config::clip_grad_norm`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub clip_grad_norm: Option<f64>,
    /// See [`Config::seed`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    /// See [`Config::cpu`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu: Option<bool>,
    /// See [`Config::tensor_parallel`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tensor_parallel: Option<usize>,
    /// See [`Config::pipeline_parallel`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pipeline_parallel: Option<usize>,
    /// See [`Config::context_parallel`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub context_parallel: Option<usize>,
    /// See [`Config::sequence_parallel`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sequence_parallel: Option<bool>,
    /// See [`Config::activation_checkpointing`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub activation_checkpointing: Option<bool>,
    /// See [`Config::offload`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub offload: Option<bool>,
    /// See [`Config::sync_module_states`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sync_module_states: Option<bool>,
    /// See [`Config::wrap`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub wrap: Option<Wrap>,
    /// See [`Config::state_dict`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub state_dict: Option<StateDict>,
    /// See [`Config::log_with`].
    #[serde(default, skip_serializing_if = "Option::is_none", with = "log_with_list::option")]
    pub log_with: Option<Vec<LogWith>>,
}

/// Environment variables read by [`PartialConfig::from_env`] (set by `accel launch`).
pub const ENV_VARS: &[(&str, &str)] = &[
    ("ACCEL_STRATEGY", "strategy"),
    ("ACCEL_PRECISION", "precision"),
    ("ACCEL_FP8_RECIPE", "fp8_recipe"),
    ("ACCEL_ACCUMULATE", "accumulate"),
    ("ACCEL_CLIP_GRAD_NORM", "clip_grad_norm"),
    ("ACCEL_SEED", "seed"),
    ("ACCEL_CPU", "cpu"),
    ("ACCEL_TENSOR_PARALLEL", "tensor_parallel"),
    ("ACCEL_PIPELINE_PARALLEL", "pipeline_parallel"),
    ("ACCEL_CONTEXT_PARALLEL", "context_parallel"),
    ("ACCEL_SEQUENCE_PARALLEL", "sequence_parallel"),
    ("ACCEL_ACTIVATION_CHECKPOINTING", "activation_checkpointing"),
    ("ACCEL_OFFLOAD", "offload"),
    ("ACCEL_SYNC_MODULE_STATES", "sync_module_states"),
    ("ACCEL_WRAP", "wrap"),
    ("ACCEL_STATE_DICT", "state_dict"),
    ("ACCEL_LOG_WITH", "log_with"),
];

pub(crate) fn parse_bool(value: &str) -> Option<bool> {
    match value.to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" => Some(true),
        "0" | "false" | "no" | "" => Some(false),
        _ => None,
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
pub const CONFIG_FILE_ENV: &str = "ACCEL_CONFIG_FILE";

impl PartialConfig {
    /// Reads a YAML config file.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
        serde_yaml_ng::from_str(&text)
            .map_err(|e| Error::Config(format!("{}: {e}", path.display())))
    }

    /// Reads the `ACCEL_*` variables of [`ENV_VARS`] through `get`.
    pub fn from_env_with(get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let mut config = Self::default();
        let parse_err = |var: &str, value: &str, expected: &str| {
            Error::Config(format!("{var}={value:?} is not {expected}"))
        };
        for (var, _) in ENV_VARS {
            let Some(value) = get(var) else { continue };
            let value = value.trim().to_owned();
            match *var {
                "ACCEL_STRATEGY" => {
                    config.strategy = Some(value.parse().map_err(|e| env_context(var, e))?)
                }
                "ACCEL_PRECISION" => {
                    config.precision = Some(value.parse().map_err(|e| env_context(var, e))?)
                }
                "ACCEL_FP8_RECIPE" => {
                    config.fp8_recipe = Some(value.parse().map_err(|e| env_context(var, e))?)
                }
                "ACCEL_ACCUMULATE" => {
                    config.accumulate =
                        Some(value.parse().map_err(|_| parse_err(var, &value, "an integer >= 1"))?)
                }
                "ACCEL_CLIP_GRAD_NORM" => {
                    config.clip_grad_norm =
                        Some(value.parse().map_err(|_| parse_err(var, &value, "a number > 0"))?)
                }
                "ACCEL_SEED" => {
                    config.seed =
                        Some(value.parse().map_err(|_| parse_err(var, &value, "an integer"))?)
                }
                "ACCEL_CPU" => {
                    config.cpu = Some(
                        parse_bool(&value)
                            .ok_or_else(|| parse_err(var, &value, "true or false"))?,
                    )
                }
                "ACCEL_TENSOR_PARALLEL" => {
                    config.tensor_parallel =
                        Some(value.parse().map_err(|_| parse_err(var, &value, "an integer >= 1"))?)
                }
                "ACCEL_PIPELINE_PARALLEL" => {
                    config.pipeline_parallel =
                        Some(value.parse().map_err(|_| parse_err(var, &value, "an integer >= 1"))?)
                }
                "ACCEL_CONTEXT_PARALLEL" => {
                    config.context_parallel =
                        Some(value.parse().map_err(|_| parse_err(var, &value, "an integer >= 1"))?)
                }
                "ACCEL_SEQUENCE_PARALLEL" => {
                    config.sequence_parallel = Some(
                        parse_bool(&value)
                            .ok_or_else(|| parse_err(var, &value, "true or false"))?,
                    )
                }
                "ACCEL_ACTIVATION_CHECKPOINTING" => {
                    config.activation_checkpointing = Some(
                        parse_bool(&value)
                            .ok_or_else(|| parse_err(var, &value, "true or false"))?,
                    )
                }
                "ACCEL_OFFLOAD" => {
                    config.offload = Some(
                        parse_bool(&value)
                            .ok_or_else(|| parse_err(var, &value, "true or false"))?,
                    )
                }
                "ACCEL_SYNC_MODULE_STATES" => {
                    config.sync_module_states = Some(
                        parse_bool(&value)
                            .ok_or_else(|| parse_err(var, &value, "true or false"))?,
                    )
                }
                "ACCEL_WRAP" => config.wrap = Some(value.parse().map_err(|e| env_error(var, e))?),
                "ACCEL_STATE_DICT" => {
                    config.state_dict = Some(value.parse().map_err(|e| env_error(var, e))?)
                }
                "ACCEL_LOG_WITH" => {
                    config.log_with =
                        Some(LogWith::parse_list(&value).map_err(|e| env_context(var, e))?)
                }
                _ => unreachable!("every ENV_VARS entry is handled"),
            }
        }
        Ok(config)
    }

    /// Reads the process environment.
    pub fn from_env() -> Result<Self> {
        Self::from_env_with(|k| std::env::var(k).ok())
    }

    /// `self` with the values of `stronger` on top.
    pub fn overlay(self, stronger: &PartialConfig) -> PartialConfig {
        PartialConfig {
            strategy: stronger.strategy.or(self.strategy),
            precision: stronger.precision.or(self.precision),
            fp8_recipe: stronger.fp8_recipe.or(self.fp8_recipe),
            accumulate: stronger.accumulate.or(self.accumulate),
            clip_grad_norm: stronger.clip_grad_norm.or(self.clip_grad_norm),
            seed: stronger.seed.or(self.seed),
            cpu: stronger.cpu.or(self.cpu),
            tensor_parallel: stronger.tensor_parallel.or(self.tensor_parallel),
            pipeline_parallel: stronger.pipeline_parallel.or(self.pipeline_parallel),
            context_parallel: stronger.context_parallel.or(self.context_parallel),
            sequence_parallel: stronger.sequence_parallel.or(self.sequence_parallel),
            activation_checkpointing: stronger
                .activation_checkpointing
                .or(self.activation_checkpointing),
            offload: stronger.offload.or(self.offload),
            sync_module_states: stronger.sync_module_states.or(self.sync_module_states),
            wrap: stronger.wrap.or(self.wrap),
            state_dict: stronger.state_dict.or(self.state_dict),
            log_with: stronger.log_with.clone().or(self.log_with),
        }
    }

    /// Values set in both `self` (explicit) and `weaker` that differ: (key, ours, theirs).
    pub fn conflicts(&self, weaker: &PartialConfig) -> Vec<(&'static str, String, String)> {
        let mut out = Vec::new();
        macro_rules! check {
            ($($field:ident),*) => {$(
                if let (Some(a), Some(b)) = (&self.$field, &weaker.$field) {
                    if a != b {
                        out.push((stringify!($field), format!("{a:?}"), format!("{b:?}")));
                    }
                }
            )*};
        }
        check!(
            strategy,
            precision,
            fp8_recipe,
            accumulate,
            clip_grad_norm,
            seed,
            cpu,
            tensor_parallel,
            pipeline_parallel,
            context_parallel,
            sequence_parallel,
            activation_checkpointing,
            offload,
            sync_module_states,
            wrap,
            state_dict,
            log_with
        );
        out
    }

    /// Fills in defaults and checks every value.
    pub fn build(&self) -> Result<Config> {
        let d = Config::default();
        let config = Config {
            strategy: self.strategy.unwrap_or(d.strategy),
            precision: self.precision.unwrap_or(d.precision),
            fp8_recipe: self.fp8_recipe.unwrap_or(d.fp8_recipe),
            accumulate: self.accumulate.unwrap_or(d.accumulate),
            clip_grad_norm: self.clip_grad_norm.or(d.clip_grad_norm),
            seed: self.seed.or(d.seed),
            cpu: self.cpu.unwrap_or(d.cpu),
            tensor_parallel: self.tensor_parallel.unwrap_or(d.tensor_parallel),
            pipeline_parallel: self.pipeline_parallel.unwrap_or(d.pipeline_parallel),
            context_parallel: self.context_parallel.unwrap_or(d.context_parallel),
            sequence_parallel: self.sequence_parallel.unwrap_or(d.sequence_parallel),
            activation_checkpointing: self
                .activation_checkpointing
                .unwrap_or(d.activation_checkpointing),
            offload: self.offload.unwrap_or(d.offload),
            sync_module_states: self.sync_module_states.unwrap_or(d.sync_module_states),
            wrap: self.wrap.unwrap_or(d.wrap),
            state_dict: self.state_dict.unwrap_or(d.state_dict),
            log_with: self.log_with.clone().unwrap_or(d.log_with),
        };
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
        if config.offload && !config.strategy.can_offload() {
            return Err(Error::Config(format!(
                "offload needs a sharded strategy (zero2, zero3 or fsdp); the strategy is {}",
                config.strategy
            )));
        }
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
        Ok(config)
    }
}

fn env_context(var: &str, e: UnknownChoice) -> Error {
    Error::Config(format!("{var}: {e}"))
}

fn env_error(var: &str, e: Error) -> Error {
    match e {
        Error::Config(m) => Error::Config(format!("{var}: {m}")),
        other => other,
    }
}

/// The config file named by `ACCEL_CONFIG_FILE`, if any.
pub fn config_file_from_env() -> Option<PathBuf> {
    std::env::var_os(CONFIG_FILE_ENV).map(PathBuf::from)
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
