//! `save_state` / `load_state`: everything needed to continue a run bit-identically — the
//! model, optimizer state, schedule, loss scale, step counters, data positions and every
//! random generator — as safetensors files plus a JSON manifest; and `save_model`, the
//! weights alone, in shards of bounded size with an index (Hugging Face's layout).
//!
//! Writes go to a temporary folder that is renamed into place only when complete, so a
//! crash mid-save leaves the previous checkpoint intact. The manifest records each file's
//! size and CRC32, so a truncated or corrupted file is named on load rather than read.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tch::{Device, Tensor};

use crate::accelerator::{Accelerator, DataPosition, Slot, StepCounters};
use crate::error::{Error, Result};
use crate::optim::{OptimizerState, SchedulerState};
use crate::precision::ScalerState;
use crate::shim::{rng_state, set_rng_state};
use crate::strategy::fsdp::{ShardedModel, chunk_of};
use std::sync::Arc;

const FORMAT: &str = "accel-checkpoint";
const VERSION: u32 = 1;
const MANIFEST: &str = "manifest.json";

/// Size and checksum of one file of a checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
struct FileRecord {
    bytes: u64,
    crc32: u32,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct OptimizerRecord {
    name: String,
    groups: serde_json::Value,
    scheduler: Option<SchedulerState>,
    step_was_skipped: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Manifest {
    format: String,
    version: u32,
    accel: String,
    world_size: usize,
    files: BTreeMap<String, FileRecord>,
    counters: StepCounters,
    scaler: Option<ScalerState>,
    models: usize,
    optimizers: Vec<OptimizerRecord>,
    loaders: Vec<DataPosition>,
    rng_devices: Vec<String>,
    /// Tensors split across processes (zero1/2/3), in `shard_{rank}.safetensors`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    shards: Option<ShardRecord>,
}

/// Which tensors of the shard files are chunks of a flattened whole of `numel` elements
/// (zero2/zero3: one chunk per process, in rank order); the others are whole tensors that
/// one process owns (zero1's optimizer state).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct ShardRecord {
    numel: BTreeMap<String, i64>,
    /// How many shard files hold the chunks, in order (0: all; hybrid sharding saves the
    /// first machine's).
    #[serde(default)]
    chunks: usize,
    /// The shapes of the model's sharded parameters (what `merge_weights` restores).
    #[serde(default)]
    shapes: BTreeMap<String, Vec<i64>>,
}

/// A tensor of this process's shard file: its key, value, and whole size if it is a chunk.
type Piece = (String, Tensor, Option<i64>);

impl Manifest {
    /// Reads and checks `dir`'s manifest.
    fn read(dir: &Path) -> Result<Self> {
        let path = dir.join(MANIFEST);
        let text = std::fs::read_to_string(&path).map_err(|e| io_error(&path, e))?;
        let manifest: Manifest = serde_json::from_str(&text)
            .map_err(|e| bad(&path, format!("unreadable manifest: {e}")))?;
        if manifest.format != FORMAT || manifest.version != VERSION {
            return Err(bad(
                &path,
                format!(
                    "format {} v{} is not {FORMAT} v{VERSION}",
                    manifest.format, manifest.version
                ),
            ));
        }
        Ok(manifest)
    }

    /// The tensors of file `name` of the checkpoint, checked against this manifest.
    fn read_file(&self, dir: &Path, name: &str) -> Result<BTreeMap<String, Tensor>> {
        let path = dir.join(name);
        let record = self.files.get(name).ok_or_else(|| bad(&path, "missing from the manifest"))?;
        read_tensors(&path, record)
    }

