//! `#[accelerate]` end to end: an annotated function gives bit-identical parameters to the
//! same training written by hand against the explicit API; the annotated example equals its
//! plain twin minus the attribute line, trains with that line removed, and with 2 processes
//! matches 1 process with twice the batch (data parallelism, as examples/tests/parity.rs).

use std::path::{Path, PathBuf};

use accel_core::Accelerator;
use accel_core::launch::{LaunchPlan, run};
use accel_core::optim::{AdamConfig, AdamW};
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

fn mlp(root: &nn::Path) -> nn::Sequential {
    nn::seq()
        .add(nn::linear(root / "layers" / 0, 6, 16, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(root / "layers" / 1, 16, 3, Default::default()))
}

fn batches() -> Vec<(Tensor, Tensor)> {
    (0..7i64)
        .map(|i| {
            let x = (Tensor::arange(8 * 6, (Kind::Float, Device::Cpu)).view([8, 6])
                * (0.1 * (i + 1) as f64))
                .sin();
            let y = (Tensor::arange(8, (Kind::Int64, Device::Cpu)) + i).remainder(3);
            (x, y)
        })
        .collect()
}

fn snapshot(vs: &nn::VarStore) -> Vec<(String, Tensor)> {
    let mut v: Vec<_> = vs.variables().into_iter().map(|(n, t)| (n, t.detach().copy())).collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

#[accel_core::accelerate(accumulate = 2, seed = 7, cpu = true)]
fn annotated(data: Vec<(Tensor, Tensor)>) -> anyhow::Result<Vec<(String, Tensor)>> {
    let vs = nn::VarStore::new(Device::Cpu);
    let net = mlp(&vs.root());
    let mut opt = nn::AdamW::default().build(&vs, 1e-2)?;
    for (x, y) in data {
        let loss = net.forward(&x).cross_entropy_for_logits(&y);
        opt.zero_grad();
        loss.backward();
        opt.step();
    }
    Ok(snapshot(&vs))
}

fn by_hand(data: Vec<(Tensor, Tensor)>) -> anyhow::Result<Vec<(String, Tensor)>> {
    let acc = Accelerator::builder().accumulate(2).seed(7).cpu(true).build()?;
    let vs = nn::VarStore::new(acc.device());
    let net = mlp(&vs.root());
    acc.prepare_model(&vs)?;
    let adamw = AdamW::new(acc.params(&vs), AdamConfig { lr: 1e-2, ..AdamConfig::adamw() })?;
    let mut opt = acc.prepare_optimizer(adamw);
    for (x, y) in acc.prepare_iter(data) {
        let autocast = acc.autocast()?;
        let loss = net.forward(&x).cross_entropy_for_logits(&y);
        opt.zero_grad()?;
        drop(autocast);
        acc.backward(&loss)?;
        opt.step()?;
    }
    acc.wait_for_everyone()?;
    Ok(snapshot(&vs))
}

#[test]
fn an_annotated_function_equals_the_explicit_api_bit_for_bit() {
    let ours = annotated(batches()).unwrap();
    let theirs = by_hand(batches()).unwrap();
    assert_eq!(ours.len(), 4);
    for ((name, a), (_, b)) in ours.iter().zip(&theirs) {
        assert_eq!((a - b).abs().max().double_value(&[]), 0.0, "{name} differs");
    }
    // And it trained: the weights moved away from the seeded start.
    tch::manual_seed(7);
    let start = nn::VarStore::new(Device::Cpu);
    let _ = mlp(&start.root());
    let moved = (&ours[0].1 - &snapshot(&start)[0].1).abs().max().double_value(&[]);
    assert!(moved > 1e-3, "the parameters did not move ({moved})");
}

fn build_dir() -> PathBuf {
    std::env::current_exe().unwrap().parent().unwrap().parent().unwrap().to_path_buf()
}

fn example(name: &str) -> String {
    let path = build_dir().join("examples").join(name);
    assert!(path.exists(), "{} is missing: `cargo test` builds the examples first", path.display());
    path.display().to_string()
}

#[test]
fn the_annotated_example_is_its_plain_twin_plus_one_line_and_both_train() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let annotated = std::fs::read_to_string(dir.join("existing_function.rs")).unwrap();
    let plain = std::fs::read_to_string(dir.join("existing_function_plain.rs")).unwrap();
    let removed: String = annotated
        .lines()
        .filter(|l| !l.starts_with("#[accel_core::accelerate("))
        .map(|l| format!("{l}\n"))
        .collect();
    assert_eq!(
        removed, plain,
        "existing_function_plain.rs must be existing_function.rs without the attribute line"
    );
    assert_eq!(annotated.lines().count(), plain.lines().count() + 1);
    for name in ["existing_function", "existing_function_plain"] {
        let output =
            std::process::Command::new(example(name)).args(["--epochs", "3"]).output().unwrap();
        assert!(output.status.success(), "{name}: {}", String::from_utf8_lossy(&output.stderr));
    }
}

fn final_weights(processes: usize, batch: &str, out: &Path) -> Vec<(String, Vec<f32>)> {
    let program = vec![
        example("existing_function"),
        "--epochs".into(),
        "2".into(),
        "--batch-size".into(),
        batch.into(),
        "--samples".into(),
        "1408".into(),
        "--out".into(),
        out.display().to_string(),
    ];
    let plan = LaunchPlan {
        env: vec![("ACCEL_TIMEOUT_SECS".into(), "60".into())],
        rank0_only: true,
        ..LaunchPlan::local(processes, program)
    };
    assert_eq!(run(&plan).unwrap(), 0);
    let mut weights: Vec<(String, Vec<f32>)> = Tensor::read_safetensors(out)
        .unwrap()
        .into_iter()
        .map(|(n, t)| (n, Vec::<f32>::try_from(t.flatten(0, -1)).unwrap()))
        .collect();
    weights.sort_by(|a, b| a.0.cmp(&b.0));
    weights
}

#[test]
fn the_annotated_example_on_2_processes_equals_1_process_with_twice_the_batch() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("attribute");
    std::fs::create_dir_all(&dir).unwrap();
    let one = final_weights(1, "64", &dir.join("one.safetensors"));
    let two = final_weights(2, "32", &dir.join("two.safetensors"));
    assert_eq!(one.len(), 4);
    for ((name, a), (other, b)) in one.iter().zip(&two) {
        assert_eq!(name, other);
        let diff = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
        assert!(diff <= 1e-5, "{name}: 1 process vs 2 processes differ by {diff}");
    }
}

