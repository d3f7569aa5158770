//! The [`Accelerator`]: one per process. It knows the topology and the configuration,
//! prepares the model, optimizers and data, runs forward passes under autocast and
//! backward passes with loss scaling and accumulation, and saves and restores the whole
//! training state.

mod attribute;
mod data;
mod driven;
mod optimizer;
mod state;

use std::fmt::Display;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use tch::{Device, Tensor};

use crate::comm::{Communicator, GroupOptions, ProcessGroup, ReduceOp};
use crate::config::{Config, PartialConfig, Precision, Strategy, config_file_from_env};
use crate::data::{DataLoader, Dataset};
use crate::device::ToDevice;
use crate::error::{Error, Result};
use crate::mesh::{DeviceMesh, ParallelDims};
use crate::optim::{Optimizer, Param, named_params};
use crate::precision::{self, GradScaler, ScalerConfig, ToFp32};
use crate::shim::AutocastGuard;
use crate::strategy::ModelOptions;
use crate::strategy::ddp::DdpOptions;
use crate::strategy::fsdp::ShardOptions;
use crate::topology::Topology;

pub use attribute::{AdoptOptimizer, ExitGuard, IntoAccelOptimizer};
pub use data::{DataPosition, PreparedBatches, PreparedIter, PreparedLoader, Rounds};
pub use driven::{DriveOptimizer, Driven};
pub use optimizer::AcceleratedOptimizer;
pub(crate) use state::GradientState;
pub use state::StepCounters;

/// Builds an [`Accelerator`]; every setting left out comes from the environment
/// (`ACCEL_*`, set by `accel launch`), the config file, or the defaults.
#[derive(Default, Clone)]
pub struct AcceleratorBuilder {
    explicit: PartialConfig,
    config_file: Option<PathBuf>,
    device: Option<Device>,
    checkpoint_dir: Option<PathBuf>,
    checkpoint_limit: Option<usize>,
    ddp: DdpOptions,
    sharding: ShardOptions,
    custom: Option<Arc<dyn crate::strategy::Strategy>>,
}

impl std::fmt::Debug for AcceleratorBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AcceleratorBuilder")
            .field("explicit", &self.explicit)
            .field("config_file", &self.config_file)
            .field("custom_strategy", &self.custom.as_ref().map(|s| s.name()))
            .finish_non_exhaustive()
    }
}

impl AcceleratorBuilder {
    /// Distributes the work with `strategy` instead of a built-in one (Accelerate's custom
    /// plugins): see [`crate::strategy::Strategy`]. The configured strategy name then only
    /// shapes the mesh (all processes data-parallel).
    pub fn custom_strategy(mut self, strategy: impl crate::strategy::Strategy) -> Self {
        self.custom = Some(Arc::new(strategy));
        self
    }

    /// DDP settings (bucket size, unused parameters, gradient compression).
    pub fn ddp(mut self, options: DdpOptions) -> Self {
        self.ddp = options;
        self
    }
    /// Distribution strategy.
    pub fn strategy(mut self, strategy: Strategy) -> Self {
        self.explicit.strategy = Some(strategy);
        self
    }
    /// Mixed precision.
    pub fn precision(mut self, precision: Precision) -> Self {
        self.explicit.precision = Some(precision);
        self
    }
    /// Micro-batches per optimizer step.
    pub fn accumulate(mut self, steps: u32) -> Self {
        self.explicit.accumulate = Some(steps);
        self
    }
    /// Clip the global gradient norm before every optimizer step.
    pub fn clip_grad_norm(mut self, max_norm: f64) -> Self {
        self.explicit.clip_grad_norm = Some(max_norm);
        self
    }
    /// Seed torch's generators (and the shuffling of loaders that use the run's seed).
    pub fn seed(mut self, seed: u64) -> Self {
        self.explicit.seed = Some(seed);
        self
    }
    /// Stay on CPU even where a GPU is available.
    pub fn cpu(mut self, cpu: bool) -> Self {
        self.explicit.cpu = Some(cpu);
        self
    }
    /// Keep the fp32 master shards and the optimizer state in CPU memory (zero2, zero3,
    /// fsdp; `build` refuses it with another strategy).
    pub fn offload(mut self, offload: bool) -> Self {
        self.sharding.offload = offload;
        self
    }