    /// The tensors of the shard files whose key `keep` accepts, put back together: chunks
    /// concatenated in rank order (flat, padding dropped), whole tensors as they are.
    fn split_tensors(
        &self,
        dir: &Path,
        keep: impl Fn(&str) -> bool,
    ) -> Result<BTreeMap<String, Tensor>> {
        let Some(record) = &self.shards else { return Ok(BTreeMap::new()) };
        let chunks = if record.chunks == 0 { self.world_size } else { record.chunks };
        let mut parts: BTreeMap<String, Vec<Tensor>> = BTreeMap::new();
        for rank in 0..self.world_size {
            let name = shard_file(rank);
            // Processes with nothing to save wrote no file; chunk holders always do.
            if !self.files.contains_key(&name) && rank >= record.chunks {
                continue;
            }
            for (key, tensor) in self.read_file(dir, &name)? {
                if keep(&key) {
                    parts.entry(key).or_default().push(tensor);
                }
            }
        }
        let mut whole = BTreeMap::new();
        for (key, parts) in parts {
            let tensor = match record.numel.get(&key) {
                Some(&numel) if parts.len() == chunks => {
                    Tensor::f_cat(&parts, 0)?.f_narrow(0, 0, numel)?
                }
                Some(_) => {
                    return Err(bad(
                        dir,
                        format!("`{key}` is missing from some of the processes' shard files"),
                    ));
                }
                None => parts.into_iter().next().expect("one part at least"),
            };
            whole.insert(key, tensor);
        }
        Ok(whole)
    }
}

fn model_file(i: usize) -> String {
    if i == 0 { "model.safetensors".into() } else { format!("model_{i}.safetensors") }
}
fn optimizer_file(i: usize) -> String {
    if i == 0 { "optimizer.safetensors".into() } else { format!("optimizer_{i}.safetensors") }
}
fn rng_file(rank: usize) -> String {
    format!("rng_state_{rank}.safetensors")
}
fn shard_file(rank: usize) -> String {
    format!("shard_{rank}.safetensors")
}

/// The whole size of optimizer state tensor `key` (`{param}/{slot}`) when it is a chunk of a
/// zero2/zero3 master shard; `None` for scalars like `step` and for unsharded state.
fn chunk_numel(slot: &Slot, key: &str, tensor: &Tensor) -> Option<i64> {
    let sharded = slot.sharded.as_ref()?;
    let numel = *sharded.numel.get(key.rsplit_once('/')?.0)?;
    let world = sharded.group.size() as i64;
    let chunk = (numel + world - 1) / world;
    (tensor.dim() == 1 && tensor.size()[0] == chunk).then_some(numel)
}

fn io_error(path: &Path, source: std::io::Error) -> Error {
    Error::Io { path: path.to_path_buf(), source }
}

fn bad(path: &Path, message: impl Into<String>) -> Error {
    Error::Checkpoint { path: Some(path.to_path_buf()), message: message.into() }
}

/// Writes named tensors (moved to CPU, made contiguous) as safetensors; returns its record.
fn write_tensors(path: &Path, tensors: &[(String, Tensor)]) -> Result<FileRecord> {
    let cpu: Vec<(String, Tensor)> = tensors
        .iter()
        .map(|(n, t)| Ok((n.clone(), t.f_to_device(Device::Cpu)?.f_contiguous()?)))
        .collect::<Result<_>>()?;
    Tensor::write_safetensors(&cpu, path).map_err(|e| bad(path, format!("cannot write: {e}")))?;
    let bytes = std::fs::read(path).map_err(|e| io_error(path, e))?;
    Ok(FileRecord { bytes: bytes.len() as u64, crc32: crc32fast::hash(&bytes) })
}

/// Checks a file against its manifest record, then reads its tensors.
fn read_tensors(path: &Path, record: &FileRecord) -> Result<BTreeMap<String, Tensor>> {
    let bytes = std::fs::read(path).map_err(|e| io_error(path, e))?;
    if bytes.len() as u64 != record.bytes {
        return Err(bad(
            path,
            format!(
                "the file has {} bytes, the manifest says {}: it is truncated or was replaced",
                bytes.len(),
                record.bytes
            ),
        ));
    }
    if crc32fast::hash(&bytes) != record.crc32 {
        return Err(bad(path, "the file's CRC32 does not match the manifest: it is corrupted"));
    }
    let tensors = Tensor::read_safetensors(path)
        .map_err(|e| bad(path, format!("not a safetensors file: {e}")))?;
    Ok(tensors.into_iter().collect())
}

/// Moves a finished temporary folder into place, keeping the old one until the new one is
/// there.
fn publish(tmp: &Path, dir: &Path) -> Result<()> {
    let old = dir.with_extension(format!("old-{}", std::process::id()));
    let replaced = dir.exists();
    if replaced {
        std::fs::rename(dir, &old).map_err(|e| io_error(dir, e))?;
    }
    std::fs::rename(tmp, dir).map_err(|e| io_error(dir, e))?;
    if replaced {
        std::fs::remove_dir_all(&old).map_err(|e| io_error(&old, e))?;
    }
    Ok(())
}

/// Where a checkpoint is written before it is published: per process (`.{name}.tmp-{pid}`),
/// or shared by the processes of a run (`.{name}.tmp`).
fn temporary_dir_path(dir: &Path, per_process: bool) -> Result<PathBuf> {
    let name = dir.file_name().ok_or_else(|| bad(dir, "a checkpoint needs a folder name"))?;
    let suffix = if per_process { format!("-{}", std::process::id()) } else { String::new() };
    Ok(dir.with_file_name(format!(".{}.tmp{suffix}", name.to_string_lossy())))
}

/// Creates the temporary folder afresh.
fn temporary_dir(dir: &Path, per_process: bool) -> Result<PathBuf> {
    let tmp = temporary_dir_path(dir, per_process)?;
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| io_error(&tmp, e))?;
    }
    std::fs::create_dir_all(&tmp).map_err(|e| io_error(&tmp, e))?;
    Ok(tmp)
}

