//! A user's own crate, outside this workspace, set up as the README says — its dependency
//! lines, then `accel setup`, which finds the libtorch, writes `.cargo/config.toml` and the
//! one-line build script — builds with a plain `cargo build`, and links libtorch so that
//! it runs without LD_LIBRARY_PATH and keeps libtorch_cuda loaded. tch_examples.rs builds
//! tch-rs's own examples the same way.

mod corpus;
mod tch_examples;

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;

const MANIFEST: &str = r#"[package]
name = "user-crate"
version = "0.1.0"
edition = "2024"

[dependencies]
accel-core = { path = "ACCEL_CORE" }
tch = "=0.24.0"

# Its own workspace: the test writes it inside this repository's target/. Edition 2024's
# feature resolver for every edition: under 2021's (resolver 1), torch-sys's build script
# would get other features, so another build of its C++ (minutes) for the tch-rs examples.
[workspace]
resolver = "3"
"#;

/// For the crates built into the workspace's target (`Build::for_programs`): a dependency
/// line that gives serde its features as `cargo test --workspace` unifies them (trybuild, a
/// dev-dependency of the UI tests, brings `serde_core/alloc` through `toml`). With other
/// features serde, and so accel-core above it, would be another build: minutes on a fresh
/// clone, for no other difference.
pub(crate) const AS_THE_WORKSPACE: &str =
    "serde_core = { version = \"1\", features = [\"alloc\"] }";

/// The README's build script, verbatim (what `accel setup` writes).
const BUILD_RS: &str = r#"fn main() {
    println!("cargo::rustc-link-arg={}", std::env::var("DEP_ACCEL_LINK_ARG").unwrap());
}
"#;

/// The linker of this target. The workspace's `.cargo/config.toml`, which crates inside
/// target/ read too, names scripts/linker.sh; a crate built as a user builds it links with
/// the system's default, `cc`.
const LINKER_ENV: &str = "CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_LINKER";

/// target/debug (where this test binary's deps/ folder sits).
fn build_dir() -> PathBuf {
    std::env::current_exe().unwrap().parent().unwrap().parent().unwrap().to_path_buf()
}

const MAIN_RS: &str = r#"fn main() {
    let cuda = accel_core::cuda::load_libtorch_cuda();
    let x = tch::Tensor::from_slice(&[1.0f32, 2.0, 3.0]);
    println!("sum={} libtorch_cuda={cuda:?}", x.sum(tch::Kind::Float).double_value(&[]));
}
"#;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// The folder the user crates that check `accel setup`'s own LIBTORCH build into (shared, so
/// that tch and accel-core are compiled once for all of them).
fn shared_target() -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join("user-crates-target")
}

/// Where a user crate builds, and with which LIBTORCH.
pub(crate) struct Build {
    pub(crate) target: PathBuf,
    /// None: the one `accel setup` wrote into the crate's `.cargo/config.toml`.
    libtorch: Option<OsString>,
}

impl Build {
    /// For the crates whose tests are about their programs, not about `accel setup`'s
    /// LIBTORCH. Under `cargo test`, which hands this test the workspace's LIBTORCH: the
    /// workspace's own target folder, that LIBTORCH and the workspace's debug level, so that
    /// torch-sys's C++ and tch are the workspace's builds and not made again (minutes on a
    /// fresh clone; accel-core, a path dependency here, is built anew). Otherwise the shared
    /// folder.
    pub(crate) fn for_programs() -> Build {
        match std::env::var_os("LIBTORCH") {
            Some(libtorch) => {
                Build { target: build_dir().parent().unwrap().into(), libtorch: Some(libtorch) }
            }
            None => Build { target: shared_target(), libtorch: None },
        }
    }

    /// `cargo` in `dir`, building into this folder with this LIBTORCH.
    pub(crate) fn cargo(&self, dir: &Path) -> Command {
        let mut command = Command::new(env!("CARGO"));
        command.current_dir(dir).env("CARGO_TARGET_DIR", &self.target).env_remove("RUSTFLAGS");
        match &self.libtorch {
            // The workspace's `[profile.dev]`, which a crate outside it does not read.
            Some(libtorch) => {
                command.env("LIBTORCH", libtorch).env("CARGO_PROFILE_DEV_DEBUG", "line-tables-only")
            }
            // As a user builds: `accel setup`'s LIBTORCH, and the system's linker (not the
            // workspace's, whose configuration a crate inside target/ reads too).
            None => command.env_remove("LIBTORCH").env(LINKER_ENV, "cc"),
        };
        command
    }
}

