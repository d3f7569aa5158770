//! The launch configuration file (`accel config` writes it, `accel launch` reads it): our
//! keys, and Hugging Face Accelerate's `default_config.yaml` keys where they mean the same.

use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::config::{PartialConfig, Precision, Strategy, closest};
use crate::error::{Error, Result};

/// Settings of a launch; every field optional (flags and defaults fill the rest).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct LaunchConfig {
    /// Processes per machine.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub num_processes: Option<usize>,
    /// Machines.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub num_machines: Option<usize>,
    /// This machine's index.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub machine_rank: Option<usize>,
    /// Address of machine 0 (rank 0's store listens there).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub main_process_ip: Option<String>,
    /// Port of rank 0's store (0: a free one, single machine only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub main_process_port: Option<u16>,
    /// Training settings passed to the program as `ACCEL_*` variables.
    #[serde(flatten)]
    pub training: PartialConfig,
    /// A DeepSpeed JSON config (the file given, or Accelerate's `deepspeed_config_file`):
    /// its settings beyond `training` reach the program through `ACCEL_DEEPSPEED_CONFIG`.
    #[serde(skip)]
    pub deepspeed_config: Option<PathBuf>,
    /// What reading the file has to say (DeepSpeed settings ignored), for the caller to
    /// print once.
    #[serde(skip)]
    pub warnings: Vec<String>,
}

/// Names the DeepSpeed JSON config whose settings the program's accelerator applies.
pub const DEEPSPEED_CONFIG_ENV: &str = "ACCEL_DEEPSPEED_CONFIG";

/// Our keys.
const OURS: &[&str] = &[
    "num_processes",
    "num_machines",
    "machine_rank",
    "main_process_ip",
    "main_process_port",
    "strategy",
    "precision",
    "fp8_recipe",
    "accumulate",
    "clip_grad_norm",
    "seed",
    "cpu",
    "tensor_parallel",
    "pipeline_parallel",
    "sequence_parallel",
    "activation_checkpointing",
];

/// Accelerate keys we translate.
const TRANSLATED: &[&str] = &[
    "distributed_type",
    "mixed_precision",
    "fp8_config",
    "use_cpu",
    "gradient_accumulation_steps",
    "fsdp_config",
    "deepspeed_config",
    "megatron_lm_config",
];

/// Accelerate keys that have no meaning here; read and ignored.
const IGNORED: &[&str] = &[
    "compute_environment",
    "debug",
    "downcast_bf16",
    "dynamo_config",
    "enable_cpu_affinity",
    "gpu_ids",
    "ipex_config",
    "main_training_function",
    "mpirun_config",
    "rdzv_backend",
    "same_network",
    "tpu_env",
    "tpu_use_cluster",
    "tpu_use_sudo",
    "use_mps_device",
    "parallelism_config",
];

/// Where `accel config` writes and `accel launch` looks when no file is given:
/// `$ACCEL_CONFIG_DIR`, else `$XDG_CONFIG_HOME/accel`, else `~/.config/accel`, then
/// `default_config.yaml`.
pub fn default_config_path() -> Option<PathBuf> {
    let dir = std::env::var_os("ACCEL_CONFIG_DIR")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("XDG_CONFIG_HOME").map(|d| PathBuf::from(d).join("accel")))
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".config/accel")))?;
    Some(dir.join("default_config.yaml"))
}

/// Accelerate's inline `deepspeed_config` keys beyond `zero_stage`,
/// `gradient_accumulation_steps` and `deepspeed_config_file` (read by the caller): clipping
/// is taken, launcher-only keys are ignored, and anything else is named in one error.
fn deepspeed_inline(value: &serde_yaml_ng::Value, training: &mut PartialConfig) -> Result<()> {
    let Some(map) = value.as_mapping() else { return Ok(()) };
    let mut refused = Vec::new();
    for (k, v) in map {
        let key = k.as_str().unwrap_or_default();
        match key {
            "zero_stage" | "gradient_accumulation_steps" | "deepspeed_config_file" => {}
            "zero3_init_flag"
            | "zero3_save_16bit_model"
            | "deepspeed_multinode_launcher"
            | "deepspeed_hostfile"
            | "deepspeed_exclusion_filter"
            | "deepspeed_inclusion_filter" => {}
            "gradient_clipping" => match v.as_f64() {
                Some(max) if max > 0.0 => training.clip_grad_norm = Some(max),
                Some(_) => {}
                None => refused.push(format!("gradient_clipping = {v:?} (a number)")),
            },
            "offload_optimizer_device" | "offload_param_device" => {
                if v.as_str().is_some_and(|d| d != "none") {
                    refused.push(format!(
                        "{key} = {v:?} (accel launch has no offload flag: put the offload in a \
                         DeepSpeed JSON named by deepspeed_config_file, or call \
                         .offload(true) on the builder)"
                    ));
                }
            }
            other => refused.push(format!("{other} (not implemented)")),
        }
    }
    if refused.is_empty() {
        Ok(())
    } else {
        Err(Error::Config(format!("deepspeed_config: accel does not take {}", refused.join(", "))))
    }
}

