//! The NCCL layer on a machine without GPUs: the FFI tables against nccl.h, and loading,
//! error mapping, non-blocking creation, split, the watchdog and the order of abort /
//! finalize / destroy against a stub library (stub_nccl.c, compiled here).

use std::ffi::{CStr, c_char, c_int};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use super::ffi::{self, Config, Nccl, UniqueId};
use super::handle::Handle;
use super::watchdog::{Completion, Tracked, Watchdog, WatchdogOptions};
use crate::comm::{Op, ReduceOp};

/// Builds the stub (once per variant) and returns a fresh copy for one test: each copy is
/// its own library to `dlopen`, with its own state.
fn stub(variant: &str, flags: &[&str]) -> PathBuf {
    static BUILT: OnceLock<Mutex<std::collections::HashMap<String, PathBuf>>> = OnceLock::new();
    static COPIES: AtomicU64 = AtomicU64::new(0);
    let dir = std::env::temp_dir().join(format!("accel-stub-nccl-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let built = {
        let mut built = BUILT.get_or_init(Default::default).lock().unwrap();
        built
            .entry(variant.to_owned())
            .or_insert_with(|| {
                let source = dir.join("stub_nccl.c");
                std::fs::write(&source, include_str!("stub_nccl.c")).unwrap();
                let out = dir.join(format!("libstub-{variant}.so"));
                let compiler = std::env::var("CC").unwrap_or_else(|_| "cc".into());
                let status = std::process::Command::new(&compiler)
                    .args(["-shared", "-fPIC", "-O1", "-o"])
                    .arg(&out)
                    .arg(&source)
                    .args(flags)
                    .status()
                    .unwrap_or_else(|e| panic!("cannot run the C compiler `{compiler}`: {e}"));
                assert!(status.success(), "building the stub NCCL failed");
                out
            })
            .clone()
    };
    let copy = dir.join(format!("libnccl-{}.so", COPIES.fetch_add(1, Ordering::SeqCst)));
    std::fs::copy(&built, &copy).unwrap();
    copy
}

/// The stub's test controls, from the same loaded library as `Nccl::load`'s.
struct Controls {
    lib: libloading::Library,
}

impl Controls {
    fn of(path: &Path) -> Self {
        // SAFETY: the stub has no initialisers; dlopen returns the handle Nccl::load holds.
        Self { lib: unsafe { libloading::Library::new(path) }.unwrap() }
    }
    fn set(&self, key: &str, value: i32) {
        let key = std::ffi::CString::new(key).unwrap();
        // SAFETY: stub_set(const char*, int) of stub_nccl.c.
        unsafe {
            let f = self.lib.get::<unsafe extern "C" fn(*const c_char, c_int)>(b"stub_set\0");
            f.unwrap()(key.as_ptr(), value);
        }
    }
    fn log(&self) -> String {
        // SAFETY: stub_log() of stub_nccl.c returns its static log buffer.
        unsafe {
            let f = self.lib.get::<unsafe extern "C" fn() -> *const c_char>(b"stub_log\0");
            CStr::from_ptr(f.unwrap()()).to_string_lossy().into_owned()
        }
    }
}

/// A non-blocking communicator (polled while it works), as `ACCEL_NCCL_NONBLOCKING=1` makes.
fn init(nccl: &'static Nccl, timeout: Duration) -> crate::Result<Handle> {
    let id = UniqueId { internal: [1; ffi::UNIQUE_ID_BYTES] };
    Handle::init(nccl, id, 1, 0, 5, timeout, false)
}

/// Communicators are blocking unless ACCEL_NCCL_NONBLOCKING=1 (as PyTorch creates them): a call returns when it is
/// done (no NCCL thread per call, no polling), and a split inherits the mode.
#[test]
fn blocking_communicators_and_their_splits_are_made_with_a_blocking_config() {
    let path = stub("full", &[]);
    let nccl = Nccl::load(&path).unwrap();
    let controls = Controls::of(&path);
    let id = UniqueId { internal: [1; ffi::UNIQUE_ID_BYTES] };
    let handle = Handle::init(nccl, id, 1, 0, 5, Duration::from_secs(5), true).unwrap();
    let split = handle.split(1, 0, 1).unwrap().expect("color 1 takes part");
    let log = controls.log();
    assert!(log.contains("version=21700 blocking=1"), "{log}");
    assert!(log.contains("ncclCommSplit color=1 key=0 blocking=1"), "{log}");
    drop(split);
    drop(handle);
}

/// Pulls `name = value` pairs out of nccl.h's enums and defines.
fn header_value(header: &str, name: &str) -> Option<i64> {
    let at = header.find(&format!("{name} "))?;
    let rest = &header[at + name.len()..];
    let rest = rest.trim_start().strip_prefix('=').unwrap_or(rest).trim_start();
    let digits: String =
        rest.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == 'x').collect();
    match digits.strip_prefix("0x") {
        Some(hex) => i64::from_str_radix(hex, 16).ok(),
        None => digits.parse().ok(),
    }
}

