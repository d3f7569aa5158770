//! Experiment tracking, as Accelerate's: `log_with` chooses the trackers,
//! [`Accelerator::init_trackers`] starts them with the run's hyperparameters,
//! [`Accelerator::log`] records values at a step, [`Accelerator::end_training`] closes
//! them. Only the main process writes. Built in: TensorBoard event files
//! ([`TensorBoard`]), JSONL + CSV files ([`MetricsFiles`]) and an MLflow server
//! ([`MlFlow`]); a [`Tracker`] of one's own is added with [`Accelerator::add_tracker`]. Also here: plots of the metrics
//! ([`plot`]) and the progress bar.

mod files;
mod mlflow;
pub mod plot;
mod tensorboard;

use std::io::IsTerminal;
use std::path::PathBuf;

use indicatif::{ProgressBar, ProgressStyle};

pub use crate::config::LogWith;
pub use files::MetricsFiles;
pub use mlflow::{MlFlow, MlFlowSettings};
pub use tensorboard::TensorBoard;

use crate::accelerator::Accelerator;
use crate::error::{Error, Result};

/// Where a run's values go (Accelerate's `GeneralTracker`). Trackers live on the main
/// process only; every method may assume it.
pub trait Tracker: Send {
    /// Its name (`log_with`'s spelling for the built-in ones).
    fn name(&self) -> &str;
    /// Records the run's hyperparameters, once, when the trackers start.
    fn store_init_configuration(&mut self, config: &serde_json::Value) -> Result<()> {
        let _ = config;
        Ok(())
    }
    /// Records `values` at `step`.
    fn log(&mut self, step: u64, values: &[(&str, f64)]) -> Result<()>;
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

impl Accelerator {
    /// Starts the trackers `log_with` named (the builder's `.log_with`, else
    /// `ACCEL_LOG_WITH`, `accel launch --log-with` or the config file's `log_with`) and
    /// those added with [`add_tracker`](Self::add_tracker), and records `config` (the run's
    /// hyperparameters) in each. Files go to `project_dir/project_name` (the builder's
    /// `.project_dir`, else `runs`); a run resumed from a checkpoint before this call adds
    /// to its `metrics.jsonl` instead of starting it over. MLflow's run goes to the
    /// experiment `MLFLOW_EXPERIMENT_NAME`, else `project_name`. Only the main process
    /// writes; call it on every process.
    pub fn init_trackers(&self, project_name: &str, config: &serde_json::Value) -> Result<()> {
        let resumed = self.counters().micro_steps_total > 0;
        let mut trackers = self.trackers();
        if trackers.initialised {
            return Err(Error::Config("init_trackers was called twice".into()));
        }
        trackers.initialised = true;
        let main = self.is_main_process();
        let dir = trackers.project_dir.clone().unwrap_or_else(|| "runs".into()).join(project_name);
        let wanted =
            |which: LogWith| trackers.log_with.iter().any(|w| *w == which || *w == LogWith::All);
        let mut started: Vec<Box<dyn Tracker>> = Vec::new();
        if wanted(LogWith::TensorBoard) {
            started.push(Box::new(TensorBoard::new(&dir, main)?));
        }
        if wanted(LogWith::Jsonl) {
            started.push(Box::new(MetricsFiles::open(&dir, main, resumed)?));
        }
        // `all` is every tracker that can run here, as Accelerate's is every one installed:
        // MLflow when a server is named.
        let mlflow = trackers.log_with.contains(&LogWith::MlFlow)
            || (wanted(LogWith::All) && std::env::var_os("MLFLOW_TRACKING_URI").is_some());
        if mlflow {
            // Every process checks the settings, so that a bad one stops them all alike.
            let settings = MlFlowSettings::from_env(project_name)?;
            if main {
                started.push(Box::new(MlFlow::start(&settings)?));
            }
        }
        started.append(&mut trackers.pending);
        if main {
            for tracker in &mut started {
                tracker.store_init_configuration(config)?;
            }
        }
        trackers.started = started;
        Ok(())
    }

    /// Adds a tracker of one's own (Accelerate's custom `GeneralTracker`), on the main
    /// process; before [`init_trackers`](Self::init_trackers), which starts it.
    pub fn add_tracker(&self, tracker: Box<dyn Tracker>) {
        if self.is_main_process() {
            self.trackers().pending.push(tracker);
        }
    }

    /// Records `values` at `step` in every tracker (main process only; elsewhere nothing).
    pub fn log(&self, step: u64, values: &[(&str, f64)]) -> Result<()> {
        if !self.is_main_process() {
            return Ok(());
        }
        for tracker in &mut self.trackers().started {
            tracker.log(step, values)?;
        }
        Ok(())
    }

    /// Finishes every tracker (from [`Accelerator::end_training`]), or with `failed`
    /// records that the run ended by an error. Trackers named by `log_with` but never
    /// started (no `init_trackers`) are warned of, once.
    pub(crate) fn finish_trackers(&self, failed: bool) -> Result<()> {
        let mut trackers = self.trackers();
        if !trackers.initialised && !trackers.log_with.is_empty() && self.is_main_process() {
            eprintln!(
                "accel: log_with names {} but init_trackers was never called, so nothing was \
                 tracked: call accelerator.init_trackers(project, &config) before training, as \
                 with Accelerate",
                crate::config::log_with_text(&trackers.log_with)
            );
            trackers.initialised = true;
        }
        let mut first_error = None;
        for mut tracker in trackers.started.drain(..) {
            let done = if failed { tracker.fail() } else { tracker.finish() };
            if let Err(e) = done {
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    fn trackers(&self) -> std::sync::MutexGuard<'_, Trackers> {
        self.inner.trackers.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A progress bar of `len` steps on the local main process (hidden elsewhere). On a
    /// terminal it redraws one line; when the output is not one (under `accel launch`, in
    /// CI logs) it prints a plain line at most every 10 % or 30 s, with the rate and the
    /// time left, and the bar's message (set the loss there).
    pub fn progress_bar(&self, len: u64) -> ProgressBar {
        if !self.is_local_main_process() {
            return ProgressBar::hidden();
        }
        if std::io::stderr().is_terminal() {
            let bar = ProgressBar::new(len);
            if let Ok(style) = ProgressStyle::with_template(
                "{bar:30} {pos}/{len} [{elapsed_precise}<{eta_precise}, {per_sec}] {msg}",
            ) {
                bar.set_style(style);
            }
            return bar;
        }
        plain_progress(len)
    }
}

/// A bar that writes plain lines (no terminal to redraw on): `progress 120/600 (20%) 45.2/s
/// eta 0:10 loss 1.73`, to standard output: at most every 10 % or 30 s, or every second
/// under an `accel launch` on a terminal, which keeps the latest on one line.
fn plain_progress(len: u64) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(Some(len), indicatif::ProgressDrawTarget::hidden());
    let watcher = bar.downgrade();
    let redrawn = std::env::var(crate::launch::PROGRESS_ENV).is_ok_and(|v| v == "tty");
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
                    crate::launch::PROGRESS_PREFIX,
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