impl LaunchConfig {
    /// Reads a YAML file of our keys and/or Accelerate's, or a DeepSpeed JSON config
    /// (`.json`). A YAML's `deepspeed_config_file` is read too (from the working directory,
    /// else beside the YAML), and its values win over the YAML's, as in Accelerate.
    pub fn from_file(path: &Path) -> Result<Self> {
        if path.extension().is_some_and(|e| e.eq_ignore_ascii_case("json")) {
            return Self::from_deepspeed(path);
        }
        let text = std::fs::read_to_string(path)
            .map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
        let mut config = Self::from_yaml(&text).map_err(|e| match e {
            Error::Config(m) => Error::Config(format!("{}: {m}", path.display())),
            other => other,
        })?;
        if let Some(json) = config.deepspeed_config.take() {
            // As Accelerate: the path as given (from the working directory); else beside
            // the YAML.
            let json = match path.parent() {
                Some(dir) if !json.exists() => dir.join(&json),
                _ => json,
            };
            let deepspeed = Self::from_deepspeed(&json)?;
            // As Accelerate: with a DeepSpeed file, its settings win over the YAML's
            // (`distributed_type: DEEPSPEED`'s zero2 default, `mixed_precision: no`).
            config.training = config.training.overlay(&deepspeed.training);
            config.training.build()?;
            config.deepspeed_config = deepspeed.deepspeed_config;
            config.warnings.extend(deepspeed.warnings);
        }
        Ok(config)
    }

    /// A DeepSpeed JSON config's training settings, and the file (absolute) for the rest;
    /// its performance hints are named in one warning.
    fn from_deepspeed(path: &Path) -> Result<Self> {
        let deepspeed = super::deepspeed::read(path)?;
        let mut warnings = Vec::new();
        if !deepspeed.ignored.is_empty() {
            warnings.push(format!(
                "{}: ignoring DeepSpeed performance settings accel has no use for: {}",
                path.display(),
                deepspeed.ignored.join(", ")
            ));
        }
        deepspeed.training.build()?;
        let absolute = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
        Ok(Self {
            training: deepspeed.training,
            deepspeed_config: Some(absolute),
            warnings,
            ..Self::default()
        })
    }

