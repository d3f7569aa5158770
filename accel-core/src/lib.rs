//! accel-core: distributed training for [tch], the runtime that `#[accelerate]` expands
//! into and that can also be used by hand.
//!
//! This release holds the foundation: the libtorch shim ([`shim`]: autograd hooks,
//! autocast with a chosen dtype, storage release, the CUDA stream, fused AdamW) and CUDA
//! loading with clear diagnostics ([`cuda`]).

pub mod cuda;
mod error;
pub mod shim;

pub use error::{Error, Result};

/// The version of accel-core.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The version of tch accel-core is built on (pinned in the workspace's Cargo.toml).
pub const TCH_VERSION: &str = "0.24.0";
pub mod optim;
