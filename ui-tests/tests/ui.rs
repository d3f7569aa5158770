//! `#[accelerate]` compile errors (`fail/<topic>/*.rs`, each with the `.stderr` it must
//! produce) and the shapes of training function it accepts (`pass/*.rs`, built into the
//! `shapes` example), each trained on 1 and on 2 processes.
//!
//! After an intended change of messages: `TRYBUILD=overwrite cargo test -p accel-ui-tests`,
//! then review the diff.

use std::path::{Path, PathBuf};
use std::process::Command;

use accel_core::launch::{LaunchPlan, run};
use tch::Tensor;

/// Set in the process [`ui`] starts to run trybuild.
const TRYBUILD_CHILD: &str = "ACCEL_UI_TRYBUILD_CHILD";

/// trybuild checks its dependencies with one set of rustflags, then the cases with another
/// (it adds `--diagnostic-width=140`): every dependency, and the C++ of torch-sys and
/// accel-core, was built twice. The same flags for both, through `CARGO_ENCODED_RUSTFLAGS`
/// (which takes precedence over the `--config` flags trybuild passes), build them once; the
/// flags are trybuild's own. Set in a child process of this test binary, so that no thread
/// of this process changes the environment while others read it.
#[test]
fn ui() {
    if std::env::var_os(TRYBUILD_CHILD).is_some() {
        let t = trybuild::TestCases::new();
        t.compile_fail("fail/*/*.rs");
        return;
    }
    let flags = ["--cfg", "trybuild", "--verbose", "-A", "dead_code", "--diagnostic-width=140"];
    let status = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "ui", "--nocapture", "--test-threads", "1"])
        .env(TRYBUILD_CHILD, "1")
        .env("CARGO_ENCODED_RUSTFLAGS", flags.join("\x1f"))
        .status()
        .unwrap();
    assert!(status.success(), "trybuild's compile-fail cases failed (their report is above)");
}

fn shapes_program() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let path = exe.parent().unwrap().parent().unwrap().join("examples").join("shapes");
    assert!(path.exists(), "{} is missing: `cargo test` builds the examples first", path.display());
    path
}

fn run_once(name: &str, batch: i64, epochs: usize, dir: &Path) -> Result<(), String> {
    let out = Command::new(shapes_program())
        .args([name, &batch.to_string(), &epochs.to_string(), &dir.display().to_string()])
        .env_remove("ACCEL_CONFIG_FILE")
        .output()
        .map_err(|e| e.to_string())?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("1 process: {}", String::from_utf8_lossy(&out.stderr)))
    }
}

fn run_on_two(name: &str, batch: i64, epochs: usize, dir: &Path) -> Result<(), String> {
    let program = vec![
        shapes_program().display().to_string(),
        name.into(),
        batch.to_string(),
        epochs.to_string(),
        dir.display().to_string(),
    ];
    let plan = LaunchPlan {
        env: vec![("ACCEL_TIMEOUT_SECS".into(), "60".into())],
        ..LaunchPlan::local(2, program)
    };
    match run(&plan) {
        Ok(0) => Ok(()),
        Ok(code) => Err(format!("2 processes: exit code {code}")),
        Err(e) => Err(format!("2 processes: {e}")),
    }
}

fn read(path: &Path) -> Vec<(String, Tensor)> {
    let mut all = Tensor::read_safetensors(path).unwrap();
    all.sort_by(|a, b| a.0.cmp(&b.0));
    all
}

/// The largest difference between two sets of weights, checking that the names agree.
fn max_diff(a: &[(String, Tensor)], b: &[(String, Tensor)]) -> Result<f64, String> {
    let names = |w: &[(String, Tensor)]| w.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
    if names(a) != names(b) {
        return Err(format!("different variables: {:?} vs {:?}", names(a), names(b)));
    }
    Ok(a.iter()
        .zip(b)
        .map(|((_, x), (_, y))| (x - y).abs().max().double_value(&[]))
        .fold(0.0, f64::max))
}

/// Shapes whose 2-process run is not one process with twice the batch: plain batch norm
/// normalises each process's batch by its own statistics (torch's DDP does the same). Their
/// ranks must still agree on every variable, running statistics included.
const RANKS_AGREE_ONLY: &[&str] = &["batch_norm_buffers_agree"];

