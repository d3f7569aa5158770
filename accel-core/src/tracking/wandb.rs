//! Weights & Biases, offline: the run is written as the `wandb` client writes it under
//! `WANDB_MODE=offline` — `wandb/offline-run-<time>-<id>/run-<id>.wandb` — and uploaded
//! later with `wandb sync`, as clusters without internet do. No Python and no network at
//! run time.
//!
//! The file is W&B's variant of LevelDB's log format (W&B's `datastore.py` and its Go
//! core's `pkg/leveldb`): a 7-byte header (`:W&B`, magic 0xBEE1, version 0), then 32 KiB
//! blocks of chunks, each `crc32(type ‖ data)` (IEEE, unmasked), length and type (full,
//! first, middle, last), with zeros where a block has less than a chunk header left. Each
//! chunk's data is a `wandb_internal.Record`, declared below with prost's derive, field
//! numbers as in W&B's `wandb/proto/wandb_internal.proto` (MIT; read at commit b6e2950).
//! The records follow the client's order: header, run (with the configuration), for each
//! step a summary of the latest values and a history row (`_step`, `_runtime`,
//! `_timestamp`), then the exit code (0, or 1 for a run that failed) and `final`.
//!
//! Settings come from W&B's own variables: `WANDB_PROJECT` (else the project name given to
//! `init_trackers`), `WANDB_ENTITY`, `WANDB_NAME`, `WANDB_RUN_ID`, `WANDB_TAGS`,
//! `WANDB_DIR` (the folder that holds `wandb/`) and `WANDB_MODE` (`offline`, `dryrun`;
//! `disabled` writes nothing; `online` is refused: accel cannot upload).

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use prost::Message;

use super::media::{file_stem, sha256_hex};
use super::{Tracker, Value};
use crate::error::{Error, Result};

