//! Data-parallel training against references, with real processes:
//! - Accelerate's own check: 1 process with batch 8·N trains the regression model to the
//!   same parameters as N processes with batch 8 (1e-6), also with accumulation and
//!   split batches; bf16 within a stated tolerance;
//! - side by side with PyTorch + Accelerate: examples/parity.rs vs
//!   python/reference/parity_accelerate.py (torchrun, .venv) for 1, 2 and 3 processes,
//!   accumulation 1 and 3, an uneven data set: every loss and every weight within 1e-5.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use accel_core::launch::{LaunchPlan, run};

#[path = "parity/clusters.rs"]
mod clusters;

/// target/debug (or wherever this test binary's deps/ folder sits).
fn build_dir() -> PathBuf {
    std::env::current_exe().unwrap().parent().unwrap().parent().unwrap().to_path_buf()
}

fn example(name: &str) -> String {
    let path = build_dir().join("examples").join(name);
    assert!(path.exists(), "{} is missing: `cargo test` builds the examples first", path.display());
    path.display().to_string()
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("parity").join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn launch(processes: usize, program: Vec<String>) {
    let plan = LaunchPlan {
        env: vec![("ACCEL_TIMEOUT_SECS".into(), "60".into())],
        rank0_only: true,
        ..LaunchPlan::local(processes, program)
    };
    assert_eq!(run(&plan).unwrap(), 0, "accel launch of {:?} failed", plan.program);
}

fn regression(processes: usize, args: &[&str]) -> (f64, f64) {
    let dir = scratch(&format!("regression-{processes}-{}", args.join("_").replace("--", "")));
    let out = dir.join("ab.json");
    let mut program = vec![example("regression")];
    program.extend(args.iter().map(|s| s.to_string()));
    program.extend(["--out".into(), out.display().to_string()]);
    launch(processes, program);
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(out).unwrap()).unwrap();
    (v["a"].as_f64().unwrap(), v["b"].as_f64().unwrap())
}

fn assert_close(one: (f64, f64), many: (f64, f64), tolerance: f64, what: &str) {
    let diff = (one.0 - many.0).abs().max((one.1 - many.1).abs());
    assert!(
        diff <= tolerance,
        "{what}: 1 process {one:?} vs N processes {many:?} differ by {diff}"
    );
}

#[test]
fn one_process_with_batch_8n_equals_n_processes_with_batch_8() {
    for n in [2usize, 3] {
        let single = regression(1, &["--batch-size", &(8 * n).to_string(), "--samples", "96"]);
        let many = regression(n, &["--batch-size", "8", "--samples", "96"]);
        assert_close(single, many, 1e-6, &format!("{n} processes"));
        assert!((single.0 - 2.0).abs() < 0.2, "the model learned nothing: {single:?}");
    }
    let single = regression(1, &["--batch-size", "16", "--accumulate", "2"]);
    let many = regression(2, &["--batch-size", "8", "--accumulate", "2"]);
    assert_close(single, many, 1e-6, "accumulation 2");
    let single = regression(1, &["--batch-size", "16"]);
    let split = regression(2, &["--batch-size", "16", "--split-batches"]);
    assert_close(single, split, 1e-6, "split batches");
    // bf16 rounds activations to 8 bits of mantissa; the runs agree to about that.
    let single = regression(1, &["--batch-size", "16", "--precision", "bf16"]);
    let many = regression(2, &["--batch-size", "8", "--precision", "bf16"]);
    assert_close(single, many, 2e-2, "bf16");
}

/// W.safetensors and D.safetensors for the parity runs (45 samples of 10 features, a
/// 10-16-16-3 MLP), made by python/reference/parity_accelerate.py in `.venv`.
fn make_weights_and_data(dir: &Path, seed: u64) -> (PathBuf, PathBuf) {
    make_weights_and_data_with(dir, seed, "16,16")
}

/// [`make_weights_and_data`] with other hidden widths.
fn make_weights_and_data_with(dir: &Path, seed: u64, hidden: &str) -> (PathBuf, PathBuf) {
    make_weights_and_samples(dir, seed, hidden, 45)
}

/// [`make_weights_and_data_with`] with `n` samples.
fn make_weights_and_samples(dir: &Path, seed: u64, hidden: &str, n: usize) -> (PathBuf, PathBuf) {
    let (w, d) = (dir.join("W.safetensors"), dir.join("D.safetensors"));
    let made = Command::new(root().join(".venv/bin/python"))
        .arg(root().join("python/reference/parity_accelerate.py"))
        .args(["make", "--n", &n.to_string(), "--d", "10", "--hidden", hidden, "--classes", "3"])
        .args(["--seed", &seed.to_string()])
        .arg("--init")
        .arg(&w)
        .arg("--data")
        .arg(&d)
        .status()
        .unwrap();
    assert!(made.success(), "parity_accelerate.py make failed");
    (w, d)
}

fn read_losses(path: &Path) -> Vec<f64> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"].as_f64().unwrap())
        .collect()
}

fn read_weights(path: &Path) -> BTreeMap<String, Vec<f32>> {
    tch::Tensor::read_safetensors(path)
        .unwrap()
        .into_iter()
        .map(|(n, t)| (n, Vec::<f32>::try_from(t.flatten(0, -1)).unwrap()))
        .collect()
}

#[test]
fn parity_example_matches_pytorch_and_accelerate() {
    let dir = scratch("accelerate");
    let (w, d) = make_weights_and_data(&dir, 0);
    let cases: &[(usize, &str, &str)] = &[
        (1, "adamw", "1"),
        (1, "adamw", "3"),
        (2, "adamw", "1"),
        (2, "adamw", "3"),
        (3, "adamw", "1"),
        (3, "adamw", "3"),
        (2, "sgd", "3"),
    ];
    let runs: Vec<(usize, String, Vec<String>)> = cases
        .iter()
        .map(|&(n, optimizer, accumulate)| {
            let args = [
                "--init",
                w.to_str().unwrap(),
                "--data",
                d.to_str().unwrap(),
                "--hidden",
                "16,16",
                "--optimizer",
                optimizer,
                "--lr",
                "1e-2",
                "--weight-decay",
                "0.01",
                "--batch-size",
                "4",
                "--accumulate",
                accumulate,
                "--epochs",
                "2",
                "--precision",
                "no",
                "--clip-grad-norm",
                "1.0",
            ];
            (n, format!("{n}-{optimizer}-{accumulate}"), command(&args))
        })
        .collect();
    // One torchrun per process count, its runs one after the other.
    for n in 1..=3 {
        let same_n: Vec<(&str, &[String])> = runs
            .iter()
            .filter(|r| r.0 == n)
            .map(|(_, tag, args)| (tag.as_str(), &args[..]))
            .collect();
        accelerate_runs(&dir, n, &same_n);
    }
    for (n, tag, args) in &runs {
        equals_accelerate(&dir, tag, tag, *n, args, &[]);
    }
}

/// Runs the reference, PyTorch + Accelerate (`python/reference/parity_accelerate.py`), on `n`
/// processes for each `(tag, args)`, the runs one after the other in one torchrun: each
/// writes `py-{tag}.safetensors` (the final weights) and `py-{tag}.jsonl` (rank 0's losses)
/// in `dir`.
fn accelerate_runs(dir: &Path, n: usize, runs: &[(&str, &[String])]) {
    let torchrun = root().join(".venv/bin/torchrun");
    assert!(torchrun.exists(), "{} is missing: run `cargo xtask setup`", torchrun.display());
    let script = root().join("python/reference/parity_accelerate.py");
    let commands: Vec<Vec<String>> = runs
        .iter()
        .map(|(tag, args)| {
            let out = dir.join(format!("py-{tag}.safetensors")).display().to_string();
            let losses = dir.join(format!("py-{tag}.jsonl")).display().to_string();
            [&args[..], &command(&["--out", &out, "--losses", &losses])].concat()
        })
        .collect();
    let reference = || {
        let port = accel_core::comm::free_port("127.0.0.1").unwrap();
        Command::new(&torchrun)
            .args([format!("--nproc-per-node={n}"), format!("--master-port={port}")])
            .arg(&script)
            .args(commands.join(&";".to_string()))
            .output()
            .unwrap()
    };
    let tags: Vec<&str> = runs.iter().map(|r| r.0).collect();
    let mut output = reference();
    // The reference side's own flake: with torch 2.11's gloo, a rank of the Local SGD run
    // aborts in about one run in ten ("terminate called without an active exception", or only
    // torchrun's "Signal 6 (SIGABRT)"; the pre-fp8 script does too). Up to two more tries,
    // said out loud.
    for _ in 0..2 {
        let stderr = String::from_utf8_lossy(&output.stderr);
        if output.status.success()
            || !(stderr.contains("terminate called without") || stderr.contains("SIGABRT"))
        {
            break;
        }
        eprintln!("{tags:?}: the PyTorch reference aborted inside torch; running it again");
        output = reference();
    }
    assert!(
        output.status.success(),
        "Accelerate runs {tags:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Runs the `parity` example with `args` and `accel_extra` on `accel_n` processes (accel
/// launch), writing `rs-{tag}.*`, and checks every logged loss and final weight against the
/// reference run `reference` of [`accelerate_runs`] (1e-5). `accel_extra` can make the same
/// run another way: 4 processes as 2 data-parallel replicas of 2 tensor-parallel ranks, say.
fn equals_accelerate(
    dir: &Path,
    reference: &str,
    tag: &str,
    accel_n: usize,
    args: &[String],
    accel_extra: &[&str],
) {
    let (py_out, py_losses) = (
        dir.join(format!("py-{reference}.safetensors")),
        dir.join(format!("py-{reference}.jsonl")),
    );
    let (rs_out, rs_losses) =
        (dir.join(format!("rs-{tag}.safetensors")), dir.join(format!("rs-{tag}.jsonl")));
    let mut program = vec![example("parity")];
    program.extend_from_slice(args);
    program.extend(accel_extra.iter().map(|s| s.to_string()));
    program.extend([
        "--out".into(),
        rs_out.display().to_string(),
        "--losses".into(),
        rs_losses.display().to_string(),
    ]);
    launch(accel_n, program);

    let (py, rs) = (read_losses(&py_losses), read_losses(&rs_losses));
    assert_eq!(py.len(), rs.len(), "{tag}: number of batches on rank 0");
    for (step, (a, b)) in py.iter().zip(&rs).enumerate() {
        assert!((a - b).abs() <= 1e-5, "{tag}: loss at step {step}: Accelerate {a} vs accel {b}");
    }
    let (pw, rw) = (read_weights(&py_out), read_weights(&rs_out));
    assert_eq!(pw.keys().collect::<Vec<_>>(), rw.keys().collect::<Vec<_>>(), "{tag}: weight names");
    for (name, a) in &pw {
        let diff = a.iter().zip(&rw[name]).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
        assert!(diff <= 1e-5, "{tag}: {name} differs from Accelerate's by {diff}");
    }
}

/// Local SGD, a strategy written outside accel-core (examples/local_sgd.rs) with the public
/// API only, against Accelerate's own `LocalSGD` on the same weights and data, with
/// accumulation and clipping.
#[test]
fn local_sgd_written_outside_accel_core_matches_accelerates() {
    let dir = scratch("local-sgd");
    let (w, d) = make_weights_and_data(&dir, 1);
    for (n, accumulate, every) in [(2, "2", "3"), (3, "1", "2")] {
        let common: Vec<String> = [
            "--init",
            w.to_str().unwrap(),
            "--data",
            d.to_str().unwrap(),
            "--hidden",
            "16,16",
            "--lr",
            "1e-2",
            "--batch-size",
            "4",
            "--accumulate",
            accumulate,
            "--epochs",
            "2",
            "--clip-grad-norm",
            "1.0",
            "--local-sgd",
            every,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let tag = format!("local-sgd-{n}-{accumulate}-{every}");
        accelerate_runs(&dir, n, &[(&tag, &common)]);
        equals_accelerate(&dir, &tag, &tag, n, &common, &[]);
    }
}

#[test]
fn every_zero_stage_trains_to_the_same_weights_as_ddp_on_2_and_3_processes() {
    let dir = scratch("zero");
    make_weights_and_data(&dir, 1);
    for n in [2, 3] {
        let mut runs = Vec::new();
        for strategy in STAGES {
            let tag = format!("{strategy}-{n}");
            let saved = dir.join(format!("{tag}-model"));
            let weights =
                run_parity(&dir, n, strategy, &tag, &["--save-model", saved.to_str().unwrap()]);
            // save_model writes the whole weights, whatever holds them (under zero3 no
            // process does: they are gathered first).
            let written = read_weights(&saved.join("model.safetensors"));
            assert_eq!(max_diff(&weights, &written), 0.0, "{tag}: save_model wrote other weights");
            runs.push((read_losses(&dir.join(format!("{tag}.jsonl"))), weights));
        }
        let (ddp_losses, ddp_weights) = &runs[0];
        for (strategy, (losses, weights)) in STAGES.iter().zip(&runs).skip(1) {
            assert_eq!(ddp_losses.len(), losses.len(), "{n} processes, {strategy}: steps");
            for (step, (a, b)) in ddp_losses.iter().zip(losses).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-5,
                    "{n} processes, {strategy}: loss at step {step}: ddp {a} vs {b}"
                );
            }
            let diff = max_diff(ddp_weights, weights);
            assert!(
                diff <= 1e-5,
                "{n} processes: weights differ between ddp and {strategy} by {diff}"
            );
        }
    }
}

/// `optimizer_in_backward`: each unit's update applied inside backward, its gradient shard
/// dropped at once. Under zero2 and zero3, with plain SGD (which sees the gradients' scale)
/// and AdamW, on 2 processes: equal to the ordinary step on 2 processes, and to 1 process
/// with twice the batch (whose own in-backward update, a hook per parameter, equals its
/// ordinary step too).
#[test]
fn the_update_inside_backward_equals_the_ordinary_step_on_1_and_2_processes() {
    let dir = scratch("in-backward");
    let (w, d) = make_weights_and_samples(&dir, 3, "16,16", 48);
    let train = |n: usize, strategy: &str, optimizer: &str, in_backward: bool| {
        let tag = format!("{strategy}-{optimizer}-{n}-{in_backward}");
        let out = dir.join(format!("{tag}.safetensors"));
        let batch = (8 / n).to_string();
        let mut program = vec![example("parity")];
        program.extend(
            ["--init", w.to_str().unwrap(), "--data", d.to_str().unwrap(), "--hidden", "16,16"]
                .into_iter()
                .chain(["--optimizer", optimizer, "--lr", "5e-2", "--batch-size", &batch])
                .chain(["--epochs", "2", "--strategy", strategy, "--out", out.to_str().unwrap()])
                .chain(["--losses", dir.join(format!("{tag}.jsonl")).to_str().unwrap()])
                .map(String::from),
        );
        if in_backward {
            program.push("--optimizer-in-backward".into());
        }
        launch(n, program);
        read_weights(&out)
    };
    let init = read_weights(&w);
    for optimizer in ["sgd", "adamw"] {
        let one = train(1, "zero3", optimizer, false);
        assert!(max_diff(&init, &one) > 1e-3, "{optimizer}: nothing trained");
        let one_in_backward = train(1, "zero3", optimizer, true);
        let diff = max_diff(&one, &one_in_backward);
        assert!(diff <= 1e-6, "{optimizer}, 1 process: in backward differs by {diff}");
        for strategy in ["zero2", "zero3"] {
            let ordinary = train(2, strategy, optimizer, false);
            let in_backward = train(2, strategy, optimizer, true);
            let diff = max_diff(&ordinary, &in_backward);
            assert!(diff <= 1e-6, "{strategy}, {optimizer}: in backward differs by {diff}");
            let diff = max_diff(&one, &in_backward);
            assert!(diff <= 1e-6, "{strategy}, {optimizer}: 2 processes differ from 1 by {diff}");
        }
    }
}

/// A group of one (`ACCEL_GROUP_OF_ONE=1`, how scripts/gpu-check.sh puts every strategy
/// through NCCL on a machine with one GPU): the strategy runs over a real process group of
/// one process, says so, and trains exactly as one process does without any.
#[test]
fn every_strategy_over_a_group_of_one_trains_as_one_process_does_without() {
    let dir = scratch("group-of-one");
    make_weights_and_data(&dir, 2);
    let alone = run_parity(&dir, 1, "ddp", "alone", &[]);
    for strategy in STAGES {
        let (w, d) = (dir.join("W.safetensors"), dir.join("D.safetensors"));
        let out = dir.join(format!("{strategy}.safetensors"));
        let port = accel_core::comm::free_port("127.0.0.1").unwrap().to_string();
        let output = Command::new(example("parity"))
            .args(["--init", w.to_str().unwrap(), "--data", d.to_str().unwrap()])
            .args(["--hidden", "16,16", "--lr", "1e-2", "--batch-size", "4", "--accumulate", "2"])
            .args(["--epochs", "2", "--clip-grad-norm", "1.0", "--strategy", strategy, "--out"])
            .arg(&out)
            .arg("--losses")
            .arg(dir.join(format!("{strategy}.jsonl")))
            .envs([("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")])
            .envs([("MASTER_PORT", port.as_str()), ("ACCEL_GROUP_OF_ONE", "1")])
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&output.stdout).into_owned()
            + &String::from_utf8_lossy(&output.stderr);
        assert!(output.status.success(), "{strategy}: {said}");
        assert!(
            said.contains(&format!("parity: {strategy} on 1 process(es), collectives over Cpu")),
            "{strategy} did not run over a group of one: {said}"
        );
        let diff = max_diff(&alone, &read_weights(&out));
        assert!(diff <= 1e-6, "{strategy} over a group of one is {diff} from one process alone");
    }
}

