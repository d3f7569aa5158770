//! The [`Accelerator`]: one per process. It knows the topology and the configuration,
//! prepares the model, optimizers and data, runs forward passes under autocast and
//! backward passes with loss scaling and accumulation, and saves and restores the whole
//! training state.

mod attribute;
mod builder;
mod collectives;
mod data;
mod driven;
pub(crate) mod helpers;
mod layers;
mod optimizer;
mod tracking;
mod varstore;

use std::fmt::Display;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use tch::{Device, Tensor};

use crate::comm::{Communicator, ProcessGroup};
use crate::config::Config;
use crate::data::{DataLoader, Dataset};
use crate::device::ToDevice;
use crate::error::{Error, Result};
use crate::mesh::DeviceMesh;
use crate::optim::{Optimizer, Param, named_params};
use crate::precision::{self, GradScaler, ToFp32};
use crate::shim::AutocastGuard;
use crate::strategy::ModelOptions;
use crate::topology::Topology;

pub(crate) use crate::accumulation::GradientState;
pub use crate::accumulation::StepCounters;
pub use attribute::{AdoptOptimizer, ExitGuard, IntoAccelOptimizer};
pub use builder::AcceleratorBuilder;
pub use collectives::split_between;
pub use data::{DataPosition, PreparedBatches, PreparedIter, PreparedLoader, Rounds};
pub use driven::{DriveOptimizer, Driven};
pub use optimizer::AcceleratedOptimizer;

/// The accelerator most recently built, held weakly: when the program drops its last handle
/// (the end of an `#[accelerate]` function, of `main`), the accelerator goes, and with it its
/// communicators — their watchdogs stopped, NCCL's finalized and destroyed — instead of
/// living on in a static until the process exits.
static CURRENT: OnceLock<Mutex<std::sync::Weak<Inner>>> = OnceLock::new();

/// The accelerator most recently built in this process, while the program holds it (what
/// `#[accelerate]` code reaches from helper functions).
pub fn current() -> Option<Accelerator> {
    let current = CURRENT.get()?.lock().unwrap_or_else(|e| e.into_inner()).upgrade()?;
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
    /// Driven optimizers (by their first parameter) whose gradients this step unscaled.
    driven_unscaled: Mutex<std::collections::HashSet<usize>>,
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
    /// Whether the strategy's `end_training` ran (it runs once).
    pub(crate) strategy_ended: std::sync::atomic::AtomicBool,
    /// Each prepared model's buffers, kept equal across the data-parallel processes.
    buffers: Mutex<Vec<crate::strategy::buffers::BufferSync>>,
}

/// What [`Accelerator::autocast`] returns: autocast for the configured precision and, in a
/// profile, the `accel::forward` range, both until dropped.
#[must_use = "autocast lasts only while the guard lives"]
#[derive(Debug)]
pub struct ForwardGuard {
    _autocast: Option<AutocastGuard>,
    _range: crate::shim::Range,
}

