//! Reading a launch YAML, key by key: accel's own keys and Hugging Face Accelerate's (its
//! `ClusterConfig`/`SageMakerConfig` and the `fsdp_config`, `deepspeed_config`,
//! `megatron_lm_config`, `parallelism_config`, `fp8_config`, `dynamo_config`, `ipex_config`,
//! `mpirun_config` sections). Every key gets one [`Note`](super::check::Note): what it
//! becomes, why it is ignored, a performance hint accel does not follow, or a refusal.

use std::path::PathBuf;

use serde_yaml_ng::Value;

use super::check::{Report, Verdict, show_yaml};
use super::launch::LaunchConfig;
use crate::config::{StateDict, Strategy, Wrap, closest};
use crate::error::{Error, Result};

/// Our keys besides the settings' (the table's, `accel_choices::SETTINGS`): the launch's.
pub(super) const LAUNCH_KEYS: &[&str] = &[
    "num_processes",
    "num_machines",
    "machine_rank",
    "main_process_ip",
    "main_process_port",
    "gpu_ids",
    "num_cpu_threads_per_process",
    "deepspeed_config_file",
];

/// Every key of accel's own: the launch's, then the settings'.
pub(super) fn our_keys() -> Vec<&'static str> {
    let settings = crate::config::SETTINGS.iter().map(|s| s.name);
    LAUNCH_KEYS[..5]
        .iter()
        .copied()
        .chain(settings)
        .chain(LAUNCH_KEYS[5..].iter().copied())
        .collect()
}

/// A setting's value as a file writes it, as the environment would: a scalar's text, a
/// list's items joined by commas.
fn setting_text(key: &str, v: &Value) -> Result<String> {
    Ok(match v {
        Value::Sequence(items) => {
            items.iter().map(|item| as_str(key, item)).collect::<Result<Vec<_>>>()?.join(",")
        }
        Value::String(text) => text.clone(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        other => return Err(bad(key, "a value", other)),
    })
}

/// Accelerate's top-level keys (its `ClusterConfig` and `SageMakerConfig`).
pub(crate) const ACCELERATE: &[&str] = &[
    "compute_environment",
    "distributed_type",
    "mixed_precision",
    "use_cpu",
    "debug",
    "gradient_accumulation_steps",
    "fp8_config",
    "deepspeed_config",
    "fsdp_config",
    "parallelism_config",
    "megatron_lm_config",
    "mpirun_config",
    "dynamo_config",
    "ipex_config",
    "downcast_bf16",
    "rdzv_backend",
    "same_network",
    "main_training_function",
    "enable_cpu_affinity",
    "use_mps_device",
    "tpu_name",
    "tpu_zone",
    "tpu_use_cluster",
    "tpu_use_sudo",
    "tpu_vm",
    "tpu_env",
    "command_file",
    "commands",
    "ec2_instance_type",
    "iam_role_name",
    "image_uri",
    "profile",
    "region",
    "base_job_name",
    "pytorch_version",
    "transformers_version",
    "py_version",
    "sagemaker_inputs_file",
    "sagemaker_metrics_file",
    "additional_args",
];

/// The text of a configuration error, without the "invalid configuration" prefix.
fn why(e: Error) -> String {
    match e {
        Error::Config(m) => m,
        other => other.to_string(),
    }
}

fn bad(key: &str, expected: &str, value: &Value) -> Error {
    Error::Config(format!("`{key}`: expected {expected}, got {}", show_yaml(value)))
}

fn as_usize(key: &str, v: &Value) -> Result<usize> {
    v.as_u64().and_then(|v| usize::try_from(v).ok()).ok_or_else(|| bad(key, "an integer >= 0", v))
}

fn as_u32(key: &str, v: &Value) -> Result<u32> {
    v.as_u64()
        .and_then(|v| u32::try_from(v).ok())
        .ok_or_else(|| bad(key, &format!("an integer from 0 to {}", u32::MAX), v))
}

/// A boolean; Accelerate also writes some as the strings "true"/"false"/"yes"/"no".
fn as_bool(key: &str, v: &Value) -> Result<bool> {
    if let Some(b) = v.as_bool() {
        return Ok(b);
    }
    match v.as_str().map(str::to_ascii_lowercase).as_deref() {
        Some("true" | "yes") => Ok(true),
        Some("false" | "no") => Ok(false),
        _ => Err(bad(key, "true or false", v)),
    }
}

fn as_str<'a>(key: &str, v: &'a Value) -> Result<&'a str> {
    v.as_str().ok_or_else(|| bad(key, "a string", v))
}

/// A string or a number, upper-cased (Accelerate writes enums both ways).
fn as_name(v: &Value) -> String {
    v.as_str().map(str::to_owned).unwrap_or_else(|| show_yaml(v)).to_ascii_uppercase()
}

