//! [`LaunchConfig`]: the settings of a launch, as the config files give them (read by
//! file.rs, yaml.rs and deepspeed.rs).

use std::path::PathBuf;

use serde::Serialize;

use super::PartialConfig;
use super::check::Report;

/// Settings of a launch; every field optional (flags and defaults fill the rest).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct LaunchConfig {
    /// Processes per machine.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub num_processes: Option<usize>,
    /// Machines.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub num_machines: Option<usize>,
    /// This machine's index.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub machine_rank: Option<usize>,
    /// Address of machine 0 (rank 0's store listens there).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub main_process_ip: Option<String>,
    /// Port of rank 0's store (0: a free one, single machine only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub main_process_port: Option<u16>,
    /// Training settings passed to the program as `ACCEL_*` variables.
    #[serde(flatten)]
    pub training: PartialConfig,
    /// A DeepSpeed JSON config (the file given, or Accelerate's `deepspeed_config_file`):
    /// its settings beyond `training` reach the program through `ACCEL_DEEPSPEED_CONFIG`.
    #[serde(rename = "deepspeed_config_file", skip_serializing_if = "Option::is_none")]
    pub deepspeed_config: Option<PathBuf>,
    /// `CUDA_VISIBLE_DEVICES` for every process (Accelerate's `gpu_ids`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu_ids: Option<String>,
    /// `OMP_NUM_THREADS` for every process (default: cores ÷ processes).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub num_cpu_threads_per_process: Option<usize>,
    /// What reading the file has to say (performance settings not followed), for the
    /// caller to print once.
    #[serde(skip)]
    pub warnings: Vec<String>,
    /// One note per key of the file(s) read.
    #[serde(skip)]
    pub report: Report,
}