/// `wandb_internal.Record` (the kinds accel writes).
#[derive(Clone, PartialEq, prost::Message)]
struct Record {
    #[prost(int64, tag = "1")]
    num: i64,
    #[prost(oneof = "Kind", tags = "2, 3, 5, 6, 17, 18, 20, 21")]
    kind: Option<Kind>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
enum Kind {
    #[prost(message, tag = "2")]
    History(HistoryRecord),
    #[prost(message, tag = "3")]
    Summary(SummaryRecord),
    #[prost(message, tag = "5")]
    Config(ConfigRecord),
    #[prost(message, tag = "6")]
    Files(FilesRecord),
    #[prost(message, tag = "17")]
    Run(RunRecord),
    #[prost(message, tag = "18")]
    Exit(RunExitRecord),
    #[prost(message, tag = "20")]
    Final(FinalRecord),
    #[prost(message, tag = "21")]
    Header(HeaderRecord),
}

/// `wandb_internal.HeaderRecord` with its `VersionInfo`.
#[derive(Clone, PartialEq, prost::Message)]
struct HeaderRecord {
    #[prost(message, optional, tag = "1")]
    version_info: Option<VersionInfo>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct VersionInfo {
    #[prost(string, tag = "1")]
    producer: String,
    #[prost(string, tag = "2")]
    min_consumer: String,
}

/// `google.protobuf.Timestamp`.
#[derive(Clone, PartialEq, prost::Message)]
struct Timestamp {
    #[prost(int64, tag = "1")]
    seconds: i64,
    #[prost(int32, tag = "2")]
    nanos: i32,
}

/// `wandb_internal.RunRecord` (the fields accel sets).
#[derive(Clone, PartialEq, prost::Message)]
struct RunRecord {
    #[prost(string, tag = "1")]
    run_id: String,
    #[prost(string, tag = "2")]
    entity: String,
    #[prost(string, tag = "3")]
    project: String,
    #[prost(message, optional, tag = "4")]
    config: Option<ConfigRecord>,
    #[prost(string, tag = "8")]
    display_name: String,
    #[prost(string, repeated, tag = "10")]
    tags: Vec<String>,
    #[prost(string, tag = "13")]
    host: String,
    #[prost(message, optional, tag = "17")]
    start_time: Option<Timestamp>,
}

/// `wandb_internal.ConfigItem`, `SummaryItem` and `HistoryItem` (one layout): a top-level
/// `key` or a `nested_key` path, and the value as JSON text.
#[derive(Clone, PartialEq, prost::Message)]
struct Item {
    #[prost(string, tag = "1")]
    key: String,
    #[prost(string, repeated, tag = "2")]
    nested_key: Vec<String>,
    #[prost(string, tag = "16")]
    value_json: String,
}

/// `wandb_internal.ConfigRecord`.
#[derive(Clone, PartialEq, prost::Message)]
struct ConfigRecord {
    #[prost(message, repeated, tag = "1")]
    update: Vec<Item>,
}

/// `wandb_internal.SummaryRecord`.
#[derive(Clone, PartialEq, prost::Message)]
struct SummaryRecord {
    #[prost(message, repeated, tag = "1")]
    update: Vec<Item>,
}

/// `wandb_internal.HistoryRecord` with its `HistoryStep`.
#[derive(Clone, PartialEq, prost::Message)]
struct HistoryRecord {
    #[prost(message, repeated, tag = "1")]
    item: Vec<Item>,
    #[prost(message, optional, tag = "2")]
    step: Option<HistoryStep>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct HistoryStep {
    #[prost(int64, tag = "1")]
    num: i64,
}

/// `wandb_internal.FilesRecord`: files under the run's `files/` for sync to upload.
#[derive(Clone, PartialEq, prost::Message)]
struct FilesRecord {
    #[prost(message, repeated, tag = "1")]
    files: Vec<FilesItem>,
}

/// `wandb_internal.FilesItem` (policy 0 is `NOW`; type 0 `OTHER`, which the uploader takes
/// for media under `media/`).
#[derive(Clone, PartialEq, prost::Message)]
struct FilesItem {
    #[prost(string, tag = "1")]
    path: String,
    #[prost(int32, tag = "2")]
    policy: i32,
    #[prost(int32, tag = "3")]
    r#type: i32,
}

/// `wandb_internal.RunExitRecord`.
#[derive(Clone, PartialEq, prost::Message)]
struct RunExitRecord {
    #[prost(int32, tag = "1")]
    exit_code: i32,
    #[prost(int32, tag = "2")]
    runtime: i32,
}

/// `wandb_internal.FinalRecord`: written after the exit for `wandb sync --legacy`, which
/// sends the exit only when it sees one (the current sync ignores it).
#[derive(Clone, PartialEq, prost::Message)]
struct FinalRecord {}

const BLOCK: usize = 32 * 1024;
const CHUNK_HEADER: usize = 7;
const FULL: u8 = 1;
const FIRST: u8 = 2;
const MIDDLE: u8 = 3;
const LAST: u8 = 4;

/// The record log: the file header, then records split into chunks within 32 KiB blocks.
struct RecordLog {
    file: File,
    path: PathBuf,
    /// Bytes written so far (blocks are counted from the start of the file).
    offset: usize,
    /// Records written so far (each record's `num`).
    records: i64,
}

impl RecordLog {
    fn create(path: PathBuf) -> Result<Self> {
        let io = |source| Error::Io { path: path.clone(), source };
        // As the client: a run file is never overwritten.
        let mut file = File::options().write(true).create_new(true).open(&path).map_err(io)?;
        let mut header = b":W&B".to_vec();
        header.extend_from_slice(&0xBEE1u16.to_le_bytes());
        header.push(0);
        file.write_all(&header).map_err(io)?;
        Ok(Self { file, path, offset: header.len(), records: 0 })
    }

    fn append(&mut self, kind: Kind) -> Result<()> {
        self.records += 1;
        let data = Record { num: self.records, kind: Some(kind) }.encode_to_vec();
        let mut out = Vec::with_capacity(data.len() + 2 * CHUNK_HEADER);
        let mut left = BLOCK - self.offset % BLOCK;
        if left < CHUNK_HEADER {
            out.resize(left, 0);
            left = BLOCK;
        }
        let chunk = |out: &mut Vec<u8>, kind: u8, part: &[u8]| {
            let mut crc = crc32fast::Hasher::new();
            crc.update(&[kind]);
            crc.update(part);
            out.extend_from_slice(&crc.finalize().to_le_bytes());
            out.extend_from_slice(&(part.len() as u16).to_le_bytes());
            out.push(kind);
            out.extend_from_slice(part);
        };
        if data.len() + CHUNK_HEADER <= left {
            chunk(&mut out, FULL, &data);
        } else {
            let (first, mut rest) = data.split_at(left - CHUNK_HEADER);
            chunk(&mut out, FIRST, first);
            while rest.len() > BLOCK - CHUNK_HEADER {
                let (middle, tail) = rest.split_at(BLOCK - CHUNK_HEADER);
                chunk(&mut out, MIDDLE, middle);
                rest = tail;
            }
            chunk(&mut out, LAST, rest);
        }
        self.file
            .write_all(&out)
            .map_err(|source| Error::Io { path: self.path.clone(), source })?;
        self.offset += out.len();
        Ok(())
    }

