//! Metrics to JSONL and CSV files, on the main process only.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use super::media::file_stem;
use super::{Tracker, Value};
use crate::error::{Error, Result};

/// Appends one record per [`log`](Self::log) call to `metrics.jsonl` and `metrics.csv` in
/// its folder. On every process but the main one it writes nothing.
///
/// A fresh run truncates the files; a resumed one (`append`) adds to them.
#[derive(Debug)]
pub struct MetricsFiles {
    dir: PathBuf,
    files: Option<(BufWriter<File>, BufWriter<File>)>,
    columns: Vec<String>,
}

impl MetricsFiles {
    /// Opens the files in `dir` on the main process (`main`; elsewhere it writes nothing):
    /// truncated, or appended to with `append` (a resumed run keeps the records of the run
    /// it continues).
    pub fn new(dir: impl AsRef<Path>, main: bool, append: bool) -> Result<Self> {
        let dir = dir.as_ref().to_path_buf();
        let files = if main {
            std::fs::create_dir_all(&dir)
                .map_err(|source| Error::Io { path: dir.clone(), source })?;
            let open = |name: &str| -> Result<BufWriter<File>> {
                let path = dir.join(name);
                std::fs::OpenOptions::new()
                    .create(true)
                    .write(true)
                    .append(append)
                    .truncate(!append)
                    .open(&path)
                    .map(BufWriter::new)
                    .map_err(|source| Error::Io { path, source })
            };
            Some((open("metrics.jsonl")?, open("metrics.csv")?))
        } else {
            None
        };
        // When appending, the CSV header already written fixes the columns.
        let columns = std::fs::read_to_string(dir.join("metrics.csv"))
            .ok()
            .filter(|_| append)
            .and_then(|text| text.lines().next().map(str::to_owned))
            .and_then(|header| header.strip_prefix("step,").map(str::to_owned))
            .map(|cols| cols.split(',').map(str::to_owned).collect())
            .unwrap_or_default();
        Ok(Self { dir, files, columns })
    }

    /// Records `metrics` at `step`. The first record fixes the CSV columns; a later record
    /// with a metric outside them is an error naming it (the JSONL file takes anything).
    pub fn log(&mut self, step: u64, metrics: &[(&str, f64)]) -> Result<()> {
        let Some((jsonl, csv)) = &mut self.files else { return Ok(()) };
        let io = |e| Error::Io { path: self.dir.clone(), source: e };
        if self.columns.is_empty() {
            self.columns = metrics.iter().map(|(k, _)| (*k).to_owned()).collect();
            writeln!(csv, "step,{}", self.columns.join(",")).map_err(io)?;
        }
        let values: BTreeMap<&str, f64> = metrics.iter().copied().collect();
        if let Some((unknown, _)) =
            metrics.iter().find(|(k, _)| !self.columns.iter().any(|c| c == k))
        {
            return Err(Error::Config(format!(
                "metric `{unknown}` is not among the CSV columns {:?} fixed by the first record",
                self.columns
            )));
        }
        let mut record = serde_json::Map::new();
        record.insert("step".into(), step.into());
        for (k, v) in metrics {
            record.insert(
                (*k).into(),
                serde_json::Number::from_f64(*v).map_or(serde_json::Value::Null, Into::into),
            );
        }
        writeln!(jsonl, "{}", serde_json::Value::Object(record)).map_err(io)?;
        let row: Vec<String> = self
            .columns
            .iter()
            .map(|c| values.get(c.as_str()).map_or(String::new(), f64::to_string))
            .collect();
        writeln!(csv, "{step},{}", row.join(",")).map_err(io)?;
        jsonl.flush().map_err(io)?;
        csv.flush().map_err(io)
    }
}

impl Tracker for MetricsFiles {
    fn name(&self) -> &str {
        "jsonl"
    }

    fn log(&mut self, step: u64, values: &[(&str, f64)]) -> Result<()> {
        MetricsFiles::log(self, step, values)
    }

    /// The image (PNG), text or table (JSON: columns and data) in `media/<key>_<step>.*`
    /// beside the metrics, and a JSONL record pointing at it: `{"step": 10, "wrong":
    /// {"_type": "image", "path": "media/wrong_10.png"}}` (the CSV keeps numbers only).
    fn log_media(&mut self, step: u64, key: &str, value: &Value) -> Result<()> {
        let Some((jsonl, _)) = &mut self.files else { return Ok(()) };
        let (bytes, extension) = match value {
            Value::Scalar(_) => return Ok(()),
            Value::Image(image) => (image.png()?, "png"),
            Value::Text(text) => (text.clone().into_bytes(), "txt"),
            Value::Table(table) => (table.json().to_string().into_bytes(), "json"),
        };
        let relative = format!("media/{}_{step}.{extension}", file_stem(key));
        let path = self.dir.join(&relative);
        let io = |path: &std::path::Path| {
            let path = path.to_path_buf();
            move |source| Error::Io { path, source }
        };
        std::fs::create_dir_all(self.dir.join("media")).map_err(io(&self.dir.join("media")))?;
        std::fs::write(&path, bytes).map_err(io(&path))?;
        let record = serde_json::json!({
            "step": step,
            key: { "_type": value.kind(), "path": relative },
        });
        writeln!(jsonl, "{record}").map_err(io(&self.dir))?;
        jsonl.flush().map_err(io(&self.dir))
    }

    fn store_init_configuration(&mut self, config: &serde_json::Value) -> Result<()> {
        if self.files.is_none() {
            return Ok(());
        }
        let path = self.dir.join("hparams.json");
        let text = serde_json::to_string_pretty(config).unwrap_or_default();
        std::fs::write(&path, text + "\n").map_err(|source| Error::Io { path, source })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_go_to_both_files_and_unknown_columns_are_refused() {
        let dir = std::env::temp_dir().join(format!("accel-tracker-{}", std::process::id()));
        let mut tracker = MetricsFiles::new(&dir, true, false).unwrap();
        tracker.log(1, &[("loss", 0.5), ("lr", 0.001)]).unwrap();
        tracker.log(2, &[("loss", 0.25)]).unwrap();
        let err = tracker.log(3, &[("accuracy", 0.9)]).unwrap_err();
        assert!(err.to_string().contains("`accuracy`"), "{err}");
        let jsonl = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
        assert_eq!(jsonl.lines().next().unwrap(), r#"{"loss":0.5,"lr":0.001,"step":1}"#);
        let csv = std::fs::read_to_string(dir.join("metrics.csv")).unwrap();
        assert_eq!(csv, "step,loss,lr\n1,0.5,0.001\n2,0.25,\n");
        drop(tracker);
        let mut resumed = MetricsFiles::new(&dir, true, true).unwrap();
        resumed.log(3, &[("lr", 0.002)]).unwrap();
        let csv = std::fs::read_to_string(dir.join("metrics.csv")).unwrap();
        assert_eq!(csv, "step,loss,lr\n1,0.5,0.001\n2,0.25,\n3,,0.002\n");
        let _ = std::fs::remove_dir_all(dir);
    }
}
