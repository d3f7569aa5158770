//! `accel launch`: starts this machine's processes of a run and watches them.
//!
//! Each process gets torchrun's variables (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//! `LOCAL_WORLD_SIZE`, `GROUP_RANK`, `MASTER_ADDR`, `MASTER_PORT`), the training settings as
//! `ACCEL_*`, libtorch's lib dir on `LD_LIBRARY_PATH`, and `OMP_NUM_THREADS` = cores /
//! processes unless set. Output lines are prefixed with the rank. When a process exits
//! non-zero or dies, the others get SIGTERM, then SIGKILL after a grace period; the
//! launcher names the failed rank, its exit code or signal and its last lines, and exits
//! non-zero. Children die with the launcher (`PR_SET_PDEATHSIG`), so none is orphaned.

// The files of settings are read by the configuration layer, below both the launcher and
// the accelerator; these paths stay for the launcher's users.
pub use crate::config::file as config;
pub use crate::config::{check, deepspeed};

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Re-exported where the launcher's flags parse their durations.
pub use crate::config::parse_seconds;
use crate::error::{Error, Result};
use crate::sync::Locked;

/// Lines of each rank's output kept for the failure report.
const TAIL_LINES: usize = 20;

/// Everything `accel launch` needs, resolved.
#[derive(Debug, Clone)]
pub struct LaunchPlan {
    /// The program and its arguments.
    pub program: Vec<String>,
    /// Processes on this machine.
    pub num_processes: usize,
    /// Machines in the run.
    pub num_machines: usize,
    /// This machine's index.
    pub machine_rank: usize,
    /// Address of rank 0's store.
    pub main_process_ip: String,
    /// Its port (0: pick a free one; single machine only).
    pub main_process_port: u16,
    /// Extra variables for every process (training settings, timeouts ...).
    pub env: Vec<(String, String)>,
    /// Show only rank 0's output.
    pub rank0_only: bool,
    /// Whole-group restarts allowed after a failure.
    pub max_restarts: usize,
    /// Time between SIGTERM and SIGKILL when stopping processes.
    pub grace: Duration,
    /// Every rank's output also goes to `rank{N}.log` in this folder (torchrun's
    /// `--log-dir` with `--tee`), whatever the console shows.
    pub log_dir: Option<PathBuf>,
}

impl LaunchPlan {
    /// `processes` processes of `program` on this machine, on a free port, with the usual
    /// defaults (no restarts, 5 s grace, every rank's output shown).
    pub fn local(processes: usize, program: Vec<String>) -> Self {
        Self {
            program,
            num_processes: processes,
            num_machines: 1,
            machine_rank: 0,
            main_process_ip: "127.0.0.1".into(),
            main_process_port: 0,
            env: Vec::new(),
            rank0_only: false,
            max_restarts: 0,
            grace: Duration::from_secs(5),
            log_dir: None,
        }
    }
}

/// Why a process ended.
fn describe(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exited with code {code}"),
        (None, Some(signal)) => format!("was killed by signal {signal} ({})", signal_name(signal)),
        _ => "ended".into(),
    }
}

fn signal_name(signal: i32) -> &'static str {
    match signal {
        libc::SIGKILL => "SIGKILL",
        libc::SIGTERM => "SIGTERM",
        libc::SIGINT => "SIGINT",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        _ => "signal",
    }
}

/// The exit code the launcher reports for a failed process (shell convention for signals).
fn exit_code(status: ExitStatus) -> i32 {
    status.code().unwrap_or_else(|| 128 + status.signal().unwrap_or(1))
}

struct Rank {
    rank: usize,
    child: Child,
    tail: Arc<Mutex<VecDeque<String>>>,
    readers: Vec<std::thread::JoinHandle<()>>,
    status: Option<ExitStatus>,
}

/// Signals the child's whole process group: the program and anything it started (a shell
/// script's children included), so nothing is left behind holding the output pipes.
fn send_signal(child: &Child, signal: i32) {
    // SAFETY: killpg(2) on the process group the child leads (set up in `spawn`).
    unsafe {
        libc::killpg(child.id() as libc::pid_t, signal);
    }
}

