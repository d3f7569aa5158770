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
pub mod topology;
pub mod tracking;
mod world;

pub use accel_macros::{ToDevice, accelerate};
pub use accelerator::helpers::{
    Stateful, find_executable_batch_size, find_executable_batch_size_with, is_out_of_memory,
};
pub use accelerator::{
    AcceleratedOptimizer, Accelerator, AcceleratorBuilder, AdoptOptimizer, DataPosition, DrawnLoop,
    DriveOptimizer, Driven, ExitGuard, ForwardGuard, IntoAccelOptimizer, Lent, PreparedBatches,
    PreparedIter, PreparedLoader, StepCounters, StepGuard, Steps, TrackerRef, current,
    split_between,
};
pub use checkpoint::{HfCheckpoint, merge_weights};
pub use config::{Config, DataSharding, Fp8Recipe, LogWith, Precision, Strategy};
pub use device::ToDevice;
pub use error::{Error, Result};
pub use strategy::fsdp::{ShardOptions, Unit};

/// The version of accel-core.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The version of tch accel-core is built on (pinned in the workspace's Cargo.toml).
pub const TCH_VERSION: &str = "0.24.0";

/// What generated code refers to; not part of the public API.
#[doc(hidden)]
pub mod __private {
    pub use tch::Device;
}
