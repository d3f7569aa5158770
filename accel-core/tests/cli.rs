//! The built `accel` binary: runs without LD_LIBRARY_PATH and keeps libtorch (and with it
//! libtorch_cuda, the library that makes GPUs visible) among its needed libraries.

use std::path::Path;
use std::process::Command;

fn readelf_dynamic(binary: &Path) -> String {
    let output = Command::new("readelf")
        .arg("-d")
        .arg(binary)
        .output()
        .expect("readelf (binutils) is needed for this test; apt-get install binutils");
    assert!(output.status.success(), "readelf -d {} failed", binary.display());
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn needed(dynamic: &str) -> Vec<String> {
    dynamic
        .lines()
        .filter(|l| l.contains("(NEEDED)"))
        .filter_map(|l| l.split('[').nth(1).map(|s| s.trim_end_matches(']').to_owned()))
        .collect()
}

#[test]
fn accel_env_runs_without_ld_library_path() {
    let output = Command::new(env!("CARGO_BIN_EXE_accel"))
        .arg("env")
        .env_remove("LD_LIBRARY_PATH")
        .env("RANK", "3")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "accel env failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        stdout.contains(&format!("libtorch              {}", accel_core::shim::torch_version())),
        "{stdout}"
    );
    assert!(stdout.contains("RANK=3"), "distributed variables missing:\n{stdout}");
    for key in ["CUDA available", "NCCL", "CPU", "torch threads", "NVIDIA driver"] {
        assert!(stdout.contains(key), "`{key}` missing:\n{stdout}");
    }
    let lib = accel_core::cuda::libtorch_lib_dir();
    if lib.join("libtorch_cuda.so").exists() {
        assert!(
            stdout.contains("libtorch_cuda.so      linked"),
            "libtorch_cuda not linked:\n{stdout}"
        );
    }
}

#[test]
fn accel_binary_needs_libtorch_and_carries_an_rpath_to_it() {
    let dynamic = readelf_dynamic(Path::new(env!("CARGO_BIN_EXE_accel")));
    let needed = needed(&dynamic);
    assert!(needed.iter().any(|n| n == "libtorch.so"), "libtorch.so not needed: {needed:?}");
    let lib = accel_core::cuda::libtorch_lib_dir();
    let rpath_line = dynamic.lines().find(|l| l.contains("RUNPATH") || l.contains("RPATH"));
    let rpath_line = rpath_line.unwrap_or_else(|| panic!("no rpath in:\n{dynamic}"));
    let points_at_libtorch = rpath_line
        .split(['[', ']', ':'])
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .any(|p| Path::new(p).canonicalize().ok() == lib.canonicalize().ok());
    assert!(points_at_libtorch, "rpath {rpath_line} does not reach {}", lib.display());
}

#[test]
fn this_test_binary_links_libtorch_cuda_when_libtorch_has_it() {
    let lib = accel_core::cuda::libtorch_lib_dir();
    let state = accel_core::cuda::load_libtorch_cuda();
    if lib.join("libtorch_cuda.so").exists() {
        assert!(
            matches!(state, accel_core::cuda::LibtorchCuda::Linked(_)),
            "libtorch_cuda.so exists but was not linked: {state:?}"
        );
    } else {
        assert!(matches!(state, accel_core::cuda::LibtorchCuda::NotShipped(_)), "{state:?}");
    }
}

#[test]
fn asking_for_cuda_without_it_is_a_clear_error() {
    match accel_core::cuda::check_device(tch::Device::Cuda(0)) {
        Ok(_) => assert!(tch::Cuda::is_available()),
        Err(e) => {
            let text = e.to_string();
            assert!(!tch::Cuda::is_available());
            assert!(
                text.starts_with("CUDA was requested (device cuda:0) but is not available: "),
                "{text}"
            );
            assert!(text.len() > 80, "the diagnosis says too little: {text}");
        }
    }
    assert_eq!(accel_core::cuda::check_device(tch::Device::Cpu).unwrap(), tch::Device::Cpu);
}