fn rng_devices() -> Vec<Device> {
    let mut devices = vec![Device::Cpu];
    if tch::Cuda::is_available() {
        devices.extend((0..tch::Cuda::device_count() as usize).map(Device::Cuda));
    }
    devices
}

fn device_name(device: Device) -> String {
    match device {
        Device::Cuda(i) => format!("cuda:{i}"),
        _ => "cpu".into(),
    }
}

impl Accelerator {
    /// Saves the whole training state into folder `dir` (created or replaced atomically).
    /// With several processes every process must call it: the main process writes the
    /// model, optimizer and manifest, each process its own random generator states, and
    /// the folder appears only once all are written.
    pub fn save_state(&self, dir: impl AsRef<Path>) -> Result<()> {
        let dir = dir.as_ref();
        let Some(group) = self.inner.group.clone() else {
            let tmp = temporary_dir(dir, true)?;
            let result = self
                .write_rng(&tmp)
                .and_then(|rng| self.write_state(&tmp, vec![rng], ShardRecord::default()));
            if let Err(e) = result {
                let _ = std::fs::remove_dir_all(&tmp);
                return Err(e);
            }
            return publish(&tmp, dir);
        };
        // Every rank learns the main process's outcome of each phase, so all return alike.
        let agree = |outcome: Result<()>| -> Result<()> {
            let message = outcome.as_ref().err().map(ToString::to_string);
            let shared: Option<String> =
                group.broadcast_object((group.rank() == 0).then_some(&message), 0)?;
            match (outcome, shared) {
                (Err(e), _) => Err(e),
                (Ok(()), Some(m)) => Err(bad(dir, format!("the main process failed to save: {m}"))),
                (Ok(()), None) => Ok(()),
            }
        };
        let tmp = temporary_dir_path(dir, false)?;
        agree(if self.is_main_process() { temporary_dir(dir, false).map(|_| ()) } else { Ok(()) })?;
        let pieces = self.own_pieces();
        let numel: BTreeMap<String, i64> = match &pieces {
            Ok(p) => p.iter().filter_map(|(k, _, n)| n.map(|n| (k.clone(), n))).collect(),
            Err(_) => BTreeMap::new(),
        };
        let mut shapes = BTreeMap::new();
        for (i, params) in self.registry().models.iter().enumerate() {
            for p in params {
                if numel.contains_key(&format!("model_{i}/{}", p.name)) {
                    shapes.insert(format!("model_{i}/{}", p.name), p.tensor.size());
                }
            }
        }
        let chunks = self.sharded_models().first().map_or(0, |m| m.group().size());
        let record = ShardRecord { numel, chunks, shapes };
        let mine = pieces
            .and_then(|pieces| {
                let mut files = vec![self.write_rng(&tmp)?];
                if !pieces.is_empty() {
                    let name = shard_file(self.process_index());
                    let tensors: Vec<(String, Tensor)> =
                        pieces.into_iter().map(|(k, t, _)| (k, t)).collect();
                    files.push((name.clone(), write_tensors(&tmp.join(&name), &tensors)?));
                }
                Ok(files.into_iter().map(|(name, r)| (name, r.bytes, r.crc32)).collect::<Vec<_>>())
            })
            .map_err(|e| e.to_string());
        let all = group.gather_objects(&mine, 0)?;
        let outcome = match all {
            Some(all) => (|| {
                let records = all
                    .into_iter()
                    .collect::<std::result::Result<Vec<_>, String>>()
                    .map_err(|e| {
                        bad(dir, format!("a process could not write its RNG state or shard: {e}"))
                    })?
                    .into_iter()
                    .flatten()
                    .map(|(name, bytes, crc32)| (name, FileRecord { bytes, crc32 }))
                    .collect();
                self.write_state(&tmp, records, record)?;
                publish(&tmp, dir)
            })(),
            None => Ok(()),
        };
        if outcome.is_err() && self.is_main_process() {
            let _ = std::fs::remove_dir_all(&tmp);
        }
        agree(outcome)
    }

