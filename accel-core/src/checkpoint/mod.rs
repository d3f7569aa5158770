//! `save_state` / `load_state`: everything needed to continue a run bit-identically — the
//! model, optimizer state, schedule, loss scale, step counters, data positions and every
//! random generator — as safetensors files plus a JSON manifest (format.rs); `save_model`
//! and `merge_weights` (model.rs).
//!
//! What each process holds of each tensor comes from the strategy (a
//! [`Placement`](crate::strategy::Placement)): replicated tensors go to the model and
//! optimizer files, written by the main process; tensors a process holds alone or in chunks
//! go to its shard file, and the manifest says where each piece is. Loading (load.rs) reads
//! in each process only the elements the loading run's strategy places there, from wherever
//! the saving run put them (ranges.rs reads and checks byte ranges), so a checkpoint loads
//! into any number of processes and any strategy without any process holding the whole.
//! Nothing here branches on which strategy saved or loads.

mod format;
mod hf;
mod load;
mod model;
mod ranges;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tch::Tensor;

use crate::accelerator::Accelerator;
use crate::error::{Error, Result};
use crate::shim::rng_state;
use crate::strategy::Placement;
use crate::sync::Locked;
use format::{
    FileRecord, FolderLock, Manifest, OptimizerRecord, SavedPiece, bad, device_name, io_error,
    model_file, numbered_checkpoints, optimizer_file, publish, rng_devices, rng_file, shard_file,
    temporary_dir, temporary_dir_path, write_tensors,
};
pub use hf::HfCheckpoint;
pub use model::merge_weights;

/// What one process saved of a tensor in its shard file.
#[derive(Debug, Clone, Serialize, Deserialize)]
enum PieceReport {
    Whole,
    Chunk { index: usize, count: usize, numel: i64 },
    Slice { dim: usize, index: usize, count: usize, shape: Vec<i64>, inner: Box<PieceReport> },
}

impl PieceReport {
    /// What to report of a piece placed so, if this process saves it.
    fn of(placement: &Placement) -> Option<Self> {
        Some(match placement {
            Placement::Replicated => return None,
            Placement::Whole { write } | Placement::Chunk { write, .. } if !write => return None,
            Placement::Whole { .. } => PieceReport::Whole,
            Placement::Chunk { index, count, numel, .. } => {
                PieceReport::Chunk { index: *index, count: *count, numel: *numel }
            }
            Placement::Slice { dim, index, count, shape, inner } => PieceReport::Slice {
                dim: *dim,
                index: *index,
                count: *count,
                shape: shape.clone(),
                inner: Box::new(Self::of(inner)?),
            },
        })
    }
}

/// A tensor's pieces as the processes report them, becoming its [`SavedPiece`].
enum Collected {
    Whole(usize),
    Chunks(i64, Vec<Option<usize>>),
    Slices(usize, Vec<i64>, Vec<Option<Collected>>),
}

impl Collected {
    fn add(slot: &mut Option<Collected>, rank: usize, report: PieceReport) {
        match report {
            PieceReport::Whole => *slot = Some(Collected::Whole(rank)),
            PieceReport::Chunk { index, count, numel } => {
                let entry = slot.get_or_insert_with(|| Collected::Chunks(numel, vec![None; count]));
                if let Collected::Chunks(_, ranks) = entry {
                    if let Some(r) = ranks.get_mut(index) {
                        *r = Some(rank);
                    }
                }
            }
            PieceReport::Slice { dim, index, count, shape, inner } => {
                let entry = slot.get_or_insert_with(|| {
                    Collected::Slices(dim, shape, (0..count).map(|_| None).collect())
                });
                if let Collected::Slices(_, _, parts) = entry {
                    if let Some(part) = parts.get_mut(index) {
                        Self::add(part, rank, *inner);
                    }
                }
            }
        }
    }

