//! The one-process runtime end to end: resume, checkpoint integrity, mixed precision, data.
//!
//! torch's generators are global to the process, so these tests take turns (`serial`).

use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};

use accel_core::data::{DataLoader, LoaderOptions, MapDataset, Sampler, TensorDataset, stack};
use accel_core::optim::{AdamConfig, AdamW, Schedule, Sgd, SgdConfig, TchOptimizer, named_params};
use accel_core::{AcceleratedOptimizer, Accelerator, Precision, PreparedLoader};
use tch::nn::{self, Module, ModuleT, OptimizerConfig};
use tch::{Device, Kind, Tensor};

fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn scratch(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("training").join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

/// An MLP with dropout, AdamW with a cosine schedule, shuffled batches.
struct Run {
    acc: Accelerator,
    vs: nn::VarStore,
    net: nn::SequentialT,
    opt: AcceleratedOptimizer,
    loader: PreparedLoader<TensorDataset>,
}

fn data() -> (Tensor, Tensor) {
    let g = Tensor::arange(50 * 8, (Kind::Float, Device::Cpu)).view([50, 8]);
    let x = (g.sin() * 3.0).cos();
    let y = Tensor::arange(50, (Kind::Int64, Device::Cpu)).remainder(3);
    (x, y)
}

fn run(init_seed: i64, hidden: i64) -> Run {
    let acc = Accelerator::builder().accumulate(2).cpu(true).build().unwrap();
    tch::manual_seed(init_seed);
    let vs = nn::VarStore::new(Device::Cpu);
    let root = vs.root();
    let net = nn::seq_t()
        .add(nn::linear(&root / "layers" / 0, 8, hidden, Default::default()))
        .add_fn_t(|x, train| x.dropout(0.3, train))
        .add_fn(|x| x.relu())
        .add(nn::linear(&root / "layers" / 1, hidden, 3, Default::default()));
    acc.prepare_model(&vs).unwrap();
    let adamw =
        AdamW::new(named_params(&vs), AdamConfig { lr: 1e-2, ..AdamConfig::adamw() }).unwrap();
    let mut opt = acc.prepare_optimizer(adamw);
    opt.set_schedule(Schedule::CosineWarmup { warmup_steps: 3, total_steps: 21, num_cycles: 0.5 })
        .unwrap();
    let (x, y) = data();
    let options = LoaderOptions {
        batch_size: 4,
        sampler: Sampler::Shuffled { seed: 7 },
        ..Default::default()
    };
    let loader = DataLoader::new(TensorDataset::new(vec![x, y]).unwrap(), options).unwrap();
    let loader = acc.prepare_loader(loader).unwrap();
    Run { acc, vs, net, opt, loader }
}

/// Trains to the end of epoch 3, or stops after `stop_after` micro-steps; returns how many
/// micro-steps ran.
fn train(r: &mut Run, stop_after: Option<usize>) -> usize {
    let mut steps = 0;
    for _ in r.loader.epoch()..3 {
        for batch in r.loader.iter() {
            let batch = batch.unwrap();
            let logits = r.net.forward_t(&batch[0], true);
            let loss = logits.cross_entropy_for_logits(&batch[1]);
            r.acc.backward(&loss).unwrap();
            r.opt.step().unwrap();
            r.opt.zero_grad().unwrap();
            steps += 1;
            if Some(steps) == stop_after {
                return steps;
            }
        }
    }
    steps
}

fn params(vs: &nn::VarStore) -> Vec<(String, Tensor)> {
    let mut v: Vec<_> = vs.variables().into_iter().map(|(n, t)| (n, t.detach().copy())).collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

#[test]
fn resume_from_save_state_is_bit_identical() {
    let _serial = serial();
    let dir = scratch("resume");
    let mut whole = run(0, 16);
    let total = train(&mut whole, None);
    assert_eq!(total, 39, "13 batches × 3 epochs");
    let expected = params(&whole.vs);

    let mut first = run(0, 16);
    assert_eq!(train(&mut first, Some(17)), 17, "stops inside epoch 2, mid accumulation window");
    first.acc.save_state(&dir).unwrap();
    drop(first);

    // A new process, in effect: other initial weights, all state from the checkpoint.
    let mut resumed = run(12345, 16);
    resumed.acc.load_state(&dir).unwrap();
    assert_eq!(resumed.loader.epoch(), 1);
    let rest = train(&mut resumed, None);
    assert_eq!(rest, total - 17);
    for ((name, a), (_, b)) in expected.iter().zip(params(&resumed.vs)) {
        assert_eq!(max_abs_diff(a, &b), 0.0, "{name} differs after resuming");
    }
    assert_eq!(resumed.acc.counters(), whole.acc.counters());
    assert_eq!(resumed.opt.lr(), whole.opt.lr());
}

#[test]
fn truncated_or_corrupted_checkpoints_are_named_errors() {
    let _serial = serial();
    let dir = scratch("truncated");
    let mut r = run(0, 16);
    train(&mut r, Some(3));
    r.acc.save_state(&dir).unwrap();
    let before = params(&r.vs);

    let model = dir.join("model.safetensors");
    let bytes = std::fs::read(&model).unwrap();
    std::fs::write(&model, &bytes[..bytes.len() / 2]).unwrap();
    let err = r.acc.load_state(&dir).unwrap_err().to_string();
    assert!(err.contains("model.safetensors") && err.contains("truncated"), "{err}");

    let mut flipped = bytes.clone();
    let middle = flipped.len() - 20;
    flipped[middle] ^= 0x55;
    std::fs::write(&model, &flipped).unwrap();
    let err = r.acc.load_state(&dir).unwrap_err().to_string();
    assert!(err.contains("model.safetensors") && err.contains("corrupted"), "{err}");

    // A failed load changes nothing.
    for ((name, a), (_, b)) in before.iter().zip(params(&r.vs)) {
        assert_eq!(max_abs_diff(a, &b), 0.0, "{name} changed by a failed load");
    }
}

#[test]
fn a_checkpoint_of_another_model_names_the_tensor() {
    let _serial = serial();
    let dir = scratch("other-model");
    let small = run(0, 16);
    small.acc.save_state(&dir).unwrap();
    let wide = run(0, 32);
    let err = wide.acc.load_state(&dir).unwrap_err().to_string();
    assert!(err.contains("model.safetensors"), "{err}");
    assert!(err.contains("layers.0.") && err.contains("[16") && err.contains("[32"), "{err}");
}

#[test]
fn a_failed_save_leaves_the_previous_checkpoint_intact() {
    let _serial = serial();
    let dir = scratch("atomic");
    let r = run(0, 16);
    r.acc.save_state(dir.join("ckpt")).unwrap();
    let manifest = std::fs::read(dir.join("ckpt/manifest.json")).unwrap();
    // tch's optimizer cannot export its state: the second save fails part-way.
    let tch_opt = nn::Sgd::default().build(&r.vs, 0.1).unwrap();
    let _ = r.acc.prepare_optimizer(TchOptimizer::new(tch_opt, 0.1));
    let err = r.acc.save_state(dir.join("ckpt")).unwrap_err().to_string();
    assert!(err.contains("cannot export its state"), "{err}");
    assert_eq!(std::fs::read(dir.join("ckpt/manifest.json")).unwrap(), manifest);
    let leftovers: Vec<_> =
        std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(leftovers.len(), 1, "temporary folders left behind: {leftovers:?}");
}

#[test]
fn automatic_checkpoint_names_keep_the_newest_within_the_limit() {
    let _serial = serial();
    let dir = scratch("auto");
    let acc = Accelerator::builder().cpu(true).checkpoints(&dir, Some(2)).build().unwrap();
    let vs = nn::VarStore::new(Device::Cpu);
    let _lin = nn::linear(vs.root() / "lin", 2, 2, Default::default());
    acc.prepare_model(&vs).unwrap();
    for _ in 0..3 {
        acc.save_checkpoint().unwrap();
    }
    let mut names: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, ["checkpoint_1", "checkpoint_2"]);
    assert_eq!(acc.load_latest_checkpoint().unwrap(), Some(dir.join("checkpoint_2")));
}

#[test]
fn checkpoints_survive_interruptions_and_a_second_writer_is_refused() {
    let _serial = serial();
    let dir = scratch("durable");
    let acc = Accelerator::builder().cpu(true).checkpoints(&dir, None).build().unwrap();
    let vs = nn::VarStore::new(Device::Cpu);
    let _lin = nn::linear(vs.root() / "lin", 2, 2, Default::default());
    acc.prepare_model(&vs).unwrap();
    let first = acc.save_checkpoint().unwrap();
    let second = acc.save_checkpoint().unwrap();

    // A damaged newest checkpoint is skipped for the newest complete one.
    let model = second.join("model.safetensors");
    let mut bytes = std::fs::read(&model).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x55;
    std::fs::write(&model, &bytes).unwrap();
    assert_eq!(acc.load_latest_checkpoint().unwrap(), Some(first.clone()));
    std::fs::remove_dir_all(&second).unwrap();

    // A replacement stopped between its two renames: the old folder is put back.
    std::fs::rename(&first, dir.join("checkpoint_0.old-4242")).unwrap();
    acc.load_state(&first).unwrap();
    assert!(first.join("manifest.json").exists());

    // A checkpoint folder whose parents do not exist yet is made whole.
    acc.save_state(dir.join("not/yet/there")).unwrap();
    assert!(dir.join("not/yet/there/manifest.json").exists());

    // A folder another live process is writing is refused, naming the lock...
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
    let lock = dir.join(".checkpoint_0.lock");
    std::fs::write(&lock, format!("1 {}", host.trim())).unwrap();
    let err = acc.save_state(&first).unwrap_err().to_string();
    assert!(err.contains("another job") && err.contains(".checkpoint_0.lock"), "{err}");
    // ...and the lock of a process that no longer runs is taken over, then released.
    let mut gone = std::process::Command::new("true").spawn().unwrap();
    gone.wait().unwrap();
    std::fs::write(&lock, format!("{} {}", gone.id(), host.trim())).unwrap();
    acc.save_state(&first).unwrap();
    assert!(!lock.exists());

    // A crafted manifest's world size is refused before anything is sized by it.
    let manifest = first.join("manifest.json");
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&manifest).unwrap()).unwrap();
    json["world_size"] = serde_json::json!(1_000_000_000_000_000_000u64);
    std::fs::write(&manifest, json.to_string()).unwrap();
    let err = acc.load_state(&first).unwrap_err().to_string();
    assert!(err.contains("world_size 1000000000000000000"), "{err}");
}

