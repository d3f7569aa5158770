//! tch's own `VarStore::save`/`load`/`load_partial`/`variables`, made right for a prepared
//! model: what `#[accelerate]` turns those calls into, and what the explicit API offers
//! for the same files. One whole copy is written, by the main process, atomically; every
//! process loads into its own (possibly sharded) part of the model.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use tch::Tensor;
use tch::nn::VarStore;

use super::Accelerator;
use crate::error::{Error, Result};
use crate::optim::Param;

/// tch's choice of file format by extension, for reading (`VarStore::load`).
fn read_by_extension(path: &Path) -> Result<HashMap<String, Tensor>> {
    let cpu = tch::Device::Cpu;
    let read = match path.extension().and_then(|x| x.to_str()) {
        Some("bin") | Some("pt") => Tensor::loadz_multi_with_device(path, cpu),
        Some("safetensors") => Tensor::read_safetensors(path),
        Some(_) | None => Tensor::load_multi_with_device(path, cpu),
    };
    let named = read.map_err(|e| Error::Checkpoint {
        path: Some(path.to_path_buf()),
        message: format!("cannot read it: {}", crate::error::torch_text(&e)),
    })?;
    Ok(named.into_iter().collect())
}

/// tch's choice of file format by extension, for writing (`VarStore::save`).
fn write_by_extension(path: &Path, named: &[(String, Tensor)]) -> Result<()> {
    let refs: Vec<(&str, &Tensor)> = named.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let written = match path.extension().and_then(|x| x.to_str()) {
        Some("safetensors") => Tensor::write_safetensors(&refs, path),
        Some(_) | None => Tensor::save_multi(&refs, path),
    };
    written.map_err(|e| Error::Checkpoint {
        path: Some(path.to_path_buf()),
        message: format!("cannot write it: {}", crate::error::torch_text(&e)),
    })
}