/// Runs the plan; returns the exit code for the launcher.
pub fn run(plan: &LaunchPlan) -> Result<i32> {
    if plan.program.is_empty() {
        return Err(Error::Config("accel launch needs a program to run".into()));
    }
    if plan.num_processes == 0 || plan.num_machines == 0 {
        return Err(Error::Config("--num-processes and --num-machines must be at least 1".into()));
    }
    if plan.machine_rank >= plan.num_machines {
        return Err(Error::Config(format!(
            "--machine-rank {} is not below --num-machines {}",
            plan.machine_rank, plan.num_machines
        )));
    }
    let interrupted = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(signal, interrupted.clone())
            .map_err(|e| Error::Config(format!("cannot install signal handlers: {e}")))?;
    }
    let mut attempt = 0;
    loop {
        let port = resolve_port(plan)?;
        let outcome = run_once(plan, port, attempt, &interrupted)?;
        match outcome {
            Outcome::Success => return Ok(0),
            Outcome::Interrupted(code) => return Ok(code),
            Outcome::Failed(_) if attempt < plan.max_restarts => {
                attempt += 1;
                let pause = restart_backoff(attempt);
                eprintln!(
                    "accel launch: restarting all processes in {} s (restart {attempt} of {}); \
                     programs that call load_latest_checkpoint continue from their last checkpoint",
                    pause.as_secs(),
                    plan.max_restarts
                );
                let until = Instant::now() + pause;
                while Instant::now() < until {
                    if interrupted.load(Ordering::SeqCst) {
                        return Ok(130);
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
            Outcome::Failed(code) => return Ok(code),
        }
    }
}

/// The pause before restart `n` (1, 2, 4 ... seconds, at most 30): a fault that comes back
/// at once (a full disk, a port still held) is not hammered, and a passing one costs little.
fn restart_backoff(n: usize) -> Duration {
    Duration::from_secs(1u64 << (n.saturating_sub(1)).min(5)).min(Duration::from_secs(30))
}

fn resolve_port(plan: &LaunchPlan) -> Result<u16> {
    if plan.main_process_port == 0 {
        if plan.num_machines > 1 {
            return Err(Error::Config(
                "--main-process-port 0 (a free port) works on one machine only: the other machines \
                 must be told the port; pick one"
                    .into(),
            ));
        }
        return crate::comm::free_port(&plan.main_process_ip);
    }
    // Only machine 0 hosts the store; check there that the port is free before starting.
    if plan.machine_rank == 0 {
        std::net::TcpListener::bind((plan.main_process_ip.as_str(), plan.main_process_port)).map_err(|e| {
            Error::Rendezvous(if e.kind() == std::io::ErrorKind::AddrInUse {
                format!(
                    "port {} on {} is already in use (another run, or a leftover process?); pick \
                     another with --main-process-port, or 0 for a free one",
                    plan.main_process_port, plan.main_process_ip
                )
            } else {
                format!("cannot listen on {}:{}: {e}", plan.main_process_ip, plan.main_process_port)
            })
        })?;
    }
    Ok(plan.main_process_port)
}

enum Outcome {
    Success,
    Failed(i32),
    Interrupted(i32),
}

/// What the launcher tells its processes about its terminal (`tty`: rank 0's progress is
/// redrawn on one line, so it may report often; `lines`: every report stays in the log).
pub const PROGRESS_ENV: &str = crate::config::env::PROGRESS;

/// The start of a progress report (`Accelerator::progress_bar` away from a terminal).
pub use crate::config::env::PROGRESS_PREFIX;

/// The launcher's output: the ranks' lines as they come, and, on a terminal, rank 0's
/// latest progress report kept on the last line.
struct Console {
    tty: bool,
    progress: Option<String>,
}

impl Console {
    fn new() -> Self {
        use std::io::IsTerminal;
        Self { tty: std::io::stdout().is_terminal(), progress: None }
    }

    fn line(&mut self, is_err: bool, line: &str) {
        let mut stdout = std::io::stdout();
        if self.progress.is_some() {
            let _ = write!(stdout, "\r\x1b[2K");
            let _ = stdout.flush();
        }
        if is_err {
            let _ = writeln!(std::io::stderr(), "{line}");
        } else {
            let _ = writeln!(stdout, "{line}");
        }
        if let Some(progress) = &self.progress {
            let _ = write!(stdout, "{progress}");
            let _ = stdout.flush();
        }
    }

    fn progress(&mut self, line: String) {
        if !self.tty {
            return self.line(false, &line);
        }
        let mut stdout = std::io::stdout();
        let _ = write!(stdout, "\r\x1b[2K{line}");
        let _ = stdout.flush();
        self.progress = Some(line);
    }
}

impl Drop for Console {
    /// Leaves the last progress report on its own line.
    fn drop(&mut self) {
        if self.progress.take().is_some() {
            let _ = writeln!(std::io::stdout());
        }
    }
}

fn spawn(
    plan: &LaunchPlan,
    local_rank: usize,
    port: u16,
    attempt: usize,
    token: Option<&str>,
    out: &Arc<Mutex<Console>>,
) -> Result<Rank> {
    let world = plan.num_processes * plan.num_machines;
    let rank = plan.machine_rank * plan.num_processes + local_rank;
    let mut command = Command::new(&plan.program[0]);
    command
        .args(&plan.program[1..])
        .env("RANK", rank.to_string())
        .env("LOCAL_RANK", local_rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("LOCAL_WORLD_SIZE", plan.num_processes.to_string())
        .env("GROUP_RANK", plan.machine_rank.to_string())
        .env("MASTER_ADDR", &plan.main_process_ip)
        .env("MASTER_PORT", port.to_string())
        .env(crate::config::env::LAUNCHED, "1")
        .env(PROGRESS_ENV, if out.locked().tty { "tty" } else { "lines" })
        .env(crate::config::env::RESTART_COUNT, attempt.to_string())
        .envs(token.map(|t| (crate::comm::auth::TOKEN_ENV, t)))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if std::env::var_os("OMP_NUM_THREADS").is_none() {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        command.env("OMP_NUM_THREADS", (cores / plan.num_processes).max(1).to_string());
    }
    let lib = crate::cuda::libtorch_lib_dir();
    let library_path = match std::env::var_os("LD_LIBRARY_PATH") {
        Some(old) if !old.is_empty() => {
            let mut joined = lib.into_os_string();
            joined.push(":");
            joined.push(old);
            joined
        }
        _ => lib.into_os_string(),
    };
    command.env("LD_LIBRARY_PATH", library_path);
    for (k, v) in &plan.env {
        command.env(k, v);
    }
    // SAFETY: setpgid and prctl are async-signal-safe. The child leads its own process
    // group (so stopping it reaches what it starts) and is killed if the launcher dies.
    unsafe {
        command.pre_exec(|| {
            libc::setpgid(0, 0);
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    let mut child = command.spawn().map_err(|e| {
        Error::Config(format!("cannot start `{}`: {e}", PathBuf::from(&plan.program[0]).display()))
    })?;
    let tail = Arc::new(Mutex::new(VecDeque::with_capacity(TAIL_LINES)));
    let show = !plan.rank0_only || rank == 0;
    let log = match &plan.log_dir {
        Some(dir) => Some(Arc::new(Mutex::new(open_log(dir, rank, attempt)?))),
        None => None,
    };
    let mut readers = Vec::new();
    let stdout = child.stdout.take().map(|s| Box::new(s) as Box<dyn std::io::Read + Send>);
    let stderr = child.stderr.take().map(|s| Box::new(s) as Box<dyn std::io::Read + Send>);
    for (stream, is_err) in [(stdout, false), (stderr, true)] {
        let Some(stream) = stream else { continue };
        let (tail, out, log) = (tail.clone(), out.clone(), log.clone());
        readers.push(std::thread::spawn(move || {
            let mut reader = BufReader::new(stream);
            let mut line = Vec::new();
            let mut in_backtrace = false;
            while reader.read_until(b'\n', &mut line).unwrap_or(0) > 0 {
                let text = String::from_utf8_lossy(&line).trim_end_matches(['\n', '\r']).to_owned();
                line.clear();
                if let Some(log) = &log {
                    let mut file = log.locked();
                    // A full disk must not stop the run: the console still has the line.
                    let _ = writeln!(file, "{text}");
                }
                if show {
                    let mut console = out.locked();
                    let line = format!("[rank{rank}] {text}");
                    if rank == 0 && !is_err && text.starts_with(PROGRESS_PREFIX) {
                        console.progress(line);
                    } else {
                        console.line(is_err, &line);
                    }
                }
                // The report's tail is for the message: a backtrace's frames would push it out.
                in_backtrace = match is_backtrace_frame(&text) {
                    Frame::Header => true,
                    Frame::Line => in_backtrace,
                    Frame::Not => false,
                };
                if in_backtrace {
                    continue;
                }
                let mut tail = tail.locked();
                if tail.len() == TAIL_LINES {
                    tail.pop_front();
                }
                tail.push_back(text);
            }
        }));
    }
    Ok(Rank { rank, child, tail, readers, status: None })
}

/// `dir/rank{rank}.log`, created with `dir`; a restart appends to it after a marker line.
fn open_log(dir: &std::path::Path, rank: usize, attempt: usize) -> Result<std::fs::File> {
    let io = |path: &std::path::Path| {
        let path = path.to_path_buf();
        move |source| Error::Io { path, source }
    };
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let path = dir.join(format!("rank{rank}.log"));
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .write(true)
        .append(attempt > 0)
        .truncate(attempt == 0)
        .open(&path)
        .map_err(io(&path))?;
    if attempt > 0 {
        writeln!(file, "--- accel launch: restart {attempt} ---").map_err(io(&path))?;
    }
    Ok(file)
}

/// What a line is to a Rust backtrace, as `RUST_BACKTRACE=1` prints one after an error or
/// a panic: its header, one of its frames (`  12: path::to::fn`, `      at src/x.rs:3:5`,
/// the closing note), or not part of one (anyhow's numbered `Caused by:` lines look like
/// frames, so frames count only after a header).
#[derive(Debug, PartialEq, Eq)]
enum Frame {
    Header,
    Line,
    Not,
}

fn is_backtrace_frame(line: &str) -> Frame {
    let trimmed = line.trim_start();
    let indented = trimmed.len() < line.len();
    let numbered = trimmed
        .split_once(": ")
        .is_some_and(|(n, _)| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
    if trimmed.eq_ignore_ascii_case("stack backtrace:") {
        Frame::Header
    } else if (indented && (numbered || trimmed.starts_with("at ")))
        || trimmed.starts_with("note: Some details are omitted")
    {
        Frame::Line
    } else {
        Frame::Not
    }
}

/// The token this attempt's processes prove to each other: the one the environment or the
/// plan gives (`ACCEL_TOKEN`, `ACCEL_TOKEN_FILE`), else a fresh one per attempt on one
/// machine (so a restarted group never meets the old one), else — several machines, each
/// with its own launcher — none, said once: they cannot agree on a secret by themselves.
fn run_token(plan: &LaunchPlan) -> Result<Option<String>> {
    use crate::comm::auth::{TOKEN_ENV, TOKEN_FILE_ENV, Token};
    let given = |k: &str| {
        plan.env.iter().any(|(key, _)| key == k)
            || std::env::var_os(k).is_some_and(|v| !v.is_empty())
    };
    if given(TOKEN_ENV) || given(TOKEN_FILE_ENV) {
        return Ok(None);
    }
    if plan.num_machines > 1 {
        if plan.machine_rank == 0 {
            eprintln!(
                "accel launch: connections between the machines are not authenticated; give every \
                 machine the same secret in {TOKEN_ENV} or {TOKEN_FILE_ENV} (docs/security.md)"
            );
        }
        return Ok(None);
    }
    Token::generate().map(Some)
}

fn run_once(
    plan: &LaunchPlan,
    port: u16,
    attempt: usize,
    interrupted: &AtomicBool,
) -> Result<Outcome> {
    let out = Arc::new(Mutex::new(Console::new()));
    let token = run_token(plan)?;
    let mut ranks = Vec::new();
    for local in 0..plan.num_processes {
        match spawn(plan, local, port, attempt, token.as_deref(), &out) {
            Ok(r) => ranks.push(r),
            Err(e) => {
                stop(&mut ranks, plan.grace);
                return Err(e);
            }
        }
    }
    // Failed ranks in the order they were seen to fail; the cause is chosen among them.
    let mut failures: Vec<usize> = Vec::new();
    let mut choose_by: Option<Instant> = None;
    loop {
        for (i, r) in ranks.iter_mut().enumerate() {
            if r.status.is_none() {
                if let Ok(Some(status)) = r.child.try_wait() {
                    r.status = Some(status);
                    if !status.success() {
                        drain_output(r);
                        failures.push(i);
                    }
                }
            }
        }
        if !failures.is_empty() {
            let deadline = *choose_by.get_or_insert_with(|| Instant::now() + CAUSE_WINDOW);
            let cause = failures.iter().copied().find(|&i| !lost_a_peer(&ranks[i]));
            let all_ended = ranks.iter().all(|r| r.status.is_some());
            if cause.is_some() || all_ended || Instant::now() >= deadline {
                let i = first_failure(&ranks, &failures);
                stop(&mut ranks, plan.grace);
                report_failure(&ranks, i, &failures);
                return Ok(Outcome::Failed(exit_code(
                    ranks[i].status.expect("failed rank has a status"),
                )));
            }
        }
        if interrupted.load(Ordering::SeqCst) {
            eprintln!("accel launch: interrupted; stopping {} process(es)", ranks.len());
            stop(&mut ranks, plan.grace);
            return Ok(Outcome::Interrupted(130));
        }
        if ranks.iter().all(|r| r.status.is_some()) {
            join_readers(&mut ranks);
            return Ok(Outcome::Success);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// SIGTERM to every live process, SIGKILL to those still there after `grace`; reaps all.
fn stop(ranks: &mut [Rank], grace: Duration) {
    for r in ranks.iter() {
        if r.status.is_none() {
            send_signal(&r.child, libc::SIGTERM);
        }
    }
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline && ranks.iter().any(|r| r.status.is_none()) {
        for r in ranks.iter_mut().filter(|r| r.status.is_none()) {
            if let Ok(Some(status)) = r.child.try_wait() {
                r.status = Some(status);
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    for r in ranks.iter_mut() {
        // Also the group's leftovers when the leader itself has already exited.
        send_signal(&r.child, libc::SIGKILL);
        if r.status.is_none() {
            r.status = r.child.wait().ok();
        }
    }
    join_readers(ranks);
}

/// Waits for the output threads to drain (a bounded time: a process that escaped its group
/// could hold a pipe open).
fn join_readers(ranks: &mut [Rank]) {
    let deadline = Instant::now() + Duration::from_secs(2);
    for r in ranks.iter_mut() {
        for h in r.readers.drain(..) {
            while !h.is_finished() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
            if h.is_finished() {
                let _ = h.join();
            }
        }
    }
}

/// How long the launcher waits, after a rank failed only because it lost a peer, for the
/// rank that caused it to fail too (it is usually the one that exited first, but not always
/// the first one seen).
const CAUSE_WINDOW: Duration = Duration::from_secs(2);

/// Whether a failed rank's last words say that it failed because another one went away
/// (the collectives' and the store's messages for a lost connection).
fn lost_a_peer(rank: &Rank) -> bool {
    let tail = rank.tail.locked();
    tail.iter().any(|line| is_peer_loss(line))
}

fn is_peer_loss(line: &str) -> bool {
    line.contains("lost the connection to rank") || line.contains("lost the store at")
}

/// The failure to report as the run's cause: a rank killed by a signal (nobody else sent
/// one yet), else the first whose own error is not a lost peer, else the first.
fn first_failure(ranks: &[Rank], failures: &[usize]) -> usize {
    let by_signal =
        failures.iter().copied().find(|&i| ranks[i].status.is_some_and(|s| s.signal().is_some()));
    by_signal
        .or_else(|| failures.iter().copied().find(|&i| !lost_a_peer(&ranks[i])))
        .unwrap_or(failures[0])
}

/// Lets a rank that has exited finish handing over its last lines (a bounded wait).
fn drain_output(rank: &mut Rank) {
    let deadline = Instant::now() + Duration::from_millis(300);
    while rank.readers.iter().any(|h| !h.is_finished()) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn report_failure(ranks: &[Rank], failed: usize, failures: &[usize]) {
    let r = &ranks[failed];
    let status = r.status.expect("reaped");
    let mut report = format!(
        "accel launch: rank {} (pid {}) {}; stopped the other {} process(es)\n",
        r.rank,
        r.child.id(),
        describe(status),
        ranks.len() - 1
    );
    let tail = r.tail.locked();
    if tail.is_empty() {
        report.push_str(&format!("  rank {} printed nothing\n", r.rank));
    } else {
        report.push_str(&format!("  last lines of rank {}:\n", r.rank));
        for line in tail.iter() {
            report.push_str(&format!("    | {line}\n"));
        }
    }
    let followers: Vec<String> = failures
        .iter()
        .filter(|&&i| i != failed && lost_a_peer(&ranks[i]))
        .map(|&i| ranks[i].rank.to_string())
        .collect();
    if !followers.is_empty() {
        report.push_str(&format!(
            "  rank(s) {} then failed because they lost their connection to it\n",
            followers.join(", ")
        ));
    }
    let _ = std::io::stderr().write_all(report.as_bytes());
}

#[cfg(test)]
mod tests {
    #[test]
    fn restarts_back_off_exponentially_up_to_30_s() {
        let pauses: Vec<u64> = (1..=8).map(|n| super::restart_backoff(n).as_secs()).collect();
        assert_eq!(pauses, [1, 2, 4, 8, 16, 30, 30, 30]);
    }

    #[test]
    fn seconds_are_finite_bounded_and_positive_where_they_must_be() {
        use super::parse_seconds;
        assert_eq!(parse_seconds("2.5", false), Ok(2.5));
        assert_eq!(parse_seconds(" 0 ", true), Ok(0.0));
        for (text, zero_ok) in
            [("-1", true), ("nan", true), ("inf", false), ("0", false), ("1e300", true)]
        {
            let err = parse_seconds(text, zero_ok).unwrap_err();
            assert!(err.contains(text) && err.contains("expected"), "{text}: {err}");
        }
        assert!(parse_seconds("soon", true).unwrap_err().contains("not a number"));
    }

    use super::{Frame, is_backtrace_frame};

    #[test]
    fn backtrace_frames_are_told_from_messages() {
        assert_eq!(is_backtrace_frame("stack backtrace:"), Frame::Header);
        assert_eq!(is_backtrace_frame("Stack backtrace:"), Frame::Header);
        for frame in [
            "   0: __rustc::rust_begin_unwind",
            "  12: parity::main",
            "             at ./examples/parity.rs:43:5",
            "note: Some details are omitted, run with `RUST_BACKTRACE=full` for a verbose backtrace.",
            // anyhow's causes look the same; the reader keeps them unless a header came first.
            "    0: no such file",
        ] {
            assert_eq!(is_backtrace_frame(frame), Frame::Line, "{frame}");
        }
        for message in [
            "Error: invalid configuration: tensor_parallel = 2, but ...",
            "thread 'main' (24855) panicked at accel-core/src/strategy/tp/layers.rs:253:50:",
            "step 10: loss 0.5",
            "Caused by:",
        ] {
            assert_eq!(is_backtrace_frame(message), Frame::Not, "{message}");
        }
    }
}
