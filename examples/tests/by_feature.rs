//! The by-feature examples and the CNN run, on 1 and on 2 processes, and check their own
//! claims (they exit non-zero otherwise).

use std::path::{Path, PathBuf};

use accel_core::launch::{LaunchPlan, run};

fn example(name: &str) -> String {
    let dir = std::env::current_exe().unwrap().parent().unwrap().parent().unwrap().join("examples");
    let path = dir.join(name);
    assert!(path.exists(), "{} is missing: `cargo test` builds the examples first", path.display());
    path.display().to_string()
}

fn launch(processes: usize, program: Vec<String>, env: &[(&str, &Path)]) {
    let mut plan = LaunchPlan { rank0_only: true, ..LaunchPlan::local(processes, program) };
    plan.env.extend(env.iter().map(|(k, v)| (k.to_string(), v.display().to_string())));
    assert_eq!(run(&plan).unwrap(), 0, "{:?} on {processes} process(es) failed", plan.program);
}

#[test]
fn accumulation_evaluation_mixed_precision_fp8_sharding_and_local_sgd_on_1_and_2_processes() {
    for name in ["accumulation", "evaluation", "mixed_precision", "fp8", "sharding", "local_sgd"] {
        for processes in [1, 2] {
            launch(processes, vec![example(name)], &[]);
        }
    }
}

#[test]
fn tensor_parallelism_through_the_attribute_matches_the_whole_model_on_2_processes() {
    // tensor_parallel = 2 is in the attribute: it needs a multiple of 2 processes.
    launch(2, vec![example("tensor_parallel")], &[]);
}

/// DDP and zero3 alike to 1e-4; fp8 through the tensor-parallel layers (2 tensor ranks)
/// within 2% of bf16 on the same layout.
#[test]
fn the_transformer_trains_alike_under_ddp_and_zero3_and_in_fp8_split_by_tensor() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("char-lm");
    std::fs::create_dir_all(&dir).unwrap();
    let text = Path::new(env!("CARGO_MANIFEST_DIR")).join("../data/kjv-genesis-exodus.txt");
    let mut losses = Vec::new();
    let runs: [(&str, &[&str]); 4] = [
        ("ddp", &[]),
        ("zero3", &[]),
        ("ddp", &["--precision", "bf16", "--tensor-parallel", "2"]),
        ("ddp", &["--precision", "fp8", "--tensor-parallel", "2"]),
    ];
    for (i, (strategy, extra)) in runs.into_iter().enumerate() {
        let metrics = dir.join(format!("{strategy}-{i}.json"));
        let args = ["--steps", "12", "--blocks", "2", "--target", "10", "--text"];
        let mut program = vec![example("char_lm")];
        program.extend(extra.iter().chain(&args).map(|s| s.to_string()));
        program.extend([text.display().to_string(), "--metrics".into()]);
        program.push(metrics.display().to_string());
        let mut plan = LaunchPlan { rank0_only: true, ..LaunchPlan::local(2, program) };
        plan.env.push(("ACCEL_STRATEGY".into(), strategy.into()));
        assert_eq!(run(&plan).unwrap(), 0, "char_lm under {strategy} failed");
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&metrics).unwrap()).unwrap();
        losses.push(json["held_out_loss"].as_f64().unwrap());
    }
    assert!(losses[0] < 4.0, "12 steps leave the uniform guess (4.28) behind: {}", losses[0]);
    assert!((losses[0] - losses[1]).abs() < 1e-4, "ddp {} vs zero3 {}", losses[0], losses[1]);
    let fp8 = (losses[3] - losses[2]).abs() / losses[2];
    assert!(
        fp8 > 0.0 && fp8 < 0.02,
        "fp8 {} vs bf16 {}: {:.2}% apart",
        losses[3],
        losses[2],
        fp8 * 100.0
    );
}

#[test]
fn the_cnn_reaches_its_target_on_2_processes() {
    launch(2, vec![example("cnn")], &[]);
}

#[test]
fn checkpointing_stops_and_resumes_on_1_and_2_processes() {
    for processes in [1, 2] {
        let dir: PathBuf =
            Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("by-feature-{processes}"));
        let _ = std::fs::remove_dir_all(&dir);
        let env = [("CHECKPOINT_DIR", dir.as_path())];
        launch(processes, vec![example("checkpointing"), "--stop-after".into(), "20".into()], &env);
        assert!(dir.join("checkpoint_0/manifest.json").exists());
        launch(processes, vec![example("checkpointing"), "--resume".into()], &env);
        // One checkpoint per epoch after the stop, the oldest pruned to a limit of 3.
        assert!(dir.join("checkpoint_3").exists() && !dir.join("checkpoint_0").exists());
    }
}

