//! glibc's malloc, set up for training steps on CPU.
//!
//! libtorch's CPU tensors come from `malloc`. By default glibc hands a step's freed
//! activations and gradients back to the kernel (it trims the heap's top above twice its
//! dynamic mmap threshold, at most 64 MiB), so the next step faults the same pages in again,
//! zeroed one by one: up to 1200 page faults per step of a 1-process MLP on the development
//! machine, 12% of its time (`perf`), though how many depends on the order of allocations.
//! [`keep_step_memory`] fixes both thresholds instead, which also ends glibc's dynamic
//! adjustment: blocks below 32 MiB come from the heap (32 MiB is glibc's ceiling for its
//! dynamic threshold, and the largest value glibc before 2.35 accepts), and the main heap
//! keeps up to 1 GiB of freed memory for the next step.
//! The peak is unchanged (the next step reuses what the last one freed); memory freed after
//! the last step stays with the process, as PyTorch's CUDA caching allocator keeps it on a
//! GPU. Blocks of 32 MiB and more are still mapped and returned one by one, and the arenas
//! of other threads (a data loader's, say) still return a whole sub-heap once it is free.
//!
//! The accelerator calls it when it is built for the CPU, before it starts threads of its
//! own. `mallopt` is not synchronised with other threads' `free`: one freeing a mapped
//! block at that very moment can put glibc's dynamic values back (the steps then run as
//! they would with glibc's defaults; nothing worse). A program's own choice wins:
//! `GLIBC_TUNABLES` setting one of the four thresholds below, one of the variables
//! `MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_`, `MALLOC_TOP_PAD_`,
//! `MALLOC_MMAP_MAX_`, or a preloaded allocator (`LD_PRELOAD` naming jemalloc, tcmalloc or
//! mimalloc) leave glibc as it is, and `ACCEL_KEEP_HEAP=0` turns it off. The environment is
//! read once, at the first call. `cargo xtask bench` gives the Python side the same values
//! through `GLIBC_TUNABLES` (xtask's `KEPT_HEAP`: change both together).

use std::sync::OnceLock;

/// Variable that turns [`keep_step_memory`] off (`0`, `false`, `no`) or on (the default).
pub const KEEP_HEAP_ENV: &str = crate::config::env::KEEP_HEAP;

/// Blocks of at least this many bytes are mapped on their own.
pub const MMAP_THRESHOLD: usize = 32 << 20;

/// Freed memory at the main heap's top kept for reuse before any goes back to the kernel.
pub const TRIM_THRESHOLD: usize = 1 << 30;

/// glibc's own variables for the same thresholds; any of them set leaves glibc as it is.
const MALLOC_VARS: [&str; 4] =
    ["MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_"];

/// What [`keep_step_memory`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeapSetup {
    /// glibc's thresholds are now [`MMAP_THRESHOLD`] and [`TRIM_THRESHOLD`].
    Kept,
    /// The environment already chooses the allocator or its settings (the variable named).
    LeftToEnvironment(String),
    /// `ACCEL_KEEP_HEAP=0`.
    Off,
    /// Not a 64-bit glibc: nothing to set.
    NotGlibc,
    /// glibc refused a value (the message says which); its defaults stay.
    Refused(String),
}

/// Sets glibc's malloc to keep a step's freed memory for the next step (see the module's
/// documentation), once per process; later calls return the first one's outcome. An
/// `ACCEL_KEEP_HEAP` that is not a yes or a no is an error.
pub fn keep_step_memory() -> crate::Result<HeapSetup> {
    static DONE: OnceLock<Result<HeapSetup, String>> = OnceLock::new();
    DONE.get_or_init(|| {
        let env = |name: &str| std::env::var(name).ok();
        let setup = decide(env)?;
        if setup != HeapSetup::Kept {
            return Ok(setup);
        }
        Ok(set_thresholds().map_or_else(HeapSetup::Refused, |()| HeapSetup::Kept))
    })
    .clone()
    .map_err(crate::Error::Config)
}