/// A DeepSpeed JSON config, as `accelerate launch --config_file ds_config.json` takes it,
/// given to `accel launch --config-file`: ZeRO stage 2, accumulation and clipping come from
/// the file (the program's command line leaves them out), the batch-size arithmetic is
/// checked, and the run equals DDP with the same settings.
#[test]
fn a_deepspeed_json_config_runs_the_parity_example_as_zero2_equal_to_ddp() {
    let dir = scratch("deepspeed");
    make_weights_and_data(&dir, 3);
    let json = dir.join("ds_config.json");
    std::fs::write(
        &json,
        r#"{
  "train_batch_size": "auto",
  "train_micro_batch_size_per_gpu": 4,
  "gradient_accumulation_steps": 2,
  "gradient_clipping": 1.0,
  "fp16": {"enabled": false},
  "bf16": {"enabled": "auto"},
  "zero_optimization": {"stage": 2, "overlap_comm": true, "contiguous_gradients": true,
                        "reduce_bucket_size": "auto"}
}"#,
    )
    .unwrap();
    let stop = ["--state", "", "--stop-after", "10"];
    let ddp_state = dir.join("ddp-state");
    let mut extra = stop;
    extra[1] = ddp_state.to_str().unwrap();
    let ddp = run_parity(&dir, 2, "ddp", "ddp", &extra);

    let config = accel_core::launch::config::LaunchConfig::from_file(&json).unwrap();
    assert_eq!(config.training.strategy, Some(accel_core::Strategy::Zero2));
    let (w, d, out) =
        (dir.join("W.safetensors"), dir.join("D.safetensors"), dir.join("ds.safetensors"));
    let ds_state = dir.join("ds-state");
    let mut program = vec![example("parity")];
    program.extend(
        ["--init", w.to_str().unwrap(), "--data", d.to_str().unwrap(), "--hidden", "16,16"]
            .into_iter()
            .chain(["--lr", "1e-2", "--batch-size", "4", "--epochs", "2", "--out"])
            .chain([out.to_str().unwrap(), "--losses", dir.join("ds.jsonl").to_str().unwrap()])
            .chain(["--state", ds_state.to_str().unwrap(), "--stop-after", "10"])
            .map(str::to_owned),
    );
    let mut env: Vec<(String, String)> =
        config.training_env().into_iter().map(|(k, v)| (k.to_owned(), v)).collect();
    env.push(("ACCEL_TIMEOUT_SECS".into(), "60".into()));
    let plan = LaunchPlan { env, rank0_only: true, ..LaunchPlan::local(2, program) };
    assert_eq!(run(&plan).unwrap(), 0, "parity under the DeepSpeed config failed");
    // Sharded as ZeRO-2: one shard file per process (DDP's checkpoint has none).
    assert!(!ddp_state.join("shard_1.safetensors").exists());
    for rank in 0..2 {
        let shard = ds_state.join(format!("shard_{rank}.safetensors"));
        assert!(shard.exists(), "{} missing: not zero2", shard.display());
    }
    let diff = max_diff(&ddp, &read_weights(&out));
    assert!(diff <= 1e-5, "the DeepSpeed zero2 run is {diff} from DDP");

    // The micro batch the file fixes must be the program's.
    std::fs::write(
        &json,
        r#"{"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 2}}"#,
    )
    .unwrap();
    let config = accel_core::launch::config::LaunchConfig::from_file(&json).unwrap();
    let mut program = vec![example("parity")];
    program.extend(
        ["--init", w.to_str().unwrap(), "--data", d.to_str().unwrap(), "--hidden", "16,16"]
            .into_iter()
            .chain(["--batch-size", "4", "--out", out.to_str().unwrap(), "--losses"])
            .chain([dir.join("bad.jsonl").to_str().unwrap()])
            .map(str::to_owned),
    );
    let env = config.training_env().into_iter().map(|(k, v)| (k.to_owned(), v)).collect();
    let plan = LaunchPlan { env, rank0_only: true, ..LaunchPlan::local(2, program) };
    assert_ne!(run(&plan).unwrap(), 0, "a micro batch of 8 against batches of 4 must fail");
}

/// `strategy = "auto"`: with room it trains as DDP; told it has little memory
/// (`ACCEL_AUTO_MEMORY`), it shards (zero3 here) and says why — and trains the same.
#[test]
fn strategy_auto_picks_by_memory_and_trains_like_ddp() {
    let dir = scratch("auto");
    make_weights_and_data(&dir, 4);
    let state = |name: &str| dir.join(name).to_str().unwrap().to_owned();
    let stop =
        |name: &str| ["--state".to_string(), state(name), "--stop-after".into(), "10".into()];
    let run_with = |strategy: &str, tag: &str, env: Vec<(String, String)>| {
        let extra = stop(&format!("{tag}-state"));
        let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
        run_parity_with(
            &dir,
            |program| {
                let plan = LaunchPlan {
                    env: env.clone(),
                    rank0_only: true,
                    ..LaunchPlan::local(2, program)
                };
                assert_eq!(run(&plan).unwrap(), 0, "{tag} failed");
            },
            strategy,
            tag,
            &extra,
        )
    };
    let ddp = run_with("ddp", "ddp", Vec::new());
    let roomy = run_with("auto", "roomy", Vec::new());
    assert!(max_diff(&ddp, &roomy) <= 1e-6);
    assert!(!dir.join("roomy-state/shard_1.safetensors").exists(), "with room, auto is ddp");
    // The MLP's 499 parameters: ddp needs 16 × 499 = 7984 bytes, zero1 5988, zero2 4990,
    // zero3 3992; 60% of 8000 bytes leaves room for zero3 only.
    let tight = run_with("auto", "tight", vec![("ACCEL_AUTO_MEMORY".into(), "8000".into())]);
    for rank in 0..2 {
        assert!(dir.join(format!("tight-state/shard_{rank}.safetensors")).exists(), "not sharded");
    }
    assert!(max_diff(&ddp, &tight) <= 1e-5);
}

/// `Accelerator::profile` on 2 processes under DDP: each writes a Chrome trace in which
/// libtorch's operators sit with accel's ranges — forward, backward, the gradients'
/// synchronisation, the optimizer step, every bucket's all-reduce on the group's worker
/// thread — and the summary finds the steps and the communication, part of it overlapping
/// the backward pass that launched it.
#[test]
fn profiles_hold_accels_ranges_and_the_summary_accounts_for_them() {
    let dir = scratch("profile");
    make_weights_and_data(&dir, 5);
    let traces = dir.join("traces");
    run_parity(&dir, 2, "ddp", "profiled", &["--profile", traces.to_str().unwrap()]);
    for rank in 0..2 {
        let path = traces.join(format!("trace_rank{rank}.json"));
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(
            text.contains("\"aten::addmm\""),
            "libtorch's operators missing in {}",
            path.display()
        );
        let summary = accel_core::profile::summarize(&path).unwrap();
        // 45 samples: 12 batches of 4 dealt to 2 ranks, 3 steps of 2 micro-batches an epoch.
        assert_eq!(summary.steps, 6, "{summary}");
        for phase in [
            "forward",
            "backward",
            "gradient_sync",
            "optimizer_step",
            "data_wait",
            "all_reduce(avg)",
        ] {
            assert!(
                summary.phases.get(phase).is_some_and(|us| *us > 0.0),
                "{phase} missing: {summary}"
            );
        }
        assert!(
            summary.communication_us > 0.0 && summary.overlapped_us <= summary.communication_us
        );
    }
}

/// DDP first: the reference the sharded strategies are held to.
const STAGES: [&str; 4] = ["ddp", "zero1", "zero2", "zero3"];

/// Runs the parity example on `n` processes with the zero test's settings plus `extra`;
/// returns rank 0's final weights.
fn run_parity(
    dir: &Path,
    n: usize,
    strategy: &str,
    tag: &str,
    extra: &[&str],
) -> BTreeMap<String, Vec<f32>> {
    run_parity_with(dir, |program| launch(n, program), strategy, tag, extra)
}