#[test]
fn ffi_tables_equal_the_values_of_the_nccl_h_beside_torch() {
    let header_path = crate::cuda::libtorch_lib_dir().join("../../nvidia/nccl/include/nccl.h");
    let header = std::fs::read_to_string(&header_path).unwrap_or_else(|e| {
        panic!("{} (the torch wheel's NCCL header): {e}", header_path.display())
    });
    for (name, ours) in [
        ("ncclSuccess", ffi::SUCCESS),
        ("ncclInProgress", ffi::IN_PROGRESS),
        ("ncclInt8", ffi::data_type::INT8),
        ("ncclUint8", ffi::data_type::UINT8),
        ("ncclInt32", ffi::data_type::INT32),
        ("ncclUint32", ffi::data_type::UINT32),
        ("ncclInt64", ffi::data_type::INT64),
        ("ncclUint64", ffi::data_type::UINT64),
        ("ncclFloat16", ffi::data_type::FLOAT16),
        ("ncclFloat32", ffi::data_type::FLOAT32),
        ("ncclFloat64", ffi::data_type::FLOAT64),
        ("ncclBfloat16", ffi::data_type::BFLOAT16),
        ("ncclFloat8e4m3", ffi::data_type::FLOAT8_E4M3),
        ("ncclFloat8e5m2", ffi::data_type::FLOAT8_E5M2),
        ("ncclSum", ffi::red_op::SUM),
        ("ncclProd", ffi::red_op::PROD),
        ("ncclMax", ffi::red_op::MAX),
        ("ncclMin", ffi::red_op::MIN),
        ("ncclAvg", ffi::red_op::AVG),
    ] {
        assert_eq!(header_value(&header, name), Some(i64::from(ours)), "{name}");
    }
    for code in 0..8 {
        let name = ffi::result_name(code);
        assert_eq!(header_value(&header, name), Some(i64::from(code)), "{name}");
    }
    assert_eq!(header_value(&header, "NCCL_UNIQUE_ID_BYTES"), Some(128));
    assert_eq!(std::mem::size_of::<UniqueId>(), 128);
    // The 2.17 head of ncclConfig_t: size, magic, version, blocking, cgaClusterSize,
    // minCTAs, maxCTAs, netName — in this order in today's header too.
    let config = &header[header.find("typedef struct ncclConfig_v").unwrap()..];
    let fields = [
        "size_t size;",
        "unsigned int magic;",
        "unsigned int version;",
        "int blocking;",
        "int cgaClusterSize;",
        "int minCTAs;",
        "int maxCTAs;",
        "const char *netName;",
    ];
    let positions: Vec<usize> = fields.iter().map(|f| config.find(f).expect(f)).collect();
    assert!(positions.windows(2).all(|w| w[0] < w[1]), "{positions:?}");
    assert_eq!(std::mem::size_of::<Config>(), 8 + 4 + 4 + 4 * 4 + 8);
    assert!(header.contains("0xcafebeef"));
    assert_eq!(ffi::version_string(22809), "2.28.9");
    assert_eq!(ffi::version_string(2708), "2.7.8");
}