/// Writes `named` to a temporary file beside `path`, then renames it onto `path`: a reader
/// sees the old file or the new one, never half of one.
fn write_atomically(path: &Path, named: &[(String, Tensor)]) -> Result<()> {
    let tmp = temporary_beside(path);
    let result = write_by_extension(&tmp, named).and_then(|()| {
        std::fs::rename(&tmp, path).map_err(|source| Error::Io { path: path.to_path_buf(), source })
    });
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// A file beside `path`, in its folder, with its extension (which decides the format).
fn temporary_beside(path: &Path) -> PathBuf {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = match path.extension() {
        Some(ext) => format!(".{name}.accel-{}.{}", std::process::id(), ext.to_string_lossy()),
        None => format!(".{name}.accel-{}", std::process::id()),
    };
    path.with_file_name(tmp)
}

impl Accelerator {
    /// The prepared model whose variables `vs` holds, if it was prepared.
    pub(crate) fn prepared_params(&self, vs: &VarStore) -> Option<Vec<Param>> {
        let first = vs.variables().into_values().next()?;
        // By identity: a released zero3 parameter has no data to compare, and refuses reads.
        let id = crate::shim::tensor_id(&first).ok()?;
        self.registry()
            .models
            .iter()
            .find(|params| {
                params.iter().any(|p| crate::shim::tensor_id(&p.tensor).ok() == Some(id))
            })
            .cloned()
    }

    /// tch's `vs.save(path)` for a prepared model: its whole weights written once, by the
    /// main process, to a temporary file beside `path` that is then renamed onto it, in the
    /// format tch picks from the extension (`.safetensors`, else libtorch's).
    ///
    /// Every process calls it, and every process returns once the file is in place — as
    /// Accelerate's `save_state` ends with `wait_for_everyone` — so that a `load` of `path`
    /// that follows, on any process, reads what was written (not a file of an earlier save).
    /// A failure to write is an error on every process. Where no process holds the model
    /// whole (zero3 units, tensor or pipeline parallelism) it is gathered first.
    pub fn save_varstore(&self, vs: &VarStore, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let written = if self.holds_whole(vs)? {
            if self.is_main_process() {
                let mut named: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
                named.sort_by(|a, b| a.0.cmp(&b.0));
                write_atomically(path, &named)
            } else {
                Ok(())
            }
        } else {
            let whole = self.full_state_dict(vs)?;
            if self.is_main_process() { write_atomically(path, &whole) } else { Ok(()) }
        };
        let Some(group) = self.process_group() else { return written };
        // Every process waits for the main one's outcome (the barrier) and shares it.
        let failed = written.as_ref().err().map(ToString::to_string);
        let outcome: Option<String> =
            group.broadcast_object(self.is_main_process().then_some(&failed), 0)?;
        match (written, outcome) {
            (Err(e), _) => Err(e),
            (Ok(()), Some(m)) => Err(Error::Checkpoint {
                path: Some(path.to_path_buf()),
                message: format!("the main process could not write it: {m}"),
            }),
            (Ok(()), None) => Ok(()),
        }
    }

    /// Whether this process holds every variable of `vs` whole, with its values: no tensor
    /// or pipeline split, no parameter released by zero3. The same answer on every process.
    fn holds_whole(&self, vs: &VarStore) -> Result<bool> {
        if self.inner.parallel.splits_model() {
            return Ok(false);
        }
        for tensor in vs.variables().values() {
            if tensor.numel() > 0 && crate::shim::storage_nbytes(tensor)? == 0 {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// tch's `vs.load(path)` for a prepared model: every process reads the file and sets
    /// its part of each variable (its shard under zero2/zero3, its slice under tensor
    /// parallelism), keeping the variable's dtype. A variable missing from the file is an
    /// error naming it, and then nothing is changed.
    pub fn load_varstore(&self, vs: &mut VarStore, path: impl AsRef<Path>) -> Result<()> {
        let missing = self.load_into(vs, path.as_ref())?;
        match missing.first() {
            None => Ok(()),
            Some(name) => Err(Error::Checkpoint {
                path: Some(path.as_ref().to_path_buf()),
                message: format!(
                    "it has no tensor `{name}` ({} of the model's variables are missing); \
                     nothing was loaded. Use `load_partial` to load what it has",
                    missing.len()
                ),
            }),
        }
    }

    /// tch's `vs.load_partial(path)` for a prepared model: as
    /// [`load_varstore`](Self::load_varstore), skipping the variables the file lacks, whose
    /// names it returns.
    pub fn load_varstore_partial(
        &self,
        vs: &mut VarStore,
        path: impl AsRef<Path>,
    ) -> Result<Vec<String>> {
        self.load_into_partial(vs, path.as_ref())
    }

    fn load_into(&self, vs: &VarStore, path: &Path) -> Result<Vec<String>> {
        let file = read_by_extension(path)?;
        let mut missing: Vec<String> =
            vs.variables().into_keys().filter(|n| !file.contains_key(n)).collect();
        missing.sort();
        if !missing.is_empty() {
            return Ok(missing);
        }
        self.apply(vs, path, &file)?;
        Ok(Vec::new())
    }

    fn load_into_partial(&self, vs: &VarStore, path: &Path) -> Result<Vec<String>> {
        let file = read_by_extension(path)?;
        let mut missing: Vec<String> =
            vs.variables().into_keys().filter(|n| !file.contains_key(n)).collect();
        missing.sort();
        self.apply(vs, path, &file)?;
        Ok(missing)
    }

    /// Sets every variable of `vs` that `file` holds.
    fn apply(&self, vs: &VarStore, path: &Path, file: &HashMap<String, Tensor>) -> Result<()> {
        let shape_error = |name: &str, want: &[i64], got: &[i64]| Error::Checkpoint {
            path: Some(path.to_path_buf()),
            message: format!("`{name}` has shape {got:?} there, the model's is {want:?}"),
        };
        let Some(params) = self.prepared_params(vs) else {
            // Not prepared: every process holds the whole model, as tch does it.
            return tch::no_grad(|| -> Result<()> {
                for (name, var) in vs.variables() {
                    let Some(src) = file.get(&name) else { continue };
                    if src.size() != var.size() {
                        return Err(shape_error(&name, &var.size(), &src.size()));
                    }
                    var.shallow_clone().f_copy_(src)?;
                }
                Ok(())
            });
        };
        for p in &params {
            let Some(src) = file.get(&p.name) else { continue };
            let want = self.inner.parallel.whole_shape(&p.tensor)?;
            if src.size() != want {
                return Err(shape_error(&p.name, &want, &src.size()));
            }
        }
        let strategy = &self.inner.strategy;
        for p in &params {
            let Some(src) = file.get(&p.name) else { continue };
            let mine = self.inner.parallel.cut(&p.tensor, src)?;
            strategy.load_parameter(p, &mine)?;
        }
        strategy.after_load()
    }

    /// tch's `vs.variables()`, refusing to hand out released storage: under zero3 the
    /// parameters of wrapped units hold no values between uses, and reading one would read
    /// memory that is not there. Panics, naming [`full_state_dict`](Self::full_state_dict)
    /// (a collective that gathers them), when a variable is released; otherwise the
    /// variables as tch returns them.
    pub fn variables(&self, vs: &VarStore) -> HashMap<String, Tensor> {
        let variables = vs.variables();
        let released: Vec<&String> = variables
            .iter()
            .filter(|(_, t)| {
                t.numel() > 0 && crate::shim::storage_nbytes(t).is_ok_and(|bytes| bytes == 0)
            })
            .map(|(name, _)| name)
            .collect();
        if let Some(first) = released.iter().min() {
            panic!(
                "accel: `vs.variables()` on rank {}: {} parameter(s) (`{first}` first) are \
                 released between uses under zero3 and hold no values here; call \
                 `accelerator.summon_full_params()?` on every process first (the model whole \
                 until training resumes), or call `accelerator.full_state_dict(&vs)?` on every \
                 process for whole copies",
                self.process_index(),
                released.len()
            );
        }
        variables
    }
}
