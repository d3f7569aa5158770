//! Real code: tch-rs's own training examples (tests/real_code/, see its README), each with
//! `#[accelerate(..)]` added, built as one user's crate outside the workspace and run as a
//! user would. Each runs on 1 and on 2 processes — its data dealt (each of 2 processes
//! takes about half the micro-steps of one) or, where its loop counts and draws its own
//! batches, every iteration on every process — every variable equal on both ranks, the
//! precision asked for in effect and said so; or, where 2 processes would do one's work
//! (full-batch training, bare tensors for weights), it stops on 2 processes saying why.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use tch::{Device, Kind, Tensor};

use super::{AS_THE_WORKSPACE, Build, build_dir, root, set_up_crate};

/// A tch-rs example and what must happen to it.
struct Example {
    /// The binary (`src/bin/{name}.rs` of the crate).
    name: &'static str,
    /// Its source under tests/real_code/.
    source: &'static str,
    /// The call that runs it (`main()` or the module's `run()`).
    entry: &'static str,
    outcome: Outcome,
}

enum Outcome {
    /// It trains: arguments, the precision the attribute asks for, and epochs (a last
    /// round too short for every process is dropped once per epoch).
    Runs { args: &'static [&'static str], precision: &'static str, epochs: u64 },
    /// Its loop counts and draws its own batches: every process runs every iteration (as
    /// many micro-steps as 1 process), the ranks end equal.
    Draws { args: &'static [&'static str] },
    /// It runs on 1 process; on 2 it stops with a message containing this.
    FailsOnTwo { says: &'static str },
}

const EXAMPLES: &[Example] = &[
    Example {
        name: "mnist_conv",
        source: "mnist_conv.rs",
        entry: "run",
        outcome: Outcome::Runs { args: &[], precision: "fp16", epochs: 2 },
    },
    Example {
        name: "char_rnn",
        source: "char_rnn.rs",
        entry: "main",
        // fp32: libtorch's CPU LSTM (oneDNN) has no fp16 or bf16 kernel on this machine;
        // PyTorch under autocast fails the same way.
        outcome: Outcome::Runs { args: &[], precision: "no", epochs: 1 },
    },
    Example {
        name: "min_gpt",
        source: "min_gpt.rs",
        entry: "main",
        outcome: Outcome::Runs { args: &["train"], precision: "bf16", epochs: 1 },
    },
    Example {
        name: "vae",
        source: "vae.rs",
        entry: "main",
        // Not fp16: its loss sums ~100,000 binary cross-entropies, beyond fp16's 65,504, so
        // nearly every step would overflow and be skipped.
        outcome: Outcome::Runs { args: &[], precision: "bf16", epochs: 2 },
    },
    // Full-batch training in a loop over epochs: every process would compute the same
    // gradient on the same data, which the first step on 2 processes shows.
    Example {
        name: "mnist_nn",
        source: "mnist_nn.rs",
        entry: "run",
        outcome: Outcome::FailsOnTwo { says: "computed the same loss" },
    },
    Example {
        name: "mnist_linear",
        source: "mnist_linear.rs",
        entry: "run",
        // Its weights are bare tensors: no model for the accelerator to prepare.
        outcome: Outcome::FailsOnTwo { says: "with no prepared model" },
    },
    // Random batches drawn in a loop over step numbers: each process draws its own.
    Example {
        name: "gan",
        source: "gan.rs",
        entry: "main",
        outcome: Outcome::Draws { args: &["data/faces"] },
    },
    Example {
        name: "translation",
        source: "translation/main.rs",
        entry: "main",
        outcome: Outcome::Draws { args: &[] },
    },
];

/// The crate: the examples under `real/`, a `src/bin` wrapper calling each one's entry.
fn write_crate(dir: &Path) {
    let real = dir.join("real");
    copy_dir(&root().join("tests/real_code"), &real);
    std::fs::create_dir_all(dir.join("src/bin")).unwrap();
    for e in EXAMPLES {
        let wrapper = format!(
            "#[path = \"../../real/{}\"]\nmod example;\n\nfn main() -> anyhow::Result<()> {{\n    \
             example::{}()\n}}\n",
            e.source, e.entry
        );
        std::fs::write(dir.join(format!("src/bin/{}.rs", e.name)), wrapper).unwrap();
    }
}

pub(super) fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap().flatten() {
        let path = entry.path();
        if path.is_dir() {
            copy_dir(&path, &to.join(entry.file_name()));
        } else {
            std::fs::copy(&path, to.join(entry.file_name())).unwrap();
        }
    }
}