#[test]
fn dtypes_and_reductions_map_as_torch_maps_them() {
    use tch::Kind;
    assert_eq!(ffi::data_type(Kind::BFloat16, 22809).unwrap(), ffi::data_type::BFLOAT16);
    assert_eq!(ffi::data_type(Kind::Bool, 22809).unwrap(), ffi::data_type::UINT8);
    assert_eq!(ffi::data_type(Kind::Float8e4m3fn, 22809).unwrap(), ffi::data_type::FLOAT8_E4M3);
    let err = ffi::data_type(Kind::Float8e5m2, 22300).unwrap_err().to_string();
    assert!(err.contains("need NCCL 2.24 or later; this one is 2.23.0"), "{err}");
    let err = ffi::data_type(Kind::Int16, 22809).unwrap_err().to_string();
    assert!(err.contains("NCCL has no type for Int16"), "{err}");
    assert_eq!(ffi::reduction(ReduceOp::Avg, Kind::Half).unwrap(), ffi::red_op::AVG);
    assert_eq!(ffi::reduction(ReduceOp::Sum, Kind::Bool).unwrap(), ffi::red_op::MAX);
    let err = ffi::reduction(ReduceOp::Avg, Kind::Int64).unwrap_err().to_string();
    assert!(err.contains("an average of Int64 tensors"), "{err}");
}

#[test]
fn the_library_is_loaded_once_and_a_lacking_or_old_one_is_refused_by_name() {
    let path = stub("full", &[]);
    let first = Nccl::load(&path).unwrap();
    let second = Nccl::load(&path).unwrap();
    assert!(std::ptr::eq(first, second), "resolved twice");
    assert_eq!(ffi::version_string(first.version), "2.28.9");

    let err = Nccl::load(&stub("no-split", &["-DSTUB_OMIT_SPLIT"])).unwrap_err().to_string();
    assert!(err.contains("it lacks ncclCommSplit"), "{err}");
    assert!(err.contains("set NCCL_LIBRARY"), "{err}");
    let err = Nccl::load(&stub("old", &["-DSTUB_VERSION=21703"])).unwrap_err().to_string();
    assert!(err.contains("it is NCCL 2.17.3, older than 2.18"), "{err}");
    let err = Nccl::load(Path::new("/nonexistent/libnccl.so.2")).unwrap_err().to_string();
    assert!(err.contains("cannot use NCCL from /nonexistent/libnccl.so.2"), "{err}");
}

#[test]
fn creation_is_non_blocking_and_polled_and_failed_calls_name_rank_operation_and_nccls_text() {
    let path = stub("full", &[]);
    let nccl = Nccl::load(&path).unwrap();
    let controls = Controls::of(&path);
    let handle = init(nccl, Duration::from_secs(5)).unwrap();
    let log = controls.log();
    // The 2.17 config, non-blocking; the id passed by value.
    assert!(
        log.contains("ncclCommInitRankConfig nranks=1 rank=0 id1=1 size=40 magic=cafebeef version=21700 blocking=0"),
        "{log}"
    );
    // A failing call: its code's name, NCCL's text, the rank in the run, the collective.
    controls.set("fail_count", 13);
    let mut data = [0f32; 13];
    let status = {
        let _calls = handle.lock().unwrap();
        handle
            .launch("collective #3", |comm| {
                // SAFETY: the stub's ncclAllReduce on host memory of 13 floats.
                unsafe {
                    (nccl.all_reduce)(
                        data.as_ptr().cast(),
                        data.as_mut_ptr().cast(),
                        13,
                        ffi::data_type::FLOAT32,
                        ffi::red_op::SUM,
                        comm,
                        std::ptr::null_mut(),
                    )
                }
            })
            .unwrap()
    };
    let err = handle
        .check(status, "ncclAllReduce", Some("collective #3 all_reduce(sum) of [13] Float"))
        .unwrap_err()
        .to_string();
    assert_eq!(
        err,
        "ncclAllReduce failed on rank 5 in collective #3 all_reduce(sum) of [13] Float: \
         ncclInvalidArgument (4): stub error string 4; NCCL's last warning (process-wide, may \
         be older): the stub refuses this count"
    );
    drop(handle);
    let log = controls.log();
    let (finalize, destroy) =
        (log.find("ncclCommFinalize").unwrap(), log.find("ncclCommDestroy").unwrap());
    assert!(finalize < destroy && !log.contains("ncclCommAbort"), "{log}");
}