fn applied(text: impl Into<String>) -> Result<Verdict> {
    Ok(Verdict::Applied(text.into()))
}

fn ignored(text: impl Into<String>) -> Result<Verdict> {
    Ok(Verdict::Ignored(text.into()))
}

fn hint(text: impl Into<String>) -> Result<Verdict> {
    Ok(Verdict::Hint(text.into()))
}

fn refused(text: impl Into<String>) -> Result<Verdict> {
    Ok(Verdict::Refused(text.into()))
}

/// The reader's state while it goes through a file.
struct Reader {
    config: LaunchConfig,
    report: Report,
    /// `distributed_type`, upper-cased, if given: a section of another type is ignored, as
    /// Accelerate ignores it.
    distributed: Option<String>,
    /// Accelerate's accumulation (ours wins when both are given).
    accelerate_accumulate: Option<u32>,
    /// `parallelism_config`'s data-parallel sizes (replicate, shard), checked at the end.
    data_sizes: (Option<usize>, Option<usize>),
    /// `fsdp_config`'s wrap policy and minimum size, combined at the end.
    wrap_policy: Option<String>,
    min_num_params: Option<i64>,
}

/// Reads YAML text, noting every key. `Err` only when the text is no YAML mapping.
pub(super) fn read(text: &str) -> Result<(LaunchConfig, Report)> {
    let TopLevel(entries) =
        serde_yaml_ng::from_str(text).map_err(|e| Error::Config(format!("not YAML: {e}")))?;
    // A key written twice: the last value counts, as in PyYAML (which Accelerate reads
    // with); the earlier ones are noted as ignored.
    let mut map = serde_yaml_ng::Mapping::new();
    let mut repeated = Vec::new();
    for (k, v) in entries {
        if let Some(old) = map.insert(k.clone(), v) {
            repeated.push((k, old));
        }
    }
    let mut r = Reader {
        config: LaunchConfig::default(),
        report: Report::default(),
        distributed: map.get("distributed_type").map(as_name),
        accelerate_accumulate: None,
        data_sizes: (None, None),
        wrap_policy: None,
        min_num_params: None,
    };
    for (k, v) in &map {
        let Some(key) = k.as_str() else {
            r.report.push(show_yaml(k), show_yaml(v), Verdict::Refused("not a string key".into()));
            continue;
        };
        match r.top(key, v) {
            Ok(Some(verdict)) => r.report.push(key, show_yaml(v), verdict),
            Ok(None) => {}
            Err(e) => r.report.push(key, show_yaml(v), Verdict::Refused(why(e))),
        }
    }
    for (k, old) in repeated {
        r.report.push(
            show_yaml(&k),
            show_yaml(&old),
            Verdict::Ignored("written again later in the file: the last value counts".into()),
        );
    }
    r.finish();
    Ok((r.config, r.report))
}

/// The top level of a YAML file as its entries in order, repeated keys kept (a null or
/// empty document has none).
struct TopLevel(Vec<(Value, Value)>);

impl<'de> serde::Deserialize<'de> for TopLevel {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct Entries;
        impl<'de> serde::de::Visitor<'de> for Entries {
            type Value = TopLevel;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a mapping of keys to values")
            }
            fn visit_unit<E>(self) -> std::result::Result<TopLevel, E> {
                Ok(TopLevel(Vec::new()))
            }
            fn visit_none<E>(self) -> std::result::Result<TopLevel, E> {
                Ok(TopLevel(Vec::new()))
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> std::result::Result<TopLevel, A::Error> {
                let mut entries = Vec::new();
                while let Some(entry) = map.next_entry::<Value, Value>()? {
                    entries.push(entry);
                }
                Ok(TopLevel(entries))
            }
        }
        d.deserialize_any(Entries)
    }
}

