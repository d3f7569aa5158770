//! Every `ACCEL_*` environment variable accel reads or sets, named once: the settings'
//! (one per row of `accel_choices::settings!`, [`super::ENV_VARS`]) and the rest, here. The
//! code uses these constants, never the names spelled out (a repository lint checks it),
//! and docs/reference.md lists them all from [`VARIABLES`] and the settings.

/// Who a variable is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Audience {
    /// Users set it (or `accel launch` does, from its flags).
    User,
    /// `accel launch` sets it for the processes it starts; a program reads it.
    Launcher,
    /// Diagnostics and benchmarks.
    Diagnostics,
    /// The test suite alone.
    Tests,
}

/// A variable that is not a setting.
#[derive(Debug, Clone, Copy)]
pub struct Variable {
    /// Its name.
    pub name: &'static str,
    /// Who sets it.
    pub audience: Audience,
    /// What it does.
    pub doc: &'static str,
}

macro_rules! variables {
    ($($(#[doc = $doc:literal])+ $constant:ident = $name:literal, $audience:ident;)+) => {
        $(
            $(#[doc = $doc])+
            pub const $constant: &str = $name;
        )+

        /// Every variable that is not a setting, in this file's order.
        pub const VARIABLES: &[Variable] = &[$(
            Variable { name: $name, audience: Audience::$audience, doc: concat!($($doc, "\n"),+) },
        )+];
    };
}

variables! {
    /// A YAML (accel's or Accelerate's keys) or DeepSpeed JSON file of settings, read by
    /// every accelerator built while it is set (`accel launch --config-file` reads its file
    /// itself and passes the settings on as their variables).
    CONFIG_FILE = "ACCEL_CONFIG_FILE", User;
    /// The folder of `accel config`'s default file (`default_config.yaml`); else
    /// `$XDG_CONFIG_HOME/accel`, else `~/.config/accel`.
    CONFIG_DIR = "ACCEL_CONFIG_DIR", User;
    /// A DeepSpeed JSON config whose settings beyond the common ones (bucket sizes,
    /// communication dtype, micro-batch size) the program's accelerator applies.
    DEEPSPEED_CONFIG = "ACCEL_DEEPSPEED_CONFIG", Launcher;
    /// Seconds a collective or the rendezvous waits for a peer before failing with a
    /// message naming it (default 1800; `accel launch --timeout`).
    TIMEOUT_SECS = "ACCEL_TIMEOUT_SECS", User;
    /// Seconds an NCCL collective may run before the watchdog aborts the group (default 600;
    /// `accel launch --timeout` sets it too).
    NCCL_TIMEOUT = "ACCEL_NCCL_TIMEOUT", User;
    /// `1`: NCCL communicators in blocking mode (their calls return when done), for
    /// debugging.
    NCCL_NONBLOCKING = "ACCEL_NCCL_NONBLOCKING", Diagnostics;
    /// The run's shared secret for the rendezvous (HMAC-SHA256), as text; `accel launch`
    /// makes one per run.
    TOKEN = "ACCEL_TOKEN", Launcher;
    /// A file holding the run's secret (instead of `ACCEL_TOKEN`), for schedulers that
    /// hand out files.
    TOKEN_FILE = "ACCEL_TOKEN_FILE", User;
    /// Set by `accel launch` in every process it starts, so that a program knows its
    /// topology came from it.
    LAUNCHED = "ACCEL_LAUNCHED", Launcher;
    /// How many times `accel launch --max-restarts` restarted the group (0 first).
    RESTART_COUNT = "ACCEL_RESTART_COUNT", Launcher;
    /// `tty` when the launcher's console draws progress bars (set by `accel launch`).
    PROGRESS = "ACCEL_PROGRESS", Launcher;
    /// `1` (or `true`): no start-up line from the accelerator.
    QUIET = "ACCEL_QUIET", User;
    /// `0`: do not compare each collective across processes before it runs; `shapes`:
    /// compare names only, not shapes.
    CHECK_COLLECTIVES = "ACCEL_CHECK_COLLECTIVES", Diagnostics;
    /// Set: the CPU backend never copies between processes' memory directly
    /// (`process_vm_readv`), only over sockets.
    DISABLE_CMA = "ACCEL_DISABLE_CMA", Diagnostics;
    /// `0`: leave glibc's malloc as it is on the CPU (by default accel keeps freed memory
    /// for the next step).
    KEEP_HEAP = "ACCEL_KEEP_HEAP", User;
    /// Bytes of memory `strategy = "auto"` may plan with, instead of the device's.
    AUTO_MEMORY = "ACCEL_AUTO_MEMORY", User;
    /// `1`: a run of one process still creates its process group (checks the NCCL
    /// communicator on one GPU).
    GROUP_OF_ONE = "ACCEL_GROUP_OF_ONE", Diagnostics;
    /// Where `#[accelerate]` functions save their final state (tests of the attribute).
    FINAL_STATE_DIR = "ACCEL_FINAL_STATE_DIR", Tests;
    /// A fault to inject (`point:rank[:kill]`, the restart tests).
    TEST_FAULT = "ACCEL_TEST_FAULT", Tests;
    /// `accel test`'s processes write their process ids here (the kill tests).
    PID_DIR = "ACCEL_PID_DIR", Tests;
    /// Where `accel bench` writes its results (rank 0).
    BENCH_OUT = "ACCEL_BENCH_OUT", Diagnostics;
    /// The heap test's child process (the heap test itself).
    HEAP_TEST_CHILD = "ACCEL_HEAP_TEST_CHILD", Tests;
    /// Set: tests that compare generated text with a file (expansions, docs/reference.md)
    /// rewrite the file instead.
    BLESS = "ACCEL_BLESS", Tests;
    /// The Python whose torch the user-crate test installs into its venv.
    PYTHON = "ACCEL_PYTHON", Tests;
}

/// How rank 0's progress lines start, for the launcher to draw them as a bar (with
/// [`PROGRESS`] `tty`).
pub const PROGRESS_PREFIX: &str = "progress ";

/// The variable of setting `name`.
pub fn of_setting(name: &str) -> Option<&'static str> {
    super::ENV_VARS.iter().find(|(_, n)| *n == name).map(|(var, _)| *var)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_variable_is_named_once_and_documented() {
        let mut names: Vec<&str> = VARIABLES.iter().map(|v| v.name).collect();
        names.extend(super::super::ENV_VARS.iter().map(|(v, _)| *v));
        let count = names.len();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), count, "a variable named twice");
        assert!(names.iter().all(|n| n.starts_with("ACCEL_")));
        assert!(VARIABLES.iter().all(|v| !v.doc.trim().is_empty()));
        assert_eq!(of_setting("accumulate"), Some("ACCEL_ACCUMULATE"));
    }
}