/// What [`Accelerator::autocast_step`] returns: autocast for the configured precision
/// until dropped.
#[must_use = "autocast lasts only while the guard lives"]
#[derive(Debug)]
pub struct StepGuard {
    _autocast: Option<AutocastGuard>,
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
        self.inner.registry.lock().unwrap_or_else(|e| e.into_inner())
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
    pub fn describe(&self, attribute_data_loops: Option<usize>) -> String {
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
            crate::config::DataSharding::Manual => ", data sharded by the program (manual)",
        });
        if self.inner.sync_batchnorm {
            line.push_str(", synchronised batch norm");
        }
        if let Some(loops) = attribute_data_loops {
            line.push_str(&format!(
                ", #[accelerate] prepared {loops} data loop{}",
                if loops == 1 { "" } else { "s" }
            ));
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
        self.inner.mesh.dims().index(dim, self.process_index())
    }

    /// This process's data-parallel index and the number of data-parallel replicas that see
    /// different batches (the process index and count without tensor, pipeline or context
    /// parallelism; the ranks of a context group share a batch).
    pub fn data_parallel(&self) -> (usize, usize) {
        (
            self.index_along(crate::mesh::Dim::Batch),
            self.inner.mesh.dims().size(crate::mesh::Dim::Batch),
        )
    }

    /// What the strategy's hooks see of the run.
    pub(crate) fn strategy_context(&self) -> crate::strategy::Context<'_> {
        crate::strategy::Context {
            mesh: &self.inner.mesh,
            state: &self.inner.state,
            device: self.inner.device,
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

    /// Seeds torch's generators; `device_specific` adds the rank so processes differ.
    pub fn set_seed(&self, seed: u64, device_specific: bool) {
        let offset = if device_specific { self.process_index() as u64 } else { 0 };
        tch::manual_seed(seed.wrapping_add(offset) as i64);
    }

    /// Places the model's variables on this process's device (in place: tensors keep their
    /// identity, so the model's layers see the move), registers them for checkpoints, and
    /// hands them to the strategy: with several processes DDP broadcasts rank 0's values and
    /// averages every sync step's gradients (see `strategy/ddp`), ZeRO shards them.
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
        if vs.device() != self.device() {
            tch::no_grad(|| -> Result<()> {
                for p in &params {
                    let moved = p.tensor.f_to_device(self.device())?;
                    p.tensor.shallow_clone().set_data(&moved);
                }
                Ok(())
            })?;
        }
        self.inner.parallel.check_model(&params)?;
        self.filter_fp8_layers(&params)?;
        let options = options.into();
        let cx = self.strategy_context();
        // The model's units learn from its accelerator whether to checkpoint activations
        // (before zero3 takes them to bind).
        let names: Vec<&str> = params.iter().map(|p| p.name.as_str()).collect();
        let checkpointing = self.inner.config.activation_checkpointing;
        crate::strategy::fsdp::set_checkpointing(
            crate::strategy::fsdp::in_model(&names),
            checkpointing,
        );
        self.inner.strategy.prepare_model(&cx, &params, &options)?;
        if let Some(group) = self.inner.strategy.buffer_group(&cx, &options) {
            let buffers = crate::strategy::buffers::BufferSync::new(vs, group)?;
            if !buffers.is_empty() {
                self.inner.buffers.lock().unwrap_or_else(|e| e.into_inner()).push(buffers);
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
        let first = vs.variables().into_values().next();
        let prepared = first.is_some_and(|t| {
            self.registry().models.iter().flatten().any(|p| p.tensor.data_ptr() == t.data_ptr())
        });
        if prepared { Ok(()) } else { self.prepare_model(vs) }
    }

    /// Stops taking part in collectives at once: other ranks waiting for this one get an
    /// error instead of waiting for their timeout. Used when a run fails.
    pub fn abort(&self) {
        if let Some(group) = self.process_group() {
            group.abort();
        }
    }

    /// The trainable variables of `vs` as named parameters for an optimizer (sorted by name).
    pub fn params(&self, vs: &tch::nn::VarStore) -> Vec<Param> {
        named_params(vs)
    }

    /// Shards `loader` across processes, moves its batches to the device, and registers its
    /// position for checkpoints.
    pub fn prepare_loader<D: Dataset>(&self, mut loader: DataLoader<D>) -> Result<PreparedLoader<D>>
    where
        D::Batch: ToDevice,
    {
        // Processes of one data-parallel replica (its tensor ranks and pipeline stages) see
        // the same batches.
        let (index, replicas) = self.data_parallel();
        loader.shard(index, replicas)?;
        if let (Some(micro), per_process) =
            (self.inner.micro_batch_size, loader.per_process_batch())
        {
            if micro != per_process {
                return Err(Error::Config(format!(
                    "the DeepSpeed config's micro batch size is {micro} per process, but this \
                     loader gives each process batches of {per_process}; make them agree (or \
                     set train_micro_batch_size_per_gpu to \"auto\")"
                )));
            }
        }
        let position = Arc::new(Mutex::new(DataPosition::default()));
        self.registry().loaders.push(position.clone());
        Ok(PreparedLoader::new(loader, self.inner.state.clone(), position, self.device()))
    }

    /// Any iterable of batches: moved to the device, with the look-ahead that closes the
    /// accumulation window on the last batch. With several processes, batches are dealt
    /// round-robin (batch k to rank k mod N) and a last round too short for every rank is
    /// dropped; use a [`DataLoader`] for Accelerate's padding and for resumable positions.
    pub fn prepare_iter<I>(&self, iterable: I) -> PreparedIter<Rounds<I::IntoIter>>
    where
        I: IntoIterator,
        I::Item: ToDevice,
    {
        let position = Arc::new(Mutex::new(DataPosition::default()));
        let (index, replicas) = self.data_parallel();
        let rounds = Rounds::new(iterable.into_iter(), index, replicas);
        PreparedIter::new(rounds, self.inner.state.clone(), position, self.device())
    }

    /// This process's share of a stream of samples, with Accelerate's
    /// `IterableDatasetShard` rules (buffers of `batch_size × processes`, rank r takes its
    /// slice, a short last buffer completed from the first); batch the result yourself, or
    /// through a [`DataLoader`].
    pub fn shard_samples<I>(
        &self,
        samples: I,
        batch_size: usize,
    ) -> crate::data::IterableShard<I::IntoIter>
    where
        I: IntoIterator,
        I::Item: Clone,
    {
        let (rank, world) = self.data_parallel();
        let options = crate::data::ShardOptions {
            rank,
            world,
            batch_size,
            drop_last: false,
            even_batches: true,
            split_batches: false,
        };
        crate::data::IterableShard::new(samples.into_iter(), options)
    }

    /// Autocast for the configured precision until the guard is dropped (nothing to undo in
    /// fp32), and in a profile the `accel::forward` range.
    pub fn autocast(&self) -> Result<ForwardGuard> {
        self.inner.state.note_autocast();
        Ok(ForwardGuard {
            _autocast: precision::enter(self.inner.config.precision, self.device())?,
            _range: crate::shim::range("accel::forward"),
        })
    }

    /// Autocast for the configured precision over one training step, until dropped: what
    /// `#[accelerate]` puts at the top of a training loop's body, so that every forward pass
    /// of the step runs under it wherever it is written. [`backward`](Self::backward) and
    /// the optimizer's step switch it off while they run.
    pub fn autocast_step(&self) -> Result<StepGuard> {
        self.inner.state.note_autocast();
        Ok(StepGuard { _autocast: precision::enter(self.inner.config.precision, self.device())? })
    }

    /// Runs `forward` under autocast and casts its half-precision outputs back to fp32
    /// (as Accelerate wraps `model.forward`).
    pub fn forward<T: ToFp32>(&self, forward: impl FnOnce() -> T) -> Result<T> {
        let guard = self.autocast()?;
        let out = forward();
        drop(guard);
        Ok(if precision::autocast_kind(self.inner.config.precision).is_some() {
            out.to_fp32()
        } else {
            out
        })
    }

    /// The backward pass of one micro-batch: decides whether this is a sync step, divides
    /// the loss by `accumulate` (always, as Accelerate does), scales it for fp16 and runs
    /// autograd. A failure inside backward (a hook that panicked, say) comes back as `Err`.
    pub fn backward(&self, loss: &Tensor) -> Result<()> {
        if loss.numel() != 1 {
            return Err(Error::Training(format!(
                "backward needs a scalar loss, got shape {:?}; reduce it first (mean or sum)",
                loss.size()
            )));
        }
        if self.num_processes() > 1 && self.registry().models.is_empty() {
            return Err(Error::Training(format!(
                "backward on rank {} of {} with no prepared model: its gradients would not be \
                 averaged across processes, and each process would train a model of its own. \
                 Call `accelerator.prepare_model(&vs)` on the model's VarStore first (under \
                 #[accelerate], build the optimizer in the function over the VarStore, or name \
                 it with `model = vs`)",
                self.process_index(),
                self.num_processes()
            )));
        }
        self.inner.parallel.check_backward(self.process_index())?;
        // A collective that failed inside the forward (zero3's gathers in `Module::forward`).
        self.inner.strategy.take_error()?;
        let sync = self.inner.state.begin_micro_step();
        if sync {
            self.check_data_was_dealt()?;
            self.inner.parallel.check_sync_step(self.process_index())?;
        }
        self.check_autocast()?;
        // The step's autocast (`autocast_step`) stays off while autograd runs.
        let _no_autocast = precision::suspend(self.device())?;
        let n = self.inner.state.accumulate();
        let loss = if n > 1 { loss.f_div_scalar(n as f64)? } else { loss.shallow_clone() };
        let loss = match &self.inner.scaler {
            Some(scaler) => scaler.lock().unwrap_or_else(|e| e.into_inner()).scale_loss(&loss)?,
            None => loss,
        };
        let range = crate::shim::range("accel::backward");
        if let Err(e) = loss.f_backward() {
            self.inner.strategy.take_error()?;
            return Err(Error::Training(format!(
                "backward failed: {}",
                crate::error::torch_text(&e)
            )));
        }
        drop(range);
        let _range = crate::shim::range("accel::gradient_sync");
        self.inner.strategy.after_backward(&self.strategy_context(), sync)?;
        if sync {
            self.sync_buffers()?;
        }
        Ok(())
    }

    /// The net under data that was not dealt: with several data-parallel processes, a sync
    /// step whose micro-batches did not all come through a prepared iterator or loader
    /// would average the gradients of processes that may all have seen the same batches.
    fn check_data_was_dealt(&self) -> Result<()> {
        let (_, replicas) = self.data_parallel();
        if replicas < 2
            || self.inner.data == crate::config::DataSharding::Manual
            || !self.inner.state.window_had_undealt_batches()
        {
            return Ok(());
        }
        Err(Error::Training(format!(
            "backward on rank {} of {replicas} data-parallel processes, on batches that did not \
             come through a prepared data loader or iterator: nothing dealt them, so every \
             process may be training on the same batches. Prepare the data \
             (`accelerator.prepare_loader(loader)` or `accelerator.prepare_iter(batches)`; \
             under #[accelerate], loop over the batches in the annotated function), or, if each \
             process already loads its own part, say so: `.data(DataSharding::Manual)` on the \
             builder, #[accelerate(data = \"manual\")]",
            self.process_index()
        )))
    }

    /// The end of every optimizer step, prepared or driven: the step counted (or the skip),
    /// then, with several processes, the collective sequence check (every rank compares the
    /// collectives it issued since the last step with the others', off this thread; a
    /// divergence found earlier is returned here).
    pub(crate) fn end_optimizer_step(&self, skipped: bool) -> Result<()> {
        self.inner.state.record_optimizer_step(skipped);
        if self.num_processes() > 1 {
            self.inner.mesh.check_collectives()?;
        }
        Ok(())
    }

    /// Whether optimizers zero gradients in place instead of setting them to none: where
    /// the strategy needs them to stay views of its buffers (DDP's buckets). The one rule
    /// for prepared and driven optimizers.
    pub(crate) fn zero_grad_in_place(&self) -> bool {
        self.inner.strategy.zero_grad_in_place()
    }

    /// A pipeline step of `micro_batches` begins (one accumulation window, see
    /// `GradientState::start_window`); its backward passes are allowed until the guard drops.
    pub(crate) fn pipeline_step(
        &self,
        micro_batches: u64,
    ) -> crate::strategy::model_parallel::PipelineStep<'_> {
        self.inner.state.start_window(micro_batches);
        self.inner.parallel.pipeline_step()
    }

    /// The net under a forward pass that forgot autocast: under bf16/fp16/fp8, a backward
    /// with no autocast region since the last optimizer step is reported once (a warning:
    /// code may cast by hand).
    fn check_autocast(&self) -> Result<()> {
        use std::sync::atomic::Ordering::Relaxed;
        if precision::autocast_kind(self.inner.config.precision).is_none()
            || self.inner.state.autocast_since_step()
            || self.inner.warned_autocast.load(Relaxed)
            || crate::shim::autocast_state(self.device())?.is_some()
        {
            return Ok(());
        }
        self.inner.warned_autocast.store(true, Relaxed);
        if self.is_main_process() {
            eprintln!(
                "accel: precision is {}, but this backward's forward pass ran outside any \
                 autocast region, so it ran in fp32 (reported once). Run the forward pass \
                 through `accelerator.forward(|| ..)` or under `accelerator.autocast()`; under \
                 #[accelerate], inside the training loop",
                self.inner.config.precision
            );
        }
        Ok(())
    }

    /// Every prepared model's buffers from the first rank of their group to the others.
    pub(crate) fn sync_buffers(&self) -> Result<()> {
        for buffers in self.inner.buffers.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            buffers.sync()?;
        }
        Ok(())
    }

    /// A backward pass from `output` with its gradient `grad` given (a pipeline stage's
    /// output, whose gradient the next stage computed): a micro-step as [`backward`]'s,
    /// without loss division or scaling (the gradient carries them already).
    ///
    /// [`backward`]: Self::backward
    pub(crate) fn backward_with_grad(&self, output: &Tensor, grad: &Tensor) -> Result<()> {
        self.inner.state.begin_micro_step();
        let surrogate = output.f_mul(grad)?.f_sum(tch::Kind::Float)?;
        surrogate.f_backward().map_err(|e| {
            Error::Training(format!("backward failed: {}", crate::error::torch_text(&e)))
        })?;
        let sync = self.inner.state.sync_gradients();
        self.inner.strategy.after_backward(&self.strategy_context(), sync)?;
        if sync {
            self.sync_buffers()?;
        }
        Ok(())
    }

    /// The model's variables by name, whole: under zero2/zero3 the sharded parameters are
    /// gathered from every rank's shard (a collective: call it on every process, as
    /// Accelerate's `get_state_dict`); otherwise copies of the local values.
    pub fn full_state_dict(&self, vs: &tch::nn::VarStore) -> Result<Vec<(String, Tensor)>> {
        self.full_state_of(crate::optim::sorted_variables(vs))
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
        self.inner.scaler.as_ref().map(|s| s.lock().unwrap_or_else(|e| e.into_inner()).scale())
    }

    /// The folder for automatically named checkpoints, if configured.
    pub fn checkpoint_dir(&self) -> Option<&Path> {
        self.inner.checkpoint_dir.as_deref()
    }
}
