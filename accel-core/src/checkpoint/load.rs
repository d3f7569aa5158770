//! `load_state`: every process reads only what it holds of each tensor — the byte ranges of
//! its own shard, wherever the saving run put them — checks each byte it reads against the
//! manifest's block CRCs, and changes nothing until every process has read and checked its
//! part. Then the parts are applied.
//!
//! What a process holds of a tensor is a list of runs of the whole tensor's flattened
//! elements ([`held`], from the loading run's [`Placement`]); where the saving run kept those
//! elements comes from the manifest ([`Source`]: a file of the main process, or pieces in the
//! processes' shard files). A checkpoint saved on N processes thus loads on M, each process
//! reading about 1/M of the sharded state, and no process ever holds a tensor whole that
//! it keeps a piece of.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use tch::{Device, Kind, Tensor};

use super::format::{
    Manifest, SavedPiece, bad, model_file, numbered_checkpoints, optimizer_file,
    recover_interrupted, rng_file, shard_file,
};
use super::ranges::{FileReader, ReadCounter, filled};
use crate::accelerator::Accelerator;
use crate::error::{Error, Result};
use crate::optim::{OptimizerState, Param};
use crate::shim::set_rng_state;
use crate::strategy::Placement;
use crate::sync::Locked;

/// The elements of a whole tensor that one process holds: runs `(start, len)` of the whole's
/// flattened elements, in the order of the process's own tensor, which has `numel` elements
/// (zero padding after the runs) and shape `shape`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Held {
    pub runs: Vec<(i64, i64)>,
    pub numel: i64,
    pub shape: Vec<i64>,
}

/// What `placement` holds of a whole tensor of shape `shape` — the elements that
/// [`Placement::cut`] keeps, without the whole.
pub(crate) fn held(placement: &Placement, shape: &[i64]) -> Held {
    let whole: i64 = shape.iter().product();
    match placement {
        Placement::Replicated | Placement::Whole { .. } => {
            Held { runs: vec![(0, whole)], numel: whole, shape: shape.to_vec() }
        }
        Placement::Chunk { index, count, numel, .. } => {
            let chunk = (numel + *count as i64 - 1) / *count as i64;
            let start = (chunk * *index as i64).min(*numel);
            let len = chunk.min(numel - start);
            let runs = if len > 0 { vec![(start, len)] } else { Vec::new() };
            Held { runs, numel: chunk, shape: vec![chunk] }
        }
        Placement::Slice { dim, index, count, shape: whole_shape, inner } => {
            let (d, outer_dim) = (*dim, whole_shape[*dim]);
            let part = outer_dim / *count as i64;
            let inner_size: i64 = whole_shape[d + 1..].iter().product();
            // Elements of one slice that lie side by side in the whole.
            let row = part * inner_size;
            let mut slice_shape = whole_shape.clone();
            slice_shape[d] = part;
            let within = held(inner, &slice_shape);
            let mut runs = Vec::new();
            for (start, len) in within.runs {
                let mut at = start;
                while at < start + len {
                    let (o, r) = (at / row.max(1), at % row.max(1));
                    let take = (row - r).min(start + len - at);
                    let whole_at = o * outer_dim * inner_size + *index as i64 * row + r;
                    match runs.last_mut() {
                        Some((s, l)) if *s + *l == whole_at => *l += take,
                        _ => runs.push((whole_at, take)),
                    }
                    at += take;
                }
            }
            Held { runs, numel: within.numel, shape: within.shape }
        }
    }
}

/// Where the saving run kept a tensor's elements.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Source<'m> {
    /// Whole, as tensor `name` of the main process's file `file`.
    File { file: &'m str, name: &'m str },
    /// In pieces in the processes' shard files, under `key`.
    Pieces { key: &'m str, piece: &'m SavedPiece },
}

/// The files of one checkpoint, opened as they are first needed; every read counted.
pub(crate) struct Files<'a> {
    dir: &'a Path,
    manifest: &'a Manifest,
    open: BTreeMap<String, FileReader<'a>>,
    counter: &'a ReadCounter,
}

impl<'a> Files<'a> {
    pub fn new(dir: &'a Path, manifest: &'a Manifest, counter: &'a ReadCounter) -> Self {
        Self { dir, manifest, open: BTreeMap::new(), counter }
    }

