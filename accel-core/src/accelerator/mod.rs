//! The [`Accelerator`]: one per process. It knows the topology and the configuration,
//! prepares the model, optimizers and data, runs forward passes under autocast and
//! backward passes with loss scaling and accumulation, and saves and restores the whole
//! training state.

mod attribute;
mod builder;
mod collectives;
mod data;
mod drawn;
mod driven;
pub(crate) mod helpers;
mod layers;
mod optimizer;
mod step;
mod tracking;
mod varstore;

use std::fmt::Display;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use tch::{Device, Tensor};

use crate::comm::{Communicator, ProcessGroup};
use crate::config::Config;
use crate::error::Result;
use crate::mesh::DeviceMesh;
use crate::optim::{Optimizer, Param, named_params};
use crate::precision::GradScaler;
use crate::strategy::ModelOptions;
use crate::sync::Locked;
use crate::topology::Topology;

pub(crate) use crate::accumulation::GradientState;
pub use crate::accumulation::StepCounters;
pub use attribute::{AdoptOptimizer, ExitGuard, IntoAccelOptimizer};
pub use builder::AcceleratorBuilder;
pub use collectives::split_between;
pub use data::{DataPosition, PreparedBatches, PreparedIter, PreparedLoader};
pub use drawn::{DrawnLoop, Steps};
pub use driven::{DriveOptimizer, Driven, Lent};
pub use optimizer::AcceleratedOptimizer;
pub(crate) use optimizer::Slot;
pub use step::{ForwardGuard, StepGuard};
pub use tracking::TrackerRef;

/// The accelerator most recently built, held weakly: when the program drops its last handle
/// (the end of an `#[accelerate]` function, of `main`), the accelerator goes, and with it its
/// communicators — their watchdogs stopped, NCCL's finalized and destroyed — instead of
/// living on in a static until the process exits.
static CURRENT: OnceLock<Mutex<std::sync::Weak<Inner>>> = OnceLock::new();

/// The accelerator most recently built in this process, while the program holds it: what a
/// helper function reaches without being passed it, as Accelerate's code reaches its shared
/// `PartialState()` (one accelerator per process is the rule there too). Once the program
/// drops its last handle, `None`.
///
/// ```standalone_crate
/// // Its own process: no other test's accelerator may be the most recent one.
/// use accel_core::{Accelerator, current};
///
/// /// Deep in a helper that was not given the accelerator.
/// fn should_print() -> bool {
///     current().is_none_or(|accelerator| accelerator.is_main_process())
/// }
///
/// let accelerator = Accelerator::builder().cpu(true).build()?;
/// assert!(should_print());
/// assert_eq!(current().map(|a| a.num_processes()), Some(1));
/// drop(accelerator);
/// assert!(current().is_none(), "gone with the program's last handle");
/// # Ok::<(), accel_core::Error>(())
/// ```
pub fn current() -> Option<Accelerator> {
    let current = CURRENT.get()?.locked().upgrade()?;
    Some(Accelerator { inner: current })
}

/// Objects whose state a checkpoint holds, in the order they were prepared.
#[derive(Default)]
pub(crate) struct Registry {
    pub(crate) models: Vec<Vec<Param>>,
    pub(crate) optimizers: Vec<AcceleratedOptimizer>,
    pub(crate) loaders: Vec<Arc<Mutex<DataPosition>>>,
    /// States of the program's own (`register_for_checkpointing`).
    pub(crate) custom: Vec<Arc<Mutex<dyn helpers::Stateful>>>,
    /// The positions of the loops `prepare_iter` dealt, by call site.
    pub(crate) loops: std::collections::BTreeMap<String, Arc<Mutex<DataPosition>>>,
    /// Loop positions restored by `load_state`, for each loop's next pass to resume from.
    pub(crate) resume_loops: std::collections::BTreeMap<String, DataPosition>,
    /// The latest epoch among them (0 in a fresh run).
    pub(crate) resumed_epoch: u64,
}