/// Each step's loss (`--losses`) and the final whole weights (`--weights`) of one char_lm run.
fn char_lm_run(
    name: &str,
    processes: usize,
    extra: &[&str],
) -> (Vec<f64>, Vec<(String, tch::Tensor)>) {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("char-lm-split");
    std::fs::create_dir_all(&dir).unwrap();
    let text = Path::new(env!("CARGO_MANIFEST_DIR")).join("../data/kjv-genesis-exodus.txt");
    let (losses, weights) =
        (dir.join(format!("{name}.jsonl")), dir.join(format!("{name}.safetensors")));
    let small = "--steps 8 --width 64 --blocks 2 --heads 4 --context 32 --batch-size 8 \
                 --accumulate 2 --target 10";
    let mut program = vec![example("char_lm")];
    program.extend(small.split(' ').chain(extra.iter().copied()).map(String::from));
    program.extend(["--text".into(), text.display().to_string()]);
    program.extend(["--losses".into(), losses.display().to_string()]);
    program.extend(["--weights".into(), weights.display().to_string()]);
    let plan = LaunchPlan { rank0_only: true, ..LaunchPlan::local(processes, program) };
    assert_eq!(run(&plan).unwrap(), 0, "char_lm {extra:?} on {processes} process(es) failed");
    let losses = std::fs::read_to_string(&losses).unwrap();
    let losses = losses
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"].as_f64().unwrap())
        .collect();
    let mut weights = tch::Tensor::read_safetensors(&weights).unwrap();
    weights.sort_by(|a, b| a.0.cmp(&b.0));
    (losses, weights)
}

#[test]
fn the_transformer_trains_alike_split_by_tensor_sequence_and_pipeline() {
    let (reference, whole) = char_lm_run("one-process", 1, &[]);
    assert_eq!(reference.len(), 8);
    let runs: [(&str, usize, &[&str]); 3] = [
        ("tp2-sp", 2, &["--tensor-parallel", "2", "--sequence-parallel"]),
        ("pp2-1f1b", 2, &["--pipeline-parallel", "2"]),
        (
            "tp2-pp2-gpipe-sp",
            4,
            &[
                "--tensor-parallel",
                "2",
                "--pipeline-parallel",
                "2",
                "--schedule",
                "gpipe",
                "--sequence-parallel",
            ],
        ),
    ];
    for (name, processes, extra) in runs {
        let (losses, weights) = char_lm_run(name, processes, extra);
        for (step, (a, b)) in reference.iter().zip(&losses).enumerate() {
            assert!((a - b).abs() < 1e-5, "{name}: step {} loss {b} vs one process {a}", step + 1);
        }
        assert_eq!(weights.len(), whole.len(), "{name}: the whole state dict has other names");
        for ((key, a), (other, b)) in whole.iter().zip(&weights) {
            assert_eq!(key, other);
            // Key biases get no gradient (softmax ignores a shift of every score), so Adam
            // turns their rounding noise into full steps: they cannot agree, nor matter.
            if key.ends_with("qkv.bias") {
                continue;
            }
            let relative = (a - b).norm().double_value(&[]) / a.norm().double_value(&[]);
            assert!(relative < 1e-4, "{name}: {key} differs from one process by {relative:.2e}");
        }
    }
}

