//! The on-disk format of a checkpoint folder: safetensors files and a JSON manifest that
//! records each file's size and CRC32, and where each tensor split across processes lives.
//! Writes go to a temporary folder renamed into place only when complete.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tch::{Device, Tensor};

use crate::accelerator::{DataPosition, StepCounters};
use crate::error::Result;
use crate::optim::SchedulerState;
use crate::precision::ScalerState;

use super::ranges::{FileReader, ReadCounter, checksums};
pub(crate) use super::ranges::{FileRecord, bad, io_error};

pub(crate) const FORMAT: &str = "accel-checkpoint";
pub(crate) const VERSION: u32 = 3;
/// The oldest format this version reads (2: one CRC32 per file, no block checksums).
const OLDEST_READ: u32 = 2;
pub(crate) const MANIFEST: &str = "manifest.json";

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct OptimizerRecord {
    pub name: String,
    pub groups: serde_json::Value,
    pub scheduler: Option<SchedulerState>,
    pub step_was_skipped: bool,
}

/// Where a tensor that is not in the model or optimizer files lives: in the shard file
/// (`shard_{rank}.safetensors`) of the process that held it whole, cut into chunks held by
/// several processes, or sliced along a dimension (tensor parallelism), each slice held in
/// one of those ways.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum SavedPiece {
    /// Whole, in rank `rank`'s shard file.
    Whole { rank: usize },
    /// Chunk i of the flattened, zero-padded whole of `numel` elements is in rank
    /// `ranks[i]`'s shard file.
    Chunks { numel: i64, ranks: Vec<usize> },
    /// Slice i along `dim` of a whole of `shape` is saved as `parts[i]` says.
    Slices { dim: usize, shape: Vec<i64>, parts: Vec<SavedPiece> },
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Manifest {
    pub format: String,
    pub version: u32,
    pub accel: String,
    pub world_size: usize,
    pub files: BTreeMap<String, FileRecord>,
    pub counters: StepCounters,
    pub scaler: Option<ScalerState>,
    pub models: usize,
    pub optimizers: Vec<OptimizerRecord>,
    pub loaders: Vec<DataPosition>,
    /// The positions of the loops `prepare_iter` dealt, by call site ("src/main.rs:40").
    #[serde(default)]
    pub loops: BTreeMap<String, DataPosition>,
    pub rng_devices: Vec<String>,
    /// The tensors of the shard files, by key (`model_{i}/{name}`, `optimizer_{j}/{key}`).
    #[serde(default)]
    pub pieces: BTreeMap<String, SavedPiece>,
    /// The shapes of the model variables saved in pieces (what `merge_weights` restores).
    #[serde(default)]
    pub shapes: BTreeMap<String, Vec<i64>>,
    /// The states registered with `register_for_checkpointing`, in order (the main
    /// process's).
    #[serde(default)]
    pub custom: Vec<serde_json::Value>,
}

pub(crate) fn model_file(i: usize) -> String {
    if i == 0 { "model.safetensors".into() } else { format!("model_{i}.safetensors") }
}
pub(crate) fn optimizer_file(i: usize) -> String {
    if i == 0 { "optimizer.safetensors".into() } else { format!("optimizer_{i}.safetensors") }
}
pub(crate) fn rng_file(rank: usize) -> String {
    format!("rng_state_{rank}.safetensors")
}
pub(crate) fn shard_file(rank: usize) -> String {
    format!("shard_{rank}.safetensors")
}

impl Manifest {
    /// Reads and checks `dir`'s manifest.
    pub fn read(dir: &Path) -> Result<Self> {
        let path = dir.join(MANIFEST);
        let text = std::fs::read_to_string(&path).map_err(|e| io_error(&path, e))?;
        let manifest: Manifest = serde_json::from_str(&text)
            .map_err(|e| bad(&path, format!("unreadable manifest: {e}")))?;
        if manifest.world_size == 0 || manifest.world_size > 1 << 20 {
            return Err(bad(
                &path,
                format!("world_size {} is not a number of processes", manifest.world_size),
            ));
        }
        if manifest.format != FORMAT || !(OLDEST_READ..=VERSION).contains(&manifest.version) {
            return Err(bad(
                &path,
                format!(
                    "format {} v{} is not {FORMAT} v{OLDEST_READ} to v{VERSION}",
                    manifest.format, manifest.version
                ),
            ));
        }
        Ok(manifest)
    }