    /// Parses YAML text; an unknown key is an error naming the closest valid one.
    pub fn from_yaml(text: &str) -> Result<Self> {
        let value: serde_yaml_ng::Value =
            serde_yaml_ng::from_str(text).map_err(|e| Error::Config(format!("not YAML: {e}")))?;
        let map = match value {
            serde_yaml_ng::Value::Mapping(m) => m,
            serde_yaml_ng::Value::Null => return Ok(Self::default()),
            _ => {
                return Err(Error::Config("the config must be a mapping of keys to values".into()));
            }
        };
        let mut config = Self::default();
        let mut accelerate_accumulate = None;
        for (key, value) in &map {
            let key = key
                .as_str()
                .ok_or_else(|| Error::Config(format!("key {key:?} is not a string")))?;
            let bad = |expected: &str| {
                Error::Config(format!("`{key}`: expected {expected}, got {value:?}"))
            };
            let as_usize = || {
                value
                    .as_u64()
                    .and_then(|v| usize::try_from(v).ok())
                    .ok_or_else(|| bad("a non-negative integer"))
            };
            // Integers narrower than the YAML's are checked, never truncated.
            let as_u32 = || {
                value
                    .as_u64()
                    .and_then(|v| u32::try_from(v).ok())
                    .ok_or_else(|| bad(&format!("an integer from 0 to {}", u32::MAX)))
            };
            let as_str = || value.as_str().map(str::to_owned).ok_or_else(|| bad("a string"));
            match key {
                "num_processes" => config.num_processes = Some(as_usize()?),
                "num_machines" => config.num_machines = Some(as_usize()?),
                "machine_rank" => config.machine_rank = Some(as_usize()?),
                "main_process_ip" => config.main_process_ip = Some(as_str()?),
                "main_process_port" => {
                    config.main_process_port =
                        Some(u16::try_from(as_usize()?).map_err(|_| bad("a port number"))?)
                }
                "strategy" => config.training.strategy = Some(as_str()?.parse()?),
                "precision" => config.training.precision = Some(as_str()?.parse()?),
                "fp8_recipe" => config.training.fp8_recipe = Some(as_str()?.parse()?),
                "accumulate" => config.training.accumulate = Some(as_u32()?),
                "clip_grad_norm" => {
                    config.training.clip_grad_norm =
                        Some(value.as_f64().ok_or_else(|| bad("a number"))?)
                }
                "seed" => config.training.seed = Some(as_usize()? as u64),
                "tensor_parallel" => config.training.tensor_parallel = Some(as_usize()?),
                "pipeline_parallel" => config.training.pipeline_parallel = Some(as_usize()?),
                "sequence_parallel" => {
                    config.training.sequence_parallel =
                        Some(value.as_bool().ok_or_else(|| bad("true or false"))?)
                }
                "activation_checkpointing" => {
                    config.training.activation_checkpointing =
                        Some(value.as_bool().ok_or_else(|| bad("true or false"))?)
                }
                // Accelerate's Megatron-LM plugin: the degrees mean the same here.
                "megatron_lm_config" => {
                    let get = |k: &str| value.get(k);
                    let degree = |k: &str| {
                        get(k).and_then(|v| v.as_u64()).and_then(|v| usize::try_from(v).ok())
                    };
                    if let Some(tp) = degree("megatron_lm_tp_degree") {
                        config.training.tensor_parallel = Some(tp);
                    }
                    if let Some(pp) = degree("megatron_lm_pp_degree") {
                        config.training.pipeline_parallel = Some(pp);
                    }
                    if let Some(m) = get("megatron_lm_num_micro_batches").and_then(|v| v.as_u64()) {
                        accelerate_accumulate = Some(u32::try_from(m).map_err(|_| {
                            bad("megatron_lm_num_micro_batches of at most 4294967295")
                        })?);
                    }
                    if let Some(sp) =
                        get("megatron_lm_sequence_parallelism").and_then(|v| v.as_bool())
                    {
                        config.training.sequence_parallel = Some(sp);
                    }
                }
                "cpu" | "use_cpu" => {
                    config.training.cpu = Some(value.as_bool().ok_or_else(|| bad("true or false"))?)
                }
                "mixed_precision" => {
                    let p = as_str()?;
                    config.training.precision = Some(p.parse().map_err(|_| {
                        Error::Config(format!(
                            "mixed_precision `{p}`: expected no, fp16, bf16 or fp8"
                        ))
                    })?)
                }
                "distributed_type" => {
                    let d = as_str()?;
                    config.training.strategy = Some(match d.to_ascii_uppercase().as_str() {
                        "NO" => Strategy::Single,
                        "MULTI_CPU" | "MULTI_GPU" => Strategy::Ddp,
                        "FSDP" => config.training.strategy.unwrap_or(Strategy::Fsdp),
                        "DEEPSPEED" => config.training.strategy.unwrap_or(Strategy::Zero2),
                        other => {
                            return Err(Error::Config(format!(
                                "distributed_type `{other}` has no accel equivalent; accel reads \
                                 NO, MULTI_CPU, MULTI_GPU, FSDP and DEEPSPEED"
                            )));
                        }
                    })
                }
                // Accelerate's fp8 backends: torchao's (AO) is what accel implements, with
                // its default (tensor-wise) recipe unless `fp8_recipe` says otherwise.
                "fp8_config" => {
                    let backend = value.get("backend").and_then(serde_yaml_ng::Value::as_str);
                    match backend.map(str::to_ascii_uppercase).as_deref() {
                        None | Some("AO") => {}
                        Some(other) => {
                            return Err(Error::Config(format!(
                                "fp8_config: backend {other} (Transformer Engine or MS-AMP) is \
                                 not available in accel; accel's fp8 is torchao's (backend: AO), \
                                 with fp8_recipe tensorwise or rowwise"
                            )));
                        }
                    }
                }
                "gradient_accumulation_steps" => accelerate_accumulate = Some(as_u32()?),
                "deepspeed_config" => {
                    deepspeed_inline(value, &mut config.training)?;
                    if let Some(file) = value.get("deepspeed_config_file") {
                        let file = file.as_str().ok_or_else(|| {
                            bad("deepspeed_config_file to be a path to a JSON file")
                        })?;
                        config.deepspeed_config = Some(PathBuf::from(file));
                    }
                    if let Some(stage) =
                        value.get("zero_stage").and_then(serde_yaml_ng::Value::as_u64)
                    {
                        config.training.strategy = Some(match stage {
                            1 => Strategy::Zero1,
                            2 => Strategy::Zero2,
                            3 => Strategy::Zero3,
                            _ => Strategy::Ddp,
                        });
                    }
                    if let Some(n) = value
                        .get("gradient_accumulation_steps")
                        .and_then(serde_yaml_ng::Value::as_u64)
                    {
                        accelerate_accumulate = Some(u32::try_from(n).map_err(|_| {
                            bad("gradient_accumulation_steps of at most 4294967295")
                        })?);
                    }
                }
                "fsdp_config" => {
                    if let Some(on) = value.get("fsdp_activation_checkpointing") {
                        config.training.activation_checkpointing =
                            Some(on.as_bool().ok_or_else(|| {
                                bad("fsdp_activation_checkpointing: true or false")
                            })?);
                    }
                    if let Some(s) = value.get("fsdp_sharding_strategy") {
                        let s = s
                            .as_str()
                            .map(str::to_owned)
                            .or_else(|| s.as_u64().map(|n| n.to_string()));
                        config.training.strategy =
                            Some(match s.as_deref().map(str::to_ascii_uppercase).as_deref() {
                                Some("FULL_SHARD" | "1") => Strategy::Zero3,
                                Some("SHARD_GRAD_OP" | "2") => Strategy::Zero2,
                                Some("NO_SHARD" | "3") => Strategy::Ddp,
                                Some("HYBRID_SHARD" | "4") => Strategy::HybridShard,
                                Some(other @ ("_HYBRID_SHARD_ZERO2" | "5")) => {
                                    return Err(Error::Config(format!(
                                        "fsdp_sharding_strategy {other} (hybrid sharding of \
                                         gradients only) is not implemented; use HYBRID_SHARD, \
                                         FULL_SHARD or SHARD_GRAD_OP"
                                    )));
                                }
                                _ => Strategy::Fsdp,
                            });
                    }
                }
                k if IGNORED.contains(&k) => {}
                other => {
                    let valid: Vec<&str> =
                        OURS.iter().chain(TRANSLATED).chain(IGNORED).copied().collect();
                    let hint = closest(other, &valid)
                        .map(|c| format!(" — did you mean `{c}`?"))
                        .unwrap_or_default();
                    return Err(Error::Config(format!(
                        "unknown key `{other}`{hint} (accel's keys: {})",
                        OURS.join(", ")
                    )));
                }
            }
        }
        if config.training.accumulate.is_none() {
            config.training.accumulate = accelerate_accumulate;
        }
        config.training.build()?;
        Ok(config)
    }