    fn finish(self) -> Option<SavedPiece> {
        Some(match self {
            Collected::Whole(rank) => SavedPiece::Whole { rank },
            Collected::Chunks(numel, ranks) => {
                SavedPiece::Chunks { numel, ranks: ranks.into_iter().collect::<Option<_>>()? }
            }
            Collected::Slices(dim, shape, parts) => SavedPiece::Slices {
                dim,
                shape,
                parts: parts.into_iter().map(|p| p?.finish()).collect::<Option<_>>()?,
            },
        })
    }
}

/// This process's part of a checkpoint: the tensors of its shard file (and what each is),
/// and the replicated tensors the main process writes to the model and optimizer files.
struct Part {
    shard: Vec<(String, Tensor)>,
    reports: Vec<(String, PieceReport)>,
    models: Vec<Vec<(String, Tensor)>>,
    optimizers: Vec<Vec<(String, Tensor)>>,
    shapes: BTreeMap<String, Vec<i64>>,
}

/// Files a process wrote, and the pieces in its shard file (what the main process gathers).
type Written = (Vec<(String, FileRecord)>, Vec<(String, PieceReport)>);

impl Accelerator {
    /// Sorts every tensor of the training state by where it goes.
    fn part(&self) -> Result<Part> {
        let registry = self.registry();
        let strategy = self.strategy();
        let mut part = Part {
            shard: Vec::new(),
            reports: Vec::new(),
            models: Vec::new(),
            optimizers: Vec::new(),
            shapes: BTreeMap::new(),
        };
        let place = |part: &mut Part, key: String, tensor: Tensor, placement: Placement| {
            if placement == Placement::Replicated {
                return Some(tensor);
            }
            if let Some(report) = PieceReport::of(&placement) {
                part.shard.push((key.clone(), tensor));
                part.reports.push((key, report));
            }
            None
        };
        let full = self.inner.config.state_dict == crate::config::StateDict::Full;
        for (i, params) in registry.models.iter().enumerate() {
            if full {
                // FSDP's FULL_STATE_DICT: gathered (a collective), written whole by the main
                // process in the model file.
                part.models.push(self.full_state_of(params.clone())?);
                continue;
            }
            let mut whole = Vec::new();
            for p in params {
                let (tensor, placement) = strategy.parameter(p)?;
                let placement = self.inner.parallel.placement(&p.tensor, placement)?;
                let key = format!("model_{i}/{}", p.name);
                if placement != Placement::Replicated {
                    part.shapes.insert(key.clone(), self.inner.parallel.whole_shape(&p.tensor)?);
                }
                if let Some(t) = place(&mut part, key, tensor, placement) {
                    whole.push((p.name.clone(), t));
                }
            }
            part.models.push(whole);
        }
        for (j, optimizer) in registry.optimizers.iter().enumerate() {
            let slot = optimizer.slot.locked();
            let params = slot.named_trainable();
            let mut whole = Vec::new();
            for (key, tensor) in slot.optimizer.state()?.tensors {
                let placement = slot.plan().state_placement(&key, &tensor);
                let param = key.rsplit_once('/').and_then(|(p, _)| params.get(p));
                let placement = match param {
                    Some(param) if tensor.dim() > 0 => {
                        self.inner.parallel.placement(param, placement)?
                    }
                    _ => self.inner.parallel.placement_unsplit(placement),
                };
                if let Some(t) = place(&mut part, format!("optimizer_{j}/{key}"), tensor, placement)
                {
                    whole.push((key, t));
                }
            }
            part.optimizers.push(whole);
        }
        Ok(part)
    }

