//! Experiment tracking, as Accelerate's: `log_with` chooses the trackers,
//! [`Accelerator::init_trackers`](crate::Accelerator::init_trackers) starts them with the
//! run's hyperparameters, [`log`](crate::Accelerator::log) records values at a step,
//! [`end_training`](crate::Accelerator::end_training) closes them (those methods are in
//! `accelerator/tracking.rs`; this module knows nothing of the accelerator). Only the main
//! process writes. Built in: TensorBoard event files ([`TensorBoard`]), JSONL + CSV files
//! ([`MetricsFiles`]), an MLflow server ([`MlFlow`]) and Weights & Biases offline runs
//! ([`Wandb`]); a [`Tracker`] of one's own is added with
//! [`add_tracker`](crate::Accelerator::add_tracker), and any of them reached with
//! [`get_tracker`](crate::Accelerator::get_tracker). Also here: plots of the
//! metrics ([`plot`]) and the progress bar.

mod files;
mod media;
mod mlflow;
pub mod plot;
mod tensorboard;
mod wandb;

use std::path::PathBuf;

use indicatif::ProgressBar;

pub use crate::config::LogWith;
pub use files::MetricsFiles;
pub use media::{Image, Table, Value};
pub use mlflow::{MlFlow, MlFlowSettings};
pub use tensorboard::TensorBoard;
pub use wandb::{Wandb, WandbMode, WandbSettings};

use crate::error::Result;

/// Where a run's values go (Accelerate's `GeneralTracker`). Trackers live on the main
/// process only; every method may assume it.
pub trait Tracker: Send + AsAny {
    /// Its name (`log_with`'s spelling for the built-in ones).
    fn name(&self) -> &str;
    /// Records the run's hyperparameters, once, when the trackers start.
    fn store_init_configuration(&mut self, config: &serde_json::Value) -> Result<()> {
        let _ = config;
        Ok(())
    }
    /// Records `values` at `step`.
    fn log(&mut self, step: u64, values: &[(&str, f64)]) -> Result<()>;
    /// Records `value` (an image, text or a table; never a [`Value::Scalar`], which goes to
    /// [`log`](Self::log)) under `key` at `step`. A tracker that keeps numbers only leaves it
    /// as it is: nothing is written.
    fn log_media(&mut self, step: u64, key: &str, value: &Value) -> Result<()> {
        let _ = (step, key, value);
        Ok(())
    }
    /// Flushes and closes, at the end of training.
    fn finish(&mut self) -> Result<()> {
        Ok(())
    }
    /// Flushes and closes when the run ends by an error (an `#[accelerate]` function that
    /// fails); a tracker with a run status records it as failed.
    fn fail(&mut self) -> Result<()> {
        self.finish()
    }
}

/// A tracker as [`std::any::Any`], so that
/// [`get_tracker`](crate::Accelerator::get_tracker) can hand out the type it is (every
/// `'static` type has it).
pub trait AsAny: std::any::Any {
    /// `self`, to downcast.
    fn as_any(&self) -> &dyn std::any::Any;
    /// `self`, to downcast mutably.
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any;
}

impl<T: std::any::Any> AsAny for T {
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}

/// The trackers of a run, and where they write.
#[derive(Default)]
pub(crate) struct Trackers {
    pub(crate) log_with: Vec<LogWith>,
    pub(crate) project_dir: Option<PathBuf>,
    pub(crate) started: Vec<Box<dyn Tracker>>,
    /// Added before `init_trackers`.
    pub(crate) pending: Vec<Box<dyn Tracker>>,
    /// Whether `init_trackers` ran.
    pub(crate) initialised: bool,
}

/// A bar that writes plain lines (no terminal to redraw on): `progress 120/600 (20%) 45.2/s
/// eta 0:10 loss 1.73`, to standard output: at most every 10 % or 30 s, or every second
/// under an `accel launch` on a terminal, which keeps the latest on one line.
pub(crate) fn plain_progress(len: u64) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(Some(len), indicatif::ProgressDrawTarget::hidden());
    let watcher = bar.downgrade();
    let redrawn = std::env::var(crate::config::env::PROGRESS).is_ok_and(|v| v == "tty");
    let _ = std::thread::Builder::new().name("accel-progress".into()).spawn(move || {
        let (mut last_pos, mut last_time) = (0u64, std::time::Instant::now());
        loop {
            std::thread::sleep(std::time::Duration::from_millis(250));
            let Some(bar) = watcher.upgrade() else { return };
            let pos = bar.position();
            let total = bar.length().unwrap_or(0).max(1);
            let done = bar.is_finished();
            let tenth = (pos * 10 / total) > (last_pos * 10 / total);
            let every = if redrawn { 1 } else { 30 };
            if done || tenth || (pos != last_pos && last_time.elapsed().as_secs() >= every) {
                let eta = bar.eta().as_secs();
                let message = bar.message();
                println!(
                    "{}{pos}/{total} ({:.0}%) {:.1}/s eta {}:{:02}{}{}",
                    crate::config::env::PROGRESS_PREFIX,
                    100.0 * pos as f64 / total as f64,
                    bar.per_sec(),
                    eta / 60,
                    eta % 60,
                    if message.is_empty() { "" } else { " " },
                    message
                );
                (last_pos, last_time) = (pos, std::time::Instant::now());
            }
            if done {
                return;
            }
        }
    });
    bar
}
