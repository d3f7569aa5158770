//! Hugging Face checkpoints: `model.safetensors`, or `model.safetensors.index.json` and its
//! shards, read by the tensors' own names (Accelerate's `load_checkpoint_in_model`). Only
//! the headers are read up front; each tensor — or each process's part of it — is read from
//! its file when loaded, so a process under zero2/zero3 reads its own shard of every
//! parameter and no more (about one shard per process instead of the model).

use std::collections::BTreeMap;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use tch::{Kind, Tensor};

use super::format::{MAX_HEADER_BYTES, bad, io_error};
use crate::accelerator::Accelerator;
use crate::error::{Error, Result};
use crate::strategy::Placement;

/// Where one tensor lies in its file.
#[derive(Debug, Clone)]
struct Entry {
    file: PathBuf,
    kind: Kind,
    shape: Vec<i64>,
    /// Offset of its first byte in the file.
    start: u64,
}

impl Entry {
    fn numel(&self) -> i64 {
        self.shape.iter().product()
    }
}

/// A Hugging Face checkpoint: where each tensor is, by name.
#[derive(Debug)]
pub struct HfCheckpoint {
    entries: BTreeMap<String, Entry>,
}

fn kind_of(dtype: &str) -> Option<Kind> {
    Some(match dtype {
        "F64" => Kind::Double,
        "F32" => Kind::Float,
        "F16" => Kind::Half,
        "BF16" => Kind::BFloat16,
        "I64" => Kind::Int64,
        "I32" => Kind::Int,
        "I16" => Kind::Int16,
        "I8" => Kind::Int8,
        "U8" => Kind::Uint8,
        "BOOL" => Kind::Bool,
        _ => return None,
    })
}

/// The header of a safetensors file: each tensor's dtype, shape and byte range.
fn read_header(path: &Path) -> Result<BTreeMap<String, Entry>> {
    let mut file = std::fs::File::open(path).map_err(|e| io_error(path, e))?;
    let size = file.metadata().map_err(|e| io_error(path, e))?.len();
    let mut prefix = [0u8; 8];
    file.read_exact(&mut prefix)
        .map_err(|_| bad(path, "not a safetensors file: shorter than its 8-byte header length"))?;
    let header = u64::from_le_bytes(prefix);
    if header > MAX_HEADER_BYTES || header > size - 8 {
        return Err(bad(
            path,
            format!("not a safetensors file: its header claims {header} bytes of {}", size - 8),
        ));
    }
    let mut text = vec![0u8; header as usize];
    file.read_exact(&mut text).map_err(|e| io_error(path, e))?;
    let json: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&text)
        .map_err(|e| bad(path, format!("not a safetensors file: its header: {e}")))?;
    let data_start = 8 + header;
    let mut entries = BTreeMap::new();
    for (name, info) in json {
        if name == "__metadata__" {
            continue;
        }
        let dtype = info["dtype"].as_str().unwrap_or_default();
        let kind = kind_of(dtype).ok_or_else(|| {
            bad(path, format!("tensor `{name}` has dtype {dtype:?}, unsupported"))
        })?;
        let shape: Vec<i64> = info["shape"]
            .as_array()
            .map(|a| a.iter().filter_map(|d| d.as_i64()).collect())
            .ok_or_else(|| bad(path, format!("tensor `{name}` has no shape")))?;
        let offsets: Vec<u64> = info["data_offsets"]
            .as_array()
            .map(|a| a.iter().filter_map(|d| d.as_u64()).collect())
            .unwrap_or_default();
        let [begin, end] = offsets[..] else {
            return Err(bad(path, format!("tensor `{name}` has no data_offsets")));
        };
        let numel: i64 = shape.iter().product();
        let expected = numel as u64 * kind.elt_size_in_bytes() as u64;
        if end < begin || end - begin != expected || data_start + end > size {
            return Err(bad(
                path,
                format!(
                    "tensor `{name}` ({dtype} {shape:?}) claims bytes {begin}..{end}, which do \
                     not fit it or the file ({size} bytes)"
                ),
            ));
        }
        entries.insert(
            name,
            Entry { file: path.to_path_buf(), kind, shape, start: data_start + begin },
        );
    }
    Ok(entries)
}

