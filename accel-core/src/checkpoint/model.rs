//! The model's weights alone: `save_model` (Hugging Face's layout: one file, or shards of
//! bounded size with an index) and `merge_weights` (a sharded checkpoint's weights put back
//! together, what `accel merge-weights` writes).

use std::collections::BTreeMap;
use std::path::Path;

use tch::Tensor;

use super::format::{Manifest, bad, io_error, model_file, publish, temporary_dir, write_tensors};
use crate::accelerator::Accelerator;
use crate::error::Result;

impl Accelerator {
    /// Writes the model's weights to `dir` as `model.safetensors`, or, when they exceed
    /// `max_shard_bytes`, as `model-0000i-of-0000n.safetensors` plus
    /// `model.safetensors.index.json` (Hugging Face's layout). Every process must call it:
    /// the weights are gathered whole first (under zero3 no process holds them), then the
    /// main process writes them.
    pub fn save_model(
        &self,
        vs: &tch::nn::VarStore,
        dir: impl AsRef<Path>,
        max_shard_bytes: u64,
    ) -> Result<()> {
        let variables = self.full_state_dict(vs)?;
        if !self.is_main_process() {
            return Ok(());
        }
        let dir = dir.as_ref();
        let mut shards: Vec<Vec<(String, Tensor)>> = vec![Vec::new()];
        let mut shard_bytes = 0u64;
        for (name, tensor) in variables {
            let bytes = (tensor.numel() * tensor.kind().elt_size_in_bytes()) as u64;
            if shard_bytes > 0 && shard_bytes + bytes > max_shard_bytes {
                shards.push(Vec::new());
                shard_bytes = 0;
            }
            shard_bytes += bytes;
            shards.last_mut().expect("one shard at least").push((name, tensor));
        }
        let tmp = temporary_dir(dir, true)?;
        let result = (|| -> Result<()> {
            if shards.len() == 1 {
                write_tensors(&tmp.join("model.safetensors"), &shards[0])?;
                return Ok(());
            }
            let n = shards.len();
            let mut weight_map = BTreeMap::new();
            let mut total = 0u64;
            for (i, shard) in shards.iter().enumerate() {
                let name = format!("model-{:05}-of-{n:05}.safetensors", i + 1);
                write_tensors(&tmp.join(&name), shard)?;
                for (tensor_name, t) in shard {
                    total += (t.numel() * t.kind().elt_size_in_bytes()) as u64;
                    weight_map.insert(tensor_name.clone(), name.clone());
                }
            }
            let index = serde_json::json!({ "metadata": { "total_size": total }, "weight_map": weight_map });
            let path = tmp.join("model.safetensors.index.json");
            std::fs::write(&path, serde_json::to_string_pretty(&index).expect("json"))
                .map_err(|e| io_error(&path, e))
        })();
        if let Err(e) = result {
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(e);
        }
        publish(&tmp, dir)
    }
}

/// The whole weights of model `model` (0 for the first prepared) of the checkpoint in
/// `dir`, its sharded parameters put back together from every process's shard file: what
/// `accel merge-weights DIR OUT.safetensors` writes. Every file is checked against the
/// manifest first.
pub fn merge_weights(dir: &Path, model: usize) -> Result<Vec<(String, Tensor)>> {
    let manifest = Manifest::read(dir)?;
    if model >= manifest.models {
        return Err(bad(
            dir,
            format!("it holds {} model(s); there is no model {model}", manifest.models),
        ));
    }
    let mut weights = manifest.read_file(dir, &model_file(model))?;
    let prefix = format!("model_{model}/");
    for (key, whole) in manifest.whole_pieces(dir, |key| key.starts_with(&prefix))? {
        let shape = manifest
            .shapes
            .get(&key)
            .ok_or_else(|| bad(dir, format!("the manifest lacks the shape of `{key}`")))?;
        weights.insert(key[prefix.len()..].to_string(), whole.f_reshape(shape.as_slice())?);
    }
    Ok(weights.into_iter().collect())
}