    /// How zero2/zero3/fsdp cut the model into units, where shards live, the reduction
    /// dtype (see [`ShardOptions`]).
    pub fn sharding(mut self, options: ShardOptions) -> Self {
        self.sharding = options;
        self
    }
    /// Read settings from this YAML file (else from `ACCEL_CONFIG_FILE`, if set).
    pub fn config_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.config_file = Some(path.into());
        self
    }
    /// Use this device instead of the one the topology implies.
    pub fn device(mut self, device: Device) -> Self {
        self.device = Some(device);
        self
    }
    /// Where [`Accelerator::save_checkpoint`] writes `checkpoint_{i}` folders, keeping at
    /// most `limit` of them (oldest removed first).
    pub fn checkpoints(mut self, dir: impl Into<PathBuf>, limit: Option<usize>) -> Self {
        self.checkpoint_dir = Some(dir.into());
        self.checkpoint_limit = limit;
        self
    }

    /// Resolves the configuration and the device and makes the accelerator (also reachable
    /// afterwards through [`crate::current`]).
    pub fn build(self) -> Result<Accelerator> {
        let process = Topology::from_env()?;
        let file = match self.config_file.clone().or_else(config_file_from_env) {
            Some(path) => PartialConfig::from_file(&path)?,
            None => PartialConfig::default(),
        };
        let env = PartialConfig::from_env()?;
        let outside = file.overlay(&env);
        let conflicts = self.explicit.conflicts(&outside);
        let config = outside.overlay(&self.explicit).build()?;
        if process.rank == 0 {
            for (key, ours, theirs) in conflicts {
                eprintln!(
                    "accel: {key} = {ours} set in code overrides {key} = {theirs} from the \
                     environment/config file"
                );
            }
        }
        if self.sharding.offload && !config.strategy.shards() {
            return Err(Error::Config(format!(
                "offload needs a sharded strategy (zero2, zero3 or fsdp); the strategy is {}",
                config.strategy
            )));
        }
        let device = self.device.unwrap_or_else(|| default_device(&config, &process));
        let device = crate::cuda::check_device(device)?;
        precision::check_precision(config.precision, device)?;
        let dims = ParallelDims::for_run(&config, &process)?;
        let mesh = if process.world_size > 1 {
            check_multi_process(&config, device)?;
            let world = ProcessGroup::new(&process, GroupOptions::default())?;
            DeviceMesh::new(dims, &world)?
        } else {
            DeviceMesh::single()
        };
        let strategy = match self.custom {
            Some(custom) => custom,
            None => crate::strategy::builtin(config.strategy, &mesh, self.sharding.clone()),
        };
        if let Some(seed) = config.seed {
            tch::manual_seed(seed as i64);
        }
        let scaler = (config.precision == Precision::Fp16)
            .then(|| Arc::new(Mutex::new(GradScaler::new(ScalerConfig::default(), device))));
        let accelerator = Accelerator {
            inner: Arc::new(Inner {
                state: Arc::new(state::GradientState::new(config.accumulate)),
                config,
                process,
                device,
                scaler,
                registry: Mutex::new(Registry::default()),
                checkpoint_dir: self.checkpoint_dir,
                checkpoint_limit: self.checkpoint_limit,
                mesh,
                strategy,
                model_options: ModelOptions::from(self.ddp),
                driven_unscaled: Mutex::new(Default::default()),
            }),
        };
        let _ = CURRENT.set(Mutex::new(None));
        if let Some(current) = CURRENT.get() {
            *current.lock().unwrap_or_else(|e| e.into_inner()) = Some(accelerator.clone());
        }
        Ok(accelerator)
    }
}

/// What this release can do with several processes: data parallelism and sharding on CPU.
fn check_multi_process(config: &Config, device: Device) -> Result<()> {
    if device != Device::Cpu {
        return Err(Error::Unsupported(format!(
            "{} on {device:?} with several processes: the strategies run over the cpu \
             backend so far (the NCCL communicator is not wired in yet); run with --cpu",
            config.strategy
        )));
    }
    Ok(())
}

