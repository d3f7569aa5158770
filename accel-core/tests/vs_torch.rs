//! accel-core against PyTorch (and Hugging Face Accelerate) on the same numbers: reference
//! values come from the scripts in python/reference/, run in the project's .venv by the
//! tests themselves.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

use accel_core::optim::{
    Adam, AdamConfig, AdamW, LrScheduler, Optimizer, Schedule, Sgd, SgdConfig, unnamed_params,
};
use tch::{Device, Kind, Tensor};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// Runs `python/reference/{script}` with an output path and loads what it wrote.
fn run_reference(script: &str) -> HashMap<String, Tensor> {
    let python = std::env::var_os("ACCEL_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join(".venv/bin/python"));
    assert!(
        python.exists(),
        "{} does not exist: run `cargo xtask setup` (it creates .venv with torch and accelerate)",
        python.display()
    );
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join(script.replace(".py", ".safetensors"));
    let output = Command::new(&python)
        .arg(root().join("python/reference").join(script))
        .arg(&out)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{script} failed:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    Tensor::read_safetensors(&out).unwrap().into_iter().collect()
}

/// Runs each reference script once per test binary (tensors are not Sync, hence the Mutex).
fn cached_reference(script: &'static str) -> HashMap<String, Tensor> {
    static CACHE: Mutex<BTreeMap<&'static str, HashMap<String, Tensor>>> =
        Mutex::new(BTreeMap::new());
    let mut cache = CACHE.lock().unwrap_or_else(|e| e.into_inner());
    let values = cache.entry(script).or_insert_with(|| run_reference(script));
    values.iter().map(|(k, v)| (k.clone(), v.shallow_clone())).collect()
}

fn optim_reference() -> HashMap<String, Tensor> {
    cached_reference("optim_sched.py")
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

/// Runs `optimizer` over the reference gradients and compares with torch after steps
/// 1, 10 and 100.
fn check_optimizer(name: &str, make: impl FnOnce(Vec<Tensor>) -> Box<dyn Optimizer>) {
    let r = optim_reference();
    let params: Vec<Tensor> =
        (0..2).map(|i| r[&format!("init.{i}")].copy().set_requires_grad(true)).collect();
    let mut opt = make(params.iter().map(Tensor::shallow_clone).collect());
    for step in 0..100i64 {
        for (i, p) in params.iter().enumerate() {
            let g = r[&format!("grads.{i}")].get(step);
            accel_core::shim::set_grad(p, Some(&g)).unwrap();
        }
        opt.step().unwrap();
        if [1, 10, 100].contains(&(step + 1)) {
            for (i, p) in params.iter().enumerate() {
                let expected = &r[&format!("{name}.step{}.{i}", step + 1)];
                let diff = max_abs_diff(p, expected);
                assert!(
                    diff < 1e-6,
                    "{name}: param {i} differs from torch by {diff} after step {}",
                    step + 1
                );
            }
        }
    }
    // Something happened: a no-op optimizer stays at the start.
    assert!(max_abs_diff(&params[0], &r["init.0"]) > 1e-3, "{name} did not move the parameters");
}

fn sgd(config: SgdConfig) -> impl FnOnce(Vec<Tensor>) -> Box<dyn Optimizer> {
    move |p| Box::new(Sgd::new(unnamed_params(&p), config).unwrap())
}

/// The reference of configuration `name`, through torch's fused kernel when `fused`.
fn reference_name(name: &str, fused: bool) -> String {
    if fused { format!("{name}_fused") } else { name.to_owned() }
}

/// Each configuration through torch's single-tensor path and through ATen's fused kernel
/// (`fused: true`, one call per group), against `torch.optim.SGD` without and with
/// `fused=True`.
#[test]
fn sgd_equals_torch_over_100_steps_unfused_and_fused() {
    for fused in [false, true] {
        let name = |n: &str| reference_name(n, fused);
        check_optimizer(&name("sgd"), sgd(SgdConfig { lr: 0.1, fused, ..Default::default() }));
        check_optimizer(
            &name("sgd_momentum"),
            sgd(SgdConfig {
                lr: 0.05,
                momentum: 0.9,
                dampening: 0.1,
                weight_decay: 0.01,
                fused,
                ..Default::default()
            }),
        );
        check_optimizer(
            &name("sgd_nesterov"),
            sgd(SgdConfig {
                lr: 0.05,
                momentum: 0.9,
                nesterov: true,
                weight_decay: 0.01,
                fused,
                ..Default::default()
            }),
        );
        check_optimizer(
            &name("sgd_maximize"),
            sgd(SgdConfig { lr: 0.05, momentum: 0.5, maximize: true, fused, ..Default::default() }),
        );
    }
}

#[test]
fn adam_equals_torch_over_100_steps_unfused_and_fused() {
    for fused in [false, true] {
        check_optimizer(&reference_name("adam", fused), |p| {
            Box::new(
                Adam::new(
                    unnamed_params(&p),
                    AdamConfig { lr: 1e-2, weight_decay: 0.01, fused, ..Default::default() },
                )
                .unwrap(),
            )
        });
        check_optimizer(&reference_name("adam_betas", fused), |p| {
            let config = AdamConfig {
                lr: 3e-3,
                beta1: 0.8,
                beta2: 0.99,
                eps: 1e-6,
                fused,
                ..Default::default()
            };
            Box::new(Adam::new(unnamed_params(&p), config).unwrap())
        });
    }
}

#[test]
fn adamw_equals_torch_over_100_steps_unfused_fused_and_with_groups() {
    let config = AdamConfig { lr: 1e-2, weight_decay: 0.1, fused: false, ..AdamConfig::adamw() };
    check_optimizer("adamw", |p| Box::new(AdamW::new(unnamed_params(&p), config).unwrap()));
    check_optimizer("adamw_fused", |p| {
        Box::new(AdamW::new(unnamed_params(&p), AdamConfig { fused: true, ..config }).unwrap())
    });
    check_optimizer("adamw_groups", |p| {
        let named = unnamed_params(&p);
        let config =
            AdamConfig { lr: 1e-2, weight_decay: 0.05, fused: false, ..AdamConfig::adamw() };
        let mut opt = AdamW::new(vec![named[0].clone()], config).unwrap();
        opt.add_param_group(vec![named[1].clone()], AdamConfig { lr: 3e-2, ..config }).unwrap();
        Box::new(opt)
    });
}

#[test]
fn amsgrad_equals_torch_over_100_steps_for_adam_and_adamw() {
    check_optimizer("adam_amsgrad", |p| {
        let config =
            AdamConfig { lr: 1e-2, weight_decay: 0.01, amsgrad: true, ..Default::default() };
        Box::new(Adam::new(unnamed_params(&p), config).unwrap())
    });
    // Fused is asked for and AMSGrad takes torch's single-tensor path anyway.
    check_optimizer("adamw_amsgrad", |p| {
        let config =
            AdamConfig { lr: 1e-2, weight_decay: 0.1, amsgrad: true, ..AdamConfig::adamw() };
        Box::new(AdamW::new(unnamed_params(&p), config).unwrap())
    });
}

#[test]
fn schedules_equal_torch_step_by_step() {
    let r = optim_reference();
    let schedules = [
        ("constant", Schedule::Constant),
        ("constant_warmup", Schedule::ConstantWithWarmup { warmup_steps: 5 }),
        ("linear_warmup", Schedule::LinearWarmup { warmup_steps: 10, total_steps: 40 }),
        (
            "cosine_warmup",
            Schedule::CosineWarmup { warmup_steps: 8, total_steps: 40, num_cycles: 0.5 },
        ),
        ("one_cycle", Schedule::one_cycle(0.5, 41)),
        ("step", Schedule::Step { step_size: 7, gamma: 0.3 }),
    ];
    for (name, schedule) in schedules {
        let p = Tensor::zeros([1], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let config = SgdConfig { lr: 0.1, momentum: 0.9, ..Default::default() };
        let mut opt = Sgd::new(unnamed_params(&[p]), config).unwrap();
        let mut scheduler = LrScheduler::new(schedule, &mut opt).unwrap();
        let lrs = Vec::<f64>::try_from(&r[&format!("sched.{name}.lr")]).unwrap();
        let momenta = Vec::<f64>::try_from(&r[&format!("sched.{name}.momentum")]).unwrap();
        for (step, (lr, momentum)) in lrs.iter().zip(&momenta).enumerate() {
            let (ours, our_momentum) = (opt.lr(0), opt.momentum(0).unwrap());
            assert!(
                (ours - lr).abs() <= 1e-12 * lr.abs().max(1e-12),
                "{name} step {step}: lr {ours} vs torch {lr}"
            );
            assert!(
                (our_momentum - momentum).abs() <= 1e-12,
                "{name} step {step}: momentum {our_momentum} vs {momentum}"
            );
            scheduler.step(&mut opt).unwrap();
        }
    }
}

#[test]
fn accumulation_matches_accelerate_gradients_lr_and_parameters() {
    use accel_core::data::{DataLoader, LoaderOptions, TensorDataset};
    use accel_core::{Accelerator, optim::named_params};
    use tch::nn::{self, Module};

    let r = cached_reference("accumulate.py");
    let acc = Accelerator::builder().accumulate(3).cpu(true).build().unwrap();
    let vs = nn::VarStore::new(Device::Cpu);
    let root = vs.root();
    let net = nn::seq()
        .add(nn::linear(&root / "0", 4, 8, Default::default()))
        .add_fn(|x| x.tanh())
        .add(nn::linear(&root / "2", 8, 2, Default::default()));
    tch::no_grad(|| {
        for (name, mut t) in vs.variables() {
            t.copy_(&r[&format!("init.{name}")]);
        }
    });
    acc.prepare_model(&vs).unwrap();
    let sgd =
        Sgd::new(named_params(&vs), SgdConfig { lr: 0.1, momentum: 0.9, ..Default::default() })
            .unwrap();
    let mut opt = acc.prepare_optimizer(sgd);
    opt.set_schedule(Schedule::LinearWarmup { warmup_steps: 2, total_steps: 8 }).unwrap();
    let data =
        TensorDataset::new(vec![r["data.x"].shallow_clone(), r["data.y"].shallow_clone()]).unwrap();
    let loader =
        DataLoader::new(data, LoaderOptions { batch_size: 4, ..Default::default() }).unwrap();
    let mut loader = acc.prepare_loader(loader).unwrap();

    let expected_lr = Vec::<f64>::try_from(&r["lr"]).unwrap();
    let expected_sync = Vec::<i64>::try_from(&r["sync"]).unwrap();
    let mut step = 0;
    for _epoch in 0..2 {
        for batch in loader.iter() {
            let batch = batch.unwrap();
            let loss = net.forward(&batch[0]).mse_loss(&batch[1], tch::Reduction::Mean);
            acc.backward(&loss).unwrap();
            assert_eq!(acc.sync_gradients(), expected_sync[step] == 1, "sync flag at step {step}");
            for (name, p) in vs.variables() {
                let diff = max_abs_diff(&p.grad(), &r[&format!("grad.{step}.{name}")]);
                assert!(
                    diff < 1e-6,
                    "step {step}: gradient of {name} differs from Accelerate's by {diff}"
                );
            }
            opt.step().unwrap();
            opt.zero_grad().unwrap();
            assert!(
                (opt.lr() - expected_lr[step]).abs() < 1e-12,
                "step {step}: lr {} vs {}",
                opt.lr(),
                expected_lr[step]
            );
            for (name, p) in vs.variables() {
                let diff = max_abs_diff(&p, &r[&format!("param.{step}.{name}")]);
                assert!(diff < 1e-6, "step {step}: {name} differs from Accelerate's by {diff}");
            }
            step += 1;
        }
    }
    assert_eq!(step, 20);
    assert_eq!(acc.counters().optimizer_steps, 8, "4 windows per epoch");
}

/// A tracker of one's own, counting what reaches it.
struct Counting(std::sync::Arc<std::sync::Mutex<Vec<(u64, usize)>>>);

impl accel_core::tracking::Tracker for Counting {
    fn name(&self) -> &str {
        "counting"
    }
    fn log(&mut self, step: u64, values: &[(&str, f64)]) -> accel_core::Result<()> {
        self.0.lock().unwrap().push((step, values.len()));
        Ok(())
    }
}

/// Accelerate's `log_with` / `init_trackers` / `log` / `end_training`: the event files
/// accel writes are read back by TensorBoard's own reader (scalars and the hparams
/// plugin's records), next to the JSONL/CSV files and a tracker of one's own.
#[test]
fn tensorboard_reads_the_scalars_and_hyperparameters_accel_logged() {
    use accel_core::tracking::LogWith;
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("tensorboard");
    let _ = std::fs::remove_dir_all(&dir);
    let acc = accel_core::Accelerator::builder()
        .cpu(true)
        .log_with([LogWith::All])
        .project_dir(&dir)
        .build()
        .unwrap();
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    acc.add_tracker(Box::new(Counting(seen.clone())));
    let config = serde_json::json!({
        "lr": 0.001, "optimizer": "adamw", "fused": true, "model": {"width": 64, "layers": 2}
    });
    acc.init_trackers("digits", &config).unwrap();
    for step in 1..=5u64 {
        let loss = 1.0 / step as f64;
        acc.log(step * 10, &[("loss", loss), ("accuracy", 1.0 - loss / 2.0)]).unwrap();
    }
    // Media: an RGB image from a [C, H, W] tensor, text, and a table (as Markdown text).
    use accel_core::tracking::Value;
    let rgb = Tensor::arange(3 * 4 * 5, (Kind::Float, Device::Cpu)).view([3, 4, 5]) / 59.0;
    let table = Value::table(["digit", "guess"], vec![vec![3.into(), 8.into()]]).unwrap();
    let media = [
        ("samples", Value::image(&rgb).unwrap()),
        ("notes", Value::text("**bold** start")),
        ("wrong", table),
    ];
    acc.log(50, &media).unwrap();
    acc.end_training().unwrap();

    let python = std::env::var_os("ACCEL_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join(".venv/bin/python"));
    let output = Command::new(python)
        .arg(root().join("python/reference/read_tensorboard.py"))
        .arg(dir.join("digits"))
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let read: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    let loss = read["scalars"]["loss"].as_array().unwrap();
    assert_eq!(loss.len(), 5, "{read}");
    for (i, point) in loss.iter().enumerate() {
        let step = (i as u64 + 1) * 10;
        assert_eq!(point[0].as_u64(), Some(step));
        let expected = 1.0 / (i + 1) as f64;
        assert!((point[1].as_f64().unwrap() - expected).abs() < 1e-6, "{point}");
    }
    assert_eq!(read["scalars"]["accuracy"][4][1].as_f64(), Some(0.8999999761581421));
    let hparams = &read["hparams"];
    assert_eq!(hparams["lr"].as_f64(), Some(0.001), "{read}");
    assert_eq!(hparams["model.width"].as_f64(), Some(64.0));
    assert_eq!(hparams["optimizer"].as_str(), Some("adamw"));
    assert_eq!(hparams["fused"].as_bool(), Some(true));
    assert_eq!(read["metrics"], serde_json::json!(["accuracy", "loss"]));
    assert_eq!(read["ended"], true);
    let image = &read["images"]["samples"][0];
    assert_eq!(
        (image[0].as_u64(), image[1].as_u64(), image[2].as_u64()),
        (Some(50), Some(5), Some(4))
    );
    let Value::Image(expected) = &media[0].1 else { unreachable!() };
    let hex: String = expected.png().unwrap().iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(image[3].as_str(), Some(hex.as_str()), "the PNG TensorBoard reads back");
    assert_eq!(read["text"]["notes"], serde_json::json!([[50, "**bold** start"]]));
    assert_eq!(read["text"]["wrong"][0][1], "| digit | guess |\n| --- | --- |\n| 3 | 8 |\n");

    let jsonl = std::fs::read_to_string(dir.join("digits/metrics.jsonl")).unwrap();
    assert_eq!(jsonl.lines().filter(|l| l.contains("\"loss\"")).count(), 5);
    // The media beside it, pointed at by a record each.
    assert!(
        jsonl.contains(r#"{"samples":{"_type":"image","path":"media/samples_50.png"},"step":50}"#),
        "{jsonl}"
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("digits/media/notes_50.txt")).unwrap(),
        "**bold** start"
    );
    assert!(dir.join("digits/media/wrong_50.json").exists());
    let csv = std::fs::read_to_string(dir.join("digits/metrics.csv")).unwrap();
    assert!(csv.starts_with("step,loss,accuracy\n10,1,0.5\n"), "{csv}");
    let saved: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("digits/hparams.json")).unwrap())
            .unwrap();
    assert_eq!(saved, config);
    assert_eq!(*seen.lock().unwrap(), [(10, 2), (20, 2), (30, 2), (40, 2), (50, 2)]);
}
