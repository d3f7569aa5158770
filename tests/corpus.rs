//! Ordinary training loops written the way tch users write them (tests/real_code/loops/,
//! see its README), each with `#[accelerate(..)]`, built as one user's crate outside the
//! workspace and run as a user would:
//! - loops that deal their data end, on each of 2 processes (batches of 32), with the
//!   weights of 1 process with the global batch (64), every variable within 1e-6, the
//!   ranks equal;
//! - loops that draw their own batches run every iteration on every process, ranks equal;
//! - what cannot be understood is refused: at compile time at the line to change, or, where
//!   only the run shows it (every process drawing the same batches, one leaving the loop
//!   alone), on 2 processes at the first step that shows it, saying why.

use std::path::{Path, PathBuf};
use std::process::Command;

use tch::{Kind, Tensor};

use super::tch_examples::{cargo_build, copy_dir, counter, write_data};
use super::{AS_THE_WORKSPACE, Build, build_dir, root, set_up_crate};

enum Outcome {
    /// 2 processes equal 1 process with twice the batch.
    Equal,
    /// Every process runs every iteration on batches of its own.
    Draws,
    /// Runs on 1 process; on 2, stops with a message containing this (and the line, if any).
    FailsOnTwo { says: &'static str, line: Option<usize> },
    /// Does not compile: at this line, with a message containing this.
    Refused { line: usize, says: &'static str },
    /// Saved mid-epoch and resumed on 2 processes, it ends as the uninterrupted run.
    Resumes,
    /// Runs on 1 and 2 processes, the data dealt (2 processes with half the batch take as
    /// many steps as 1), the ranks equal; not comparable with 1 process (its own unseeded
    /// draws, per-process batch statistics).
    RanksEqual,
    /// Stops on 1 process saying `one`, and on 2 saying `two`.
    FailsEverywhere { one: &'static str, two: &'static str },
}
use Outcome::*;

const PROGRAMS: &[(&str, Outcome)] = &[
    ("quickstart", Equal),
    ("tch_train_iter", Equal),
    ("index_narrow", Equal),
    ("index_logging", Equal),
    ("index_op_slices", Equal),
    ("enumerate_warmup", Equal),
    ("counter_accumulation", Equal),
    ("accumulate_key", Equal),
    ("borrowed_vec", Equal),
    ("split_zip", Equal),
    ("while_let_shuffled", Equal),
    ("loop_let_else", Equal),
    ("schedule_helper", Equal),
    ("update_helper", Equal),
    ("optimizer_factory", Equal),
    ("trainer_per_epoch", Equal),
    ("pretrain_finetune", Equal),
    ("early_stopping", Equal),
    ("clip_grad_norm", Equal),
    ("backward_step_clip_norm", Equal),
    ("epoch_schedule", Equal),
    ("box_dyn_error", Equal),
    ("two_optimizers", Equal),
    ("regression_mse", Equal),
    ("unit_return", Equal),
    ("sharded_zero3", Equal),
    ("fsdp_seq_reads_after_loop", Equal),
    ("zero3_evaluates_each_epoch", Equal),
    ("labeled_break", Equal),
    ("moe_unused", Equal),
    ("resume_mid_epoch", Resumes),
    ("nanogpt", Draws),
    ("nanogpt_while", Draws),
    ("gan_latent", Draws),
    ("wgan_critic_loop", RanksEqual),
    ("while_let_drawn", Draws),
    ("full_batch", FailsOnTwo { says: "computed the same loss", line: None }),
    ("seeded_rng_batches", FailsOnTwo { says: "computed the same loss", line: None }),
    ("break_on_own_loss", FailsOnTwo { says: "parted ways", line: Some(22) }),
    ("moe_unused_refused", FailsOnTwo { says: "find_unused_parameters = true", line: None }),
    ("index_schedule", Refused { line: 17, says: "sets the optimizer (`opt.set_lr(..)`)" }),
    ("index_to_helper", Refused { line: 27, says: "is passed to `log_progress(..)`" }),
    ("double_accumulation", Refused { line: 16, says: "steps the optimizer every few batches" }),
    ("step_in_helper", Refused { line: 20, says: "the training step runs in `train_step(..)`" }),
    // From crates.io packages (tests/real_code/crates/, README.md there).
    ("tch011_jit_train", Equal),
    ("tch011_cifar", RanksEqual),
    ("tch011_rl_a2c", Draws),
    ("tch011_rl_ppo", Draws),
    ("tch011_rl_policy_gradient", Draws),
    ("tch011_transfer_learning", FailsOnTwo { says: "computed the same loss", line: None }),
    ("tch011_neural_style_transfer", FailsOnTwo { says: "computed the same loss", line: None }),
    (
        "tch011_optimizer_test",
        FailsEverywhere {
            one: "created after the optimizer was built",
            two: "computed the same loss",
        },
    ),
    ("tch011_gradient_descent", FailsOnTwo { says: "computed the same loss", line: None }),
    (
        "tch011_gradient_descent_clip_norm",
        FailsOnTwo { says: "computed the same loss", line: None },
    ),
    (
        "tch011_layer_norm_parameters",
        FailsEverywhere {
            one: "created after the optimizer was built",
            two: "computed the same loss",
        },
    ),
    (
        "tch011_param_group_weight_decay",
        FailsEverywhere {
            one: "created after the optimizer was built",
            two: "computed the same loss",
        },
    ),
    (
        "tch011_custom_optimizer",
        Refused { line: 215, says: "is not an optimizer the accelerator can prepare" },
    ),
    ("tch011_rl_ddpg", Refused { line: 386, says: "found no `loss.backward()`" }),
    ("tch011_check_param_group", Refused { line: 27, says: "is passed in" }),
    ("reinforcex_ppo_update", Refused { line: 429, says: "is kept in a field" }),
    (
        "syntaxdot_run_epoch_steps",
        Refused { line: 1139, says: "cannot see where the optimizer `scaler` is made" },
    ),
    ("syntaxdot_finetune_run", Refused { line: 1192, says: "found no `loss.backward()`" }),
    ("syntaxdot_train_steps", Refused { line: 834, says: "is passed in" }),
    (
        "sticker2_run_epoch",
        Refused { line: 932, says: "cannot see where the optimizer `scaler` is made" },
    ),
    ("border_dqn_opt", Refused { line: 436, says: "found no `loss.backward()`" }),
];

/// The crate: every program that compiles in one binary (`loops NAME`), each refused one
/// in a binary of its own.
fn write_crate(dir: &Path) {
    copy_dir(&root().join("tests/real_code/loops"), &dir.join("real"));
    copy_dir(&root().join("tests/real_code/crates"), &dir.join("real"));
    let mut main = String::from("#[path = \"../real/data.rs\"]\nmod data;\n");
    for (name, outcome) in PROGRAMS {
        if matches!(outcome, Refused { .. }) {
            let bin = format!(
                "#[path = \"../../real/data.rs\"]\nmod data;\n#[path = \"../../real/{name}.rs\"]\n\
                 mod program;\n\nfn main() -> anyhow::Result<()> {{\n    program::run()\n}}\n"
            );
            std::fs::create_dir_all(dir.join("src/bin")).unwrap();
            std::fs::write(dir.join(format!("src/bin/{name}.rs")), bin).unwrap();
        } else {
            main.push_str(&format!("#[path = \"../real/{name}.rs\"]\nmod {name};\n"));
        }
    }
    main.push_str(
        "\nfn main() -> anyhow::Result<()> {\n    match std::env::args().nth(1).as_deref() {\n",
    );
    for (name, outcome) in PROGRAMS {
        if !matches!(outcome, Refused { .. }) {
            main.push_str(&format!("        Some(\"{name}\") => {name}::run(),\n"));
        }
    }
    main.push_str("        other => anyhow::bail!(\"no program {other:?}\"),\n    }\n}\n");
    std::fs::write(dir.join("src/main.rs"), main).unwrap();
}

/// `loops name` on `processes` processes in a folder of its own (with `data/`), its final
/// state in `{folder}/final`. Returns the folder, whether it succeeded and what it printed.
fn run(
    (dir, target): (&Path, &Path),
    name: &str,
    tag: &str,
    processes: usize,
    env: &[(&str, String)],
) -> (PathBuf, bool, String) {
    let work = dir.join(format!("run-{name}-{tag}"));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).unwrap();
    std::os::unix::fs::symlink(dir.join("data"), work.join("data")).unwrap();
    let binary = target.join("debug/loops");
    let mut command = if processes == 1 {
        Command::new(&binary)
    } else {
        let mut c = Command::new(build_dir().join("accel"));
        c.args(["launch", "--num-processes", &processes.to_string(), "--main-process-port", "0"]);
        c.arg(&binary);
        c
    };
    command
        .arg(name)
        .current_dir(&work)
        .env("ACCEL_FINAL_STATE_DIR", work.join("final"))
        .env("ACCEL_TIMEOUT_SECS", "60")
        .env_remove("ACCEL_CONFIG_FILE");
    for (k, v) in env {
        command.env(k, v);
    }
    let output = command.output().unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    // What a failure report needs: the lines without backtraces' frames.
    let said: Vec<&str> =
        said.lines().filter(|l| !l.contains("   at ") && !l.contains(": <")).collect();
    let said = said[said.len().saturating_sub(25)..].join("\n");
    (work, output.status.success(), said)
}

fn read(state: &Path, model: usize, rank: usize) -> Option<Vec<(String, Tensor)>> {
    let path = state.join(format!("model{model}.rank{rank}.safetensors"));
    let mut all = Tensor::read_safetensors(path).ok()?;
    all.sort_by(|a, b| a.0.cmp(&b.0));
    Some(all)
}

/// The largest difference between rank `ra` of `a` and rank `rb` of `b`, over every
/// variable of every model (the names must agree).
fn differ_by(a: &Path, ra: usize, b: &Path, rb: usize) -> Result<f64, String> {
    let mut worst = 0.0f64;
    let mut model = 0;
    while let Some(x) = read(a, model, ra) {
        let y = read(b, model, rb).ok_or(format!("model {model} missing on rank {rb}"))?;
        let names = |w: &[(String, Tensor)]| w.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
        if names(&x) != names(&y) {
            return Err(format!("different variables: {:?} vs {:?}", names(&x), names(&y)));
        }
        for ((_, p), (_, q)) in x.iter().zip(&y) {
            let d = (p.to_kind(Kind::Double) - q.to_kind(Kind::Double)).abs().max();
            worst = worst.max(d.double_value(&[]));
        }
        model += 1;
    }
    if model == 0 {
        return Err(format!("no final state in {}", a.display()));
    }
    Ok(worst)
}

fn check(folder: &Path, build: &Build, name: &str, outcome: &Outcome) -> Result<(), String> {
    let dir = (folder, build.target.as_path());
    let batch = |b: i64| vec![("BATCH_SIZE", b.to_string())];
    match outcome {
        Resumes => check_resume(dir),
        Equal => {
            let (one, ok1, said1) = run(dir, name, "1", 1, &batch(64));
            let (two, ok2, said2) = run(dir, name, "2", 2, &batch(32));
            if !ok1 || !ok2 {
                return Err(format!("failed:\n{said1}\n{said2}"));
            }
            let ranks = differ_by(&two.join("final"), 0, &two.join("final"), 1)?;
            let parity = differ_by(&one.join("final"), 0, &two.join("final"), 0)?;
            if ranks > 1e-6 || parity > 1e-6 {
                return Err(format!(
                    "ranks differ by {ranks:e}; 2 processes differ from 1 with twice the batch by \
                     {parity:e}"
                ));
            }
            Ok(())
        }
        Draws => {
            let (one, ok1, said1) = run(dir, name, "1", 1, &[]);
            let (two, ok2, said2) = run(dir, name, "2", 2, &[]);
            if !ok1 || !ok2 {
                return Err(format!("failed:\n{said1}\n{said2}"));
            }
            if !said2.contains("draws its own batches") {
                return Err(format!("not run as a loop that draws its batches:\n{said2}"));
            }
            let ranks = differ_by(&two.join("final"), 0, &two.join("final"), 1)?;
            let steps = |s: &Path, r| counter(&s.join("final"), r, "micro_steps_total");
            let (single, r0, r1) = (steps(&one, 0), steps(&two, 0), steps(&two, 1));
            if ranks > 1e-6 || r0 != single || r1 != single {
                return Err(format!(
                    "ranks differ by {ranks:e}; micro-steps: 1 process {single}, ranks {r0} and {r1}"
                ));
            }
            Ok(())
        }
        RanksEqual => {
            let (one, ok1, said1) = run(dir, name, "1", 1, &batch(64));
            let (two, ok2, said2) = run(dir, name, "2", 2, &batch(32));
            if !ok1 || !ok2 {
                return Err(format!("failed:\n{said1}\n{said2}"));
            }
            let ranks = differ_by(&two.join("final"), 0, &two.join("final"), 1)?;
            let steps = |s: &Path, r| counter(&s.join("final"), r, "micro_steps_total");
            let (single, r0) = (steps(&one, 0), steps(&two, 0));
            // Half the batch on each of 2 processes: as many steps as 1 process takes (not
            // twice as many, which each would take if the data were not dealt).
            if ranks > 1e-6 || r0 != single {
                return Err(format!(
                    "ranks differ by {ranks:e}; micro-steps: 1 process {single}, rank 0 of 2 {r0}"
                ));
            }
            Ok(())
        }
        FailsEverywhere { one, two } => {
            for (processes, b, says) in [(1, 64, one), (2, 32, two)] {
                let (_, ok, said) = run(dir, name, &processes.to_string(), processes, &batch(b));
                if ok || !said.contains(says) {
                    return Err(format!(
                        "{processes} process(es) did not stop saying {says:?}:\n{said}"
                    ));
                }
            }
            Ok(())
        }
        FailsOnTwo { says, line } => {
            let (_, ok1, said1) = run(dir, name, "1", 1, &batch(64));
            if !ok1 {
                return Err(format!("1 process failed:\n{said1}"));
            }
            let start = std::time::Instant::now();
            let (_, ok2, said2) = run(dir, name, "2", 2, &batch(32));
            if ok2 || !said2.contains(says) {
                return Err(format!("2 processes did not stop saying {says:?}:\n{said2}"));
            }
            if let Some(line) = line {
                let at = format!("{name}.rs:{line}");
                if !said2.contains(&at) {
                    return Err(format!("the message does not name {at}:\n{said2}"));
                }
            }
            if start.elapsed().as_secs() > 30 {
                return Err(format!("took {:?} to stop", start.elapsed()));
            }
            Ok(())
        }
        Refused { line, says } => {
            let output = cargo_build(folder, build, &[name]);
            let text = String::from_utf8_lossy(&output.stderr);
            if output.status.success() {
                return Err("built, but must be refused".into());
            }
            let at = format!("real/{name}.rs:{line}:");
            let message = text
                .split("\nerror")
                .find(|m| m.contains(says))
                .ok_or(format!("no error saying {says:?}:\n{text}"))?;
            if !message.contains(&at) {
                return Err(format!("the error is not at {at}:\n{message}"));
            }
            Ok(())
        }
    }
}

/// A checkpoint saved mid-epoch and resumed on 2 processes ends with the uninterrupted
/// run's weights.
fn check_resume(dir: (&Path, &Path)) -> Result<(), String> {
    let checkpoint = dir.0.join("resume-checkpoint");
    let _ = std::fs::remove_dir_all(&checkpoint);
    let batch = ("BATCH_SIZE", "32".to_string());
    let ckpt = ("CHECKPOINT", checkpoint.display().to_string());
    let (whole, ok, said) = run(dir, "resume_mid_epoch", "whole", 2, std::slice::from_ref(&batch));
    if !ok {
        return Err(format!("uninterrupted run failed:\n{said}"));
    }
    // 8 batches per process per epoch: stop 3 batches into the second epoch.
    let stop = ("STOP_AFTER", "11".to_string());
    let (_, ok, said) =
        run(dir, "resume_mid_epoch", "stop", 2, &[batch.clone(), ckpt.clone(), stop]);
    if !ok {
        return Err(format!("interrupted run failed:\n{said}"));
    }
    let (resumed, ok, said) = run(dir, "resume_mid_epoch", "resumed", 2, &[batch, ckpt]);
    if !ok {
        return Err(format!("resumed run failed:\n{said}"));
    }
    let diff = differ_by(&whole.join("final"), 0, &resumed.join("final"), 0)?;
    let steps = |s: &Path| counter(&s.join("final"), 0, "micro_steps_total");
    if diff > 1e-6 || steps(&whole) != steps(&resumed) {
        return Err(format!(
            "resumed run differs from the uninterrupted one by {diff:e} (micro-steps {} vs {})",
            steps(&resumed),
            steps(&whole)
        ));
    }
    Ok(())
}

/// nanoGPT's loop on 2 processes equals PyTorch + Accelerate's (torchrun, the same
/// weights, data, per-rank seeds 1337 + rank): every loss of both ranks and every final
/// weight within 1e-6.
fn check_nanogpt_against_accelerate(crate_: (&Path, &Path)) -> Result<(), String> {
    let dir = crate_.0.join("nanogpt-vs-accelerate");
    let _ = std::fs::remove_dir_all(&dir);
    let (ours, theirs) = (dir.join("accel"), dir.join("accelerate"));
    std::fs::create_dir_all(&ours).unwrap();
    std::fs::create_dir_all(&theirs).unwrap();
    let script = root().join("python/reference/nanogpt_accelerate.py");
    let text = crate_.0.join("data/input.txt");
    let init = dir.join("init.safetensors");
    let made = Command::new(root().join(".venv/bin/python"))
        .arg(&script)
        .args(["--text", text.to_str().unwrap(), "--make", init.to_str().unwrap()])
        .output()
        .unwrap();
    if !made.status.success() {
        return Err(format!("--make failed: {}", String::from_utf8_lossy(&made.stderr)));
    }
    let port = accel_core::comm::free_port("127.0.0.1").unwrap();
    let reference = Command::new(root().join(".venv/bin/torchrun"))
        .args(["--nproc-per-node=2".to_string(), format!("--master-port={port}")])
        .arg(&script)
        .args(["--text", text.to_str().unwrap(), "--init", init.to_str().unwrap()])
        .args(["--iters", "20", "--losses", theirs.to_str().unwrap()])
        .args(["--out", theirs.join("final.safetensors").to_str().unwrap()])
        .output()
        .unwrap();
    if !reference.status.success() {
        return Err(format!("torchrun failed: {}", String::from_utf8_lossy(&reference.stderr)));
    }
    let env = [
        ("INIT", init.display().to_string()),
        ("LOSSES", ours.display().to_string()),
        ("MAX_ITERS", "20".to_string()),
    ];
    let (work, ok, said) = run(crate_, "nanogpt", "vs-accelerate", 2, &env);
    if !ok {
        return Err(format!("accel failed:\n{said}"));
    }
    let losses = |d: &Path, r: usize| -> Vec<f64> {
        let text = std::fs::read_to_string(d.join(format!("losses.rank{r}.json"))).unwrap();
        serde_json::from_str(&text).unwrap()
    };
    for rank in 0..2 {
        let (a, b) = (losses(&ours, rank), losses(&theirs, rank));
        let worst = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max);
        if a.len() != b.len() || a.len() != 20 || worst > 1e-6 {
            return Err(format!("rank {rank}: losses differ by {worst:e}:\n{a:?}\n{b:?}"));
        }
    }
    if losses(&ours, 0) == losses(&ours, 1) {
        return Err("both ranks trained on the same batches".into());
    }
    let read = |path: PathBuf| {
        let mut all = Tensor::read_safetensors(path).unwrap();
        all.sort_by(|a, b| a.0.cmp(&b.0));
        all
    };
    let mine = read(work.join("final/model0.rank0.safetensors"));
    let reference = read(theirs.join("final.safetensors"));
    let names = |w: &[(String, Tensor)]| w.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
    if names(&mine) != names(&reference) {
        return Err(format!("variables: {:?} vs {:?}", names(&mine), names(&reference)));
    }
    let worst = mine
        .iter()
        .zip(&reference)
        .map(|((_, a), (_, b))| (a - b).abs().max().double_value(&[]))
        .fold(0.0, f64::max);
    if worst > 1e-6 {
        return Err(format!("final weights differ from Accelerate's by {worst:e}"));
    }
    Ok(())
}