    /// This process's random generator states, as `rng_state_{rank}.safetensors`.
    fn write_rng(&self, tmp: &Path) -> Result<(String, FileRecord)> {
        let rng: Vec<(String, Tensor)> = rng_devices()
            .iter()
            .map(|&d| Ok((device_name(d), rng_state(d)?)))
            .collect::<Result<_>>()?;
        let name = rng_file(self.process_index());
        let record = write_tensors(&tmp.join(&name), &rng)?;
        Ok((name, record))
    }

    /// The master shard of `param` when it is sharded (zero2/zero3).
    fn master_of(&self, param: &Tensor) -> Result<Option<Tensor>> {
        Ok(self.sharded_model_of(param)?.map(|(_, master)| master))
    }

    /// The sharded model `param` belongs to, and its master shard.
    fn sharded_model_of(&self, param: &Tensor) -> Result<Option<(Arc<ShardedModel>, Tensor)>> {
        let id = crate::shim::tensor_id(param)?;
        Ok(self.sharded_models().iter().find_map(|m| m.master_of(id).map(|t| (m.clone(), t))))
    }

    /// What this process alone holds: its master shards and optimizer state chunks
    /// (zero2/zero3), the optimizer state of the parameters it owns (zero1).
    fn own_pieces(&self) -> Result<Vec<Piece>> {
        let mut pieces = Vec::new();
        let registry = self.registry();
        for (i, params) in registry.models.iter().enumerate() {
            for p in params {
                if let Some((model, master)) = self.sharded_model_of(&p.tensor)? {
                    if model.writes_shards() {
                        let key = format!("model_{i}/{}", p.name);
                        pieces.push((key, master.f_detach()?, Some(p.tensor.numel() as i64)));
                    }
                }
            }
        }
        for (j, optimizer) in registry.optimizers.iter().enumerate() {
            let slot = optimizer.slot.lock().unwrap_or_else(|e| e.into_inner());
            let copies = slot.sharded.as_ref().is_some_and(|s| !s.models[0].writes_shards());
            if (!slot.zero1() && slot.sharded.is_none()) || copies {
                continue;
            }
            for (key, tensor) in slot.optimizer.state()?.tensors {
                let numel = chunk_numel(&slot, &key, &tensor);
                if numel.is_some() || slot.zero1() {
                    pieces.push((format!("optimizer_{j}/{key}"), tensor, numel));
                }
            }
        }
        Ok(pieces)
    }

