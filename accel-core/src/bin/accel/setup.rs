//! `accel setup`: makes a user's crate build against accel in one command. It finds a
//! libtorch 2.11.0 — `LIBTORCH`, else the torch of a Python (`--python`, else `python3`),
//! else a new `.venv` in the crate with torch 2.11.0 from PyPI, as `cargo xtask setup`
//! makes accel's own — then writes the crate's `.cargo/config.toml` (`LIBTORCH`) and the
//! one-line `build.rs` if missing, and says what it did and what is left to do by hand.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The libtorch accel's tch is built for.
const TORCH: &str = "2.11.0";

/// The one-line build script (the README's).
pub(crate) const BUILD_RS: &str = r#"fn main() {
    println!("cargo::rustc-link-arg={}", std::env::var("DEP_ACCEL_LINK_ARG").unwrap());
}
"#;

fn fail(message: String) -> accel_core::Error {
    accel_core::Error::Config(message)
}

/// The version of the libtorch in `dir` (a torch package or an unpacked libtorch), if it
/// says.
fn libtorch_version(dir: &Path) -> Option<String> {
    if let Ok(text) = std::fs::read_to_string(dir.join("version.py")) {
        let line = text.lines().find(|l| l.starts_with("__version__"))?;
        return Some(line.split(['\'', '"']).nth(1)?.to_owned());
    }
    if let Ok(text) = std::fs::read_to_string(dir.join("build-version")) {
        return Some(text.trim().to_owned());
    }
    let header = std::fs::read_to_string(dir.join("include/torch/headeronly/version.h")).ok()?;
    let at = header.find("define TORCH_VERSION")?;
    Some(header[at..].split('"').nth(1)?.to_owned())
}

/// Whether `version` ("2.11.0+cu130") is the one tch 0.24 needs.
fn matches(version: &str) -> bool {
    version.split('+').next() == Some(TORCH)
}

/// The torch package of `python`: (version, folder), or why not.
fn python_torch(python: &Path) -> std::result::Result<(String, PathBuf), String> {
    let output = Command::new(python)
        .args([
            "-c",
            "import os, torch; print(torch.__version__); print(os.path.dirname(torch.__file__))",
        ])
        .output()
        .map_err(|e| format!("cannot run {}: {e}", python.display()))?;
    if !output.status.success() {
        return Err(format!("{} has no torch", python.display()));
    }
    let text = String::from_utf8_lossy(&output.stdout);
    let mut lines = text.lines();
    match (lines.next(), lines.next()) {
        (Some(v), Some(d)) => Ok((v.trim().to_owned(), PathBuf::from(d.trim()))),
        _ => Err(format!("{} printed no torch version", python.display())),
    }
}

/// Says what `accel setup` did, a line at a time.
fn say(line: impl std::fmt::Display) {
    println!("accel setup: {line}");
}

/// Finds or makes the libtorch.
fn find_libtorch(crate_dir: &Path, python: Option<&Path>) -> accel_core::Result<PathBuf> {
    if let Some(dir) = std::env::var_os("LIBTORCH").map(PathBuf::from) {
        match libtorch_version(&dir) {
            Some(v) if matches(&v) && dir.join("lib/libtorch.so").exists() => {
                say(format!("using LIBTORCH={} (torch {v})", dir.display()));
                return Ok(dir);
            }
            other => {
                return Err(fail(format!(
                    "LIBTORCH={} is not a libtorch {TORCH} (version {}); unset it, or point it at \
                     one",
                    dir.display(),
                    other.unwrap_or_else(|| "unknown".into())
                )));
            }
        }
    }
    let python = python.map(Path::to_path_buf).unwrap_or_else(|| "python3".into());
    match python_torch(&python) {
        Ok((v, dir)) if matches(&v) => {
            say(format!("found torch {v} of {} in {}", python.display(), dir.display()));
            return Ok(dir);
        }
        Ok((v, _)) => say(format!(
            "{} has torch {v}, not {TORCH} (tch 0.24 needs exactly {TORCH})",
            python.display()
        )),
        Err(why) => say(why),
    }
    let venv = crate_dir.join(".venv");
    let venv_python = venv.join("bin/python");
    if !venv_python.exists() {
        say(format!("creating {} with {}", venv.display(), python.display()));
        let status = Command::new(&python).args(["-m", "venv"]).arg(&venv).status();
        if !status.is_ok_and(|s| s.success()) {
            return Err(fail(format!(
                "`{} -m venv {}` failed: install Python 3.10+ with its venv module, or set \
                 LIBTORCH to a libtorch {TORCH}",
                python.display(),
                venv.display()
            )));
        }
    }
    say(format!("installing torch=={TORCH} into {} (about 4.7 GB with CUDA)", venv.display()));
    let status = Command::new(&venv_python)
        .args(["-m", "pip", "install", "--disable-pip-version-check", "-q"])
        .arg(format!("torch=={TORCH}"))
        .status();
    if !status.is_ok_and(|s| s.success()) {
        return Err(fail(format!(
            "pip could not install torch=={TORCH} into {} (is PyPI reachable? PIP_INDEX_URL \
             names a mirror); or set LIBTORCH to a libtorch {TORCH}",
            venv.display()
        )));
    }
    let (v, dir) = python_torch(&venv_python).map_err(fail)?;
    say(format!("torch {v} installed in {}", dir.display()));
    Ok(dir)
}

