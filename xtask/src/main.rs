//! Project chores, so that a fresh clone needs two commands and nothing installed by hand:
//!
//! - `cargo xtask setup`  creates `.venv` (torch 2.11.0 from PyPI, accelerate, safetensors)
//!   and links `.venv/libtorch` to the torch package, which `.cargo/config.toml` hands to
//!   torch-sys as `LIBTORCH`. Runs once; later calls only check it.
//! - `cargo xtask test [ARGS]`   setup, then `cargo test --workspace [ARGS]`.
//! - `cargo xtask train [ARGS]`  setup, then the main job (the `train` example).
//!
//! Only std is used so that this builds in seconds, before libtorch exists.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::Instant;

const REQUIREMENTS: &str = "python/requirements.txt";
const VENV: &str = ".venv";
/// Written after a successful install; holds the requirements it was made from.
const STAMP: &str = ".venv/.accel-requirements";
const LIBTORCH_LINK: &str = ".venv/libtorch";
const MAIN_EXAMPLE: &str = "train";

fn main() -> ExitCode {
    let mut args = std::env::args_os().skip(1);
    let command = args.next().and_then(|a| a.into_string().ok()).unwrap_or_default();
    let rest: Vec<OsString> = args.collect();
    let result = match command.as_str() {
        "setup" => setup().map(|_| ()),
        "test" => setup().and_then(|_| cargo(&["test", "--workspace"], &rest)),
        "train" => setup().and_then(|_| {
            cargo(
                &["run", "--quiet", "-p", "accel-examples", "--example", MAIN_EXAMPLE, "--"],
                &rest,
            )
        }),
        _ => Err(format!(
            "unknown command `{command}`; the commands are:\n  \
             cargo xtask setup         install libtorch into .venv (once)\n  \
             cargo xtask test [ARGS]   every test (cargo test --workspace ARGS)\n  \
             cargo xtask train [ARGS]  the main job"
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

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("xtask lives in the workspace").into()
}

/// Makes sure a libtorch is there; returns its directory.
fn setup() -> Result<PathBuf, String> {
    let root = root();
    let ours = root.join(LIBTORCH_LINK);
    // `cargo run` passes on the LIBTORCH of .cargo/config.toml; only a different one is the
    // user's own choice.
    if let Some(theirs) = std::env::var_os("LIBTORCH").map(PathBuf::from)
        && theirs != ours
    {
        if !theirs.join("lib/libtorch.so").exists() {
            return Err(format!(
                "LIBTORCH={} has no lib/libtorch.so; point it at a libtorch 2.11.0 \
                 (the folder that holds lib/ and include/), or unset it to let \
                 `cargo xtask setup` install one into {VENV}",
                theirs.display()
            ));
        }
        eprintln!("xtask: using LIBTORCH={} (set in the environment)", theirs.display());
        return Ok(theirs);
    }
    let requirements = std::fs::read_to_string(root.join(REQUIREMENTS))
        .map_err(|e| format!("cannot read {REQUIREMENTS}: {e}"))?;
    let stamp = root.join(STAMP);
    if std::fs::read_to_string(&stamp).ok().as_deref() == Some(requirements.as_str())
        && ours.join("lib/libtorch.so").exists()
    {
        return Ok(ours);
    }

    let started = Instant::now();
    let python = find_python()?;
    let venv = root.join(VENV);
    let venv_python = venv.join("bin/python");
    if !venv_python.exists() {
        eprintln!("xtask: creating {} with {}", venv.display(), python.display());
        run(Command::new(&python).args(["-m", "venv"]).arg(&venv)).map_err(|e| {
            format!(
                "{e}\n`{} -m venv` failed: on Debian/Ubuntu install the venv module \
                 (apt-get install python3-venv), or set LIBTORCH to an existing libtorch 2.11.0",
                python.display()
            )
        })?;
    }
    eprintln!(
        "xtask: installing {} into {VENV} (first time only; torch with its CUDA libraries \
         is about 4.7 GB)",
        requirements.lines().filter(|l| !l.trim().is_empty() && !l.starts_with('#')).count()
    );
    run(Command::new(&venv_python)
        .args(["-m", "pip", "install", "--disable-pip-version-check", "-q", "-r"])
        .arg(root.join(REQUIREMENTS)))
    .map_err(|e| {
        format!(
            "{e}\npip could not install {REQUIREMENTS} (is PyPI reachable from here?). \
             Ways out: make PyPI reachable (or set PIP_INDEX_URL to a mirror), or set \
             LIBTORCH to an existing libtorch 2.11.0 and run cargo directly"
        )
    })?;
    let torch_dir =
        python_output(&venv_python, "import os, torch; print(os.path.dirname(torch.__file__))")?;
    // A relative link keeps working when the checkout is moved.
    let torch_dir = PathBuf::from(torch_dir.trim());
    let target = torch_dir.strip_prefix(&venv).unwrap_or(&torch_dir);
    let _ = std::fs::remove_file(&ours);
    std::os::unix::fs::symlink(target, &ours)
        .map_err(|e| format!("cannot link {} -> {}: {e}", ours.display(), target.display()))?;
    std::fs::write(&stamp, &requirements).map_err(|e| format!("cannot write {STAMP}: {e}"))?;
    eprintln!(
        "xtask: libtorch ready at {} -> {} ({:.0} s)",
        ours.display(),
        torch_dir.display(),
        started.elapsed().as_secs_f64()
    );
    Ok(ours)
}

fn find_python() -> Result<PathBuf, String> {
    let candidate = std::env::var_os("PYTHON").map(PathBuf::from).unwrap_or("python3".into());
    let version = python_output(&candidate, "import sys; print('%d.%d' % sys.version_info[:2])")
        .map_err(|e| {
            format!(
                "{e}\nPython 3.10 or newer is needed to install torch==2.11.0 from PyPI, and \
             `{}` did not run. Install python3 (with its venv module), set PYTHON to one, or \
             set LIBTORCH to an existing libtorch 2.11.0 (the folder with lib/libtorch.so)",
                candidate.display()
            )
        })?;
    let (major, minor) = version.trim().split_once('.').unwrap_or(("0", "0"));
    let (major, minor): (u32, u32) = (major.parse().unwrap_or(0), minor.parse().unwrap_or(0));
    if (major, minor) < (3, 10) {
        return Err(format!(
            "{} is Python {}; torch==2.11.0 needs 3.10 or newer. Set PYTHON to a newer one \
             or LIBTORCH to an existing libtorch 2.11.0",
            candidate.display(),
            version.trim()
        ));
    }
    Ok(candidate)
}

fn python_output(python: &Path, code: &str) -> Result<String, String> {
    let output = Command::new(python)
        .args(["-c", code])
        .output()
        .map_err(|e| format!("cannot run {}: {e}", python.display()))?;
    if !output.status.success() {
        return Err(format!(
            "{} -c {code:?} failed: {}",
            python.display(),
            String::from_utf8_lossy(&output.stderr).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

fn run(command: &mut Command) -> Result<(), String> {
    let status = command.status().map_err(|e| format!("cannot run {command:?}: {e}"))?;
    if status.success() { Ok(()) } else { Err(format!("{command:?} failed ({status})")) }
}

fn cargo(args: &[&str], rest: &[OsString]) -> Result<(), String> {
    let cargo = std::env::var_os("CARGO").unwrap_or("cargo".into());
    run(Command::new(cargo).current_dir(root()).args(args).args(rest))
}
