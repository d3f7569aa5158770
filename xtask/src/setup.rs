//! `cargo xtask setup`: the Python venv (.venv, torch from PyPI) and the libtorch link into
//! it, made once and checked on every later command.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use crate::{root, run};

const REQUIREMENTS: &str = "python/requirements.txt";
const VENV: &str = ".venv";
/// Written after a successful install; holds the requirements it was made from.
const STAMP: &str = ".venv/.accel-requirements";
const LIBTORCH_LINK: &str = ".venv/libtorch";

/// Makes sure a libtorch is there; returns its directory.
pub(crate) fn setup() -> Result<PathBuf, String> {
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
    // pip's own "No space left on device" comes minutes in; say it before starting.
    if let Some(free) = free_gib(&root).filter(|free| *free < NEEDED_GIB) {
        eprintln!(
            "xtask: warning: {free:.1} GiB free under {}; the venv and a debug build need \
             about {NEEDED_GIB} GiB",
            root.display()
        );
    }
    eprintln!(
        "xtask: installing {} into {VENV} (first time only; torch with its CUDA libraries \
         is about 4.7 GB)",
        requirements.lines().filter(|l| !l.trim().is_empty() && !l.starts_with('#')).count()
    );
    install(&venv, &root.join(REQUIREMENTS)).map_err(|e| {
        format!(
            "{e}\ncould not install {REQUIREMENTS}: its message above says why (PyPI \
             not reachable, or no space left). Ways out: make PyPI reachable (or set \
             PIP_INDEX_URL to a mirror), free disk space (about {NEEDED_GIB} GiB in all), or \
             set LIBTORCH to an existing libtorch 2.11.0 and run cargo directly"
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

/// The installer: uv, itself from PyPI, fetches and unpacks the wheels in parallel (73 s for
/// these requirements on the 2-core VM, bytecode included, against pip's 199 s); pip when uv
/// cannot be had.
const UV: &str = "uv==0.13.9";

/// Installs `requirements` into `venv`. Neither installer keeps a cache: it would
/// hold a second copy of the ~3 GB of wheels for nothing. uv's, while it works, is a folder in
/// the venv, so that its files are hard-linked into place rather than copied (and the
/// temporary space is taken from this disk, not from /tmp).
fn install(venv: &Path, requirements: &Path) -> Result<(), String> {
    let python = &venv.join("bin/python");
    let pip = |args: &[&str]| {
        let mut command = Command::new(python);
        command.args(["-m", "pip", "install", "--disable-pip-version-check", "--no-cache-dir"]);
        command.arg("-q").args(args);
        command
    };
    if run(&mut pip(&[UV])).is_ok() {
        let mut uv = Command::new(python);
        let cache = venv.join(".uv-cache");
        // Compiled as pip does: with PYTHONDONTWRITEBYTECODE set (as on CI machines), every
        // Python process would otherwise compile torch and transformers again.
        uv.args(["-m", "uv", "pip", "install", "-q", "--compile-bytecode", "--link-mode"]);
        uv.args(["hardlink", "--cache-dir"]);
        uv.arg(&cache);
        // pip's settings for where wheels come from, which uv does not read by itself.
        if let Some(index) = std::env::var_os("PIP_INDEX_URL") {
            uv.arg("--index-url").arg(index);
        }
        let links = std::env::var("PIP_FIND_LINKS").unwrap_or_default();
        for link in links.split_whitespace() {
            if link.contains("://") || Path::new(link).exists() {
                uv.args(["--find-links", link]);
            }
        }
        uv.arg("--python").arg(python).arg("-r").arg(requirements);
        let installed = run(&mut uv);
        let _ = std::fs::remove_dir_all(&cache);
        match installed {
            Ok(()) => return Ok(()),
            Err(e) => eprintln!("xtask: uv failed ({e}); installing with pip instead"),
        }
    } else {
        eprintln!("xtask: could not install {UV}; installing with pip instead");
    }
    run(pip(&["-r"]).arg(requirements))
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

/// Disk a fresh checkout needs: the venv (5.7 GB) and `cargo xtask test`'s debug build.
const NEEDED_GIB: f64 = 12.0;

/// Free space on the file system holding `dir`, from `df` (None if it cannot tell).
fn free_gib(dir: &Path) -> Option<f64> {
    let output = Command::new("df").args(["-Pk"]).arg(dir).output().ok()?;
    let text = String::from_utf8_lossy(&output.stdout).into_owned();
    let kib: f64 = text.lines().nth(1)?.split_whitespace().nth(3)?.parse().ok()?;
    Some(kib / (1024.0 * 1024.0))
}
