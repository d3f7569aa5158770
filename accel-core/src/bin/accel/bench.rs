//! `accel bench allreduce`: like nccl-tests' all_reduce_perf, on accel's process group;
//! optionally torch's gloo on the same sizes in the same run, with ratios.

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
pub(crate) fn worker(sizes: &str, dtype: &str) -> accel_core::Result<bool> {
    let kind = parse_kind(dtype)?;
    let sizes: Vec<u64> = sizes.split(',').map(parse_size).collect::<accel_core::Result<_>>()?;
    let topology = Topology::from_env()?;
    let group = ProcessGroup::new(&topology, GroupOptions::from_env()?)?;
    let world = group.size() as f64;
    let mut results = Vec::new();
    if group.rank() == 0 {
        println!(
            "{:>10} {:>10} {:>12} {:>12}   ({} processes, {dtype}; transport: {})",
            "size",
            "time ms",
            "algbw GB/s",
            "busbw GB/s",
            group.size(),
            group.transport()
        );
    }
    for bytes in sizes {
        let n = (bytes as usize / kind.elt_size_in_bytes()).max(1) as i64;
        let t = Tensor::ones([n], (kind, Device::Cpu));
        for _ in 0..3 {
            group.all_reduce(&t, ReduceOp::Sum)?;
        }
        group.barrier()?;
        let iterations = (4e8 / bytes as f64).clamp(5.0, 200.0) as usize;
        let start = Instant::now();
        for _ in 0..iterations {
            group.all_reduce(&t, ReduceOp::Sum)?;
        }
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
    if let (0, Some(path)) = (group.rank(), std::env::var_os("ACCEL_BENCH_OUT")) {
        let _ = std::fs::write(path, serde_json::to_string(&results).unwrap_or_default());
    }
    Ok(true)
}

fn human(bytes: u64) -> String {
    if bytes >= 1 << 20 { format!("{}MiB", bytes >> 20) } else { format!("{}KiB", bytes >> 10) }
}

fn venv_tool(name: &str) -> Option<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent()?;
    let path = root.join(".venv/bin").join(name);
    path.exists().then_some(path)
}

pub(crate) fn allreduce(
    args: &LaunchArgs,
    sizes: &str,
    dtype: &str,
    compare_gloo: bool,
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
    ];
    let plan = match args.plan(program) {
        Ok(mut plan) => {
            plan.env.push(("ACCEL_BENCH_OUT".into(), out.display().to_string()));
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
    if !compare_gloo {
        return ExitCode::SUCCESS;
    }
    if dtype != "f32" {
        eprintln!("accel bench: --compare-gloo measures f32 only");
        return ExitCode::FAILURE;
    }
    let ours: Vec<serde_json::Value> =
        std::fs::read(&out).ok().and_then(|b| serde_json::from_slice(&b).ok()).unwrap_or_default();
    let Some(torchrun) = venv_tool("torchrun") else {
        eprintln!("accel bench: --compare-gloo needs .venv/bin/torchrun (run `cargo xtask setup`)");
        return ExitCode::FAILURE;
    };
    let script =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../python/reference/allreduce_gloo.py");
    let bytes: Vec<String> =
        ours.iter().filter_map(|r| r["bytes"].as_u64()).map(|b| b.to_string()).collect();
    let output = Command::new(torchrun)
        .arg(format!("--nproc-per-node={}", plan.num_processes))
        .arg(format!("--master-port={}", accel_core::comm::free_port("127.0.0.1").unwrap_or(29600)))
        .arg(script)
        .args(&bytes)
        .output();
    let output = match output {
        Ok(o) if o.status.success() => o,
        Ok(o) => {
            eprintln!("accel bench: gloo run failed:\n{}", String::from_utf8_lossy(&o.stderr));
            return ExitCode::FAILURE;
        }
        Err(e) => {
            eprintln!("accel bench: cannot run torchrun: {e}");
            return ExitCode::FAILURE;
        }
    };
    let gloo: Vec<serde_json::Value> = String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let world = plan.num_processes as f64;
    println!(
        "\n{:>10} {:>16} {:>16} {:>8}",
        "size", "accel busbw GB/s", "gloo busbw GB/s", "ratio"
    );
    for (a, g) in ours.iter().zip(&gloo) {
        let bytes = a["bytes"].as_f64().unwrap_or(0.0);
        let (ta, tg) =
            (a["seconds"].as_f64().unwrap_or(f64::NAN), g["seconds"].as_f64().unwrap_or(f64::NAN));
        let (ba, bg) = (busbw(bytes, ta, world), busbw(bytes, tg, world));
        println!("{:>10} {:>16.2} {:>16.2} {:>7.2}x", human(bytes as u64), ba, bg, ba / bg);
    }
    let _ = std::fs::remove_file(out);
    ExitCode::SUCCESS
}
