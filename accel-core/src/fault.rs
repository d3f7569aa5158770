//! Fault injection for the restart tests. `ACCEL_TEST_FAULT=POINT:RANK:N` makes process
//! RANK kill itself (SIGKILL: no unwinding, no cleanup, as a crash or the OOM killer) the Nth
//! time it passes POINT, in the first attempt of a launch only (`ACCEL_RESTART_COUNT` unset
//! or 0), so that the restarted group can finish. Unset, a point costs an environment
//! lookup.
//!
//! `ACCEL_TEST_FAULT=deny-memory-reads` makes every process of the run unreadable by the
//! others, as on a host with Yama's `ptrace_scope` ≥ 2 or a container without
//! CAP_SYS_PTRACE: it drops CAP_SYS_PTRACE and marks itself not dumpable, so the kernel
//! refuses `process_vm_readv` between the ranks and they must fall back to TCP.
//!
//! Points: `save-own-files-written` (a checkpoint's shard and RNG files of this rank are
//! written, the checkpoint is not yet published), `save-before-publish` (every file and the
//! manifest are written by the main process, the folder not yet renamed into place).

use crate::sync::Locked;
use std::collections::HashMap;
use std::sync::Mutex;

const VARIABLE: &str = crate::config::env::TEST_FAULT;

static PASSED: Mutex<Option<HashMap<&'static str, u64>>> = Mutex::new(None);

/// Dies here if `ACCEL_TEST_FAULT` names this point, this rank and this pass.
pub(crate) fn point(name: &'static str, rank: usize) {
    let Ok(spec) = std::env::var(VARIABLE) else { return };
    let first_attempt =
        std::env::var(crate::config::env::RESTART_COUNT).map_or(true, |n| n.trim() == "0");
    let mut parts = spec.split(':');
    let (Some(point), Some(who), Some(nth)) = (parts.next(), parts.next(), parts.next()) else {
        return;
    };
    if point != name || who.parse() != Ok(rank) || !first_attempt {
        return;
    }
    let mut passed = PASSED.locked();
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

/// Under `ACCEL_TEST_FAULT=deny-memory-reads`, forbids the other processes to read this
/// one's memory (see the module's documentation) and returns true.
pub(crate) fn deny_memory_reads() -> bool {
    if std::env::var(VARIABLE).as_deref() != Ok("deny-memory-reads") {
        return false;
    }
    const CAP_SYS_PTRACE: u32 = 19;
    #[repr(C)]
    struct Header {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Default, Clone, Copy)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    let mut header = Header { version: 0x2008_0522, pid: 0 }; // _LINUX_CAPABILITY_VERSION_3
    let mut data = [Data::default(); 2];
    // SAFETY: capget/capset with a v3 header and the two data words it reads and writes;
    // prctl(PR_SET_DUMPABLE) touches no memory. Failures leave the process as it was.
    unsafe {
        if libc::syscall(libc::SYS_capget, &mut header, data.as_mut_ptr()) == 0 {
            data[0].effective &= !(1 << CAP_SYS_PTRACE);
            data[0].permitted &= !(1 << CAP_SYS_PTRACE);
            libc::syscall(libc::SYS_capset, &mut header, data.as_ptr());
        }
        libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0);
    }
    true
}