pub(crate) struct Inner {
    pub(crate) config: Config,
    pub(crate) process: Topology,
    pub(crate) device: Device,
    pub(crate) state: Arc<GradientState>,
    pub(crate) scaler: Option<Arc<Mutex<GradScaler>>>,
    pub(crate) registry: Mutex<Registry>,
    pub(crate) checkpoint_dir: Option<PathBuf>,
    pub(crate) checkpoint_limit: Option<usize>,
    /// Folders found shared by every machine of the run (checkpoint/mod.rs).
    pub(crate) shared_dirs: Mutex<Vec<PathBuf>>,
    /// The run's parallel dimensions and their communicators (the world's group inside).
    pub(crate) mesh: DeviceMesh,
    /// What every hook of training defers to.
    pub(crate) strategy: Arc<dyn crate::strategy::Strategy>,
    /// The tensor, context and pipeline dimensions: what each asks of training.
    pub(crate) parallel: crate::strategy::model_parallel::ModelParallel,
    /// Under precision fp8: the recipe and the fp8 layers made so far.
    pub(crate) fp8: Option<Arc<crate::precision::fp8::Fp8Layers>>,
    pub(crate) model_options: ModelOptions,
    /// The per-process batch size a DeepSpeed config fixes (`train_micro_batch_size_per_gpu`,
    /// or what its `train_batch_size` implies).
    pub(crate) micro_batch_size: Option<usize>,
    /// The experiment trackers (`log_with`, `init_trackers`).
    pub(crate) trackers: Mutex<crate::tracking::Trackers>,
    /// Optimizers (by their first parameter) whose gradients this step has prepared
    /// (finalize_grads, the fp16 unscale): see `Accelerator::prepare_gradients`.
    prepared_gradients: Mutex<std::collections::HashSet<usize>>,
    /// Who deals the data: with several processes and `Prepared`, a step on batches that
    /// did not come through a prepared iterator or loader is an error.
    pub(crate) data: crate::config::DataSharding,
    /// Whether `batch_norm*d` layers made by the accelerator share their statistics across
    /// the data-parallel processes.
    pub(crate) sync_batchnorm: bool,
    /// The warning about a backward with no autocast was printed.
    warned_autocast: std::sync::atomic::AtomicBool,
    /// This process's flag for `check_trigger`.
    pub(crate) trigger: std::sync::atomic::AtomicBool,
    /// The [`crate::Unit`]s made for this accelerator whose model it has not prepared yet.
    pub(crate) units: crate::strategy::fsdp::PendingUnits,
    /// Whether the strategy's `end_training` ran (it runs once).
    pub(crate) strategy_ended: std::sync::atomic::AtomicBool,
    /// What this process read and placed (`io_counts`).
    pub(crate) io: Io,
    /// Each prepared model's buffers, kept equal across the data-parallel processes.
    buffers: Mutex<Vec<crate::strategy::buffers::BufferSync>>,
    /// Where the body last left a prepared loop early (`leaving_loop`).
    pub(crate) loop_exit: Arc<Mutex<Option<&'static std::panic::Location<'static>>>>,
    /// Loops that draw their own batches: seeding and the first step's check.
    pub(crate) drawn: Mutex<drawn::Drawn>,
    /// "`train` at src/main.rs:12" under `#[accelerate]`, else "an accelerator".
    pub(crate) run_name: String,
}

/// The counters behind [`IoCounts`].
#[derive(Debug, Default)]
pub(crate) struct Io {
    pub(crate) checkpoint_bytes_read: std::sync::atomic::AtomicU64,
    pub(crate) bytes_placed: std::sync::atomic::AtomicU64,
}

/// What one process has read from checkpoint files and placed on its device so far
/// ([`Accelerator::io_counts`]): the bytes that sharding's memory promise is about. Under
/// zero3 on N processes each reads about 1/N of a checkpoint's sharded state when it
/// resumes, and places about 1/N of the model (plus the units it keeps whole) when it
/// prepares one.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct IoCounts {
    /// Bytes read from checkpoint files: `load_state`, `load_latest_checkpoint`,
    /// `load_checkpoint_in_model` (the checks of the blocks nobody else read included).
    pub checkpoint_bytes_read: u64,
    /// Bytes of model variables that `prepare_model` placed on the process's device
    /// (moved there, or kept there as its shard).
    pub bytes_placed_on_device: u64,
}