/// `machines` launchers of `per_machine` processes each on this host, as if on as many
/// machines (their own LOCAL_WORLD_SIZE, one rendezvous).
fn launch_machines(machines: usize, per_machine: usize, program: Vec<String>) {
    let port = accel_core::comm::free_port("127.0.0.1").unwrap();
    let launchers: Vec<_> = (0..machines)
        .map(|machine| {
            let plan = LaunchPlan {
                num_machines: machines,
                machine_rank: machine,
                main_process_port: port,
                env: vec![("ACCEL_TIMEOUT_SECS".into(), "60".into())],
                rank0_only: true,
                ..LaunchPlan::local(per_machine, program.clone())
            };
            std::thread::spawn(move || run(&plan).unwrap())
        })
        .collect();
    for (machine, launcher) in launchers.into_iter().enumerate() {
        assert_eq!(launcher.join().unwrap(), 0, "machine {machine} of {program:?} failed");
    }
}

fn run_parity_with(
    dir: &Path,
    launch: impl Fn(Vec<String>),
    strategy: &str,
    tag: &str,
    extra: &[&str],
) -> BTreeMap<String, Vec<f32>> {
    let out = dir.join(format!("{tag}.safetensors"));
    let mut program = vec![example("parity")];
    program.extend(run_args(dir));
    program.extend(
        [
            "--strategy",
            strategy,
            "--out",
            out.to_str().unwrap(),
            "--losses",
            dir.join(format!("{tag}.jsonl")).to_str().unwrap(),
        ]
        .iter()
        .chain(extra)
        .map(|s| s.to_string()),
    );
    launch(program);
    read_weights(&out)
}

/// The arguments of [`run_parity`]'s runs (and their reference's), on `dir`'s W and D:
/// AdamW at 1e-2, batch 4, accumulation 2, 2 epochs, clipping at 1.
fn run_args(dir: &Path) -> Vec<String> {
    let (w, d) = (dir.join("W.safetensors"), dir.join("D.safetensors"));
    command(&[
        "--init",
        w.to_str().unwrap(),
        "--data",
        d.to_str().unwrap(),
        "--hidden",
        "16,16",
        "--lr",
        "1e-2",
        "--batch-size",
        "4",
        "--accumulate",
        "2",
        "--epochs",
        "2",
        "--clip-grad-norm",
        "1.0",
    ])
}

fn max_diff(a: &BTreeMap<String, Vec<f32>>, b: &BTreeMap<String, Vec<f32>>) -> f32 {
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>(), "weight names");
    a.iter()
        .flat_map(|(name, x)| x.iter().zip(&b[name]).map(|(p, q)| (p - q).abs()))
        .fold(0.0, f32::max)
}

#[test]
fn sharded_checkpoints_resume_exactly_and_load_into_another_world_size_and_strategy() {
    let dir = scratch("zero-resume");
    make_weights_and_data(&dir, 1);
    let state = |name: &str| dir.join(name).display().to_string();

    // Same world size: stopping half-way and resuming lands where one run does.
    let straight = run_parity(&dir, 2, "zero3", "straight", &[]);
    run_parity(&dir, 2, "zero3", "first-half", &["--state", &state("z3-2"), "--stop-after", "4"]);
    for (file, expect) in [("shard_0.safetensors", true), ("shard_1.safetensors", true)] {
        assert_eq!(dir.join("z3-2").join(file).exists(), expect, "{file}");
    }
    let resumed = run_parity(&dir, 2, "zero3", "resumed", &["--resume", &state("z3-2")]);
    let diff = max_diff(&straight, &resumed);
    assert!(diff <= 1e-6, "zero3 resumed on 2 processes differs from one run by {diff}");

    // Saved by 3 processes (odd chunks, padded), loaded by 2: resharded for zero2 and put
    // back together whole for DDP, both continue to the same weights.
    run_parity(&dir, 3, "zero3", "three", &["--state", &state("z3-3"), "--stop-after", "4"]);
    let zero2 = run_parity(&dir, 2, "zero2", "into-zero2", &["--resume", &state("z3-3")]);
    let ddp = run_parity(&dir, 2, "ddp", "into-ddp", &["--resume", &state("z3-3")]);
    let diff = max_diff(&zero2, &ddp);
    assert!(diff <= 1e-5, "a 3-process zero3 state continued as zero2 and as ddp: {diff}");
    // And they did move on from the saved point.
    let saved = read_weights(&dir.join("three.safetensors"));
    assert!(max_diff(&saved, &ddp) > 1e-3, "training continued after loading");

    // `accel merge-weights`: the three shards put back together are the weights reached.
    let merged: BTreeMap<String, Vec<f32>> = accel_core::merge_weights(&dir.join("z3-3"), 0)
        .unwrap()
        .into_iter()
        .map(|(n, t)| (n, Vec::<f32>::try_from(t.flatten(0, -1)).unwrap()))
        .collect();
    assert_eq!(max_diff(&saved, &merged), 0.0, "merged shards vs the gathered weights");
    let shard = dir.join("z3-3/shard_1.safetensors");
    let mut bytes = std::fs::read(&shard).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    std::fs::write(&shard, bytes).unwrap();
    let err = accel_core::merge_weights(&dir.join("z3-3"), 0).unwrap_err().to_string();
    assert!(err.contains("shard_1.safetensors") && err.contains("CRC32"), "{err}");

    // zero1 (whole state tensors, each in its owner's file), 2 processes into 3.
    run_parity(&dir, 2, "zero1", "z1", &["--state", &state("z1-2"), "--stop-after", "4"]);
    let zero1 = run_parity(&dir, 3, "zero1", "z1-into-zero1", &["--resume", &state("z1-2")]);
    let ddp = run_parity(&dir, 3, "ddp", "z1-into-ddp", &["--resume", &state("z1-2")]);
    let diff = max_diff(&zero1, &ddp);
    assert!(diff <= 1e-6, "a 2-process zero1 state continued as zero1 and ddp on 3: {diff}");
}

/// Sharded resume as a preempted large run needs it: a zero3/fsdp state saved on N
/// processes continues on M (N, M in 1, 2, 4) to the weights of the uninterrupted run, each
/// process reading only the bytes of its own new shard (counted: at most its share of the
/// shard files plus the main process's small files, far below the whole a process read
/// before), and a corrupt byte is found by the process that reads it and stops every
/// process before anything changed.
#[test]
fn sharded_resume_reads_each_process_share_and_continues_on_any_number_of_processes() {
    let dir = scratch("sharded-resume");
    make_weights_and_samples(&dir, 7, "192,192", 48);
    let (w, d) = (dir.join("W.safetensors"), dir.join("D.safetensors"));
    // Split batches: the same global batches of 8 on 1, 2 and 4 processes.
    let args = |strategy: &str, optimizer: &str, tag: &str, extra: &[String]| -> Vec<String> {
        let mut program = vec![example("parity")];
        program.extend(
            [
                "--init",
                w.to_str().unwrap(),
                "--data",
                d.to_str().unwrap(),
                "--hidden",
                "192,192",
                "--optimizer",
                optimizer,
                "--lr",
                if optimizer == "sgd" { "0.05" } else { "1e-2" },
                "--weight-decay",
                "0",
                "--batch-size",
                "8",
                "--split-batches",
                "--accumulate",
                "2",
                "--epochs",
                "2",
                "--strategy",
                strategy,
                "--out",
                dir.join(format!("{tag}.safetensors")).to_str().unwrap(),
                "--losses",
                dir.join(format!("{tag}.jsonl")).to_str().unwrap(),
            ]
            .map(String::from),
        );
        program.extend(extra.iter().cloned());
        program
    };
    let state = |optimizer: &str, n: usize| dir.join(format!("state-{optimizer}-{n}"));
    for optimizer in ["adamw", "sgd"] {
        launch(1, args("zero3", optimizer, &format!("straight-{optimizer}"), &[]));
        let straight = read_weights(&dir.join(format!("straight-{optimizer}.safetensors")));
        let sizes: &[usize] = if optimizer == "sgd" { &[2] } else { &[1, 2, 4] };
        for &n in sizes {
            let save = ["--state".into(), state(optimizer, n).display().to_string()];
            let save = [&save[..], &["--stop-after".into(), "6".into()]].concat();
            launch(n, args("zero3", optimizer, &format!("first-{optimizer}-{n}"), &save));
        }
        let pairs: &[(usize, usize, &str)] = if optimizer == "sgd" {
            &[(2, 4, "fsdp")]
        } else {
            &[
                (1, 2, "zero3"),
                (1, 4, "fsdp"),
                (2, 1, "fsdp"),
                (2, 4, "zero3"),
                (4, 1, "zero3"),
                (4, 2, "fsdp"),
                (4, 4, "zero3"),
            ]
        };
        for &(n, m, strategy) in pairs {
            let tag = format!("{optimizer}-{n}-into-{m}");
            let counts = dir.join(format!("io-{tag}"));
            let extra = [
                "--resume".into(),
                state(optimizer, n).display().to_string(),
                "--io-counts".into(),
                counts.display().to_string(),
            ];
            launch(m, args(strategy, optimizer, &tag, &extra));
            let resumed = read_weights(&dir.join(format!("{tag}.safetensors")));
            let diff = max_diff(&straight, &resumed);
            assert!(diff <= 1e-6, "{optimizer}: saved on {n}, resumed on {m} ({strategy}): {diff}");

            // What each process read: its share of the shard files, the main process's files
            // (replicated tensors: biases and step counts here are small) and its own random
            // generators, plus whole blocks where its ranges start and end.
            let files: BTreeMap<String, u64> = std::fs::read_dir(state(optimizer, n))
                .unwrap()
                .map(|e| e.unwrap())
                .map(|e| (e.file_name().into_string().unwrap(), e.metadata().unwrap().len()))
                .collect();
            let shards: u64 =
                files.iter().filter(|(f, _)| f.starts_with("shard_")).map(|(_, b)| b).sum();
            let small: u64 = files
                .iter()
                .filter(|(f, _)| f.starts_with("model") || f.starts_with("optimizer"))
                .map(|(_, b)| b)
                .sum();
            let rng = files["rng_state_0.safetensors"];
            // Saved on one process, the main process's files hold everything.
            let (state, replicated) = (shards + small, if shards > 0 { small } else { 0 });
            let share = state / m as u64;
            let bound = share + share / 4 + replicated + 2 * rng + 64 * 1024;
            if m > 1 {
                assert!(bound < state, "{tag}: the bound {bound} of {state} has no teeth");
            }
            for rank in 0..m {
                let io: serde_json::Value = serde_json::from_str(
                    &std::fs::read_to_string(format!("{}.{rank}.json", counts.display())).unwrap(),
                )
                .unwrap();
                let read = io["checkpoint_bytes_read"].as_u64().unwrap();
                assert!(
                    read <= bound,
                    "{tag}: rank {rank} read {read} bytes of the {state} of the checkpoint; its \
                     share is {share}, the bound {bound}"
                );
            }
        }
    }

    // A byte flipped in the middle of shard_1 (a moment of the second process's shard): the
    // process that reads it names the file, every process stops, and says so.
    let shard = state("adamw", 2).join("shard_1.safetensors");
    let mut bytes = std::fs::read(&shard).unwrap();
    let middle = bytes.len() / 2 + 3;
    bytes[middle] ^= 0x10;
    std::fs::write(&shard, bytes).unwrap();
    let extra = ["--resume".into(), state("adamw", 2).display().to_string()];
    let output = Command::new(build_dir().join("accel"))
        .args(["launch", "--num-processes", "2", "--main-process-port", "0", "--cpu"])
        .args(args("zero3", "adamw", "corrupt", &extra))
        .env("ACCEL_TIMEOUT_SECS", "60")
        .output()
        .unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(!output.status.success(), "a corrupt shard loaded:\n{said}");
    let line = |rank: usize| {
        said.lines()
            .find(|l| l.starts_with(&format!("[rank{rank}]")) && l.contains("Error"))
            .unwrap_or_else(|| panic!("rank {rank} reported no error:\n{said}"))
            .to_owned()
    };
    assert!(line(1).contains("shard_1.safetensors") && line(1).contains("corrupted"), "{said}");
    assert!(line(0).contains("process 1") && line(0).contains("corrupted"), "{said}");
    assert!(!dir.join("corrupt.safetensors").exists(), "the run went on:\n{said}");
}

