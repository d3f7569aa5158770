//! Reading parts of safetensors files: each tensor's bytes found through the file's header,
//! only the byte ranges a process needs read, straight into the tensor that keeps them.
//!
//! A checkpoint's files are checked as they are read: the manifest records a CRC32 for each
//! block of every file ([`FileRecord`], in format.rs's manifest), and no byte is used before the CRC of
//! its whole block has been compared. Blocks no process needed are checked afterwards by one
//! process each ([`FileReader::verify`]), so a corrupt byte anywhere is still found — and
//! every block is read by about one process, not by all. Files of a Hugging Face checkpoint
//! have no record: they are read unchecked, as transformers reads them.

use std::collections::BTreeMap;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

use crate::error::{Error, Result};

/// Size and checksums of one file of a checkpoint: of the whole, and of each `block`-byte
/// block (the last one shorter), so that a process reading part of the file checks what it
/// reads without reading the rest. Format 2 had the whole file's only (`block` 0).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct FileRecord {
    pub bytes: u64,
    pub crc32: u32,
    #[serde(default)]
    pub block: u64,
    #[serde(default)]
    pub blocks: Vec<u32>,
}

impl FileRecord {
    /// The units a reader checks the file in: its blocks, or the whole (format 2) as one.
    pub fn checked_units(&self) -> usize {
        if self.block == 0 { 1 } else { self.blocks.len() }
    }
}

/// The largest safetensors header accepted: a checkpoint's lists each tensor's name, dtype,
/// shape and offsets (~100 bytes), so this allows well over 100,000 tensors.
pub(crate) const MAX_HEADER_BYTES: u64 = 16 << 20;

/// An I/O failure on `path`.
pub(crate) fn io_error(path: &Path, source: std::io::Error) -> Error {
    Error::Io { path: path.to_path_buf(), source }
}

/// A checkpoint file that is not what it should be, and why.
pub(crate) fn bad(path: &Path, message: impl Into<String>) -> Error {
    Error::Checkpoint { path: Some(path.to_path_buf()), message: message.into() }
}

/// Where one tensor lies in its file.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct TensorEntry {
    pub kind: Kind,
    pub shape: Vec<i64>,
    /// Offset of its first byte in the file.
    pub start: u64,
}

impl TensorEntry {
    pub fn numel(&self) -> i64 {
        self.shape.iter().product()
    }
}

pub(crate) fn kind_of(dtype: &str) -> Option<Kind> {
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

/// The tensors a safetensors header lists (`text`: its JSON), checked against the file's
/// size: each tensor's bytes must fit its dtype and shape and lie inside the file.
fn parse_header(path: &Path, text: &[u8], size: u64) -> Result<BTreeMap<String, TensorEntry>> {
    let json: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(text)
        .map_err(|e| bad(path, format!("not a safetensors file: its header: {e}")))?;
    let data_start = 8 + text.len() as u64;
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
        let numel =
            shape.iter().try_fold(1i64, |n, &d| if d < 0 { None } else { n.checked_mul(d) });
        let expected = numel.and_then(|n| (n as u64).checked_mul(kind.elt_size_in_bytes() as u64));
        let fits = end >= begin
            && Some(end - begin) == expected
            && data_start.checked_add(end).is_some_and(|last| last <= size);
        if !fits {
            return Err(bad(
                path,
                format!(
                    "tensor `{name}` ({dtype} {shape:?}) claims bytes {begin}..{end}, which do \
                     not fit it or the file ({size} bytes)"
                ),
            ));
        }
        entries.insert(name, TensorEntry { kind, shape, start: data_start + begin });
    }
    Ok(entries)
}

/// The block size of a checkpoint file of `bytes` bytes: about 64 blocks a file, 4 KiB to
/// 1 MiB each — small enough that a process reading a part of a file reads little more than
/// that part, large enough that the manifest stays small.
pub(crate) fn block_size(bytes: u64) -> u64 {
    (bytes / 64).next_power_of_two().clamp(4 << 10, 1 << 20)
}

/// The CRC32 of every `block`-byte block of the file at `path` (and of the whole file),
/// computed by reading it once, a block at a time.
pub(crate) fn checksums(path: &Path) -> Result<FileRecord> {
    let mut file = std::fs::File::open(path).map_err(|e| io_error(path, e))?;
    let bytes = file.metadata().map_err(|e| io_error(path, e))?.len();
    let block = block_size(bytes);
    let mut buffer = vec![0u8; block as usize];
    let (mut whole, mut blocks) = (crc32fast::Hasher::new(), Vec::new());
    let mut left = bytes;
    while left > 0 {
        let n = left.min(block) as usize;
        file.read_exact(&mut buffer[..n]).map_err(|e| io_error(path, e))?;
        whole.update(&buffer[..n]);
        blocks.push(crc32fast::hash(&buffer[..n]));
        left -= n as u64;
    }
    Ok(FileRecord { bytes, crc32: whole.finalize(), block, blocks })
}