    /// Model, optimizers and the manifest (the main process's part); `record` describes
    /// the chunked tensors of the shard files.
    fn write_state(
        &self,
        tmp: &Path,
        own_files: Vec<(String, FileRecord)>,
        record: ShardRecord,
    ) -> Result<()> {
        let registry = self.registry();
        let sharded = own_files.iter().any(|(name, _)| name.starts_with("shard_"));
        let mut files: BTreeMap<String, FileRecord> = own_files.into_iter().collect();
        for (i, params) in registry.models.iter().enumerate() {
            let mut tensors: Vec<(String, Tensor)> = Vec::new();
            for p in params {
                // Sharded parameters are in the shard files (and under zero3 have no
                // memory here to read).
                if self.master_of(&p.tensor)?.is_none() {
                    tensors.push((p.name.clone(), p.tensor.detach()));
                }
            }
            files.insert(model_file(i), write_tensors(&tmp.join(model_file(i)), &tensors)?);
        }
        let mut optimizers = Vec::new();
        for (i, optimizer) in registry.optimizers.iter().enumerate() {
            let slot = optimizer.slot.lock().unwrap_or_else(|e| e.into_inner());
            let state = slot.optimizer.state()?;
            let tensors: Vec<(String, Tensor)> = state
                .tensors
                .into_iter()
                .filter(|(k, t)| !slot.zero1() && chunk_numel(&slot, k, t).is_none())
                .collect();
            files.insert(optimizer_file(i), write_tensors(&tmp.join(optimizer_file(i)), &tensors)?);
            optimizers.push(OptimizerRecord {
                name: slot.optimizer.name().to_owned(),
                groups: state.groups,
                scheduler: slot.scheduler.as_ref().map(|s| s.state().clone()),
                step_was_skipped: slot.step_was_skipped,
            });
        }
        let devices = rng_devices();
        let manifest = Manifest {
            format: FORMAT.into(),
            version: VERSION,
            accel: crate::VERSION.into(),
            world_size: self.num_processes(),
            files,
            counters: self.counters(),
            scaler: self
                .inner
                .scaler
                .as_ref()
                .map(|s| s.lock().unwrap_or_else(|e| e.into_inner()).state()),
            models: registry.models.len(),
            optimizers,
            loaders: registry
                .loaders
                .iter()
                .map(|p| *p.lock().unwrap_or_else(|e| e.into_inner()))
                .collect(),
            rng_devices: devices.into_iter().map(device_name).collect(),
            shards: sharded.then_some(record),
        };
        let path = tmp.join(MANIFEST);
        let text = serde_json::to_string_pretty(&manifest).expect("the manifest serialises");
        std::fs::write(&path, text).map_err(|e| io_error(&path, e))
    }

