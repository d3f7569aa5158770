//! `accel bench allreduce`: like nccl-tests' all_reduce_perf, on accel's process group (or
//! its NCCL communicator, one GPU per process); optionally torch.distributed on the same
//! sizes and backend in the same run, with ratios.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::Instant;

use accel_core::comm::{Communicator, GroupOptions, ProcessGroup, ReduceOp};
use accel_core::topology::Topology;
use tch::{Device, Kind, Tensor};

use super::{LaunchArgs, this_binary};

fn parse_size(text: &str) -> accel_core::Result<u64> {
    let t = text.trim();
    let (number, unit) = t.split_at(t.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(t.len()));
    let scale = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        other => {
            return Err(accel_core::Error::Config(format!("unknown size unit `{other}` in `{t}`")));
        }
    };
    let n: f64 =
        number.trim().parse().map_err(|_| accel_core::Error::Config(format!("bad size `{t}`")))?;
    Ok((n * scale as f64) as u64)
}

fn parse_kind(dtype: &str) -> accel_core::Result<Kind> {
    Ok(match dtype {
        "f32" => Kind::Float,
        "f64" => Kind::Double,
        "f16" => Kind::Half,
        "bf16" => Kind::BFloat16,
        "i64" => Kind::Int64,
        other => {
            return Err(accel_core::Error::Config(format!(
                "unknown dtype `{other}`; use f32, f64, f16, bf16 or i64"
            )));
        }
    })
}

fn busbw(bytes: f64, seconds: f64, world: f64) -> f64 {
    bytes / seconds / 1e9 * 2.0 * (world - 1.0) / world
}

/// Runs in every process: times all-reduce per size; rank 0 prints and writes results.
pub(crate) fn worker(sizes: &str, dtype: &str, backend: &str) -> accel_core::Result<bool> {
    let kind = parse_kind(dtype)?;
    let sizes: Vec<u64> = sizes.split(',').map(parse_size).collect::<accel_core::Result<_>>()?;
    let topology = Topology::from_env()?;
    let group = ProcessGroup::new(&topology, GroupOptions::from_env()?)?;
    let (comm, device, transport): (Box<dyn Communicator>, Device, String) = match backend {
        "cpu" => (Box::new(group.clone()), Device::Cpu, group.transport().to_string()),
        "nccl" => {
            let device = Device::Cuda(topology.local_rank);
            let nccl = accel_core::comm::nccl::NcclComm::new(&group, device)?;
            let (_, version) = nccl.library();
            (Box::new(nccl), device, format!("NCCL {version}"))
        }
        other => {
            return Err(accel_core::Error::Config(format!(
                "unknown backend `{other}`; use cpu or nccl"
            )));
        }
    };
    // NCCL returns once the work is queued: time what the GPU did.
    let synchronize = || {
        if let Device::Cuda(index) = device {
            tch::Cuda::synchronize(index as i64);
        }
    };
    let world = group.size() as f64;
    let mut results = Vec::new();
    if group.rank() == 0 {
        println!(
            "{:>10} {:>10} {:>12} {:>12}   ({} processes, {dtype}; transport: {transport})",
            "size",
            "time ms",
            "algbw GB/s",
            "busbw GB/s",
            group.size(),
        );
    }
    for bytes in sizes {
        let n = (bytes as usize / kind.elt_size_in_bytes()).max(1) as i64;
        let t = Tensor::ones([n], (kind, device));
        for _ in 0..3 {
            comm.all_reduce(&t, ReduceOp::Sum)?;
        }
        synchronize();
        group.barrier()?;
        let iterations = (4e8 / bytes as f64).clamp(5.0, 200.0) as usize;
        let start = Instant::now();
        for _ in 0..iterations {
            comm.all_reduce(&t, ReduceOp::Sum)?;
        }
        synchronize();
        let seconds = start.elapsed().as_secs_f64() / iterations as f64;
        let worst = Tensor::from_slice(&[seconds]);
        group.all_reduce(&worst, ReduceOp::Max)?;
        let seconds = worst.double_value(&[0]);
        if group.rank() == 0 {
            println!(
                "{:>10} {:>10.3} {:>12.2} {:>12.2}",
                human(bytes),
                seconds * 1e3,
                bytes as f64 / seconds / 1e9,
                busbw(bytes as f64, seconds, world)
            );
            results.push(serde_json::json!({ "bytes": bytes, "seconds": seconds }));
        }
    }
    if let (0, Some(path)) = (group.rank(), std::env::var_os(accel_core::config::env::BENCH_OUT)) {
        let _ = std::fs::write(path, serde_json::to_string(&results).unwrap_or_default());
    }
    Ok(true)
}