/// Bytes read from checkpoint files, for [`crate::Accelerator::io_counts`].
pub(crate) type ReadCounter = AtomicU64;

/// One safetensors file opened for reading parts of its tensors.
pub(crate) struct FileReader<'c> {
    pub path: PathBuf,
    file: std::fs::File,
    size: u64,
    /// The manifest's record of the file, when it has one; its blocks checked so far.
    record: Option<FileRecord>,
    checked: Vec<bool>,
    /// The last block read whole for part of it: adjacent tensors share their edge blocks,
    /// and the next one's part is then served from here, not read again.
    last: Option<(usize, Vec<u8>)>,
    pub entries: BTreeMap<String, TensorEntry>,
    counter: &'c ReadCounter,
}

impl<'c> FileReader<'c> {
    /// Opens the file at `path` and reads its header. With a `record` (a checkpoint's file)
    /// its size is checked first and every byte read is checked against the record's CRCs;
    /// a record from before block CRCs (format version 2) has the whole file checked once,
    /// here, reading it a block at a time.
    pub fn open(
        path: &Path,
        record: Option<&FileRecord>,
        counter: &'c ReadCounter,
    ) -> Result<Self> {
        let file = std::fs::File::open(path).map_err(|e| io_error(path, e))?;
        let size = file.metadata().map_err(|e| io_error(path, e))?.len();
        if let Some(record) = record {
            if size != record.bytes {
                return Err(bad(
                    path,
                    format!(
                        "the file has {size} bytes, the manifest says {}: it is truncated or \
                         was replaced",
                        record.bytes
                    ),
                ));
            }
            let blocks = if record.block == 0 { 0 } else { size.div_ceil(record.block) };
            if record.block != 0 && record.blocks.len() as u64 != blocks {
                return Err(bad(
                    path,
                    format!(
                        "the manifest lists {} block checksums for it, its {size} bytes make \
                         {blocks}",
                        record.blocks.len()
                    ),
                ));
            }
        }
        let blocks = record.map_or(0, |r| r.blocks.len());
        let mut reader = Self {
            path: path.to_path_buf(),
            file,
            size,
            record: record.cloned(),
            checked: vec![false; blocks],
            last: None,
            entries: BTreeMap::new(),
            counter,
        };
        if record.is_some_and(|r| r.block == 0) {
            reader.check_whole()?;
        }
        let mut prefix = [0u8; 8];
        if size < 8 {
            return Err(bad(path, "not a safetensors file: shorter than its 8-byte header length"));
        }
        reader.read_at(0, &mut prefix)?;
        let header = u64::from_le_bytes(prefix);
        if header > MAX_HEADER_BYTES || header > size - 8 {
            return Err(bad(
                path,
                format!(
                    "not a safetensors file: its header claims {header} bytes ({} follow; at \
                     most {MAX_HEADER_BYTES} accepted)",
                    size - 8
                ),
            ));
        }
        let mut text = vec![0u8; header as usize];
        reader.read_at(8, &mut text)?;
        reader.entries = parse_header(path, &text, size)?;
        Ok(reader)
    }

    /// A format-2 record's whole-file CRC, checked by reading the file once.
    fn check_whole(&mut self) -> Result<()> {
        let record = self.record.clone().expect("called with a record");
        let block = block_size(self.size);
        let mut buffer = vec![0u8; block as usize];
        let mut hasher = crc32fast::Hasher::new();
        let mut at = 0;
        while at < self.size {
            let n = (self.size - at).min(block) as usize;
            self.raw_read(at, &mut buffer[..n])?;
            hasher.update(&buffer[..n]);
            at += n as u64;
        }
        if hasher.finalize() != record.crc32 {
            return Err(bad(
                &self.path,
                "the file's CRC32 does not match the manifest: it is corrupted",
            ));
        }
        // Checked whole: the reads that follow need no block checks.
        self.record = None;
        Ok(())
    }