    /// Ends the file. Where it would end less than a chunk header short of a block, the
    /// block is filled with zeros: `datastore.py`'s reader takes that rest for padding and
    /// would fail on it otherwise (W&B's Go reader reads both).
    fn close(&mut self) -> Result<()> {
        let left = BLOCK - self.offset % BLOCK;
        let io = |source| Error::Io { path: self.path.clone(), source };
        if left < CHUNK_HEADER {
            self.file.write_all(&vec![0; left]).map_err(io)?;
            self.offset += left;
        }
        self.file.sync_all().map_err(io)
    }
}

/// What `WANDB_MODE` asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WandbMode {
    /// Write the offline run (`offline`, `dryrun`, or unset: accel cannot upload).
    Offline,
    /// Write nothing (`disabled`).
    Disabled,
}

/// A W&B run's settings, from W&B's environment variables.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WandbSettings {
    /// `WANDB_MODE`.
    pub mode: WandbMode,
    /// `WANDB_PROJECT`, else the project name given to `init_trackers`.
    pub project: String,
    /// `WANDB_ENTITY` (empty: the user's default entity, at sync time).
    pub entity: String,
    /// `WANDB_NAME`: the run's display name.
    pub name: String,
    /// `WANDB_RUN_ID`, else 8 random characters of `[a-z0-9]`, as the client makes them.
    pub run_id: String,
    /// `WANDB_TAGS`, comma-separated.
    pub tags: Vec<String>,
    /// `WANDB_DIR`: the folder that holds `wandb/` (default: the working directory).
    pub root: PathBuf,
}

impl WandbSettings {
    /// From the process's environment.
    pub fn from_env(project: &str) -> Result<Self> {
        Self::from_env_with(project, |k| std::env::var(k).ok())
    }