/// What to do, from the environment (`env(name)` is the variable's value).
fn decide(env: impl Fn(&str) -> Option<String>) -> Result<HeapSetup, String> {
    if let Some(value) = env(KEEP_HEAP_ENV) {
        match crate::config::parse_bool(&value) {
            Some(true) => {}
            Some(false) => return Ok(HeapSetup::Off),
            None => {
                return Err(format!(
                    "{KEEP_HEAP_ENV}={value}: expected 0 (glibc's defaults) or 1 (keep freed \
                     memory for the next step, the default)"
                ));
            }
        }
    }
    if !cfg!(all(target_os = "linux", target_env = "gnu", target_pointer_width = "64")) {
        return Ok(HeapSetup::NotGlibc);
    }
    let tunables = env("GLIBC_TUNABLES").unwrap_or_default();
    let ours = ["mmap_threshold", "trim_threshold", "top_pad", "mmap_max"];
    if ours.iter().any(|t| tunables.contains(&format!("glibc.malloc.{t}="))) {
        return Ok(HeapSetup::LeftToEnvironment("GLIBC_TUNABLES".into()));
    }
    if let Some(var) = MALLOC_VARS.into_iter().find(|v| env(v).is_some()) {
        return Ok(HeapSetup::LeftToEnvironment(var.into()));
    }
    let preloaded = env("LD_PRELOAD").unwrap_or_default();
    if ["jemalloc", "tcmalloc", "mimalloc"].iter().any(|a| preloaded.contains(a)) {
        return Ok(HeapSetup::LeftToEnvironment("LD_PRELOAD".into()));
    }
    Ok(HeapSetup::Kept)
}

/// Hands the heap's free memory back to the kernel now (glibc's `malloc_trim`): what a
/// program that frees a large block it will not need again soon calls, such as big-model
/// inference after an offloaded module has run, where [`keep_step_memory`]'s kept heap would
/// otherwise hold every module it has read. Nothing outside glibc.
pub fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free pages of malloc's heaps to the kernel; it is
    // thread-safe (it takes each arena's lock).
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(all(target_os = "linux", target_env = "gnu", target_pointer_width = "64"))]
fn set_thresholds() -> Result<(), String> {
    for (name, param, value) in [
        ("M_MMAP_THRESHOLD", libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD),
        ("M_TRIM_THRESHOLD", libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD),
    ] {
        let value = libc::c_int::try_from(value).expect("thresholds fit an int");
        // SAFETY: mallopt changes malloc's tunables only, and takes any value (it returns 0
        // for one it refuses). Its race with other threads' free is described above.
        if unsafe { libc::mallopt(param, value) } != 1 {
            return Err(format!(
                "glibc refused mallopt({name}, {value}): steps run with glibc's defaults \
                 (set {KEEP_HEAP_ENV}=0 to skip this)"
            ));
        }
    }
    Ok(())
}

