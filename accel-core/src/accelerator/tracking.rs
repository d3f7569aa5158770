//! The accelerator's side of experiment tracking (`crate::tracking` holds the trackers):
//! starting them, logging to them, closing them, and the progress bar.

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressStyle};

use super::Accelerator;
use crate::config::LogWith;
use crate::error::{Error, Result};
use crate::sync::Locked;
use crate::tracking::{
    MetricsFiles, MlFlow, MlFlowSettings, TensorBoard, Tracker, Trackers, Wandb, WandbMode,
    WandbSettings,
};

impl Accelerator {
    /// Starts the trackers `log_with` named (the builder's `.log_with`, else
    /// `ACCEL_LOG_WITH`, `accel launch --log-with` or the config file's `log_with`) and
    /// those added with [`add_tracker`](Self::add_tracker), and records `config` (the run's
    /// hyperparameters) in each. Files go to `project_dir/project_name` (the builder's
    /// `.project_dir`, else `runs`); a run resumed from a checkpoint before this call adds
    /// to its `metrics.jsonl` instead of starting it over. MLflow's run goes to the
    /// experiment `MLFLOW_EXPERIMENT_NAME`, else `project_name`; W&B's to
    /// `$WANDB_DIR/wandb/offline-run-*` in project `WANDB_PROJECT`, else `project_name`. Only
    /// the main process writes; call it on every process.
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
            started.push(Box::new(MetricsFiles::new(&dir, main, resumed)?));
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
        // W&B under `all` where the run names it (a W&B variable set), as MLflow's server.
        let wandb = trackers.log_with.contains(&LogWith::Wandb)
            || (wanted(LogWith::All)
                && ["WANDB_MODE", "WANDB_PROJECT", "WANDB_DIR"]
                    .iter()
                    .any(|v| std::env::var_os(v).is_some()));
        if wandb {
            let settings = WandbSettings::from_env(project_name)?;
            if settings.mode == WandbMode::Disabled {
                if main {
                    eprintln!("accel: WANDB_MODE=disabled: nothing is written for W&B");
                }
            } else {
                started.push(Box::new(Wandb::start(&settings, main)?));
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

    /// Records `values` at `step` in every tracker (main process only; elsewhere nothing):
    /// numbers (`&[("loss", loss)]`), or [`Value`](crate::tracking::Value)s that may also be
    /// images (a tensor `[C, H, W]` or `[H, W]`), text and tables, each written as its tracker
    /// stores such things (TensorBoard's image and text summaries, MLflow artifacts, W&B
    /// media, files beside `metrics.jsonl`).
    ///
    /// ```no_run
    /// # fn main() -> accel_core::Result<()> {
    /// # let accelerator = accel_core::Accelerator::builder().build()?;
    /// # let grid = tch::Tensor::zeros([1, 8, 8], (tch::Kind::Float, tch::Device::Cpu));
    /// use accel_core::tracking::Value;
    /// accelerator.log(10, &[("loss", 0.25), ("accuracy", 0.9)])?;
    /// accelerator.log(10, &[("loss", Value::from(0.25)), ("wrong", Value::image(&grid)?)])?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn log<V: Clone + Into<crate::tracking::Value>>(
        &self,
        step: u64,
        values: &[(&str, V)],
    ) -> Result<()> {
        use crate::tracking::Value;
        if !self.is_main_process() {
            return Ok(());
        }
        let values: Vec<(&str, Value)> =
            values.iter().map(|(k, v)| (*k, v.clone().into())).collect();
        let scalars: Vec<(&str, f64)> = values
            .iter()
            .filter_map(|(k, v)| if let Value::Scalar(x) = v { Some((*k, *x)) } else { None })
            .collect();
        for tracker in &mut self.trackers().started {
            if !scalars.is_empty() {
                tracker.log(step, &scalars)?;
            }
            for (key, value) in values.iter().filter(|(_, v)| !matches!(v, Value::Scalar(_))) {
                tracker.log_media(step, key, value)?;
            }
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

    /// The started tracker called `name` (`"tensorboard"`, `"jsonl"`, `"mlflow"`, `"wandb"`,
    /// or a tracker of one's own), as the type it is: what accel does not wrap, reached
    /// directly (Accelerate's `get_tracker(name, unwrap=True)`). `None` on processes other
    /// than the main one, which hold no trackers; an error when the main process has no
    /// tracker of that name, or it is not a `T` (both said).
    ///
    /// ```no_run
    /// # fn main() -> accel_core::Result<()> {
    /// # let accelerator = accel_core::Accelerator::builder().build()?;
    /// use accel_core::tracking::MlFlow;
    /// if let Some(mlflow) = accelerator.get_tracker::<MlFlow>("mlflow")? {
    ///     println!("MLflow run {}", mlflow.run_id());
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub fn get_tracker<T: Tracker>(&self, name: &str) -> Result<Option<TrackerRef<'_, T>>> {
        if !self.is_main_process() {
            return Ok(None);
        }
        let trackers = self.trackers();
        let names: Vec<String> = trackers.started.iter().map(|t| t.name().to_owned()).collect();
        let Some(index) = names.iter().position(|n| n == name) else {
            return Err(Error::Config(format!(
                "no tracker `{name}` was started (started: {}); name it in log_with and call                  init_trackers first",
                if names.is_empty() { "none".to_owned() } else { names.join(", ") }
            )));
        };
        if !trackers.started[index].as_any().is::<T>() {
            return Err(Error::Config(format!(
                "the tracker `{name}` is not a {}",
                std::any::type_name::<T>()
            )));
        }
        Ok(Some(TrackerRef { trackers, index, _type: std::marker::PhantomData }))
    }

    fn trackers(&self) -> std::sync::MutexGuard<'_, Trackers> {
        self.inner.trackers.locked()
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
        crate::tracking::plain_progress(len)
    }
}

/// A started tracker, as its own type, from [`Accelerator::get_tracker`]; the trackers stay
/// locked while it is held (drop it before logging).
pub struct TrackerRef<'a, T> {
    trackers: std::sync::MutexGuard<'a, Trackers>,
    index: usize,
    _type: std::marker::PhantomData<T>,
}

impl<T: 'static> std::ops::Deref for TrackerRef<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        self.trackers.started[self.index].as_any().downcast_ref().expect("checked when made")
    }
}

impl<T: 'static> std::ops::DerefMut for TrackerRef<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        self.trackers.started[self.index].as_any_mut().downcast_mut().expect("checked when made")
    }
}