    /// From `get` (a variable's value), checked as the client checks them.
    pub fn from_env_with(project: &str, get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let mode = match get("WANDB_MODE").as_deref().map(str::trim) {
            None | Some("") | Some("offline") | Some("dryrun") => WandbMode::Offline,
            Some("disabled") => WandbMode::Disabled,
            Some(online @ ("online" | "run" | "shared")) => {
                return Err(Error::Config(format!(
                    "WANDB_MODE={online}: accel writes W&B runs offline only (it does not \
                     reach W&B's servers); set WANDB_MODE=offline and upload the run with \
                     `wandb sync wandb/offline-run-*` afterwards"
                )));
            }
            Some(other) => {
                return Err(Error::Config(format!(
                    "WANDB_MODE={other} is not one of W&B's modes; accel takes offline, dryrun \
                     and disabled"
                )));
            }
        };
        let tags: Vec<String> = match get("WANDB_TAGS") {
            // As the client: split on commas, nothing trimmed, each 1 to 64 characters.
            Some(text) if !text.is_empty() => text.split(',').map(str::to_owned).collect(),
            _ => Vec::new(),
        };
        if let Some(bad) = tags.iter().find(|t| t.is_empty() || t.chars().count() > 64) {
            return Err(Error::Config(format!(
                "WANDB_TAGS: the tag `{bad}` must be 1 to 64 characters long (tags are \
                 separated by commas)"
            )));
        }
        let run_id = match get("WANDB_RUN_ID").filter(|v| !v.is_empty()) {
            Some(id) => {
                if let Some(c) = id.chars().find(|c| "/\\#?%:".contains(*c)) {
                    return Err(Error::Config(format!(
                        "WANDB_RUN_ID={id} holds `{c}`, which W&B does not allow in a run id \
                         (nor any of / \\ # ? % :)"
                    )));
                }
                id
            }
            None => {
                use rand::Rng;
                let mut rng = rand::rng();
                const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
                (0..8).map(|_| ALPHABET[rng.random_range(0..ALPHABET.len())] as char).collect()
            }
        };
        let non_empty = |k: &str| get(k).filter(|v| !v.is_empty());
        Ok(Self {
            mode,
            project: non_empty("WANDB_PROJECT").unwrap_or_else(|| project.to_owned()),
            entity: non_empty("WANDB_ENTITY").unwrap_or_default(),
            name: non_empty("WANDB_NAME").unwrap_or_default(),
            run_id,
            tags,
            root: non_empty("WANDB_DIR").map_or_else(|| PathBuf::from("."), PathBuf::from),
        })
    }
}

/// A value as W&B's JSON: numbers as they are, and NaN and the infinities as the client
/// writes them (`NaN`, `Infinity`, `-Infinity`), where JSON itself has no spelling.
fn json_number(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v.is_infinite() {
        if v > 0.0 { "Infinity".into() } else { "-Infinity".into() }
    } else {
        serde_json::Number::from_f64(v).map_or_else(|| "NaN".into(), |n| n.to_string())
    }
}

fn item(path: &[&str], value_json: String) -> Item {
    Item {
        key: String::new(),
        nested_key: path.iter().map(|s| (*s).to_owned()).collect(),
        value_json,
    }
}

/// An item under a top-level `key`.
fn keyed(key: &str, value_json: String) -> Item {
    Item { key: key.to_owned(), nested_key: vec![], value_json }
}

/// A configuration as the client's items: its top-level keys, or the whole under `config`
/// when it is not an object.
fn config_items(config: &serde_json::Value) -> Vec<Item> {
    match config {
        serde_json::Value::Object(map) => {
            map.iter().map(|(k, v)| keyed(k, v.to_string())).collect()
        }
        other => vec![keyed("config", other.to_string())],
    }
}

/// Local time as the client names run folders: `20261205_143000`.
fn folder_time(unix: i64) -> String {
    // SAFETY: `libc::tm` is plain integers (and a pointer that may be null): all zeros is a
    // valid value.
    let mut tm: libc::tm = unsafe { std::mem::zeroed() };
    let t = unix as libc::time_t;
    // SAFETY: both pointers are to live locals; localtime_r writes only into `tm`.
    let ok = unsafe { !libc::localtime_r(&t, &mut tm).is_null() };
    if !ok {
        return unix.to_string();
    }
    format!(
        "{:04}{:02}{:02}_{:02}{:02}{:02}",
        tm.tm_year + 1900,
        tm.tm_mon + 1,
        tm.tm_mday,
        tm.tm_hour,
        tm.tm_min,
        tm.tm_sec
    )
}

/// A Weights & Biases run written offline (see the module's documentation). On every process
/// but the main one it writes nothing.
pub struct Wandb {
    settings: WandbSettings,
    /// `None` on other processes and under `WANDB_MODE=disabled`.
    log: Option<RecordLog>,
    run_dir: PathBuf,
    run_written: bool,
    started: Instant,
    start_unix: f64,
    /// The row being filled: its step and values (a step is written when a later one
    /// starts, or at the end, as the client does with `log(step=...)`).
    pending: Option<(u64, BTreeMap<String, String>)>,
    /// The last step written, and whether a step below it was dropped (said once).
    last_step: Option<u64>,
    warned_backwards: bool,
}

impl std::fmt::Debug for Wandb {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Wandb").field("run_dir", &self.run_dir).finish_non_exhaustive()
    }
}