/// Keys for other machines and environments than accel's (SageMaker, TPUs, Apple GPUs,
/// notebooks) and switches accel does not need. `Ok(None)`: not one of them.
fn elsewhere(key: &str, v: &Value) -> Result<Option<Verdict>> {
    let verdict = match key {
        "compute_environment" => match as_name(v).as_str() {
            "LOCAL_MACHINE" => ignored("accel launch starts this machine's processes"),
            other => refused(format!(
                "{other}: accel launches processes on the machines it runs on; cloud \
                         jobs (SageMaker) are not supported"
            )),
        },
        "debug" => {
            if as_bool(key, v)? {
                applied(
                    "collectives compared across processes before they run (accel always \
                             does; ACCEL_CHECK_COLLECTIVES=0 turns it off)",
                )
            } else {
                ignored("accel compares collectives across processes anyway")
            }
        }
        "downcast_bf16" => ignored("TPU only"),
        "rdzv_backend" => ignored("accel's rendezvous is rank 0's TCP store (static)"),
        "same_network" => ignored("machines connect over TCP either way"),
        "main_training_function" => ignored("notebook launcher only; a Rust program has main"),
        "enable_cpu_affinity" => {
            if as_bool(key, v)? {
                hint("accel does not pin processes to NUMA-local cores")
            } else {
                ignored("off, as in accel")
            }
        }
        "use_mps_device" => {
            if as_bool(key, v)? {
                refused("Apple GPUs (MPS) are not supported: CPU and CUDA only")
            } else {
                ignored("off")
            }
        }
        "tpu_name" | "tpu_zone" | "tpu_use_cluster" | "tpu_use_sudo" | "tpu_vm" | "tpu_env"
        | "command_file" | "commands" => ignored("TPU pods only"),
        "ec2_instance_type"
        | "iam_role_name"
        | "image_uri"
        | "profile"
        | "region"
        | "base_job_name"
        | "pytorch_version"
        | "transformers_version"
        | "py_version"
        | "sagemaker_inputs_file"
        | "sagemaker_metrics_file"
        | "additional_args" => ignored("SageMaker only (see compute_environment)"),
        _ => return Ok(None),
    };
    verdict.map(Some)
}

/// A key nobody reads: refused, with the closest known key.
fn unknown(key: &str) -> Result<Verdict> {
    let ours = our_keys();
    let valid: Vec<&str> = ours.iter().chain(ACCELERATE).copied().collect();
    let hint = closest(key, &valid).map(|c| format!(" — did you mean `{c}`?")).unwrap_or_default();
    refused(format!("unknown key{hint} (accel's keys: {})", ours.join(", ")))
}

/// FSDP's `fsdp_sharding_strategy` (a name or its number) as accel's strategy.
fn fsdp_sharding(name: &str) -> Result<Strategy> {
    Ok(match name {
        "FULL_SHARD" | "1" | "TRUE" => Strategy::Zero3,
        "SHARD_GRAD_OP" | "2" | "FALSE" => Strategy::Zero2,
        "NO_SHARD" | "3" => Strategy::Ddp,
        "HYBRID_SHARD" | "4" => Strategy::HybridShard,
        "_HYBRID_SHARD_ZERO2" | "5" => {
            return Err(Error::Config(format!(
                "{name} (hybrid sharding of gradients only) is not implemented; use \
                 HYBRID_SHARD, FULL_SHARD or SHARD_GRAD_OP"
            )));
        }
        other => {
            return Err(Error::Config(format!(
                "{other}: expected FULL_SHARD, SHARD_GRAD_OP, NO_SHARD or HYBRID_SHARD"
            )));
        }
    })
}

/// FSDP's `fsdp_state_dict_type`.
fn fsdp_state_dict(name: &str) -> Result<StateDict> {
    match name {
        "FULL_STATE_DICT" => Ok(StateDict::Full),
        "SHARDED_STATE_DICT" | "LOCAL_STATE_DICT" => Ok(StateDict::Sharded),
        other => Err(Error::Config(format!(
            "{other}: expected FULL_STATE_DICT, SHARDED_STATE_DICT or LOCAL_STATE_DICT"
        ))),
    }
}

/// What FSDP's `fsdp_auto_wrap_policy` makes the units.
fn fsdp_wrap_policy(policy: &str) -> Result<&'static str> {
    Ok(match policy {
        "TRANSFORMER_BASED_WRAP" => {
            "units: accel_core::Unit wrappers and each element of a repeated layer list \
             (layers.{i}, h.{i}, blocks.{i})"
        }
        "SIZE_BASED_WRAP" => "units: the innermost modules of fsdp_min_num_params",
        "NO_WRAP" => "units: the whole model as one",
        other => {
            return Err(Error::Config(format!(
                "{other}: expected TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP or NO_WRAP"
            )));
        }
    })
}

impl Reader {
    fn training(&mut self) -> &mut crate::config::PartialConfig {
        &mut self.config.training
    }