/// The main job under `accel launch --max-restarts 1` with a rank that fails after epoch 5
/// (checkpoints every 3 epochs): the restarted group resumes from epoch 3 and ends with
/// exactly the weights of a run that never failed.
#[test]
fn the_main_job_restarted_after_a_failure_ends_as_an_uninterrupted_run() {
    let root = Path::new(env!("CARGO_TARGET_TMPDIR")).join("restarts");
    let _ = std::fs::remove_dir_all(&root);
    let final_weights = |tag: &str, extra: &[&str], max_restarts: usize| {
        let out = root.join(tag);
        let mut program = vec![example("train")];
        let args = ["--cpu", "--epochs", "8", "--checkpoint-every", "3", "--target", "0.5"];
        program.extend(args.iter().chain(extra).map(|s| s.to_string()));
        program.extend(["--out".into(), out.display().to_string()]);
        let plan = LaunchPlan { rank0_only: true, max_restarts, ..LaunchPlan::local(2, program) };
        assert_eq!(run(&plan).unwrap(), 0, "train ({tag}) failed");
        let newest = std::fs::read_dir(out.join("checkpoints"))
            .unwrap()
            .filter_map(|e| {
                let name = e.unwrap().file_name().into_string().unwrap();
                name.strip_prefix("checkpoint_").and_then(|i| i.parse::<u64>().ok())
            })
            .max()
            .unwrap();
        let file = out.join(format!("checkpoints/checkpoint_{newest}/model.safetensors"));
        tch::Tensor::read_safetensors(file)
            .unwrap()
            .into_iter()
            .collect::<std::collections::BTreeMap<_, _>>()
    };
    let straight = final_weights("straight", &[], 0);
    let restarted = final_weights("restarted", &["--fail-after-epoch", "5"], 1);
    assert_eq!(straight.len(), restarted.len());
    for (name, a) in &straight {
        let b = &restarted[name];
        let diff = (a - b).abs().max().double_value(&[]);
        assert!(diff <= 1e-6, "{name}: the restarted run differs by {diff}");
    }
}

/// char_lm under zero2 on 2 processes, checkpointing every 2 of its 12 steps, killed once —
/// after a step picked at random, in the middle of a save on the rank writing its shard, and
/// on the main process between writing a checkpoint and publishing it — and restarted by
/// `accel launch --max-restarts 1`: each ends with the weights of the run that was never
/// interrupted.
#[test]
fn char_lm_killed_anywhere_under_zero2_resumes_to_the_uninterrupted_weights() {
    let root = Path::new(env!("CARGO_TARGET_TMPDIR")).join("char-lm-kills");
    let _ = std::fs::remove_dir_all(&root);
    let text = Path::new(env!("CARGO_MANIFEST_DIR")).join("../data/kjv-genesis-exodus.txt");
    let final_weights = |tag: &str, extra: &[String], fault: Option<&str>| {
        let dir = root.join(tag);
        std::fs::create_dir_all(&dir).unwrap();
        let small = "--steps 12 --width 32 --blocks 2 --heads 2 --context 16 --batch-size 8 \
                     --target 10 --checkpoint-every 2";
        let mut program = vec![example("char_lm")];
        program.extend(small.split(' ').map(String::from).chain(extra.iter().cloned()));
        let weights = dir.join("weights.safetensors");
        for (flag, path) in [
            ("--text", text.clone()),
            ("--checkpoint-dir", dir.join("checkpoints")),
            ("--weights", weights.clone()),
        ] {
            program.extend([flag.to_string(), path.display().to_string()]);
        }
        let mut plan =
            LaunchPlan { rank0_only: true, max_restarts: 1, ..LaunchPlan::local(2, program) };
        plan.env.push(("ACCEL_STRATEGY".into(), "zero2".into()));
        plan.env.extend(fault.map(|f| ("ACCEL_TEST_FAULT".to_string(), f.to_string())));
        assert_eq!(run(&plan).unwrap(), 0, "char_lm ({tag}) failed");
        let mut weights = tch::Tensor::read_safetensors(&weights).unwrap();
        weights.sort_by(|a, b| a.0.cmp(&b.0));
        weights
    };
    let straight = final_weights("straight", &[], None);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap();
    let kill_step = 1 + nanos.subsec_nanos() as u64 % 11;
    let runs = [
        (
            format!("killed after step {kill_step}"),
            vec!["--kill-after-step".into(), kill_step.to_string()],
            None,
        ),
        (
            "killed writing its shard (rank 1, 3rd save)".into(),
            vec![],
            Some("save-own-files-written:1:3"),
        ),
        (
            "killed before publishing (rank 0, 2nd save)".into(),
            vec![],
            Some("save-before-publish:0:2"),
        ),
    ];
    for (i, (tag, extra, fault)) in runs.iter().enumerate() {
        let restarted = final_weights(&format!("run{i}"), extra, *fault);
        assert_eq!(straight.len(), restarted.len());
        for ((name, a), (other, b)) in straight.iter().zip(&restarted) {
            assert_eq!(name, other);
            let diff = (a - b).abs().max().double_value(&[]);
            assert!(diff <= 1e-6, "{tag}: {name} differs from the uninterrupted run by {diff}");
        }
    }
}
