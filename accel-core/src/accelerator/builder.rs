//! [`AcceleratorBuilder`]: the configuration resolved from the builder, the environment and
//! the config file; the device; the mesh and its communicators; the strategy.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use tch::Device;

use super::{Accelerator, CURRENT, GradientState, Inner, Registry};
use crate::comm::GroupOptions;
use crate::config::file::{DEEPSPEED_CONFIG_ENV, LaunchConfig};
use crate::config::{Config, PartialConfig, Precision, Strategy, config_file_from_env};
use crate::error::{Error, Result};
use crate::mesh::{DeviceMesh, ParallelDims};
use crate::precision::{self, GradScaler, ScalerConfig};
use crate::strategy::ModelOptions;
use crate::strategy::ddp::DdpOptions;
use crate::strategy::fsdp::ShardOptions;
use crate::sync::Locked;
use crate::topology::Topology;

/// The builder's method of each setting the table marks `builder yes`: it sets the value,
/// which wins over the environment's and the config file's.
macro_rules! builder_methods {
    ($(
        $(#[doc = $doc:literal])+
        $name:ident : $mode:ident $ty:ty = $default:expr,
            env $env:literal, attribute $attr:ident, builder $builder:ident;
    )+) => {
        impl AcceleratorBuilder {
            $(builder_method!($builder $name $ty; $($doc)+);)+
        }
    };
}

macro_rules! builder_method {
    (yes $name:ident $ty:ty; $($doc:literal)+) => {
        $(#[doc = $doc])+
        pub fn $name(mut self, value: $ty) -> Self {
            self.explicit.$name = Some(value);
            self
        }
    };
    (no $name:ident $ty:ty; $($doc:literal)+) => {};
}

accel_choices::settings!(builder_methods);

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
    /// Whether `.offload(..)` was called (it then wins over a config file's offload).
    offload_set: bool,
    custom: Option<Arc<dyn crate::strategy::Strategy>>,
    project_dir: Option<PathBuf>,
    data: crate::config::DataSharding,
    sync_batchnorm: bool,
    fp32_gathers: bool,
    /// Set by `#[accelerate]`: the data loops it prepared (the run's first line says it).
    attribute_data_loops: Option<usize>,
    /// Set by `#[accelerate]`: of those, the loops that draw their own batches.
    attribute_drawn_loops: usize,
    /// Set by `#[accelerate]`: the annotated function and where it is, for messages.
    attribute_call: Option<String>,
    /// Tests driving ranks as threads: the topology and mesh to use instead of the
    /// environment's.
    #[cfg(test)]
    thread_rank: Option<(Topology, DeviceMesh)>,
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

    /// The experiment trackers [`Accelerator::init_trackers`] starts (Accelerate's
    /// `log_with`): TensorBoard, JSONL + CSV, MLflow, or all. It wins over `log_with` in
    /// the environment (`ACCEL_LOG_WITH`, `accel launch --log-with`) and the config file.
    pub fn log_with(
        mut self,
        trackers: impl IntoIterator<Item = crate::tracking::LogWith>,
    ) -> Self {
        self.explicit.log_with.get_or_insert_with(Vec::new).extend(trackers);
        self
    }

    /// Where trackers write (Accelerate's `project_dir`; default `runs`): each run in
    /// `project_dir/project_name`.
    pub fn project_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.project_dir = Some(dir.into());
        self
    }

    /// DDP settings (bucket size, unused parameters, gradient compression).
    pub fn ddp(mut self, options: DdpOptions) -> Self {
        self.ddp = options;
        self
    }
    /// Who deals the data across processes: the accelerator (`Prepared`, the default: with
    /// several processes, a step on batches that did not come through `prepare_loader` or
    /// `prepare_iter` is an error) or the program (`Manual`: it gives each process its own
    /// part; nothing is dealt or checked).
    pub fn data(mut self, data: crate::config::DataSharding) -> Self {
        self.data = data;
        self
    }
    /// Whether DDP keeps every model's buffers (batch norm's running statistics) equal to
    /// rank 0's (torch's `broadcast_buffers`, on by default). Sharded strategies always do.
    pub fn broadcast_buffers(mut self, on: bool) -> Self {
        self.ddp.broadcast_buffers = on;
        self
    }
    /// Batch norm layers made by [`Accelerator::batch_norm2d`] (and 1d, 3d) compute their
    /// statistics over the whole data-parallel group (torch's `SyncBatchNorm`); under
    /// `#[accelerate(sync_batchnorm = true)]` the body's `nn::batch_norm*d` become them.
    pub fn sync_batchnorm(mut self, on: bool) -> Self {
        self.sync_batchnorm = on;
        self
    }
    /// Under zero3/fsdp with precision bf16, gather the units' parameters and reduce their
    /// gradients in fp32 (autocast then casts them) instead of bf16. By default they are
    /// gathered, computed and reduced in bf16 with fp32 masters, as Accelerate's FSDP plugin
    /// sets FSDP's `MixedPrecision` from `mixed_precision = "bf16"`.
    pub fn fp32_gathers(mut self, on: bool) -> Self {
        self.fp32_gathers = on;
        self
    }
    /// Set by `#[accelerate]`: how many data loops it prepared, for the run's first line.
    #[doc(hidden)]
    pub fn attribute_data_loops(mut self, loops: usize) -> Self {
        self.attribute_data_loops = Some(loops);
        self
    }
    /// Set by `#[accelerate]`: how many of its data loops draw their own batches.
    #[doc(hidden)]
    pub fn attribute_drawn_loops(mut self, loops: usize) -> Self {
        self.attribute_drawn_loops = loops;
        self
    }
    /// Set by `#[accelerate]`: which function is annotated, and where ("`train` at
    /// src/main.rs:12"), for messages about the process's group.
    #[doc(hidden)]
    pub fn attribute_call(mut self, call: &str) -> Self {
        self.attribute_call = Some(call.to_owned());
        self
    }
    /// Keep the fp32 master shards and the optimizer state in CPU memory (zero2, zero3,
    /// fsdp; `build` refuses it with another strategy).
    pub fn offload(mut self, offload: bool) -> Self {
        self.sharding.offload = offload;
        self.offload_set = true;
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

    /// A rank run as a thread of a test: `process` and `mesh` instead of the environment's.
    #[cfg(test)]
    pub(crate) fn thread_rank(mut self, process: Topology, mesh: DeviceMesh) -> Self {
        self.thread_rank = Some((process, mesh));
        self
    }

    /// Resolves the configuration and the device and makes the accelerator (also reachable
    /// afterwards through [`crate::current`]). On the CPU it also sets glibc's malloc to keep
    /// freed memory for the next step ([`crate::heap`]; `ACCEL_KEEP_HEAP=0` does not).
    pub fn build(self) -> Result<Accelerator> {
        #[cfg(test)]
        let (process, given_mesh): (Topology, Option<DeviceMesh>) = match self.thread_rank.clone() {
            Some((process, mesh)) => (process, Some(mesh)),
            None => (Topology::from_env()?, None),
        };
        #[cfg(not(test))]
        let (process, given_mesh): (Topology, Option<DeviceMesh>) = (Topology::from_env()?, None);
        // Our YAML, Accelerate's, or a DeepSpeed JSON (whose other settings may also come
        // from the launcher, as ACCEL_DEEPSPEED_CONFIG).
        let named = self
            .config_file
            .clone()
            .or_else(config_file_from_env)
            .or_else(|| std::env::var_os(DEEPSPEED_CONFIG_ENV).map(PathBuf::from));
        let launch_file = match named {
            Some(path) => LaunchConfig::from_file(&path)?,
            None => LaunchConfig::default(),
        };
        if process.rank == 0 {
            for warning in &launch_file.warnings {
                eprintln!("accel: {warning}");
            }
        }
        let deepspeed = match &launch_file.deepspeed_config {
            Some(path) => Some(crate::config::deepspeed::read(path)?.settings),
            None => None,
        };
        let file = launch_file.training;
        let env = PartialConfig::from_env()?;
        let outside = file.overlay(&env);
        let conflicts = self.explicit.conflicts(&outside);
        let mut wanted = outside.overlay(&self.explicit);
        if let (None, Some(ds)) = (wanted.accumulate, &deepspeed) {
            // DeepSpeed infers it from its batch sizes (train ÷ micro ÷ data-parallel ranks).
            let partial = wanted.build()?;
            let replicas = ParallelDims::for_run(&partial, &process)?.size(crate::mesh::Dim::Batch);
            wanted.accumulate = ds.inferred_accumulation(replicas);
        }
        let config = wanted.build()?;
        if process.rank == 0 {
            for (key, ours, theirs) in conflicts {
                eprintln!(
                    "accel: {key} = {ours} set in code overrides {key} = {theirs} from the \
                     environment/config file"
                );
            }
        }
        let (mut sharding, mut ddp, mut scaler_config) =
            (self.sharding.clone(), self.ddp, ScalerConfig::default());
        if let Some(ds) = &deepspeed {
            if ds.offload && !self.offload_set {
                if config.strategy.can_offload() {
                    sharding.offload = true;
                } else if process.rank == 0 {
                    eprintln!(
                        "accel: the DeepSpeed config's offload is not used: the strategy {} \
                         set in code does not shard",
                        config.strategy
                    );
                }
            }
            if let Some(scaler) = ds.scaler {
                scaler_config = scaler;
            }
            // DeepSpeed counts elements; accel's buckets are bytes of fp32 gradients.
            if let Some(elements) = ds.reduce_bucket_elements {
                if ddp.bucket_bytes == DdpOptions::default().bucket_bytes {
                    ddp.bucket_bytes = elements.saturating_mul(4);
                }
            }
            if let Some(kind) = ds.communication {
                ddp.compression.get_or_insert(kind);
                sharding.reduce_dtype.get_or_insert(kind);
            }
        }
        // The file's or the launcher's FSDP settings, where the code set none of its own.
        if config.offload && !self.offload_set {
            sharding.offload = true;
        }
        if config.find_unused_parameters {
            ddp.allow_unused = true;
            sharding.allow_unused = true;
        }
        sharding.step_in_backward = config.optimizer_in_backward;
        if sharding.units.is_none() && sharding.min_unit_params.is_none() {
            match config.wrap {
                crate::config::Wrap::Layers => {}
                crate::config::Wrap::Size(n) => sharding.min_unit_params = Some(n),
                crate::config::Wrap::None => sharding.units = Some(Vec::new()),
            }
        }
        crate::config::check_offload(sharding.offload, config.strategy)?;
        // FSDP's MixedPrecision as Accelerate's plugin sets it for bf16: units gathered,
        // computed and reduced in bf16, masters in fp32.
        let gathers_units =
            matches!(config.strategy, Strategy::Zero3 | Strategy::Fsdp | Strategy::HybridShard);
        if gathers_units
            && config.precision == Precision::Bf16
            && sharding.param_dtype.is_none()
            && !self.fp32_gathers
        {
            sharding.param_dtype = Some(tch::Kind::BFloat16);
            sharding.reduce_dtype.get_or_insert(tch::Kind::BFloat16);
        }
        if let Some(kind) = sharding.param_dtype {
            check_param_dtype(kind, config.strategy, config.precision)?;
        }
        let device = self.device.unwrap_or_else(|| default_device(&config, &process));
        let device = crate::cuda::check_device(device)?;
        precision::check_precision(config.precision, device)?;
        if device == Device::Cpu {
            // Steps reuse the last step's freed memory instead of faulting it in afresh.
            if let crate::heap::HeapSetup::Refused(why) = crate::heap::keep_step_memory()? {
                if process.rank == 0 {
                    eprintln!("accel: {why}");
                }
            }
        }
        let dims = ParallelDims::for_run(&config, &process)?;
        let micro_batch_size = match &deepspeed {
            Some(ds) => {
                ds.check_batch_sizes(config.accumulate, dims.size(crate::mesh::Dim::Batch))?
            }
            None => None,
        };
        if let Device::Cuda(index) = device {
            // This thread's (and NCCL's) device: every CUDA call that follows lands on it.
            crate::shim::set_cuda_device(index)?;
        }
        let given_mesh_absent = given_mesh.is_none();
        let mesh = match given_mesh {
            Some(mesh) => mesh,
            None if process.world_size > 1 || crate::mesh::group_of_one() => {
                let who = self.attribute_call.clone().unwrap_or_else(|| "an accelerator".into());
                crate::world::mesh_for(&process, GroupOptions::from_env()?, dims, device, &who)?
            }
            None => DeviceMesh::single(),
        };
        let strategy = match self.custom {
            Some(custom) => custom,
            None => {
                crate::strategy::builtin(config.strategy, &mesh, sharding, process.local_world_size)
            }
        };
        if let Some(seed) = config.seed {
            tch::manual_seed(seed as i64);
        }
        let scaler = (config.precision == Precision::Fp16)
            .then(|| Arc::new(Mutex::new(GradScaler::new(scaler_config, device))));
        let fp8 = (config.precision == Precision::Fp8)
            .then(|| Arc::new(precision::fp8::Fp8Layers::new(config.fp8_recipe)));
        let tp = crate::strategy::tp::TensorParallel::new(
            mesh.comm(crate::mesh::Dim::Tensor),
            config.sequence_parallel,
        )
        .with_fp8(fp8.clone());
        let cp = crate::strategy::cp::ContextParallel::new(mesh.comm(crate::mesh::Dim::Context));
        let parallel = crate::strategy::model_parallel::ModelParallel::new(&mesh, device, tp, cp);
        let model_options = ModelOptions::from(ddp).sync_module_states(config.sync_module_states);
        let log_with = config.log_with.clone();
        let accelerator = Accelerator {
            inner: Arc::new(Inner {
                state: Arc::new(GradientState::new(config.accumulate)),
                config,
                process,
                device,
                scaler,
                registry: Mutex::new(Registry::default()),
                checkpoint_dir: self.checkpoint_dir,
                checkpoint_limit: self.checkpoint_limit,
                shared_dirs: Mutex::default(),
                parallel,
                fp8,
                mesh,
                strategy,
                model_options,
                micro_batch_size,
                trackers: Mutex::new(crate::tracking::Trackers {
                    log_with,
                    project_dir: self.project_dir,
                    ..Default::default()
                }),
                prepared_gradients: Mutex::new(Default::default()),
                data: self.data,
                sync_batchnorm: self.sync_batchnorm,
                warned_autocast: Default::default(),
                units: Default::default(),
                strategy_ended: Default::default(),
                io: Default::default(),
                trigger: Default::default(),
                buffers: Mutex::new(Vec::new()),
                loop_exit: Arc::default(),
                drawn: Mutex::default(),
                run_name: self.attribute_call.clone().unwrap_or_else(|| "an accelerator".into()),
            }),
        };
        // Before the first step, not at the first save after an epoch of training.
        if let Some(dir) = accelerator.inner.checkpoint_dir.clone() {
            accelerator.refuse_unshared(&dir, "checkpoint directory")?;
        }
        if accelerator.is_main_process() && !quiet() {
            eprintln!(
                "{}",
                accelerator
                    .describe(self.attribute_data_loops.map(|n| (n, self.attribute_drawn_loops)))
            );
        }
        if given_mesh_absent {
            // Process-wide; a test's thread ranks leave it to the process.
            crate::optim::note_run(accelerator.process_index(), accelerator.num_processes());
        }
        let _ = CURRENT.set(Mutex::new(std::sync::Weak::new()));
        if let Some(current) = CURRENT.get() {
            *current.locked() = Arc::downgrade(&accelerator.inner);
        }
        Ok(accelerator)
    }
}

/// `ACCEL_QUIET=1` drops the run's first line (for programs that own their output).
pub(crate) fn quiet() -> bool {
    std::env::var(crate::config::env::QUIET)
        .is_ok_and(|v| !matches!(v.as_str(), "" | "0" | "false"))
}

fn default_device(config: &Config, process: &Topology) -> Device {
    if config.cpu {
        return Device::Cpu;
    }
    crate::cuda::load_libtorch_cuda();
    if tch::Cuda::is_available() { Device::Cuda(process.local_rank) } else { Device::Cpu }
}

/// `ShardOptions::param_dtype` is FSDP's `MixedPrecision(param_dtype)`: it needs units that
/// are gathered per use and autocast for the operations between them.
fn check_param_dtype(kind: tch::Kind, strategy: Strategy, precision: Precision) -> Result<()> {
    if !matches!(kind, tch::Kind::BFloat16 | tch::Kind::Half) {
        return Err(Error::Config(format!(
            "ShardOptions::param_dtype is {kind:?}; it must be BFloat16 or Half"
        )));
    }
    if !matches!(
        strategy,
        Strategy::Zero3 | Strategy::Fsdp | Strategy::HybridShard | Strategy::Auto
    ) {
        return Err(Error::Config(format!(
            "ShardOptions::param_dtype applies to parameters gathered per unit (strategy zero3, \
             fsdp or hybrid_shard); the strategy is {strategy}"
        )));
    }
    if precision == Precision::No {
        return Err(Error::Config(format!(
            "ShardOptions::param_dtype {kind:?} needs autocast between the units: set precision \
             bf16 or fp16 (it is \"no\")"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn param_dtype_needs_a_half_dtype_a_gathering_strategy_and_autocast() {
        use tch::Kind::{BFloat16, Float};
        check_param_dtype(BFloat16, Strategy::Zero3, Precision::Bf16).unwrap();
        let text = |r: Result<()>| r.unwrap_err().to_string();
        assert!(
            text(check_param_dtype(Float, Strategy::Zero3, Precision::Bf16))
                .contains("BFloat16 or Half")
        );
        assert!(
            text(check_param_dtype(BFloat16, Strategy::Zero2, Precision::Bf16)).contains("zero2")
        );
        assert!(
            text(check_param_dtype(BFloat16, Strategy::Fsdp, Precision::No))
                .contains("precision bf16")
        );
    }
}
