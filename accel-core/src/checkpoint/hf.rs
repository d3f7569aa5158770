//! Hugging Face checkpoints: `model.safetensors`, or `model.safetensors.index.json` and its
//! shards, read by the tensors' own names (Accelerate's `load_checkpoint_in_model`). Only
//! the headers are read up front; each tensor — or each process's part of it — is read from
//! its file when loaded, so a process under zero2/zero3 reads its own shard of every
//! parameter and no more (about one shard per process instead of the model).

use std::collections::BTreeMap;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use std::sync::atomic::Ordering;

use tch::Tensor;

use super::format::{bad, io_error};
use super::load::held;
use super::ranges::{FileReader, ReadCounter, TensorEntry, filled};
use crate::accelerator::Accelerator;
use crate::error::{Error, Result};
use crate::strategy::Placement;

/// Where one tensor lies: its file, and its place there.
#[derive(Debug, Clone)]
struct Entry {
    file: PathBuf,
    place: TensorEntry,
}

/// A Hugging Face checkpoint: where each tensor is, by name.
#[derive(Debug)]
pub struct HfCheckpoint {
    entries: BTreeMap<String, Entry>,
    /// Bytes read from its files so far.
    read: ReadCounter,
}

/// The tensors a safetensors file's header lists.
fn read_header(path: &Path) -> Result<BTreeMap<String, Entry>> {
    let counter = ReadCounter::new(0);
    let reader = FileReader::open(path, None, &counter)?;
    Ok(reader
        .entries
        .into_iter()
        .map(|(name, place)| (name, Entry { file: path.to_path_buf(), place }))
        .collect())
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
                return Ok(Self { entries: read_header(&single)?, read: ReadCounter::new(0) });
            }
            index
        } else if path.extension().is_some_and(|e| e == "json") {
            path.to_path_buf()
        } else {
            return Ok(Self { entries: read_header(path)?, read: ReadCounter::new(0) });
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
        Ok(Self { entries, read: ReadCounter::new(0) })
    }

    /// The names of its tensors.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(String::as_str)
    }

    /// The shape of tensor `name`, if it holds one.
    pub fn shape(&self, name: &str) -> Option<&[i64]> {
        self.entries.get(name).map(|e| e.place.shape.as_slice())
    }

    fn entry(&self, name: &str) -> Result<&Entry> {
        self.entries.get(name).ok_or_else(|| Error::Checkpoint {
            path: None,
            message: format!("the checkpoint has no tensor `{name}`"),
        })
    }

    /// Elements `start..start + count` of tensor `name` flattened, read from its file alone
    /// (fewer where the tensor ends first).
    pub fn read_range(&self, name: &str, start: i64, count: i64) -> Result<Tensor> {
        let e = self.entry(name)?;
        let elt = e.place.kind.elt_size_in_bytes() as u64;
        let count = count.min(e.place.numel() - start).max(0);
        let mut file = std::fs::File::open(&e.file).map_err(|err| io_error(&e.file, err))?;
        filled(count, e.place.kind, |bytes| {
            file.seek(SeekFrom::Start(e.place.start + start as u64 * elt))
                .and_then(|_| file.read_exact(bytes))
                .map_err(|err| io_error(&e.file, err))?;
            self.read.fetch_add(bytes.len() as u64, Ordering::Relaxed);
            Ok(())
        })
    }

    /// Where tensor `name`'s bytes lie: its file, the offset of its first byte there, its
    /// dtype and its shape — to map them into memory rather than read them (as
    /// safetensors' `safe_open` does).
    pub fn location(&self, name: &str) -> Result<(&Path, u64, tch::Kind, &[i64])> {
        let e = self.entry(name)?;
        Ok((&e.file, e.place.start, e.place.kind, &e.place.shape))
    }

    /// Tensor `name`, whole.
    pub fn read(&self, name: &str) -> Result<Tensor> {
        let e = self.entry(name)?;
        Ok(self.read_range(name, 0, e.place.numel())?.f_reshape(e.place.shape.as_slice())?)
    }

    /// Bytes read from its files so far.
    pub fn bytes_read(&self) -> u64 {
        self.read.load(Ordering::Relaxed)
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
                if prepared.is_none() {
                    let whole = checkpoint.read(&p.name)?;
                    p.tensor.shallow_clone().f_copy_(&whole)?;
                    continue;
                }
                // Only this process's elements: its chunk under zero2/zero3 (zero-padded),
                // its slice under tensor parallelism.
                let (local, placement) = strategy.parameter(p)?;
                let whole = placement == Placement::Replicated;
                let shape = self.inner.parallel.whole_shape(&p.tensor)?;
                let held = held(&self.inner.parallel.placement(&p.tensor, placement)?, &shape);
                let mut runs = Vec::new();
                for &(start, len) in &held.runs {
                    runs.push(checkpoint.read_range(&p.name, start, len)?.f_to_kind(local.kind())?);
                }
                let mut value = Tensor::f_zeros([held.numel], (local.kind(), tch::Device::Cpu))?;
                if !runs.is_empty() {
                    let read = Tensor::f_cat(&runs, 0)?;
                    value.f_narrow(0, 0, read.numel() as i64)?.f_copy_(&read)?;
                }
                value = value.f_view(held.shape.as_slice())?;
                if whole {
                    strategy.load_parameter(p, &value)?;
                } else {
                    strategy.load_part(p, &value.f_view(local.size().as_slice())?)?;
                }
            }
            Ok(())
        })?;
        self.inner.io.checkpoint_bytes_read.fetch_add(checkpoint.bytes_read(), Ordering::Relaxed);
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