impl HfCheckpoint {
    /// A folder with `model.safetensors.index.json` (and the shards it names) or
    /// `model.safetensors`; or such an index or safetensors file itself.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let index = if path.is_dir() {
            let index = path.join("model.safetensors.index.json");
            if !index.exists() {
                let single = path.join("model.safetensors");
                if !single.exists() {
                    return Err(bad(
                        path,
                        "holds neither model.safetensors.index.json nor model.safetensors",
                    ));
                }
                return Ok(Self { entries: read_header(&single)? });
            }
            index
        } else if path.extension().is_some_and(|e| e == "json") {
            path.to_path_buf()
        } else {
            return Ok(Self { entries: read_header(path)? });
        };
        let text = std::fs::read_to_string(&index).map_err(|e| io_error(&index, e))?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| bad(&index, format!("not JSON: {e}")))?;
        let map = json["weight_map"].as_object().ok_or_else(|| bad(&index, "has no weight_map"))?;
        let dir = index.parent().unwrap_or(Path::new("."));
        let mut files: BTreeMap<String, BTreeMap<String, Entry>> = BTreeMap::new();
        let mut entries = BTreeMap::new();
        for (name, file) in map {
            let file = file.as_str().ok_or_else(|| bad(&index, format!("`{name}`: no file")))?;
            if file.contains('/') || file.contains("..") {
                return Err(bad(&index, format!("`{name}` is in {file:?}, outside the folder")));
            }
            if !files.contains_key(file) {
                files.insert(file.to_owned(), read_header(&dir.join(file))?);
            }
            let entry = files[file].get(name).ok_or_else(|| {
                bad(&dir.join(file), format!("has no tensor `{name}`, which the index puts there"))
            })?;
            entries.insert(name.clone(), entry.clone());
        }
        Ok(Self { entries })
    }

    /// The names of its tensors.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(String::as_str)
    }

    /// The shape of tensor `name`, if it holds one.
    pub fn shape(&self, name: &str) -> Option<&[i64]> {
        self.entries.get(name).map(|e| e.shape.as_slice())
    }

    fn entry(&self, name: &str) -> Result<&Entry> {
        self.entries.get(name).ok_or_else(|| Error::Checkpoint {
            path: None,
            message: format!("the checkpoint has no tensor `{name}`"),
        })
    }

    /// Elements `start..start + count` of tensor `name` flattened, read from its file alone.
    pub fn read_range(&self, name: &str, start: i64, count: i64) -> Result<Tensor> {
        let e = self.entry(name)?;
        let elt = e.kind.elt_size_in_bytes() as u64;
        let count = count.min(e.numel() - start).max(0);
        let mut bytes = vec![0u8; count as usize * elt as usize];
        let mut file = std::fs::File::open(&e.file).map_err(|err| io_error(&e.file, err))?;
        file.seek(SeekFrom::Start(e.start + start as u64 * elt))
            .and_then(|_| file.read_exact(&mut bytes))
            .map_err(|err| io_error(&e.file, err))?;
        Ok(Tensor::f_from_data_size(&bytes, &[count], e.kind)?)
    }

    /// Tensor `name`, whole.
    pub fn read(&self, name: &str) -> Result<Tensor> {
        let e = self.entry(name)?;
        Ok(self.read_range(name, 0, e.numel())?.f_reshape(e.shape.as_slice())?)
    }
}

impl Accelerator {
    /// Loads a Hugging Face checkpoint into the model in `vs` by the variables' names
    /// (Accelerate's `load_checkpoint_in_model`): `path` is a folder with
    /// `model.safetensors.index.json` and its shards, or `model.safetensors`, or such a file.
    /// Every variable must be in it with its shape (else an error naming the first missing,
    /// and nothing changes); tensors of the checkpoint the model lacks are ignored, and
    /// values are converted to each variable's dtype.
    ///
    /// On a prepared model every process reads its own part of each variable: under
    /// zero2/zero3 the bytes of its shard, straight into its master shard; elsewhere the
    /// whole tensor. Every process calls it.
    pub fn load_checkpoint_in_model(
        &self,
        vs: &tch::nn::VarStore,
        path: impl AsRef<Path>,
    ) -> Result<()> {
        let path = path.as_ref();
        let checkpoint = HfCheckpoint::open(path)?;
        let prepared = self.prepared_params(vs);
        let params = prepared.clone().unwrap_or_else(|| crate::optim::sorted_variables(vs));
        let with_path = |message: String| Error::Checkpoint { path: Some(path.into()), message };
        for p in &params {
            let want = self.inner.parallel.whole_shape(&p.tensor)?;
            match checkpoint.shape(&p.name) {
                None => {
                    return Err(with_path(format!(
                        "has no tensor `{}` (shape {want:?}), which the model needs; nothing \
                         was loaded",
                        p.name
                    )));
                }
                Some(shape) if shape != want.as_slice() => {
                    return Err(with_path(format!(
                        "`{}` has shape {shape:?} there, the model's is {want:?}; nothing was \
                         loaded",
                        p.name
                    )));
                }
                Some(_) => {}
            }
        }
        let strategy = self.strategy();
        tch::no_grad(|| -> Result<()> {
            for p in &params {
                if prepared.is_some() {
                    let (local, placement) = strategy.parameter(p)?;
                    if let Placement::Chunk { index, count, numel, .. } = placement {
                        // Only this process's bytes: chunk `index` of `count`, zero-padded.
                        let chunk = (numel + count as i64 - 1) / count as i64;
                        let part = checkpoint.read_range(&p.name, index as i64 * chunk, chunk)?;
                        let mut local = local.f_reshape([-1])?;
                        let _ = local.f_zero_()?;
                        let n = part.numel() as i64;
                        local.f_narrow(0, 0, n)?.f_copy_(&part.f_to_kind(local.kind())?)?;
                        continue;
                    }
                    let whole = checkpoint.read(&p.name)?.f_to_kind(p.tensor.kind())?;
                    let mine = self.inner.parallel.cut(&p.tensor, &whole)?;
                    strategy.load_parameter(p, &mine)?;
                } else {
                    let whole = checkpoint.read(&p.name)?;
                    p.tensor.shallow_clone().f_copy_(&whole)?;
                }
            }
            Ok(())
        })?;
        if prepared.is_some() {
            strategy.after_load()?;
        }
        Ok(())
    }

    /// Prepares the model in `vs` from a Hugging Face checkpoint: prepared without the
    /// broadcast of the first process's values (FSDP's `sync_module_states = False`), then
    /// every process loads its part of each variable from `path`
    /// ([`load_checkpoint_in_model`](Self::load_checkpoint_in_model)). Built with
    /// [`crate::nn::uninit`] variables, a model under zero3 never occupies more than its
    /// shards plus the units that stay whole in any process's memory.
    pub fn prepare_model_from_checkpoint(
        &self,
        vs: &tch::nn::VarStore,
        path: impl AsRef<Path>,
    ) -> Result<()> {
        let options = self.inner.model_options.sync_module_states(false);
        self.prepare_model_with(vs, options)?;
        self.load_checkpoint_in_model(vs, path)
    }
}
