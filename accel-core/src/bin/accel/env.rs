//! `accel env`: the facts a bug report needs.

use std::fmt::Write;

use accel_core::cuda::{self, LibtorchCuda};

/// Variables that decide how a distributed run starts, from accel's launcher, torchrun,
/// Slurm, Open MPI, NCCL and CUDA.
const DISTRIBUTED_PREFIXES: &[&str] = &[
    "ACCEL_",
    "SLURM_",
    "OMPI_COMM_WORLD_",
    "PMI_",
    "PMIX_",
    "MPI_LOCAL",
    "MV2_COMM_WORLD_",
    "NCCL_",
    "TORCH_",
    "TORCHELASTIC_",
];
const DISTRIBUTED_NAMES: &[&str] = &[
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "CUDA_VISIBLE_DEVICES",
    "OMP_NUM_THREADS",
    "LIBTORCH",
    "LD_LIBRARY_PATH",
];

pub(crate) fn report() -> String {
    // Before any CUDA query: libtorch caches the first answer.
    let libtorch_cuda = cuda::load_libtorch_cuda();
    let mut out = String::new();
    let mut line = |key: &str, value: String| {
        let _ = writeln!(out, "{key:<22}{value}");
    };
    line("accel", accel_core::VERSION.to_owned());
    line("tch", accel_core::TCH_VERSION.to_owned());
    line(
        "libtorch",
        format!("{} ({})", accel_core::shim::torch_version(), cuda::libtorch_lib_dir().display()),
    );
    line(
        "libtorch_cuda.so",
        match libtorch_cuda {
            LibtorchCuda::Linked(p) => format!("linked ({})", p.display()),
            LibtorchCuda::LoadedNow(p) => format!("loaded by dlopen, not linked ({})", p.display()),
            LibtorchCuda::NotShipped(_) => "absent: this libtorch is CPU-only".to_owned(),
            LibtorchCuda::Failed { path, error } => {
                format!("failed to load {}: {error}", path.display())
            }
        },
    );
    line("CUDA available", tch::Cuda::is_available().to_string());
    line("CUDA devices", tch::Cuda::device_count().to_string());
    line("cuDNN available", tch::Cuda::cudnn_is_available().to_string());
    match cuda::driver_info() {
        Ok(info) => {
            line("NVIDIA driver", format!("CUDA {}", info.version));
            for (i, (name, bytes)) in info.devices.iter().enumerate() {
                line(&format!("  cuda:{i}"), format!("{name}, {:.1} GiB", gib(*bytes)));
            }
        }
        Err(why) => line("NVIDIA driver", format!("none ({why})")),
    }
    line(
        "NCCL",
        match cuda::nccl_info() {
            Ok(nccl) => format!("{} ({})", nccl.version, nccl.path.display()),
            Err(why) => format!("not found: {why}"),
        },
    );
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    line("CPU", format!("{}, {cores} usable cores", cpu_model()));
    line(
        "torch threads",
        format!("{} intra-op, {} inter-op", tch::get_num_threads(), tch::get_num_interop_threads()),
    );
    line("OS", format!("{} {}", std::env::consts::OS, std::env::consts::ARCH));
    line("CPU transport", cpu_transport());

    let mut vars: Vec<(String, String)> = std::env::vars()
        .filter(|(k, _)| {
            DISTRIBUTED_NAMES.contains(&k.as_str())
                || DISTRIBUTED_PREFIXES.iter().any(|p| k.starts_with(p))
        })
        .collect();
    vars.sort();
    let _ = writeln!(out, "distributed variables{}", if vars.is_empty() { ": none" } else { ":" });
    for (k, v) in vars {
        let _ = writeln!(out, "  {k}={v}");
    }
    out
}

fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| {
            info.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown CPU".to_owned())
}

/// What the cpu backend's processes on this machine will most likely use between each
/// other, and why (`accel test` shows what a run really got).
fn cpu_transport() -> String {
    const DIRECT: &str = "direct copies (process_vm_readv)";
    if std::env::var_os(accel_core::config::env::DISABLE_CMA).is_some() {
        return "TCP (ACCEL_DISABLE_CMA is set)".into();
    }
    let cap_sys_ptrace = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            let hex = s.lines().find_map(|l| l.strip_prefix("CapEff:"))?.trim().to_owned();
            u64::from_str_radix(&hex, 16).ok()
        })
        .is_some_and(|caps| caps & (1 << 19) != 0);
    let scope = std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope")
        .ok()
        .and_then(|s| s.trim().parse::<u8>().ok());
    match (scope, cap_sys_ptrace) {
        (None, _) => format!("{DIRECT}; no Yama: processes of one user read each other"),
        (Some(0 | 1), _) => format!(
            "{DIRECT}; kernel.yama.ptrace_scope = {}: accel's processes allow their launcher's \
             other children",
            scope.unwrap_or(0)
        ),
        (Some(2), true) => format!("{DIRECT}; kernel.yama.ptrace_scope = 2, CAP_SYS_PTRACE held"),
        (Some(n), _) => format!(
            "TCP (kernel.yama.ptrace_scope = {n}{} forbids reading another process's memory)",
            if n == 2 { " without CAP_SYS_PTRACE" } else { "" }
        ),
    }
}