    pub fn get(&mut self, name: &str) -> Result<&mut FileReader<'a>> {
        if !self.open.contains_key(name) {
            let path = self.dir.join(name);
            let record = self
                .manifest
                .files
                .get(name)
                .ok_or_else(|| bad(&path, "missing from the manifest"))?;
            let reader = FileReader::open(&path, Some(record), self.counter)?;
            self.open.insert(name.to_owned(), reader);
        }
        Ok(self.open.get_mut(name).expect("opened above"))
    }

    /// The blocks checked so far, by file (what this process tells the others).
    fn checked(&self) -> BTreeMap<String, Vec<usize>> {
        let mut checked = BTreeMap::new();
        for (name, record) in &self.manifest.files {
            let done = match self.open.get(name) {
                // Opening a format-2 file checked it whole: its one unit.
                Some(_) if record.block == 0 => vec![0],
                Some(reader) => {
                    let unchecked = reader.unchecked();
                    (0..record.blocks.len()).filter(|b| !unchecked.contains(b)).collect()
                }
                None => Vec::new(),
            };
            checked.insert(name.clone(), done);
        }
        checked
    }

    /// The dtype, element count and (when kept whole in one file) shape of what `source`
    /// holds.
    fn describe(&mut self, source: Source<'_>) -> Result<(Kind, i64, Option<Vec<i64>>)> {
        match source {
            Source::File { file, name } => {
                let entry = self.get(file)?.entry(name)?.clone();
                Ok((entry.kind, entry.numel(), Some(entry.shape)))
            }
            Source::Pieces { key, piece } => match piece {
                SavedPiece::Whole { rank } => {
                    let entry = self.get(&shard_file(*rank))?.entry(key)?.clone();
                    Ok((entry.kind, entry.numel(), Some(entry.shape)))
                }
                SavedPiece::Chunks { numel, .. } => {
                    Ok((self.first_kind(key, piece)?, *numel, None))
                }
                SavedPiece::Slices { shape, .. } => {
                    Ok((self.first_kind(key, piece)?, shape.iter().product(), None))
                }
            },
        }
    }

    fn first_kind(&mut self, key: &str, piece: &SavedPiece) -> Result<Kind> {
        match piece {
            SavedPiece::Whole { rank } => Ok(self.get(&shard_file(*rank))?.entry(key)?.kind),
            SavedPiece::Chunks { ranks, .. } => {
                let rank =
                    ranks.first().ok_or_else(|| bad(self.dir, format!("`{key}`: no chunks")))?;
                Ok(self.get(&shard_file(*rank))?.entry(key)?.kind)
            }
            SavedPiece::Slices { parts, .. } => match parts.first() {
                Some(part) => self.first_kind(key, part),
                None => Err(bad(self.dir, format!("`{key}`: no slices"))),
            },
        }
    }

    /// Reads elements `start..start + len` of the whole that `source` holds, of `kind`,
    /// into `into`.
    fn read_run(
        &mut self,
        source: Source<'_>,
        kind: Kind,
        start: i64,
        into: &mut [u8],
    ) -> Result<()> {
        match source {
            Source::File { file, name } => self.read_elements(file, name, kind, start, into),
            Source::Pieces { key, piece } => self.read_piece(key, piece, kind, start, into),
        }
    }

    fn read_elements(
        &mut self,
        file: &str,
        name: &str,
        kind: Kind,
        start: i64,
        into: &mut [u8],
    ) -> Result<()> {
        let reader = self.get(file)?;
        let found = reader.entry(name)?.kind;
        if found != kind {
            return Err(bad(
                &reader.path,
                format!("`{name}` is {found:?} there, other pieces of it are {kind:?}"),
            ));
        }
        reader.read_elements(name, start, into)
    }

    fn read_piece(
        &mut self,
        key: &str,
        piece: &SavedPiece,
        kind: Kind,
        start: i64,
        into: &mut [u8],
    ) -> Result<()> {
        let elt = kind.elt_size_in_bytes();
        let len = (into.len() / elt) as i64;
        match piece {
            SavedPiece::Whole { rank } => {
                self.read_elements(&shard_file(*rank), key, kind, start, into)
            }
            SavedPiece::Chunks { numel, ranks } => {
                if start + len > *numel || ranks.is_empty() {
                    return Err(bad(
                        self.dir,
                        format!("the chunks of `{key}` hold fewer than its {numel} elements"),
                    ));
                }
                let chunk = (numel + ranks.len() as i64 - 1) / ranks.len() as i64;
                let mut at = start;
                while at < start + len {
                    let i = (at / chunk) as usize;
                    let take = (chunk * (i as i64 + 1)).min(start + len) - at;
                    let bytes = &mut into
                        [((at - start) as usize * elt)..((at - start + take) as usize * elt)];
                    self.read_elements(
                        &shard_file(ranks[i]),
                        key,
                        kind,
                        at - i as i64 * chunk,
                        bytes,
                    )?;
                    at += take;
                }
                Ok(())
            }
            SavedPiece::Slices { dim, shape, parts } => {
                if *dim >= shape.len() || parts.is_empty() || shape[*dim] % parts.len() as i64 != 0
                {
                    return Err(bad(
                        self.dir,
                        format!("`{key}`: slices of a malformed shape {shape:?}"),
                    ));
                }
                let outer_dim = shape[*dim];
                let part = outer_dim / parts.len() as i64;
                let inner_size: i64 = shape[dim + 1..].iter().product();
                let row = (part * inner_size).max(1);
                let mut at = start;
                while at < start + len {
                    let (o, rest) = (
                        at / (outer_dim * inner_size).max(1),
                        at % (outer_dim * inner_size).max(1),
                    );
                    let (p, r) = ((rest / row) as usize, rest % row);
                    let take = (row - r).min(start + len - at);
                    let bytes = &mut into
                        [((at - start) as usize * elt)..((at - start + take) as usize * elt)];
                    self.read_piece(key, &parts[p], kind, o * row + r, bytes)?;
                    at += take;
                }
                Ok(())
            }
        }
    }

    /// What `held` names of the whole that `source` holds: a new CPU tensor of `held.numel`
    /// elements of `kind` (zero padding after the runs), shaped `held.shape`.
    fn read_held(&mut self, source: Source<'_>, kind: Kind, held: &Held) -> Result<Tensor> {
        let elt = kind.elt_size_in_bytes();
        let tensor = filled(held.numel, kind, |bytes| {
            let mut at = 0usize;
            for &(start, len) in &held.runs {
                let n = len as usize * elt;
                self.read_run(source, kind, start, &mut bytes[at..at + n])?;
                at += n;
            }
            Ok(())
        })?;
        Ok(tensor.f_view(held.shape.as_slice())?)
    }
}