    /// One top-level key: its verdict, or `None` when it noted its sub-keys itself.
    fn top(&mut self, key: &str, v: &Value) -> Result<Option<Verdict>> {
        if let Some(setting) = crate::config::setting(key) {
            // One of the settings (accel_choices::settings!), written as in the environment.
            let text = setting_text(key, v)?;
            self.training().set(key, &text, &format!("`{key}`"))?;
            let summary = setting.summary();
            let summary = summary.trim_end_matches('.');
            return Ok(Some(Verdict::Applied(format!("{key} = {text}: {summary}"))));
        }
        if self.sections(key, v)? {
            return Ok(None);
        }
        let verdict = match key {
            "mixed_precision" => {
                let p = as_name(v).to_ascii_lowercase();
                let p = p.parse().map_err(|_| {
                    Error::Config(format!("mixed_precision `{p}`: expected no, fp16, bf16 or fp8"))
                })?;
                self.training().precision = Some(p);
                applied(format!("precision {p}"))
            }
            "distributed_type" => self.distributed_type(v),
            "gradient_accumulation_steps" => {
                self.accelerate_accumulate = Some(as_u32(key, v)?);
                applied("micro-batches per optimizer step")
            }
            _ => match self.processes(key, v)? {
                Some(verdict) => Ok(verdict),
                None => elsewhere(key, v)?.map_or_else(|| unknown(key), Ok),
            },
        };
        verdict.map(Some)
    }

    /// The keys of the processes: how many, on which machines, on what devices. `Ok(None)`:
    /// not one of them.
    fn processes(&mut self, key: &str, v: &Value) -> Result<Option<Verdict>> {
        let verdict = match key {
            "num_processes" => {
                // Accelerate writes -1 for "given elsewhere" (SLURM).
                if v.as_i64() == Some(-1) {
                    return ignored("-1: the number comes from --num_processes").map(Some);
                }
                let n = as_usize(key, v)?;
                self.config.num_processes = Some(n);
                applied(format!("{n} processes on this machine"))
            }
            "num_machines" => {
                let n = as_usize(key, v)?;
                self.config.num_machines = Some(n);
                applied(format!("{n} machines"))
            }
            "machine_rank" => {
                let n = as_usize(key, v)?;
                self.config.machine_rank = Some(n);
                applied(format!("this machine is number {n}"))
            }
            "main_process_ip" if v.is_null() => ignored("null: 127.0.0.1 (one machine)"),
            "main_process_ip" => {
                self.config.main_process_ip = Some(as_str(key, v)?.to_owned());
                applied("address of rank 0's rendezvous store")
            }
            "main_process_port" if v.is_null() => ignored("null: port 29500"),
            "main_process_port" => {
                let port =
                    u16::try_from(as_usize(key, v)?).map_err(|_| bad(key, "a port number", v))?;
                self.config.main_process_port = Some(port);
                applied("port of rank 0's rendezvous store")
            }
            "use_cpu" => {
                let on = as_bool(key, v)?;
                self.training().cpu = Some(on);
                applied(if on { "CPU only" } else { "GPUs where there are any" })
            }
            "gpu_ids" => self.gpu_ids(v),
            "num_cpu_threads_per_process" => {
                let n = as_usize(key, v)?;
                if n == 0 {
                    return Err(bad(key, "an integer >= 1", v));
                }
                self.config.num_cpu_threads_per_process = Some(n);
                applied(format!("OMP_NUM_THREADS={n} in every process"))
            }
            "deepspeed_config_file" => {
                self.config.deepspeed_config = Some(PathBuf::from(as_str(key, v)?));
                applied("read as a DeepSpeed config: its keys follow")
            }
            _ => return Ok(None),
        };
        verdict.map(Some)
    }

    /// A section of sub-keys (`fsdp_config`, ...), each noted: whether `key` is one.
    fn sections(&mut self, key: &str, v: &Value) -> Result<bool> {
        type Each = fn(&mut Reader, &str, &Value) -> Result<Verdict>;
        let (needs, each): (Option<&str>, Each) = match key {
            "fsdp_config" => (Some("FSDP"), Self::fsdp),
            "deepspeed_config" => (Some("DEEPSPEED"), Self::deepspeed),
            "megatron_lm_config" => (Some("MEGATRON_LM"), Self::megatron),
            "parallelism_config" => (None, Self::parallelism),
            "fp8_config" => (None, Self::fp8),
            "dynamo_config" => (None, Self::dynamo),
            "ipex_config" => (None, Self::ipex),
            "mpirun_config" => (None, Self::mpirun),
            _ => return Ok(false),
        };
        self.section(key, v, needs, each)?;
        Ok(true)
    }

    fn gpu_ids(&mut self, v: &Value) -> Result<Verdict> {
        let ids = match v {
            Value::Null => return ignored("null: every GPU"),
            Value::Number(n) => n.to_string(),
            other => as_str("gpu_ids", other)?.trim().to_owned(),
        };
        if ids.eq_ignore_ascii_case("all") {
            return ignored("all: every GPU, as without it");
        }
        if ids.split(',').any(|id| id.trim().parse::<u32>().is_err()) {
            return Err(bad("gpu_ids", "all or a comma-separated list of GPU indices", v));
        }
        self.config.gpu_ids = Some(ids.clone());
        applied(format!("CUDA_VISIBLE_DEVICES={ids} in every process"))
    }