/// Sets `LIBTORCH` in the crate's `.cargo/config.toml`, keeping everything else in it.
fn write_cargo_config(crate_dir: &Path, libtorch: &Path) -> accel_core::Result<()> {
    let path = crate_dir.join(".cargo/config.toml");
    // The table form merges with a parent folder's `.cargo/config.toml` of either form.
    let line = format!("LIBTORCH = {{ value = {:?} }}", libtorch.display().to_string());
    let old = std::fs::read_to_string(&path).unwrap_or_default();
    let mut lines: Vec<String> = old.lines().map(str::to_owned).collect();
    let existing = lines.iter().position(|l| l.trim_start().starts_with("LIBTORCH"));
    if existing.is_some_and(|i| lines[i].trim() == line) {
        say(format!("{} already sets {line}", path.display()));
        return Ok(());
    }
    match (existing, lines.iter().position(|l| l.trim() == "[env]")) {
        (Some(i), _) => lines[i] = line.clone(),
        (None, Some(env)) => lines.insert(env + 1, line.clone()),
        (None, None) => {
            if !lines.is_empty() {
                lines.push(String::new());
            }
            lines.push("[env]".into());
            lines.push("# libtorch for tch (written by `accel setup`).".into());
            lines.push(line.clone());
        }
    }
    let io = |source| accel_core::Error::Io { path: path.clone(), source };
    std::fs::create_dir_all(crate_dir.join(".cargo")).map_err(io)?;
    std::fs::write(&path, lines.join("\n") + "\n").map_err(io)?;
    say(format!("wrote {line} into {}", path.display()));
    Ok(())
}

/// Runs `accel setup` in `crate_dir`.
pub(crate) fn run(crate_dir: &Path, python: Option<&Path>) -> accel_core::Result<()> {
    let manifest = crate_dir.join("Cargo.toml");
    let cargo_toml = std::fs::read_to_string(&manifest).map_err(|e| {
        fail(format!(
            "no Cargo.toml in {} ({e}): run `accel setup` in your crate's folder (or give \
             --dir)",
            crate_dir.display()
        ))
    })?;
    let libtorch = find_libtorch(crate_dir, python)?;
    write_cargo_config(crate_dir, &libtorch)?;
    let build_rs = crate_dir.join("build.rs");
    match std::fs::read_to_string(&build_rs) {
        Err(_) => {
            std::fs::write(&build_rs, BUILD_RS)
                .map_err(|source| accel_core::Error::Io { path: build_rs.clone(), source })?;
            say(format!("wrote {} (links libtorch so the binary sees GPUs)", build_rs.display()));
        }
        Ok(text) if text.contains("DEP_ACCEL_LINK_ARG") => {
            say(format!("{} already passes DEP_ACCEL_LINK_ARG", build_rs.display()));
        }
        Ok(_) => say(format!(
            "{} exists: add this line to its main() yourself: println!(\"cargo::rustc-link-arg={{}}\", \
             std::env::var(\"DEP_ACCEL_LINK_ARG\").unwrap());",
            build_rs.display()
        )),
    }
    for (dependency, line) in [
        ("accel-core", "cargo add --git https://github.com/accel-rs/accel accel-core"),
        ("tch", "cargo add tch@=0.24.0"),
    ] {
        if !cargo_toml.lines().any(|l| l.trim_start().starts_with(dependency)) {
            say(format!("{} lacks {dependency}: {line}", manifest.display()));
        }
    }
    ignore_machine_config(crate_dir)?;
    say("done: `cargo build` now finds libtorch. Commit build.rs; .cargo/config.toml names this \
         machine's libtorch, so each machine (and CI) runs `accel setup` instead");
    Ok(())
}

/// Keeps `.cargo/config.toml` (an absolute path of this machine) out of the crate's git,
/// where the crate has a `.gitignore` (as `cargo new` writes one).
fn ignore_machine_config(crate_dir: &Path) -> accel_core::Result<()> {
    let path = crate_dir.join(".gitignore");
    let Ok(text) = std::fs::read_to_string(&path) else { return Ok(()) };
    let entry = "/.cargo/config.toml";
    if text.lines().any(|l| l.trim() == entry || l.trim() == ".cargo/config.toml") {
        return Ok(());
    }
    let separator = if text.is_empty() || text.ends_with('\n') { "" } else { "\n" };
    let io = |source| accel_core::Error::Io { path: path.clone(), source };
    std::fs::write(&path, format!("{text}{separator}{entry}\n")).map_err(io)?;
    say(format!("added {entry} to {}", path.display()));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_are_read_from_a_package_an_unpacked_libtorch_or_the_header() {
        let dir = std::env::temp_dir().join(format!("accel-setup-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("include/torch/headeronly")).unwrap();
        std::fs::write(
            dir.join("include/torch/headeronly/version.h"),
            "#define TORCH_VERSION \\\n  \"2.11.0\"\n",
        )
        .unwrap();
        assert_eq!(libtorch_version(&dir).as_deref(), Some("2.11.0"));
        std::fs::write(dir.join("build-version"), "2.10.1+cpu\n").unwrap();
        assert_eq!(libtorch_version(&dir).as_deref(), Some("2.10.1+cpu"));
        std::fs::write(dir.join("version.py"), "__version__ = '2.11.0+cu130'\n").unwrap();
        assert_eq!(libtorch_version(&dir).as_deref(), Some("2.11.0+cu130"));
        assert!(matches("2.11.0+cu130") && matches("2.11.0") && !matches("2.11.1"));
        let _ = std::fs::remove_dir_all(dir);
    }
}
