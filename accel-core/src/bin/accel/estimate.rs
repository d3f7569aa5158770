//! `accel estimate-memory`: per-process bytes of model state (parameters, gradients,
//! optimizer state) under each strategy, from a safetensors file's header or a count.

use std::io::Read;
use std::path::Path;

use accel_core::Strategy;
use accel_core::strategy::auto::model_state_parts;

/// Parameters in a safetensors file, from its header alone (the tensors are not read).
pub(crate) fn count_parameters(path: &Path) -> accel_core::Result<u64> {
    let io = |source| accel_core::Error::Io { path: path.to_path_buf(), source };
    let mut file = std::fs::File::open(path).map_err(io)?;
    let mut len = [0u8; 8];
    file.read_exact(&mut len).map_err(io)?;
    let len = u64::from_le_bytes(len);
    if len > 100 << 20 {
        return Err(accel_core::Error::Config(format!(
            "{}: a safetensors header of {len} bytes is not plausible",
            path.display()
        )));
    }
    let mut header = vec![0; len as usize];
    file.read_exact(&mut header).map_err(io)?;
    let header: serde_json::Value = serde_json::from_slice(&header).map_err(|e| {
        accel_core::Error::Config(format!("{}: not a safetensors header: {e}", path.display()))
    })?;
    let tensors = header.as_object().ok_or_else(|| {
        accel_core::Error::Config(format!("{}: header is not an object", path.display()))
    })?;
    Ok(tensors
        .iter()
        .filter(|(name, _)| *name != "__metadata__")
        .map(|(_, t)| {
            t["shape"]
                .as_array()
                .map_or(0, |s| s.iter().map(|d| d.as_u64().unwrap_or(0)).product::<u64>())
        })
        .sum())
}

/// Bytes per parameter of optimizer state (fp32): Adam/AdamW keep two moments, SGD with
/// momentum one buffer, plain SGD none.
fn state_bytes(optimizer: &str) -> accel_core::Result<f64> {
    match optimizer {
        "adamw" | "adam" => Ok(8.0),
        "sgd-momentum" => Ok(4.0),
        "sgd" => Ok(0.0),
        other => Err(accel_core::Error::Config(format!(
            "unknown optimizer `{other}`; use adamw, adam, sgd-momentum or sgd"
        ))),
    }
}

fn human(bytes: f64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes;
    let mut unit = 0;
    while value >= 1024.0 && unit < units.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.2} {}", units[unit])
}

/// The table, as text.
pub(crate) fn table(
    params: u64,
    processes: &[usize],
    optimizer: &str,
) -> accel_core::Result<String> {
    let p = params as f64;
    let k = state_bytes(optimizer)?;
    let mut out = format!(
        "model state per process for {params} parameters ({}) with {optimizer}; fp32 master \
         weights and gradients (4 bytes each), optimizer state {k} bytes per parameter.\n\
         Mixed precision (bf16/fp16) in accel casts per operation under autocast and keeps no \
         half-precision copy of the weights, so it changes activations, not these figures.\n\
         Formulas (Ψ = parameters, N = processes; ZeRO, Rajbhandari et al. 2020):\n  \
         ddp    params 4Ψ   + grads 4Ψ   + state {k}Ψ\n  \
         zero1  params 4Ψ   + grads 4Ψ   + state {k}Ψ/N\n  \
         zero2  params 4Ψ   + grads 4Ψ/N + state {k}Ψ/N   (fsdp shard_grad_op)\n  \
         zero3  params 4Ψ/N + grads 4Ψ/N + state {k}Ψ/N   (fsdp full_shard; plus the largest unit, gathered)\n\n",
        human(4.0 * p)
    );
    out.push_str(&format!(
        "{:<8} {:>4} {:>12} {:>12} {:>12} {:>12}\n",
        "strategy", "N", "params", "grads", "optimizer", "total"
    ));
    for &n in processes {
        let n_f = n as f64;
        for strategy in [Strategy::Ddp, Strategy::Zero1, Strategy::Zero2, Strategy::Zero3] {
            let (params_b, grads_b, state_b) = model_state_parts(strategy, p, n_f, k);
            let name = strategy.as_str();
            out.push_str(&format!(
                "{name:<8} {n:>4} {:>12} {:>12} {:>12} {:>12}\n",
                human(params_b),
                human(grads_b),
                human(state_b),
                human(params_b + grads_b + state_b)
            ));
        }
    }
    out.push_str(
        "\nMeasured against these formulas by `cargo xtask bench memory` (CPU): see \
         docs/performance.md. zero3 holds a unit's whole parameters (and gradients, until \
         reduce-scattered) while it computes, on top of the row.\n",
    );
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_formulas_of_the_zero_paper() {
        let text = table(1_000_000, &[4], "adamw").unwrap();
        // 16Ψ, 8Ψ + 8Ψ/4 = 10Ψ, 4Ψ + 12Ψ/4 = 7Ψ, 16Ψ/4 = 4Ψ bytes for Ψ = 10⁶.
        for (row, total) in [
            ("ddp", "15.26 MiB"),
            ("zero1", "9.54 MiB"),
            ("zero2", "6.68 MiB"),
            ("zero3", "3.81 MiB"),
        ] {
            let line = text.lines().find(|l| l.starts_with(row) && l.contains("   4 ")).unwrap();
            assert!(line.trim_end().ends_with(total), "{row}: {line}");
        }
        assert!(table(1, &[1], "lion").is_err());
    }
}