fn human(bytes: u64) -> String {
    if bytes >= 1 << 20 { format!("{}MiB", bytes >> 20) } else { format!("{}KiB", bytes >> 10) }
}

/// torchrun: the project's `.venv`'s, else the one of the `python3` on the path (a GPU
/// machine with torch installed, no venv).
fn torchrun() -> Command {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().map(Path::to_path_buf);
    let venv = root.map(|r| r.join(".venv/bin/torchrun")).filter(|p| p.exists());
    match venv {
        Some(path) => Command::new(path),
        None => {
            let mut command = Command::new("python3");
            command.args(["-m", "torch.distributed.run"]);
            command
        }
    }
}

/// A reference script: under the working directory's `python/reference/` (a checkout
/// copied to another machine), else beside this build's sources.
fn reference_script(name: &str) -> PathBuf {
    let here = PathBuf::from("python/reference").join(name);
    if here.exists() {
        return here;
    }
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../python/reference").join(name)
}

pub(crate) fn allreduce(
    args: &LaunchArgs,
    sizes: &str,
    dtype: &str,
    backend: &str,
    compare: bool,
) -> ExitCode {
    let mut args = args.clone();
    args.num_processes = args.num_processes.or(Some(2));
    args.rank0_only = true;
    let out = std::env::temp_dir().join(format!("accel-bench-{}.json", std::process::id()));
    let program = vec![
        this_binary(),
        "worker".into(),
        "allreduce".into(),
        "--sizes".into(),
        sizes.into(),
        "--dtype".into(),
        dtype.into(),
        "--backend".into(),
        backend.into(),
    ];
    let plan = match args.plan(program) {
        Ok(mut plan) => {
            plan.env.push((accel_core::config::env::BENCH_OUT.into(), out.display().to_string()));
            plan
        }
        Err(e) => {
            eprintln!("accel bench: {e}");
            return ExitCode::FAILURE;
        }
    };
    match accel_core::launch::run(&plan) {
        Ok(0) => {}
        Ok(code) => return ExitCode::from(code.clamp(1, 255) as u8),
        Err(e) => {
            eprintln!("accel bench: {e}");
            return ExitCode::FAILURE;
        }
    }
    if !compare {
        return ExitCode::SUCCESS;
    }
    if dtype != "f32" {
        eprintln!("accel bench: --compare measures f32 only");
        return ExitCode::FAILURE;
    }
    let theirs_name = if backend == "nccl" { "nccl" } else { "gloo" };
    let ours: Vec<serde_json::Value> =
        std::fs::read(&out).ok().and_then(|b| serde_json::from_slice(&b).ok()).unwrap_or_default();
    let bytes: Vec<String> =
        ours.iter().filter_map(|r| r["bytes"].as_u64()).map(|b| b.to_string()).collect();
    let output = torchrun()
        .arg(format!("--nproc-per-node={}", plan.num_processes))
        .arg(format!("--master-port={}", accel_core::comm::free_port("127.0.0.1").unwrap_or(29600)))
        .arg(reference_script("allreduce_torch.py"))
        .args(["--backend", theirs_name])
        .args(&bytes)
        .output();
    let output = match output {
        Ok(o) if o.status.success() => o,
        Ok(o) => {
            eprintln!(
                "accel bench: torch's {theirs_name} run failed:\n{}",
                String::from_utf8_lossy(&o.stderr)
            );
            return ExitCode::FAILURE;
        }
        Err(e) => {
            eprintln!(
                "accel bench: cannot run torchrun (.venv's, or python3 -m torch.distributed.run): {e}"
            );
            return ExitCode::FAILURE;
        }
    };
    let theirs: Vec<serde_json::Value> = String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let world = plan.num_processes as f64;
    println!(
        "\n{:>10} {:>16} {:>16} {:>8}",
        "size",
        "accel busbw GB/s",
        format!("{theirs_name} busbw GB/s"),
        "ratio"
    );
    for (a, g) in ours.iter().zip(&theirs) {
        let bytes = a["bytes"].as_f64().unwrap_or(0.0);
        let (ta, tg) =
            (a["seconds"].as_f64().unwrap_or(f64::NAN), g["seconds"].as_f64().unwrap_or(f64::NAN));
        let (ba, bg) = (busbw(bytes, ta, world), busbw(bytes, tg, world));
        println!("{:>10} {:>16.2} {:>16.2} {:>7.2}x", human(bytes as u64), ba, bg, ba / bg);
    }
    let _ = std::fs::remove_file(out);
    ExitCode::SUCCESS
}
