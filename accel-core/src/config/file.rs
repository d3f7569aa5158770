//! The launch configuration file (`accel config` writes it, `accel launch` and every
//! accelerator read it): our keys, and Hugging Face Accelerate's `default_config.yaml` keys
//! where they mean the same.

use std::path::{Path, PathBuf};

use super::check::Verdict;
pub use super::launch::LaunchConfig;
use super::{Precision, Strategy};
use crate::error::{Error, Result};

/// Names the DeepSpeed JSON config whose settings the program's accelerator applies.
pub const DEEPSPEED_CONFIG_ENV: &str = super::env::DEEPSPEED_CONFIG;

/// Where `accel config` writes and `accel launch` looks when no file is given:
/// `$ACCEL_CONFIG_DIR`, else `$XDG_CONFIG_HOME/accel`, else `~/.config/accel`, then
/// `default_config.yaml`.
pub fn default_config_path() -> Option<PathBuf> {
    let dir = std::env::var_os(super::env::CONFIG_DIR)
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("XDG_CONFIG_HOME").map(|d| PathBuf::from(d).join("accel")))
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".config/accel")))?;
    Some(dir.join("default_config.yaml"))
}

impl LaunchConfig {
    /// Reads a YAML file of our keys and/or Accelerate's, or a DeepSpeed JSON config
    /// (`.json`). A YAML's `deepspeed_config_file` is read too (from the working directory,
    /// else beside the YAML), and its values win over the YAML's, as in Accelerate. A key
    /// accel refuses makes it an error naming every such key; keys that only tune
    /// performance become one warning (see [`check`](Self::check)).
    pub fn from_file(path: &Path) -> Result<Self> {
        let config = Self::check(path)?;
        config.report.check(Some(&path.display().to_string()))?;
        Ok(config)
    }

    /// Reads a file as [`from_file`](Self::from_file) does, but a refused key is only
    /// noted in [`report`](Self::report): one note per key of the file, and of the DeepSpeed
    /// file it names (`accel config check`). `Err` when a file cannot be read or parsed.
    pub fn check(path: &Path) -> Result<Self> {
        let shown = path.display().to_string();
        let mut config = if path.extension().is_some_and(|e| e.eq_ignore_ascii_case("json")) {
            Self::from_deepspeed(path)?
        } else {
            let text = std::fs::read_to_string(path)
                .map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
            let (mut config, report) = super::yaml::read(&text).map_err(|e| match e {
                Error::Config(m) => Error::Config(format!("{shown}: {m}")),
                other => other,
            })?;
            config.report = report;
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
                if let Err(Error::Config(m)) = config.training.build() {
                    config.report.push("(files)", "", Verdict::Refused(m));
                }
                config.deepspeed_config = deepspeed.deepspeed_config;
                let name = json.file_name().map_or_else(
                    || json.display().to_string(),
                    |n| n.to_string_lossy().into_owned(),
                );
                config.report.extend_prefixed(&format!("{name}: "), deepspeed.report);
            }
            config
        };
        config.warnings.extend(config.report.warning(&shown));
        Ok(config)
    }

    /// A DeepSpeed JSON config's training settings and the file (absolute) for the rest.
    fn from_deepspeed(path: &Path) -> Result<Self> {
        let (deepspeed, report) = super::deepspeed::check(path)?;
        let absolute = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
        Ok(Self {
            training: deepspeed.training,
            deepspeed_config: Some(absolute),
            report,
            ..Self::default()
        })
    }

    /// Parses YAML text; a refused key (unknown, or not implemented) is an error naming it,
    /// and an unknown one the closest valid key.
    pub fn from_yaml(text: &str) -> Result<Self> {
        let (mut config, report) = super::yaml::read(text)?;
        report.check(None)?;
        config.warnings.extend(report.warning("the config"));
        config.report = report;
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
            gpu_ids: stronger.gpu_ids.clone().or(self.gpu_ids),
            num_cpu_threads_per_process: stronger
                .num_cpu_threads_per_process
                .or(self.num_cpu_threads_per_process),
            warnings: [self.warnings, stronger.warnings.clone()].concat(),
            report: self.report,
        }
    }

    /// The `ACCEL_*` variables carrying the training settings to the program.
    pub fn training_env(&self) -> Vec<(&'static str, String)> {
        let t = &self.training;
        let mut env = Vec::new();
        if let Some(path) = &self.deepspeed_config {
            env.push((DEEPSPEED_CONFIG_ENV, path.display().to_string()));
        }
        env.extend(t.env());
        if let Some(ids) = &self.gpu_ids {
            env.push(("CUDA_VISIBLE_DEVICES", ids.clone()));
        }
        if let Some(n) = self.num_cpu_threads_per_process {
            env.push(("OMP_NUM_THREADS", n.to_string()));
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
    use crate::config::PartialConfig;

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
    fn accelerates_cp_and_sp_sizes_and_megatrons_context_size_set_the_context_dimension() {
        for yaml in [
            "parallelism_config:\n  parallelism_config_cp_size: 2\n  \
             parallelism_config_cp_comm_strategy: alltoall\n",
            "parallelism_config:\n  parallelism_config_sp_size: 2\n",
            "megatron_lm_config:\n  megatron_lm_context_parallel_size: 2\n",
            "context_parallel: 2\n",
        ] {
            let config = LaunchConfig::from_yaml(yaml).unwrap();
            assert_eq!(config.training.context_parallel, Some(2), "{yaml}");
            assert!(
                config.training_env().contains(&("ACCEL_CONTEXT_PARALLEL", "2".to_owned())),
                "{yaml}"
            );
        }
        let yaml = "parallelism_config:\n  parallelism_config_cp_size: 2\n  \
                    parallelism_config_sp_size: 4\n";
        let err = LaunchConfig::from_yaml(yaml).unwrap_err().to_string();
        assert!(err.contains("sp_size") && err.contains("one context dimension"), "{err}");
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
        assert!(err.contains("`fp8_config.backend` (TE") && err.contains("backend: AO"), "{err}");
    }

    #[test]
    fn unknown_keys_name_the_closest_valid_one_and_round_trip_works() {
        let err = LaunchConfig::from_yaml("num_proceses: 2\n").unwrap_err().to_string();
        assert!(
            err.contains("`num_proceses` (unknown key")
                && err.contains("did you mean `num_processes`"),
            "{err}"
        );
        let c = LaunchConfig {
            num_processes: Some(2),
            training: PartialConfig { precision: Some(Precision::Fp16), ..Default::default() },
            ..Default::default()
        };
        let read = LaunchConfig::from_yaml(&c.to_yaml()).unwrap();
        assert_eq!(LaunchConfig { report: Default::default(), ..read }, c);
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
            err.contains("offload needs a sharded strategy")
                && err.contains("`deepspeed_config.nvme_x` (not a deepspeed_config key"),
            "{err}"
        );
        let c = LaunchConfig::from_yaml(
            "deepspeed_config:\n  zero_stage: 2\n  offload_optimizer_device: cpu\n",
        )
        .unwrap();
        assert_eq!((c.training.strategy, c.training.offload), (Some(Strategy::Zero2), Some(true)));
        assert!(c.training_env().contains(&("ACCEL_OFFLOAD", "true".to_owned())));
        let _ = std::fs::remove_dir_all(dir);
    }
}
