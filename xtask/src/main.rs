//! Project chores, so that a fresh clone needs two commands and nothing installed by hand:
//!
//! - `cargo xtask setup`  creates `.venv` (torch 2.11.0 from PyPI, accelerate, safetensors)
//!   and links `.venv/libtorch` to the torch package, which `.cargo/config.toml` hands to
//!   torch-sys as `LIBTORCH`. Runs once; later calls only check it.
//! - `cargo xtask test [ARGS]`   setup, then `cargo test --workspace [ARGS]`; without ARGS
//!   also the packages, the API docs, fmt and clippy: all CI checks, each phase timed.
//! - `cargo xtask train [ARGS]`  setup, then the main job: the `train` example on 2 local
//!   processes (`accel launch`), on CPU.
//! - `cargo xtask bench`         setup, release build, then accel, a raw tch loop and PyTorch +
//!   Accelerate on the same work in the same run, as a table of ratios; writes
//!   bench/results.json and the bench block of docs/performance.md from it (`bench speed`:
//!   without the memory benchmarks; `bench readme`: only that block, from the file).
//!
//! Only std and serde_json are used so that this builds in seconds, before libtorch exists.
//!
//! This file holds the commands' dispatch, `test` and `train`; setup.rs the venv and libtorch,
//! bench/ the benchmarks (one file each), results.rs what they write, lints.rs the
//! repository's lint tests.

mod bench;
mod phases;
mod results;
mod setup;

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use bench::{
    bench, generate_bench, in_backward_bench, llama_memory_bench, loader_bench, memory_bench,
    overhead_bench, scale_bench,
};
use results::readme_from_results;
use setup::setup;

const MAIN_EXAMPLE: &str = "train";

fn main() -> ExitCode {
    let mut args = std::env::args_os().skip(1);
    let command = args.next().and_then(|a| a.into_string().ok()).unwrap_or_default();
    let rest: Vec<OsString> = args.collect();
    let result = match command.as_str() {
        "setup" => setup().map(|_| ()),
        "test" => test(&rest),
        "train" => setup().and_then(|_| train(&rest)),
        "package" => setup().and_then(|_| package_and_check()),
        "bench" if rest.first().is_some_and(|a| a == "memory") => {
            setup().and_then(|_| memory_bench()).and_then(|_| llama_memory_bench())
        }
        "bench" if rest.first().is_some_and(|a| a == "speed") => setup().and_then(|_| bench()),
        "bench" if rest.first().is_some_and(|a| a == "readme") => readme_from_results(),
        "bench" if rest.first().is_some_and(|a| a == "overhead") => {
            setup().and_then(|_| overhead_bench(rest.get(1).and_then(|m| m.to_str())))
        }
        "bench" if rest.first().is_some_and(|a| a == "llama") => {
            setup().and_then(|_| llama_memory_bench())
        }
        "bench" if rest.first().is_some_and(|a| a == "in-backward") => {
            setup().and_then(|_| in_backward_bench())
        }
        "bench" if rest.first().is_some_and(|a| a == "generate") => {
            setup().and_then(|_| generate_bench())
        }
        "bench" if rest.first().is_some_and(|a| a == "loader") => {
            setup().and_then(|_| loader_bench())
        }
        "bench" if rest.first().is_some_and(|a| a == "scale") => {
            setup().and_then(|_| scale_bench()).and_then(|_| readme_from_results())
        }
        "bench" => setup()
            .and_then(|_| bench())
            .and_then(|_| scale_bench())
            .and_then(|_| loader_bench())
            .and_then(|_| readme_from_results())
            .and_then(|_| memory_bench())
            .and_then(|_| llama_memory_bench()),
        _ => Err(format!(
            "unknown command `{command}`; the commands are:\n  \
             cargo xtask setup         install libtorch into .venv (once)\n  \
             cargo xtask test [ARGS]   every test (cargo test --workspace ARGS)\n  \
             cargo xtask train [ARGS]  the main job\n  \
             cargo xtask package       the published crates packaged, each checked alone\n  \
             cargo xtask bench         accel vs a raw tch loop and PyTorch + Accelerate, same run\n  \
             cargo xtask bench speed   the same without the memory benchmarks\n  \
             cargo xtask bench readme  docs/performance.md's readings, from bench/results.json\n  \
             cargo xtask bench scale   rendezvous of 16 to 256 processes, accel and torchrun\n  \
             cargo xtask bench loader  the data loader's workers against a slow data set\n  \
             cargo xtask bench llama   a 106M Llama: loading and fine-tuning, beside PyTorch\n  \
             cargo xtask bench generate  the 106M Llama generating, beside transformers\n  \
             cargo xtask bench in-backward  the 106M Llama with the update inside backward, beside torchtune's\n  \
             cargo xtask bench overhead [mlp|transformer]  accel's instructions per step over the raw loop's (callgrind)\n  \
             cargo xtask bench memory  peak memory per process of ddp and zero1/2/3"
        )),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("xtask: {message}");
            ExitCode::FAILURE
        }
    }
}

