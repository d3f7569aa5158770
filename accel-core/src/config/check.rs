//! What accel makes of each key of a configuration file (`accel config check`): taken and
//! what it becomes, ignored and why, a performance hint accel warns about, or refused.
//! The readers of Accelerate's YAML and DeepSpeed's JSON write one note per key they meet,
//! so nothing in a file is dropped without a word: `accel launch` refuses a file with a
//! refused key (naming every one) and prints the hints as warnings.

use std::fmt;

use crate::error::{Error, Result};

/// What accel does with one key.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// Taken: the setting it becomes.
    Applied(String),
    /// Read and ignored: why it has no meaning here (another platform, the launcher's own
    /// machinery, a default accel always has).
    Ignored(String),
    /// Only tunes speed or memory in Accelerate/DeepSpeed and accel does not do it:
    /// `accel launch` warns and goes on.
    Hint(String),
    /// Not implemented, or a wrong value: `accel launch` refuses the file.
    Refused(String),
}

impl Verdict {
    fn label(&self) -> &'static str {
        match self {
            Verdict::Applied(_) => "applied",
            Verdict::Ignored(_) => "ignored",
            Verdict::Hint(_) => "warning",
            Verdict::Refused(_) => "refused",
        }
    }

    fn text(&self) -> &str {
        match self {
            Verdict::Applied(t) | Verdict::Ignored(t) | Verdict::Hint(t) | Verdict::Refused(t) => t,
        }
    }
}

/// One key of a file (dotted for nested keys) and what accel does with it.
#[derive(Debug, Clone, PartialEq)]
pub struct Note {
    /// `fsdp_config.fsdp_offload_params`, `zero_optimization.stage`; `(file)` for what
    /// concerns several keys together.
    pub key: String,
    /// The value as written (compact).
    pub value: String,
    /// What accel does with it.
    pub verdict: Verdict,
}

/// The notes of one file, in the file's order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Report {
    /// One per key.
    pub notes: Vec<Note>,
}

impl Report {
    pub(crate) fn push(&mut self, key: impl Into<String>, value: impl Into<String>, v: Verdict) {
        self.notes.push(Note { key: key.into(), value: value.into(), verdict: v });
    }

    /// Notes of another file this one names (DeepSpeed's JSON from a YAML), under `prefix`.
    pub(crate) fn extend_prefixed(&mut self, prefix: &str, other: Report) {
        for mut note in other.notes {
            note.key = format!("{prefix}{}", note.key);
            self.notes.push(note);
        }
    }

    /// The refused keys, as one error naming each (`None` when the file can be launched);
    /// `file` is the path, or `None` for text that is no file.
    pub fn refusal(&self, file: Option<&str>) -> Option<Error> {
        let refused: Vec<String> = self
            .notes
            .iter()
            .filter_map(|n| match &n.verdict {
                Verdict::Refused(why) => Some(format!("`{}` ({why})", n.key)),
                _ => None,
            })
            .collect();
        (!refused.is_empty()).then(|| {
            let refused = refused.join("; ");
            Error::Config(match file {
                Some(file) => format!(
                    "{file}: accel cannot run with {refused} (`accel config check {file}` \
                     says what accel makes of each key)"
                ),
                None => format!("accel cannot run with {refused}"),
            })
        })
    }

    /// One warning naming the performance hints accel does not follow, if any.
    pub fn warning(&self, file: &str) -> Option<String> {
        let hints: Vec<&str> = self
            .notes
            .iter()
            .filter(|n| matches!(n.verdict, Verdict::Hint(_)))
            .map(|n| n.key.as_str())
            .collect();
        (!hints.is_empty()).then(|| {
            format!(
                "{file}: not followed (performance settings only; `accel config check {file}` \
                 says why): {}",
                hints.join(", ")
            )
        })
    }

    /// Counts of (applied, ignored, warnings, refused).
    pub fn counts(&self) -> [usize; 4] {
        let mut counts = [0; 4];
        for n in &self.notes {
            counts[match n.verdict {
                Verdict::Applied(_) => 0,
                Verdict::Ignored(_) => 1,
                Verdict::Hint(_) => 2,
                Verdict::Refused(_) => 3,
            }] += 1;
        }
        counts
    }

    /// Fails with [`refusal`](Self::refusal) when a key is refused.
    pub fn check(&self, file: Option<&str>) -> Result<()> {
        self.refusal(file).map_or(Ok(()), Err)
    }
}

impl fmt::Display for Report {
    /// One line per key: `key = value  <label>  <what>`, then the counts.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let width =
            self.notes.iter().map(|n| n.key.len() + n.value.len() + 3).max().unwrap_or(0).min(60);
        for n in &self.notes {
            let left = format!("{} = {}", n.key, n.value);
            writeln!(f, "{left:<width$}  {:<7}  {}", n.verdict.label(), n.verdict.text())?;
        }
        let [applied, ignored, hints, refused] = self.counts();
        write!(
            f,
            "{} keys: {applied} applied, {ignored} ignored, {hints} warned about, {refused} refused",
            self.notes.len()
        )
    }
}

/// A YAML or JSON value, compact and on one line, for the report.
pub(crate) fn show_yaml(value: &serde_yaml_ng::Value) -> String {
    match value {
        serde_yaml_ng::Value::Null => "null".into(),
        serde_yaml_ng::Value::String(s) => s.clone(),
        other => serde_json::to_string(other).unwrap_or_else(|_| format!("{other:?}")),
    }
}