    fn distributed_type(&mut self, v: &Value) -> Result<Verdict> {
        let d = as_name(v);
        let current = self.config.training.strategy;
        let strategy = match d.as_str() {
            "NO" | "FALSE" => Strategy::Single,
            "MULTI_CPU" | "MULTI_GPU" => Strategy::Ddp,
            // Tensor and pipeline degrees come from megatron_lm_config.
            "MEGATRON_LM" => current.unwrap_or(Strategy::Ddp),
            "FSDP" => current.unwrap_or(Strategy::Fsdp),
            "DEEPSPEED" => current.unwrap_or(Strategy::Zero2),
            other => {
                return refused(format!(
                    "{other} has no accel equivalent (accel runs on CPUs and CUDA GPUs); accel \
                     reads NO, MULTI_CPU, MULTI_GPU, FSDP, DEEPSPEED and MEGATRON_LM"
                ));
            }
        };
        self.training().strategy = Some(strategy);
        applied(match d.as_str() {
            "FSDP" => "strategy fsdp (zero3) unless fsdp_config's sharding says otherwise".into(),
            "DEEPSPEED" => "strategy zero2 unless the DeepSpeed settings give the stage".into(),
            _ => format!("strategy {strategy}"),
        })
    }

    /// A section's keys, each noted as `section.key`; a section for another
    /// `distributed_type` than the file's is ignored, as Accelerate ignores it.
    fn section(
        &mut self,
        name: &str,
        v: &Value,
        needs: Option<&str>,
        each: fn(&mut Self, &str, &Value) -> Result<Verdict>,
    ) -> Result<()> {
        let map = match v {
            Value::Null => None,
            Value::Mapping(m) if m.is_empty() => None,
            Value::Mapping(m) => Some(m),
            other => return Err(bad(name, "a mapping of keys to values", other)),
        };
        let Some(map) = map else {
            self.report.push(name, show_yaml(v), Verdict::Ignored("empty".into()));
            return Ok(());
        };
        let other_type = match (needs, &self.distributed) {
            (Some(needs), Some(d)) if d != needs => Some((needs, d.clone())),
            _ => None,
        };
        for (k, sv) in map {
            let sub = k.as_str().map(str::to_owned).unwrap_or_else(|| show_yaml(k));
            let key = format!("{name}.{sub}");
            let verdict = match &other_type {
                Some((needs, d)) => Verdict::Ignored(format!(
                    "distributed_type is {d}: this section is read with {needs} only, as in \
                     Accelerate"
                )),
                None => each(self, &sub, sv).unwrap_or_else(|e| Verdict::Refused(why(e))),
            };
            self.report.push(key, show_yaml(sv), verdict);
        }
        Ok(())
    }

    fn fsdp(&mut self, key: &str, v: &Value) -> Result<Verdict> {
        match key {
            "fsdp_sharding_strategy" | "fsdp_reshard_after_forward" => {
                let s = fsdp_sharding(&as_name(v))?;
                self.training().strategy = Some(s);
                applied(format!("strategy {s}"))
            }
            "fsdp_version" => {
                ignored("accel has one sharding engine; both versions' keys are read")
            }
            "fsdp_offload_params" => {
                let on = as_bool(key, v)?;
                self.training().offload = Some(on);
                applied(if on {
                    "offload: fp32 masters and optimizer state in CPU memory"
                } else {
                    "no offload"
                })
            }
            "fsdp_activation_checkpointing" => {
                let on = as_bool(key, v)?;
                self.training().activation_checkpointing = Some(on);
                applied(format!("activation checkpointing {}", if on { "on" } else { "off" }))
            }
            "fsdp_state_dict_type" => {
                let d = fsdp_state_dict(&as_name(v))?;
                self.training().state_dict = Some(d);
                applied(match d {
                    StateDict::Full => {
                        "save_state gathers the model; the main process writes it whole"
                    }
                    StateDict::Sharded => "save_state writes each process's shard",
                })
            }
            "fsdp_cpu_ram_efficient_loading" => {
                if as_bool(key, v)? {
                    applied(
                        "load_checkpoint_in_model / prepare_model_from_checkpoint read only each \
                         process's own bytes (always so in accel)",
                    )
                } else {
                    ignored("accel's checkpoint loading reads only each process's own bytes anyway")
                }
            }
            "fsdp_sync_module_states" => {
                let on = as_bool(key, v)?;
                self.training().sync_module_states = Some(on);
                applied(if on {
                    "rank 0's initial values broadcast when a model is prepared"
                } else {
                    "each process keeps its own initial values (same seed: the same)"
                })
            }
            "fsdp_auto_wrap_policy" => {
                let policy = as_name(v);
                let text = fsdp_wrap_policy(&policy)?;
                self.wrap_policy = Some(policy);
                applied(text)
            }
            "fsdp_transformer_layer_cls_to_wrap" => ignored(
                "a Rust model has no Python classes: its units are its accel_core::Unit wrappers and \
                 repeated layer lists (or ShardOptions::units)",
            ),
            "fsdp_min_num_params" => {
                let n = as_usize(key, v)?;
                self.min_num_params = Some(n as i64);
                applied(format!("with SIZE_BASED_WRAP: units of at least {n} parameters"))
            }
            "fsdp_backward_prefetch" => match as_name(v).as_str() {
                "BACKWARD_PRE" => {
                    applied("the previous unit is gathered during each unit's backward")
                }
                "NULL" | "NO_PREFETCH" | "BACKWARD_POST" => {
                    hint("accel always prefetches as BACKWARD_PRE (one unit ahead)")
                }
                other => Err(Error::Config(format!(
                    "{other}: expected BACKWARD_PRE, BACKWARD_POST or NO_PREFETCH"
                ))),
            },
            "fsdp_forward_prefetch" => {
                if as_bool(key, v)? {
                    applied("the next unit is gathered during each unit's forward")
                } else {
                    ignored("accel prefetches the next unit in forward always (one unit of memory)")
                }
            }
            "fsdp_use_orig_params" => {
                ignored("accel's optimizers always step the original parameters")
            }
            "fsdp_ignored_modules" if v.is_null() => ignored("none"),
            "fsdp_ignored_modules" => refused("modules left out of sharding are not implemented"),
            _ => refused("not an FSDP key accel knows"),
        }
    }

