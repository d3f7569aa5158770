//! LoRA adapters as PEFT writes them (`adapter_config.json` + `adapter_model.safetensors`):
//! `y = W x + b + (B A x) · scale` on the targeted projections, `scale = alpha / r` (or
//! `alpha / √r` with rsLoRA), the base frozen and only A and B trained; saved under PEFT's
//! names (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`), so that
//! `peft.PeftModel.from_pretrained` loads them; merged into the base weights
//! (`W + scale · B A`, PEFT's `merge_and_unload`) for a plain checkpoint.
//!
//! Closed world, as the models: an adapter config with anything this does not compute
//! (DoRA, per-module ranks, trained biases, modules saved whole, regex targets, ...) is
//! refused by name.

use std::path::Path;

use anyhow::{Context, Result, bail};
use tch::Tensor;

use crate::llama::Llama;

/// What PEFT's `LoraConfig` says, for what this computes.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraConfig {
    /// The rank of A and B.
    pub r: i64,
    /// `lora_alpha`.
    pub alpha: f64,
    /// Module names (`q_proj`, or a full name): a projection is adapted when its full name
    /// equals one or ends with `.` + one (PEFT's rule for a list).
    pub targets: Vec<String>,
    /// rsLoRA: `alpha / √r` instead of `alpha / r`.
    pub rslora: bool,
    /// Dropout on the adapters' input in training (refused by the trainer when above 0).
    pub dropout: f64,
}

impl LoraConfig {
    /// The factor on `B A x`.
    pub fn scale(&self) -> f64 {
        if self.rslora { self.alpha / (self.r as f64).sqrt() } else { self.alpha / self.r as f64 }
    }

    /// Whether the projection named `module` (`model.layers.0.self_attn.q_proj`) is adapted.
    pub fn targets(&self, module: &str) -> bool {
        self.targets.iter().any(|t| module == t || module.ends_with(&format!(".{t}")))
    }

    /// Reads `dir/adapter_config.json` as PEFT 0.21 writes it.
    pub fn read(dir: &Path) -> Result<Self> {
        crate::read_config(dir, "adapter_config.json", Self::parse)
    }

    /// [`LoraConfig::read`] of the text of an adapter_config.json.
    pub fn parse(text: &str) -> Result<Self> {
        let value: serde_json::Value = serde_json::from_str(text).context("not JSON")?;
        let map = value.as_object().context("not a JSON object")?;
        let peft_type = map.get("peft_type").and_then(|v| v.as_str()).unwrap_or("LORA");
        if peft_type != "LORA" {
            bail!("peft_type is {peft_type:?}; only LORA adapters are implemented");
        }
        // Keys that change the computation when not at PEFT's defaults.
        let is_default = |key: &str| match map.get(key) {
            None | Some(serde_json::Value::Null) => true,
            Some(serde_json::Value::Bool(b)) => !b,
            Some(serde_json::Value::Object(o)) => o.is_empty(),
            Some(serde_json::Value::Array(a)) => a.is_empty(),
            Some(serde_json::Value::String(s)) => key == "bias" && s == "none",
            Some(_) => false,
        };
        for key in [
            "fan_in_fan_out",
            "rank_pattern",
            "alpha_pattern",
            "lora_bias",
            "bias",
            "use_dora",
            "modules_to_save",
            "layers_to_transform",
            "layers_pattern",
            "exclude_modules",
            "target_parameters",
            "trainable_token_indices",
            "layer_replication",
            "use_qalora",
            "use_bdlora",
        ] {
            if !is_default(key) {
                bail!(
                    "`{key}` is {}; this LoRA implements PEFT's plain LoRA only (that key at its \
                     default), so the adapter is refused rather than computed otherwise",
                    map[key]
                );
            }
        }
        let r = map.get("r").and_then(|v| v.as_i64()).context("`r` is missing")?;
        if r <= 0 {
            bail!("`r` is {r}; the rank must be at least 1");
        }
        let alpha = map.get("lora_alpha").and_then(|v| v.as_f64()).unwrap_or(8.0);
        let targets: Vec<String> = match map.get("target_modules") {
            Some(serde_json::Value::Array(a)) => a
                .iter()
                .map(|v| v.as_str().map(str::to_owned).context("a target is not a string"))
                .collect::<Result<_>>()?,
            Some(serde_json::Value::String(s)) => bail!(
                "target_modules is the pattern {s:?}; give the module names as a list \
                 (q_proj, v_proj, ...)"
            ),
            _ => bail!("`target_modules` is missing"),
        };
        Ok(Self {
            r,
            alpha,
            targets,
            rslora: map.get("use_rslora").and_then(|v| v.as_bool()).unwrap_or(false),
            dropout: map.get("lora_dropout").and_then(|v| v.as_f64()).unwrap_or(0.0),
        })
    }