/// `data/` as the examples read it: MNIST's files made from the 8x8 digits of data/
/// (each pixel 3x3, a 2-pixel border: 28x28), and 5,000 characters of the KJV text as
/// `input.txt` (tch's `TextData` starts a sequence at every character: about 600 batches
/// of 8).
pub(super) fn write_data(dir: &Path) {
    let data = dir.join("data");
    std::fs::create_dir_all(&data).unwrap();
    let digits: std::collections::HashMap<String, Tensor> =
        Tensor::read_safetensors(root().join("data/digits.safetensors"))
            .unwrap()
            .into_iter()
            .collect();
    for (split, prefix) in [("train", "train"), ("test", "t10k")] {
        let x = &digits[&format!("{split}.x")];
        let n = x.size()[0];
        let big = (x.to_kind(Kind::Float) * (255.0 / 16.0))
            .view([n, 1, 8, 8])
            .upsample_nearest2d([24, 24], None, None)
            .constant_pad_nd([2, 2, 2, 2])
            .round()
            .to_kind(Kind::Uint8)
            .view([-1]);
        let pixels = Vec::<u8>::try_from(&big).unwrap();
        let mut images = Vec::new();
        for word in [2051u32, n as u32, 28, 28] {
            images.extend(word.to_be_bytes());
        }
        images.extend(pixels);
        std::fs::write(data.join(format!("{prefix}-images-idx3-ubyte")), images).unwrap();
        let y = digits[&format!("{split}.y")].to_kind(Kind::Uint8).to_device(Device::Cpu);
        let mut labels = Vec::new();
        for word in [2049u32, n as u32] {
            labels.extend(word.to_be_bytes());
        }
        labels.extend(Vec::<u8>::try_from(&y).unwrap());
        std::fs::write(data.join(format!("{prefix}-labels-idx1-ubyte")), labels).unwrap();
    }
    // The translation example's sentence pairs (tab-separated, as in the Tatoeba file).
    let pairs = [
        ("I am cold.", "J'ai froid."),
        ("I am tired.", "Je suis fatigue."),
        ("I am home.", "Je suis chez moi."),
        ("You are late.", "Tu es en retard."),
        ("You are kind.", "Tu es gentil."),
        ("He is tall.", "Il est grand."),
        ("He is here.", "Il est ici."),
        ("She is happy.", "Elle est heureuse."),
        ("She is busy.", "Elle est occupee."),
        ("We are ready.", "Nous sommes prets."),
        ("We are friends.", "Nous sommes amis."),
        ("They are young.", "Ils sont jeunes."),
        ("They are here.", "Ils sont ici."),
        ("I am hungry.", "J'ai faim."),
        ("You are right.", "Tu as raison."),
        ("He is a teacher.", "Il est professeur."),
    ];
    let lines: String = pairs.iter().map(|(e, f)| format!("{e}\t{f}\n")).collect();
    std::fs::write(data.join("eng-fra.txt"), lines).unwrap();
    // The GAN's image folder: 40 of the digits as 64x64 RGB images.
    let faces = data.join("faces");
    std::fs::create_dir_all(&faces).unwrap();
    let x = &digits["train.x"];
    for i in 0..40 {
        let image = (x.get(i).to_kind(Kind::Float) * (255.0 / 16.0))
            .view([1, 1, 8, 8])
            .upsample_nearest2d([64, 64], None, None)
            .view([1, 64, 64])
            .repeat([3, 1, 1])
            .to_kind(Kind::Uint8);
        tch::vision::image::save(&image, faces.join(format!("{i}.png"))).unwrap();
    }
    let text = std::fs::read_to_string(root().join("data/kjv-genesis-exodus.txt")).unwrap();
    let text: String = text.chars().take(5_000).collect();
    std::fs::write(data.join("input.txt"), text).unwrap();
}

pub(super) fn cargo_build(dir: &Path, build: &Build, bins: &[&str]) -> Output {
    let mut command = build.cargo(dir);
    command.args(["build", "--offline", "--quiet"]);
    for bin in bins {
        command.args(["--bin", bin]);
    }
    command.output().unwrap()
}

/// Runs `bin args` in its own folder (with `data/` beside it) on `processes` processes;
/// returns the folder of the final states and what the processes printed.
fn run(
    dir: &Path,
    binary: &Path,
    name: &str,
    args: &[&str],
    processes: usize,
) -> (PathBuf, String) {
    let work = dir.join(format!("run-{name}-{processes}"));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).unwrap();
    std::os::unix::fs::symlink(dir.join("data"), work.join("data")).unwrap();
    let state = work.join("final");
    let mut command = if processes == 1 {
        Command::new(binary)
    } else {
        let mut c = Command::new(build_dir().join("accel"));
        c.args(["launch", "--num-processes", &processes.to_string(), "--main-process-port", "0"]);
        c.arg(binary);
        c
    };
    let output = command
        .args(args)
        .current_dir(&work)
        .env("ACCEL_FINAL_STATE_DIR", &state)
        .env("ACCEL_TIMEOUT_SECS", "120")
        .env_remove("ACCEL_CONFIG_FILE")
        .output()
        .unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(output.status.success(), "{name} on {processes} process(es) failed:\n{said}");
    (state, said)
}

/// A step counter of `rank` (`micro_steps_total`, `optimizer_steps`).
pub(super) fn counter(state: &Path, rank: usize, name: &str) -> u64 {
    let text = std::fs::read_to_string(state.join(format!("counters.rank{rank}.json"))).unwrap();
    let counters: serde_json::Value = serde_json::from_str(&text).unwrap();
    counters[name].as_u64().unwrap()
}