    fn deepspeed(&mut self, key: &str, v: &Value) -> Result<Verdict> {
        match key {
            "zero_stage" => {
                let s = match v.as_u64() {
                    Some(0) => Strategy::Ddp,
                    Some(1) => Strategy::Zero1,
                    Some(2) => Strategy::Zero2,
                    Some(3) => Strategy::Zero3,
                    _ => return Err(bad(key, "0, 1, 2 or 3", v)),
                };
                self.training().strategy = Some(s);
                applied(format!("strategy {s}"))
            }
            "gradient_accumulation_steps" => {
                self.accelerate_accumulate = Some(as_u32(key, v)?);
                applied("micro-batches per optimizer step")
            }
            "gradient_clipping" => match v.as_f64() {
                Some(max) if max > 0.0 => {
                    self.training().clip_grad_norm = Some(max);
                    applied(format!("gradients clipped to norm {max}"))
                }
                Some(_) => ignored("0: no clipping"),
                None if v.as_str() == Some("auto") => ignored("auto: no clipping unless set"),
                None => Err(bad(key, "a number", v)),
            },
            "deepspeed_config_file" => {
                self.config.deepspeed_config = Some(PathBuf::from(as_str(key, v)?));
                applied("read as a DeepSpeed config: its keys follow")
            }
            "offload_optimizer_device" | "offload_param_device" => match as_name(v).as_str() {
                "NONE" | "NULL" => ignored("no offload"),
                "CPU" => {
                    self.training().offload = Some(true);
                    applied("offload: fp32 masters and optimizer state in CPU memory")
                }
                "NVME" => refused("offload to NVMe is not implemented: use cpu"),
                _ => Err(bad(key, "none, cpu or nvme", v)),
            },
            "offload_optimizer_nvme_path" | "offload_param_nvme_path" => {
                ignored("only with offload to NVMe, which accel refuses")
            }
            "zero3_init_flag" => {
                if as_bool(key, v)? {
                    applied(
                        "models too large for one process: build with accel::nn::uninit and \
                         load with prepare_model_from_checkpoint",
                    )
                } else {
                    ignored("off")
                }
            }
            "zero3_save_16bit_model" => {
                if as_bool(key, v)? {
                    hint("save_model writes the parameters in their own dtype (fp32 masters)")
                } else {
                    ignored("off")
                }
            }
            "deepspeed_multinode_launcher"
            | "deepspeed_hostfile"
            | "deepspeed_exclusion_filter"
            | "deepspeed_inclusion_filter" => {
                ignored("DeepSpeed's launcher only: run accel launch on each machine")
            }
            "deepspeed_moe_layer_cls_names" => refused("mixture-of-experts is not implemented"),
            _ => refused("not a deepspeed_config key accel knows"),
        }
    }