/// Distributed training for one process of a run; cheap to clone (a shared handle).
#[derive(Clone)]
pub struct Accelerator {
    pub(crate) inner: Arc<Inner>,
}

impl std::fmt::Debug for Accelerator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Accelerator")
            .field("config", &self.inner.config)
            .field("process", &self.inner.process)
            .field("device", &self.inner.device)
            .finish_non_exhaustive()
    }
}

impl Accelerator {
    /// A builder; `Accelerator::builder().build()` takes everything from the environment.
    pub fn builder() -> AcceleratorBuilder {
        AcceleratorBuilder::default()
    }

    pub(crate) fn registry(&self) -> MutexGuard<'_, Registry> {
        self.inner.registry.locked()
    }

    /// The resolved configuration.
    pub fn config(&self) -> &Config {
        &self.inner.config
    }
    /// This process's device.
    pub fn device(&self) -> Device {
        self.inner.device
    }
    /// Global rank.
    pub fn process_index(&self) -> usize {
        self.inner.process.rank
    }
    /// Rank on this machine.
    pub fn local_process_index(&self) -> usize {
        self.inner.process.local_rank
    }
    /// Number of processes.
    pub fn num_processes(&self) -> usize {
        self.inner.process.world_size
    }
    /// Rank 0.
    pub fn is_main_process(&self) -> bool {
        self.inner.process.rank == 0
    }
    /// Local rank 0.
    pub fn is_local_main_process(&self) -> bool {
        self.inner.process.local_rank == 0
    }

    /// Prints on the local main process only.
    pub fn print(&self, message: impl Display) {
        if self.is_local_main_process() {
            println!("{message}");
        }
    }

    /// The per-process batch size a DeepSpeed config fixes, if it does (its
    /// `train_micro_batch_size_per_gpu`, or `train_batch_size` ÷ accumulation ÷ replicas).
    pub fn micro_batch_size(&self) -> Option<usize> {
        self.inner.micro_batch_size
    }

    /// Waits until every process gets here (a barrier; immediate with one process).
    pub fn wait_for_everyone(&self) -> Result<()> {
        match self.process_group() {
            Some(group) => group.barrier(),
            None => Ok(()),
        }
    }

    /// The process group of the whole run, for control traffic and collectives of one's
    /// own (`None` with one process).
    pub fn process_group(&self) -> Option<&ProcessGroup> {
        self.inner.mesh.world()
    }

    /// The run's parallel dimensions and a communicator for each.
    pub fn mesh(&self) -> &DeviceMesh {
        &self.inner.mesh
    }

    /// The strategy every hook of training defers to.
    pub fn strategy(&self) -> &dyn crate::strategy::Strategy {
        self.inner.strategy.as_ref()
    }

    /// One line with what is in effect, which the main process prints when the accelerator
    /// is built (`ACCEL_QUIET=1` drops it): the strategy (and what it runs as), processes
    /// and mesh, device, precision, accumulation, who deals the data and, under
    /// `#[accelerate]`, how many data loops the attribute prepared.
    pub fn describe(&self, attribute_data_loops: Option<(usize, usize)>) -> String {
        let config = &self.inner.config;
        let mut strategy = config.strategy.to_string();
        let runs_as = self.inner.strategy.name();
        if config.strategy == crate::config::Strategy::Single && self.num_processes() > 1 {
            // No strategy asked for: several processes default to DDP.
            strategy = format!("{runs_as} (the default with several processes)");
        } else if runs_as != strategy && !(runs_as == "single" && self.num_processes() == 1) {
            strategy = format!("{strategy} (runs as {runs_as})");
        }
        let processes = self.num_processes();
        let dims = self.inner.mesh.dims();
        let mut line = format!(
            "accel: strategy {strategy}, {processes} process{} ({dims}), device {:?}, precision {}",
            if processes == 1 { "" } else { "es" },
            self.device(),
            config.precision,
        );
        if config.precision == crate::config::Precision::Fp8 {
            line.push_str(&format!(" ({} recipe)", config.fp8_recipe));
        }
        line.push_str(&format!(", accumulate {}", config.accumulate));
        if let Some(max) = config.clip_grad_norm {
            line.push_str(&format!(", clip_grad_norm {max}"));
        }
        line.push_str(match self.inner.data {
            crate::config::DataSharding::Prepared => ", data dealt by the accelerator",
            crate::config::DataSharding::Dealt => ", data dealt by the accelerator (dealt)",
            crate::config::DataSharding::Drawn => ", batches drawn by each process (drawn)",
            crate::config::DataSharding::Manual => ", data sharded by the program (manual)",
        });
        if self.inner.sync_batchnorm {
            line.push_str(", synchronised batch norm");
        }
        if let Some((loops, drawn)) = attribute_data_loops {
            line.push_str(&format!(
                ", #[accelerate] prepared {loops} data loop{}",
                if loops == 1 { "" } else { "s" }
            ));
            if drawn > 0 {
                line.push_str(&format!(
                    " ({drawn} of which draw{} its own batches on every process)",
                    if drawn == 1 { "s" } else { "" }
                ));
            }
        }
        line
    }

    /// The tensor dimension of the mesh: builds tensor-parallel layers and remembers what
    /// they split (a group of one without tensor parallelism).
    pub fn tensor_parallel(&self) -> crate::strategy::tp::TensorParallel {
        self.inner.parallel.tp.clone()
    }

    /// The context dimension of the mesh: which part of each sequence this process holds,
    /// and the exchanges attention needs (a group of one without context parallelism).
    pub fn context_parallel(&self) -> crate::strategy::cp::ContextParallel {
        self.inner.parallel.cp.clone()
    }

    /// This process's index along mesh dimension `dim`.
    pub(crate) fn index_along(&self, dim: crate::mesh::Dim) -> usize {
        self.inner.mesh.index(dim)
    }

    /// This process's data-parallel index and the number of data-parallel replicas that see
    /// different batches (the process index and count without tensor, pipeline or context
    /// parallelism; the ranks of a context group share a batch).
    pub fn data_parallel(&self) -> (usize, usize) {
        self.inner.mesh.data_parallel()
    }

    /// What the strategy's hooks see of the run.
    pub(crate) fn strategy_context(&self) -> crate::strategy::Context<'_> {
        crate::strategy::Context {
            mesh: &self.inner.mesh,
            state: &self.inner.state,
            device: self.inner.device,
            units: &self.inner.units,
            announce: self.is_main_process() && !builder::quiet(),
            placed: &self.inner.io.bytes_placed,
        }
    }

    /// The end of training: the strategy's last word (LocalSGD averages the parameters once
    /// more), the trackers finished (MLflow's run marked FINISHED), then a barrier. An
    /// `#[accelerate]` function calls it when it succeeds; calling it again does no more
    /// than the barrier.
    pub fn end_training(&self) -> Result<()> {
        self.end_strategy()?;
        self.finish_trackers(false)?;
        self.wait_for_everyone()
    }

    /// The strategy's `end_training`, once.
    pub(crate) fn end_strategy(&self) -> Result<()> {
        if self.inner.strategy_ended.swap(true, std::sync::atomic::Ordering::SeqCst) {
            return Ok(());
        }
        self.inner.strategy.end_training(&self.strategy_context())
    }

    /// Places the model's variables on this process's device (in place: tensors keep their
    /// identity, so the model's layers see the move), registers them for checkpoints, and
    /// hands them to the strategy: with several processes DDP broadcasts rank 0's values and
    /// averages every sync step's gradients (see `strategy/ddp`), ZeRO shards them. Under
    /// zero3 only this process's shards and the parameters no unit holds reach the device:
    /// a model built on the CPU is never whole on a GPU.
    pub fn prepare_model(&self, vs: &tch::nn::VarStore) -> Result<()> {
        self.prepare_model_with(vs, self.inner.model_options)
    }

    /// [`prepare_model`](Self::prepare_model) with this model's own settings (DDP's bucket
    /// size, unused parameters, gradient compression).
    pub fn prepare_model_with(
        &self,
        vs: &tch::nn::VarStore,
        options: impl Into<ModelOptions>,
    ) -> Result<()> {
        let params = crate::optim::sorted_variables(vs);
        let cx = self.strategy_context();
        // A sharded strategy places only shards on the device (never the whole model).
        if !self.inner.strategy.places_parameters() {
            crate::strategy::place_whole(&cx, &params)?;
        }
        // Gradients left by an earlier run (another accelerator's step, say) would be added
        // to this run's first ones: the model starts without any, as a fresh one does.
        for p in &params {
            if p.tensor.grad().defined() {
                crate::shim::set_grad(&p.tensor, None)?;
            }
        }
        self.inner.parallel.check_model(&params)?;
        self.filter_fp8_layers(&params)?;
        let options = options.into();
        // The model's units learn from its accelerator whether to checkpoint activations
        // (before zero3 takes them to bind).
        let names: Vec<&str> = params.iter().map(|p| p.name.as_str()).collect();
        let checkpointing = self.inner.config.activation_checkpointing;
        self.inner.units.set_checkpointing(crate::strategy::fsdp::in_model(&names), checkpointing);
        self.inner.strategy.prepare_model(&cx, &params, &options)?;
        if let Some(group) = self.inner.strategy.buffer_group(&cx, &options) {
            let buffers = crate::strategy::buffers::BufferSync::new(vs, group)?;
            if !buffers.is_empty() {
                self.inner.buffers.locked().push(buffers);
            }
        }
        self.registry().models.push(params);
        Ok(())
    }

    /// Wraps `optimizer` so that it follows accumulation, loss scaling and clipping, and
    /// registers it for checkpoints.
    pub fn prepare_optimizer(&self, optimizer: impl Optimizer + 'static) -> AcceleratedOptimizer {
        self.prepare_boxed_optimizer(Box::new(optimizer))
    }

    pub(crate) fn prepare_boxed_optimizer(
        &self,
        optimizer: Box<dyn Optimizer>,
    ) -> AcceleratedOptimizer {
        let prepared = AcceleratedOptimizer::new(optimizer, self);
        self.registry().optimizers.push(prepared.clone());
        prepared
    }

    /// Prepares the model in `vs` (once) and wraps `optimizer`: what building one of accel's
    /// optimizers over the model becomes under `#[accelerate]`.
    pub fn prepare_optimizer_for(
        &self,
        vs: &tch::nn::VarStore,
        optimizer: impl Optimizer + 'static,
    ) -> Result<AcceleratedOptimizer> {
        self.prepare_model_once(vs)?;
        Ok(self.prepare_optimizer(optimizer))
    }

    /// The shapes of those of `params` that belong to no prepared model.
    pub(crate) fn unprepared(&self, params: &[Tensor]) -> Result<Vec<Vec<i64>>> {
        let registry = self.registry();
        let prepared: std::collections::HashSet<usize> = registry
            .models
            .iter()
            .flatten()
            .map(|p| crate::shim::tensor_id(&p.tensor))
            .collect::<Result<_>>()?;
        let mut strays = Vec::new();
        for p in params {
            if !prepared.contains(&crate::shim::tensor_id(p)?) {
                strays.push(p.size());
            }
        }
        Ok(strays)
    }

    /// [`prepare_model`](Self::prepare_model) unless this `VarStore` was prepared already.
    pub fn prepare_model_once(&self, vs: &tch::nn::VarStore) -> Result<()> {
        self.prepare_model_once_with(vs, self.inner.model_options)
    }

    /// [`prepare_model_with`](Self::prepare_model_with) unless this `VarStore` was prepared
    /// already.
    pub(crate) fn prepare_model_once_with(
        &self,
        vs: &tch::nn::VarStore,
        options: ModelOptions,
    ) -> Result<()> {
        let first = vs.variables().into_values().next();
        // By identity: a released zero3 parameter has no data pointer to compare.
        let id = first.and_then(|t| crate::shim::tensor_id(&t).ok());
        let prepared = id.is_some_and(|id| {
            let registry = self.registry();
            registry
                .models
                .iter()
                .flatten()
                .any(|p| crate::shim::tensor_id(&p.tensor).ok() == Some(id))
        });
        if prepared { Ok(()) } else { self.prepare_model_with(vs, options) }
    }

    /// Stops taking part in collectives at once: other ranks waiting for this one get an
    /// error instead of waiting for their timeout. Used when a run fails.
    pub fn abort(&self) {
        if let Some(group) = self.process_group() {
            crate::world::mark_aborted(format!(
                "{} failed on rank {}",
                self.inner.run_name,
                self.process_index()
            ));
            group.abort();
        }
    }

    /// The trainable variables of `vs` as named parameters for an optimizer (sorted by name).
    pub fn params(&self, vs: &tch::nn::VarStore) -> Vec<Param> {
        named_params(vs)
    }

    /// The model's variables by name, whole: under zero2/zero3 the sharded parameters are
    /// gathered from every rank's shard (a collective: call it on every process, as
    /// Accelerate's `get_state_dict`); otherwise copies of the local values.
    pub fn full_state_dict(&self, vs: &tch::nn::VarStore) -> Result<Vec<(String, Tensor)>> {
        self.full_state_of(crate::optim::sorted_variables(vs))
    }

    /// Makes every parameter of the prepared models whole on this process with its trained
    /// values, so that code reading the model outside forward and backward (its own
    /// evaluation, a weight norm, its own save) reads what one process would — FSDP's
    /// `summon_full_params`. Only zero3 releases parameters between uses; elsewhere this does
    /// nothing. A collective there: call it on every process. The parameters stay whole
    /// (forwards without gradient use them as they are) until training resumes: the next
    /// forward with gradient writes what the program changed in them back into the shards
    /// and releases them again. Costs the zero3 units' parameters whole on every process;
    /// `#[accelerate]` calls it after a training loop before the first statement that
    /// reaches the model. Returns the bytes made whole.
    pub fn summon_full_params(&self) -> Result<u64> {
        self.inner.strategy.summon_full_params()
    }

    /// [`full_state_dict`](Self::full_state_dict) of a prepared model's variables.
    pub(crate) fn full_state_of(&self, params: Vec<Param>) -> Result<Vec<(String, Tensor)>> {
        let values = self.inner.strategy.full_parameters(&params)?;
        let mine = params
            .into_iter()
            .zip(values)
            .map(|(p, v)| Ok((p.name.clone(), self.inner.parallel.whole(&p.tensor, &v)?)))
            .collect::<Result<Vec<_>>>()?;
        self.inner.parallel.pipeline_whole(mine)
    }

    /// The bytes this process has read from checkpoints and placed on its device so far.
    pub fn io_counts(&self) -> IoCounts {
        use std::sync::atomic::Ordering::Relaxed;
        IoCounts {
            checkpoint_bytes_read: self.inner.io.checkpoint_bytes_read.load(Relaxed),
            bytes_placed_on_device: self.inner.io.bytes_placed.load(Relaxed),
        }
    }

    /// Whether the current micro-step ends an accumulation window (optimizers step).
    pub fn sync_gradients(&self) -> bool {
        self.inner.state.sync_gradients()
    }

    /// Whether the batch being processed is the last of its data source.
    pub fn end_of_dataloader(&self) -> bool {
        self.inner.state.end_of_dataloader()
    }

    /// Step counters (micro-steps, optimizer steps, skipped steps).
    pub fn counters(&self) -> StepCounters {
        self.inner.state.counters()
    }

    /// The current fp16 loss scale, if fp16 is on.
    pub fn loss_scale(&self) -> Option<f64> {
        self.inner.scaler.as_ref().map(|s| s.locked().scale())
    }

    /// Restores the fp16 loss scaler's state from a checkpoint (nothing without a scaler:
    /// the loader checked that the checkpoint's precision is this run's).
    pub(crate) fn restore_scaler(&self, saved: crate::precision::ScalerState) -> Result<()> {
        match &self.inner.scaler {
            Some(scaler) => scaler.locked().load_state(saved),
            None => Ok(()),
        }
    }

    /// Restores the step counters from a checkpoint (and with them where accumulation is).
    pub(crate) fn restore_counters(&self, counters: StepCounters) {
        self.inner.state.restore(counters);
    }

    /// The folder for automatically named checkpoints, if configured.
    pub fn checkpoint_dir(&self) -> Option<&Path> {
        self.inner.checkpoint_dir.as_deref()
    }
}

/// [`crate::Unit::new`] takes the accelerator that will prepare the unit's model.
impl AsRef<crate::strategy::fsdp::PendingUnits> for Accelerator {
    fn as_ref(&self) -> &crate::strategy::fsdp::PendingUnits {
        &self.inner.units
    }
}