#[test]
fn ordinary_training_loops_equal_1_process_draw_their_own_batches_or_are_refused() {
    let extra = ["anyhow = \"1\"", "rand = \"0.9\"", AS_THE_WORKSPACE];
    let (dir, _) = set_up_crate("loops", "2024", &extra);
    let build = Build::for_programs();
    let target = &build.target;
    write_crate(&dir);
    write_data(&dir);
    std::fs::copy(root().join("data/digits.safetensors"), dir.join("data/digits.safetensors"))
        .unwrap();
    let built = cargo_build(&dir, &build, &["loops"]);
    assert!(
        built.status.success(),
        "the programs did not build:\n{}",
        String::from_utf8_lossy(&built.stderr)
    );
    let mut failures: Vec<String> = PROGRAMS
        .iter()
        .filter_map(|(name, outcome)| {
            check(&dir, &build, name, outcome).err().map(|e| format!("{name}: {e}"))
        })
        .collect();
    if let Err(e) = check_nanogpt_against_accelerate((&dir, target)) {
        failures.push(format!("nanogpt against PyTorch + Accelerate: {e}"));
    }
    assert!(
        failures.is_empty(),
        "{} of {} checks failed:\n{}",
        failures.len(),
        PROGRAMS.len() + 1,
        failures.join("\n\n")
    );
}
