//! `cargo xtask bench memory`: peak memory per process of ddp and zero1/2/3 on a 52M-parameter
//! model, beside PyTorch and the ZeRO paper's formulas.

use std::process::Command;

use super::memory_figures;
use crate::{cargo, root};

/// Peak memory per process of each strategy on a 52M-parameter model, accel beside
/// PyTorch (DDP, ZeroRedundancyOptimizer, FSDP2) and the ZeRO paper's formulas.
pub(crate) fn memory_bench() -> Result<(), String> {
    cargo(
        &["build", "--release", "-p", "accel-core", "--bin", "accel", "-p", "accel-examples"],
        &["--example".into(), "memory_bench".into(), "--example".into(), "llama".into()],
    )?;
    let root = root();
    let accel = root.join("target/release/accel");
    let example = root.join("target/release/examples/memory_bench");
    let torchrun = root.join(".venv/bin/torchrun");
    let script = root.join("python/reference/torch_memory.py");
    eprintln!("xtask: measuring memory, 4 strategies x 2 and 4 processes, accel and PyTorch ...");
    const MIB: f64 = 1024.0 * 1024.0;
    // The largest unit: one 2560x2560 Linear with its bias.
    let unit = 2560.0 * 2560.0 + 2560.0;
    println!(
        "\nPeak resident memory per process above the process's own baseline, during training \
         steps 2-4 (max over ranks);\n8 Linear 2560x2560 units (52.4M parameters), AdamW \
         (fused) fp32, batch 8, CPU, 1 thread per process. PyTorch: DDP, DDP + \
         ZeroRedundancyOptimizer,\nFSDP2 fully_shard with reshard_after_forward False / True. \
         Formula = ZeRO paper's model state (16Ψ, 8Ψ+8Ψ/N, 4Ψ+12Ψ/N, 16Ψ/N)\n+ the working \
         set, in copies of the largest unit (4 bytes x 6.6M): zero2 4 (the gradients being \
         computed, their reduce-scatter buffer, two more in flight), zero3 6 (also its \
         gathered parameters and the next unit's, prefetched)"
    );
    println!(
        "{:<8} {:>3} {:>10} {:>10} {:>8} {:>12} {:>9} {:>9} {:>9}",
        "strategy",
        "N",
        "accel MiB",
        "torch MiB",
        "vs torch",
        "formula MiB",
        "vs form.",
        "accel s",
        "torch s"
    );
    for n in [2usize, 4] {
        for strategy in ["ddp", "zero1", "zero2", "zero3"] {
            let mut ours = Command::new(&accel);
            ours.args(["launch", "--num-processes", &n.to_string(), "--main-process-port", "0"])
                .args(["--cpu", "--strategy", strategy])
                .arg(&example)
                .env("MALLOC_MMAP_THRESHOLD_", "65536");
            let mut theirs = Command::new(&torchrun);
            theirs
                .args([format!("--nproc-per-node={n}"), "--master-port=29791".into()])
                .arg(&script)
                .arg(strategy)
                .env("MALLOC_MMAP_THRESHOLD_", "65536");
            let (peak, step, psi) = memory_figures(&mut ours, n)?;
            let (torch_peak, torch_step, _) = memory_figures(&mut theirs, n)?;
            let n_f = n as f64;
            let formula = match strategy {
                "ddp" => 16.0 * psi,
                "zero1" => 8.0 * psi + 8.0 * psi / n_f,
                "zero2" => 4.0 * psi + 12.0 * psi / n_f + 4.0 * 4.0 * unit,
                _ => 16.0 * psi / n_f + 6.0 * 4.0 * unit,
            };
            println!(
                "{strategy:<8} {n:>3} {:>10.0} {:>10.0} {:>7.2}x {:>12.0} {:>8.2}x {:>9.3} {:>9.3}",
                peak / MIB,
                torch_peak / MIB,
                peak / torch_peak,
                formula / MIB,
                peak / formula,
                step,
                torch_step
            );
        }
    }
    Ok(())
}