/// A model variable as read: what this process holds of it, and whether that is the
/// strategy's whole (for `Strategy::load_parameter`) or its part (`load_part`).
struct ModelPart {
    param: Param,
    value: Tensor,
    whole: bool,
}

/// Everything a checkpoint gives this process, read and checked, nothing applied yet.
struct Loaded {
    manifest: Manifest,
    models: Vec<Vec<ModelPart>>,
    optimizers: Vec<(PathBuf, OptimizerState)>,
    rng: BTreeMap<String, Tensor>,
}

impl Accelerator {
    /// Restores a state saved by [`save_state`](Self::save_state) into the prepared model,
    /// optimizers, schedules, scaler, loaders and generators. Each process reads only what
    /// it holds of each tensor (its shard's byte ranges under zero2/zero3, whatever number
    /// of processes saved it), and checks every byte it reads against the manifest's
    /// checksums; the blocks nobody needed are checked too, spread over the processes. A
    /// damaged or mismatched checkpoint is an error on every process, naming the process
    /// and the file, and then nothing has changed.
    pub fn load_state(&self, dir: impl AsRef<Path>) -> Result<()> {
        let loaded = self.read_state(dir.as_ref())?;
        self.apply_state(dir.as_ref(), loaded)
    }

    /// Reads and checks this process's part of the checkpoint in `dir`, then agrees with
    /// the other processes: an error on any is an error on all (each naming the process
    /// that met it).
    fn read_state(&self, dir: &Path) -> Result<Loaded> {
        let counter = &self.inner.io.checkpoint_bytes_read;
        let mut checked = BTreeMap::new();
        let mut units: Vec<(String, usize)> = Vec::new();
        let outcome = (|| -> Result<Loaded> {
            if let Some(message) = recover_interrupted(dir)? {
                eprintln!("accel: {message}");
            }
            let manifest = Manifest::read(dir)?;
            units = manifest.files.iter().map(|(n, r)| (n.clone(), r.checked_units())).collect();
            let mut files = Files::new(dir, &manifest, counter);
            let parts = self.read_parts(dir, &manifest, &mut files);
            checked = files.checked();
            drop(files);
            let (models, optimizers, rng) = parts?;
            Ok(Loaded { manifest, models, optimizers, rng })
        })();
        // Every process learns what the others read, and whether they could: a failure on
        // one is a failure on all. Every process takes part, whatever its reading met.
        let (loaded, all_checked) = self.agree(dir, outcome, checked)?;
        // The blocks no process read are checked now, each by one process, and agreed on.
        let mine = self.unread_blocks(&units, &all_checked);
        let verified = (|| -> Result<()> {
            let mut files = Files::new(dir, &loaded.manifest, counter);
            for (name, blocks) in mine {
                files.get(&name)?.verify(&blocks)?;
            }
            Ok(())
        })();
        self.agree(dir, verified.map(|()| loaded), BTreeMap::new()).map(|(loaded, _)| loaded)
    }