    /// Writes the manifest into `dir`.
    pub fn write(&self, dir: &Path) -> Result<()> {
        let path = dir.join(MANIFEST);
        let text = serde_json::to_string_pretty(self).expect("the manifest serialises");
        std::fs::write(&path, text).map_err(|e| io_error(&path, e))?;
        sync(&path)
    }

    /// The tensors of file `name` of the checkpoint, checked against this manifest.
    pub fn read_file(&self, dir: &Path, name: &str) -> Result<BTreeMap<String, Tensor>> {
        let path = dir.join(name);
        let record = self.files.get(name).ok_or_else(|| bad(&path, "missing from the manifest"))?;
        let counter = ReadCounter::new(0);
        FileReader::open(&path, Some(record), &counter)?.read_all()
    }

    /// The tensors saved in pieces whose key `keep` accepts, put back together whole
    /// (chunks concatenated in order, flat, padding dropped; slices concatenated along their
    /// dimension, in the whole's shape).
    pub fn whole_pieces(
        &self,
        dir: &Path,
        keep: impl Fn(&str) -> bool,
    ) -> Result<BTreeMap<String, Tensor>> {
        let mut files: BTreeMap<usize, BTreeMap<String, Tensor>> = BTreeMap::new();
        let mut whole = BTreeMap::new();
        for (key, piece) in self.pieces.iter().filter(|(k, _)| keep(k)) {
            whole.insert(key.clone(), self.assemble(dir, key, piece, &mut files)?);
        }
        Ok(whole)
    }

    fn assemble(
        &self,
        dir: &Path,
        key: &str,
        piece: &SavedPiece,
        files: &mut BTreeMap<usize, BTreeMap<String, Tensor>>,
    ) -> Result<Tensor> {
        let mut part_of = |rank: usize| -> Result<Tensor> {
            if let std::collections::btree_map::Entry::Vacant(entry) = files.entry(rank) {
                entry.insert(self.read_file(dir, &shard_file(rank))?);
            }
            let part = files[&rank].get(key).ok_or_else(|| {
                bad(&dir.join(shard_file(rank)), format!("has no tensor `{key}`"))
            })?;
            Ok(part.shallow_clone())
        };
        match piece {
            SavedPiece::Whole { rank } => part_of(*rank),
            SavedPiece::Chunks { numel, ranks } => {
                let parts = ranks.iter().map(|&r| part_of(r)).collect::<Result<Vec<_>>>()?;
                let flat = Tensor::f_cat(&parts, 0)?;
                if (flat.numel() as i64) < *numel {
                    return Err(bad(
                        dir,
                        format!("the chunks of `{key}` hold fewer than its {numel} elements"),
                    ));
                }
                Ok(flat.f_narrow(0, 0, *numel)?)
            }
            SavedPiece::Slices { dim, shape, parts } => {
                let mut slice_shape = shape.clone();
                if *dim >= shape.len() || parts.is_empty() {
                    return Err(bad(
                        dir,
                        format!("`{key}`: slices of a malformed shape {shape:?}"),
                    ));
                }
                slice_shape[*dim] /= parts.len() as i64;
                let slices = parts
                    .iter()
                    .map(|p| {
                        Ok(self.assemble(dir, key, p, files)?.f_reshape(slice_shape.as_slice())?)
                    })
                    .collect::<Result<Vec<_>>>()?;
                Ok(Tensor::f_cat(&slices, *dim as i64)?)
            }
        }
    }
}

/// Writes named tensors (moved to CPU, made contiguous) as safetensors; returns its record.
pub(crate) fn write_tensors(path: &Path, tensors: &[(String, Tensor)]) -> Result<FileRecord> {
    let cpu: Vec<(String, Tensor)> = tensors
        .iter()
        .map(|(n, t)| Ok((n.clone(), t.f_to_device(Device::Cpu)?.f_contiguous()?)))
        .collect::<Result<_>>()?;
    Tensor::write_safetensors(&cpu, path).map_err(|e| bad(path, format!("cannot write: {e}")))?;
    sync(path)?;
    checksums(path)
}

/// Flushes a file's data, or a folder's entries, to the disk (fsync).
pub(crate) fn sync(path: &Path) -> Result<()> {
    std::fs::File::open(path).and_then(|f| f.sync_all()).map_err(|e| io_error(path, e))
}