#[test]
fn a_creation_that_never_finishes_or_fails_is_aborted_with_a_clear_error() {
    let path = stub("full", &[]);
    let nccl = Nccl::load(&path).unwrap();
    let controls = Controls::of(&path);
    controls.set("init_polls", i32::MAX);
    let started = Instant::now();
    let err = init(nccl, Duration::from_millis(300)).unwrap_err().to_string();
    assert!(started.elapsed() < Duration::from_secs(3));
    assert!(err.contains("ncclCommInitRankConfig failed on rank 5"), "{err}");
    assert!(err.contains("still in progress after 0 s"), "{err}");
    assert!(err.contains("the communicator was aborted"), "{err}");
    assert!(controls.log().contains("ncclCommAbort"), "{}", controls.log());
    // Refused outright: NCCL's code comes back as it is.
    controls.set("init_polls", 0);
    controls.set("init_result", 2);
    let err = init(nccl, Duration::from_secs(1)).unwrap_err().to_string();
    assert!(err.contains("ncclSystemError (2): stub error string 2"), "{err}");
}

#[test]
fn split_makes_communicators_for_colors_and_none_for_no_color() {
    let path = stub("full", &[]);
    let nccl = Nccl::load(&path).unwrap();
    let controls = Controls::of(&path);
    let world = init(nccl, Duration::from_secs(5)).unwrap();
    let part = world.split(1, 0, 1).unwrap().expect("a member");
    assert_eq!((part.rank, part.size), (0, 1));
    assert!(world.split(-1, 0, 0).unwrap().is_none());
    let log = controls.log();
    assert!(log.contains("ncclCommSplit color=1 key=0 blocking=0"), "{log}");
    assert!(log.contains("ncclCommSplit color=-1 key=0"), "{log}");
}

/// A completion the test decides.
struct Flag(AtomicBool);

impl Completion for Flag {
    fn is_done(&self) -> crate::Result<bool> {
        Ok(self.0.load(Ordering::SeqCst))
    }
}

/// A watched communicator of a fresh stub: the handle, its watchdog, the stub's controls,
/// the reports the watchdog made, and the last progress it posted.
type Watched = (Arc<Handle>, Watchdog, Controls, Arc<Mutex<Vec<String>>>, Arc<AtomicU64>);

fn watched(timeout: Duration) -> Watched {
    let path = stub("full", &[]);
    let nccl = Nccl::load(&path).unwrap();
    let controls = Controls::of(&path);
    let handle = Arc::new(init(nccl, Duration::from_secs(5)).unwrap());
    let reports = Arc::new(Mutex::new(Vec::new()));
    let posted = Arc::new(AtomicU64::new(0));
    let options = WatchdogOptions {
        timeout,
        poll: Duration::from_millis(20),
        on_failure: {
            let reports = reports.clone();
            Arc::new(move |m: &str| reports.lock().unwrap().push(m.to_owned()))
        },
        behind: Arc::new(|seq| format!("; not arrived: rank 1 (last at #{})", seq - 1)),
        post_progress: {
            let posted = posted.clone();
            Arc::new(move |seq, _epoch| posted.store(seq, Ordering::SeqCst))
        },
        device_index: None,
    };
    let watchdog = Watchdog::start(handle.clone(), options).unwrap();
    (handle, watchdog, controls, reports, posted)
}