#[test]
fn mixed_precision_inside_sharding_trains_like_ddp() {
    let dir = scratch("zero-mixed");
    make_weights_and_data(&dir, 2);
    let mut ddp_runs = BTreeMap::new();
    for precision in ["bf16", "fp16"] {
        let ddp =
            run_parity(&dir, 2, "ddp", &format!("ddp-{precision}"), &["--precision", precision]);
        let zero3 = run_parity(
            &dir,
            2,
            "zero3",
            &format!("zero3-{precision}"),
            &["--precision", precision, "--fp32-gathers"],
        );
        // Same autocast over the same fp32 weights; only the order of the gradient sums
        // differs. For fp16 this also checks that every rank skips the same overflowing
        // steps (the scaler's verdict is shared across shards).
        let diff = max_diff(&ddp, &zero3);
        assert!(diff <= 1e-4, "{precision}: zero3 differs from ddp by {diff}");
        ddp_runs.insert(precision, ddp);
    }
    // Gradients reduce-scattered in bf16 (8 bits of mantissa): close to fp32, not equal.
    let ddp = run_parity(&dir, 2, "ddp", "ddp-fp32", &[]);
    let zero2 = run_parity(&dir, 2, "zero2", "zero2-bf16-reduce", &["--bf16-reductions"]);
    let diff = max_diff(&ddp, &zero2);
    assert!(diff > 0.0 && diff <= 1e-2, "zero2 with bf16 reductions vs fp32 ddp: {diff}");
    // Parameters gathered in bf16 compute what autocast computes from fp32 ones (the same
    // rounding); their gradients come out, and are reduced, in bf16, while the masters
    // step in fp32 and the saved weights are fp32.
    let ddp = &ddp_runs["bf16"];
    let zero3 = run_parity(
        &dir,
        2,
        "zero3",
        "zero3-bf16-params",
        &["--precision", "bf16", "--bf16-parameters"],
    );
    let diff = max_diff(ddp, &zero3);
    assert!(diff > 0.0 && diff <= 1e-2, "zero3 with bf16 parameters vs bf16 ddp: {diff}");
    // That is zero3's default under bf16, as Accelerate's FSDP plugin sets MixedPrecision.
    let default = run_parity(&dir, 2, "zero3", "zero3-bf16-default", &["--precision", "bf16"]);
    assert_eq!(max_diff(&zero3, &default), 0.0, "zero3 under bf16 does not gather in bf16");
}

#[test]
fn hybrid_sharding_on_2_machines_of_2_trains_like_ddp_on_4_and_checkpoints_once() {
    let dir = scratch("hybrid");
    make_weights_and_data(&dir, 3);
    let ddp = run_parity(&dir, 4, "ddp", "ddp-4", &[]);
    let two_by_two = |program| launch_machines(2, 2, program);
    let hybrid = run_parity_with(&dir, two_by_two, "hybrid_shard", "hybrid", &[]);
    let diff = max_diff(&ddp, &hybrid);
    assert!(diff <= 1e-5, "hybrid_shard on 2x2 differs from ddp on 4 by {diff}");

    // Its checkpoint keeps one copy of each shard (the first machine's) and merges whole.
    let state = dir.join("state").display().to_string();
    let stopped = run_parity_with(
        &dir,
        two_by_two,
        "hybrid_shard",
        "hybrid-stopped",
        &["--state", &state, "--stop-after", "4"],
    );
    let files = |rank: usize| dir.join("state").join(format!("shard_{rank}.safetensors")).exists();
    assert!(
        files(0) && files(1) && !files(2) && !files(3),
        "shard files of the first machine only"
    );
    let merged: BTreeMap<String, Vec<f32>> = accel_core::merge_weights(&dir.join("state"), 0)
        .unwrap()
        .into_iter()
        .map(|(n, t)| (n, Vec::<f32>::try_from(t.flatten(0, -1)).unwrap()))
        .collect();
    assert_eq!(max_diff(&stopped, &merged), 0.0, "merged hybrid shards vs the gathered weights");
    // And it continues on one machine of 2 under zero3.
    run_parity(&dir, 2, "zero3", "hybrid-into-zero3", &["--resume", &state]);
}