fn default_device(config: &Config, process: &Topology) -> Device {
    if config.cpu {
        return Device::Cpu;
    }
    crate::cuda::load_libtorch_cuda();
    if tch::Cuda::is_available() { Device::Cuda(process.local_rank) } else { Device::Cpu }
}

static CURRENT: OnceLock<Mutex<Option<Accelerator>>> = OnceLock::new();

/// The accelerator most recently built in this process, if any (what `#[accelerate]` code
/// reaches from helper functions).
pub fn current() -> Option<Accelerator> {
    CURRENT.get().and_then(|c| c.lock().unwrap_or_else(|e| e.into_inner()).clone())
}

/// Objects whose state a checkpoint holds, in the order they were prepared.
#[derive(Default)]
pub(crate) struct Registry {
    pub(crate) models: Vec<Vec<Param>>,
    pub(crate) optimizers: Vec<AcceleratedOptimizer>,
    pub(crate) loaders: Vec<Arc<Mutex<DataPosition>>>,
}

pub(crate) struct Inner {
    pub(crate) config: Config,
    pub(crate) process: Topology,
    pub(crate) device: Device,
    pub(crate) state: Arc<state::GradientState>,
    pub(crate) scaler: Option<Arc<Mutex<GradScaler>>>,
    pub(crate) registry: Mutex<Registry>,
    pub(crate) checkpoint_dir: Option<PathBuf>,
    pub(crate) checkpoint_limit: Option<usize>,
    /// The run's parallel dimensions and their communicators (the world's group inside).
    pub(crate) mesh: DeviceMesh,
    /// What every hook of training defers to.
    pub(crate) strategy: Arc<dyn crate::strategy::Strategy>,
    model_options: ModelOptions,
    /// Driven optimizers (by their first parameter) whose gradients this step unscaled.
    driven_unscaled: Mutex<std::collections::HashSet<usize>>,
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

    /// The end of training: the strategy's last word (LocalSGD averages the parameters once
    /// more), then a barrier. An `#[accelerate]` function calls it when it succeeds.
    pub fn end_training(&self) -> Result<()> {
        self.inner.strategy.end_training(self)?;
        self.wait_for_everyone()
    }

    /// Every process's `tensor` (same shape on all) concatenated along dim 0; a scalar
    /// becomes one element per process.
    pub fn gather(&self, tensor: &Tensor) -> Result<Tensor> {
        match self.process_group() {
            Some(group) => group.all_gather(tensor),
            None => {
                Ok(if tensor.dim() == 0 { tensor.f_reshape([1])? } else { tensor.shallow_clone() })
            }
        }
    }

    /// [`gather`](Self::gather), minus the samples that padded the last round of a
    /// prepared loader (Accelerate's `gather_for_metrics`): over an epoch, exactly the
    /// data set's samples come back.
    pub fn gather_for_metrics(&self, tensor: &Tensor) -> Result<Tensor> {
        let gathered = self.gather(tensor)?;
        if self.inner.state.end_of_dataloader() {
            if let Some(remainder) = self.inner.state.remainder() {
                return Ok(gathered.f_narrow(0, 0, (remainder as i64).min(gathered.size()[0]))?);
            }
        }
        Ok(gathered)
    }

    /// The reduction of `tensor` over processes (a new tensor).
    pub fn reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<Tensor> {
        let out = tensor.f_detach_copy()?;
        if let Some(group) = self.process_group() {
            group.all_reduce(&out, op)?;
        }
        Ok(out)
    }

    /// Rank `from`'s `tensor` on every process (a new tensor).
    pub fn broadcast(&self, tensor: &Tensor, from: usize) -> Result<Tensor> {
        let out = tensor.f_detach_copy()?;
        if let Some(group) = self.process_group() {
            group.broadcast(&out, from)?;
        }
        Ok(out)
    }