/// `accel setup` in `dir`, as a user runs the installed binary: no LIBTORCH anywhere; the
/// torch of the Python named. Returns what it printed.
fn accel_setup(dir: &Path) -> String {
    let python = std::env::var_os("ACCEL_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join(".venv/bin/python"));
    let setup = Command::new(build_dir().join("accel"))
        .current_dir(dir)
        .arg("setup")
        .arg("--python")
        .arg(&python)
        .env_remove("LIBTORCH")
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&setup.stdout).into_owned();
    assert!(setup.status.success(), "{said}{}", String::from_utf8_lossy(&setup.stderr));
    said
}

/// A user's crate named `name` of Rust `edition` in a fresh folder, with accel-core, tch and `extra`
/// dependency lines, the workspace's lock file (same versions, no network) and `accel
/// setup` run in it. Returns the folder and what `accel setup` said.
fn set_up_crate(name: &str, edition: &str, extra: &[&str]) -> (PathBuf, String) {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("src")).unwrap();
    let accel_core = root().join("accel-core");
    let mut manifest = MANIFEST.replace("ACCEL_CORE", accel_core.to_str().unwrap());
    manifest = manifest.replace("name = \"user-crate\"", &format!("name = \"{name}\""));
    manifest = manifest.replace("edition = \"2024\"", &format!("edition = \"{edition}\""));
    manifest = manifest.replace(
        "[dependencies]\n",
        &format!("[dependencies]\n{}", extra.iter().map(|l| format!("{l}\n")).collect::<String>()),
    );
    std::fs::write(dir.join("Cargo.toml"), manifest).unwrap();
    std::fs::copy(root().join("Cargo.lock"), dir.join("Cargo.lock")).unwrap();
    let built = Command::new(env!("CARGO"))
        .current_dir(root())
        .args(["build", "--quiet", "-p", "accel-core", "--bin", "accel"])
        .status()
        .unwrap();
    assert!(built.success());
    let said = accel_setup(&dir);
    (dir, said)
}

#[test]
fn a_crate_outside_the_workspace_is_set_up_by_accel_setup_and_runs_without_ld_library_path() {
    let (dir, said) = set_up_crate("user-crate", "2024", &[]);
    std::fs::write(dir.join("src/main.rs"), MAIN_RS).unwrap();
    assert!(said.contains("found torch 2.11.0"), "{said}");
    assert_eq!(std::fs::read_to_string(dir.join("build.rs")).unwrap(), BUILD_RS);
    let config = std::fs::read_to_string(dir.join(".cargo/config.toml")).unwrap();
    assert!(config.contains("[env]") && config.contains("LIBTORCH = "), "{config}");
    // Run again: nothing changes, and it says so.
    let said = accel_setup(&dir);
    assert!(said.contains("already sets LIBTORCH") && said.contains("already passes"), "{said}");

    let lib_dir = accel_core::cuda::libtorch_lib_dir();
    let target = shared_target();
    let setup = Build { target: target.clone(), libtorch: None };
    let status = setup.cargo(&dir).args(["build", "--offline", "--quiet"]).status().unwrap();
    assert!(status.success(), "the user crate did not build");

    let binary = target.join("debug/user-crate");
    let output = Command::new(&binary).env_remove("LD_LIBRARY_PATH").output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    assert!(stdout.contains("sum=6"), "{stdout}");
    if lib_dir.join("libtorch_cuda.so").exists() {
        assert!(stdout.contains("libtorch_cuda=Linked"), "{stdout}");
    }

    let dynamic = Command::new("readelf").arg("-d").arg(&binary).output().unwrap();
    let dynamic = String::from_utf8_lossy(&dynamic.stdout);
    assert!(dynamic.contains("[libtorch.so]"), "libtorch.so not needed:\n{dynamic}");
}

/// The user's training program of the route test: an ordinary tch loop with the one line.
const ROUTE_MAIN_RS: &str = r#"use anyhow::Result;
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

#[accel_core::accelerate(strategy = "ddp", seed = 0)]
fn train(batch: i64, out: &str) -> Result<()> {
    let x = Tensor::randn([64, 8], (Kind::Float, Device::Cpu));
    let y = x.sum_dim_intlist(1, true, Kind::Float).sin();
    let device = Device::cuda_if_available();
    let vs = nn::VarStore::new(device);
    let net = nn::seq()
        .add(nn::linear(vs.root() / "fc1", 8, 16, Default::default()))
        .add_fn(|x| x.tanh())
        .add(nn::linear(vs.root() / "fc2", 16, 1, Default::default()));
    let mut opt = nn::Sgd::default().build(&vs, 0.1)?;
    for _epoch in 0..3 {
        for (xb, yb) in tch::data::Iter2::new(&x, &y, batch) {
            let loss = net.forward(&xb.to_device(device)).mse_loss(&yb.to_device(device), tch::Reduction::Mean);
            opt.zero_grad();
            loss.backward();
            opt.step();
        }
    }
    vs.save(out)?;
    Ok(())
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    train(args[1].parse()?, &args[2])
}
"#;