    /// Shares each process's outcome (and the blocks it checked): an error on any process is
    /// an error on every one, naming the process that met it. A collective.
    #[allow(clippy::type_complexity)]
    fn agree<T>(
        &self,
        dir: &Path,
        outcome: Result<T>,
        checked: BTreeMap<String, Vec<usize>>,
    ) -> Result<(T, Vec<BTreeMap<String, Vec<usize>>>)> {
        let Some(group) = self.process_group() else {
            return outcome.map(|t| (t, vec![checked]));
        };
        let message = outcome.as_ref().err().map(ToString::to_string);
        let all: Vec<(Option<String>, BTreeMap<String, Vec<usize>>)> =
            group.all_gather_objects(&(message, checked))?;
        let failed = all.iter().enumerate().find_map(|(r, (m, _))| Some((r, m.as_ref()?)));
        match (outcome, failed) {
            (Err(e), _) => Err(e),
            (Ok(_), Some((rank, m))) => {
                Err(bad(dir, format!("process {rank} could not load its part, so none did: {m}")))
            }
            (Ok(t), None) => Ok((t, all.into_iter().map(|(_, c)| c).collect())),
        }
    }

    /// The blocks this process checks of those no process read (`checked`: what each
    /// read), dealt out in turn.
    fn unread_blocks(
        &self,
        files: &[(String, usize)],
        checked: &[BTreeMap<String, Vec<usize>>],
    ) -> Vec<(String, Vec<usize>)> {
        let (rank, size) = (self.process_index(), checked.len().max(1));
        let mut mine: Vec<(String, Vec<usize>)> = Vec::new();
        let mut turn = 0usize;
        for (name, blocks) in files {
            let read: std::collections::BTreeSet<usize> =
                checked.iter().filter_map(|c| c.get(name)).flatten().copied().collect();
            let mut own = Vec::new();
            for b in (0..*blocks).filter(|b| !read.contains(b)) {
                if turn % size == rank {
                    own.push(b);
                }
                turn += 1;
            }
            if !own.is_empty() {
                mine.push((name.clone(), own));
            }
        }
        mine
    }