/// A pipeline step takes a short last window as accumulation without a pipeline ends an
/// epoch: 26 batches with accumulate 3 (8 full windows and one of 2 per epoch), on 2 stages
/// under each schedule, equal Accelerate on 1 process — losses and weights, with plain SGD
/// (which sees the scale of every gradient: a window divided by 2 instead of 3 shows).
#[test]
fn the_pipeline_steps_a_short_last_window_as_accelerate_does() {
    let dir = scratch("pp-short-window");
    let (w, d) = make_weights_and_samples(&dir, 6, "16,16", 52);
    let common: Vec<String> = [
        "--init",
        w.to_str().unwrap(),
        "--data",
        d.to_str().unwrap(),
        "--hidden",
        "16,16",
        "--optimizer",
        "sgd",
        "--lr",
        "0.1",
        "--weight-decay",
        "0",
        "--batch-size",
        "2",
        "--accumulate",
        "3",
        "--epochs",
        "2",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    // Accelerate's one process is the reference for both schedules.
    accelerate_runs(&dir, 1, &[("pp-reference", &common)]);
    for schedule in ["1f1b", "gpipe"] {
        let extra = ["--pipeline-parallel", "2", "--schedule", schedule];
        equals_accelerate(&dir, "pp-reference", &format!("pp2-{schedule}"), 2, &common, &extra);
    }
}

/// Megatron-style column/row pairs and pipeline stages (both schedules) train the parity
/// MLP exactly as one process does; tensor parallelism inside data parallelism matches
/// Accelerate's DDP; and a tensor × pipeline checkpoint continues as plain DDP.
#[test]
fn tensor_and_pipeline_parallel_train_like_one_process_and_like_accelerate() {
    let dir = scratch("tp-pp");
    make_weights_and_data(&dir, 4);
    let one = run_parity(&dir, 1, "ddp", "one", &[]);
    let one_losses = read_losses(&dir.join("one.jsonl"));
    let runs: [(&str, usize, &[&str]); 5] = [
        ("tp2", 2, &["--tensor-parallel", "2"]),
        ("pp2-1f1b", 2, &["--pipeline-parallel", "2"]),
        ("pp2-gpipe", 2, &["--pipeline-parallel", "2", "--schedule", "gpipe"]),
        ("pp3", 3, &["--pipeline-parallel", "3"]),
        ("tp2-pp2", 4, &["--tensor-parallel", "2", "--pipeline-parallel", "2"]),
    ];
    for (tag, n, extra) in runs {
        let weights = run_parity(&dir, n, "ddp", tag, extra);
        let losses = read_losses(&dir.join(format!("{tag}.jsonl")));
        assert_eq!(losses.len(), one_losses.len(), "{tag}: steps");
        for (step, (a, b)) in one_losses.iter().zip(&losses).enumerate() {
            assert!((a - b).abs() <= 1e-6, "{tag}: loss at step {step}: one process {a} vs {b}");
        }
        // Row-parallel layers add partial products in another order: 1e-7 per step, which
        // Adam blows up for a weight whose gradient is nearly 0 (tp2: one weight 4e-6 off,
        // every other within 1.2e-7), as it does between DDP and ZeRO.
        let diff = max_diff(&one, &weights);
        assert!(diff <= 1e-5, "{tag}: weights differ from one process's by {diff}");
    }

    // 2 data-parallel replicas of 2 tensor-parallel ranks = Accelerate's DDP on 2, under
    // each strategy that shards across the replicas too.
    let common = run_args(&dir);
    accelerate_runs(&dir, 2, &[("dp2", &common)]);
    for strategy in ["ddp", "zero3"] {
        let extra = ["--tensor-parallel", "2", "--strategy", strategy];
        equals_accelerate(&dir, "dp2", &format!("tp2-dp2-{strategy}"), 4, &common, &extra);
    }

    // A checkpoint written by 2 stages of 2 tensor-parallel ranks continues on one process
    // (the same one data-parallel replica, so the same batches) to where one process goes
    // without a stop, and on 2 pipeline stages likewise: its pieces are put back whole.
    let state = dir.join("tp2-pp2-state").display().to_string();
    let tp_pp = ["--tensor-parallel", "2", "--pipeline-parallel", "2"];
    let stop = [&tp_pp[..], &["--state", &state, "--stop-after", "4"]].concat();
    run_parity(&dir, 4, "ddp", "tp2-pp2-stopped", &stop);
    for (tag, n, extra) in
        [("one-resumed", 1, &[][..]), ("pp2-resumed", 2, &["--pipeline-parallel", "2"][..])]
    {
        let resume = [extra, &["--resume", &state]].concat();
        let resumed = run_parity(&dir, n, "ddp", tag, &resume);
        let diff = max_diff(&one, &resumed);
        assert!(diff <= 1e-5, "{tag}: a tp2 x pp2 checkpoint continued differs by {diff}");
        // It started from the checkpoint: only the batches after it ran, with the losses
        // the uninterrupted run had there.
        let losses = read_losses(&dir.join(format!("{tag}.jsonl")));
        assert!(
            !losses.is_empty() && losses.len() < one_losses.len(),
            "{tag}: {} batches",
            losses.len()
        );
        let tail = &one_losses[one_losses.len() - losses.len()..];
        for (a, b) in tail.iter().zip(&losses) {
            assert!((a - b).abs() <= 1e-6, "{tag}: loss {b} where the straight run had {a}");
        }
    }
}

/// fp8 training against Accelerate's (`mixed_precision="fp8"` with torchao's `Float8Linear`,
/// `AORecipeKwargs`): a 10-32-32-32-3 MLP, whose two middle layers are fp8 on both sides
/// (the first and last stay bf16), trained 3 epochs on 1 process, on 2 under DDP and zero3,
/// and with the row-wise recipe: every loss and weight within 1e-5 of Accelerate's
/// (the issue asked 2e-3), while both differ from the fp32 run (quantisation happened).
#[test]
fn fp8_trains_like_accelerate_with_torchao() {
    let dir = scratch("fp8");
    let (w, d) = make_weights_and_data_with(&dir, 0, "32,32,32");
    let args = |precision: &str, recipe: &str| -> Vec<String> {
        [
            "--init",
            w.to_str().unwrap(),
            "--data",
            d.to_str().unwrap(),
            "--hidden",
            "32,32,32",
            "--lr",
            "1e-2",
            "--batch-size",
            "4",
            "--epochs",
            "3",
            "--precision",
            precision,
            "--fp8-recipe",
            recipe,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };
    let (tensorwise, rowwise) = (args("fp8", "tensorwise"), args("fp8", "rowwise"));
    accelerate_runs(&dir, 1, &[("fp8-1", &tensorwise), ("fp8-rowwise", &rowwise)]);
    accelerate_runs(&dir, 2, &[("fp8-2", &tensorwise)]);
    equals_accelerate(&dir, "fp8-1", "fp8-1", 1, &tensorwise, &[]);
    equals_accelerate(&dir, "fp8-2", "fp8-2-ddp", 2, &tensorwise, &[]);
    equals_accelerate(&dir, "fp8-2", "fp8-2-zero3", 2, &tensorwise, &["--strategy", "zero3"]);
    equals_accelerate(&dir, "fp8-rowwise", "fp8-rowwise", 1, &rowwise, &[]);

    let mut program = vec![example("parity")];
    program.extend(args("no", "tensorwise"));
    let fp32 = dir.join("fp32.safetensors");
    program.extend(["--out".into(), fp32.display().to_string(), "--losses".into()]);
    program.push(dir.join("fp32.jsonl").display().to_string());
    launch(1, program);
    let fp32 = read_weights(&fp32);
    for tag in ["fp8-1", "fp8-rowwise"] {
        let fp8 = read_weights(&dir.join(format!("rs-{tag}.safetensors")));
        let diff = max_diff(&fp8, &fp32);
        assert!(diff > 1e-3, "{tag}: fp8 weights within {diff} of fp32's: no quantisation?");
    }
}

/// accel's fp8 linear layer against torchao's `Float8Linear` (python/reference/fp8_linear.py)
/// on the same tensors: output and every gradient equal bit for bit, for the tensor-wise
/// recipe in fp32 and under bf16 autocast, and for the row-wise recipe.
#[test]
fn fp8_linear_equals_torchao_bit_for_bit() {
    use accel_core::Fp8Recipe;
    use accel_core::precision::fp8;
    use tch::{Device, Kind, Tensor};

    let dir = scratch("fp8-linear");
    let file = dir.join("torchao.safetensors");
    let made = Command::new(root().join(".venv/bin/python"))
        .arg(root().join("python/reference/fp8_linear.py"))
        .arg(&file)
        .status()
        .unwrap();
    assert!(made.success(), "fp8_linear.py failed");
    let reference: BTreeMap<String, Tensor> =
        Tensor::read_safetensors(&file).unwrap().into_iter().collect();
    // Fresh copies: each case accumulates its own gradients.
    let get = |name: &str| reference[name].copy();
    for (case, recipe, autocast) in [
        ("tensorwise", Fp8Recipe::Tensorwise, false),
        ("tensorwise_autocast", Fp8Recipe::Tensorwise, true),
        ("rowwise", Fp8Recipe::Rowwise, false),
    ] {
        let x = get("x").set_requires_grad(true);
        let w = get("w").set_requires_grad(true);
        let b = get("b").set_requires_grad(true);
        let y = {
            let _autocast = autocast
                .then(|| accel_core::shim::autocast(Device::Cpu, Kind::BFloat16, true).unwrap());
            fp8::linear(&x, &w, Some(&b), recipe).unwrap()
        };
        let gy = get("gy").to_kind(y.kind());
        // d(sum(y·gy))/dy is gy exactly.
        (&y * &gy).sum(y.kind()).backward();
        let exact = x.linear(&w, Some(&b));
        assert!(!y.to_kind(Kind::Float).equal(&exact), "{case}: no quantisation happened");
        for (what, ours) in
            [("y", y.to_kind(Kind::Float)), ("gx", x.grad()), ("gw", w.grad()), ("gb", b.grad())]
        {
            let theirs = get(&format!("{case}.{what}"));
            let diff = (&ours - &theirs).abs().max().double_value(&[]);
            assert!(ours.equal(&theirs), "{case}.{what}: differs from torchao by up to {diff}");
        }
    }
}

/// W and D for the batch-norm runs (`--model mlp|conv`, `n` samples), made by
/// python/reference/batchnorm_accelerate.py.
fn make_batchnorm_files(dir: &Path, model: &str, n: usize) -> (PathBuf, PathBuf) {
    let (w, d) =
        (dir.join(format!("W-{model}.safetensors")), dir.join(format!("D-{model}.safetensors")));
    let made = Command::new(root().join(".venv/bin/python"))
        .arg(root().join("python/reference/batchnorm_accelerate.py"))
        .args(["make", "--model", model, "--n", &n.to_string()])
        .arg("--init")
        .arg(&w)
        .arg("--data")
        .arg(&d)
        .status()
        .unwrap();
    assert!(made.success(), "batchnorm_accelerate.py make failed");
    (w, d)
}

/// PyTorch + Accelerate on `n` processes: rank 0's variables.
fn batchnorm_reference(
    dir: &Path,
    tag: &str,
    n: usize,
    args: &[String],
) -> BTreeMap<String, Vec<f32>> {
    let out = dir.join(format!("py-{tag}.safetensors"));
    let port = accel_core::comm::free_port("127.0.0.1").unwrap();
    let output = Command::new(root().join(".venv/bin/torchrun"))
        .args([format!("--nproc-per-node={n}"), format!("--master-port={port}")])
        .arg(root().join("python/reference/batchnorm_accelerate.py"))
        .args(args)
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "Accelerate run {tag} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    read_weights(&out)
}

/// accel's batchnorm example on 2 processes: each rank's variables.
fn batchnorm_accel(dir: &Path, tag: &str, args: &[String]) -> Vec<BTreeMap<String, Vec<f32>>> {
    let out = dir.join(format!("rs-{tag}"));
    let mut program = vec![example("batchnorm")];
    program.extend(args.iter().cloned());
    program.extend(["--out-dir".into(), out.display().to_string()]);
    launch(2, program);
    (0..2).map(|r| read_weights(&out.join(format!("rank{r}.safetensors")))).collect()
}

fn max_difference(a: &BTreeMap<String, Vec<f32>>, b: &BTreeMap<String, Vec<f32>>) -> (f32, String) {
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>(), "variable names");
    let mut worst = (0.0f32, String::new());
    for (name, x) in a {
        let diff = x.iter().zip(&b[name]).map(|(p, q)| (p - q).abs()).fold(0.0f32, f32::max);
        if diff > worst.0 {
            worst = (diff, name.clone());
        }
    }
    worst
}

/// Batch norm under DDP and zero3 on 2 processes against PyTorch + Accelerate's DDP on the
/// same weights and data, every variable compared on both ranks — running statistics
/// included (torch broadcasts rank 0's buffers; accel keeps every rank's equal to rank 0's).
/// With `--sync-batchnorm`, against one process with both processes' batches together
/// (what torch's SyncBatchNorm computes; it has no CPU kernels to run here). Without buffer
/// broadcasting the ranks' running statistics must differ, or this test could not fail.
/// Under ddp and zero3 the variables compared have been through `save_state` and
/// `load_state` (scrambled on every rank in between).
#[test]
fn batch_norm_matches_accelerate_on_every_variable_including_running_statistics() {
    let dir = scratch("batchnorm");
    for model in ["mlp", "conv"] {
        let (w, d) = make_batchnorm_files(&dir, model, 48);
        let files = |batch: usize| -> Vec<String> {
            [
                "--model",
                model,
                "--init",
                w.to_str().unwrap(),
                "--data",
                d.to_str().unwrap(),
                "--batch-size",
                &batch.to_string(),
                "--accumulate",
                "2",
                "--epochs",
                "2",
            ]
            .iter()
            .map(|s| s.to_string())
            .collect()
        };
        let torch = batchnorm_reference(&dir, &format!("{model}-ddp"), 2, &files(8));
        assert!(torch.contains_key("bn1.running_mean") && torch.contains_key("bn1.running_var"));
        for strategy in ["ddp", "zero3"] {
            let mut args = files(8);
            args.extend(["--strategy".into(), strategy.into()]);
            // Every variable goes through save_state and load_state (after being scrambled
            // on every rank) before it is written.
            let state = dir.join(format!("state-{model}-{strategy}"));
            args.extend(["--state".into(), state.display().to_string()]);
            let ranks = batchnorm_accel(&dir, &format!("{model}-{strategy}"), &args);
            for (rank, ours) in ranks.iter().enumerate() {
                let (diff, name) = max_difference(&torch, ours);
                assert!(
                    diff <= 1e-6,
                    "{model} {strategy}: rank {rank}'s {name} differs from Accelerate's by {diff}"
                );
            }
        }
        let single = batchnorm_reference(&dir, &format!("{model}-one"), 1, &files(16));
        let mut args = files(8);
        args.push("--sync-batchnorm".into());
        let ranks = batchnorm_accel(&dir, &format!("{model}-sync"), &args);
        for (rank, ours) in ranks.iter().enumerate() {
            let (diff, name) = max_difference(&single, ours);
            assert!(
                diff <= 1e-5,
                "{model} sync: rank {rank}'s {name} differs from one process's by {diff}"
            );
        }
        let mut args = files(8);
        args.push("--no-broadcast-buffers".into());
        let ranks = batchnorm_accel(&dir, &format!("{model}-local"), &args);
        let (diff, name) = max_difference(&ranks[0], &ranks[1]);
        assert!(
            diff > 1e-4 && name.contains("running"),
            "{model}: without buffer broadcasting the ranks' statistics should differ ({name}: {diff})"
        );
    }
}

fn llama_reference(args: &[&str]) {
    reference_batch("llama_reference.py", &[command(args)]);
}

fn read_tensor(path: &Path, name: &str) -> tch::Tensor {
    tch::Tensor::read_safetensors(path)
        .unwrap()
        .into_iter()
        .find(|(n, _)| n == name)
        .unwrap_or_else(|| panic!("{} has no {name}", path.display()))
        .1
}

fn max_abs_difference(a: &tch::Tensor, b: &tch::Tensor) -> f64 {
    assert_eq!(a.size(), b.size());
    (a - b).abs().max().double_value(&[])
}

/// Every tensor of a Hugging Face folder (one file or an index and shards), by name.
fn read_hf_folder(dir: &Path) -> BTreeMap<String, tch::Tensor> {
    let checkpoint = accel_core::HfCheckpoint::open(dir).unwrap();
    let names: Vec<String> = checkpoint.names().map(str::to_owned).collect();
    names.into_iter().map(|n| (n.clone(), checkpoint.read(&n).unwrap())).collect()
}

/// The `llama` example's logits of `tokens` under the model folder `model` (with `extra`
/// flags), written to `out`.
fn llama_eval(model: &Path, tokens: &Path, out: &Path, extra: &[&str]) -> std::process::Output {
    Command::new(example("llama"))
        .args(["--model", model.to_str().unwrap(), "--eval", tokens.to_str().unwrap()])
        .args(["--logits-out", out.to_str().unwrap()])
        .args(extra)
        .output()
        .unwrap()
}

/// How far the logits of transformers' `from_pretrained` of `folder` (whose load report
/// must have nothing missing, unexpected or mismatched) are from the `llama` example's of
/// the same folder; the logits files go in `dir` under `tag`.
fn from_pretrained_logits_diff(dir: &Path, folder: &Path, tokens: &Path, tag: &str) -> f64 {
    from_pretrained_logits_diffs(dir, tokens, &[(folder, tag)])[0]
}

/// from_pretrained_logits_diff of each (folder, tag), transformers' side in one process.
fn from_pretrained_logits_diffs(
    dir: &Path,
    tokens: &Path,
    folders: &[(impl AsRef<Path>, &str)],
) -> Vec<f64> {
    let logits = |tag: &str, side: &str| dir.join(format!("{tag}-{side}.safetensors"));
    let t = tokens.to_str().unwrap();
    let commands: Vec<Vec<String>> = folders
        .iter()
        .map(|(folder, tag)| {
            let out = logits(tag, "load").display().to_string();
            let model = folder.as_ref().to_str().unwrap();
            command(&["load", "--model", model, "--eval", t, "--logits-out", &out])
        })
        .collect();
    reference_batch("llama_reference.py", &commands);
    folders
        .iter()
        .map(|(folder, tag)| {
            let (py_logits, rs_logits) = (logits(tag, "load"), logits(tag, "ours"));
            let output = llama_eval(folder.as_ref(), tokens, &rs_logits, &[]);
            assert!(output.status.success(), "{tag}: {}", String::from_utf8_lossy(&output.stderr));
            let (a, b) = (read_tensor(&py_logits, "logits"), read_tensor(&rs_logits, "logits"));
            max_abs_difference(&a, &b)
        })
        .collect()
}

/// Llama's logits equal transformers' (eager attention, fp32) on a random model saved by
/// `save_pretrained` in several shards, untied and tied.
#[test]
fn llama_logits_equal_transformers_on_a_sharded_checkpoint() {
    let dir = scratch("llama-logits");
    let tokens = dir.join("tokens.safetensors");
    let t = tokens.to_str().unwrap();
    let model = |tied: bool| dir.join(format!("model-tied-{tied}"));
    let logits = |tied: bool, side: &str| dir.join(format!("{side}-{tied}.safetensors"));
    let mut commands = vec![command(&["tokens", "--out", t, "--rows", "4", "--len", "16"])];
    for tied in [false, true] {
        let m = model(tied).display().to_string();
        commands.push(command(&["make", "--out", &m, "--max-shard-size", "30KB"]));
        if tied {
            commands.last_mut().unwrap().push("--tied".into());
        }
        let py = logits(tied, "py").display().to_string();
        commands.push(command(&["logits", "--model", &m, "--eval", t, "--logits-out", &py]));
    }
    reference_batch("llama_reference.py", &commands);
    for tied in [false, true] {
        assert!(model(tied).join("model.safetensors.index.json").exists(), "not sharded");
        let (py, rs) = (logits(tied, "py"), logits(tied, "rs"));
        let output = llama_eval(&model(tied), &tokens, &rs, &[]);
        assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
        let diff = max_abs_difference(&read_tensor(&py, "logits"), &read_tensor(&rs, "logits"));
        assert!(diff <= 1e-4, "tied {tied}: logits differ from transformers' by {diff}");
    }
}

/// A fine-tune on 2 processes under zero3 with activation checkpointing equals
/// transformers + Accelerate DDP (losses 1e-4, weights 2e-4); its losses are bit-identical
/// without activation checkpointing, and with the head fused into the loss (computed on its
/// shards) equal to 1e-6; the folder it writes (sharded, with an index) loads
/// with transformers' `from_pretrained` and gives the logits of the weights it holds.
#[test]
fn llama_fine_tune_under_zero3_with_activation_checkpointing_equals_transformers_and_accelerate() {
    let dir = scratch("llama-fine-tune");
    let (model, tokens) = (dir.join("model"), dir.join("tokens.safetensors"));
    reference_batch(
        "llama_reference.py",
        &[
            command(&["make", "--out", model.to_str().unwrap()]),
            command(&["tokens", "--out", tokens.to_str().unwrap(), "--rows", "12", "--len", "10"]),
        ],
    );
    let common = |out: &Path, losses: &Path| -> Vec<String> {
        ["--model", model.to_str().unwrap(), "--data", tokens.to_str().unwrap(), "--steps", "5"]
            .iter()
            .map(|s| s.to_string())
            .chain(
                ["--batch-size", "2", "--lr", "1e-2", "--weight-decay", "0.01"].map(String::from),
            )
            .chain([
                "--out".into(),
                out.display().to_string(),
                "--losses".into(),
                losses.display().to_string(),
            ])
            .collect()
    };
    let (py_out, py_losses) = (dir.join("py-out"), dir.join("py.jsonl"));
    let port = accel_core::comm::free_port("127.0.0.1").unwrap();
    let output = Command::new(root().join(".venv/bin/torchrun"))
        .args(["--nproc-per-node=2".to_string(), format!("--master-port={port}")])
        .arg(root().join("python/reference/llama_reference.py"))
        .arg("train")
        .args(common(&py_out, &py_losses))
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "Accelerate's fine-tune failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let mut runs = Vec::new();
    // With and without activation checkpointing, and with the head fused into the loss.
    for (checkpointing, fused) in [(true, false), (false, false), (true, true)] {
        let (out, losses) = (
            dir.join(format!("rs-out-{checkpointing}-{fused}")),
            dir.join(format!("rs-{checkpointing}-{fused}.jsonl")),
        );
        let mut program = vec![example("llama")];
        program.extend(common(&out, &losses));
        program.extend(["--strategy", "zero3", "--max-shard-size", "40000"].map(String::from));
        if checkpointing {
            program.push("--activation-checkpointing".into());
        }
        if !fused {
            program.extend(["--loss", "logits"].map(String::from));
        }
        launch(2, program);
        runs.push((out, read_losses(&losses)));
    }
    let reference = read_losses(&py_losses);
    assert_eq!(reference.len(), 5);
    assert_eq!(runs[0].1, runs[1].1, "activation checkpointing changed the losses");
    for (step, (a, b)) in runs[0].1.iter().zip(&runs[2].1).enumerate() {
        assert!((a - b).abs() <= 1e-6, "step {step}: the fused loss {b}, the logits' {a}");
    }
    // The fused head runs on its shards (each process half the vocabulary): its gradients
    // equal the logits' to 1e-7 of their scale (measured: 1.5e-8 at 0.11), and AdamW's
    // first steps, g / (|g| + 1e-8), make that up to 4e-5 on a weight whose gradient is
    // 1e-9; so the bound against transformers' below.
    let (plain, fused) = (read_hf_folder(&runs[0].0), read_hf_folder(&runs[2].0));
    for (name, t) in &plain {
        let diff = max_abs_difference(t, &fused[name]);
        assert!(diff <= 2e-4, "{name}: the fused loss trained it {diff} away");
    }
    for (step, (a, b)) in reference.iter().zip(&runs[0].1).enumerate() {
        assert!((a - b).abs() <= 1e-4, "step {step}: Accelerate's loss {a}, accel's {b}");
    }
    let (ours, theirs) = (read_hf_folder(&runs[0].0), read_hf_folder(&py_out));
    assert_eq!(ours.keys().collect::<Vec<_>>(), theirs.keys().collect::<Vec<_>>());
    for (name, t) in &theirs {
        let diff = max_abs_difference(t, &ours[name]);
        assert!(diff <= 2e-4, "{name} differs from transformers + Accelerate's by {diff}");
    }
    let before = &read_hf_folder(&model)["model.norm.weight"];
    assert!(max_abs_difference(before, &ours["model.norm.weight"]) > 1e-4, "nothing trained");
    assert!(runs[0].0.join("model.safetensors.index.json").exists(), "not sharded");
    let diff = from_pretrained_logits_diff(&dir, &runs[0].0, &tokens, "from-pretrained");
    assert!(diff <= 1e-4, "from_pretrained of accel's folder gives other logits (by {diff})");
}

/// scripts/gpu-check.sh has never run on a GPU; its own plumbing (paths, flags, the parsing
/// of figures, the summary) runs here on every commit: `--cpu-dry-run` takes every step with
/// CPU devices and skips, by name, what only NCCL can do.
#[test]
fn gpu_check_runs_end_to_end_as_a_cpu_dry_run() {
    let dir = scratch("gpu-check");
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    std::os::unix::fs::symlink(build_dir().join("accel"), bin.join("accel")).unwrap();
    for name in ["train", "parity", "char_lm", "lm_bench", "memory_bench", "llama"] {
        std::os::unix::fs::symlink(example(name), bin.join(name)).unwrap();
    }
    let (w, d) = make_weights_and_data(&dir, 0);
    assert!(w.exists() && d.exists());
    let small = dir.join("llama-small");
    hf_families(&["make", "--variant", "llama", "--out", small.to_str().unwrap()]);
    let output = Command::new("bash")
        .arg(root().join("scripts/gpu-check.sh"))
        .arg("--cpu-dry-run")
        .arg(&dir)
        .current_dir(root())
        .env("PYTHON", root().join(".venv/bin/python"))
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{said}{}", String::from_utf8_lossy(&output.stderr));
    let summary = said.split("== summary").nth(1).unwrap_or_else(|| panic!("no summary:\n{said}"));
    assert!(summary.contains("CPU dry run: nothing ran on a GPU"), "{summary}");
    assert!(summary.contains("skip  NCCL self-check"), "{summary}");
    assert!(!summary.contains("FAIL"), "{summary}");
    for step in [
        "PASS  the main job on cpu:0 in bf16",
        "PASS  zero3 at world size 1 through the CPU communicator on cpu:0 = CPU (1e-4)",
        "PASS  zero3: step time and peak memory beside PyTorch",
        "PASS  generation by a device map over cpu:0, the CPU and the disk = the whole model",
        "zero3 on 1 device(s): step",
        "GPT width 64, bf16, 1 cpu: accel",
    ] {
        assert!(summary.contains(step), "{step:?} missing from the summary:\n{summary}");
    }
}

fn hf_families(args: &[&str]) {
    reference_batch("hf_families.py", &[command(args)]);
}

/// python/reference/`script` run once over `commands`, in order (separated by `;`: one
/// process, since importing transformers takes more CPU than most commands); its stdout
/// lines.
fn reference_batch(script: &str, commands: &[Vec<String>]) -> Vec<String> {
    let args = commands.join(&";".to_string());
    let output = Command::new(root().join(".venv/bin/python"))
        .arg(root().join("python/reference").join(script))
        .args(&args)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{script} {args:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).lines().map(str::to_owned).collect()
}

/// `words` as owned strings, for a command of reference_batch.
fn command(words: &[&str]) -> Vec<String> {
    words.iter().map(|w| w.to_string()).collect()
}

/// Every family and RoPE type the model implements gives transformers' logits (sdpa and
/// eager, whole rows and padded ones, fp32, 1e-5)
/// on random checkpoints that transformers itself wrote: Llama with default, linear,
/// dynamic (past max_position_embeddings), llama3 and yarn RoPE; Qwen2 (biases), Qwen2 with
/// sliding layers, tied Qwen2, Qwen3 (q/k norms, head_dim ≠ hidden/heads), Mistral with and
/// without its window (24 tokens, windows of 8). What the model does not understand is
/// refused by name before anything is computed, never computed otherwise with exit 0.
#[test]
fn every_family_gives_transformers_logits_and_what_is_not_understood_is_refused() {
    let dir = scratch("families");
    let tokens = dir.join("tokens.safetensors");
    let t = tokens.to_str().unwrap();
    let llama = |model: &Path, ids: &Path, out: &Path| llama_eval(model, ids, out, &[]);
    // Row 0 padded on the left (3 tokens), row 1 on the right (5).
    let mask = dir.join("mask.safetensors");
    let attention_mask = tch::Tensor::ones([2, 24], (tch::Kind::Int64, tch::Device::Cpu));
    let _ = attention_mask.get(0).narrow(0, 0, 3).fill_(0);
    let _ = attention_mask.get(1).narrow(0, 19, 5).fill_(0);
    tch::Tensor::write_safetensors(&[("attention_mask", &attention_mask)], &mask).unwrap();
    let m = mask.to_str().unwrap();
    let variants = [
        "llama",
        "llama-linear",
        "llama-dynamic",
        "llama3",
        "llama-yarn",
        "qwen2",
        "qwen2-sliding",
        "qwen2-tied",
        "qwen3",
        "mistral",
        "mistral-nowindow",
    ];
    // Each attention, on whole rows and on padded ones (compared where not padded).
    let cases = [("sdpa", false), ("eager", false), ("sdpa", true), ("eager", true)];
    let what = |variant: &str, attention: &str, padded: bool| {
        format!("{variant}, {attention}{}", if padded { ", padded" } else { "" })
    };
    let logits = |what: &str, side: &str| {
        dir.join(format!("{}-{side}.safetensors", what.replace(", ", "-")))
    };
    // transformers' side in one process: the tokens, every checkpoint and its logits.
    let mut commands =
        vec![command(&["tokens", "--out", t, "--vocab", "128", "--batch", "2", "--seq", "24"])];
    for variant in variants {
        let model = dir.join(variant);
        commands.push(command(&["make", "--variant", variant, "--out", model.to_str().unwrap()]));
        for (attention, padded) in cases {
            let py = logits(&what(variant, attention, padded), "py");
            let mut args = vec!["logits", "--model", model.to_str().unwrap(), "--tokens", t];
            args.extend(["--out", py.to_str().unwrap(), "--attention", attention]);
            if padded {
                args.extend(["--mask", m]);
            }
            commands.push(command(&args));
        }
    }
    reference_batch("hf_families.py", &commands);
    let ids = read_tensor(&tokens, "input_ids");
    for variant in variants {
        let model = dir.join(variant);
        for (attention, padded) in cases {
            let what = what(variant, attention, padded);
            let (py, rs) = (logits(&what, "py"), logits(&what, "rs"));
            let mut rs_args = vec!["--attention", attention];
            if padded {
                rs_args.extend(["--eval-mask", m]);
            }
            let output = llama_eval(&model, &tokens, &rs, &rs_args);
            assert!(output.status.success(), "{what}: {}", String::from_utf8_lossy(&output.stderr));
            let real = if padded { attention_mask.shallow_clone() } else { ids.ones_like() };
            let real = real.to_kind(tch::Kind::Bool).unsqueeze(-1);
            let (a, b) = (read_tensor(&py, "logits"), read_tensor(&rs, "logits"));
            let diff = max_abs_difference(
                &a.masked_fill(&real.logical_not(), 0.0),
                &b.masked_fill(&real.logical_not(), 0.0),
            );
            assert!(diff <= 1e-5, "{what}: logits differ from transformers' by {diff}");
            eprintln!("{what}: logits within {diff:e} of transformers'");
        }
    }

    // Each refusal: a copy of a checkpoint with one thing changed.
    let altered = |from: &str, name: &str, edit: &dyn Fn(&mut serde_json::Value)| -> PathBuf {
        let to = dir.join(name);
        std::fs::create_dir_all(&to).unwrap();
        for entry in std::fs::read_dir(dir.join(from)).unwrap() {
            let entry = entry.unwrap();
            std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
        }
        let path = to.join("config.json");
        let mut config: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        edit(&mut config);
        std::fs::write(&path, serde_json::to_vec_pretty(&config).unwrap()).unwrap();
        to
    };
    let bad_ids = dir.join("bad-ids.safetensors");
    let ids = read_tensor(&tokens, "input_ids");
    let _ = ids.get(1).get(3).fill_(999);
    tch::Tensor::write_safetensors(&[("input_ids", &ids)], &bad_ids).unwrap();
    let cases: Vec<(PathBuf, &Path, &str)> = vec![
        (
            altered("llama", "granite", &|c| {
                c["model_type"] = "granite".into();
                c["architectures"] = serde_json::json!(["GraniteForCausalLM"]);
            }),
            &tokens,
            "model_type \"granite\" is not a family this model computes",
        ),
        (
            altered("llama", "multiplier", &|c| c["embedding_multiplier"] = 12.0.into()),
            &tokens,
            "`embedding_multiplier` is not a key this llama model knows",
        ),
        (
            // Qwen2's tensors under Llama's name: its q/k/v biases would be dropped.
            altered("qwen2", "qwen2-as-llama", &|c| {
                c["model_type"] = "llama".into();
                c["architectures"] = serde_json::json!(["LlamaForCausalLM"]);
                c.as_object_mut().unwrap().remove("use_sliding_window");
                c.as_object_mut().unwrap().remove("sliding_window");
                c.as_object_mut().unwrap().remove("max_window_layers");
                c.as_object_mut().unwrap().remove("layer_types");
            }),
            &tokens,
            "UNEXPECTED (in the checkpoint, not in this LlamaForCausalLM model): \
             model.layers.{0, 1, 2}.self_attn.k_proj.bias",
        ),
        (
            altered("llama", "longrope", &|c| {
                c["rope_parameters"]["rope_type"] = "longrope".into();
            }),
            &tokens,
            "RoPE type \"longrope\" is not implemented",
        ),
        (
            altered("llama", "no-heads", &|c| c["num_attention_heads"] = 0.into()),
            &tokens,
            "`num_attention_heads` is 0",
        ),
        (
            altered("qwen3", "sliding-without-window", &|c| {
                c["layer_types"] = serde_json::json!([
                    "sliding_attention",
                    "sliding_attention",
                    "sliding_attention"
                ]);
                c["use_sliding_window"] = false.into();
            }),
            &tokens,
            "layer 0 is \"sliding_attention\" but there is no window",
        ),
        (
            dir.join("llama"),
            &bad_ids,
            "token id 999 at row 1, position 3 is outside the vocabulary",
        ),
    ];
    for (model, ids, expected) in cases {
        let out = dir.join("refused.safetensors");
        let output = llama(&model, ids, &out);
        let said = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{}: accepted", model.display());
        assert!(
            said.contains(expected) && !said.contains("panicked"),
            "{}: {said}",
            model.display()
        );
        assert!(!out.exists(), "{}: logits were written", model.display());
    }
}

/// One generation, run by transformers (`hf_families.py generate`) and by `llama generate`
/// with the same `flags` (and each side's own spelling of the rest).
#[derive(Clone)]
struct Generation<'a> {
    dir: &'a Path,
    model: &'a Path,
    flags: Vec<&'a str>,
    theirs: Vec<&'a str>,
    ours: Vec<&'a str>,
}