/// The largest difference between two ranks' variables, over every variable of every
/// model (the names must agree).
fn ranks_differ_by(state: &Path) -> f64 {
    let mut worst = 0.0f64;
    let mut models = 0;
    while state.join(format!("model{models}.rank0.safetensors")).exists() {
        let read = |rank: usize| {
            let mut all = Tensor::read_safetensors(
                state.join(format!("model{models}.rank{rank}.safetensors")),
            )
            .unwrap();
            all.sort_by(|a, b| a.0.cmp(&b.0));
            all
        };
        let (a, b) = (read(0), read(1));
        let names = |w: &[(String, Tensor)]| w.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
        assert_eq!(names(&a), names(&b), "the ranks hold different variables");
        for ((_, x), (_, y)) in a.iter().zip(&b) {
            let diff = (x.to_kind(Kind::Double) - y.to_kind(Kind::Double)).abs().max();
            worst = worst.max(diff.double_value(&[]));
        }
        models += 1;
    }
    assert!(models > 0, "no final state was written in {}", state.display());
    worst
}

fn check_runs(dir: &Path, binary: &Path, e: &Example, args: &[&str], precision: &str, epochs: u64) {
    let (one, said_one) = run(dir, binary, e.name, args, 1);
    let (two, said_two) = run(dir, binary, e.name, args, 2);
    for said in [&said_one, &said_two] {
        assert!(
            said.contains(&format!("precision {precision}"))
                && said.contains("#[accelerate] prepared 1 data loop"),
            "{}: the run's first line does not say what is in effect:\n{said}",
            e.name
        );
        assert!(
            !said.contains("outside any autocast region"),
            "{}: a forward pass ran without autocast:\n{said}",
            e.name
        );
    }
    assert!(said_two.contains("2 processes"), "{}:\n{said_two}", e.name);
    let micro_steps = |state: &Path, rank| counter(state, rank, "micro_steps_total");
    let (single, rank0, rank1) = (micro_steps(&one, 0), micro_steps(&two, 0), micro_steps(&two, 1));
    assert_eq!(rank0, rank1, "{}: the ranks took different numbers of micro-steps", e.name);
    assert!(
        2 * rank0 <= single && 2 * rank0 + epochs >= single && rank0 > 0,
        "{}: not dealt: 1 process took {single} micro-steps, each of 2 took {rank0}",
        e.name
    );
    let stepped = counter(&two, 0, "optimizer_steps");
    assert!(stepped > 0, "{}: no optimizer step was taken on 2 processes", e.name);
    let diff = ranks_differ_by(&two);
    assert!(diff <= 1e-6, "{}: the 2 ranks ended with variables differing by {diff}", e.name);
}

#[test]
fn tch_rs_examples_run_on_1_and_2_processes_or_are_refused_at_the_right_line() {
    // tch-rs's examples are written for Rust 2021, as their crate is.
    let extra = ["anyhow = \"1\"", "rand = \"0.9\"", AS_THE_WORKSPACE];
    let (dir, _) = set_up_crate("tch-examples", "2021", &extra);
    let build = Build::for_programs();
    let target = &build.target;
    write_crate(&dir);
    write_data(&dir);
    let runs: Vec<&str> = EXAMPLES.iter().map(|e| e.name).collect();
    let built = cargo_build(&dir, &build, &runs);
    assert!(
        built.status.success(),
        "the examples did not build:\n{}",
        String::from_utf8_lossy(&built.stderr)
    );
    for e in EXAMPLES {
        match &e.outcome {
            Outcome::Runs { args, precision, epochs } => {
                let binary = target.join("debug").join(e.name);
                check_runs(&dir, &binary, e, args, precision, *epochs);
            }
            Outcome::Draws { args } => {
                let binary = target.join("debug").join(e.name);
                let (one, _) = run(&dir, &binary, e.name, args, 1);
                let (two, said) = run(&dir, &binary, e.name, args, 2);
                assert!(said.contains("draws its own batches"), "{}: {said}", e.name);
                let steps = |s: &Path, r| counter(s, r, "micro_steps_total");
                let (single, r0, r1) = (steps(&one, 0), steps(&two, 0), steps(&two, 1));
                assert!(
                    single > 0 && r0 == single && r1 == single,
                    "{}: micro-steps {single} {r0} {r1}",
                    e.name
                );
                let diff = ranks_differ_by(&two);
                assert!(diff <= 1e-6, "{}: the 2 ranks differ by {diff}", e.name);
            }
            Outcome::FailsOnTwo { says } => {
                let binary = target.join("debug").join(e.name);
                run(&dir, &binary, e.name, &[], 1);
                let output = Command::new(build_dir().join("accel"))
                    .args(["launch", "--num-processes", "2", "--main-process-port", "0"])
                    .arg(&binary)
                    .current_dir(dir.join(format!("run-{}-1", e.name)))
                    .env("ACCEL_TIMEOUT_SECS", "60")
                    .output()
                    .unwrap();
                let said = String::from_utf8_lossy(&output.stderr);
                assert!(!output.status.success() && said.contains(says), "{}: {said}", e.name);
            }
        }
    }
}