/// One shape: it trains (its weights move), both ranks of a 2-process run end equal on
/// every variable (buffers too), and equal to one process with twice the batch. A function
/// whose optimizer the attribute did not prepare trains one model per process, and fails
/// here.
fn check_shape(name: &str, root: &Path) -> Result<(), String> {
    let (start, one, two) = (root.join("start"), root.join("one"), root.join("two"));
    run_once(name, 16, 0, &start)?;
    run_once(name, 16, 2, &one)?;
    run_on_two(name, 8, 2, &two)?;
    let start = read(&start.join("rank0.safetensors"));
    let one = read(&one.join("rank0.safetensors"));
    let (rank0, rank1) =
        (read(&two.join("rank0.safetensors")), read(&two.join("rank1.safetensors")));
    let moved = max_diff(&start, &one)?;
    if moved < 1e-3 {
        return Err(format!("did not train: the weights moved by {moved:e}"));
    }
    let ranks = max_diff(&rank0, &rank1)?;
    if ranks > 1e-6 {
        return Err(format!("the 2 processes ended with different weights (by {ranks:e})"));
    }
    if RANKS_AGREE_ONLY.contains(&name) {
        return Ok(());
    }
    let parity = max_diff(&one, &rank0)?;
    if parity > 1e-6 {
        return Err(format!(
            "2 processes differ from 1 process with twice the batch by {parity:e}"
        ));
    }
    Ok(())
}

#[test]
fn every_accepted_shape_trains_one_model_on_2_processes_equal_to_1_process() {
    let listed = Command::new(shapes_program()).arg("list").output().unwrap();
    let names: Vec<String> =
        String::from_utf8(listed.stdout).unwrap().lines().map(str::to_owned).collect();
    assert!(names.len() >= 20, "only {} shapes listed", names.len());
    let root = Path::new(env!("CARGO_TARGET_TMPDIR")).join("shapes");
    let _ = std::fs::remove_dir_all(&root);
    let failures: Vec<String> = names
        .iter()
        .filter_map(|name| {
            check_shape(name, &root.join(name)).err().map(|e| format!("{name}: {e}"))
        })
        .collect();
    assert!(
        failures.is_empty(),
        "{} of {} shapes failed:\n{}",
        failures.len(),
        names.len(),
        failures.join("\n")
    );
}

/// A free TCP port on loopback (and the one after it, which accel's store takes under
/// torchrun-style variables).
fn free_port() -> u16 {
    loop {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        if port < u16::MAX && std::net::TcpListener::bind(("127.0.0.1", port + 1)).is_ok() {
            return port;
        }
    }
}

#[test]
fn the_explicit_api_refuses_to_train_one_model_per_process() {
    let cases = [
        ("prepare_model", "no prepared model"),
        ("prepare_optimizer", "was not prepared by the accelerator"),
        ("the_trained_model", "belong to no model the accelerator prepared"),
        ("tensor_parallel_of_ordinary_layers", "this model has no tensor-parallel layers"),
        ("backward_outside_the_pipeline", "only a pipeline step passes activations"),
        ("prepare_data", "did not come through a prepared data loader"),
        ("variables_released_by_zero3", "call `accelerator.full_state_dict(&vs)?`"),
        ("gradients_read_by_hand_zero2", "Clip with the optimizer's `opt.clip_grad_norm(max)`"),
        ("gradients_read_by_hand_zero3", "Clip with the optimizer's `opt.clip_grad_norm(max)`"),
        (
            "gradients_read_by_hand_accumulating",
            "Clip with the optimizer's `opt.clip_grad_norm(max)`",
        ),
    ];
    for (case, expected) in cases {
        let port = free_port().to_string();
        let start = std::time::Instant::now();
        let children: Vec<_> = (0..2)
            .map(|rank| {
                Command::new(shapes_program())
                    .args(["forgotten", case])
                    .env("RANK", rank.to_string())
                    .env("LOCAL_RANK", rank.to_string())
                    .env("WORLD_SIZE", "2")
                    .env("LOCAL_WORLD_SIZE", "2")
                    .env("MASTER_ADDR", "127.0.0.1")
                    .env("MASTER_PORT", &port)
                    .env("ACCEL_TIMEOUT_SECS", "20")
                    .stdout(std::process::Stdio::piped())
                    .stderr(std::process::Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect();
        for (rank, child) in children.into_iter().enumerate() {
            let out = child.wait_with_output().unwrap();
            let text = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success(), "{case}: rank {rank} succeeded");
            assert!(text.contains(expected), "{case}: rank {rank} said:\n{text}");
        }
        assert!(start.elapsed().as_secs() < 20, "{case} took {:?}", start.elapsed());
    }
}
