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
fn accumulation_evaluation_mixed_precision_sharding_and_local_sgd_on_1_and_2_processes() {
    for name in ["accumulation", "evaluation", "mixed_precision", "sharding", "local_sgd"] {
        for processes in [1, 2] {
            launch(processes, vec![example(name)], &[]);
        }
    }
}

#[test]
fn the_transformer_trains_alike_under_ddp_and_zero3() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("char-lm");
    std::fs::create_dir_all(&dir).unwrap();
    let text = Path::new(env!("CARGO_MANIFEST_DIR")).join("../data/kjv-genesis-exodus.txt");
    let mut losses = Vec::new();
    for strategy in ["ddp", "zero3"] {
        let metrics = dir.join(format!("{strategy}.json"));
        let args = ["--steps", "12", "--blocks", "2", "--target", "10", "--text"];
        let mut program = vec![example("char_lm")];
        program.extend(args.iter().map(|s| s.to_string()));
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