/// The folder holding `dir` (`.` for a bare name).
fn parent_of(dir: &Path) -> &Path {
    match dir.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// Moves a finished temporary folder into place, keeping the old one until the new one is
/// there.
/// Every step is flushed to the disk, so that a crash leaves the old checkpoint, the new one,
/// or (between the two renames) the old one under `{dir}.old-{pid}`, which
/// [`recover_interrupted`] puts back.
pub(crate) fn publish(tmp: &Path, dir: &Path) -> Result<()> {
    let parent = parent_of(dir);
    sync(tmp)?;
    let old = old_path(dir, std::process::id())?;
    let replaced = dir.exists();
    if replaced {
        std::fs::rename(dir, &old).map_err(|e| io_error(dir, e))?;
        sync(parent)?;
    }
    std::fs::rename(tmp, dir).map_err(|e| io_error(dir, e))?;
    sync(parent)?;
    if replaced {
        std::fs::remove_dir_all(&old).map_err(|e| io_error(&old, e))?;
        sync(parent)?;
    }
    Ok(())
}

/// Where [`publish`] keeps the checkpoint it replaces: `{dir}.old-{pid}`.
fn old_path(dir: &Path, pid: u32) -> Result<PathBuf> {
    let name = dir.file_name().ok_or_else(|| bad(dir, "a checkpoint needs a folder name"))?;
    Ok(dir.with_file_name(format!("{}.old-{pid}", name.to_string_lossy())))
}

/// Puts back a checkpoint whose replacement was interrupted between [`publish`]'s two
/// renames (only `{dir}.old-{pid}` exists); returns what it did, for a warning.
pub(crate) fn recover_interrupted(dir: &Path) -> Result<Option<String>> {
    if dir.exists() {
        return Ok(None);
    }
    let Some(name) = dir.file_name().map(|n| format!("{}.old-", n.to_string_lossy())) else {
        return Ok(None);
    };
    let parent = parent_of(dir);
    let Ok(entries) = std::fs::read_dir(parent) else { return Ok(None) };
    let mut olds: Vec<(std::time::SystemTime, PathBuf)> = entries
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(&name))
        .filter_map(|e| Some((e.metadata().ok()?.modified().ok()?, e.path())))
        .collect();
    olds.sort();
    let Some((_, newest)) = olds.pop() else { return Ok(None) };
    // Another process of the run may have done it first.
    if std::fs::rename(&newest, dir).is_err() && !dir.exists() {
        return Err(bad(dir, format!("cannot restore it from {}", newest.display())));
    }
    sync(parent)?;
    Ok(Some(format!(
        "{} was being replaced when a run stopped: restored the previous checkpoint from {}",
        dir.display(),
        newest.display()
    )))
}

/// Held while a checkpoint folder is written: a second job writing the same folder gets an
/// error instead of clobbering it. A lock left by a process that no longer runs is taken
/// over. Removed when dropped.
#[derive(Debug)]
pub(crate) struct FolderLock {
    path: PathBuf,
}

impl FolderLock {
    pub(crate) fn acquire(dir: &Path) -> Result<Self> {
        let name = dir.file_name().ok_or_else(|| bad(dir, "a checkpoint needs a folder name"))?;
        let path = dir.with_file_name(format!(".{}.lock", name.to_string_lossy()));
        let parent = parent_of(dir);
        std::fs::create_dir_all(parent).map_err(|e| io_error(parent, e))?;
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        let me = format!("{} {}", std::process::id(), host.trim());
        for _ in 0..2 {
            match std::fs::OpenOptions::new().write(true).create_new(true).open(&path) {
                Ok(mut file) => {
                    use std::io::Write;
                    file.write_all(me.as_bytes()).map_err(|e| io_error(&path, e))?;
                    return Ok(Self { path });
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    let holder = std::fs::read_to_string(&path).unwrap_or_default();
                    let mut words = holder.split_whitespace();
                    let pid = words.next().and_then(|p| p.parse::<u32>().ok());
                    let same_host = words.next().unwrap_or("") == host.trim();
                    let alive = pid.is_some_and(|p| Path::new(&format!("/proc/{p}")).exists());
                    if same_host && !alive {
                        // Its writer is gone (a crash): take the lock over.
                        let _ = std::fs::remove_file(&path);
                        continue;
                    }
                    return Err(bad(
                        dir,
                        format!(
                            "another job (process {}) is writing this checkpoint folder (lock \
                             file {}): two runs must not share a checkpoint folder; if no other \
                             run is alive, delete the lock file",
                            holder.trim(),
                            path.display()
                        ),
                    ));
                }
                Err(e) => return Err(io_error(&path, e)),
            }
        }
        Err(bad(dir, format!("cannot take the lock {}", path.display())))
    }
}