    /// Restores a state saved by [`save_state`](Self::save_state) into the prepared model,
    /// optimizers, schedules, scaler, loaders and generators. Nothing is changed unless
    /// every file checks out against the manifest and the prepared objects.
    pub fn load_state(&self, dir: impl AsRef<Path>) -> Result<()> {
        let dir = dir.as_ref();
        let manifest = Manifest::read(dir)?;
        let registry = self.registry();
        let expect = |what: &str, saved: usize, here: usize| -> Result<()> {
            if saved == here {
                Ok(())
            } else {
                Err(bad(
                    dir,
                    format!(
                        "it holds {saved} {what}, this run prepared {here}; prepare the same objects before load_state"
                    ),
                ))
            }
        };
        expect("models", manifest.models, registry.models.len())?;
        expect("optimizers", manifest.optimizers.len(), registry.optimizers.len())?;
        expect("data loaders", manifest.loaders.len(), registry.loaders.len())?;
        if manifest.scaler.is_some() != self.inner.scaler.is_some() {
            return Err(bad(
                dir,
                "it was saved with another precision (fp16 loss scaler present in one of the two)",
            ));
        }
        let file = |name: String| -> Result<(PathBuf, BTreeMap<String, Tensor>)> {
            Ok((dir.join(&name), manifest.read_file(dir, &name)?))
        };

        // Read and check everything before changing anything. Tensors split across the
        // processes that saved them are put back together whole first (any world size can
        // then take its own share).
        let mut split = manifest.split_tensors(dir, |_| true)?;
        let mut models = Vec::new();
        for (i, params) in registry.models.iter().enumerate() {
            let (path, mut tensors) = file(model_file(i))?;
            for p in params {
                if let Some(whole) = split.remove(&format!("model_{i}/{}", p.name)) {
                    if whole.numel() != p.tensor.numel() {
                        return Err(bad(
                            dir,
                            format!(
                                "sharded tensor `{}` has {} elements, the model's has {}",
                                p.name,
                                whole.numel(),
                                p.tensor.numel()
                            ),
                        ));
                    }
                    tensors.insert(p.name.clone(), whole.f_view(p.tensor.size().as_slice())?);
                }
                let saved = tensors.get(&p.name).ok_or_else(|| {
                    bad(&path, format!("has no tensor `{}`, which the model has", p.name))
                })?;
                if saved.size() != p.tensor.size() || saved.kind() != p.tensor.kind() {
                    return Err(bad(
                        &path,
                        format!(
                            "tensor `{}` is {:?} {:?}, the model's is {:?} {:?}",
                            p.name,
                            saved.kind(),
                            saved.size(),
                            p.tensor.kind(),
                            p.tensor.size()
                        ),
                    ));
                }
            }
            if let Some(extra) = tensors.keys().find(|k| params.iter().all(|p| &p.name != *k)) {
                return Err(bad(
                    &path,
                    format!("holds tensor `{extra}`, which the model does not have"),
                ));
            }
            models.push(tensors);
        }
        let mut optimizer_states = Vec::new();
        for (i, (record, optimizer)) in
            manifest.optimizers.iter().zip(&registry.optimizers).enumerate()
        {
            let (path, mut tensors) = file(optimizer_file(i))?;
            let prefix = format!("optimizer_{i}/");
            let keys: Vec<String> =
                split.keys().filter(|k| k.starts_with(&prefix)).cloned().collect();
            for key in keys {
                let whole = split.remove(&key).expect("listed above");
                tensors.insert(key[prefix.len()..].to_string(), whole);
            }
            let slot = optimizer.slot.lock().unwrap_or_else(|e| e.into_inner());
            // Whole state tensors take the shape this run's optimizer has for them: this
            // process's chunk (zero2/zero3) or the parameter's shape.
            let shapes: BTreeMap<String, Tensor> =
                slot.optimizer.param_names().into_iter().zip(slot.optimizer.params()).collect();
            for (key, tensor) in tensors.iter_mut() {
                let Some(target) = key.rsplit_once('/').and_then(|(p, _)| shapes.get(p)) else {
                    continue;
                };
                let numel = slot.sharded.as_ref().and_then(|s| {
                    s.numel.get(key.rsplit_once('/').map_or("", |(p, _)| p)).copied()
                });
                if tensor.dim() == 0 {
                    continue;
                }
                match numel {
                    Some(n) if tensor.numel() as i64 == n => {
                        let group = &slot.sharded.as_ref().expect("numel came from it").group;
                        *tensor = chunk_of(tensor, group.rank(), group.size())?;
                    }
                    _ if tensor.numel() == target.numel() && tensor.size() != target.size() => {
                        *tensor = tensor.f_reshape(target.size().as_slice())?;
                    }
                    _ => {}
                }
            }
            if slot.optimizer.name() != record.name {
                return Err(bad(
                    &path,
                    format!(
                        "holds {} state, the optimizer is {}",
                        record.name,
                        slot.optimizer.name()
                    ),
                ));
            }
            if slot.scheduler.is_some() != record.scheduler.is_some() {
                return Err(bad(
                    &path,
                    "a learning-rate schedule is set in only one of the saved and the current run",
                ));
            }
            optimizer_states
                .push((path, OptimizerState { tensors, groups: record.groups.clone() }));
        }
        // A process the saving run did not have keeps its own generators (the run can
        // continue, but no longer bit-identically: the data order per process changed anyway).
        let rng = if self.process_index() < manifest.world_size {
            file(rng_file(self.process_index()))?.1
        } else {
            BTreeMap::new()
        };
        if manifest.world_size != self.num_processes() {
            self.print(format!(
                "accel: {} was saved by {} process(es), this run has {}: sharded state is \
                 resharded; random generators are restored for the first {} process(es) only",
                dir.display(),
                manifest.world_size,
                self.num_processes(),
                manifest.world_size.min(self.num_processes())
            ));
        }

        // Apply.
        tch::no_grad(|| -> Result<()> {
            for (params, tensors) in registry.models.iter().zip(&models) {
                for p in params {
                    match self.sharded_model_of(&p.tensor)? {
                        Some((model, master)) => {
                            let group = model.group();
                            let mine = chunk_of(&tensors[&p.name], group.rank(), group.size())?;
                            master.shallow_clone().f_copy_(&mine)?;
                        }
                        None => {
                            p.tensor.shallow_clone().f_copy_(&tensors[&p.name])?;
                        }
                    }
                }
            }
            Ok(())
        })?;
        // The whole parameters follow their new master shards.
        for model in self.sharded_models().clone() {
            model.after_step()?;
        }
        for ((optimizer, record), (path, state)) in
            registry.optimizers.iter().zip(&manifest.optimizers).zip(&optimizer_states)
        {
            let mut slot = optimizer.slot.lock().unwrap_or_else(|e| e.into_inner());
            slot.optimizer.load_state(state).map_err(|e| match e {
                Error::Checkpoint { message, .. } => bad(path, message),
                other => other,
            })?;
            let slot = &mut *slot;
            if let (Some(s), Some(saved)) = (slot.scheduler.as_mut(), &record.scheduler) {
                s.load_state(saved.clone(), slot.optimizer.as_mut())?;
            }
            slot.step_was_skipped = record.step_was_skipped;
        }
        if let (Some(scaler), Some(saved)) = (&self.inner.scaler, manifest.scaler) {
            scaler.lock().unwrap_or_else(|e| e.into_inner()).load_state(saved)?;
        }
        for (position, saved) in registry.loaders.iter().zip(&manifest.loaders) {
            *position.lock().unwrap_or_else(|e| e.into_inner()) = *saved;
        }
        for name in &manifest.rng_devices {
            let device = match name.strip_prefix("cuda:").and_then(|i| i.parse().ok()) {
                Some(i) if tch::Cuda::is_available() => Device::Cuda(i),
                Some(_) => continue,
                None => Device::Cpu,
            };
            if let Some(state) = rng.get(name) {
                set_rng_state(device, state)?;
            }
        }
        self.inner.state.restore(manifest.counters);
        Ok(())
    }

