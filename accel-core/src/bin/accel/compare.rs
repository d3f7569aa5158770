//! `accel compare-weights A B`: two weight files side by side (a GPU run against the CPU
//! run on the same weights and data, say).

use std::collections::BTreeMap;
use std::path::Path;

use tch::{Kind, Tensor};

fn read(path: &Path) -> accel_core::Result<BTreeMap<String, Tensor>> {
    let tensors = Tensor::read_safetensors(path).map_err(|e| accel_core::Error::Io {
        path: path.to_path_buf(),
        source: std::io::Error::other(e.to_string()),
    })?;
    Ok(tensors.into_iter().collect())
}

/// Prints every tensor's largest absolute difference; `Ok(false)` when one is over
/// `tolerance` or the files hold different tensors.
pub(crate) fn weights(a: &Path, b: &Path, tolerance: f64) -> accel_core::Result<bool> {
    let (a_tensors, b_tensors) = (read(a)?, read(b)?);
    let mut ok = true;
    for name in a_tensors.keys().chain(b_tensors.keys()).collect::<std::collections::BTreeSet<_>>()
    {
        let (Some(x), Some(y)) = (a_tensors.get(name), b_tensors.get(name)) else {
            let (here, there) = if a_tensors.contains_key(name) { (a, b) } else { (b, a) };
            println!("{name}: only in {} (not in {})", here.display(), there.display());
            ok = false;
            continue;
        };
        if x.size() != y.size() || x.kind() != y.kind() {
            println!("{name}: {:?} {:?} against {:?} {:?}", x.size(), x.kind(), y.size(), y.kind());
            ok = false;
            continue;
        }
        let difference =
            (x.to_kind(Kind::Double) - y.to_kind(Kind::Double)).abs().max().double_value(&[]);
        let verdict = if difference <= tolerance { "ok" } else { "OVER" };
        println!("{name}: max |difference| {difference:.3e} {verdict}");
        ok &= difference <= tolerance;
    }
    println!(
        "{}: {} tensors, tolerance {tolerance:e}",
        if ok { "same" } else { "DIFFERENT" },
        a_tensors.len().max(b_tensors.len())
    );
    Ok(ok)
}