    fn megatron(&mut self, key: &str, v: &Value) -> Result<Verdict> {
        let degree = |v: &Value| as_usize(key, v);
        match key {
            "megatron_lm_tp_degree" => {
                self.training().tensor_parallel = Some(degree(v)?);
                applied("tensor-parallel ranks")
            }
            "megatron_lm_pp_degree" => {
                self.training().pipeline_parallel = Some(degree(v)?);
                applied("pipeline stages")
            }
            "megatron_lm_num_micro_batches" => {
                self.accelerate_accumulate = Some(as_u32(key, v)?);
                applied("micro-batches per optimizer step")
            }
            "megatron_lm_sequence_parallelism" => {
                self.training().sequence_parallel = Some(as_bool(key, v)?);
                applied("sequence parallelism")
            }
            "megatron_lm_gradient_clipping" => {
                let max = v.as_f64().ok_or_else(|| bad(key, "a number", v))?;
                if max > 0.0 {
                    self.training().clip_grad_norm = Some(max);
                }
                applied(format!("gradients clipped to norm {max}"))
            }
            "megatron_lm_recompute_activations" => {
                self.training().activation_checkpointing = Some(as_bool(key, v)?);
                applied("activation checkpointing (whole units)")
            }
            "megatron_lm_use_distributed_optimizer" => {
                if as_bool(key, v)? {
                    self.training().strategy = Some(Strategy::Zero1);
                    applied("strategy zero1 (optimizer state sharded over data-parallel ranks)")
                } else {
                    ignored("off")
                }
            }
            "megatron_lm_context_parallel_size" => self.context_size(degree(v)?),
            "megatron_lm_expert_model_parallel_size"
            | "megatron_lm_expert_tensor_parallel_size" => {
                if degree(v)? <= 1 {
                    ignored("1: none")
                } else {
                    refused("expert parallelism is not implemented")
                }
            }
            "megatron_lm_recompute_granularity"
            | "megatron_lm_recompute_method"
            | "megatron_lm_recompute_num_layers"
            | "megatron_lm_attention_dropout"
            | "megatron_lm_hidden_dropout"
            | "megatron_lm_attention_softmax_in_fp32"
            | "megatron_lm_attention_backend"
            | "megatron_lm_use_rotary_position_embeddings"
            | "megatron_lm_eod_mask_loss"
            | "megatron_lm_calculate_per_token_loss"
            | "megatron_lm_decoder_last_pipeline_num_layers" => ignored(
                "a setting of Megatron-LM's own models; a Rust model sets its own (accel::tp layers)",
            ),
            "megatron_lm_no_load_optim" | "megatron_lm_no_save_optim" => {
                hint("save_state/load_state always include the optimizer")
            }
            "megatron_lm_optimizer_cpu_offload"
            | "megatron_lm_overlap_cpu_optimizer_d2h_h2d"
            | "megatron_lm_use_precision_aware_optimizer"
            | "megatron_lm_use_custom_fsdp" => {
                if as_bool(key, v).unwrap_or(true) {
                    hint("Megatron-LM optimizer machinery accel does not have")
                } else {
                    ignored("off")
                }
            }
            _ => refused("not a megatron_lm_config key accel knows"),
        }
    }

    fn parallelism(&mut self, key: &str, v: &Value) -> Result<Verdict> {
        let size = |v: &Value| as_usize(key, v);
        match key.strip_prefix("parallelism_config_").unwrap_or(key) {
            "tp_size" => {
                self.training().tensor_parallel = Some(size(v)?);
                applied("tensor-parallel ranks")
            }
            "dp_replicate_size" => {
                self.data_sizes.0 = Some(size(v)?);
                applied("data-parallel replicas (checked with dp_shard_size)")
            }
            "dp_shard_size" => {
                self.data_sizes.1 = Some(size(v)?);
                applied("data-parallel shards (checked with dp_replicate_size)")
            }
            // Accelerate's two ways of splitting the sequence (torch's ring attention, and
            // DeepSpeed-Ulysses) are accel's one context dimension, exchanging by all-to-all.
            "cp_size" | "sp_size" => self.context_size(size(v)?),
            "cp_comm_strategy" | "cp_backend" | "sp_backend" | "sp_attn_implementation" => ignored(
                "accel's context parallelism exchanges attention's heads by all-to-all \
                 (Ulysses) where they divide among the context ranks, else all-gathers keys and \
                 values (accel_core::strategy::cp)",
            ),
            "sp_seq_length" | "sp_seq_length_is_variable" => {
                ignored("the model's inputs set the sequence length (accel::cp shards them)")
            }
            _ => refused("not a parallelism_config key accel knows"),
        }
    }

    /// A context-parallel degree from `cp_size`, `sp_size` or Megatron's: one context
    /// dimension, so two different degrees above 1 are refused.
    fn context_size(&mut self, size: usize) -> Result<Verdict> {
        match self.training().context_parallel {
            _ if size <= 1 => ignored("1: none"),
            Some(other) if other > 1 && other != size => refused(format!(
                "a second context degree ({other} already): accel has one context dimension"
            )),
            _ => {
                self.training().context_parallel = Some(size);
                applied("context-parallel ranks (attention's heads exchanged by all-to-all)")
            }
        }
    }