    /// This process's part of every model variable and optimizer state tensor, and its
    /// random generators, read and checked against the prepared objects.
    #[allow(clippy::type_complexity)]
    fn read_parts(
        &self,
        dir: &Path,
        manifest: &Manifest,
        files: &mut Files<'_>,
    ) -> Result<(Vec<Vec<ModelPart>>, Vec<(PathBuf, OptimizerState)>, BTreeMap<String, Tensor>)>
    {
        let registry = self.registry();
        let expect = |what: &str, saved: usize, here: usize| -> Result<()> {
            if saved == here {
                return Ok(());
            }
            Err(bad(
                dir,
                format!(
                    "it holds {saved} {what}, this run prepared {here}; prepare the same objects \
                     before load_state"
                ),
            ))
        };
        expect("models", manifest.models, registry.models.len())?;
        expect("optimizers", manifest.optimizers.len(), registry.optimizers.len())?;
        expect("data loaders", manifest.loaders.len(), registry.loaders.len())?;
        expect(
            "states registered for checkpointing",
            manifest.custom.len(),
            registry.custom.len(),
        )?;
        if manifest.scaler.is_some() != self.loss_scale().is_some() {
            return Err(bad(
                dir,
                "it was saved with another precision (fp16 loss scaler present in one of the two)",
            ));
        }
        let mut models = Vec::new();
        for (i, params) in registry.models.iter().enumerate() {
            models.push(self.read_model(manifest, files, i, params)?);
        }
        let mut optimizers = Vec::new();
        for (j, (record, optimizer)) in
            manifest.optimizers.iter().zip(&registry.optimizers).enumerate()
        {
            let path = dir.join(optimizer_file(j));
            let slot = optimizer.slot.locked();
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
            let tensors = self.read_optimizer(manifest, files, j, &slot)?;
            let state = OptimizerState { tensors, groups: record.groups.clone() };
            slot.optimizer.check_state(&state).map_err(|e| match e {
                Error::Checkpoint { message, .. } => bad(&path, message),
                other => other,
            })?;
            optimizers.push((path, state));
        }
        // A process the saving run did not have keeps its own generators (the run can
        // continue, but no longer bit-identically: the data order per process changed anyway).
        let mut rng = BTreeMap::new();
        if self.process_index() < manifest.world_size {
            let name = rng_file(self.process_index());
            let names: Vec<String> = files.get(&name)?.entries.keys().cloned().collect();
            for device in names {
                let (kind, numel, shape) =
                    files.describe(Source::File { file: &name, name: &device })?;
                let shape = shape.unwrap_or(vec![numel]);
                let whole = held(&Placement::Replicated, &shape);
                rng.insert(
                    device.clone(),
                    files.read_held(Source::File { file: &name, name: &device }, kind, &whole)?,
                );
            }
        }
        Ok((models, optimizers, rng))
    }

    /// What this process holds of model `i`'s variables.
    fn read_model(
        &self,
        manifest: &Manifest,
        files: &mut Files<'_>,
        i: usize,
        params: &[Param],
    ) -> Result<Vec<ModelPart>> {
        let file = model_file(i);
        let strategy = self.strategy();
        let keys: Vec<String> = params.iter().map(|p| format!("model_{i}/{}", p.name)).collect();
        let mut parts = Vec::new();
        for (p, key) in params.iter().zip(&keys) {
            let shape = self.inner.parallel.whole_shape(&p.tensor)?;
            let numel: i64 = shape.iter().product();
            let source = match manifest.pieces.get(key) {
                Some(piece) => Source::Pieces { key, piece },
                None => {
                    let reader = files.get(&file)?;
                    if !reader.entries.contains_key(&p.name) {
                        return Err(bad(
                            &reader.path,
                            format!("has no tensor `{}`, which the model has", p.name),
                        ));
                    }
                    Source::File { file: &file, name: &p.name }
                }
            };
            let (local, placement) = strategy.parameter(p)?;
            let (kind, saved, saved_shape) = files.describe(source)?;
            let path = files.dir.join(&file);
            if let Some(saved_shape) = saved_shape {
                if saved_shape != shape || kind != local.kind() {
                    return Err(bad(
                        &path,
                        format!(
                            "tensor `{}` is {kind:?} {saved_shape:?}, the model's is {:?} {shape:?}",
                            p.name,
                            local.kind(),
                        ),
                    ));
                }
            } else if saved != numel || kind != local.kind() {
                return Err(bad(
                    files.dir,
                    format!(
                        "`{}` has {saved} elements of {kind:?} saved, the model's has {numel} of {:?}",
                        p.name,
                        local.kind()
                    ),
                ));
            }
            let whole = placement == Placement::Replicated;
            let placement = self.inner.parallel.placement(&p.tensor, placement)?;
            let mut value = files.read_held(source, kind, &held(&placement, &shape))?;
            if !whole && value.numel() == local.numel() && value.size() != local.size() {
                value = value.f_view(local.size().as_slice())?;
            }
            parts.push(ModelPart { param: p.clone(), value, whole });
        }
        // (A pipeline stage holds some of the model only.)
        if self.inner.mesh.whole_model_per_process() && manifest.files.contains_key(&file) {
            let reader = files.get(&file)?;
            let extra = reader.entries.keys().find(|k| params.iter().all(|p| &p.name != *k));
            if let Some(extra) = extra {
                return Err(bad(
                    &reader.path,
                    format!("holds tensor `{extra}`, which the model does not have"),
                ));
            }
        }
        Ok(parts)
    }