/// Property: a manifest with random bytes changed loads or is a named error — never a panic —
/// and a failed load changes no weight.
#[test]
fn mutated_manifests_never_panic_and_failed_loads_change_nothing() {
    use rand::{Rng, SeedableRng};
    let _serial = serial();
    let dir = scratch("mutated");
    let r = run(0, 16);
    r.acc.save_state(&dir).unwrap();
    let before = params(&r.vs);
    let manifest = dir.join("manifest.json");
    let original = std::fs::read(&manifest).unwrap();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
    let digits = b"0123456789";
    for _ in 0..300 {
        let mut bytes = original.clone();
        for _ in 0..rng.random_range(1..4) {
            let at = rng.random_range(0..bytes.len());
            // Digits mostly, so that many mutants still parse and reach the checks.
            bytes[at] = if rng.random_bool(0.7) && bytes[at].is_ascii_digit() {
                digits[rng.random_range(0..10)]
            } else {
                rng.random()
            };
        }
        std::fs::write(&manifest, &bytes).unwrap();
        let loaded =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| r.acc.load_state(&dir)));
        let loaded = loaded.unwrap_or_else(|_| {
            panic!("load_state panicked on manifest {}", String::from_utf8_lossy(&bytes))
        });
        if loaded.is_err() {
            for ((name, a), (_, b)) in before.iter().zip(params(&r.vs)) {
                assert_eq!(max_abs_diff(a, &b), 0.0, "{name} changed by a failed load");
            }
        }
    }
    std::fs::write(&manifest, &original).unwrap();
}