    fn fp8(&mut self, key: &str, v: &Value) -> Result<Verdict> {
        match key {
            "backend" => match as_name(v).as_str() {
                "AO" => applied("torchao's fp8, accel's (fp8_recipe tensorwise or rowwise)"),
                other => refused(format!(
                    "{other} (Transformer Engine or MS-AMP) is not available; accel's fp8 is \
                     torchao's (backend: AO), with fp8_recipe tensorwise or rowwise"
                )),
            },
            "fp8_format"
            | "amax_history_len"
            | "amax_history_length"
            | "amax_compute_algo"
            | "amax_compute_algorithm"
            | "interval"
            | "margin"
            | "override_linear_precision"
            | "use_autocast_during_eval"
            | "opt_level"
            | "optimization_level" => ignored(
                "a Transformer Engine / MS-AMP setting; accel's fp8 scales from the current amax \
                 (fp8_recipe)",
            ),
            "pad_inner_dim" => ignored(
                "accel pads the token count of the weight-gradient product to a multiple of 16 \
                 anyway",
            ),
            "enable_fsdp_float8_all_gather" => {
                if as_bool(key, v)? {
                    hint("zero3 gathers fp8 layers' weights in their param dtype, not fp8")
                } else {
                    ignored("off")
                }
            }
            _ => refused("not an fp8_config key accel knows"),
        }
    }

    fn dynamo(&mut self, key: &str, v: &Value) -> Result<Verdict> {
        match key {
            "dynamo_backend" if as_name(v) == "NO" => ignored("no compiler"),
            k if k.starts_with("dynamo_") => {
                hint("no TorchDynamo in Rust: the step is compiled code already")
            }
            _ => refused("not a dynamo_config key accel knows"),
        }
    }

    fn ipex(&mut self, key: &str, v: &Value) -> Result<Verdict> {
        match key {
            "ipex" | "use_xpu" if !as_bool(key, v)? => ignored("off"),
            "ipex" => hint("Intel Extension for PyTorch is not used"),
            "use_xpu" => refused("Intel XPUs are not supported: CPU and CUDA only"),
            _ => refused("not an ipex_config key accel knows"),
        }
    }

    fn mpirun(&mut self, key: &str, _v: &Value) -> Result<Verdict> {
        match key {
            "mpirun_hostfile" | "mpirun_ccl" => refused(
                "accel launch starts the processes itself: run it on each machine with \
                 --machine-rank instead of mpirun",
            ),
            _ => refused("not an mpirun_config key accel knows"),
        }
    }

    /// What is only known from several keys: accumulation, the data-parallel shape, the wrap
    /// policy, and whether the settings fit together.
    fn finish(&mut self) {
        if self.config.training.accumulate.is_none() {
            self.config.training.accumulate = self.accelerate_accumulate;
        }
        let file = |why: String| Verdict::Refused(why);
        match (self.wrap_policy.as_deref(), self.min_num_params) {
            (Some("SIZE_BASED_WRAP"), Some(n)) if n > 0 => {
                self.config.training.wrap = Some(Wrap::Size(n))
            }
            // Accelerate's default minimum for the size-based policy.
            (Some("SIZE_BASED_WRAP"), _) => {
                self.config.training.wrap = Some(Wrap::Size(100_000_000))
            }
            (Some("NO_WRAP"), _) => self.config.training.wrap = Some(Wrap::None),
            (Some(_), _) => self.config.training.wrap = Some(Wrap::Layers),
            _ => {}
        }
        match self.data_sizes {
            (Some(r), Some(s)) if r > 1 && s > 1 => {
                let per_machine = self.config.num_processes.map(|n| {
                    let training = &self.config.training;
                    n / (training.tensor_parallel.unwrap_or(1).max(1)
                        * training.context_parallel.unwrap_or(1).max(1))
                });
                if per_machine.is_some_and(|p| p != s) {
                    self.report.push(
                        "parallelism_config",
                        format!("dp_replicate {r} × dp_shard {s}"),
                        file(format!(
                            "accel's hybrid sharding shards over each machine's processes: \
                             dp_shard_size must be num_processes ÷ tp_size ({})",
                            per_machine.unwrap_or(0)
                        )),
                    );
                } else {
                    self.config.training.strategy = Some(Strategy::HybridShard);
                }
            }
            (Some(r), _) if r > 1 && !self.config.training.strategy.is_some_and(|s| s.shards()) => {
                self.config.training.strategy = Some(Strategy::Ddp)
            }
            _ => {}
        }
        if let Err(e) = self.config.training.build() {
            self.report.push("(file)", "", file(why(e)));
        }
    }
}
