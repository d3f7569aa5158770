//! DeepSpeed JSON configuration files (`accelerate launch --config_file ds_config.json`,
//! Accelerate's `deepspeed_config_file`), mapped onto accel: ZeRO stages onto strategies,
//! offload, fp16/bf16 with DeepSpeed's loss-scaler settings, accumulation, clipping, bucket
//! sizes, the communication dtype and the batch-size arithmetic DeepSpeed checks. `"auto"`
//! leaves a value to the rest of the configuration, as Accelerate fills it in.
//!
//! Every key accel does not implement is named in one error; keys that only tune
//! performance (overlap, buffer counts, prefetch sizes...) are named in one warning and
//! otherwise ignored.

use std::path::Path;

use serde_json::Value;
use tch::Kind;

use super::ScalerConfig;
use super::check::{Report, Verdict};
use crate::config::{PartialConfig, Precision, Strategy};
use crate::error::{Error, Result};

/// What a DeepSpeed config sets that accel's own keys do not cover.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DeepSpeedSettings {
    /// `offload_optimizer` / `offload_param` to `cpu`.
    pub offload: bool,
    /// `fp16`'s loss scaling (DeepSpeed's defaults for what it leaves out).
    pub scaler: Option<ScalerConfig>,
    /// `reduce_bucket_size`, in elements (DeepSpeed's unit).
    pub reduce_bucket_elements: Option<usize>,
    /// `communication_data_type`: gradients are reduced in this dtype.
    pub communication: Option<Kind>,
    /// `train_micro_batch_size_per_gpu`.
    pub micro_batch_size: Option<usize>,
    /// `train_batch_size`.
    pub train_batch_size: Option<usize>,
}

/// A DeepSpeed config, read.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DeepSpeedConfig {
    /// What maps onto accel's own settings.
    pub training: PartialConfig,
    /// The rest.
    pub settings: DeepSpeedSettings,
    /// Performance hints accel ignores (for the one warning).
    pub ignored: Vec<String>,
}

/// Keys (dotted paths) that only tune DeepSpeed's performance: ignored with a warning.
const HINTS: &[&str] = &[
    "steps_per_print",
    "wall_clock_breakdown",
    "dump_state",
    "prescale_gradients",
    "gradient_predivide_factor",
    "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer",
    "memory_breakdown",
    "tensorboard",
    "csv_monitor",
    "wandb",
    "comet",
    "comms_logger",
    "fp16.auto_cast",
    "zero_optimization.allgather_partitions",
    "zero_optimization.allgather_bucket_size",
    "zero_optimization.overlap_comm",
    "zero_optimization.reduce_scatter",
    "zero_optimization.contiguous_gradients",
    "zero_optimization.round_robin_gradients",
    "zero_optimization.sub_group_size",
    "zero_optimization.stage3_max_live_parameters",
    "zero_optimization.stage3_max_reuse_distance",
    "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.stage3_param_persistence_threshold",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save",
    "zero_optimization.stage3_gather_fp16_weights_on_model_save",
    "zero_optimization.elastic_checkpoint",
    "zero_optimization.ignore_unused_parameters",
    "zero_optimization.memory_efficient_linear",
    "zero_optimization.offload_optimizer.pin_memory",
    "zero_optimization.offload_optimizer.buffer_count",
    "zero_optimization.offload_optimizer.fast_init",
    "zero_optimization.offload_optimizer.ratio",
    "zero_optimization.offload_param.pin_memory",
    "zero_optimization.offload_param.buffer_count",
    "zero_optimization.offload_param.buffer_size",
    "zero_optimization.offload_param.max_in_cpu",
];