    /// Pads `tensor` along `dim` to the largest size any process has, with `pad_value`, at
    /// the end (or the start with `pad_first`), so that it can be gathered.
    pub fn pad_across_processes(
        &self,
        tensor: &Tensor,
        dim: i64,
        pad_value: f64,
        pad_first: bool,
    ) -> Result<Tensor> {
        let Some(group) = self.process_group() else { return Ok(tensor.shallow_clone()) };
        let size = tensor.size();
        let d = if dim < 0 { dim + size.len() as i64 } else { dim } as usize;
        let len = Tensor::from_slice(&[size[d]]);
        group.all_reduce(&len, ReduceOp::Max)?;
        let max = len.int64_value(&[0]);
        if max == size[d] {
            return Ok(tensor.shallow_clone());
        }
        let mut padded_shape = size.clone();
        padded_shape[d] = max;
        let out = Tensor::f_full(&padded_shape, pad_value, (tensor.kind(), tensor.device()))?;
        let start = if pad_first { max - size[d] } else { 0 };
        out.f_narrow(d as i64, start, size[d])?.f_copy_(tensor)?;
        Ok(out)
    }

    /// Runs `f` on the main process first, then on the others (e.g. a download or a cache
    /// that one process should make).
    pub fn main_process_first<T>(&self, f: impl FnOnce() -> T) -> Result<T> {
        if !self.is_main_process() {
            self.wait_for_everyone()?;
        }
        let out = f();
        if self.is_main_process() {
            self.wait_for_everyone()?;
        }
        Ok(out)
    }

    /// This process's contiguous share of `items` (the first `len % N` processes get one
    /// more); with `pad`, shares are padded with the last item to equal length.
    pub fn split_between_processes<T: Clone>(&self, items: &[T], pad: bool) -> Vec<T> {
        split_between(items, self.process_index(), self.num_processes(), pad)
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
        self.inner.strategy.prepare_model(self, &params, &options.into())?;
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
        loader.shard(self.process_index(), self.num_processes())?;
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
        let rounds = Rounds::new(iterable.into_iter(), self.process_index(), self.num_processes());
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
        let options = crate::data::ShardOptions {
            rank: self.process_index(),
            world: self.num_processes(),
            batch_size,
            drop_last: false,
            even_batches: true,
            split_batches: false,
        };
        crate::data::IterableShard::new(samples.into_iter(), options)
    }

    /// Autocast for the configured precision until the guard is dropped (`None` in fp32).
    pub fn autocast(&self) -> Result<Option<AutocastGuard>> {
        precision::enter(self.inner.config.precision, self.device())
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
        self.inner.state.begin_micro_step();
        let n = self.inner.state.accumulate();
        let loss = if n > 1 { loss.f_div_scalar(n as f64)? } else { loss.shallow_clone() };
        let loss = match &self.inner.scaler {
            Some(scaler) => scaler.lock().unwrap_or_else(|e| e.into_inner()).scale_loss(&loss)?,
            None => loss,
        };
        loss.f_backward().map_err(|e| Error::Training(format!("backward failed: {e}")))?;
        self.inner.strategy.after_backward(self, self.inner.state.sync_gradients())
    }

    /// The model's variables by name, whole: under zero2/zero3 the sharded parameters are
    /// gathered from every rank's shard (a collective: call it on every process, as
    /// Accelerate's `get_state_dict`); otherwise copies of the local values.
    pub fn full_state_dict(&self, vs: &tch::nn::VarStore) -> Result<Vec<(String, Tensor)>> {
        let params = crate::optim::sorted_variables(vs);
        let values = self.inner.strategy.full_parameters(&params)?;
        Ok(params.into_iter().map(|p| p.name).zip(values).collect())
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

/// Accelerate's `split_between_processes` arithmetic.
pub fn split_between<T: Clone>(items: &[T], rank: usize, world: usize, pad: bool) -> Vec<T> {
    let (base, extra) = (items.len() / world, items.len() % world);
    let start = rank * base + rank.min(extra);
    let len = base + usize::from(rank < extra);
    let mut share = items[start..start + len].to_vec();
    if pad && extra > 0 && share.len() < base + 1 {
        if let Some(last) = items.last() {
            share.push(last.clone());
        }
    }
    share
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_between_processes_gives_the_first_ranks_one_more() {
        let items: Vec<u32> = (0..7).collect();
        assert_eq!(split_between(&items, 0, 3, false), [0, 1, 2]);
        assert_eq!(split_between(&items, 1, 3, false), [3, 4]);
        assert_eq!(split_between(&items, 2, 3, false), [5, 6]);
        assert_eq!(split_between(&items, 2, 3, true), [5, 6, 6]);
        assert_eq!(split_between(&items, 0, 1, false), items);
    }
}
