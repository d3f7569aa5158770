//! glibc's malloc, set up for training steps on CPU.
//!
//! libtorch's CPU tensors come from `malloc`. By default glibc hands a step's freed
//! activations and gradients back to the kernel (it trims the heap's top above twice its
//! dynamic mmap threshold, at most 64 MiB), so the next step faults the same pages in again,
//! zeroed one by one: 12% of a 1-process MLP step on the development machine (`perf`), and
//! about 1000 page faults per step. [`keep_step_memory`] fixes both thresholds instead:
//! blocks up to 32 MiB (glibc's own ceiling for the dynamic threshold) come from the heap,
//! and the heap keeps up to 1 GiB of freed memory for the next step. The peak is unchanged
//! (the next step reuses what the last one freed); memory freed after the last step stays
//! with the process, as PyTorch's CUDA caching allocator keeps it on a GPU.
//!
//! The accelerator calls it when it is built for the CPU. A program's own choice wins:
//! `GLIBC_TUNABLES` with a `glibc.malloc.` setting, a `MALLOC_*_` variable or a preloaded
//! allocator (`LD_PRELOAD` naming jemalloc, tcmalloc or mimalloc) leave glibc as it is, and
//! `ACCEL_KEEP_HEAP=0` turns it off.

use std::sync::OnceLock;

/// Variable that turns [`keep_step_memory`] off (`0`) or on (`1`, the default).
pub const KEEP_HEAP_ENV: &str = "ACCEL_KEEP_HEAP";

/// Blocks of at least this many bytes are mapped on their own, as glibc's default does for
/// the largest ones (its dynamic threshold stops at 32 MiB on 64-bit machines).
pub const MMAP_THRESHOLD: usize = 32 << 20;

/// Freed memory at the heap's top kept for reuse before any goes back to the kernel.
pub const TRIM_THRESHOLD: usize = 1 << 30;

/// What [`keep_step_memory`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeapSetup {
    /// glibc's thresholds are now [`MMAP_THRESHOLD`] and [`TRIM_THRESHOLD`].
    Kept,
    /// The environment already chooses the allocator or its settings (the variable named).
    LeftToEnvironment(String),
    /// `ACCEL_KEEP_HEAP=0`.
    Off,
    /// Not glibc: nothing to set.
    NotGlibc,
}

/// Sets glibc's malloc to keep a step's freed memory for the next step (see the module's
/// documentation), once per process; later calls return the first one's outcome. An
/// `ACCEL_KEEP_HEAP` other than `0` or `1` is an error.
pub fn keep_step_memory() -> crate::Result<HeapSetup> {
    static DONE: OnceLock<Result<HeapSetup, String>> = OnceLock::new();
    DONE.get_or_init(|| {
        let env = |name: &str| std::env::var(name).ok();
        let setup = decide(env)?;
        if setup == HeapSetup::Kept {
            set_thresholds()?;
        }
        Ok(setup)
    })
    .clone()
    .map_err(crate::Error::Config)
}

/// What to do, from the environment (`env(name)` is the variable's value).
fn decide(env: impl Fn(&str) -> Option<String>) -> Result<HeapSetup, String> {
    match env(KEEP_HEAP_ENV).as_deref() {
        Some("0") => return Ok(HeapSetup::Off),
        None | Some("1") => {}
        Some(other) => {
            return Err(format!("{KEEP_HEAP_ENV}={other}: expected 0 (glibc's defaults) or 1"));
        }
    }
    if !cfg!(all(target_os = "linux", target_env = "gnu")) {
        return Ok(HeapSetup::NotGlibc);
    }
    if env("GLIBC_TUNABLES").is_some_and(|t| t.contains("glibc.malloc.")) {
        return Ok(HeapSetup::LeftToEnvironment("GLIBC_TUNABLES".into()));
    }
    let glibc_vars =
        ["MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_"];
    if let Some(var) = glibc_vars.into_iter().find(|v| env(v).is_some()) {
        return Ok(HeapSetup::LeftToEnvironment(var.into()));
    }
    let preloaded = env("LD_PRELOAD").unwrap_or_default();
    if ["jemalloc", "tcmalloc", "mimalloc"].iter().any(|a| preloaded.contains(a)) {
        return Ok(HeapSetup::LeftToEnvironment("LD_PRELOAD".into()));
    }
    Ok(HeapSetup::Kept)
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn set_thresholds() -> Result<(), String> {
    for (name, param, value) in [
        ("M_MMAP_THRESHOLD", libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD),
        ("M_TRIM_THRESHOLD", libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD),
    ] {
        let value = libc::c_int::try_from(value).expect("thresholds fit an int");
        // SAFETY: mallopt only changes malloc's tunables; any value is safe to pass.
        if unsafe { libc::mallopt(param, value) } != 1 {
            return Err(format!(
                "glibc refused mallopt({name}, {value}); set {KEEP_HEAP_ENV}=0 to leave \
                 malloc as it is"
            ));
        }
    }
    Ok(())
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn set_thresholds() -> Result<(), String> {
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(vars: &[(&str, &str)]) -> Result<HeapSetup, String> {
        decide(|name| vars.iter().find(|(k, _)| *k == name).map(|(_, v)| v.to_string()))
    }

    #[test]
    fn the_environments_own_allocator_settings_win_and_a_bad_value_is_refused() {
        assert_eq!(with(&[]), Ok(HeapSetup::Kept));
        assert_eq!(with(&[(KEEP_HEAP_ENV, "1")]), Ok(HeapSetup::Kept));
        assert_eq!(with(&[(KEEP_HEAP_ENV, "0")]), Ok(HeapSetup::Off));
        assert_eq!(with(&[("GLIBC_TUNABLES", "glibc.rtld.nns=2")]), Ok(HeapSetup::Kept));
        assert_eq!(
            with(&[("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=0")]),
            Ok(HeapSetup::LeftToEnvironment("GLIBC_TUNABLES".into()))
        );
        assert_eq!(
            with(&[("MALLOC_TOP_PAD_", "0")]),
            Ok(HeapSetup::LeftToEnvironment("MALLOC_TOP_PAD_".into()))
        );
        assert_eq!(
            with(&[("LD_PRELOAD", "/usr/lib/libjemalloc.so.2")]),
            Ok(HeapSetup::LeftToEnvironment("LD_PRELOAD".into()))
        );
        // Off wins over everything; a value that is neither is named.
        assert_eq!(with(&[(KEEP_HEAP_ENV, "0"), ("MALLOC_TOP_PAD_", "0")]), Ok(HeapSetup::Off));
        let err = with(&[(KEEP_HEAP_ENV, "yes")]).unwrap_err();
        assert!(err.contains("ACCEL_KEEP_HEAP=yes") && err.contains("0"), "{err}");
    }

    #[test]
    fn glibc_takes_the_thresholds() {
        set_thresholds().unwrap();
    }
}