    /// What this process holds of optimizer `j`'s state tensors, cut as this run places
    /// their parameters: this tensor rank's slice first, then the strategy's share of that.
    fn read_optimizer(
        &self,
        manifest: &Manifest,
        files: &mut Files<'_>,
        j: usize,
        slot: &crate::accelerator::Slot,
    ) -> Result<BTreeMap<String, Tensor>> {
        let file = optimizer_file(j);
        let prefix = format!("optimizer_{j}/");
        let mut keys: Vec<(String, Option<String>)> = manifest
            .pieces
            .keys()
            .filter_map(|k| Some((k.strip_prefix(&prefix)?.to_owned(), Some(k.clone()))))
            .collect();
        if manifest.files.contains_key(&file) {
            keys.extend(files.get(&file)?.entries.keys().map(|k| (k.clone(), None)));
        }
        let params: BTreeMap<String, Tensor> =
            slot.optimizer.param_names().into_iter().zip(slot.optimizer.params()).collect();
        let originals = slot.named_trainable();
        let mut tensors = BTreeMap::new();
        for (name, piece_key) in keys {
            let source = match &piece_key {
                Some(key) => Source::Pieces { key, piece: &manifest.pieces[key] },
                None => Source::File { file: &file, name: &name },
            };
            let (kind, saved, saved_shape) = files.describe(source)?;
            let param = name.rsplit_once('/').map(|(p, _)| p);
            let flat = vec![saved];
            let shape = saved_shape.clone().unwrap_or(flat);
            let original = param.and_then(|p| originals.get(p));
            let scalar = saved_shape.as_ref().is_some_and(|s| s.is_empty());
            let mut whole_shape = shape.clone();
            let placement = match (param, original) {
                (Some(param), Some(original)) if !scalar => {
                    let tp_whole = self.inner.parallel.whole_shape(original)?;
                    if saved == tp_whole.iter().product::<i64>() {
                        // Shaped like its parameter: this tensor rank's slice, then the share.
                        whole_shape = tp_whole;
                        let share = slot.plan().state_placement_of(param, original.numel() as i64);
                        self.inner.parallel.placement(original, share)?
                    } else {
                        slot.plan().state_placement_of(param, saved)
                    }
                }
                (Some(param), None) if !scalar => slot.plan().state_placement_of(param, saved),
                _ => Placement::Replicated,
            };
            let mut value = files.read_held(source, kind, &held(&placement, &whole_shape))?;
            if let Some(like) = param.and_then(|p| params.get(p)).filter(|_| !scalar) {
                if !matches!(placement, Placement::Chunk { .. })
                    && like.numel() == value.numel()
                    && like.size() != value.size()
                {
                    value = value.f_view(like.size().as_slice())?;
                }
            }
            tensors.insert(name, value);
        }
        Ok(tensors)
    }

    /// Applies what [`read_state`](Self::read_state) read: registered states, the model's
    /// variables (through the strategy), optimizer states and schedules, the loss scale,
    /// data positions, random generators and step counters.
    fn apply_state(&self, dir: &Path, loaded: Loaded) -> Result<()> {
        let Loaded { manifest, models, optimizers, rng } = loaded;
        let mut registry = self.registry();
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
        // The registered states first (a state that does not read back as its type is an
        // error before any tensor changes).
        for (i, (custom, saved)) in registry.custom.iter().zip(&manifest.custom).enumerate() {
            let mut custom = custom.locked();
            custom.load(saved.clone()).map_err(|e| {
                bad(dir, format!("registered state #{i} (register_for_checkpointing): {e}"))
            })?;
        }
        let strategy = self.strategy();
        // Each part read is dropped as soon as it is applied.
        for part in models.into_iter().flatten() {
            if part.whole {
                strategy.load_parameter(&part.param, &part.value)?;
            } else {
                strategy.load_part(&part.param, &part.value)?;
            }
        }
        strategy.after_load()?;
        for ((optimizer, record), (path, state)) in
            registry.optimizers.iter().zip(&manifest.optimizers).zip(optimizers)
        {
            let mut slot = optimizer.slot.locked();
            // Handed over: the tensors read become the optimizer's state, not copied again.
            slot.optimizer.take_state(state).map_err(|e| match e {
                Error::Checkpoint { message, .. } => bad(&path, message),
                other => other,
            })?;
            let slot = &mut *slot;
            if let (Some(s), Some(saved)) = (slot.scheduler.as_mut(), &record.scheduler) {
                s.load_state(saved.clone(), slot.optimizer.as_mut())?;
            }
            slot.step_was_skipped = record.step_was_skipped;
        }
        if let Some(saved) = manifest.scaler {
            self.restore_scaler(saved)?;
        }
        for (position, saved) in registry.loaders.iter().zip(&manifest.loaders) {
            *position.locked() = *saved;
        }
        // Each dealt loop's next pass resumes where it stood (see `prepare_iter`).
        registry.resumed_epoch = manifest.loops.values().map(|p| p.epoch).max().unwrap_or(0);
        registry.resume_loops = manifest.loops.clone();
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
        self.restore_counters(manifest.counters);
        Ok(())
    }