/// docs/your-crate.md followed as written, from an empty folder outside this repository
/// (so that none of its cargo configuration applies): the libtorch of a Python environment
/// (this repository's `.venv`, which holds torch 2.11.0, stands in for the user's), the
/// `accel` command installed from the repository by git URL with its lock file (a `file://`
/// clone stands in for the public one; the lock also lets it share the compiled torch-sys of
/// the other tests' crates, whose C++ takes minutes to build), `cargo new`, `cargo add` from
/// the registry (no lock file borrowed), `accel setup`, `cargo build`, the one line on the
/// user's function — run on 2 processes it ends with the weights of 1 process with twice the
/// batch. Beyond the page: `--debug` and one shared target folder, so that the builds share
/// their compiled dependencies.
#[test]
fn the_documented_route_from_an_empty_folder_trains_on_2_processes_as_on_1() {
    let home = std::env::temp_dir().join(format!("accel-route-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&home);
    std::fs::create_dir_all(&home).unwrap();
    let run = |dir: &Path, program: &Path, args: &[&str], env: &[(&str, &Path)]| -> String {
        let mut command = Command::new(program);
        command.current_dir(dir).args(args).env_remove("LIBTORCH").env_remove("RUSTFLAGS");
        // Outside this repository: the system's linker, as a user's (unless one is set).
        command.env_remove(LINKER_ENV);
        command.env("CARGO_TARGET_DIR", shared_target());
        for (k, v) in env {
            command.env(k, v);
        }
        let output = command.output().unwrap();
        let said = format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        assert!(output.status.success(), "{} {args:?} failed:\n{said}", program.display());
        said
    };
    let cargo = Path::new(env!("CARGO"));
    // The public repository's stand-in.
    let remote = home.join("accel.git");
    let git = Path::new("git");
    run(
        &home,
        git,
        &["clone", "--quiet", "--bare", root().to_str().unwrap(), remote.to_str().unwrap()],
        &[],
    );
    let url = format!("file://{}", remote.display());

    // 1. libtorch: the Python environment's torch, named as the page says.
    let python = root().join(".venv/bin/python");
    let find = "import os, torch; print(os.path.dirname(torch.__file__))";
    let libtorch = run(&home, &python, &["-c", find], &[]).trim().to_owned();
    let libtorch = PathBuf::from(libtorch);
    let with_libtorch = [("LIBTORCH", libtorch.as_path())];

    // 2. The accel command.
    let bin = home.join("cargo-bin");
    run(
        &home,
        cargo,
        &[
            "install",
            "--quiet",
            "--locked",
            "--git",
            &url,
            "accel-core",
            "--bin",
            "accel",
            "--debug",
            "--root",
            bin.to_str().unwrap(),
        ],
        &with_libtorch,
    );
    let accel = bin.join("bin/accel");

    // 3. The crate.
    run(&home, cargo, &["new", "--quiet", "my-trainer"], &[]);
    let dir = home.join("my-trainer");
    run(&dir, cargo, &["add", "--quiet", "--git", &url, "accel-core"], &[]);
    run(&dir, cargo, &["add", "--quiet", "tch@=0.24.0", "anyhow"], &[]);
    let said = run(&dir, &accel, &["setup"], &with_libtorch);
    assert!(said.contains("using LIBTORCH=") && said.contains("Commit build.rs"), "{said}");
    let ignored = std::fs::read_to_string(dir.join(".gitignore")).unwrap();
    assert!(ignored.contains("/.cargo/config.toml"), "{ignored}");
    assert!(dir.join("build.rs").exists());

    // 4. The one line, built with plain cargo, on 1 process and 2.
    std::fs::write(dir.join("src/main.rs"), ROUTE_MAIN_RS).unwrap();
    run(&dir, cargo, &["build", "--quiet"], &[]);
    let program = shared_target().join("debug/my-trainer");
    let weights = |processes: &str, batch: &str| {
        let out = home.join(format!("weights-{processes}.safetensors"));
        let launch = [
            "launch",
            "--num-processes",
            processes,
            "--cpu",
            "--main-process-port",
            "0",
            program.to_str().unwrap(),
            batch,
            out.to_str().unwrap(),
        ];
        run(&dir, &accel, &launch, &[]);
        let mut named = tch::Tensor::read_safetensors(&out).unwrap();
        named.sort_by(|a, b| a.0.cmp(&b.0));
        named
    };
    let (one, two) = (weights("1", "16"), weights("2", "8"));
    assert_eq!(one.len(), 4);
    for ((name, a), (_, b)) in one.iter().zip(&two) {
        let diff = (a - b).abs().max().double_value(&[]);
        assert!(diff <= 1e-6, "{name}: 2 processes differ from 1 by {diff}");
    }
    let _ = std::fs::remove_dir_all(&home);
}