    /// The adapter_config.json PEFT writes for this configuration.
    pub fn to_json(&self, base_model: &str) -> serde_json::Value {
        serde_json::json!({
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_model,
            "r": self.r,
            "lora_alpha": self.alpha,
            "lora_dropout": self.dropout,
            "target_modules": self.targets,
            "use_rslora": self.rslora,
            "bias": "none",
            "fan_in_fan_out": false,
            "inference_mode": true,
            "init_lora_weights": true,
            "lora_bias": false,
            "use_dora": false,
            "modules_to_save": null,
            "layers_to_transform": null,
            "layers_pattern": null,
            "rank_pattern": {},
            "alpha_pattern": {},
            "revision": null,
        })
    }
}

/// PEFT's name of an adapter tensor of projection `module`: `base_model.model.{module}.lora_A`.
pub fn peft_prefix(module: &str) -> String {
    format!("base_model.model.{module}")
}

/// How fresh adapters start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoraInit {
    /// As PEFT: A from Kaiming-uniform (a = √5), B at zero (the model starts as the base).
    Fresh,
    /// Reserved, to be filled from an adapter file.
    Uninit,
}

impl Llama {
    /// Adds LoRA adapters to the projections `config` targets, their variables in `adapters`
    /// under PEFT's names; the base variables (in another VarStore) are left as they are —
    /// freeze them. Returns how many projections were adapted (0 is an error: the targets
    /// name nothing in this model).
    pub fn attach_lora(
        &self,
        adapters: &tch::nn::VarStore,
        config: &LoraConfig,
        init: LoraInit,
    ) -> Result<usize> {
        let mut adapted = 0;
        for (module, linear) in self.projections() {
            if !config.targets(&module) {
                continue;
            }
            let (out_features, in_features) = linear.shape();
            let root = adapters.root();
            let mut path = root.clone();
            for part in peft_prefix(&module).split('.') {
                path = &path / part;
            }
            let (a_path, b_path) = (&path / "lora_A", &path / "lora_B");
            let (a, b) = match init {
                LoraInit::Fresh => {
                    // torch's kaiming_uniform_(a=√5) on [r, in]: bound = 1/√in.
                    let bound = 1.0 / (in_features as f64).sqrt();
                    let a = a_path.var(
                        "weight",
                        &[config.r, in_features],
                        tch::nn::Init::Uniform { lo: -bound, up: bound },
                    );
                    (a, b_path.zeros("weight", &[out_features, config.r]))
                }
                LoraInit::Uninit => (
                    accel_core::nn::uninit(&a_path, "weight", &[config.r, in_features]),
                    accel_core::nn::uninit(&b_path, "weight", &[out_features, config.r]),
                ),
            };
            linear.attach(a, b, config.scale())?;
            adapted += 1;
        }
        if adapted == 0 {
            bail!(
                "target_modules {:?} name no projection of this model (q_proj, k_proj, v_proj, \
                 o_proj, gate_proj, up_proj, down_proj)",
                config.targets
            );
        }
        Ok(adapted)
    }

    /// Folds every adapter into its base weight, `W ← W + scale · B A` (PEFT's
    /// `merge_and_unload`), and detaches the adapters: the model is then the plain model
    /// that [`Llama::save_pretrained`] writes for `from_pretrained`.
    pub fn merge_lora(&self) -> Result<()> {
        tch::no_grad(|| -> Result<()> {
            for (_, linear) in self.projections() {
                linear.merge()?;
            }
            Ok(())
        })
    }
}