impl Generation<'_> {
    fn scores(&self, tag: &str, side: &str) -> PathBuf {
        self.dir.join(format!("{}-{side}.safetensors", tag.replace(' ', "-")))
    }

    /// transformers' side: a command of hf_families.py, which prints the new tokens.
    fn theirs(&self, tag: &str) -> Vec<String> {
        let scores = self.scores(tag, "transformers");
        let mut args = vec!["generate", "--model", self.model.to_str().unwrap()];
        args.extend(["--scores-out", scores.to_str().unwrap()]);
        command(&[&args[..], &self.flags, &self.theirs].concat())
    }

    /// Runs ours; asserts the tokens of transformers' `line` (what `theirs` printed), the same
    /// tokens kept at each step and the kept scores within `tolerance`. Our tokens.
    fn equal(&self, tag: &str, line: &str, tolerance: f64) -> Vec<i64> {
        let tokens = |line: &str| -> Vec<i64> {
            line.trim().split(',').filter(|t| !t.is_empty()).map(|t| t.parse().unwrap()).collect()
        };
        let scores = self.scores(tag, "accel");
        let output = Command::new(example("llama"))
            .args(["generate", "--model", self.model.to_str().unwrap()])
            .args(["--scores-out", scores.to_str().unwrap()])
            .args(&self.flags)
            .args(&self.ours)
            .output()
            .unwrap();
        assert!(output.status.success(), "{tag}: {}", String::from_utf8_lossy(&output.stderr));
        let ours = tokens(&String::from_utf8_lossy(&output.stdout));
        assert_eq!(ours, tokens(line), "{tag}: tokens differ from transformers'");
        let their_scores = read_tensor(&self.scores(tag, "transformers"), "scores");
        let our_scores = read_tensor(&scores, "scores");
        let kept = their_scores.isfinite();
        let same_kept = kept.eq_tensor(&our_scores.isfinite()).all().int64_value(&[]) != 0;
        assert!(same_kept, "{tag}: the tokens kept differ from transformers'");
        let zeroed = |t: &tch::Tensor| t.masked_fill(&kept.logical_not(), 0.0);
        let diff = max_abs_difference(&zeroed(&their_scores), &zeroed(&our_scores));
        assert!(diff <= tolerance, "{tag}: scores differ from transformers' by {diff}");
        eprintln!("{tag}: {} tokens as transformers', scores within {diff:e}", ours.len());
        ours
    }
}

