//! `accel launch`, `accel test` and multi-process runs, with real processes: failures are
//! reported within bounded time and leave no process behind.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn accel() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_accel"));
    c.env_remove("RANK").env_remove("WORLD_SIZE").env("ACCEL_CONFIG_DIR", scratch("no-config"));
    c
}

fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("launch").join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn text(output: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

fn alive(pid: i32) -> bool {
    // SAFETY: signal 0 only checks for existence.
    unsafe { libc::kill(pid, 0) == 0 }
}

#[test]
fn accel_test_passes_on_2_3_and_4_processes() {
    for n in ["2", "3", "4"] {
        let output = accel()
            .args(["test", "--main-process-port", "0", "--num-processes", n])
            .output()
            .unwrap();
        let out = text(&output);
        assert!(output.status.success(), "{out}");
        assert_eq!(out.matches("PASS").count(), 8, "{out}");
        assert!(out.contains(&format!("{n} processes (accel launch)")), "{out}");
    }
}

#[test]
fn a_failing_rank_is_named_with_its_exit_code_and_last_lines() {
    let script = "echo starting rank $RANK; if [ $RANK = 1 ]; then echo about to fail >&2; exit 3; fi; sleep 60";
    let start = Instant::now();
    let output = accel()
        .args(["launch", "--num-processes", "3", "--main-process-port", "0", "sh", "-c", script])
        .output()
        .unwrap();
    let out = text(&output);
    assert_eq!(output.status.code(), Some(3), "{out}");
    assert!(start.elapsed() < Duration::from_secs(20), "took {:?}", start.elapsed());
    assert!(out.contains("rank 1 (pid") && out.contains("exited with code 3"), "{out}");
    assert!(out.contains("    | about to fail"), "{out}");
    assert!(out.contains("[rank0] starting rank 0"), "{out}");
}

#[test]
fn the_report_names_the_rank_that_caused_a_failure_not_the_one_that_lost_it_first() {
    // Rank 0 is seen failing first, with the collectives' words for a vanished peer; the
    // cause is rank 1, which fails a moment later with an error of its own.
    let script = "if [ $RANK = 0 ]; then echo 'Error: collective #3 all_reduce [4] Float on rank 0: \
                  lost the connection to rank 1 (reset); it has probably exited' >&2; exit 1; fi; \
                  sleep 0.5; echo 'Error: cannot read shard data/part-1.bin' >&2; exit 4";
    let output = accel()
        .args(["launch", "--num-processes", "2", "--main-process-port", "0", "sh", "-c", script])
        .output()
        .unwrap();
    let out = text(&output);
    assert_eq!(output.status.code(), Some(4), "{out}");
    assert!(
        out.contains("accel launch: rank 1 (pid") && out.contains("exited with code 4"),
        "{out}"
    );
    assert!(out.contains("    | Error: cannot read shard data/part-1.bin"), "{out}");
    assert!(out.contains("rank(s) 0 then failed because they lost their connection"), "{out}");
}

#[test]
fn kill_9_in_a_collective_stops_the_run_within_30_s_and_leaves_no_process() {
    let pids = scratch("kill9");
    let launcher = accel()
        .args(["launch", "--num-processes", "3", "--main-process-port", "0"])
        .arg(env!("CARGO_BIN_EXE_accel"))
        .args(["worker", "spin"])
        .env("ACCEL_PID_DIR", &pids)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let read = |r: usize| {
        std::fs::read_to_string(pids.join(r.to_string())).ok().and_then(|p| p.parse::<i32>().ok())
    };
    while (0..3).any(|r| read(r).is_none()) {
        assert!(Instant::now() < deadline, "the ranks never started");
        std::thread::sleep(Duration::from_millis(50));
    }
    let ranks: Vec<i32> = (0..3).map(|r| read(r).unwrap()).collect();
    std::thread::sleep(Duration::from_millis(300)); // well inside the all-reduce loop
    let killed_at = Instant::now();
    // SAFETY: a pid of one of our grandchildren.
    unsafe { libc::kill(ranks[1], libc::SIGKILL) };
    let output = launcher.wait_with_output().unwrap();
    let out = text(&output);
    assert!(killed_at.elapsed() < Duration::from_secs(30), "took {:?}", killed_at.elapsed());
    assert_eq!(output.status.code(), Some(128 + 9), "{out}");
    assert!(out.contains("rank 1") && out.contains("killed by signal 9 (SIGKILL)"), "{out}");
    std::thread::sleep(Duration::from_millis(200));
    for pid in ranks {
        assert!(!alive(pid), "process {pid} is still running");
    }
}

#[test]
fn a_rank_that_never_starts_is_a_timeout_naming_it() {
    // Only rank 0 of 2 runs (torchrun-style variables, no launcher).
    let start = Instant::now();
    let port = accel_core::comm::free_port("127.0.0.1").unwrap();
    let output = accel()
        .args(["worker", "test"])
        .env("RANK", "0")
        .env("WORLD_SIZE", "2")
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("ACCEL_TIMEOUT_SECS", "2")
        .output()
        .unwrap();
    let out = text(&output);
    assert!(!output.status.success());
    assert!(out.contains("rank(s) [1] of 2 never arrived"), "{out}");
    assert!(start.elapsed() < Duration::from_secs(15), "took {:?}", start.elapsed());
}

#[test]
fn a_master_port_in_use_is_a_clear_error() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let output = accel()
        .args(["launch", "--num-processes", "2", "--main-process-port", &port, "true"])
        .output()
        .unwrap();
    let out = text(&output);
    assert!(!output.status.success());
    assert!(out.contains(&format!("port {port} on 127.0.0.1 is already in use")), "{out}");
}