/// Writes the adapters in `adapters` as PEFT's folder: `adapter_model.safetensors` (PEFT's
/// names) and `adapter_config.json`. Every process calls it; the main process writes.
pub fn save_adapter(
    acc: &accel_core::Accelerator,
    adapters: &tch::nn::VarStore,
    config: &LoraConfig,
    base_model: &str,
    out: &Path,
) -> Result<()> {
    acc.save_model(adapters, out, u64::MAX)?;
    if acc.is_main_process() {
        std::fs::rename(out.join("model.safetensors"), out.join("adapter_model.safetensors"))
            .with_context(|| format!("naming {}/adapter_model.safetensors", out.display()))?;
        let path = out.join("adapter_config.json");
        std::fs::write(&path, serde_json::to_string_pretty(&config.to_json(base_model))? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// Loads PEFT adapter folder `dir` into `adapters` (made by [`Llama::attach_lora`] with
/// [`LoraInit::Uninit`]): its tensors must be exactly the adapters', by name and shape.
pub fn load_adapter(adapters: &tch::nn::VarStore, dir: &Path) -> Result<()> {
    let path = dir.join("adapter_model.safetensors");
    let file: Vec<(String, Tensor)> =
        Tensor::read_safetensors(&path).with_context(|| format!("reading {}", path.display()))?;
    let mut variables = adapters.variables();
    let mut unexpected = Vec::new();
    tch::no_grad(|| -> Result<()> {
        for (name, tensor) in &file {
            match variables.remove(name) {
                Some(mut v) if v.size() == tensor.size() => {
                    v.copy_(&tensor.to_kind(v.kind()));
                }
                Some(v) => bail!(
                    "{}: `{name}` has shape {:?}, the adapter's is {:?}",
                    path.display(),
                    tensor.size(),
                    v.size()
                ),
                None => unexpected.push(name.clone()),
            }
        }
        Ok(())
    })?;
    if !unexpected.is_empty() || !variables.is_empty() {
        let mut missing: Vec<String> = variables.into_keys().collect();
        missing.sort();
        bail!(
            "{}: the adapter's tensors are not this model's adapters; UNEXPECTED: {:?}; \
             MISSING: {:?}",
            path.display(),
            unexpected,
            missing
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peft_configs_read_and_what_is_not_plain_lora_is_refused() {
        let text = r#"{"peft_type": "LORA", "r": 4, "lora_alpha": 8, "lora_dropout": 0.0,
            "target_modules": ["v_proj", "q_proj"], "bias": "none", "use_dora": false,
            "rank_pattern": {}, "alpha_pattern": {}, "modules_to_save": null,
            "fan_in_fan_out": false, "use_rslora": false}"#;
        let c = LoraConfig::parse(text).unwrap();
        assert_eq!((c.r, c.scale()), (4, 2.0));
        assert!(
            c.targets("model.layers.0.self_attn.q_proj")
                && !c.targets("model.layers.0.mlp.up_proj")
        );
        let rs = LoraConfig::parse(&text.replace("\"use_rslora\": false", "\"use_rslora\": true"))
            .unwrap();
        assert_eq!(rs.scale(), 4.0);
        for (from, to, named) in [
            ("\"use_dora\": false", "\"use_dora\": true", "use_dora"),
            ("\"rank_pattern\": {}", "\"rank_pattern\": {\"q_proj\": 8}", "rank_pattern"),
            ("\"bias\": \"none\"", "\"bias\": \"all\"", "bias"),
            ("\"modules_to_save\": null", "\"modules_to_save\": [\"lm_head\"]", "modules_to_save"),
            ("\"peft_type\": \"LORA\"", "\"peft_type\": \"IA3\"", "IA3"),
        ] {
            let e = format!("{:#}", LoraConfig::parse(&text.replace(from, to)).unwrap_err());
            assert!(e.contains(named), "{e}");
        }
    }
}