impl Wandb {
    /// Starts the offline run on the main process (`main`): its folder
    /// `<WANDB_DIR>/wandb/offline-run-<time>-<id>/`, the `latest-run` link, and the run file
    /// with its header.
    pub fn start(settings: &WandbSettings, main: bool) -> Result<Self> {
        let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
        let wandb_dir = {
            // As the client: `.wandb` when the project already has one.
            let dot = settings.root.join(".wandb");
            if dot.is_dir() { dot } else { settings.root.join("wandb") }
        };
        let folder =
            format!("offline-run-{}-{}", folder_time(now.as_secs() as i64), settings.run_id);
        let run_dir = wandb_dir.join(&folder);
        let log = if main && settings.mode == WandbMode::Offline {
            let files = run_dir.join("files");
            std::fs::create_dir_all(&files)
                .map_err(|source| Error::Io { path: files.clone(), source })?;
            let latest = wandb_dir.join("latest-run");
            let _ = std::fs::remove_file(&latest);
            let _ = std::os::unix::fs::symlink(&folder, &latest);
            let mut log =
                RecordLog::create(run_dir.join(format!("run-{}.wandb", settings.run_id)))?;
            let producer = format!("accel {}", crate::VERSION);
            let version_info = VersionInfo { producer, min_consumer: "0.70.0".into() };
            log.append(Kind::Header(HeaderRecord { version_info: Some(version_info) }))?;
            Some(log)
        } else {
            None
        };
        Ok(Self {
            settings: settings.clone(),
            log,
            run_dir,
            run_written: false,
            started: Instant::now(),
            start_unix: now.as_secs_f64(),
            pending: None,
            last_step: None,
            warned_backwards: false,
        })
    }

    /// The run's folder (`wandb/offline-run-<time>-<id>`): what `wandb sync` takes.
    pub fn run_dir(&self) -> &Path {
        &self.run_dir
    }

    /// The run's id.
    pub fn run_id(&self) -> &str {
        &self.settings.run_id
    }

    /// The run record, once, with the configuration if it is known by then.
    fn write_run(&mut self, config: Option<&serde_json::Value>) -> Result<()> {
        if self.run_written {
            return Ok(());
        }
        let Some(log) = &mut self.log else { return Ok(()) };
        self.run_written = true;
        let mut update = config.map(config_items).unwrap_or_default();
        // The client's own part of every run's configuration.
        update.push(keyed("_wandb", "{}".into()));
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        let s = &self.settings;
        let start = Timestamp {
            seconds: self.start_unix.trunc() as i64,
            nanos: (self.start_unix.fract() * 1e9) as i32,
        };
        log.append(Kind::Run(RunRecord {
            run_id: s.run_id.clone(),
            entity: s.entity.clone(),
            project: s.project.clone(),
            config: Some(ConfigRecord { update }),
            display_name: s.name.clone(),
            tags: s.tags.clone(),
            host: host.trim().to_owned(),
            start_time: Some(start),
        }))
    }

    /// Writes the pending row: a summary of the latest values, then the history row.
    fn flush_row(&mut self) -> Result<()> {
        let Some((step, values)) = self.pending.take() else { return Ok(()) };
        self.write_run(None)?;
        let runtime = self.started.elapsed().as_secs_f64();
        let timestamp = self.start_unix + runtime;
        let Some(log) = &mut self.log else { return Ok(()) };
        let mut items: Vec<Item> =
            values.into_iter().map(|(k, v)| item(&[k.as_str()], v)).collect();
        items.push(item(&["_step"], step.to_string()));
        items.push(item(&["_runtime"], json_number(runtime)));
        items.push(item(&["_timestamp"], json_number(timestamp)));
        log.append(Kind::Summary(SummaryRecord { update: items.clone() }))?;
        let history = HistoryRecord { item: items, step: Some(HistoryStep { num: step as i64 }) };
        log.append(Kind::History(history))?;
        self.last_step = Some(step);
        Ok(())
    }

    /// The row of `step`, started if need be (the row before it written first); `None` where
    /// nothing is written, or for a step below one already written (dropped with a warning,
    /// as the client does: W&B's steps only go forward).
    fn row(&mut self, step: u64) -> Result<Option<&mut BTreeMap<String, String>>> {
        if self.log.is_none() {
            return Ok(None);
        }
        if self.last_step.is_some_and(|last| step <= last)
            || self.pending.as_ref().is_some_and(|(pending, _)| step < *pending)
        {
            if !self.warned_backwards {
                eprintln!(
                    "accel: W&B: step {step} comes after a later step was logged; W&B's steps \
                     only go forward, so it is dropped (as the wandb client does; said once)"
                );
                self.warned_backwards = true;
            }
            return Ok(None);
        }
        if self.pending.as_ref().is_some_and(|(pending, _)| step > *pending) {
            self.flush_row()?;
        }
        Ok(Some(&mut self.pending.get_or_insert_with(|| (step, BTreeMap::new())).1))
    }