/// Why a key is refused, for the ones whose reason helps.
fn refusal(key: &str) -> &'static str {
    match key {
        k if k.starts_with("optimizer.") => {
            "accel steps the program's optimizer: set the value there and write \"auto\" here"
        }
        k if k.starts_with("scheduler.") => {
            "accel follows the program's schedule (`set_schedule`): set the value there and \
             write \"auto\" here"
        }
        "amp" => "Apex AMP: use bf16 or fp16",
        "activation_checkpointing.cpu_checkpointing" => {
            "activations offloaded to the CPU are not implemented (activation checkpointing is)"
        }
        "flops_profiler" => "not implemented (accel's profiler is `Accelerator::profile`)",
        "aio" => "NVMe offload is not implemented",
        "pipeline" => "use accel's pipeline_parallel",
        "sparse_gradients" => "not implemented",
        _ => "not implemented",
    }
}

fn is_auto(v: &Value) -> bool {
    v.as_str() == Some("auto")
}

/// Reads a DeepSpeed JSON config.
pub fn read(path: &Path) -> Result<DeepSpeedConfig> {
    let text = std::fs::read_to_string(path)
        .map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
    parse(&text).map_err(|e| match e {
        Error::Config(m) => Error::Config(format!("DeepSpeed config {}: {m}", path.display())),
        other => other,
    })
}

/// Parses DeepSpeed JSON text.
pub fn parse(text: &str) -> Result<DeepSpeedConfig> {
    let (out, refused, wrong, _) = read_parts(text)?;
    let mut problems = wrong;
    if !refused.is_empty() {
        let named: Vec<String> =
            refused.iter().map(|k| format!("`{k}` ({})", refusal(k))).collect();
        problems.push(format!("accel does not implement {}", named.join(", ")));
    }
    if !problems.is_empty() {
        return Err(Error::Config(problems.join("; ")));
    }
    Ok(out)
}

/// Reads a DeepSpeed JSON config noting every key (leaf) of it; a refused key is only
/// noted. `Err` when the file cannot be read or is no JSON object.
pub fn check(path: &Path) -> Result<(DeepSpeedConfig, Report)> {
    let text = std::fs::read_to_string(path)
        .map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
    check_text(&text).map_err(|e| match e {
        Error::Config(m) => Error::Config(format!("DeepSpeed config {}: {m}", path.display())),
        other => other,
    })
}

/// [`check`] of JSON text.
pub fn check_text(text: &str) -> Result<(DeepSpeedConfig, Report)> {
    let (out, refused, mut wrong, root) = read_parts(text)?;
    let mut leaves = Vec::new();
    flatten("", &root, &mut leaves);
    let mut report = Report::default();
    for (key, value) in leaves {
        let under = |k: &str| key == k || key.starts_with(&format!("{k}."));
        let verdict = if let Some(r) = refused.iter().find(|r| under(r)) {
            Verdict::Refused(refusal(r).to_owned())
        } else if let Some(i) = wrong.iter().position(|w| {
            let parts: Vec<&str> = key.split('.').collect();
            (1..=parts.len()).any(|n| w.contains(&format!("`{}`", parts[..n].join("."))))
        }) {
            Verdict::Refused(wrong.remove(i))
        } else if out.ignored.iter().any(|i| under(i)) {
            hint_note(&key, &value)
        } else {
            applied_note(&key, &value, &out)
        };
        report.push(key, compact(&value), verdict);
    }
    for w in wrong {
        report.push("(file)", "", Verdict::Refused(w));
    }
    Ok((out, report))
}

/// Every leaf of a JSON object as (dotted key, value); empty objects and arrays are leaves.
fn flatten(prefix: &str, v: &Value, out: &mut Vec<(String, Value)>) {
    match v.as_object() {
        Some(map) if !map.is_empty() => {
            for (k, sv) in map {
                let key = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
                flatten(&key, sv, out);
            }
        }
        _ if !prefix.is_empty() => out.push((prefix.to_owned(), v.clone())),
        _ => {}
    }
}

