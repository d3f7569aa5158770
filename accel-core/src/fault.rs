//! Fault injection for the restart tests. `ACCEL_TEST_FAULT=POINT:RANK:N` makes process
//! RANK kill itself (SIGKILL: no unwinding, no cleanup, as a crash or the OOM killer) the Nth
//! time it passes POINT, in the first attempt of a launch only (`ACCEL_RESTART_COUNT` unset
//! or 0), so that the restarted group can finish. Unset, a point costs an environment
//! lookup.
//!
//! Points: `save-own-files-written` (a checkpoint's shard and RNG files of this rank are
//! written, the checkpoint is not yet published), `save-before-publish` (every file and the
//! manifest are written by the main process, the folder not yet renamed into place).

use std::collections::HashMap;
use std::sync::Mutex;

const VARIABLE: &str = "ACCEL_TEST_FAULT";

static PASSED: Mutex<Option<HashMap<&'static str, u64>>> = Mutex::new(None);

/// Dies here if `ACCEL_TEST_FAULT` names this point, this rank and this pass.
pub(crate) fn point(name: &'static str, rank: usize) {
    let Ok(spec) = std::env::var(VARIABLE) else { return };
    let first_attempt = std::env::var("ACCEL_RESTART_COUNT").map_or(true, |n| n.trim() == "0");
    let mut parts = spec.split(':');
    let (Some(point), Some(who), Some(nth)) = (parts.next(), parts.next(), parts.next()) else {
        return;
    };
    if point != name || who.parse() != Ok(rank) || !first_attempt {
        return;
    }
    let mut passed = PASSED.lock().unwrap_or_else(|e| e.into_inner());
    let count = passed.get_or_insert_with(HashMap::new).entry(name).or_insert(0);
    *count += 1;
    if nth.parse() == Ok(*count) {
        eprintln!("accel: {VARIABLE}: rank {rank} kills itself at {name} (pass {count})");
        // SAFETY: raise(2) on this process.
        unsafe {
            libc::raise(libc::SIGKILL);
        }
    }
}