    /// Saves the state into the next `checkpoint_{i}` folder of the directory given to
    /// [`crate::AcceleratorBuilder::checkpoints`], then removes the oldest beyond the limit.
    /// Returns the new folder.
    pub fn save_checkpoint(&self) -> Result<PathBuf> {
        let root = self.checkpoint_dir().ok_or_else(|| {
            Error::Config(
                "save_checkpoint needs AcceleratorBuilder::checkpoints(dir, limit)".into(),
            )
        })?;
        std::fs::create_dir_all(root).map_err(|e| io_error(root, e))?;
        let existing = numbered_checkpoints(root)?;
        let mut next = existing.last().map_or(0, |(i, _)| i + 1);
        if let Some(group) = &self.inner.group {
            // The main process's count decides, so every process writes the same folder.
            next = group.broadcast_object(self.is_main_process().then_some(&next), 0)?;
        }
        let dir = root.join(format!("checkpoint_{next}"));
        self.save_state(&dir)?;
        if let (Some(limit), true) = (self.inner.checkpoint_limit, self.is_main_process()) {
            let all = numbered_checkpoints(root)?;
            for (_, old) in all.iter().take(all.len().saturating_sub(limit.max(1))) {
                std::fs::remove_dir_all(old).map_err(|e| io_error(old, e))?;
            }
        }
        Ok(dir)
    }