fn compact(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// A performance key accel does not follow: ignored where accel does the same anyway or it
/// only concerns DeepSpeed's own logs, else warned about.
fn hint_note(key: &str, value: &Value) -> Verdict {
    let on = value.as_bool();
    match key {
        "steps_per_print"
        | "dump_state"
        | "memory_breakdown"
        | "wall_clock_breakdown"
        | "zero_allow_untested_optimizer"
        | "zero_force_ds_cpu_optimizer" => {
            Verdict::Ignored("DeepSpeed's own logging and checks".into())
        }
        "zero_optimization.reduce_scatter"
        | "zero_optimization.contiguous_gradients"
        | "zero_optimization.allgather_partitions"
            if on != Some(false) =>
        {
            Verdict::Ignored("what accel's sharded strategies do anyway".into())
        }
        "optimizer.type" => Verdict::Hint(
            "accel steps the program's optimizer, whatever this names (params \"auto\", as \
             with Accelerate's DummyOptim)"
                .into(),
        ),
        "scheduler.type" => Verdict::Hint(
            "accel follows the program's schedule (set_schedule), whatever this names".into(),
        ),
        k if k.ends_with(".pin_memory") && on != Some(false) => {
            Verdict::Ignored("accel pins offloaded masters in page-locked memory anyway".into())
        }
        k if (k.ends_with(".enabled") || k == "fp16.auto_cast") && on == Some(false) => {
            Verdict::Ignored("off".into())
        }
        _ => Verdict::Hint("a DeepSpeed performance setting accel does not follow".into()),
    }
}

/// What a key accel takes becomes.
fn applied_note(key: &str, value: &Value, out: &DeepSpeedConfig) -> Verdict {
    let fp16_on = out.training.precision == Some(Precision::Fp16);
    let text = match key {
        k if k.starts_with("optimizer.params.") || k.starts_with("scheduler.params.") => {
            return Verdict::Ignored(if is_auto(value) {
                "auto: the program's own value".into()
            } else {
                "DeepSpeed's choice of implementation".into()
            });
        }
        _ if is_auto(value) => {
            "auto: left to the rest of the configuration, as Accelerate fills it in".to_owned()
        }
        "train_batch_size" => {
            "checked: micro-batch × accumulation × data-parallel processes".to_owned()
        }
        "train_micro_batch_size_per_gpu" => {
            "micro-batch size per process (Accelerator::micro_batch_size)".to_owned()
        }
        "gradient_accumulation_steps" => "micro-batches per optimizer step".to_owned(),
        "gradient_clipping" => match out.training.clip_grad_norm {
            Some(max) => format!("gradients clipped to norm {max}"),
            None => return Verdict::Ignored("0: no clipping".into()),
        },
        "communication_data_type" => format!("gradients reduced in {}", compact(value)),
        "bf16.enabled" | "fp16.enabled" => match out.training.precision {
            Some(p) if value.as_bool() == Some(true) => format!("precision {p}"),
            _ => return Verdict::Ignored("off".into()),
        },
        k if k.starts_with("fp16.") && !fp16_on => {
            return Verdict::Ignored("fp16 is not enabled".into());
        }
        k if k.starts_with("fp16.") => {
            "the fp16 loss scaler (DeepSpeed's defaults otherwise)".to_owned()
        }
        k if k.starts_with("activation_checkpointing") => {
            "activation checkpointing of every accel_core::Unit".to_owned()
        }
        "zero_optimization.stage" => match out.training.strategy {
            Some(s) => format!("strategy {s}"),
            None => "strategy".to_owned(),
        },
        "zero_optimization.reduce_bucket_size" => {
            "gradient buckets of this many elements (DDP, zero1)".to_owned()
        }
        k if k.ends_with(".device") => match value.as_str() {
            Some("cpu") => "offload: fp32 masters and optimizer state in CPU memory".to_owned(),
            _ => return Verdict::Ignored("no offload".into()),
        },
        k if k.ends_with(".nvme_path") => {
            return Verdict::Ignored("only with offload to NVMe".into());
        }
        _ => "taken".to_owned(),
    };
    Verdict::Applied(text)
}

type Parts = (DeepSpeedConfig, Vec<String>, Vec<String>, Value);

/// The config, the refused keys and the wrong values, and the JSON itself.
fn read_parts(text: &str) -> Result<Parts> {
    let root: Value =
        serde_json::from_str(text).map_err(|e| Error::Config(format!("not JSON: {e}")))?;
    let Value::Object(top) = &root else {
        return Err(Error::Config("the config must be a JSON object".into()));
    };
    let mut out = DeepSpeedConfig::default();
    let mut refused: Vec<String> = Vec::new();
    let mut wrong: Vec<String> = Vec::new();
    for (key, value) in top {
        match key.as_str() {
            "train_batch_size" => out.settings.train_batch_size = positive(value, key, &mut wrong),
            "train_micro_batch_size_per_gpu" => {
                out.settings.micro_batch_size = positive(value, key, &mut wrong)
            }
            "gradient_accumulation_steps" => {
                if let Some(n) = count(value, key, &mut wrong) {
                    match u32::try_from(n) {
                        Ok(n) => out.training.accumulate = Some(n),
                        Err(_) => wrong.push(format!("`{key}` = {n} is too large")),
                    }
                }
            }
            "gradient_clipping" => {
                if !is_auto(value) {
                    match value.as_f64() {
                        // DeepSpeed's 0.0 means no clipping.
                        Some(0.0) => {}
                        Some(max) => out.training.clip_grad_norm = Some(max),
                        None => wrong.push(format!("`{key}` must be a number, not {value}")),
                    }
                }
            }
            "communication_data_type" => {
                if !is_auto(value) && !value.is_null() {
                    out.settings.communication = match value.as_str() {
                        Some("fp32" | "float32") => None,
                        Some("fp16" | "float16") => Some(Kind::Half),
                        Some("bf16" | "bfloat16") => Some(Kind::BFloat16),
                        _ => {
                            wrong.push(format!("`{key}` must be fp32, fp16 or bf16, not {value}"));
                            None
                        }
                    };
                }
            }
            "bf16" => {
                if enabled(value, key, &mut wrong) == Some(true) {
                    if out.training.precision == Some(Precision::Fp16) {
                        wrong.push("fp16 and bf16 are both enabled".into());
                    }
                    out.training.precision = Some(Precision::Bf16);
                }
                for k in sub_keys(value).filter(|k| *k != "enabled") {
                    refused.push(format!("bf16.{k}"));
                }
            }
            "fp16" => fp16(value, &mut out, &mut refused, &mut wrong),
            // Recomputing each unit in backward (accel_core::Unit::run_on); how DeepSpeed lays the
            // saved inputs out is its own business, except offloading them to the CPU.
            "activation_checkpointing" => {
                out.training.activation_checkpointing = Some(true);
                for k in sub_keys(value) {
                    match k {
                        "cpu_checkpointing" if value[k].as_bool() == Some(true) => {
                            refused.push(format!("{key}.{k}"))
                        }
                        _ => out.ignored.push(format!("{key}.{k}")),
                    }
                }
            }
            "zero_optimization" => zero(value, &mut out, &mut refused, &mut wrong),
            // Accelerate's templates name DeepSpeed's optimizer and schedule with "auto"
            // values (DummyOptim/DummyScheduler fill them in from the program): accel steps
            // the program's own, so only a value given here would be lost.
            "optimizer" | "scheduler" => {
                out.ignored.push(format!("{key}.type"));
                let params = value.get("params").and_then(Value::as_object);
                for (p, v) in params.into_iter().flatten() {
                    let implementation = matches!(p.as_str(), "torch_adam" | "adam_w_mode");
                    if !is_auto(v) && !implementation {
                        refused.push(format!("{key}.params.{p}"));
                    }
                }
                for k in sub_keys(value).filter(|k| !matches!(*k, "type" | "params")) {
                    refused.push(format!("{key}.{k}"));
                }
            }
            k if HINTS.contains(&k) => out.ignored.push(k.to_owned()),
            k => refused.push(k.to_owned()),
        }
    }
    Ok((out, refused, wrong, root.clone()))
}

/// A non-negative integer (DeepSpeed writes some as 5e8), or `None` for "auto" and for a
/// wrong value (noted in `wrong`).
fn count(v: &Value, key: &str, wrong: &mut Vec<String>) -> Option<u64> {
    if is_auto(v) {
        return None;
    }
    let integral = v.as_f64().filter(|f| f.fract() == 0.0 && (0.0..1e15).contains(f));
    match v.as_u64().or(integral.map(|f| f as u64)) {
        Some(n) => Some(n),
        None => {
            wrong.push(format!("`{key}` must be a non-negative integer or \"auto\", not {v}"));
            None
        }
    }
}

/// A batch size: a positive integer (or "auto": `None`).
fn positive(v: &Value, key: &str, wrong: &mut Vec<String>) -> Option<usize> {
    match count(v, key, wrong) {
        Some(0) => {
            wrong.push(format!("`{key}` must be at least 1"));
            None
        }
        n => n.map(|n| n as usize),
    }
}

fn sub_keys(v: &Value) -> impl Iterator<Item = &str> {
    v.as_object().into_iter().flat_map(|m| m.keys().map(String::as_str))
}

/// `{"enabled": true|false|"auto"}`: `None` for auto or absent.
fn enabled(v: &Value, key: &str, wrong: &mut Vec<String>) -> Option<bool> {
    let e = v.get("enabled")?;
    if is_auto(e) {
        return None;
    }
    match e.as_bool() {
        Some(b) => Some(b),
        None => {
            wrong.push(format!("`{key}.enabled` must be true, false or \"auto\", not {e}"));
            None
        }
    }
}

fn fp16(
    value: &Value,
    out: &mut DeepSpeedConfig,
    refused: &mut Vec<String>,
    wrong: &mut Vec<String>,
) {
    if enabled(value, "fp16", wrong) != Some(true) {
        return;
    }
    if out.training.precision == Some(Precision::Bf16) {
        wrong.push("fp16 and bf16 are both enabled".into());
    }
    out.training.precision = Some(Precision::Fp16);
    // DeepSpeed's defaults: dynamic scaling from 2^16, window 1000, hysteresis 2, floor 1.
    let mut scaler = ScalerConfig {
        init_scale: 65536.0,
        growth_interval: 1000,
        hysteresis: 2,
        min_scale: 1.0,
        ..ScalerConfig::default()
    };
    for (k, v) in value.as_object().into_iter().flatten() {
        let key = format!("fp16.{k}");
        let number = v.as_f64().filter(|f| f.is_finite());
        match (k.as_str(), number) {
            ("enabled", _) => {}
            (_, _) if is_auto(v) => {}
            ("loss_scale", Some(0.0)) => {}
            ("loss_scale", Some(s)) if s > 0.0 => {
                scaler.init_scale = s;
                scaler.dynamic = false;
            }
            ("initial_scale_power", Some(p)) if (0.0..=63.0).contains(&p) && p.fract() == 0.0 => {
                scaler.init_scale = 2f64.powi(p as i32);
            }
            ("loss_scale_window", Some(w)) if w >= 1.0 && w.fract() == 0.0 => {
                scaler.growth_interval = w as i64;
            }
            ("hysteresis", Some(h)) if h >= 1.0 && h.fract() == 0.0 && h <= 1e6 => {
                scaler.hysteresis = h as u32;
            }
            ("min_loss_scale", Some(m)) if m > 0.0 => scaler.min_scale = m,
            ("consecutive_hysteresis", _) => match v.as_bool() {
                Some(b) => scaler.consecutive_hysteresis = b,
                None => wrong.push(format!("`{key}` must be true or false, not {v}")),
            },
            ("auto_cast", _) => out.ignored.push(key),
            (
                "loss_scale"
                | "initial_scale_power"
                | "loss_scale_window"
                | "hysteresis"
                | "min_loss_scale",
                _,
            ) => wrong.push(format!("`{key}` = {v} is out of range")),
            _ => refused.push(key),
        }
    }
    out.settings.scaler = Some(scaler);
}

fn zero(
    value: &Value,
    out: &mut DeepSpeedConfig,
    refused: &mut Vec<String>,
    wrong: &mut Vec<String>,
) {
    let Some(map) = value.as_object() else {
        wrong.push(format!("`zero_optimization` must be an object, not {value}"));
        return;
    };
    let mut stage = None;
    let mut offload_param = false;
    for (k, v) in map {
        let key = format!("zero_optimization.{k}");
        match k.as_str() {
            "stage" if is_auto(v) => {}
            "stage" => match v.as_u64() {
                Some(s @ 0..=3) => stage = Some(s),
                _ => wrong.push(format!("`{key}` must be 0, 1, 2 or 3, not {v}")),
            },
            "reduce_bucket_size" if is_auto(v) => {}
            "reduce_bucket_size" => match v.as_f64().filter(|f| *f >= 1.0 && *f <= 1e12) {
                Some(n) => out.settings.reduce_bucket_elements = Some(n as usize),
                None => {
                    wrong.push(format!("`{key}` must be a positive number of elements, not {v}"))
                }
            },
            "offload_optimizer" | "offload_param" => {
                for (sub, sv) in v.as_object().into_iter().flatten() {
                    let subkey = format!("{key}.{sub}");
                    match sub.as_str() {
                        "device" => match sv.as_str() {
                            Some("cpu") => {
                                out.settings.offload = true;
                                offload_param |= k == "offload_param";
                            }
                            Some("none") => {}
                            Some("nvme") => refused.push(format!("{subkey} = nvme")),
                            _ if sv.is_null() => {}
                            _ => wrong
                                .push(format!("`{subkey}` must be cpu, nvme or none, not {sv}")),
                        },
                        "nvme_path" => {}
                        _ if HINTS.contains(&subkey.as_str()) => out.ignored.push(subkey),
                        _ => refused.push(subkey),
                    }
                }
            }
            _ if HINTS.contains(&key.as_str()) => out.ignored.push(key),
            _ => refused.push(key),
        }
    }
    if let Some(stage) = stage {
        out.training.strategy = Some(match stage {
            0 => Strategy::Ddp,
            1 => Strategy::Zero1,
            2 => Strategy::Zero2,
            _ => Strategy::Zero3,
        });
    }
    if offload_param && stage != Some(3) {
        wrong.push(
            "offload_param moves the parameters themselves, which only ZeRO stage 3 shards: set \
             stage 3, or offload the optimizer state only (offload_optimizer)"
                .into(),
        );
    } else if out.settings.offload && !matches!(stage, Some(2 | 3)) {
        wrong.push(format!(
            "offload to cpu needs ZeRO stage 2 or 3 (the config's stage is {})",
            stage.map_or("not given".into(), |s| s.to_string())
        ));
    }
    if refused.iter().any(|r| r.ends_with("= nvme")) {
        // Make the reason of an NVMe offload plain in the one error.
        refused.retain(|r| !r.ends_with("= nvme"));
        wrong.push(
            "offload to nvme (zero_optimization.offload_*.device = nvme) is not implemented: \
             use cpu"
                .into(),
        );
    }
}

impl DeepSpeedSettings {
    /// The accumulation DeepSpeed infers from `train_batch_size` ÷ (micro batch ×
    /// data-parallel processes), when both are given and it divides.
    pub fn inferred_accumulation(&self, replicas: usize) -> Option<u32> {
        let (micro, train) = (self.micro_batch_size?, self.train_batch_size?);
        let per_step = micro.checked_mul(replicas)?;
        (train % per_step == 0).then(|| u32::try_from(train / per_step).ok()).flatten()
    }

    /// Checks DeepSpeed's arithmetic, `train_batch_size = micro × accumulate × data-parallel
    /// processes`, filling in what is `"auto"`; returns the micro batch size when known.
    pub fn check_batch_sizes(&self, accumulate: u32, replicas: usize) -> Result<Option<usize>> {
        let steps = accumulate as usize * replicas;
        match (self.micro_batch_size, self.train_batch_size) {
            (Some(micro), Some(train)) if micro * steps != train => Err(Error::Config(format!(
                "DeepSpeed config: train_batch_size {train} ≠ train_micro_batch_size_per_gpu \
                 {micro} × gradient_accumulation_steps {accumulate} × {replicas} data-parallel \
                 process(es) = {}",
                micro * steps
            ))),
            (Some(micro), _) => Ok(Some(micro)),
            (None, Some(train)) if train % steps != 0 => Err(Error::Config(format!(
                "DeepSpeed config: train_batch_size {train} is not a multiple of \
                 gradient_accumulation_steps {accumulate} × {replicas} data-parallel process(es)"
            ))),
            (None, Some(train)) => Ok(Some(train / steps)),
            (None, None) => Ok(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stages_precision_accumulation_clipping_and_auto_map_onto_accel() {
        let c = parse(
            r#"{"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu",
                "pin_memory": true}, "reduce_bucket_size": 5e8, "overlap_comm": true},
                "bf16": {"enabled": true}, "gradient_accumulation_steps": 4,
                "gradient_clipping": 1.0, "train_micro_batch_size_per_gpu": "auto",
                "train_batch_size": "auto", "communication_data_type": "bf16"}"#,
        )
        .unwrap();
        assert_eq!(c.training.strategy, Some(Strategy::Zero2));
        assert_eq!(c.training.precision, Some(Precision::Bf16));
        assert_eq!(c.training.accumulate, Some(4));
        assert_eq!(c.training.clip_grad_norm, Some(1.0));
        assert!(c.settings.offload);
        assert_eq!(c.settings.reduce_bucket_elements, Some(500_000_000));
        assert_eq!(c.settings.communication, Some(Kind::BFloat16));
        assert_eq!((c.settings.micro_batch_size, c.settings.train_batch_size), (None, None));
        assert_eq!(
            c.ignored,
            ["zero_optimization.offload_optimizer.pin_memory", "zero_optimization.overlap_comm"]
        );
        for (stage, strategy) in [(0, Strategy::Ddp), (1, Strategy::Zero1), (3, Strategy::Zero3)] {
            let c = parse(&format!(r#"{{"zero_optimization": {{"stage": {stage}}}}}"#)).unwrap();
            assert_eq!(c.training.strategy, Some(strategy));
        }
    }

    #[test]
    fn fp16_takes_deepspeeds_scaler_settings_and_defaults() {
        let c = parse(r#"{"fp16": {"enabled": true}}"#).unwrap();
        let s = c.settings.scaler.unwrap();
        assert_eq!(
            (s.init_scale, s.growth_interval, s.hysteresis, s.min_scale),
            (65536.0, 1000, 2, 1.0)
        );
        assert!(s.dynamic);
        let c = parse(
            r#"{"fp16": {"enabled": true, "initial_scale_power": 12, "loss_scale_window": 500,
                "hysteresis": 3, "min_loss_scale": 0.5}}"#,
        )
        .unwrap();
        let s = c.settings.scaler.unwrap();
        assert_eq!(
            (s.init_scale, s.growth_interval, s.hysteresis, s.min_scale),
            (4096.0, 500, 3, 0.5)
        );
        let s = parse(r#"{"fp16": {"enabled": true, "loss_scale": 128}}"#)
            .unwrap()
            .settings
            .scaler
            .unwrap();
        assert_eq!((s.init_scale, s.dynamic), (128.0, false));
        assert_eq!(parse(r#"{"fp16": {"enabled": false}}"#).unwrap().training.precision, None);
    }

    /// DeepSpeed's ZeRO-3 NVMe-offload example (docs: "ZeRO-Infinity"), with its optimizer
    /// and scheduler sections.
    #[test]
    fn what_accel_lacks_is_named_in_one_error() {
        let err = parse(
            r#"{
              "train_batch_size": 8, "steps_per_print": 2000,
              "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999]}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001}},
              "activation_checkpointing": {"partition_activations": true},
              "fp16": {"enabled": true, "loss_scale": 0, "fp16_master_weights_and_grads": false},
              "zero_optimization": {"stage": 3, "contiguous_gradients": true,
                "offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": true},
                "stage3_max_live_parameters": 1e9, "zero_quantized_weights": true},
              "aio": {"block_size": 262144, "queue_depth": 32}
            }"#,
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains(
                "offload to nvme (zero_optimization.offload_*.device = nvme) is not implemented"
            ),
            "{err}"
        );
        for refused in [
            "`optimizer.params.lr` (accel steps the program's optimizer: set the value there",
            "`optimizer.params.betas`",
            "`scheduler.params.warmup_max_lr` (accel follows the program's schedule",
            "`aio`",
            "`fp16.fp16_master_weights_and_grads`",
            "`zero_optimization.zero_quantized_weights`",
        ] {
            assert!(err.contains(refused), "{refused} missing from: {err}");
        }
        assert!(!err.contains("steps_per_print") && !err.contains("contiguous_gradients"), "{err}");
        // Activation checkpointing is on, its layout hints are only warned about.
        let read =
            parse(r#"{"activation_checkpointing": {"partition_activations": true}}"#).unwrap();
        assert_eq!(read.training.activation_checkpointing, Some(true));
        assert_eq!(read.ignored, ["activation_checkpointing.partition_activations"]);
        let err =
            parse(r#"{"activation_checkpointing": {"cpu_checkpointing": true}}"#).unwrap_err();
        assert!(err.to_string().contains("activation_checkpointing.cpu_checkpointing"), "{err}");
        let err = parse(r#"{"zero_optimization": {"stage": 5}, "gradient_clipping": "x"}"#)
            .unwrap_err()
            .to_string();
        assert!(err.contains("`zero_optimization.stage` must be 0, 1, 2 or 3, not 5"), "{err}");
        assert!(err.contains("`gradient_clipping` must be a number"), "{err}");
        let err =
            parse(r#"{"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}"#)
                .unwrap_err()
                .to_string();
        assert!(err.contains("offload to cpu needs ZeRO stage 2 or 3"), "{err}");
    }

    #[test]
    fn batch_sizes_follow_deepspeeds_arithmetic() {
        let s = |micro, train| DeepSpeedSettings {
            micro_batch_size: micro,
            train_batch_size: train,
            ..Default::default()
        };
        assert_eq!(s(Some(4), Some(32)).check_batch_sizes(2, 4).unwrap(), Some(4));
        assert_eq!(s(None, Some(32)).check_batch_sizes(2, 4).unwrap(), Some(4));
        assert_eq!(s(Some(4), None).check_batch_sizes(2, 4).unwrap(), Some(4));
        assert_eq!(s(None, None).check_batch_sizes(2, 4).unwrap(), None);
        let err = s(Some(4), Some(30)).check_batch_sizes(2, 4).unwrap_err().to_string();
        assert!(err.contains("train_batch_size 30 ≠ train_micro_batch_size_per_gpu 4 × gradient_accumulation_steps 2 × 4 data-parallel process(es) = 32"), "{err}");
        let err = s(None, Some(30)).check_batch_sizes(2, 4).unwrap_err().to_string();
        assert!(err.contains("not a multiple"), "{err}");
        // DeepSpeed's inference of the accumulation: 64 = 8 × gas × 4.
        assert_eq!(s(Some(8), Some(64)).inferred_accumulation(4), Some(2));
        assert_eq!(s(Some(8), Some(60)).inferred_accumulation(4), None);
        assert_eq!(s(Some(8), None).inferred_accumulation(4), None);
        let err = parse(r#"{"train_batch_size": 0}"#).unwrap_err().to_string();
        assert!(err.contains("`train_batch_size` must be at least 1"), "{err}");
        let err =
            parse(r#"{"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}"#)
                .unwrap_err()
                .to_string();
        assert!(err.contains("offload_param moves the parameters themselves"), "{err}");
        let c = parse(r#"{"fp16": {"enabled": true, "consecutive_hysteresis": true}}"#).unwrap();
        assert!(c.settings.scaler.unwrap().consecutive_hysteresis);
    }
}