    /// Loads the newest complete `checkpoint_{i}` of the checkpoint directory; returns it,
    /// or `None` when there is none yet (a fresh run). A newer one that is incomplete or
    /// corrupt (a run stopped while writing it, a damaged file) is skipped with a warning
    /// naming it and why: each process reads and checks its part of each candidate, as
    /// [`load_state`](Self::load_state) does, and nothing changes until one is whole.
    pub fn load_latest_checkpoint(&self) -> Result<Option<PathBuf>> {
        let Some(root) = self.checkpoint_dir() else { return Ok(None) };
        // The main process lists them, so that every process tries the same ones.
        let mut candidates = Vec::new();
        if self.is_main_process() && root.exists() {
            candidates = numbered_checkpoints(root)?.into_iter().map(|(_, d)| d).collect();
        }
        if let Some(group) = self.process_group() {
            candidates =
                group.broadcast_object(self.is_main_process().then_some(&candidates), 0)?;
        }
        for dir in candidates.iter().rev() {
            match self.read_state(dir) {
                Ok(loaded) => {
                    self.apply_state(dir, loaded)?;
                    return Ok(Some(dir.clone()));
                }
                Err(e) => self.print(format!("accel: skipping checkpoint {}: {e}", dir.display())),
            }
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use tch::{Device, Kind, Tensor};

    use super::held;
    use crate::strategy::Placement;

    /// The runs `held` lists, read from a whole, are what `Placement::cut` keeps of it —
    /// for chunks (padded), slices, and chunks of slices, over odd shapes.
    #[test]
    fn held_runs_are_what_a_placement_cuts() {
        for shape in [vec![7], vec![6, 5], vec![4, 6, 3], vec![1], vec![12, 1]] {
            let numel: i64 = shape.iter().product();
            let whole = Tensor::arange(numel, (Kind::Float, Device::Cpu)).view(shape.as_slice());
            let mut placements = vec![Placement::Replicated, Placement::Whole { write: true }];
            for count in 1..=5 {
                for index in 0..count {
                    placements.push(Placement::Chunk { index, count, numel, write: true });
                }
            }
            for (dim, &size) in shape.iter().enumerate() {
                for count in (1..=size as usize).filter(|c| size % *c as i64 == 0) {
                    for index in 0..count {
                        let slice: i64 = numel / count as i64;
                        for inner in [
                            Placement::Replicated,
                            Placement::Chunk {
                                index: index % 3,
                                count: 3,
                                numel: slice,
                                write: true,
                            },
                        ] {
                            placements.push(Placement::Slice {
                                dim,
                                index,
                                count,
                                shape: shape.clone(),
                                inner: Box::new(inner),
                            });
                        }
                    }
                }
            }
            for placement in placements {
                let expect = placement.cut(&whole, None).unwrap();
                let h = held(&placement, &shape);
                let flat = whole.flatten(0, -1);
                let mut values: Vec<f32> = Vec::new();
                for (start, len) in &h.runs {
                    values.extend(Vec::<f32>::try_from(flat.narrow(0, *start, *len)).unwrap());
                }
                values.resize(h.numel as usize, 0.0);
                let got = Tensor::from_slice(&values).view(h.shape.as_slice());
                assert_eq!(got.size(), expect.size(), "{placement:?} of {shape:?}");
                assert!(got.equal(&expect), "{placement:?} of {shape:?}: {got:?} vs {expect:?}");
            }
        }
    }
}