/// `strategy = "fsdp"` on unchanged code: the layers of the `nn::seq()` built in the
/// function become units by themselves, so that each of 2 processes places half the model
/// on its device (a layer's chunk, not the layer), and the run still equals 1 process with
/// twice the batch on every variable.
#[test]
fn fsdp_on_unchanged_code_shards_the_layers_of_its_nn_seq_and_equals_one_process() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("fsdp-unchanged");
    std::fs::create_dir_all(&dir).unwrap();
    let run_on = |processes: usize, steps: &str, batch: &str| {
        let out = dir.join(format!("{processes}.safetensors"));
        let program = [
            example("fsdp_unchanged"),
            "--width".into(),
            "96".into(),
            "--layers".into(),
            "4".into(),
            "--steps".into(),
            steps.into(),
            "--batch".into(),
            batch.into(),
            "--out".into(),
            out.display().to_string(),
        ];
        let output = std::process::Command::new(build_dir().join("accel"))
            .args(["launch", "--num-processes", &processes.to_string(), "--cpu"])
            .args(["--main-process-port", "0"])
            .args(program)
            .env("ACCEL_TIMEOUT_SECS", "60")
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&output.stdout).into_owned();
        assert!(output.status.success(), "{said}{}", String::from_utf8_lossy(&output.stderr));
        let reports: Vec<serde_json::Value> = said
            .lines()
            .filter_map(|l| l.find('{').map(|at| &l[at..]))
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect();
        assert_eq!(reports.len(), processes, "one report per process:\n{said}");
        assert!(!said.contains("belong to no Unit"), "every layer is a unit:\n{said}");
        let weights: std::collections::BTreeMap<String, Vec<f32>> = Tensor::read_safetensors(&out)
            .unwrap()
            .into_iter()
            .map(|(n, t)| (n, Vec::<f32>::try_from(t.flatten(0, -1)).unwrap()))
            .collect();
        (reports, weights)
    };
    let (one, whole) = run_on(1, "4", "8");
    let (two, split) = run_on(2, "8", "4");
    assert_eq!(whole.len(), 8, "4 layers' weights and biases");
    for (name, a) in &whole {
        let diff = a.iter().zip(&split[name]).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
        assert!(diff <= 1e-6, "{name}: 1 process vs 2 processes differ by {diff}");
    }
    let model = one[0]["parameters"].as_f64().unwrap() * 4.0;
    assert_eq!(one[0]["placed_bytes"].as_f64().unwrap(), model, "1 process: the model, whole");
    let layer = (96.0 * 96.0 + 96.0) * 4.0;
    for report in &two {
        let placed = report["placed_bytes"].as_f64().unwrap();
        // Each layer's chunk (half of it, padding aside), never a layer whole.
        assert!(placed <= model / 2.0 + 64.0, "placed {placed} of a {model}-byte model");
        assert!(placed < model - layer, "a layer was placed whole: {placed} of {model}");
    }
}

/// A file the function saves (`vs.save(path)` each epoch) and then loads on every process:
/// every process waits for the main process's write, so every load reads the last epoch's
/// weights — 20 runs in a row on 2 and on 4 processes (the program fails, naming the
/// process, when a load sees other weights).
#[test]
fn every_process_loads_what_the_function_saved_last() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("save-and-load");
    std::fs::create_dir_all(&dir).unwrap();
    for processes in [2, 4] {
        for run_number in 0..20 {
            let path = dir.join(format!("model-{processes}.ot"));
            let _ = std::fs::remove_file(&path);
            let program = vec![example("save_and_load"), path.display().to_string(), "2".into()];
            let plan = LaunchPlan {
                env: vec![("ACCEL_TIMEOUT_SECS".into(), "60".into())],
                rank0_only: true,
                ..LaunchPlan::local(processes, program)
            };
            assert_eq!(run(&plan).unwrap(), 0, "run {run_number} on {processes} processes");
        }
    }
}