#[cfg(not(all(target_os = "linux", target_env = "gnu", target_pointer_width = "64")))]
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
        let left = |var: &str| Ok(HeapSetup::LeftToEnvironment(var.into()));
        assert_eq!(with(&[]), Ok(HeapSetup::Kept));
        assert_eq!(with(&[(KEEP_HEAP_ENV, "1")]), Ok(HeapSetup::Kept));
        assert_eq!(with(&[(KEEP_HEAP_ENV, "0")]), Ok(HeapSetup::Off));
        assert_eq!(with(&[(KEEP_HEAP_ENV, "false")]), Ok(HeapSetup::Off));
        // Other malloc tunables (arenas, huge pages) do not decide the thresholds.
        assert_eq!(with(&[("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")]), Ok(HeapSetup::Kept));
        assert_eq!(
            with(&[("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1:glibc.malloc.trim_threshold=0")]),
            left("GLIBC_TUNABLES")
        );
        assert_eq!(with(&[("MALLOC_TOP_PAD_", "0")]), left("MALLOC_TOP_PAD_"));
        assert_eq!(with(&[("LD_PRELOAD", "/usr/lib/libjemalloc.so.2")]), left("LD_PRELOAD"));
        // Off wins over everything; a value that is neither is named.
        assert_eq!(with(&[(KEEP_HEAP_ENV, "0"), ("MALLOC_TOP_PAD_", "0")]), Ok(HeapSetup::Off));
        let err = with(&[(KEEP_HEAP_ENV, "sometimes")]).unwrap_err();
        assert!(err.contains("ACCEL_KEEP_HEAP=sometimes") && err.contains("0"), "{err}");
    }

    /// Sets them for the whole test binary, which no test here minds (none measures memory).
    #[test]
    fn glibc_takes_the_thresholds() {
        set_thresholds().unwrap();
    }

    /// Page faults counted the Linux way, against glibc's malloc.
    #[cfg(all(target_os = "linux", target_env = "gnu", target_pointer_width = "64"))]
    mod page_reuse {
        use super::*;

        const CHILD_ENV: &str = crate::config::env::HEAP_TEST_CHILD;
        const BLOCK: usize = 8 << 20;

        /// Minor page faults of the calling thread so far.
        fn thread_faults() -> i64 {
            let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
            // SAFETY: getrusage fills the struct it is given.
            assert_eq!(unsafe { libc::getrusage(libc::RUSAGE_THREAD, usage.as_mut_ptr()) }, 0);
            // SAFETY: filled above.
            unsafe { usage.assume_init() }.ru_minflt
        }

        /// A step in small: an 8 MiB block written, freed, then allocated and written again.
        /// Prints the page faults of the second writing (run by the test below, in a process of
        /// its own: glibc's state must be fresh).
        #[test]
        fn page_reuse_child() {
            if std::env::var_os(CHILD_ENV).is_none() {
                return;
            }
            let setup = keep_step_memory().unwrap();
            let write = || {
                let mut block = vec![0u8; BLOCK];
                for page in block.chunks_mut(4096) {
                    page[0] = 1;
                }
                std::hint::black_box(block);
            };
            write();
            let before = thread_faults();
            write();
            println!("setup={setup:?} faults={}", thread_faults() - before);
        }

        /// With the thresholds kept, a freed block's pages serve the next allocation; with
        /// glibc's defaults (`ACCEL_KEEP_HEAP=0`) they go back to the kernel and fault in again.
        #[test]
        fn a_freed_block_is_reused_without_faulting_its_pages_in_again() {
            let pages = (BLOCK / 4096) as f64;
            let faults = |keep: &str| -> f64 {
                let mut command = std::process::Command::new(std::env::current_exe().unwrap());
                command
                    .args(["--exact", "heap::tests::page_reuse::page_reuse_child", "--nocapture"])
                    .args(["--test-threads", "1"])
                    .env(CHILD_ENV, "1")
                    .env(KEEP_HEAP_ENV, keep);
                for var in MALLOC_VARS.into_iter().chain(["GLIBC_TUNABLES", "LD_PRELOAD"]) {
                    command.env_remove(var);
                }
                let output = command.output().unwrap();
                let text = String::from_utf8_lossy(&output.stdout).into_owned();
                assert!(
                    output.status.success(),
                    "{text}{}",
                    String::from_utf8_lossy(&output.stderr)
                );
                let expected = if keep == "1" { "setup=Kept " } else { "setup=Off " };
                assert!(text.contains(expected), "{text}");
                text.split_whitespace()
                    .find_map(|w| w.strip_prefix("faults="))
                    .and_then(|n| n.parse().ok())
                    .unwrap_or_else(|| panic!("no faults= in {text}"))
            };
            let (kept, default) = (faults("1"), faults("0"));
            assert!(kept < pages / 8.0, "kept: {kept} of {pages} pages faulted in again");
            assert!(default > pages / 2.0, "glibc's defaults: only {default} of {pages} pages");
        }
    }
}