#[test]
fn estimate_memory_reads_a_safetensors_header() {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"));
    let path = dir.join("estimate.safetensors");
    let w = tch::Tensor::zeros([1000, 500], (tch::Kind::Float, tch::Device::Cpu));
    let b = tch::Tensor::zeros([500], (tch::Kind::Float, tch::Device::Cpu));
    tch::Tensor::write_safetensors(&[("w", &w), ("b", &b)], &path).unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_accel"))
        .arg("estimate-memory")
        .arg(&path)
        .args(["--num-processes", "2"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    assert!(stdout.contains("for 500500 parameters"), "{stdout}");
    // DDP with AdamW: 16 bytes per parameter.
    let ddp = stdout.lines().find(|l| l.starts_with("ddp")).unwrap();
    assert!(ddp.trim_end().ends_with("7.64 MiB"), "{ddp}");
    let err = Command::new(env!("CARGO_BIN_EXE_accel")).args(["estimate-memory"]).output().unwrap();
    assert!(String::from_utf8_lossy(&err.stderr).contains("--params N"));
}

#[test]
fn plot_draws_any_runs_metrics_and_compare_weights_tells_files_apart() {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("plot");
    std::fs::create_dir_all(&dir).unwrap();
    let metrics = dir.join("metrics.jsonl");
    std::fs::write(&metrics, "{\"step\":1,\"loss\":2.0}\n{\"step\":2,\"loss\":1.0}\n").unwrap();
    let output =
        Command::new(env!("CARGO_BIN_EXE_accel")).arg("plot").arg(&metrics).output().unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    for written in ["metrics.png", "metrics.svg"] {
        assert!(std::fs::metadata(dir.join(written)).unwrap().len() > 1000, "{written}");
    }
    std::fs::write(&metrics, "not json\n").unwrap();
    let output =
        Command::new(env!("CARGO_BIN_EXE_accel")).arg("plot").arg(&metrics).output().unwrap();
    assert!(String::from_utf8_lossy(&output.stderr).contains("line 1: not a JSON record"));

    let (a, b) = (dir.join("a.safetensors"), dir.join("b.safetensors"));
    let w = tch::Tensor::ones([3], (tch::Kind::Float, tch::Device::Cpu));
    tch::Tensor::write_safetensors(&[("w", &w)], &a).unwrap();
    tch::Tensor::write_safetensors(&[("w", &(&w + 1e-3))], &b).unwrap();
    let compare = |tolerance: &str| {
        Command::new(env!("CARGO_BIN_EXE_accel"))
            .arg("compare-weights")
            .args([&a, &b])
            .args(["--tolerance", tolerance])
            .output()
            .unwrap()
    };
    let close = compare("1e-2");
    assert!(close.status.success(), "{}", String::from_utf8_lossy(&close.stdout));
    let far = compare("1e-4");
    assert!(!far.status.success());
    assert!(String::from_utf8_lossy(&far.stdout).contains("w: max |difference| 1.000e-3 OVER"));
}

#[test]
fn profile_summary_reads_a_folder_of_traces() {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("profile-summary");
    std::fs::create_dir_all(&dir).unwrap();
    let event = |name: &str, ts: u64, dur: u64| {
        format!(r#"{{"ph":"X","name":"{name}","ts":{ts},"dur":{dur},"pid":1,"tid":1}}"#)
    };
    let trace = format!(
        r#"{{"traceEvents":[{},{},{}]}}"#,
        event("accel::forward", 0, 1000),
        event("accel::backward", 1000, 2000),
        event("accel::optimizer_step", 3000, 500)
    );
    std::fs::write(dir.join("trace_rank0.json"), trace).unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_accel"))
        .args(["profile", "summary"])
        .arg(&dir)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    assert!(stdout.contains("1 step(s) in 3.5 ms of training thread"), "{stdout}");
    assert!(stdout.contains("backward                             2.00"), "{stdout}");
}