impl Drop for FolderLock {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Where a checkpoint is written before it is published: per process (`.{name}.tmp-{pid}`),
/// or shared by the processes of a run (`.{name}.tmp`).
pub(crate) fn temporary_dir_path(dir: &Path, per_process: bool) -> Result<PathBuf> {
    let name = dir.file_name().ok_or_else(|| bad(dir, "a checkpoint needs a folder name"))?;
    let suffix = if per_process { format!("-{}", std::process::id()) } else { String::new() };
    Ok(dir.with_file_name(format!(".{}.tmp{suffix}", name.to_string_lossy())))
}

/// Creates the temporary folder afresh.
pub(crate) fn temporary_dir(dir: &Path, per_process: bool) -> Result<PathBuf> {
    let tmp = temporary_dir_path(dir, per_process)?;
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| io_error(&tmp, e))?;
    }
    std::fs::create_dir_all(&tmp).map_err(|e| io_error(&tmp, e))?;
    Ok(tmp)
}

/// The devices whose random generators a checkpoint keeps.
pub(crate) fn rng_devices() -> Vec<Device> {
    let mut devices = vec![Device::Cpu];
    if tch::Cuda::is_available() {
        devices.extend((0..tch::Cuda::device_count() as usize).map(Device::Cuda));
    }
    devices
}

pub(crate) fn device_name(device: Device) -> String {
    match device {
        Device::Cuda(i) => format!("cuda:{i}"),
        _ => "cpu".into(),
    }
}

/// `checkpoint_{i}` folders of `root`, oldest first.
pub(crate) fn numbered_checkpoints(root: &Path) -> Result<Vec<(u64, PathBuf)>> {
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

#[cfg(test)]
mod tests {
    use rand::{Rng, SeedableRng};
    use tch::{Device, Kind, Tensor};

    use super::super::ranges::{FileReader, ReadCounter};

    /// Property: a safetensors file with its header length, its JSON header (digits mostly:
    /// shapes and offsets) or its length mutated parses or is a named error — never a panic,
    /// never an allocation sized by a claim the bytes do not back.
    #[test]
    fn mutated_safetensors_headers_never_panic_or_overallocate() {
        let dir = std::env::temp_dir().join(format!("accel-st-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.safetensors");
        let tensors = [
            ("a.weight".to_string(), Tensor::arange(12, (Kind::Float, Device::Cpu)).view([3, 4])),
            ("b.bias".to_string(), Tensor::arange(5, (Kind::Int64, Device::Cpu))),
        ];
        Tensor::write_safetensors(&tensors, &path).unwrap();
        let original = std::fs::read(&path).unwrap();
        let header = u64::from_le_bytes(*original.first_chunk::<8>().unwrap()) as usize + 8;
        let counter = ReadCounter::new(0);
        let parse = |bytes: &[u8]| {
            std::fs::write(&path, bytes).unwrap();
            FileReader::open(&path, None, &counter).and_then(|mut r| r.read_all())
        };
        assert_eq!(parse(&original).unwrap().len(), 2);
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        let (mut parsed, mut refused) = (0, 0);
        for round in 0..3000 {
            let mut bytes = original.clone();
            match round % 4 {
                0 => bytes[..8].copy_from_slice(&rng.random::<u64>().to_le_bytes()),
                1 => bytes.truncate(rng.random_range(0..bytes.len())),
                _ => {
                    for _ in 0..rng.random_range(1..4) {
                        let at = rng.random_range(8..header);
                        bytes[at] = if bytes[at].is_ascii_digit() && rng.random_bool(0.8) {
                            b"0123456789"[rng.random_range(0..10)]
                        } else {
                            rng.random()
                        };
                    }
                }
            }
            let outcome = std::panic::catch_unwind(|| parse(&bytes));
            match outcome
                .unwrap_or_else(|_| panic!("panicked on {:?}", String::from_utf8_lossy(&bytes)))
            {
                Ok(tensors) => {
                    parsed += 1;
                    let data: usize =
                        tensors.values().map(|t| t.numel() * t.kind().elt_size_in_bytes()).sum();
                    assert!(
                        data <= bytes.len(),
                        "{data} bytes of tensors from a {}-byte file",
                        bytes.len()
                    );
                }
                Err(e) => {
                    refused += 1;
                    assert!(
                        e.to_string().contains("safetensors") || e.to_string().contains("tensor `"),
                        "{e}"
                    );
                }
            }
        }
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(parsed > 0 && refused > 1000, "parsed {parsed}, refused {refused}");
    }
}