    /// The YAML `accel config` writes (our keys only).
    pub fn to_yaml(&self) -> String {
        serde_yaml_ng::to_string(self).unwrap_or_default()
    }

    /// `self` with `stronger`'s values on top.
    pub fn overlay(self, stronger: &LaunchConfig) -> LaunchConfig {
        LaunchConfig {
            num_processes: stronger.num_processes.or(self.num_processes),
            num_machines: stronger.num_machines.or(self.num_machines),
            machine_rank: stronger.machine_rank.or(self.machine_rank),
            main_process_ip: stronger.main_process_ip.clone().or(self.main_process_ip),
            main_process_port: stronger.main_process_port.or(self.main_process_port),
            training: self.training.overlay(&stronger.training),
            deepspeed_config: stronger.deepspeed_config.clone().or(self.deepspeed_config),
            warnings: [self.warnings, stronger.warnings.clone()].concat(),
        }
    }

    /// The `ACCEL_*` variables carrying the training settings to the program.
    pub fn training_env(&self) -> Vec<(&'static str, String)> {
        let t = &self.training;
        let mut env = Vec::new();
        if let Some(path) = &self.deepspeed_config {
            env.push((DEEPSPEED_CONFIG_ENV, path.display().to_string()));
        }
        if let Some(v) = t.strategy {
            env.push(("ACCEL_STRATEGY", v.to_string()));
        }
        if let Some(v) = t.precision {
            env.push(("ACCEL_PRECISION", v.to_string()));
        }
        if let Some(v) = t.fp8_recipe {
            env.push(("ACCEL_FP8_RECIPE", v.to_string()));
        }
        if let Some(v) = t.accumulate {
            env.push(("ACCEL_ACCUMULATE", v.to_string()));
        }
        if let Some(v) = t.clip_grad_norm {
            env.push(("ACCEL_CLIP_GRAD_NORM", v.to_string()));
        }
        if let Some(v) = t.seed {
            env.push(("ACCEL_SEED", v.to_string()));
        }
        if let Some(v) = t.cpu {
            env.push(("ACCEL_CPU", v.to_string()));
        }
        if let Some(v) = t.tensor_parallel {
            env.push(("ACCEL_TENSOR_PARALLEL", v.to_string()));
        }
        if let Some(v) = t.pipeline_parallel {
            env.push(("ACCEL_PIPELINE_PARALLEL", v.to_string()));
        }
        if let Some(v) = t.sequence_parallel {
            env.push(("ACCEL_SEQUENCE_PARALLEL", v.to_string()));
        }
        if let Some(v) = t.activation_checkpointing {
            env.push(("ACCEL_ACTIVATION_CHECKPOINTING", v.to_string()));
        }
        env
    }
}