    /// Loads the newest `checkpoint_{i}` of the checkpoint directory; returns it, or `None`
    /// when there is none yet (a fresh run).
    pub fn load_latest_checkpoint(&self) -> Result<Option<PathBuf>> {
        let Some(root) = self.checkpoint_dir() else { return Ok(None) };
        if !root.exists() {
            return Ok(None);
        }
        match numbered_checkpoints(root)?.pop() {
            Some((_, dir)) => {
                self.load_state(&dir)?;
                Ok(Some(dir))
            }
            None => Ok(None),
        }
    }

    /// Writes the model's weights to `dir` as `model.safetensors`, or, when they exceed
    /// `max_shard_bytes`, as `model-0000i-of-0000n.safetensors` plus
    /// `model.safetensors.index.json` (Hugging Face's layout). Main process only.
    pub fn save_model(
        &self,
        vs: &tch::nn::VarStore,
        dir: impl AsRef<Path>,
        max_shard_bytes: u64,
    ) -> Result<()> {
        if !self.is_main_process() {
            return Ok(());
        }
        let dir = dir.as_ref();
        let mut variables: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
        variables.sort_by(|a, b| a.0.cmp(&b.0));
        let mut shards: Vec<Vec<(String, Tensor)>> = vec![Vec::new()];
        let mut shard_bytes = 0u64;
        for (name, tensor) in variables {
            let bytes = (tensor.numel() * tensor.kind().elt_size_in_bytes()) as u64;
            if shard_bytes > 0 && shard_bytes + bytes > max_shard_bytes {
                shards.push(Vec::new());
                shard_bytes = 0;
            }
            shard_bytes += bytes;
            shards.last_mut().expect("one shard at least").push((name, tensor.detach()));
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

/// `checkpoint_{i}` folders of `root`, oldest first.
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
    let shapes = manifest.shards.as_ref().map(|r| &r.shapes);
    for (key, whole) in manifest.split_tensors(dir, |key| key.starts_with(&prefix))? {
        let shape = shapes
            .and_then(|shapes| shapes.get(&key))
            .ok_or_else(|| bad(dir, format!("the manifest lacks the size of `{key}`")))?;
        weights.insert(key[prefix.len()..].to_string(), whole.f_reshape(shape.as_slice())?);
    }
    Ok(weights.into_iter().collect())
}

fn numbered_checkpoints(root: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(root).map_err(|e| io_error(root, e))? {
        let entry = entry.map_err(|e| io_error(root, e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if let Some(i) = name.strip_prefix("checkpoint_").and_then(|i| i.parse().ok()) {
            found.push((i, entry.path()));
        }
    }
    found.sort();
    Ok(found)
}
