//! accel-core: distributed training for [tch], the runtime that `#[accelerate]` expands
//! into and that can also be used by hand.
//!
//! Where to look: [`Accelerator`] (configuration, device placement, autocast,
//! accumulation, loss scaling, checkpoints, trackers); the parallel strategies
//! ([`strategy`]: DDP, ZeRO-1/2/3 and FSDP, Local SGD, tensor and context parallelism) and
//! [`pipeline`]; the process groups and their transports ([`comm`], over the [`mesh`]);
//! `accel launch` ([`launch`]); our own optimizers and schedules ([`optim`]); data loading
//! ([`data`]); mixed precision ([`precision`]); the libtorch shim ([`shim`]); CUDA loading
//! with clear diagnostics ([`cuda`]); malloc set up for training steps on CPU ([`heap`]).
//!
//! An ordinary tch training function, with the one line (it runs on one process here; under
//! `accel launch --num-processes 2` the same binary trains data-parallel):
//!
//! ```
//! use tch::nn::{self, Module, OptimizerConfig};
//! use tch::{Device, Kind, Tensor};
//!
//! #[accel_core::accelerate(strategy = "ddp", accumulate = 2, cpu = true)]
//! fn train(steps: usize) -> accel_core::Result<f64> {
//!     let vs = nn::VarStore::new(Device::Cpu);
//!     let net = nn::linear(vs.root() / "lin", 4, 1, Default::default());
//!     let mut opt = nn::Sgd::default().build(&vs, 0.1)?;
//!     let x = Tensor::ones([8, 4], (Kind::Float, Device::Cpu));
//!     let mut last = f64::NAN;
//!     for _ in 0..steps {
//!         let loss = (net.forward(&x) - 1.0).square().mean(Kind::Float);
//!         opt.zero_grad();
//!         loss.backward();
//!         opt.step();
//!         last = loss.double_value(&[]);
//!     }
//!     Ok(last)
//! }
//!
//! assert!(train(20)? < 1.0);
//! # Ok::<(), accel_core::Error>(())
//! ```
//!
//! The same by hand, with [`Accelerator`]'s explicit API:
//!
//! ```
//! use accel_core::data::{DataLoader, LoaderOptions, TensorDataset};
//! use accel_core::optim::{Sgd, SgdConfig, named_params};
//! use accel_core::Accelerator;
//! use tch::nn::{self, Module};
//! use tch::{Device, Kind, Tensor};
//!
//! let acc = Accelerator::builder().cpu(true).accumulate(2).build()?;
//! let vs = nn::VarStore::new(acc.device());
//! let net = nn::linear(vs.root() / "lin", 4, 1, Default::default());
//! acc.prepare_model(&vs)?;
//! let mut opt = acc.prepare_optimizer(Sgd::new(named_params(&vs), SgdConfig { lr: 0.1, ..Default::default() })?);
//! let data = TensorDataset::new(vec![Tensor::ones([16, 4], (Kind::Float, Device::Cpu))])?;
//! let options = LoaderOptions { batch_size: 4, ..Default::default() };
//! let mut loader = acc.prepare_loader(DataLoader::new(data, options)?)?;
//! for batch in loader.iter() {
//!     let x = &batch?[0];
//!     let loss = acc.forward(|| net.forward(x))?.square().mean(Kind::Float);
//!     acc.backward(&loss)?;
//!     opt.step()?;
//!     opt.zero_grad()?;
//! }
//! assert_eq!(acc.counters().optimizer_steps, 2, "4 batches, accumulating 2");
//! acc.end_training()?;
//! # Ok::<(), accel_core::Error>(())
//! ```

// Lets derive output (`::accel_core::...`) compile inside this crate too.
extern crate self as accel_core;

mod accelerator;
mod accumulation;
mod checkpoint;
pub mod collective;
pub mod comm;
pub mod config;
pub mod cuda;
pub mod data;
pub mod device;
mod error;
mod fault;
pub mod heap;
pub mod launch;
pub mod mesh;
pub mod nn;
pub mod optim;
pub mod pipeline;
pub mod precision;
pub mod profile;
pub mod shim;
pub mod strategy;
mod sync;
pub mod topology;
pub mod tracking;
mod world;

pub use accel_macros::{ToDevice, accelerate};
pub use accelerator::helpers::{
    Stateful, find_executable_batch_size, find_executable_batch_size_with, is_out_of_memory,
};
pub use accelerator::{
    AcceleratedOptimizer, Accelerator, AcceleratorBuilder, AdoptOptimizer, DataPosition, DrawnLoop,
    DriveOptimizer, Driven, ExitGuard, ForwardGuard, IntoAccelOptimizer, IoCounts, Lent,
    PreparedBatches, PreparedIter, PreparedLoader, StepCounters, StepGuard, Steps, TrackerRef,
    current, split_between,
};
pub use checkpoint::{HfCheckpoint, merge_weights};
pub use config::{Config, DataSharding, Fp8Recipe, LogWith, Precision, Strategy};
pub use device::ToDevice;
pub use error::{Error, Result};
pub use strategy::fsdp::{PendingUnits, ShardOptions, Unit};

/// The version of accel-core.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The version of tch accel-core is built on (pinned in the workspace's Cargo.toml).
pub const TCH_VERSION: &str = "0.24.0";

/// What generated code refers to; not part of the public API.
#[doc(hidden)]
pub mod __private {
    pub use tch::Device;
}
