//! How gradients (and later parameters and optimizer state) are shared between processes.
//! One folder per strategy, each with a README of how it works.

pub mod ddp;
pub mod fsdp;