/// Each generation's transformers side in one process, then ours, compared: our tokens by tag.
fn generate_alike(cases: &[(String, Generation, f64)]) -> BTreeMap<String, Vec<i64>> {
    let commands: Vec<Vec<String>> = cases.iter().map(|(tag, g, _)| g.theirs(tag)).collect();
    let lines = reference_batch("hf_families.py", &commands);
    assert_eq!(lines.len(), cases.len(), "one line per generation: {lines:?}");
    cases
        .iter()
        .zip(lines)
        .map(|((tag, g, tol), line)| (tag.clone(), g.equal(tag, &line, *tol)))
        .collect()
}

/// `llama generate` makes transformers' `generate` tokens: greedy on every family shape
/// (a sliding window crossed while decoding, Qwen3's norms, dynamic RoPE growing past
/// max_position_embeddings), sampling with temperature, top-k, top-p and a repetition
/// penalty under one seed (the same draws from libtorch's generator; another seed, other
/// tokens), a stop token, a PEFT adapter, and bf16 weights; each step's processed scores
/// agree too (the same tokens kept; fp32 1e-4).
#[test]
fn generation_gives_transformers_tokens() {
    let dir = scratch("generate");
    let s = |p: &Path| p.to_str().unwrap().to_owned();
    let prompt = vec!["--prompt-ids", "5,17,99,3,42", "--max-new-tokens", "12"];
    let variants = ["llama", "llama-dynamic", "qwen2-sliding", "qwen3", "mistral"];
    let models: Vec<PathBuf> = variants.iter().map(|v| dir.join(v)).collect();
    let adapter = dir.join("adapter");
    let mut made: Vec<Vec<String>> = variants
        .iter()
        .zip(&models)
        .map(|(v, model)| command(&["make", "--variant", v, "--out", &s(model)]))
        .collect();
    let llama_dir = s(&models[0]);
    made.push(command(&["adapter", "--model", &llama_dir, "--out", &s(&adapter), "--seed", "3"]));
    reference_batch("hf_families.py", &made);
    let (llama, mistral) = (&models[0], &models[4]);
    // No --eos-ids: both sides stop at the checkpoint's stop token (config.json's eos_token_id).
    let greedy =
        Generation { dir: &dir, model: llama, flags: prompt.clone(), theirs: vec![], ours: vec![] };
    let mut cases: Vec<(String, Generation, f64)> = variants
        .iter()
        .zip(&models)
        .map(|(v, model)| (format!("{v} greedy"), Generation { model, ..greedy.clone() }, 1e-4))
        .collect();
    let mut sampling = prompt.clone();
    sampling.extend(["--do-sample", "--temperature", "0.8", "--top-k", "20", "--top-p", "0.9"]);
    sampling.extend(["--repetition-penalty", "1.3", "--seed", "7"]);
    let sampled = Generation { flags: sampling.clone(), ..greedy.clone() };
    let mut reseeded = sampling.clone();
    *reseeded.last_mut().unwrap() = "8";
    let adapter = s(&adapter);
    cases.extend([
        ("llama sampled".into(), sampled.clone(), 1e-4),
        ("mistral sampled".into(), Generation { model: mistral, ..sampled }, 1e-4),
        ("llama sampled, seed 8".into(), Generation { flags: reseeded, ..greedy.clone() }, 1e-4),
        // A PEFT adapter on top, and bf16 weights.
        (
            "llama greedy with a LoRA adapter".into(),
            Generation {
                theirs: vec!["--adapter", &adapter],
                ours: vec!["--lora-adapter", &adapter],
                ..greedy.clone()
            },
            1e-4,
        ),
        (
            "llama greedy in bf16".into(),
            Generation {
                theirs: vec!["--dtype", "bfloat16"],
                ours: vec!["--precision", "bf16"],
                ..greedy.clone()
            },
            5e-2,
        ),
    ]);
    let tokens = generate_alike(&cases);
    assert_ne!(
        tokens["llama sampled, seed 8"], tokens["llama sampled"],
        "the seed changed nothing"
    );

    // A stop token: the second greedy token, so generation stops after two.
    let second = tokens["llama greedy"][1].to_string();
    let stop = ["--eos-ids", second.as_str()];
    let stopping = Generation { flags: [prompt.clone(), stop.to_vec()].concat(), ..greedy };
    let tag = "llama with a stop token".to_string();
    assert_eq!(generate_alike(&[(tag.clone(), stopping, 1e-4)])[&tag].len(), 2);
}

/// `llama generate` of the bench's 106M Llama with `flags`: its new tokens and its report
/// (peak resident memory above its baseline, the budget, the largest module), and the
/// device map it printed (as a map from module to place), if any.
fn generate_with(
    model: &Path,
    flags: &[&str],
) -> (Vec<i64>, serde_json::Value, Option<serde_json::Value>) {
    let output = Command::new(example("llama"))
        .args(["generate", "--model", model.to_str().unwrap(), "--prompt-ids", "11,22,33,4"])
        .args(["--max-new-tokens", "6"])
        .args(flags)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(output.status.success(), "llama generate {flags:?}: {said}");
    let map = said.lines().find_map(|l| l.strip_prefix("llama generate: device map ")).map(|m| {
        serde_json::from_str(&m.replace('\'', "\"")).unwrap_or_else(|e| panic!("{m}: {e}"))
    });
    // (`--print-map` stops before generating: no report.)
    let report = said.lines().rev().find(|l| l.starts_with('{')).unwrap_or("null");
    let line = String::from_utf8_lossy(&output.stdout).trim().to_owned();
    let tokens = line.split(',').filter(|t| !t.is_empty()).map(|t| t.parse().unwrap()).collect();
    (tokens, serde_json::from_str(report).unwrap(), map)
}

/// Big-model inference on the CPU, the bench's 106M Llama (424 MB in fp32): the device map
/// for a memory budget is Accelerate's `infer_auto_device_map` of the same model (whole on
/// the CPU, part on the disk, all on the disk; fp32 and bf16); generating by the map gives
/// the tokens of the model loaded whole, while this process's peak resident memory stays
/// within the budget plus its largest module (the part of the model that is in memory at
/// once, the embedding or the head, 98 MB) and a small margin for activations; modules
/// converted to another dtype are written to the offload folder and read from there.
#[test]
fn a_model_larger_than_its_budget_generates_by_a_device_map() {
    let dir = scratch("dispatch");
    let model = dir.join("llama-106m");
    llama_reference(&["make", "--size", "100m", "--out", model.to_str().unwrap()]);
    // A tied head (Qwen2 with tie_word_embeddings): it goes where the embedding goes.
    let tied = dir.join("qwen2-tied");
    let untied_budgets = [
        ("150MiB", "float32"),
        ("300MiB", "float32"),
        ("500MiB", "float32"),
        ("170MiB", "bfloat16"),
    ];
    let tied_budgets = ["200000", "400000", "500000", "10000000"];
    // Accelerate's maps, in one process.
    let mut commands =
        vec![command(&["make", "--variant", "qwen2-tied", "--out", tied.to_str().unwrap()])];
    for (budget, dtype) in untied_budgets {
        let mut args = vec!["device-map", "--model", model.to_str().unwrap()];
        args.extend(["--max-memory", budget, "--dtype", dtype]);
        commands.push(command(&args));
    }
    for budget in tied_budgets {
        commands.push(command(&[
            "device-map",
            "--model",
            tied.to_str().unwrap(),
            "--max-memory",
            budget,
        ]));
    }
    let maps: Vec<serde_json::Value> = reference_batch("hf_families.py", &commands)
        .iter()
        .filter(|line| line.starts_with('{'))
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    assert_eq!(maps.len(), untied_budgets.len() + tied_budgets.len(), "{maps:?}");
    for ((budget, dtype), theirs) in untied_budgets.into_iter().zip(&maps) {
        let precision = if dtype == "bfloat16" { "bf16" } else { "no" };
        let flags = ["--max-memory", budget, "--precision", precision, "--print-map"];
        let ours = generate_with(&model, &flags).2.expect("a device map");
        assert_eq!(&ours, theirs, "{budget} {dtype}: the device map differs from Accelerate's");
        eprintln!("{budget} {dtype}: Accelerate's device map {ours}");
    }
    // Generating by the map of the tied model (part on the disk) gives the tokens of the
    // model loaded whole.
    let whole_tied = generate_with(&tied, &[]).0;
    for (budget, theirs) in tied_budgets.into_iter().zip(&maps[untied_budgets.len()..]) {
        let ours = generate_with(&tied, &["--max-memory", budget, "--print-map"]).2.unwrap();
        assert_eq!(&ours, theirs, "tied, {budget} bytes: the device map differs from Accelerate's");
        eprintln!("tied, {budget} bytes: Accelerate's device map {ours}");
        let tokens = generate_with(&tied, &["--max-memory", budget]).0;
        assert_eq!(tokens, whole_tied, "tied, {budget} bytes: other tokens than the whole model's");
    }
    let mib = |n: f64| n * 1024.0 * 1024.0;
    // Activations, the key/value cache, the logits and the allocator's slack.
    let margin = mib(24.0);
    let (whole, report, _) = generate_with(&model, &[]);
    eprintln!(
        "whole: {whole:?}, peak {:.0} MiB",
        report["peak_bytes"].as_f64().unwrap() / mib(1.0)
    );
    for budget in ["150MiB", "300MiB"] {
        let (tokens, report, _) = generate_with(&model, &["--max-memory", budget]);
        assert_eq!(tokens, whole, "{budget}: tokens differ from the model loaded whole");
        let peak = report["peak_bytes"].as_f64().unwrap();
        let limit = report["budget_bytes"].as_f64().unwrap()
            + report["largest_module_bytes"].as_f64().unwrap()
            + margin;
        assert!(peak <= limit, "{budget}: peak {peak} above {limit}");
        eprintln!(
            "{budget}: the same tokens, peak {:.0} MiB (limit {:.0})",
            peak / mib(1.0),
            limit / mib(1.0)
        );
    }
    // bf16: the checkpoint holds fp32, so the modules on the disk are written converted.
    let folder = dir.join("offload");
    let (bf16_whole, _, _) = generate_with(&model, &["--precision", "bf16"]);
    let offloaded = ["--precision", "bf16", "--max-memory", "100MiB", "--offload-folder"];
    let (tokens, report, _) =
        generate_with(&model, &[&offloaded[..], &[folder.to_str().unwrap()]].concat());
    assert_eq!(tokens, bf16_whole, "bf16 offloaded: tokens differ from bf16 whole");
    let files = std::fs::read_dir(&folder).unwrap().count();
    assert!(files > 0, "nothing was written to the offload folder");
    // Converting a module reads it in fp32 first: the largest module in both dtypes.
    let peak = report["peak_bytes"].as_f64().unwrap();
    let largest = report["largest_module_bytes"].as_f64().unwrap();
    let limit = mib(100.0) + 3.0 * largest + margin;
    assert!(peak <= limit, "bf16 under 100MiB: peak {peak} above {limit}");
    eprintln!(
        "bf16 under 100MiB: {files} modules written to the offload folder, peak {:.0} MiB (limit {:.0})",
        peak / mib(1.0),
        limit / mib(1.0)
    );
}