#[test]
fn save_model_shards_with_an_index() {
    let _serial = serial();
    let dir = scratch("save-model");
    let r = run(0, 16);
    // layers.0.weight is 16×8×4 = 512 bytes; a 600-byte limit forces several shards.
    r.acc.save_model(&r.vs, dir.join("model"), 600).unwrap();
    let index: serde_json::Value = serde_json::from_slice(
        &std::fs::read(dir.join("model/model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let map = index["weight_map"].as_object().unwrap();
    assert_eq!(map.len(), 4);
    let mut total = 0;
    for (name, file) in map {
        let tensors =
            Tensor::read_safetensors(dir.join("model").join(file.as_str().unwrap())).unwrap();
        let (_, t) = tensors.iter().find(|(n, _)| n == name).unwrap();
        let original = r.vs.variables()[name].detach();
        assert_eq!(max_abs_diff(t, &original), 0.0);
        total += t.numel() * 4;
    }
    assert_eq!(index["metadata"]["total_size"].as_u64().unwrap() as usize, total);
    assert!(std::fs::read_dir(dir.join("model")).unwrap().count() >= 3);
}

#[test]
fn fp16_skips_a_step_with_inf_gradients_halves_the_scale_then_steps() {
    let _serial = serial();
    let acc = Accelerator::builder().precision(Precision::Fp16).cpu(true).build().unwrap();
    let vs = nn::VarStore::new(Device::Cpu);
    let lin = nn::linear(vs.root() / "lin", 3, 1, Default::default());
    acc.prepare_model(&vs).unwrap();
    let sgd = Sgd::new(named_params(&vs), SgdConfig { lr: 0.1, ..Default::default() }).unwrap();
    let mut opt = acc.prepare_optimizer(sgd);
    let x = Tensor::ones([4, 3], (Kind::Float, Device::Cpu));
    assert_eq!(acc.loss_scale(), Some(65536.0));

    let before = params(&vs);
    let out = acc.forward(|| lin.forward(&x)).unwrap();
    assert_eq!(out.kind(), Kind::Float, "outputs come back in fp32");
    acc.backward(&out.mean(Kind::Float)).unwrap();
    let weight = vs.variables()["lin.weight"].shallow_clone();
    let mut grad = weight.grad();
    let _ = grad.fill_(f64::INFINITY);
    opt.step().unwrap();
    opt.zero_grad().unwrap();
    assert!(opt.step_was_skipped());
    assert_eq!(acc.loss_scale(), Some(32768.0));
    for ((name, a), (_, b)) in before.iter().zip(params(&vs)) {
        assert_eq!(max_abs_diff(a, &b), 0.0, "{name} changed in a skipped step");
    }

    let out = acc.forward(|| lin.forward(&x)).unwrap();
    acc.backward(&out.mean(Kind::Float)).unwrap();
    // The gradient reaching the optimizer is unscaled: d(mean)/dw = 1 per input.
    opt.step().unwrap();
    assert!(!opt.step_was_skipped());
    let moved = max_abs_diff(&before[1].1, &vs.variables()["lin.weight"]);
    assert!((moved - 0.1).abs() < 1e-3, "an unscaled step moves the weight by lr × 1, got {moved}");
    assert_eq!(acc.counters().skipped_steps, 1);
    assert_eq!(acc.counters().optimizer_steps, 1);
}

/// A driven optimizer (tch's own, kept by the program: what `self.opt.step()` becomes under
/// the attribute) goes through the step sequence of prepared optimizers: fp16 gradients
/// unscaled once even when clipped before the step, a step with inf gradients skipped with
/// the scale halved, the configured norm clipping, the steps counted; on an accumulation
/// step nothing happens.
#[test]
fn a_driven_optimizer_follows_the_prepared_step_sequence() {
    let _serial = serial();
    let acc = Accelerator::builder()
        .precision(Precision::Fp16)
        .clip_grad_norm(0.5)
        .accumulate(2)
        .cpu(true)
        .build()
        .unwrap();
    let vs = nn::VarStore::new(Device::Cpu);
    let lin = nn::linear(vs.root() / "lin", 4, 1, Default::default());
    acc.prepare_model(&vs).unwrap();
    let mut opt = nn::Sgd::default().build(&vs, 0.1).unwrap();
    let x = Tensor::ones([2, 4], (Kind::Float, Device::Cpu));
    let weight = vs.variables()["lin.weight"].shallow_clone();
    let micro_step = |acc: &Accelerator| {
        let out = acc.forward(|| lin.forward(&x)).unwrap();
        acc.backward(&out.mean(Kind::Float)).unwrap();
    };

    // Accumulation step: no step, no clipping, no unscale.
    micro_step(&acc);
    let before = weight.copy();
    acc.drive(&mut opt).step().unwrap();
    assert_eq!(max_abs_diff(&before, &weight), 0.0, "an accumulation step moved the weights");
    // Sync step with an inf gradient: skipped, the scale halved.
    micro_step(&acc);
    let _ = weight.grad().fill_(f64::INFINITY);
    acc.drive(&mut opt).step().unwrap();
    assert_eq!(max_abs_diff(&before, &weight), 0.0, "a skipped step moved the weights");
    assert_eq!(acc.loss_scale(), Some(32768.0));
    acc.drive(&mut opt).zero_grad().unwrap();

    // Two micro-steps, a norm clip asked for before the step: the gradient (d(mean)/dw = 1
    // per input, summed over 2 micro-steps and divided by them: 1, the bias 1) is unscaled
    // once, its norm (sqrt(5)) reported, clipped to 0.5 by the configured clipping.
    micro_step(&acc);
    acc.drive(&mut opt).step().unwrap();
    micro_step(&acc);
    let norm = acc.drive(&mut opt).clip_grad_norm(10.0).unwrap();
    assert!((norm - 5f64.sqrt()).abs() < 1e-3, "the norm of unscaled gradients, got {norm}");
    acc.drive(&mut opt).step().unwrap();
    let moved = (&weight - &before).abs().max().double_value(&[]);
    let clipped = 0.1 * 0.5 / 5f64.sqrt();
    assert!((moved - clipped).abs() < 1e-4, "lr x the clipped gradient: {clipped}, got {moved}");
    assert_eq!(acc.counters().skipped_steps, 1);
    assert_eq!(acc.counters().optimizer_steps, 1);
}

#[test]
fn bf16_runs_matmuls_in_bf16_and_returns_fp32() {
    let _serial = serial();
    let acc = Accelerator::builder().precision(Precision::Bf16).cpu(true).build().unwrap();
    let vs = nn::VarStore::new(Device::Cpu);
    let lin = nn::linear(vs.root() / "lin", 3, 2, Default::default());
    let x = Tensor::ones([4, 3], (Kind::Float, Device::Cpu));
    let inner = std::cell::Cell::new(Kind::Float);
    let out = acc
        .forward(|| {
            let y = lin.forward(&x);
            inner.set(y.kind());
            y
        })
        .unwrap();
    assert_eq!(inner.get(), Kind::BFloat16);
    assert_eq!(out.kind(), Kind::Float);
    acc.backward(&out.sum(Kind::Float)).unwrap();
    assert_eq!(vs.variables()["lin.weight"].grad().kind(), Kind::Float);
}

#[test]
fn fp8_keeps_first_last_and_odd_layers_in_bf16_and_refuses_a_model_without_fp8_layers() {
    let _serial = serial();
    let acc = Accelerator::builder().precision(Precision::Fp8).cpu(true).build().unwrap();
    // Layers made with plain nn::linear cannot become fp8: an error, not a silent bf16 run.
    let plain = nn::VarStore::new(Device::Cpu);
    let _ = nn::linear(plain.root() / "l", 32, 32, Default::default());
    let err = acc.prepare_model(&plain).unwrap_err().to_string();
    assert!(err.contains("accelerator.linear") && err.contains("bf16"), "{err}");

    let vs = nn::VarStore::new(Device::Cpu);
    let widths = [32, 64, 48, 10, 32];
    let layers: Vec<_> = widths
        .windows(2)
        .enumerate()
        .map(|(i, w)| acc.linear(vs.root() / i, w[0], w[1], Default::default()))
        .collect();
    acc.prepare_model(&vs).unwrap();
    let fp8: Vec<bool> = layers.iter().map(|l| l.fp8_recipe().is_some()).collect();
    // first, middle, 48→10 (not a multiple of 16), last
    assert_eq!(fp8, [false, true, false, false]);
    let mut opt = acc.build_optimizer(nn::Sgd::default(), &vs, 0.1).unwrap();
    let x = Tensor::randn([8, 32], (Kind::Float, Device::Cpu));
    let out =
        acc.forward(|| layers.iter().fold(x.shallow_clone(), |h, l| l.forward(&h).relu())).unwrap();
    let loss = out.square().mean(Kind::Float);
    acc.backward(&loss).unwrap();
    let grad = layers[1].ws.grad();
    assert!(grad.defined() && grad.abs().sum(Kind::Float).double_value(&[]) > 0.0);
    opt.step().unwrap();
}

#[test]
fn a_non_scalar_loss_is_refused() {
    let _serial = serial();
    let acc = Accelerator::builder().cpu(true).build().unwrap();
    let err = acc.backward(&Tensor::ones([3], (Kind::Float, Device::Cpu))).unwrap_err();
    assert!(err.to_string().contains("scalar loss"), "{err}");
}

#[test]
fn loader_prefetch_and_inline_agree_and_shuffles_are_seeded() {
    let _serial = serial();
    let (x, y) = data();
    let order_with = |prefetch: usize, num_workers: usize, seed: u64, epochs: usize| {
        let options = LoaderOptions {
            batch_size: 8,
            sampler: Sampler::Shuffled { seed },
            prefetch,
            num_workers,
            ..Default::default()
        };
        let mut loader = DataLoader::new(
            TensorDataset::new(vec![x.shallow_clone(), y.shallow_clone()]).unwrap(),
            options,
        )
        .unwrap();
        let mut out = Vec::new();
        for _ in 0..epochs {
            for batch in loader.iter() {
                let rows = batch.unwrap()[0].select(1, 0);
                out.push(
                    Vec::<f32>::try_from(&rows).unwrap().iter().map(|v| (v * 1e4) as i64).collect(),
                );
            }
        }
        out
    };
    let order = |prefetch: usize, seed: u64, epochs: usize| -> Vec<Vec<i64>> {
        order_with(prefetch, 0, seed, epochs)
    };
    let a = order(0, 1, 2);
    assert_eq!(a, order(3, 1, 2), "prefetching changes nothing");
    for workers in [1, 2, 4] {
        assert_eq!(a, order_with(2, workers, 1, 2), "{workers} workers change nothing");
    }
    assert_ne!(a, order(0, 2, 2), "another seed, another order");
    assert_ne!(a[..7], a[7..], "each epoch its own order");
    assert_eq!(a.len(), 14, "50 samples in batches of 8: 7 per epoch");
}

/// Worker threads (`num_workers`): an epoch left early gives the data set back to the next
/// one, and a batch that fails to build is reported in its place, after the ones before it.
#[test]
fn loader_workers_stop_early_and_report_a_failing_batch_in_its_place() {
    let _serial = serial();
    let dataset = MapDataset::new(
        40,
        |i| {
            if i == 21 {
                return Err(accel_core::Error::Training("sample 21 is corrupt".into()));
            }
            Ok(Tensor::from_slice(&[i as f32]))
        },
        stack,
    );
    let options = LoaderOptions { batch_size: 4, num_workers: 4, ..Default::default() };
    let mut loader = DataLoader::new(dataset, options).unwrap();
    let first: Vec<f32> = loader
        .iter()
        .take(2)
        .flat_map(|b| Vec::<f32>::try_from(b.unwrap().view([-1])).unwrap())
        .collect();
    assert_eq!(first, (0..8).map(|i| i as f32).collect::<Vec<_>>());
    let results: Vec<_> = loader.iter().collect();
    for (b, result) in results.iter().enumerate().take(5) {
        let rows = Vec::<f32>::try_from(result.as_ref().unwrap().view([-1])).unwrap();
        assert_eq!(rows, (4 * b..4 * b + 4).map(|i| i as f32).collect::<Vec<_>>(), "batch {b}");
    }
    let err = results[5].as_ref().unwrap_err().to_string();
    assert!(err.contains("sample 21"), "{err}");
}

#[test]
fn prepared_iterators_flag_the_last_batch_and_skip_resumes() {
    let _serial = serial();
    let acc = Accelerator::builder().cpu(true).build().unwrap();
    let flags: Vec<bool> =
        acc.prepare_iter(vec![1i64, 2, 3]).map(|_| acc.end_of_dataloader()).collect();
    assert_eq!(flags, [false, false, true]);

    let (x, y) = data();
    let loader = DataLoader::new(
        TensorDataset::new(vec![x, y]).unwrap(),
        LoaderOptions { batch_size: 10, ..Default::default() },
    )
    .unwrap();
    let mut loader = acc.prepare_loader(loader).unwrap();
    loader.skip_first_batches(3);
    let firsts: Vec<i64> = loader.iter().map(|b| b.unwrap()[1].int64_value(&[0])).collect();
    assert_eq!(firsts, [30 % 3, 40 % 3], "batches 3 and 4 of 5 remain");
    assert_eq!(loader.epoch(), 1);
}

#[test]
fn map_datasets_fetch_items_and_collate_them() {
    let _serial = serial();
    let dataset =
        MapDataset::new(5, |i| Ok(Tensor::from_slice(&[i as f32, 10.0 * i as f32])), stack);
    let options = LoaderOptions { batch_size: 2, prefetch: 1, ..Default::default() };
    let mut loader = DataLoader::new(dataset, options).unwrap();
    let shapes: Vec<Vec<i64>> = loader.iter().map(|b| b.unwrap().size()).collect();
    assert_eq!(shapes, [vec![2, 2], vec![2, 2], vec![1, 2]]);
    let first = loader.iter().next().unwrap().unwrap();
    assert_eq!(Vec::<f32>::try_from(first.flatten(0, -1)).unwrap(), [0.0, 0.0, 1.0, 10.0]);
}

/// A two-group MLP (the head in tch parameter group 1), seeded.
fn grouped_mlp(vs: &nn::VarStore) -> nn::Sequential {
    tch::manual_seed(11);
    let head = vs.root().set_group(1);
    nn::seq()
        .add(nn::linear(vs.root() / "layers" / 0, 8, 12, Default::default()))
        .add_fn(|x| x.tanh())
        .add(nn::linear(&head / "layers" / 1, 12, 3, Default::default()))
}

#[test]
fn the_prepared_optimizer_speaks_tchs_optimizer_api_with_tchs_results() {
    let _serial = serial();
    let (x, y) = data();
    let config = nn::Sgd { momentum: 0.9, dampening: 0.0, wd: 1e-3, nesterov: true };
    // tch's own optimizer, driven through its whole API.
    let theirs_vs = nn::VarStore::new(Device::Cpu);
    let theirs_net = grouped_mlp(&theirs_vs);
    let mut theirs = config.build(&theirs_vs, 0.05).unwrap();
    // The accelerator's, driven through the same calls.
    let acc = Accelerator::builder().cpu(true).build().unwrap();
    let ours_vs = nn::VarStore::new(Device::Cpu);
    let ours_net = grouped_mlp(&ours_vs);
    let mut ours = acc.build_optimizer(config, &ours_vs, 0.05).unwrap();
    assert_eq!(ours.lrs().len(), 2, "tch's parameter groups become the optimizer's");
    assert_eq!(ours.trainable_variables().len(), theirs.trainable_variables().len());
    for step in 0..12i64 {
        let (xb, yb) = (x.narrow(0, (step % 5) * 10, 10), y.narrow(0, (step % 5) * 10, 10));
        match step {
            3 => {
                theirs.set_lr_group(1, 0.01);
                ours.set_lr_group(1, 0.01);
                theirs.set_weight_decay(1e-2);
                ours.set_weight_decay(1e-2);
            }
            6 => {
                theirs.set_momentum(0.5);
                ours.set_momentum(0.5);
                theirs.set_weight_decay_group(0, 0.0);
                ours.set_weight_decay_group(0, 0.0);
            }
            9 => {
                theirs.set_lr(0.02);
                ours.set_lr(0.02);
            }
            _ => {}
        }
        let loss_theirs = theirs_net.forward(&xb).cross_entropy_for_logits(&yb);
        let loss_ours = ours_net.forward(&xb).cross_entropy_for_logits(&yb);
        match step % 3 {
            0 => {
                theirs.backward_step_clip(&loss_theirs, 0.05);
                ours.backward_step_clip(&loss_ours, 0.05).unwrap();
            }
            1 => {
                theirs.backward_step_clip_norm(&loss_theirs, 0.3);
                ours.backward_step_clip_norm(&loss_ours, 0.3).unwrap();
            }
            _ => {
                theirs.zero_grad();
                loss_theirs.backward();
                theirs.clip_grad_value(0.1);
                theirs.step();
                ours.zero_grad().unwrap();
                acc.backward(&loss_ours).unwrap();
                ours.clip_grad_value(0.1).unwrap();
                ours.step().unwrap();
            }
        }
    }
    let mut moved = 0.0f64;
    for (name, t) in theirs_vs.variables() {
        let o = &ours_vs.variables()[&name];
        let diff = max_abs_diff(&t, o);
        assert!(diff < 1e-6, "{name} differs from tch's by {diff}");
        moved = moved.max(max_abs_diff(&t, &grouped_start(&name)));
    }
    assert!(moved > 1e-2, "training did not move the weights ({moved})");
}

fn grouped_start(name: &str) -> Tensor {
    let vs = nn::VarStore::new(Device::Cpu);
    let _ = grouped_mlp(&vs);
    vs.variables()[name].copy()
}

/// A DeepSpeed JSON config as the builder's config file (the attribute's `config =
/// "ds_config.json"`): its stage, precision, accumulation and fp16 scaler settings apply,
/// and its batch sizes are checked and known to the program.
#[test]
fn a_deepspeed_json_config_file_sets_the_run() {
    let _serial = serial();
    let dir = scratch("deepspeed");
    let json = dir.join("ds_config.json");
    std::fs::write(
        &json,
        r#"{"zero_optimization": {"stage": 3}, "gradient_accumulation_steps": 2,
            "train_micro_batch_size_per_gpu": "auto", "train_batch_size": 8,
            "fp16": {"enabled": true, "initial_scale_power": 10, "hysteresis": 3}}"#,
    )
    .unwrap();
    let acc = Accelerator::builder().config_file(&json).cpu(true).build().unwrap();
    assert_eq!(acc.config().strategy, accel_core::Strategy::Zero3);
    assert_eq!(acc.config().precision, Precision::Fp16);
    assert_eq!(acc.config().accumulate, 2);
    assert_eq!(acc.loss_scale(), Some(1024.0));
    assert_eq!(acc.micro_batch_size(), Some(4), "8 = micro × 2 steps × 1 process");
    // The builder still wins over the file.
    let acc = Accelerator::builder().config_file(&json).accumulate(3).cpu(true).build();
    let err = acc.unwrap_err().to_string();
    assert!(
        err.contains("train_batch_size 8 is not a multiple of gradient_accumulation_steps 3"),
        "{err}"
    );
    // An optimizer section of "auto" values stands for the program's optimizer (as
    // Accelerate's DummyOptim); a value of its own would be lost, so it is refused.
    std::fs::write(
        &json,
        r#"{"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}, "zero_optimization": {"stage": 2}}"#,
    )
    .unwrap();
    let acc = Accelerator::builder().config_file(&json).cpu(true).build().unwrap();
    assert_eq!(acc.config().strategy, accel_core::Strategy::Zero2);
    std::fs::write(
        &json,
        r#"{"optimizer": {"type": "AdamW", "params": {"lr": 0.001}}, "zero_optimization": {"stage": 2}}"#,
    )
    .unwrap();
    let err = Accelerator::builder().config_file(&json).cpu(true).build().unwrap_err().to_string();
    assert!(
        err.contains("ds_config.json: accel cannot run with `optimizer.params.lr` (accel steps the program's optimizer"),
        "{err}"
    );
}

/// `optimizer_in_backward` on one process (zero3 there is one process's training, with a
/// hook per parameter): the update is applied inside backward and the gradients dropped;
/// what would need them afterwards, or would apply one twice, is refused by name.
#[test]
fn the_update_inside_backward_is_applied_there_and_misuse_is_refused() {
    let _serial = serial();
    let acc = Accelerator::builder()
        .cpu(true)
        .strategy(accel_core::Strategy::Zero3)
        .optimizer_in_backward(true)
        .build()
        .unwrap();
    let vs = nn::VarStore::new(Device::Cpu);
    let net = nn::linear(vs.root() / "lin", 4, 2, Default::default());
    acc.prepare_model(&vs).unwrap();
    let config = SgdConfig { lr: 0.1, ..Default::default() };
    let mut opt = acc.prepare_optimizer(Sgd::new(named_params(&vs), config).unwrap());
    let x = Tensor::ones([3, 4], (Kind::Float, Device::Cpu));
    let loss = || net.forward(&x).square().mean(Kind::Float);
    let before = net.ws.copy();
    let expected = {
        let l = loss();
        let grad = Tensor::run_backward(&[l], &[&net.ws], false, false).remove(0);
        &before - grad * 0.1
    };
    acc.backward(&loss()).unwrap();
    assert!(!net.ws.grad().defined(), "the gradient was kept");
    let diff = (&net.ws - &expected).abs().max().double_value(&[]);
    assert!(diff < 1e-7, "the update inside backward differs from SGD's by {diff}");
    let err = opt.clip_grad_norm(1.0).unwrap_err().to_string();
    assert!(err.contains("nothing left to clip"), "{err}");
    let err = opt.zero_grad().unwrap_err().to_string();
    assert!(err.contains("zero_grad() after a backward but before"), "{err}");
    let err = acc.backward(&loss()).unwrap_err().to_string();
    assert!(err.contains("got a second gradient before the optimizer's step()"), "{err}");
}