    /// Refuses a folder that the machines of the run do not share: the main process writes
    /// a probe into `dir`, every process looks for it. A checkpoint is written by several
    /// processes into one folder that the main process creates, so on a disk local to each
    /// machine the first save would fail after training had begun. A collective; checked
    /// once per folder, and only when the run spans machines.
    pub(crate) fn refuse_unshared(&self, dir: &Path, what: &str) -> Result<()> {
        let Some(group) = self.process_group().cloned() else { return Ok(()) };
        if self.inner.process.num_nodes() <= 1 {
            return Ok(());
        }
        {
            let checked = self.inner.shared_dirs.locked();
            if checked.iter().any(|d| d == dir) {
                return Ok(());
            }
        }
        // Rank 0's probe holds a fresh token (so that another run's leftover does not count);
        // its outcome and the token reach every rank in one broadcast.
        let made = (group.rank() == 0).then(|| {
            let token = crate::comm::auth::Token::generate().map_err(|e| e.to_string())?;
            std::fs::create_dir_all(dir)
                .and_then(|_| std::fs::write(dir.join(format!(".accel-shared-{token}")), &token))
                .map_err(|e| io_error(dir, e).to_string())?;
            Ok(token)
        });
        let made: std::result::Result<String, String> = group.broadcast_object(made.as_ref(), 0)?;
        let token =
            made.map_err(|e| bad(dir, format!("the main process cannot write the {what}: {e}")))?;
        let probe = dir.join(format!(".accel-shared-{token}"));
        let seen = std::fs::read_to_string(&probe).is_ok_and(|t| t == token);
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_owned())
            .unwrap_or_default();
        let all = group.gather_objects(&(seen, host), 0)?;
        let verdict: Option<Option<String>> = all.map(|all| {
            let _ = std::fs::remove_file(&probe);
            let blind: Vec<String> = all
                .iter()
                .enumerate()
                .filter(|(_, (seen, _))| !seen)
                .map(|(rank, (_, host))| format!("rank {rank} on {host}"))
                .collect();
            (!blind.is_empty()).then(|| blind.join(", "))
        });
        let verdict: Option<String> =
            group.broadcast_object((group.rank() == 0).then_some(&verdict.flatten()), 0)?;
        if let Some(blind) = verdict {
            return Err(bad(
                dir,
                format!(
                    "the {what} is not shared by the machines of this run: {blind} cannot see \
                     what rank 0 writes there (a disk local to each machine?). Every process \
                     writes into one checkpoint folder; put it on a file system that every \
                     machine mounts (NFS, Lustre, ...)"
                ),
            ));
        }
        self.inner.shared_dirs.locked().push(dir.to_path_buf());
        Ok(())
    }

    /// Saves the whole training state into folder `dir` (created or replaced atomically).
    /// With several processes every process must call it: the main process writes the
    /// model, optimizer and manifest, each process its random generator states and what it
    /// alone holds, and the folder appears only once all are written.
    pub fn save_state(&self, dir: impl AsRef<Path>) -> Result<()> {
        let dir = dir.as_ref();
        let Some(group) = self.process_group().cloned() else {
            let _lock = FolderLock::acquire(dir)?;
            let tmp = temporary_dir(dir, true)?;
            let result = self.part().and_then(|part| {
                let written = self.write_own(&tmp, &part)?;
                self.write_main(&tmp, part, vec![written])
            });
            if let Err(e) = result {
                let _ = std::fs::remove_dir_all(&tmp);
                return Err(e);
            }
            return publish(&tmp, dir);
        };
        if let Some(parent) = dir.parent() {
            let parent = if parent.as_os_str().is_empty() { Path::new(".") } else { parent };
            self.refuse_unshared(parent, "checkpoint folder")?;
        }
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
        // The main process holds the folder's lock until the checkpoint is published.
        let mut lock = None;
        agree(if self.is_main_process() {
            FolderLock::acquire(dir).and_then(|l| {
                lock = Some(l);
                temporary_dir(dir, false).map(|_| ())
            })
        } else {
            Ok(())
        })?;
        let part = self.part();
        let mine = part
            .as_ref()
            .map_err(ToString::to_string)
            .and_then(|part| self.write_own(&tmp, part).map_err(|e| e.to_string()));
        crate::fault::point("save-own-files-written", self.process_index());
        let all = group.gather_objects(&mine, 0)?;
        let outcome = match (all, part) {
            (Some(all), Ok(part)) => (|| {
                let written = all.into_iter().collect::<std::result::Result<Vec<_>, String>>();
                let written = written.map_err(|e| {
                    bad(dir, format!("a process could not write its RNG state or shard: {e}"))
                })?;
                self.write_main(&tmp, part, written)?;
                crate::fault::point("save-before-publish", self.process_index());
                publish(&tmp, dir)
            })(),
            (Some(_), Err(e)) => Err(e),
            (None, _) => Ok(()),
        };
        if outcome.is_err() && self.is_main_process() {
            let _ = std::fs::remove_dir_all(&tmp);
        }
        agree(outcome)
    }

    /// This process's files: its random generator states and its shard file.
    fn write_own(&self, tmp: &Path, part: &Part) -> Result<Written> {
        let rng: Vec<(String, Tensor)> = rng_devices()
            .iter()
            .map(|&d| Ok((device_name(d), rng_state(d)?)))
            .collect::<Result<_>>()?;
        let name = rng_file(self.process_index());
        let record = write_tensors(&tmp.join(&name), &rng)?;
        let mut files = vec![(name, record)];
        if !part.shard.is_empty() {
            let name = shard_file(self.process_index());
            let record = write_tensors(&tmp.join(&name), &part.shard)?;
            files.push((name, record));
        }
        Ok((files, part.reports.clone()))
    }

    /// The main process's files: models, optimizers (their replicated tensors) and the
    /// manifest, which records every process's files and pieces (`written`, in rank order).
    fn write_main(&self, tmp: &Path, part: Part, written: Vec<Written>) -> Result<()> {
        let mut files: BTreeMap<String, FileRecord> = BTreeMap::new();
        let mut collected: BTreeMap<String, Option<Collected>> = BTreeMap::new();
        for (rank, (own_files, reports)) in written.into_iter().enumerate() {
            for (name, record) in own_files {
                files.insert(name, record);
            }
            for (key, report) in reports {
                Collected::add(collected.entry(key).or_default(), rank, report);
            }
        }
        let mut pieces = BTreeMap::new();
        for (key, piece) in collected {
            let piece = piece.and_then(Collected::finish).ok_or_else(|| {
                bad(tmp, format!("some parts of `{key}` were saved by no process"))
            })?;
            pieces.insert(key, piece);
        }
        for (i, tensors) in part.models.iter().enumerate() {
            files.insert(model_file(i), write_tensors(&tmp.join(model_file(i)), tensors)?);
        }
        let registry = self.registry();
        let mut optimizers = Vec::new();
        for (j, (tensors, optimizer)) in
            part.optimizers.iter().zip(&registry.optimizers).enumerate()
        {
            files.insert(optimizer_file(j), write_tensors(&tmp.join(optimizer_file(j)), tensors)?);
            let slot = optimizer.slot.locked();
            optimizers.push(OptimizerRecord {
                name: slot.optimizer.name().to_owned(),
                groups: slot.optimizer.state()?.groups,
                scheduler: slot.scheduler.as_ref().map(|s| s.state().clone()),
                step_was_skipped: slot.step_was_skipped,
            });
        }
        let manifest = Manifest {
            format: format::FORMAT.into(),
            version: format::VERSION,
            accel: crate::VERSION.into(),
            world_size: self.num_processes(),
            files,
            counters: self.counters(),
            scaler: self.inner.scaler.as_ref().map(|s| s.locked().state()),
            models: registry.models.len(),
            optimizers,
            loaders: registry.loaders.iter().map(|p| *p.locked()).collect(),
            loops: registry.loops.iter().map(|(site, p)| (site.clone(), *p.locked())).collect(),
            rng_devices: rng_devices().into_iter().map(device_name).collect(),
            pieces,
            shapes: part.shapes,
            custom: registry.custom.iter().map(|c| c.locked().state()).collect::<Result<_>>()?,
        };
        manifest.write(tmp)
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
        if let Some(group) = self.process_group() {
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
}