fn wait_for(what: &str, done: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !done() {
        assert!(Instant::now() < deadline, "{what} did not happen within 5 s");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn the_watchdog_aborts_on_an_asynchronous_error_and_every_later_call_fails() {
    let (handle, watchdog, controls, reports, _) = watched(Duration::from_secs(60));
    let op = Arc::new(Flag(AtomicBool::new(false)));
    watchdog.track(Tracked {
        seq: 4,
        epoch: 0,
        op: Op::AllGather,
        collective: true,
        what: "[8] BFloat16".into(),
        started: Instant::now(),
        done: op,
    });
    controls.set("async_error", 6);
    wait_for("the report", || !reports.lock().unwrap().is_empty());
    let report = reports.lock().unwrap()[0].clone();
    assert!(report.contains("NCCL reported an asynchronous error"), "{report}");
    assert!(report.contains("ncclRemoteError (6)"), "{report}");
    assert!(
        report.contains("operation in flight: collective #4 all_gather of [8] BFloat16"),
        "{report}"
    );
    assert!(handle.is_aborted() && controls.log().contains("ncclCommAbort"));
    assert!(watchdog.failure().unwrap_err().to_string().contains("ncclRemoteError"));
    drop(watchdog);
    drop(handle);
    // Aborted: neither finalized nor destroyed afterwards.
    assert!(!controls.log().contains("ncclCommFinalize"), "{}", controls.log());
}

#[test]
fn an_operation_that_does_not_complete_in_time_is_reported_with_the_ranks_behind() {
    let (handle, watchdog, _controls, reports, posted) = watched(Duration::from_millis(300));
    let finished = Arc::new(Flag(AtomicBool::new(false)));
    let hung = Arc::new(Flag(AtomicBool::new(false)));
    for (seq, done) in [(6, finished.clone()), (7, hung.clone())] {
        watchdog.track(Tracked {
            seq,
            epoch: 0,
            op: Op::AllReduce(ReduceOp::Avg),
            collective: true,
            what: "[4] Float".into(),
            started: Instant::now(),
            done,
        });
    }
    finished.0.store(true, Ordering::SeqCst);
    wait_for("the progress post", || posted.load(Ordering::SeqCst) == 7);
    wait_for("the report", || !reports.lock().unwrap().is_empty());
    let report = reports.lock().unwrap()[0].clone();
    assert!(
        report.starts_with("collective #7 all_reduce(avg) of [4] Float on rank 5: timed out after 0 s on the GPU; not arrived: rank 1 (last at #6); the communicator was aborted"),
        "{report}"
    );
    assert!(handle.is_aborted());
    assert_eq!(watchdog.in_flight(), 1, "the completed operation is no longer watched");
}

/// The watchdog's poll of `ncclCommGetAsyncError` and a caller waiting out `ncclInProgress`
/// on the same communicator never overlap (NCCL 2.28 may free a group job in that call): the
/// stub logs any two calls inside one communicator at once.
#[test]
fn async_error_is_never_polled_concurrently() {
    let path = stub("full", &[]);
    let nccl = Nccl::load(&path).unwrap();
    let controls = Controls::of(&path);
    let handle = Arc::new(init(nccl, Duration::from_secs(5)).unwrap());
    controls.set("linger_us", 200);
    let options = WatchdogOptions {
        timeout: Duration::from_secs(60),
        poll: Duration::from_micros(50),
        on_failure: Arc::new(|m: &str| panic!("the watchdog reported {m}")),
        behind: Arc::new(|_| String::new()),
        post_progress: Arc::new(|_, _| {}),
        device_index: None,
    };
    let watchdog = Watchdog::start(handle.clone(), options).unwrap();
    let started = Instant::now();
    let mut waits = 0;
    while started.elapsed() < Duration::from_millis(400) {
        handle.check(ffi::IN_PROGRESS, "test wait", None).unwrap();
        waits += 1;
    }
    drop(watchdog);
    controls.set("linger_us", 0);
    let log = controls.log();
    assert!(waits > 100, "only {waits} waits");
    assert!(!log.contains("OVERLAP"), "calls overlapped:\n{log}");
}

/// An abort the program asks for (`Accelerator::abort`, a failing run's exit guard) is not a
/// fault: the watchdog stops without reporting it or ending the process.
#[test]
fn an_abort_the_program_asks_for_is_not_reported_as_a_fault() {
    let (handle, watchdog, controls, reports, _) = watched(Duration::from_secs(60));
    handle.abort();
    std::thread::sleep(Duration::from_millis(200));
    assert!(reports.lock().unwrap().is_empty(), "reported: {:?}", reports.lock().unwrap());
    assert!(watchdog.failure().is_ok());
    assert!(controls.log().contains("ncclCommAbort"));
}

/// A communicator that is dropped — the end of the run — is finalized and destroyed after its
/// watchdog stops, in that order, and never aborted.
#[test]
fn a_dropped_communicator_is_finalized_then_destroyed_after_its_watchdog_stops() {
    let (handle, watchdog, controls, reports, _) = watched(Duration::from_secs(60));
    drop(watchdog);
    drop(handle);
    let log = controls.log();
    let finalized = log.find("ncclCommFinalize").expect("not finalized");
    let destroyed = log.find("ncclCommDestroy").expect("not destroyed");
    assert!(finalized < destroyed && !log.contains("ncclCommAbort"), "{log}");
    assert!(reports.lock().unwrap().is_empty());
}

/// A blocking call that never returns (a peer that never makes the same call) does not
/// freeze the watchdog: it sees the call outlive the timeout, reports it, and aborts at once
/// — which is what releases the call (NCCL's abort flags), so waiting for it would hang.
#[test]
fn a_blocking_call_stuck_on_the_host_is_reported_and_aborted_at_once() {
    let path = stub("full", &[]);
    let nccl = Nccl::load(&path).unwrap();
    let controls = Controls::of(&path);
    let id = UniqueId { internal: [1; ffi::UNIQUE_ID_BYTES] };
    let handle =
        Arc::new(Handle::init(nccl, id, 1, 0, 5, Duration::from_millis(300), true).unwrap());
    let reports = Arc::new(Mutex::new(Vec::new()));
    let options = WatchdogOptions {
        timeout: Duration::from_secs(60),
        poll: Duration::from_millis(20),
        on_failure: {
            let reports = reports.clone();
            Arc::new(move |m: &str| reports.lock().unwrap().push(m.to_owned()))
        },
        behind: Arc::new(|_| String::new()),
        post_progress: Arc::new(|_, _| {}),
        device_index: None,
    };
    let watchdog = Watchdog::start(handle.clone(), options).unwrap();
    let stuck = {
        let (handle, path) = (handle.clone(), path.clone());
        std::thread::spawn(move || {
            let started = Instant::now();
            let nccl_side = Controls::of(&path);
            // Blocked inside NCCL until ncclCommAbort sets its flags.
            handle
                .launch("collective #3 all_reduce(sum) of [4] Float", |_| {
                    while !nccl_side.log().contains("ncclCommAbort")
                        && started.elapsed() < Duration::from_secs(10)
                    {
                        std::thread::sleep(Duration::from_millis(5));
                    }
                })
                .unwrap();
            started.elapsed()
        })
    };
    wait_for("the report", || !reports.lock().unwrap().is_empty());
    let report = reports.lock().unwrap()[0].clone();
    assert!(
        report.contains("an NCCL call has not returned after 0 s, in collective #3 all_reduce"),
        "{report}"
    );
    let blocked = stuck.join().unwrap();
    assert!(blocked < Duration::from_secs(5), "the call was released only after {blocked:?}");
    assert!(controls.log().contains("ncclCommAbort"), "{}", controls.log());
    assert!(watchdog.failure().is_err());
    drop(watchdog);
    drop(handle);
    assert!(!controls.log().contains("ncclCommFinalize"), "{}", controls.log());
}

/// Before a communicator is finalized, what is queued is let finish within the timeout
/// (`NcclComm`'s drop drains its watchdog, then aborts what did not finish).
#[test]
fn draining_waits_for_the_operations_in_flight_within_a_bound() {
    let (_handle, watchdog, _controls, reports, _) = watched(Duration::from_secs(60));
    let op = Arc::new(Flag(AtomicBool::new(false)));
    watchdog.track(Tracked {
        seq: 1,
        epoch: 0,
        op: Op::Broadcast,
        collective: true,
        what: "[2] Float".into(),
        started: Instant::now(),
        done: op.clone(),
    });
    let started = Instant::now();
    assert!(!watchdog.drain(Duration::from_millis(150)), "an unfinished operation drained");
    assert!(started.elapsed() >= Duration::from_millis(150));
    let finisher = {
        let op = op.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            op.0.store(true, Ordering::SeqCst);
        })
    };
    assert!(watchdog.drain(Duration::from_secs(5)));
    finisher.join().unwrap();
    assert!(reports.lock().unwrap().is_empty());
}

#[test]
fn fp8_is_never_reduced_by_nccl() {
    for kind in [tch::Kind::Float8e4m3fn, tch::Kind::Float8e5m2] {
        let err = super::refuse_fp8_reduction(kind).unwrap_err().to_string();
        assert!(err.contains("NCCL reductions of fp8") && err.contains("bf16"), "{err}");
    }
    assert!(super::refuse_fp8_reduction(tch::Kind::BFloat16).is_ok());
}