    /// Writes a media file under the run's `files/media/<kind>/` and lists it for sync;
    /// returns its path relative to `files/` and its SHA-256.
    fn media_file(
        &mut self,
        key: &str,
        step: u64,
        kind: &str,
        extension: &str,
        bytes: &[u8],
    ) -> Result<(String, String)> {
        self.write_run(None)?;
        let sha256 = sha256_hex(bytes);
        let path = format!("media/{kind}/{}_{step}_{}.{extension}", file_stem(key), &sha256[..20]);
        let file = self.run_dir.join("files").join(&path);
        let io = |source| Error::Io { path: file.clone(), source };
        std::fs::create_dir_all(file.parent().expect("under files/")).map_err(io)?;
        std::fs::write(&file, bytes).map_err(io)?;
        if let Some(log) = &mut self.log {
            let listed = FilesItem { path: path.clone(), policy: 0, r#type: 0 };
            log.append(Kind::Files(FilesRecord { files: vec![listed] }))?;
        }
        Ok((path, sha256))
    }

    fn end(&mut self, exit_code: i32) -> Result<()> {
        if self.log.is_none() {
            return Ok(());
        }
        self.flush_row()?;
        self.write_run(None)?;
        let runtime = self.started.elapsed().as_secs_f64();
        let Some(log) = &mut self.log else { return Ok(()) };
        let seconds = runtime as i32;
        log.append(Kind::Summary(SummaryRecord {
            update: vec![
                item(&["_wandb", "runtime"], seconds.to_string()),
                keyed("_runtime", seconds.to_string()),
            ],
        }))?;
        log.append(Kind::Exit(RunExitRecord { exit_code, runtime: seconds }))?;
        log.append(Kind::Final(FinalRecord {}))?;
        log.close()?;
        self.log = None;
        eprintln!(
            "accel: W&B run {} {} offline in {}; upload it with `wandb sync {}`",
            self.settings.run_id,
            if exit_code == 0 { "finished" } else { "failed" },
            self.run_dir.display(),
            self.run_dir.display()
        );
        Ok(())
    }
}

impl Tracker for Wandb {
    fn name(&self) -> &str {
        "wandb"
    }

    fn store_init_configuration(&mut self, config: &serde_json::Value) -> Result<()> {
        if self.run_written {
            // Configuration after the run began: a config record, as `wandb.config.update`.
            let Some(log) = &mut self.log else { return Ok(()) };
            let update = config_items(config);
            return log.append(Kind::Config(ConfigRecord { update }));
        }
        self.write_run(Some(config))
    }

    /// Values at one step make one row, written when a later step begins (the client's
    /// `log(values, step=step)`); a step below the last written is dropped with a warning,
    /// as the client does (W&B's steps only go forward).
    fn log(&mut self, step: u64, values: &[(&str, f64)]) -> Result<()> {
        let Some(row) = self.row(step)? else { return Ok(()) };
        for (key, value) in values {
            row.insert((*key).to_owned(), json_number(*value));
        }
        Ok(())
    }

    /// Images as `files/media/images/<key>_<step>_<sha256>.png` and tables as
    /// `files/media/table/<key>_<step>_<sha256>.table.json`, each listed in a files record
    /// for sync and referred to from the row as the client refers to them (`image-file`,
    /// `table-file`); text as a string in the row, as the client logs a `str`.
    fn log_media(&mut self, step: u64, key: &str, value: &Value) -> Result<()> {
        if self.row(step)?.is_none() {
            return Ok(());
        }
        let value_json = match value {
            Value::Scalar(v) => json_number(*v),
            Value::Text(text) => serde_json::Value::from(text.as_str()).to_string(),
            Value::Image(image) => {
                let png = image.png()?;
                let (path, sha256) = self.media_file(key, step, "images", "png", &png)?;
                serde_json::json!({
                    "_type": "image-file", "sha256": sha256, "size": png.len(), "path": path,
                    "format": "png", "width": image.width, "height": image.height,
                })
                .to_string()
            }
            Value::Table(table) => {
                let json = table.json().to_string().into_bytes();
                let (path, sha256) = self.media_file(key, step, "table", "table.json", &json)?;
                serde_json::json!({
                    "_type": "table-file", "sha256": sha256, "size": json.len(), "path": path,
                    "ncols": table.columns.len(), "nrows": table.rows.len(),
                    "log_mode": "IMMUTABLE",
                })
                .to_string()
            }
        };
        // The row `row(step)` started above.
        if let Some((_, row)) = &mut self.pending {
            row.insert(key.to_owned(), value_json);
        }
        Ok(())
    }