/// A 2-process zero3 fine-tune with activation checkpointing of Qwen2 (sliding layers; tied),
/// Qwen3, Mistral (windowed) and a Llama 3.1-style RoPE equals transformers + Accelerate DDP
/// (losses 1e-5, weights 1e-4), and the folder it writes loads with `from_pretrained` with
/// nothing missing, unexpected or mismatched, its config's dtype saying float32.
#[test]
fn families_fine_tune_under_zero3_as_transformers_and_accelerate_do() {
    let dir = scratch("families-fine-tune");
    let tokens = dir.join("tokens.safetensors");
    let variants = ["qwen2-sliding", "qwen2-tied", "qwen3", "mistral", "llama3"];
    let t = tokens.to_str().unwrap();
    let mut made =
        vec![command(&["tokens", "--out", t, "--vocab", "128", "--batch", "12", "--seq", "12"])];
    for variant in variants {
        made.push(command(&[
            "make",
            "--variant",
            variant,
            "--out",
            &dir.join(variant).display().to_string(),
        ]));
    }
    reference_batch("hf_families.py", &made);
    let out = |variant: &str, side: &str| dir.join(format!("{variant}-{side}"));
    let losses = |variant: &str, side: &str| dir.join(format!("{variant}-{side}.jsonl"));
    let common = |variant: &str, side: &str| -> Vec<String> {
        let model = dir.join(variant).display().to_string();
        command(&["--model", &model, "--data", t, "--steps", "4", "--batch-size", "2"])
            .into_iter()
            .chain(command(&["--lr", "1e-2", "--weight-decay", "0.01"]))
            .chain(["--out".into(), out(variant, side).display().to_string()])
            .chain(["--losses".into(), losses(variant, side).display().to_string()])
            .collect()
    };
    // Accelerate's fine-tunes, one after the other in one torchrun.
    let trains: Vec<Vec<String>> =
        variants.iter().map(|v| [vec!["train".to_string()], common(v, "py")].concat()).collect();
    let port = accel_core::comm::free_port("127.0.0.1").unwrap();
    let output = Command::new(root().join(".venv/bin/torchrun"))
        .args(["--nproc-per-node=2".to_string(), format!("--master-port={port}")])
        .arg(root().join("python/reference/llama_reference.py"))
        .args(trains.join(&";".to_string()))
        .output()
        .unwrap();
    assert!(output.status.success(), "Accelerate: {}", String::from_utf8_lossy(&output.stderr));
    for variant in variants {
        let mut program = vec![example("llama")];
        program.extend(common(variant, "rs"));
        // The logits computed whole, as transformers computes them: the head fused and
        // computed on its shards sums the vocabulary in halves, and AdamW's first steps,
        // g / (|g| + 1e-8), turn that rounding into up to 3e-3 on a weight whose gradient is
        // 1e-9 (qwen2-tied: -2.8e-9 against -9.3e-9 at a scale of 0.08). The fused path is
        // held to the logits' in the Llama fine-tune test and in strategy/fsdp/tests.rs.
        program.extend(["--loss", "logits"].map(String::from));
        program.extend(["--strategy", "zero3", "--activation-checkpointing"].map(String::from));
        launch(2, program);
        let (reference, ours) =
            (read_losses(&losses(variant, "py")), read_losses(&losses(variant, "rs")));
        assert_eq!(reference.len(), 4);
        for (step, (a, b)) in reference.iter().zip(&ours).enumerate() {
            assert!(
                (a - b).abs() <= 1e-5,
                "{variant} step {step}: Accelerate's loss {a}, accel's {b}"
            );
        }
        let (theirs, mine) =
            (read_hf_folder(&out(variant, "py")), read_hf_folder(&out(variant, "rs")));
        assert_eq!(theirs.keys().collect::<Vec<_>>(), mine.keys().collect::<Vec<_>>(), "{variant}");
        for (name, t) in &theirs {
            let diff = max_abs_difference(t, &mine[name]);
            assert!(
                diff <= 1e-4,
                "{variant}: {name} differs from transformers + Accelerate's by {diff}"
            );
        }
        let config: serde_json::Value =
            serde_json::from_slice(&std::fs::read(out(variant, "rs").join("config.json")).unwrap())
                .unwrap();
        assert_eq!(config["dtype"], "float32", "{variant}");
    }
    // from_pretrained of accel's folders: nothing missing or unexpected (the reference
    // refuses otherwise), and the logits of the weights they hold.
    let folders: Vec<(PathBuf, &str)> = variants.iter().map(|v| (out(v, "rs"), *v)).collect();
    let diffs = from_pretrained_logits_diffs(&dir, &tokens, &folders);
    for (variant, diff) in variants.iter().zip(diffs) {
        assert!(
            diff <= 1e-4,
            "{variant}: from_pretrained of accel's folder gives other logits ({diff})"
        );
        eprintln!("{variant}: fine-tune equals Accelerate's and loads back");
    }
}

/// LoRA as PEFT writes it: an adapter peft made gives peft's logits; a 2-process DDP
/// fine-tune of it (base frozen) equals transformers + peft + Accelerate DDP (losses 1e-5,
/// adapters 1e-4) and is saved as PEFT's folder, which peft loads to our logits; fresh
/// adapters (`--lora-r`) load in peft too; `--merge-out` folds the adapter into a plain
/// checkpoint that `from_pretrained` loads (nothing missing or unexpected) to the adapter's
/// logits; under zero3 (adapters sharded) the fine-tune equals ddp's.
#[test]
fn lora_adapters_load_train_save_and_merge_as_peft_does() {
    let dir = scratch("lora");
    let (model, tokens, adapter) =
        (dir.join("base"), dir.join("tokens.safetensors"), dir.join("adapter"));
    let s = |p: &Path| p.to_str().unwrap().to_owned();
    let ours = |adapter: &Path, out: &Path| {
        let output = llama_eval(&model, &tokens, out, &["--lora-adapter", &s(adapter)]);
        assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
        read_tensor(out, "logits")
    };
    // peft's logits of the base with `adapter`, written to `out`.
    let peft = |adapter: &Path, out: &Path| {
        let (model, tokens) = (s(&model), s(&tokens));
        command(&["logits", "--model", &model, "--adapter", &s(adapter), "--tokens", &tokens])
            .into_iter()
            .chain(["--out".into(), s(out)])
            .collect::<Vec<String>>()
    };
    reference_batch(
        "hf_families.py",
        &[
            command(&["make", "--variant", "llama", "--out", &s(&model)]),
            command(&[
                "tokens",
                "--out",
                &s(&tokens),
                "--vocab",
                "128",
                "--batch",
                "12",
                "--seq",
                "12",
            ]),
            command(&[
                "adapter",
                "--model",
                &s(&model),
                "--out",
                &s(&adapter),
                "--r",
                "4",
                "--alpha",
                "8",
            ]),
            peft(&adapter, &dir.join("a-py.safetensors")),
        ],
    );
    let diff = max_abs_difference(
        &read_tensor(&dir.join("a-py.safetensors"), "logits"),
        &ours(&adapter, &dir.join("a-rs.safetensors")),
    );
    assert!(diff <= 1e-4, "peft's adapter: logits differ from peft's by {diff}");

    // Fine-tune the adapter on 2 processes, both sides.
    let common = |out: &Path, losses: &Path| -> Vec<String> {
        ["--model", &s(&model), "--data", &s(&tokens), "--lora-adapter", &s(&adapter)]
            .iter()
            .map(|a| a.to_string())
            .chain(
                ["--steps", "4", "--batch-size", "2", "--lr", "1e-2", "--weight-decay", "0.01"]
                    .map(String::from),
            )
            .chain(["--out".into(), s(out), "--losses".into(), s(losses)])
            .collect()
    };
    let (py_out, py_losses) = (dir.join("py-out"), dir.join("py.jsonl"));
    let port = accel_core::comm::free_port("127.0.0.1").unwrap();
    let output = Command::new(root().join(".venv/bin/torchrun"))
        .args(["--nproc-per-node=2".to_string(), format!("--master-port={port}")])
        .arg(root().join("python/reference/llama_reference.py"))
        .arg("train")
        .args(common(&py_out, &py_losses))
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "peft + Accelerate: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let (rs_out, rs_losses) = (dir.join("rs-out"), dir.join("rs.jsonl"));
    let mut program = vec![example("llama")];
    program.extend(common(&rs_out, &rs_losses));
    program.extend(["--strategy", "ddp"].map(String::from));
    launch(2, program);
    let (reference, mine) = (read_losses(&py_losses), read_losses(&rs_losses));
    assert_eq!(reference.len(), 4);
    for (step, (a, b)) in reference.iter().zip(&mine).enumerate() {
        assert!((a - b).abs() <= 1e-5, "step {step}: peft + Accelerate's loss {a}, accel's {b}");
    }
    let read = |d: &Path| -> BTreeMap<String, tch::Tensor> {
        tch::Tensor::read_safetensors(d.join("adapter_model.safetensors"))
            .unwrap()
            .into_iter()
            .collect()
    };
    let (theirs, trained) = (read(&py_out), read(&rs_out));
    assert_eq!(
        theirs.keys().collect::<Vec<_>>(),
        trained.keys().collect::<Vec<_>>(),
        "adapter names"
    );
    for (name, t) in &theirs {
        let diff = max_abs_difference(t, &trained[name]);
        assert!(diff <= 1e-4, "{name} differs from peft + Accelerate's by {diff}");
    }
    assert!(
        max_abs_difference(
            &read(&adapter)[theirs.keys().next().unwrap()],
            &trained[theirs.keys().next().unwrap()]
        ) > 1e-4,
        "nothing trained"
    );
    // Fresh adapters: PEFT's initialisation (B = 0), saved in PEFT's format.
    let fresh = dir.join("fresh");
    let mut program = vec![example("llama")];
    program.extend(
        ["--model", &s(&model), "--data", &s(&tokens), "--lora-r", "8", "--lora-alpha", "16"]
            .map(String::from),
    );
    program.extend(
        ["--lora-target", "q_proj,k_proj,v_proj,o_proj", "--steps", "2", "--out", &s(&fresh)]
            .map(String::from),
    );
    launch(2, program);
    // peft loads both adapters accel wrote, in one process.
    let (trained_py, fresh_py) = (dir.join("t-py.safetensors"), dir.join("f-py.safetensors"));
    reference_batch("hf_families.py", &[peft(&rs_out, &trained_py), peft(&fresh, &fresh_py)]);
    let diff = max_abs_difference(
        &read_tensor(&trained_py, "logits"),
        &ours(&rs_out, &dir.join("t-rs.safetensors")),
    );
    assert!(diff <= 1e-4, "peft loads accel's adapter to other logits ({diff})");
    let diff = max_abs_difference(
        &read_tensor(&fresh_py, "logits"),
        &ours(&fresh, &dir.join("f-rs.safetensors")),
    );
    assert!(diff <= 1e-4, "peft loads accel's fresh adapter to other logits ({diff})");

    // Merged: a plain checkpoint.
    let merged = dir.join("merged");
    let output = Command::new(example("llama"))
        .args(["--model", &s(&model), "--lora-adapter", &s(&rs_out), "--merge-out", &s(&merged)])
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let loaded = dir.join("merged-py.safetensors");
    llama_reference(&[
        "load",
        "--model",
        &s(&merged),
        "--eval",
        &s(&tokens),
        "--logits-out",
        &s(&loaded),
    ]);
    let diff = max_abs_difference(
        &read_tensor(&loaded, "logits"),
        &read_tensor(&dir.join("t-rs.safetensors"), "logits"),
    );
    assert!(diff <= 1e-4, "the merged checkpoint gives other logits than its adapter ({diff})");

    // Under zero3 the adapters and their optimizer state are sharded: the same run.
    let (z3_out, z3_losses) = (dir.join("z3-out"), dir.join("z3.jsonl"));
    let mut program = vec![example("llama")];
    program.extend(common(&z3_out, &z3_losses));
    program.extend(["--strategy", "zero3"].map(String::from));
    launch(2, program);
    assert_eq!(read_losses(&z3_losses), mine, "zero3's losses differ from ddp's");
    let sharded = read(&z3_out);
    for (name, t) in &trained {
        let diff = max_abs_difference(t, &sharded[name]);
        assert!(diff <= 1e-6, "{name}: zero3's adapter differs from ddp's by {diff}");
    }

    // A strategy not tested with LoRA: said, not attempted.
    let output = Command::new(example("llama"))
        .args(["--model", &s(&model), "--lora-adapter", &s(&adapter), "--data", &s(&tokens)])
        .args(["--out", &s(&dir.join("never")), "--strategy", "auto"])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&output.stderr);
    assert!(
        !output.status.success() && said.contains("LoRA runs under single, ddp, zero3 or fsdp"),
        "{said}"
    );
}