#[test]
fn torchrun_style_variables_work_without_the_launcher() {
    let port = accel_core::comm::free_port("127.0.0.1").unwrap().to_string();
    let children: Vec<_> = (0..2)
        .map(|rank| {
            accel()
                .args(["worker", "test"])
                .env("RANK", rank.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("WORLD_SIZE", "2")
                .env("LOCAL_WORLD_SIZE", "2")
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let outputs: Vec<Output> =
        children.into_iter().map(|c| c.wait_with_output().unwrap()).collect();
    for o in &outputs {
        assert!(o.status.success(), "{}", text(o));
    }
    let out = text(&outputs[0]);
    assert!(
        out.contains("2 processes (RANK/WORLD_SIZE)") && out.contains("all checks passed"),
        "{out}"
    );
}

/// A port P free together with P + 1 (torchrun's store takes P, accel's P + 1). P is odd:
/// Linux hands odd ports to outgoing connections first, so the even P + 1 is the one less
/// likely to be taken by one meanwhile.
fn free_port_pair() -> u16 {
    for _ in 0..1000 {
        let Ok(first) = std::net::TcpListener::bind(("127.0.0.1", 0)) else { continue };
        let port = first.local_addr().unwrap().port();
        if port % 2 == 1 && std::net::TcpListener::bind(("127.0.0.1", port + 1)).is_ok() {
            return port;
        }
    }
    panic!("no pair of free ports found");
}

#[test]
fn torchrun_itself_can_launch_accel_programs() {
    let torchrun = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/torchrun");
    assert!(torchrun.exists(), "{} is missing: run `cargo xtask setup`", torchrun.display());
    let port = free_port_pair();
    let output = Command::new(torchrun)
        .args(["--no-python", "--nproc-per-node", "2", &format!("--master-port={port}")])
        .arg(env!("CARGO_BIN_EXE_accel"))
        .args(["worker", "test"])
        .output()
        .unwrap();
    let out = text(&output);
    assert!(output.status.success(), "{out}");
    assert!(out.contains("2 processes (torchrun)") && out.contains("all checks passed"), "{out}");
}

#[test]
fn sigterm_to_the_launcher_stops_every_process() {
    let pids = scratch("sigterm");
    let mut launcher = accel()
        .args([
            "launch",
            "--num-processes",
            "2",
            "--main-process-port",
            "0",
            "--grace",
            "2",
            "sh",
            "-c",
        ])
        .arg("echo $$ > $ACCEL_PID_DIR/$RANK; trap '' TERM; sleep 60 & wait")
        .env("ACCEL_PID_DIR", &pids)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let read = |r: usize| {
        std::fs::read_to_string(pids.join(r.to_string()))
            .ok()
            .and_then(|p| p.trim().parse::<i32>().ok())
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while (0..2).any(|r| read(r).is_none()) {
        assert!(Instant::now() < deadline, "the ranks never started");
        std::thread::sleep(Duration::from_millis(50));
    }
    // SAFETY: the launcher is our child.
    unsafe { libc::kill(launcher.id() as i32, libc::SIGTERM) };
    let status = launcher.wait().unwrap();
    assert_eq!(status.code(), Some(130));
    for pid in (0..2).map(|r| read(r).unwrap()) {
        assert!(
            !alive(pid),
            "rank process {pid} survived (it ignores SIGTERM: SIGKILL must follow)"
        );
    }
}

#[test]
fn max_restarts_restarts_the_group() {
    let output = accel()
        .args(["launch", "--num-processes", "2", "--main-process-port", "0", "--max-restarts", "1", "sh", "-c"])
        .arg("if [ $ACCEL_RESTART_COUNT = 0 ] && [ $RANK = 1 ]; then exit 5; fi; echo attempt $ACCEL_RESTART_COUNT ok")
        .output()
        .unwrap();
    let out = text(&output);
    assert!(output.status.success(), "{out}");
    assert!(out.contains("restarting all processes in 1 s (restart 1 of 1)"), "{out}");
    assert!(out.contains("[rank1] attempt 1 ok"), "{out}");
}

#[test]
fn training_settings_reach_the_program_and_config_files_are_read() {
    let dir = scratch("config");
    std::fs::write(
        dir.join("c.yaml"),
        "num_processes: 2\nmixed_precision: bf16\ngradient_accumulation_steps: 4\n",
    )
    .unwrap();
    let output = accel()
        .args(["launch", "--config-file"])
        .arg(dir.join("c.yaml"))
        .args([
            "--main-process-port",
            "0",
            "--accumulate",
            "8",
            "sh",
            "-c",
            "echo $RANK/$WORLD_SIZE $ACCEL_PRECISION $ACCEL_ACCUMULATE",
        ])
        .output()
        .unwrap();
    let out = text(&output);
    assert!(out.contains("[rank1] 1/2 bf16 8"), "flag > file: {out}");
    std::fs::write(dir.join("bad.yaml"), "num_proceses: 2\n").unwrap();
    let output = accel()
        .args(["launch", "--config-file"])
        .arg(dir.join("bad.yaml"))
        .args(["true"])
        .output()
        .unwrap();
    assert!(text(&output).contains("did you mean `num_processes`"), "{}", text(&output));
}

#[test]
fn ddp_through_the_accelerator_on_2_and_3_processes() {
    for n in ["2", "3"] {
        let output = accel()
            .args(["launch", "--num-processes", n, "--main-process-port", "0", "--rank0-only"])
            .arg(env!("CARGO_BIN_EXE_accel"))
            .args(["worker", "ddp"])
            .output()
            .unwrap();
        let out = text(&output);
        assert!(output.status.success(), "{out}");
        assert!(!out.contains("FAIL"), "{out}");
        let expected = if n == "2" { 10 } else { 9 };
        assert_eq!(out.matches("PASS").count(), expected, "{out}");
    }
}

#[test]
fn the_nccl_check_fails_clearly_without_a_gpu() {
    let output = accel()
        .args(["launch", "--num-processes", "2", "--main-process-port", "0", "--timeout", "20"])
        .arg(env!("CARGO_BIN_EXE_accel"))
        .args(["worker", "nccl"])
        .output()
        .unwrap();
    let out = text(&output);
    if tch::Cuda::device_count() >= 2 {
        assert!(output.status.success() && !out.contains("FAIL"), "{out}");
    } else {
        assert!(!output.status.success());
        assert!(out.contains("CUDA was requested (device cuda:"), "{out}");
    }
}

/// Each fallback of the single-copy path, forced: the kernel refusing the ranks each other's
/// memory (no CAP_SYS_PTRACE, not dumpable: a hardened container), and the path switched off
/// by hand. The collectives' values are checked by `accel test` itself under TCP; the run
/// says which transport it used and why.
#[test]
fn accel_test_passes_over_tcp_when_memory_reads_are_denied_or_disabled_and_says_why() {
    let run = |key: &str, value: &str| {
        let output = accel()
            .args(["test", "--main-process-port", "0", "--num-processes", "2"])
            .env(key, value)
            .output()
            .unwrap();
        let out = text(&output);
        assert!(output.status.success(), "{out}");
        assert_eq!(out.matches("PASS").count(), 8, "{out}");
        out
    };
    let denied = run("ACCEL_TEST_FAULT", "deny-memory-reads");
    assert!(
        denied.contains("transport TCP (the processes on this machine cannot read each other's memory (reading rank"),
        "{denied}"
    );
    assert!(denied.contains("Operation not permitted"), "{denied}");
    assert!(
        denied.contains("accel: the processes on this machine cannot read"),
        "the warning: {denied}"
    );
    let disabled = run("ACCEL_DISABLE_CMA", "1");
    assert!(
        disabled.contains("transport TCP (direct copies are off: ACCEL_DISABLE_CMA is set)"),
        "{disabled}"
    );
    let normal = run("ACCEL_UNUSED", "");
    assert!(normal.contains("transport direct copies"), "{normal}");
}

/// The keys a config file has, read without accel: a YAML's top-level keys and the keys of
/// its sections (`section.key`), a JSON's leaves (`a.b.c`).
fn keys_of(file: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(file).unwrap();
    if file.extension().is_some_and(|e| e == "json") {
        fn leaves(prefix: &str, v: &serde_json::Value, out: &mut Vec<String>) {
            match v.as_object() {
                Some(m) if !m.is_empty() => {
                    for (k, sv) in m {
                        let key =
                            if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
                        leaves(&key, sv, out);
                    }
                }
                _ => out.push(prefix.to_owned()),
            }
        }
        let mut out = Vec::new();
        leaves("", &serde_json::from_str(&text).unwrap(), &mut out);
        return out;
    }
    let mut out = Vec::new();
    let mut section = None;
    for line in text.lines() {
        let code = line.split(" #").next().unwrap_or("").trim_end();
        if code.trim_start().starts_with('#') || !code.contains(':') {
            continue;
        }
        let key = code.trim_start().split(':').next().unwrap().to_owned();
        if !code.starts_with(' ') {
            // A section (`fsdp_config:` and its indented keys) is named by its keys.
            let section_header = code.trim_end().ends_with(':');
            if !section_header {
                out.push(key.clone());
            }
            section = section_header.then_some(key);
        } else if let Some(s) = &section {
            out.push(format!("{s}.{key}"));
        }
    }
    out
}

#[test]
fn every_key_of_accelerates_config_files_is_named() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/configs/accelerate");
    let mut files = Vec::new();
    for dir in [
        "examples/config_yaml_templates",
        "examples/deepspeed_config_templates",
        "tests/test_configs",
    ] {
        for entry in std::fs::read_dir(root.join(dir)).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "yaml" || e == "json") {
                files.push(path);
            }
        }
    }
    files.sort();
    assert_eq!(files.len(), 21);
    // What accel refuses in Accelerate's own files, and why; every other file launches.
    let refused = [
        ("fp8.yaml", "fp8_config.backend"),
        ("0_34_0_fp8.yaml", "fp8_config.backend"),
        ("multi_xpu.yaml", "distributed_type"),
        ("0_28_0_mpi.yaml", "mpirun_config.mpirun_hostfile"),
        ("0_30_0_sagemaker.yaml", "compute_environment"),
        ("invalid_keys.yaml", "invalid_key"),
    ];
    for file in &files {
        let output = accel().args(["config", "check"]).arg(file).output().unwrap();
        let out = text(&output);
        let name = file.file_name().unwrap().to_str().unwrap();
        let mut expected = keys_of(file);
        // A YAML naming a DeepSpeed JSON: the JSON's keys too, after its name.
        if let Some(line) = std::fs::read_to_string(file)
            .unwrap()
            .lines()
            .find(|l| l.trim_start().starts_with("deepspeed_config_file:"))
        {
            let json = line.split(':').nth(1).unwrap().split('#').next().unwrap().trim();
            let path = file.parent().unwrap().join(json);
            let json_name = path.file_name().unwrap().to_str().unwrap().to_owned();
            if path.exists() {
                expected.extend(keys_of(&path).into_iter().map(|k| format!("{json_name}: {k}")));
            }
        }
        assert!(!expected.is_empty(), "{name}");
        for key in &expected {
            assert!(
                out.lines().any(|l| l.starts_with(&format!("{key} = "))),
                "{name}: `{key}` is not named:\n{out}"
            );
        }
        match refused.iter().find(|(f, _)| *f == name) {
            Some((_, key)) => {
                assert!(!output.status.success(), "{name}:\n{out}");
                let line = out.lines().find(|l| l.starts_with(&format!("{key} = "))).unwrap();
                assert!(line.contains(" refused "), "{name}: {line}");
                assert!(out.contains("accel launch refuses"), "{name}:\n{out}");
            }
            None => {
                assert!(output.status.success(), "{name}:\n{out}");
                assert!(out.contains(" 0 refused") && out.contains("accel launch takes"), "{out}");
            }
        }
    }
    // What the keys become reaches the program: Accelerate's FSDP and DeepSpeed templates.
    let dir = root.join("examples/config_yaml_templates");
    let show = "echo $ACCEL_STRATEGY $ACCEL_PRECISION $ACCEL_OFFLOAD $ACCEL_SYNC_MODULE_STATES \
                $ACCEL_STATE_DICT $ACCEL_WRAP $ACCEL_ACTIVATION_CHECKPOINTING";
    let output = accel()
        .args(["launch", "--main-process-port", "0", "--config-file"])
        .arg(dir.join("fsdp.yaml"))
        .args(["sh", "-c", show])
        .output()
        .unwrap();
    let out = text(&output);
    assert!(output.status.success(), "{out}");
    assert!(out.contains("[rank1] zero3 bf16 false true sharded layers false"), "{out}");
    let output = accel()
        .args(["launch", "--main-process-port", "0", "--config-file"])
        .arg(dir.join("deepspeed.yaml"))
        .args(["sh", "-c", "echo $ACCEL_STRATEGY $ACCEL_PRECISION"])
        .output()
        .unwrap();
    let out = text(&output);
    assert!(output.status.success(), "{out}");
    assert!(out.contains("[rank1] zero1 fp16"), "{out}");
    assert!(out.contains("not followed") && out.contains("optimizer.type"), "warned: {out}");
}

#[test]
fn config_update_rewrites_accelerates_keys_as_accels_and_keeps_the_original() {
    let dir = scratch("update");
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/configs/accelerate");
    let file = dir.join("latest_fsdp.yaml");
    std::fs::copy(root.join("tests/test_configs/latest_fsdp.yaml"), &file).unwrap();
    let original = std::fs::read_to_string(&file).unwrap();
    let output = accel().args(["config", "update"]).arg(&file).output().unwrap();
    assert!(output.status.success(), "{}", text(&output));
    assert_eq!(std::fs::read_to_string(dir.join("latest_fsdp.yaml.orig")).unwrap(), original);
    let updated = std::fs::read_to_string(&file).unwrap();
    for line in ["strategy: zero3", "precision: no", "sync_module_states: true", "wrap: layers"] {
        assert!(updated.contains(line), "{line} missing from:\n{updated}");
    }
    let output = accel().args(["config", "check"]).arg(&file).output().unwrap();
    let out = text(&output);
    assert!(
        output.status.success() && out.contains(" 0 ignored") && out.contains(" 0 refused"),
        "{out}"
    );
    // A file accel refuses is not rewritten.
    let bad = dir.join("bad.yaml");
    std::fs::write(&bad, "num_proceses: 2\n").unwrap();
    let output = accel().args(["config", "update"]).arg(&bad).output().unwrap();
    assert!(
        !output.status.success() && text(&output).contains("did you mean"),
        "{}",
        text(&output)
    );
    assert_eq!(std::fs::read_to_string(&bad).unwrap(), "num_proceses: 2\n");
}

#[test]
fn log_dir_gpu_ids_threads_per_process_and_trackers_reach_every_rank() {
    let dir = scratch("log-dir");
    let logs = dir.join("logs");
    let output = accel()
        .args(["launch", "--num-processes", "2", "--main-process-port", "0", "--rank0-only"])
        .args(["--gpu-ids", "0,1", "--num-cpu-threads-per-process", "3", "--log-with"])
        .args(["MLflow, tensorboard", "--log-dir"])
        .arg(&logs)
        .args([
            "sh",
            "-c",
            "echo rank $RANK sees $CUDA_VISIBLE_DEVICES $OMP_NUM_THREADS $ACCEL_LOG_WITH; \
             echo oops >&2",
        ])
        .output()
        .unwrap();
    let out = text(&output);
    assert!(output.status.success(), "{out}");
    assert!(!out.contains("rank 1 sees"), "--rank0-only still hides rank 1 on the console: {out}");
    for rank in 0..2 {
        let log = std::fs::read_to_string(logs.join(format!("rank{rank}.log"))).unwrap();
        let sees = format!("rank {rank} sees 0,1 3 mlflow,tensorboard");
        assert!(log.contains(&sees) && log.contains("oops"), "{log}");
    }
    let output = accel().args(["launch", "--log-with", "comet_ml", "true"]).output().unwrap();
    let out = text(&output);
    assert!(!output.status.success() && out.contains("unknown tracker `comet_ml`"), "{out}");
}