/// Strategy and precision names, for prompts.
pub fn choices() -> (&'static [&'static str], &'static [&'static str]) {
    (Strategy::NAMES, Precision::NAMES)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accelerate_default_config_keys_are_translated() {
        let yaml = "compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\n\
                    mixed_precision: bf16\nnum_processes: 4\nnum_machines: 1\nmachine_rank: 0\n\
                    main_process_ip: 10.1.2.3\nmain_process_port: 29501\nuse_cpu: true\n\
                    main_training_function: main\n";
        let c = LaunchConfig::from_yaml(yaml).unwrap();
        assert_eq!(c.num_processes, Some(4));
        assert_eq!(c.main_process_ip.as_deref(), Some("10.1.2.3"));
        assert_eq!(c.training.strategy, Some(Strategy::Ddp));
        assert_eq!(c.training.precision, Some(Precision::Bf16));
        assert_eq!(c.training.cpu, Some(true));
        let c = LaunchConfig::from_yaml("distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 3\n  gradient_accumulation_steps: 4\n").unwrap();
        assert_eq!((c.training.strategy, c.training.accumulate), (Some(Strategy::Zero3), Some(4)));
        let c = LaunchConfig::from_yaml(
            "distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: SHARD_GRAD_OP\n",
        )
        .unwrap();
        assert_eq!(c.training.strategy, Some(Strategy::Zero2));
        let c = LaunchConfig::from_yaml(
            "distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: HYBRID_SHARD\n",
        )
        .unwrap();
        assert_eq!(c.training.strategy, Some(Strategy::HybridShard));
        let yaml =
            "distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: _HYBRID_SHARD_ZERO2\n";
        let err = LaunchConfig::from_yaml(yaml).unwrap_err().to_string();
        assert!(err.contains("_HYBRID_SHARD_ZERO2") && err.contains("not implemented"), "{err}");
    }

    /// Property: any text (random bytes, and mutations of a valid file) parses or is a named
    /// error — never a panic.
    #[test]
    fn arbitrary_yaml_never_panics() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let valid = "mixed_precision: fp8\nfp8_config:\n  backend: AO\nnum_processes: 4\n\
                     accumulate: 2\nmegatron_lm_config:\n  megatron_lm_tp_degree: 2\n\
                     deepspeed_config:\n  zero_stage: 2\n  gradient_accumulation_steps: 3\n";
        let alphabet = b"abcdefghijklmnopqrstuvwxyz_:-0123456789 \n\t{}[],.'\"!&*#|>%@`";
        for _ in 0..3000 {
            let mut bytes = valid.as_bytes().to_vec();
            for _ in 0..rng.random_range(1..8) {
                let at = rng.random_range(0..bytes.len());
                match rng.random_range(0..3) {
                    0 => bytes[at] = alphabet[rng.random_range(0..alphabet.len())],
                    1 => bytes.insert(at, alphabet[rng.random_range(0..alphabet.len())]),
                    _ => {
                        bytes.remove(at);
                    }
                }
            }
            let text = String::from_utf8_lossy(&bytes);
            let _ = LaunchConfig::from_yaml(&text);
            let random: Vec<u8> = (0..rng.random_range(0..64)).map(|_| rng.random()).collect();
            let _ = LaunchConfig::from_yaml(&String::from_utf8_lossy(&random));
        }
    }

    #[test]
    fn integers_too_large_for_their_setting_are_named_errors_not_truncated() {
        for yaml in ["accumulate: 4294967297\n", "gradient_accumulation_steps: 4294967296\n"] {
            let err = LaunchConfig::from_yaml(yaml).unwrap_err().to_string();
            assert!(err.contains("4294967295"), "{yaml}: {err}");
        }
        let yaml = "deepspeed_config:\n  gradient_accumulation_steps: 8589934593\n";
        let err = LaunchConfig::from_yaml(yaml).unwrap_err().to_string();
        assert!(err.contains("gradient_accumulation_steps"), "{err}");
    }

    #[test]
    fn accelerates_fp8_config_is_read_and_other_backends_refused() {
        let yaml = "mixed_precision: fp8\nfp8_config:\n  backend: AO\nfp8_recipe: rowwise\n";
        let config = LaunchConfig::from_yaml(yaml).unwrap();
        assert_eq!(config.training.precision, Some(Precision::Fp8));
        assert_eq!(config.training.fp8_recipe, Some(crate::config::Fp8Recipe::Rowwise));
        assert!(config.training_env().contains(&("ACCEL_FP8_RECIPE", "rowwise".to_owned())));
        let err = LaunchConfig::from_yaml("mixed_precision: fp8\nfp8_config:\n  backend: TE\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("backend TE") && err.contains("backend: AO"), "{err}");
    }

    #[test]
    fn unknown_keys_name_the_closest_valid_one_and_round_trip_works() {
        let err = LaunchConfig::from_yaml("num_proceses: 2\n").unwrap_err().to_string();
        assert!(
            err.contains("unknown key `num_proceses`")
                && err.contains("did you mean `num_processes`"),
            "{err}"
        );
        let c = LaunchConfig {
            num_processes: Some(2),
            training: PartialConfig { precision: Some(Precision::Fp16), ..Default::default() },
            ..Default::default()
        };
        assert_eq!(LaunchConfig::from_yaml(&c.to_yaml()).unwrap(), c);
        let err = LaunchConfig::from_yaml("accumulate: 0\n").unwrap_err().to_string();
        assert!(err.contains("accumulate = 0"), "{err}");
    }

    #[test]
    fn a_deepspeed_file_named_by_an_accelerate_yaml_wins_over_the_yaml() {
        let dir = std::env::temp_dir().join(format!("accel-ds-yaml-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("ds.json"),
            r#"{"zero_optimization": {"stage": 3}, "fp16": {"enabled": true}}"#,
        )
        .unwrap();
        let yaml = dir.join("accelerate.yaml");
        std::fs::write(
            &yaml,
            "distributed_type: DEEPSPEED\nmixed_precision: 'no'\ndeepspeed_config:\n  \
             deepspeed_config_file: ds.json\n  zero3_init_flag: true\n  gradient_clipping: 0.5\n",
        )
        .unwrap();
        let c = LaunchConfig::from_file(&yaml).unwrap();
        assert_eq!(
            c.training.strategy,
            Some(Strategy::Zero3),
            "the JSON's stage, not DEEPSPEED's zero2"
        );
        assert_eq!(c.training.precision, Some(Precision::Fp16), "the JSON's fp16, not 'no'");
        assert_eq!(c.training.clip_grad_norm, Some(0.5));
        assert!(c.deepspeed_config.unwrap().ends_with("ds.json"));
        let err = LaunchConfig::from_yaml(
            "deepspeed_config:\n  offload_optimizer_device: cpu\n  nvme_x: 1\n",
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("accel launch has no offload flag")
                && err.contains("nvme_x (not implemented)"),
            "{err}"
        );
        let _ = std::fs::remove_dir_all(dir);
    }
}