    fn finish(&mut self) -> Result<()> {
        self.end(0)
    }

    fn fail(&mut self) -> Result<()> {
        self.end(1)
    }
}

impl Drop for Wandb {
    /// A run never finished (the program stopped without `end_training`) is marked failed,
    /// as the client marks a run whose process ended without `finish`.
    fn drop(&mut self) {
        if self.log.is_some() {
            let _ = self.end(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(vars: &[(&str, &str)]) -> Result<WandbSettings> {
        let vars: BTreeMap<String, String> =
            vars.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
        WandbSettings::from_env_with("proj", |k| vars.get(k).cloned())
    }

    #[test]
    fn settings_follow_the_clients_variables_and_refuse_what_it_refuses() {
        let s = settings(&[("WANDB_TAGS", "a,b c"), ("WANDB_RUN_ID", "abc123")]).unwrap();
        assert_eq!((s.project.as_str(), s.mode), ("proj", WandbMode::Offline));
        assert_eq!(s.tags, ["a", "b c"]);
        assert_eq!(s.run_id, "abc123");
        let generated = settings(&[]).unwrap().run_id;
        assert!(generated.len() == 8 && generated.chars().all(|c| c.is_ascii_alphanumeric()));
        assert_eq!(settings(&[("WANDB_MODE", "disabled")]).unwrap().mode, WandbMode::Disabled);
        for (var, value, said) in [
            ("WANDB_MODE", "online", "offline only"),
            ("WANDB_MODE", "sometimes", "not one of W&B's modes"),
            ("WANDB_TAGS", "a,,b", "1 to 64"),
            ("WANDB_RUN_ID", "a/b", "does not allow"),
        ] {
            let err = settings(&[(var, value)]).unwrap_err().to_string();
            assert!(err.contains(said) && err.contains(var), "{var}={value}: {err}");
        }
    }

    /// Records of every size land in blocks as LevelDB's log lays them out: chunk types,
    /// lengths, checksums and zeros at block ends, read back by a reader written here from
    /// the format's description.
    #[test]
    fn records_of_every_size_are_framed_in_32_kib_blocks() {
        let dir = std::env::temp_dir().join(format!("accel-wandb-frame-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("run.wandb");
        let _ = std::fs::remove_file(&path);
        let mut log = RecordLog::create(path.clone()).unwrap();
        let sizes = [0usize, 10, 32_740, 5, 70_000, 32_761, 1, 100_000, 3];
        let mut written = Vec::new();
        for (i, n) in sizes.iter().enumerate() {
            let value = "x".repeat(*n);
            let kind = Kind::Config(ConfigRecord {
                update: vec![Item { key: format!("k{i}"), nested_key: vec![], value_json: value }],
            });
            written.push(Record { num: i as i64 + 1, kind: Some(kind.clone()) });
            log.append(kind).unwrap();
        }
        log.close().unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(&bytes[..7], b":W&B\xe1\xbe\x00");
        let (mut at, mut read, mut record) = (7usize, Vec::new(), Vec::new());
        while at < bytes.len() {
            let left = BLOCK - at % BLOCK;
            if left < CHUNK_HEADER {
                assert!(bytes[at..at + left].iter().all(|b| *b == 0), "padding at {at}");
                at += left;
                continue;
            }
            let crc = u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap());
            let len = u16::from_le_bytes(bytes[at + 4..at + 6].try_into().unwrap()) as usize;
            let kind = bytes[at + 6];
            let data = &bytes[at + 7..at + 7 + len];
            assert!(at % BLOCK + 7 + len <= BLOCK, "a chunk crosses a block at {at}");
            assert_eq!(crc, crc32fast::hash(&bytes[at + 6..at + 7 + len]), "checksum at {at}");
            record.extend_from_slice(data);
            if kind == FULL || kind == LAST {
                read.push(Record::decode(record.as_slice()).unwrap());
                record.clear();
            }
            at += 7 + len;
        }
        assert_eq!(read, written);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