pub(crate) fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("xtask lives in the workspace").into()
}

pub(crate) fn run(command: &mut Command) -> Result<(), String> {
    let status = command.status().map_err(|e| format!("cannot run {command:?}: {e}"))?;
    if status.success() { Ok(()) } else { Err(format!("{command:?} failed ({status})")) }
}

/// Everything CI checks: setup, `cargo test --workspace` (built, then run), the packages,
/// the API docs, fmt and clippy, each timed (phases.rs). The builds the tests start
/// themselves (trybuild's, the user crates') do not read this workspace's `[profile.dev]`;
/// the environment gives them its debug level, which halves their size. Same value, so the
/// workspace does not rebuild.
fn test(rest: &[OsString]) -> Result<(), String> {
    let started = std::time::Instant::now();
    let fresh = fresh_clone();
    let mut phases = phases::Phases::default();
    let result = test_phases(rest, &mut phases);
    if rest.is_empty() || result.is_err() {
        phases.report(started.elapsed(), fresh);
    }
    result
}

/// Whether nothing of the workspace was built yet (xtask itself aside).
fn fresh_clone() -> bool {
    let fingerprints = root().join("target/debug/.fingerprint");
    let Ok(entries) = std::fs::read_dir(fingerprints) else { return true };
    !entries.flatten().any(|e| e.file_name().to_string_lossy().starts_with("accel-core-"))
}

fn test_phases(rest: &[OsString], phases: &mut phases::Phases) -> Result<(), String> {
    phases.time("setup", setup).map(|_| ())?;
    let debug = ("CARGO_PROFILE_DEV_DEBUG", "line-tables-only");
    phases.time("build (workspace, tests, examples)", || {
        run(cargo_command(&["test", "--workspace", "--no-run"], &[]).env(debug.0, debug.1))
    })?;
    phases.run_tests(cargo_command(&["test", "--workspace"], rest).env(debug.0, debug.1))?;
    if !rest.is_empty() {
        // A filtered run (`cargo xtask test NAME`) tests that, not the packages.
        return Ok(());
    }
    // The API docs as docs.rs builds them: no warning, every intra-doc link resolved.
    phases.time("doc (warnings denied)", || {
        eprintln!("xtask: cargo doc --no-deps, warnings denied");
        run(cargo_command(&["doc", "--no-deps", "--workspace", "--quiet"], &[])
            .env("RUSTDOCFLAGS", "-D warnings")
            .env(debug.0, debug.1))
    })?;
    phases
        .time("fmt --check", || run(&mut cargo_command(&["fmt", "--all", "--", "--check"], &[])))?;
    phases.time("clippy (warnings denied)", || {
        run(cargo_command(&["clippy", "--workspace", "--all-targets", "--", "-D", "warnings"], &[])
            .env(debug.0, debug.1))
    })?;
    // The crates as crates.io would take them: packaged in dependency order (versions on the
    // path dependencies, the `include` lists), each then checked from its package alone. Last:
    // doc and clippy have checked most of their dependencies by then.
    phases.time("package (4 crates, each checked alone)", || {
        eprintln!("xtask: packaging {}, each checked alone", PUBLISHED.join(", "));
        package_and_check()
    })
}