    fn raw_read(&mut self, at: u64, into: &mut [u8]) -> Result<()> {
        self.file
            .seek(SeekFrom::Start(at))
            .and_then(|_| self.file.read_exact(into))
            .map_err(|e| io_error(&self.path, e))?;
        self.counter.fetch_add(into.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    /// The byte range of block `b`.
    fn block_range(&self, b: usize) -> (u64, u64) {
        let block = self.record.as_ref().map_or(self.size, |r| r.block);
        let start = b as u64 * block;
        (start, (start + block).min(self.size))
    }

    fn compare(&mut self, b: usize, bytes: &[u8]) -> Result<()> {
        let record = self.record.as_ref().expect("blocks come from a record");
        if crc32fast::hash(bytes) != record.blocks[b] {
            let (start, end) = self.block_range(b);
            return Err(bad(
                &self.path,
                format!(
                    "bytes {start}..{end} do not match their CRC32 in the manifest: the file \
                     is corrupted"
                ),
            ));
        }
        self.checked[b] = true;
        Ok(())
    }

    /// Reads `into.len()` bytes from offset `at`, each checked against the CRC of its block
    /// (a block is read whole, once, the first time any of it is needed).
    pub fn read_at(&mut self, at: u64, into: &mut [u8]) -> Result<()> {
        let end = at + into.len() as u64;
        if end > self.size {
            return Err(bad(&self.path, format!("bytes {at}..{end} lie past its end")));
        }
        let Some(block) = self.record.as_ref().map(|r| r.block) else {
            return self.raw_read(at, into);
        };
        let mut pos = at;
        while pos < end {
            let b = (pos / block) as usize;
            let (start, stop) = self.block_range(b);
            let upto = stop.min(end);
            let target = &mut into[(pos - at) as usize..(upto - at) as usize];
            let part = (pos - start) as usize..(upto - start) as usize;
            if let Some((_, bytes)) = self.last.as_ref().filter(|(l, _)| *l == b) {
                target.copy_from_slice(&bytes[part]);
            } else if pos == start && upto == stop {
                // The whole block is wanted: read (and check) it in place.
                self.raw_read(pos, target)?;
                if !self.checked[b] {
                    self.compare(b, target)?;
                }
            } else if self.checked[b] {
                self.raw_read(pos, target)?;
            } else {
                let mut scratch = self.last.take().map(|(_, v)| v).unwrap_or_default();
                scratch.resize((stop - start) as usize, 0);
                self.raw_read(start, &mut scratch)?;
                self.compare(b, &scratch)?;
                target.copy_from_slice(&scratch[part]);
                self.last = Some((b, scratch));
            }
            pos = upto;
        }
        Ok(())
    }

    /// The blocks of the file not checked yet (none for a file without a record).
    pub fn unchecked(&self) -> Vec<usize> {
        (0..self.checked.len()).filter(|&b| !self.checked[b]).collect()
    }

    /// Checks blocks `blocks` against their CRCs, reading one at a time.
    pub fn verify(&mut self, blocks: &[usize]) -> Result<()> {
        let mut buffer = Vec::new();
        for &b in blocks {
            if self.checked.get(b) != Some(&false) {
                continue;
            }
            let (start, stop) = self.block_range(b);
            buffer.resize((stop - start) as usize, 0);
            self.raw_read(start, &mut buffer)?;
            self.compare(b, &buffer)?;
        }
        Ok(())
    }

    /// The entry of tensor `name`.
    pub fn entry(&self, name: &str) -> Result<&TensorEntry> {
        self.entries.get(name).ok_or_else(|| bad(&self.path, format!("has no tensor `{name}`")))
    }

    /// Every tensor of the file, whole.
    pub fn read_all(&mut self) -> Result<BTreeMap<String, Tensor>> {
        let names: Vec<String> = self.entries.keys().cloned().collect();
        names
            .into_iter()
            .map(|name| {
                let entry = self.entry(&name)?.clone();
                let tensor =
                    filled(entry.numel(), entry.kind, |bytes| self.read_elements(&name, 0, bytes))?;
                Ok((name, tensor.f_view(entry.shape.as_slice())?))
            })
            .collect()
    }

    /// Elements `start..start + count` of tensor `name`, flattened, read into `into` (the
    /// bytes of `count` elements of its dtype).
    pub fn read_elements(&mut self, name: &str, start: i64, into: &mut [u8]) -> Result<()> {
        let entry = self.entry(name)?;
        let elt = entry.kind.elt_size_in_bytes() as u64;
        let count = into.len() as u64 / elt;
        if start < 0 || start as u64 + count > entry.numel() as u64 {
            return Err(bad(
                &self.path,
                format!(
                    "elements {start}..{} of `{name}` lie outside its {}",
                    start as u64 + count,
                    entry.numel()
                ),
            ));
        }
        let at = entry.start + start as u64 * elt;
        self.read_at(at, into)
    }
}

/// A new CPU tensor of `numel` elements of `kind`, zero-filled, and its bytes to fill.
pub(crate) fn filled(
    numel: i64,
    kind: Kind,
    fill: impl FnOnce(&mut [u8]) -> Result<()>,
) -> Result<Tensor> {
    let tensor = Tensor::f_zeros([numel], (kind, tch::Device::Cpu))?;
    let bytes = numel as usize * kind.elt_size_in_bytes();
    if bytes > 0 {
        // SAFETY: `tensor` is a fresh, contiguous CPU tensor of exactly `bytes` bytes that
        // nothing else refers to; the slice lives only for the call of `fill`.
        let slice =
            unsafe { std::slice::from_raw_parts_mut(tensor.data_ptr().cast::<u8>(), bytes) };
        fill(slice)?;
    }
    Ok(tensor)
}
