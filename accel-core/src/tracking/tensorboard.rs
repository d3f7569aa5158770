//! TensorBoard event files, written by the main process: TFRecord framing (length,
//! masked CRC-32C of the length, the bytes, masked CRC-32C of the bytes) around `Event`
//! protocol buffers — the file version, one scalar summary per logged value, and the
//! hyperparameters as the hparams plugin's session records, so that TensorBoard's
//! SCALARS and HPARAMS tabs show the run. The messages are declared here with prost's
//! derive, field numbers as in TensorFlow's `event.proto`, `summary.proto` and the hparams
//! plugin's `api.proto` / `plugin_data.proto`.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use prost::Message;

use super::{Tracker, Value};
use crate::error::{Error, Result};

/// `tensorflow.Event`.
#[derive(Clone, PartialEq, prost::Message)]
struct Event {
    #[prost(double, tag = "1")]
    wall_time: f64,
    #[prost(int64, tag = "2")]
    step: i64,
    #[prost(oneof = "What", tags = "3, 5")]
    what: Option<What>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
enum What {
    #[prost(string, tag = "3")]
    FileVersion(String),
    #[prost(message, tag = "5")]
    Summary(Summary),
}

/// `tensorflow.Summary`.
#[derive(Clone, PartialEq, prost::Message)]
struct Summary {
    #[prost(message, repeated, tag = "1")]
    value: Vec<SummaryValue>,
}

/// `tensorflow.Summary.Value` (the scalar form, and metadata for plugin records).
#[derive(Clone, PartialEq, prost::Message)]
struct SummaryValue {
    #[prost(string, tag = "1")]
    tag: String,
    #[prost(float, optional, tag = "2")]
    simple_value: Option<f32>,
    #[prost(message, optional, tag = "4")]
    image: Option<SummaryImage>,
    #[prost(message, optional, tag = "8")]
    tensor: Option<TensorProto>,
    #[prost(message, optional, tag = "9")]
    metadata: Option<SummaryMetadata>,
}

/// `tensorflow.Summary.Image`: an encoded (PNG) image.
#[derive(Clone, PartialEq, prost::Message)]
struct SummaryImage {
    #[prost(int32, tag = "1")]
    height: i32,
    #[prost(int32, tag = "2")]
    width: i32,
    /// 1 grey, 3 RGB.
    #[prost(int32, tag = "3")]
    colorspace: i32,
    #[prost(bytes = "vec", tag = "4")]
    encoded_image_string: Vec<u8>,
}

/// `tensorflow.TensorProto`, as the text plugin reads it: a string scalar.
#[derive(Clone, PartialEq, prost::Message)]
struct TensorProto {
    /// `DataType`: 7 is `DT_STRING`.
    #[prost(int32, tag = "1")]
    dtype: i32,
    #[prost(message, optional, tag = "2")]
    tensor_shape: Option<TensorShape>,
    #[prost(bytes = "vec", repeated, tag = "8")]
    string_val: Vec<Vec<u8>>,
}

/// `tensorflow.TensorShapeProto` (no dimensions: a scalar).
#[derive(Clone, PartialEq, prost::Message)]
struct TensorShape {}

/// `tensorflow.SummaryMetadata`.
#[derive(Clone, PartialEq, prost::Message)]
struct SummaryMetadata {
    #[prost(message, optional, tag = "1")]
    plugin_data: Option<PluginData>,
}

/// `tensorflow.SummaryMetadata.PluginData`.
#[derive(Clone, PartialEq, prost::Message)]
struct PluginData {
    #[prost(string, tag = "1")]
    plugin_name: String,
    #[prost(bytes = "vec", tag = "2")]
    content: Vec<u8>,
}

/// `tensorboard.hparams.HParamsPluginData`.
#[derive(Clone, PartialEq, prost::Message)]
struct HParamsPluginData {
    #[prost(int32, tag = "1")]
    version: i32,
    #[prost(oneof = "HParamsData", tags = "2, 3, 4")]
    data: Option<HParamsData>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
enum HParamsData {
    #[prost(message, tag = "2")]
    Experiment(Experiment),
    #[prost(message, tag = "3")]
    SessionStartInfo(SessionStartInfo),
    #[prost(message, tag = "4")]
    SessionEndInfo(SessionEndInfo),
}

/// `tensorboard.hparams.Experiment`.
#[derive(Clone, PartialEq, prost::Message)]
struct Experiment {
    #[prost(double, tag = "3")]
    time_created_secs: f64,
    #[prost(message, repeated, tag = "4")]
    hparam_infos: Vec<HParamInfo>,
    #[prost(message, repeated, tag = "5")]
    metric_infos: Vec<MetricInfo>,
}

/// `tensorboard.hparams.HParamInfo` (name and type).
#[derive(Clone, PartialEq, prost::Message)]
struct HParamInfo {
    #[prost(string, tag = "1")]
    name: String,
    /// `DataType`: 1 string, 2 bool, 3 float64.
    #[prost(int32, tag = "4")]
    r#type: i32,
}

/// `tensorboard.hparams.MetricInfo`.
#[derive(Clone, PartialEq, prost::Message)]
struct MetricInfo {
    #[prost(message, optional, tag = "1")]
    name: Option<MetricName>,
}

/// `tensorboard.hparams.MetricName`.
#[derive(Clone, PartialEq, prost::Message)]
struct MetricName {
    #[prost(string, tag = "1")]
    group: String,
    #[prost(string, tag = "2")]
    tag: String,
}

/// `tensorboard.hparams.SessionStartInfo`.
#[derive(Clone, PartialEq, prost::Message)]
struct SessionStartInfo {
    #[prost(map = "string, message", tag = "1")]
    hparams: std::collections::HashMap<String, ProtoValue>,
    #[prost(double, tag = "5")]
    start_time_secs: f64,
}

/// `tensorboard.hparams.SessionEndInfo`.
#[derive(Clone, PartialEq, prost::Message)]
struct SessionEndInfo {
    /// `Status`: 1 success.
    #[prost(int32, tag = "1")]
    status: i32,
    #[prost(double, tag = "2")]
    end_time_secs: f64,
}

/// `google.protobuf.Value`: a number, a string or a bool.
#[derive(Clone, PartialEq, prost::Message)]
struct ProtoValue {
    #[prost(oneof = "Kind", tags = "2, 3, 4")]
    kind: Option<Kind>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
enum Kind {
    #[prost(double, tag = "2")]
    Number(f64),
    #[prost(string, tag = "3")]
    Text(String),
    #[prost(bool, tag = "4")]
    Bool(bool),
}

fn now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

/// TFRecord's masked CRC-32C.
fn masked_crc(bytes: &[u8]) -> u32 {
    let crc = crc32c::crc32c(bytes);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// Writes one run's event file (`events.out.tfevents.{time}.{host}` in its folder).
#[derive(Debug)]
pub struct TensorBoard {
    path: PathBuf,
    out: Option<BufWriter<File>>,
    /// Metric tags logged so far, for the hparams experiment written at the end.
    tags: Vec<String>,
    hparams: Vec<(String, i32)>,
}

impl TensorBoard {
    /// A new event file in `dir` (created if missing); `main` false writes nothing (every
    /// process but the main one).
    pub fn new(dir: &Path, main: bool) -> Result<Self> {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_owned())
            .unwrap_or_else(|_| "localhost".into());
        // Unique per writer: two in one folder within a second must not share a file.
        static WRITERS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let path = dir.join(format!(
            "events.out.tfevents.{}.{host}.{}.{}",
            now() as u64,
            std::process::id(),
            WRITERS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        let mut board = Self { path, out: None, tags: Vec::new(), hparams: Vec::new() };
        if main {
            std::fs::create_dir_all(dir)
                .map_err(|source| Error::Io { path: dir.to_path_buf(), source })?;
            let file = File::create(&board.path)
                .map_err(|source| Error::Io { path: board.path.clone(), source })?;
            board.out = Some(BufWriter::new(file));
            board.write(&Event {
                wall_time: now(),
                step: 0,
                what: Some(What::FileVersion("brain.Event:2".into())),
            })?;
        }
        Ok(board)
    }

    /// The event file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn write(&mut self, event: &Event) -> Result<()> {
        let Some(out) = &mut self.out else { return Ok(()) };
        let data = event.encode_to_vec();
        let length = (data.len() as u64).to_le_bytes();
        let io = |source| Error::Io { path: self.path.clone(), source };
        out.write_all(&length).map_err(io)?;
        out.write_all(&masked_crc(&length).to_le_bytes()).map_err(io)?;
        out.write_all(&data).map_err(io)?;
        out.write_all(&masked_crc(&data).to_le_bytes()).map_err(io)?;
        out.flush().map_err(io)
    }

    fn hparams_record(&mut self, tag: &str, data: HParamsData) -> Result<()> {
        let content = HParamsPluginData { version: 0, data: Some(data) }.encode_to_vec();
        let metadata = SummaryMetadata {
            plugin_data: Some(PluginData { plugin_name: "hparams".into(), content }),
        };
        let value =
            SummaryValue { tag: tag.into(), metadata: Some(metadata), ..Default::default() };
        self.write(&Event {
            wall_time: now(),
            step: 0,
            what: Some(What::Summary(Summary { value: vec![value] })),
        })
    }
}

impl Tracker for TensorBoard {
    fn name(&self) -> &str {
        "tensorboard"
    }

    /// Scalars, one summary value each (TensorBoard reads them as float scalars).
    fn log(&mut self, step: u64, values: &[(&str, f64)]) -> Result<()> {
        for (tag, _) in values {
            if !self.tags.iter().any(|t| t == tag) {
                self.tags.push((*tag).to_owned());
            }
        }
        let value = values
            .iter()
            .map(|(tag, v)| SummaryValue {
                tag: (*tag).to_owned(),
                simple_value: Some(*v as f32),
                ..Default::default()
            })
            .collect();
        self.write(&Event {
            wall_time: now(),
            step: step as i64,
            what: Some(What::Summary(Summary { value })),
        })
    }

    /// Images as image summaries (PNG), text and tables (as Markdown) as the text plugin's
    /// string tensors: TensorBoard's IMAGES and TEXT tabs.
    fn log_media(&mut self, step: u64, key: &str, value: &Value) -> Result<()> {
        let value = match value {
            Value::Scalar(_) => return Ok(()),
            Value::Image(image) => SummaryValue {
                tag: key.to_owned(),
                image: Some(SummaryImage {
                    height: image.height as i32,
                    width: image.width as i32,
                    colorspace: i32::from(image.channels),
                    encoded_image_string: image.png()?,
                }),
                ..Default::default()
            },
            Value::Text(_) | Value::Table(_) => {
                let text = match value {
                    Value::Table(table) => table.markdown(),
                    Value::Text(text) => text.clone(),
                    _ => unreachable!("matched above"),
                };
                let plugin = PluginData { plugin_name: "text".into(), content: Vec::new() };
                SummaryValue {
                    tag: key.to_owned(),
                    tensor: Some(TensorProto {
                        dtype: 7,
                        tensor_shape: Some(TensorShape {}),
                        string_val: vec![text.into_bytes()],
                    }),
                    metadata: Some(SummaryMetadata { plugin_data: Some(plugin) }),
                    ..Default::default()
                }
            }
        };
        self.write(&Event {
            wall_time: now(),
            step: step as i64,
            what: Some(What::Summary(Summary { value: vec![value] })),
        })
    }

    /// The hyperparameters as the hparams plugin's session start (numbers, strings and
    /// bools; anything else as its JSON text), flattened with `.` between nested keys.
    fn store_init_configuration(&mut self, config: &serde_json::Value) -> Result<()> {
        let mut flat = Vec::new();
        flatten("", config, &mut flat);
        self.hparams.clear();
        let mut hparams = std::collections::HashMap::new();
        for (name, value) in flat {
            let (kind, ty) = match value {
                serde_json::Value::Number(n) => (Kind::Number(n.as_f64().unwrap_or(f64::NAN)), 3),
                serde_json::Value::Bool(b) => (Kind::Bool(*b), 2),
                serde_json::Value::String(s) => (Kind::Text(s.clone()), 1),
                other => (Kind::Text(other.to_string()), 1),
            };
            self.hparams.push((name.clone(), ty));
            hparams.insert(name, ProtoValue { kind: Some(kind) });
        }
        let start = SessionStartInfo { hparams, start_time_secs: now() };
        self.hparams_record("_hparams_/session_start_info", HParamsData::SessionStartInfo(start))
    }

    /// The hparams experiment (which hyperparameters and metrics the run has) and the end
    /// of the session, then the file is closed.
    fn finish(&mut self) -> Result<()> {
        if self.out.is_none() {
            return Ok(());
        }
        if !self.hparams.is_empty() {
            let experiment = Experiment {
                time_created_secs: now(),
                hparam_infos: self
                    .hparams
                    .iter()
                    .map(|(name, ty)| HParamInfo { name: name.clone(), r#type: *ty })
                    .collect(),
                metric_infos: self
                    .tags
                    .iter()
                    .map(|tag| MetricInfo {
                        name: Some(MetricName { group: String::new(), tag: tag.clone() }),
                    })
                    .collect(),
            };
            self.hparams_record("_hparams_/experiment", HParamsData::Experiment(experiment))?;
            let end = SessionEndInfo { status: 1, end_time_secs: now() };
            self.hparams_record("_hparams_/session_end_info", HParamsData::SessionEndInfo(end))?;
        }
        self.out = None;
        Ok(())
    }
}

fn flatten<'a>(
    prefix: &str,
    value: &'a serde_json::Value,
    out: &mut Vec<(String, &'a serde_json::Value)>,
) {
    match value {
        serde_json::Value::Object(map) => {
            for (k, v) in map {
                let name = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
                flatten(&name, v, out);
            }
        }
        other if !prefix.is_empty() => out.push((prefix.to_owned(), other)),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// TFRecord's framing as TensorFlow computes it: crc32c("") masked is 0xa282ead8, and
    /// the record of one known event reads back through prost.
    #[test]
    fn records_are_framed_with_masked_crc32c_and_decode_back() {
        assert_eq!(masked_crc(b""), 0xa282_ead8);
        // crc32c("123456789") = 0xe3069283, TensorFlow's test vector.
        assert_eq!(crc32c::crc32c(b"123456789"), 0xe306_9283);
        let dir = std::env::temp_dir().join(format!("accel-tb-{}", std::process::id()));
        let mut board = TensorBoard::new(&dir, true).unwrap();
        board.log(7, &[("loss", 0.5)]).unwrap();
        board.finish().unwrap();
        let bytes = std::fs::read(board.path()).unwrap();
        let mut events = Vec::new();
        let mut at = 0;
        while at < bytes.len() {
            let len = u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap()) as usize;
            let len_crc = u32::from_le_bytes(bytes[at + 8..at + 12].try_into().unwrap());
            assert_eq!(len_crc, masked_crc(&bytes[at..at + 8]));
            let data = &bytes[at + 12..at + 12 + len];
            let crc = u32::from_le_bytes(bytes[at + 12 + len..at + 16 + len].try_into().unwrap());
            assert_eq!(crc, masked_crc(data));
            events.push(Event::decode(data).unwrap());
            at += 16 + len;
        }
        assert_eq!(events[0].what, Some(What::FileVersion("brain.Event:2".into())));
        let Some(What::Summary(summary)) = &events[1].what else { panic!("{events:?}") };
        assert_eq!((events[1].step, summary.value[0].tag.as_str()), (7, "loss"));
        assert_eq!(summary.value[0].simple_value, Some(0.5));
        let _ = std::fs::remove_dir_all(dir);
    }
}