/// The published crates, in dependency order.
const PUBLISHED: [&str; 4] = ["accel-choices", "accel-macros", "accel-core", "accel-models"];

/// `cargo package` without its own verification, then each package unpacked and checked on
/// its own, as cargo's verification builds it: its own feature resolution, its workspace
/// dependencies taken from the packages just made, not from this checkout. A check, not a
/// build: what a package can lose (a file outside `include`, a path dependency without a
/// version, a feature its manifest forgot) fails at the check as at the build, build scripts
/// included; codegen and linking are those of the test build, from the same sources. On a
/// fresh clone cargo's own verification took 108 s, this 56 (docs/performance.md).
fn package_and_check() -> Result<(), String> {
    let mut package = cargo_command(&["package", "--allow-dirty", "--no-verify", "--quiet"], &[]);
    for name in PUBLISHED {
        package.args(["-p", name]);
    }
    run(&mut package)?;
    let root = root();
    let version = env!("CARGO_PKG_VERSION");
    let unpacked = root.join("target/package-check");
    let _ = std::fs::remove_dir_all(&unpacked);
    std::fs::create_dir_all(&unpacked)
        .map_err(|e| format!("creating {}: {e}", unpacked.display()))?;
    let dir = |name: &str| unpacked.join(format!("{name}-{version}"));
    for name in PUBLISHED {
        let file = root.join(format!("target/package/{name}-{version}.crate"));
        run(Command::new("tar").arg("-xzf").arg(&file).arg("-C").arg(&unpacked))?;
        let manifest = dir(name).join("Cargo.toml");
        let mut text = std::fs::read_to_string(&manifest)
            .map_err(|e| format!("reading {}: {e}", manifest.display()))?;
        // Its own workspace, with the packages just made for its siblings (all of them
        // below it: a patch applies to the whole graph, those the crate reaches only through
        // another included).
        let below = PUBLISHED.iter().take_while(|s| **s != name);
        text.push_str("\n[workspace]\n\n[patch.crates-io]\n");
        for sibling in below {
            text.push_str(&format!("{sibling} = {{ path = \"../{sibling}-{version}\" }}\n"));
        }
        std::fs::write(&manifest, text)
            .map_err(|e| format!("writing {}: {e}", manifest.display()))?;
        // The versions this workspace is tested with (the package's own lock, where it has
        // one, is made from the same).
        if !dir(name).join("Cargo.lock").exists() {
            std::fs::copy(root.join("Cargo.lock"), dir(name).join("Cargo.lock"))
                .map_err(|e| format!("copying Cargo.lock: {e}"))?;
        }
    }
    for name in PUBLISHED {
        eprintln!("xtask: checking the package {name} {version}");
        run(cargo_command(&["check", "--quiet", "--offline", "--manifest-path"], &[])
            .arg(dir(name).join("Cargo.toml"))
            .arg("--target-dir")
            .arg(root.join("target")))?;
    }
    Ok(())
}

pub(crate) fn cargo(args: &[&str], rest: &[OsString]) -> Result<(), String> {
    run(&mut cargo_command(args, rest))
}

/// `cargo args rest` in the workspace's root.
fn cargo_command(args: &[&str], rest: &[OsString]) -> Command {
    let cargo = std::env::var_os("CARGO").unwrap_or("cargo".into());
    let mut command = Command::new(cargo);
    command.current_dir(root()).args(args).args(rest);
    command
}

/// The main job: the `train` example on 2 processes of this machine, on CPU.
fn train(rest: &[OsString]) -> Result<(), String> {
    cargo(
        &["build", "--quiet", "-p", "accel-core", "--bin", "accel", "-p", "accel-examples"],
        &["--example".into(), MAIN_EXAMPLE.into()],
    )?;
    let root = root();
    run(Command::new(root.join("target/debug/accel"))
        .args([
            "launch",
            "--num-processes",
            "2",
            "--main-process-port",
            "0",
            "--cpu",
            "--rank0-only",
        ])
        .arg(root.join("target/debug/examples").join(MAIN_EXAMPLE))
        .args(rest))
}

#[cfg(test)]
mod lints;
