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
fn accumulation_evaluation_and_mixed_precision_on_1_and_2_processes() {
    for name in ["accumulation", "evaluation", "mixed_precision"] {
        for processes in [1, 2] {
            launch(processes, vec![example(name)], &[]);
        }
    }
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
