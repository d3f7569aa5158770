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

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
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
    char_lm_run_with(name, processes, extra, &[])
}

/// [`char_lm_run`] with `env` set for the processes (e.g. `ACCEL_STRATEGY`).
fn char_lm_run_with(
    name: &str,
    processes: usize,
    extra: &[&str],
    env: &[(&str, &str)],
) -> (Vec<f64>, Vec<(String, tch::Tensor)>) {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("char-lm-split");
    std::fs::create_dir_all(&dir).unwrap();
    let text = Path::new(env!("CARGO_MANIFEST_DIR")).join("../data/kjv-genesis-exodus.txt");
    let (losses, weights) =
        (dir.join(format!("{name}.jsonl")), dir.join(format!("{name}.safetensors")));
    let small = "--steps 8 --width 64 --blocks 2 --context 32 --batch-size 8 --accumulate 2 \
                 --target 10";
    // 4 heads unless the run says otherwise.
    let heads = if extra.contains(&"--heads") { &[][..] } else { &["--heads", "4"][..] };
    let mut program = vec![example("char_lm")];
    program.extend(
        small
            .split(' ')
            .chain(heads.iter().copied())
            .chain(extra.iter().copied())
            .map(String::from),
    );
    program.extend(["--text".into(), text.display().to_string()]);
    program.extend(["--losses".into(), losses.display().to_string()]);
    program.extend(["--weights".into(), weights.display().to_string()]);
    let mut plan = LaunchPlan { rank0_only: true, ..LaunchPlan::local(processes, program) };
    plan.env.extend(env.iter().map(|(k, v)| (k.to_string(), v.to_string())));
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
        assert_trains_alike(name, (&reference, &whole), char_lm_run(name, processes, extra));
    }
}

/// Every step's loss within 1e-5 and every weight within 1e-4 (relative) of the reference.
fn assert_trains_alike(
    name: &str,
    (reference, whole): (&[f64], &[(String, tch::Tensor)]),
    (losses, weights): (Vec<f64>, Vec<(String, tch::Tensor)>),
) {
    assert_eq!(losses.len(), reference.len(), "{name}: another number of steps");
    for (step, (a, b)) in reference.iter().zip(&losses).enumerate() {
        assert!((a - b).abs() < 1e-5, "{name}: step {} loss {b} vs the reference's {a}", step + 1);
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
        assert!(relative < 1e-4, "{name}: {key} differs from the reference by {relative:.2e}");
    }
}

/// Context parallelism: each sequence split across 2 ranks (attention's heads exchanged by
/// all-to-all) trains as the whole sequences do — on 2 processes as on one, with 2
/// data-parallel replicas (DDP and zero3) as those replicas without it, and beside tensor
/// and sequence parallelism on 4 as on one; across 4 ranks with 2 heads (keys and values
/// all-gathered) as on one.
#[test]
fn the_transformer_trains_alike_split_along_the_sequence_by_context_parallelism() {
    let (reference, whole) = char_lm_run("cp-reference", 1, &[]);
    let cp2 = char_lm_run("cp2", 2, &["--context-parallel", "2"]);
    assert_trains_alike("cp2 on 2 processes", (&reference, &whole), cp2);
    let tp2 = ["--context-parallel", "2", "--tensor-parallel", "2", "--sequence-parallel"];
    let cp2_tp2 = char_lm_run("cp2-tp2-sp", 4, &tp2);
    assert_trains_alike("cp2 × tp2 (sequence-parallel) on 4", (&reference, &whole), cp2_tp2);
    let (dp2, dp2_whole) = char_lm_run("dp2", 2, &[]);
    let cp2_dp2 = char_lm_run("cp2-dp2", 4, &["--context-parallel", "2"]);
    assert_trains_alike("cp2 × dp2 on 4 against dp2 on 2", (&dp2, &dp2_whole), cp2_dp2);
    // 2 heads do not divide among 4 context ranks: keys and values are all-gathered instead.
    let two_heads = char_lm_run("cp-reference-2-heads", 1, &["--heads", "2"]);
    let cp4 = char_lm_run("cp4-2-heads", 4, &["--heads", "2", "--context-parallel", "4"]);
    assert_trains_alike("cp4, 2 heads, on 4 processes", (&two_heads.0, &two_heads.1), cp4);
    // ZeRO-3 shards over the context ranks too (torchtitan's dp_shard × cp).
    let zero3 = char_lm_run_with(
        "cp2-dp2-zero3",
        4,
        &["--context-parallel", "2"],
        &[("ACCEL_STRATEGY", "zero3")],
    );
    assert_trains_alike("cp2 × dp2 under zero3 against dp2", (&dp2, &dp2_whole), zero3);
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

/// An MLflow tracking server from the project's .venv (`mlflow server`, SQLite store) on a
/// free port, read back over its REST API; stopped, with its workers, when dropped.
struct MlflowServer {
    child: std::process::Child,
    uri: String,
    agent: ureq::Agent,
}

impl MlflowServer {
    fn start(dir: &Path) -> Self {
        use std::os::unix::process::CommandExt;
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf();
        let mlflow = root.join(".venv/bin/mlflow");
        assert!(mlflow.exists(), "{} is missing: run `cargo xtask setup`", mlflow.display());
        std::fs::create_dir_all(dir).unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let log = std::fs::File::create(dir.join("server.log")).unwrap();
        let child = std::process::Command::new(mlflow)
            .args(["server", "--host", "127.0.0.1", "--port", &port.to_string(), "--workers", "1"])
            .arg("--backend-store-uri")
            .arg(format!("sqlite:///{}", dir.join("mlflow.db").display()))
            // Artifacts behind the server's proxy (`mlflow-artifacts:`), as a shared server
            // keeps them.
            .arg("--artifacts-destination")
            .arg(dir.join("artifacts"))
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .process_group(0)
            .spawn()
            .unwrap();
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .timeout_global(Some(std::time::Duration::from_secs(30)))
            .http_status_as_error(false)
            .build()
            .into();
        let mut server = Self { child, uri: format!("http://127.0.0.1:{port}"), agent };
        let started = std::time::Instant::now();
        loop {
            let health = server.agent.get(format!("{}/health", server.uri)).call();
            if health.is_ok_and(|r| r.status() == 200) {
                return server;
            }
            let log = || std::fs::read_to_string(dir.join("server.log")).unwrap_or_default();
            if let Some(status) = server.child.try_wait().unwrap() {
                panic!("mlflow server exited ({status}):\n{}", log());
            }
            assert!(started.elapsed().as_secs() < 180, "mlflow server not up in 180 s:\n{}", log());
            std::thread::sleep(std::time::Duration::from_millis(500));
        }
    }

    /// `GET` (`body` None, `query` as given) or `POST` of `/api/2.0/mlflow/{endpoint}`.
    fn call(
        &self,
        endpoint: &str,
        query: &[(&str, &str)],
        body: Option<serde_json::Value>,
    ) -> serde_json::Value {
        let url = format!("{}/api/2.0/mlflow/{endpoint}", self.uri);
        let mut response = match body {
            Some(body) => self
                .agent
                .post(&url)
                .header("Content-Type", "application/json")
                .send(body.to_string())
                .unwrap(),
            None => {
                let mut request = self.agent.get(&url);
                for (k, v) in query {
                    request = request.query(*k, *v);
                }
                request.call().unwrap()
            }
        };
        let text = response.body_mut().read_to_string().unwrap();
        assert_eq!(response.status(), 200, "{endpoint}: {text}");
        serde_json::from_str(&text).unwrap()
    }

    /// The runs of the experiment `name`.
    fn runs(&self, name: &str) -> Vec<serde_json::Value> {
        let found = self.call("experiments/get-by-name", &[("experiment_name", name)], None);
        let id = found["experiment"]["experiment_id"].clone();
        let runs =
            self.call("runs/search", &[], Some(serde_json::json!({ "experiment_ids": [id] })));
        runs["runs"].as_array().cloned().unwrap_or_default()
    }

    /// The bytes of artifact `path` of run `run_id`, through the server.
    fn artifact(&self, run_id: &str, path: &str) -> Vec<u8> {
        let url = format!("{}/get-artifact", self.uri);
        let mut response =
            self.agent.get(&url).query("path", path).query("run_uuid", run_id).call().unwrap();
        assert_eq!(response.status(), 200, "{path}");
        response.body_mut().read_to_vec().unwrap()
    }

    /// A metric's points, as (step, value).
    fn history(&self, run_id: &str, key: &str) -> Vec<(u64, f64)> {
        let history =
            self.call("metrics/get-history", &[("run_id", run_id), ("metric_key", key)], None);
        let mut points: Vec<(u64, f64)> = history["metrics"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| (m["step"].as_u64().unwrap(), m["value"].as_f64().unwrap()))
            .collect();
        points.sort_by_key(|p| p.0);
        points
    }
}

impl Drop for MlflowServer {
    fn drop(&mut self) {
        // SAFETY: signals the process group the server leads (its own, from process_group(0)).
        unsafe { libc::kill(-(self.child.id() as i32), libc::SIGTERM) };
        let _ = self.child.wait();
    }
}

fn tag<'a>(run: &'a serde_json::Value, key: &str) -> Option<&'a str> {
    run["data"]["tags"].as_array()?.iter().find(|t| t["key"] == key)?["value"].as_str()
}

fn param<'a>(run: &'a serde_json::Value, key: &str) -> Option<&'a str> {
    run["data"]["params"].as_array()?.iter().find(|t| t["key"] == key)?["value"].as_str()
}

/// Trains 6 steps with plain SGD under the attribute, tracking to the tracker `start` makes
/// (from hand-made settings: the process's environment is shared by the tests), and fails at
/// the end if asked: the run's end decides the tracker's run status. `started` looks at the
/// accelerator once its trackers run.
#[accel_core::accelerate(cpu = true, seed = 3)]
fn tracked(
    project: &str,
    fail: bool,
    start: &dyn Fn(bool) -> accel_core::Result<Box<dyn accel_core::tracking::Tracker>>,
    started: &dyn Fn(&accel_core::Accelerator) -> anyhow::Result<()>,
) -> anyhow::Result<Vec<f64>> {
    use tch::nn::{Module, OptimizerConfig};
    accelerator.add_tracker(start(accelerator.is_main_process())?);
    accelerator.init_trackers(project, &serde_json::json!({ "lr": 0.1, "fail": fail }))?;
    started(&accelerator)?;
    let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    let net = tch::nn::linear(vs.root() / "lin", 3, 1, Default::default());
    let mut opt = tch::nn::Sgd::default().build(&vs, 0.1)?;
    let mut losses = Vec::new();
    let data: Vec<tch::Tensor> = (0..6)
        .map(|i| {
            tch::Tensor::arange(12, (tch::Kind::Float, tch::Device::Cpu)).view([4, 3])
                / (i + 4) as f64
        })
        .collect();
    for x in data {
        let loss = (net.forward(&x) - 1.0).square().mean(tch::Kind::Float);
        opt.zero_grad();
        loss.backward();
        opt.step();
        losses.push(loss.double_value(&[]));
        accelerator.log(losses.len() as u64, &[("loss", losses[losses.len() - 1])])?;
    }
    if fail {
        anyhow::bail!("injected failure after training");
    }
    Ok(losses)
}

/// [`tracked`] with an MLflow run on `server` in `experiment`.
fn tracked_mlflow(server: &str, experiment: &str, fail: bool) -> anyhow::Result<Vec<f64>> {
    let settings = accel_core::tracking::MlFlowSettings {
        tracking_uri: server.to_owned(),
        experiment_name: experiment.to_owned(),
        run_id: None,
        run_name: Some(if fail { "failing".into() } else { "succeeding".into() }),
        tags: vec![("fail".into(), fail.to_string())],
        authorization: None,
        timeout: std::time::Duration::from_secs(30),
        retries: 2,
    };
    let start = |_main: bool| -> accel_core::Result<Box<dyn accel_core::tracking::Tracker>> {
        Ok(Box::new(accel_core::tracking::MlFlow::start(&settings)?))
    };
    tracked(experiment, fail, &start, &|_| Ok(()))
}

/// The MLflow tracker against a real MLflow server (the `mlflow` package in .venv): the main
/// job on 2 processes with `--log-with mlflow,jsonl` writes one run whose params, tags and
/// per-epoch metrics read back equal to what it wrote to its JSONL file, FINISHED; the
/// launcher's `ACCEL_LOG_WITH` alone chooses it too; under the attribute the run's end
/// closes the trackers: FINISHED when the function succeeds, FAILED when it fails.
#[test]
fn the_mlflow_tracker_writes_runs_a_real_mlflow_server_reads_back() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("mlflow");
    let _ = std::fs::remove_dir_all(&dir);
    let server = MlflowServer::start(&dir);
    let uri = PathBuf::from(&server.uri);

    // The main job, trackers chosen by its flag, and the launcher's variable alone.
    let tags = PathBuf::from(r#"{"team": "accel"}"#);
    let epochs = 4;
    for (processes, experiment, flag) in [(2, "digits", true), (1, "digits-env", false)] {
        let out = dir.join(experiment);
        let mut program = vec![example("train")];
        let args = ["--cpu", "--epochs", &epochs.to_string(), "--target", "0.5"];
        program.extend(args.iter().map(|s| s.to_string()));
        program.extend(["--out".into(), out.display().to_string()]);
        let experiment = PathBuf::from(experiment);
        let mut env = vec![
            ("MLFLOW_TRACKING_URI", uri.as_path()),
            ("MLFLOW_EXPERIMENT_NAME", experiment.as_path()),
            ("MLFLOW_TAGS", tags.as_path()),
        ];
        let both = PathBuf::from("mlflow,jsonl");
        if flag {
            program.extend(["--log-with".into(), "mlflow,jsonl".into()]);
        } else {
            env.push(("ACCEL_LOG_WITH", both.as_path()));
        }
        launch(processes, program, &env);

        let runs = server.runs(experiment.to_str().unwrap());
        assert_eq!(runs.len(), 1, "one run per training, written by the main process only");
        let run = &runs[0];
        assert_eq!(run["info"]["status"], "FINISHED", "{run}");
        assert!(run["info"]["end_time"].as_u64().is_some(), "{run}");
        assert_eq!(param(run, "epochs"), Some("4"));
        assert_eq!(param(run, "processes"), Some(processes.to_string().as_str()));
        assert_eq!(param(run, "lr"), Some("0.003"));
        assert_eq!(tag(run, "team"), Some("accel"));
        assert_eq!(tag(run, "mlflow.source.type"), Some("LOCAL"));
        assert!(tag(run, "mlflow.source.name").is_some_and(|s| s.ends_with("train")), "{run}");
        let run_id = run["info"]["run_id"].as_str().unwrap();
        let jsonl = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
        let records: Vec<serde_json::Value> = jsonl
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .filter(|r| r.get("loss").is_some())
            .collect();
        assert_eq!(records.len(), epochs);
        // The misclassified digits: an image and a table, as MLflow's log_image/log_table.
        let png = server.artifact(run_id, &format!("media/misclassified_{epochs}.png"));
        assert_eq!(
            png,
            std::fs::read(out.join(format!("media/misclassified_{epochs}.png"))).unwrap()
        );
        let table: serde_json::Value = serde_json::from_slice(
            &server.artifact(run_id, &format!("media/misclassified_digits_{epochs}.json")),
        )
        .unwrap();
        assert_eq!(table["columns"], serde_json::json!(["label", "guess"]), "{table}");
        assert!(!table["data"].as_array().unwrap().is_empty());
        let logged = tag(run, "mlflow.loggedArtifacts").unwrap();
        assert!(logged.contains("misclassified_digits") && logged.contains("table"), "{logged}");
        for key in ["loss", "test_accuracy", "lr"] {
            let points = server.history(run_id, key);
            let written: Vec<(u64, f64)> = records
                .iter()
                .map(|r| (r["step"].as_u64().unwrap(), r[key].as_f64().unwrap()))
                .collect();
            assert_eq!(points, written, "{key}: MLflow's points against metrics.jsonl");
        }
    }

    // Under the attribute: success finishes the run, failure marks it failed.
    let losses = tracked_mlflow(&server.uri, "attribute", false).unwrap();
    let err = tracked_mlflow(&server.uri, "attribute", true).unwrap_err().to_string();
    assert!(err.contains("injected failure"), "{err}");
    let runs = server.runs("attribute");
    assert_eq!(runs.len(), 2);
    for run in &runs {
        let failing = tag(run, "fail") == Some("true");
        let expected = if failing { "FAILED" } else { "FINISHED" };
        assert_eq!(run["info"]["status"], expected, "{run}");
        assert_eq!(param(run, "fail"), Some(if failing { "true" } else { "false" }));
        let points = server.history(run["info"]["run_id"].as_str().unwrap(), "loss");
        assert_eq!(points.len(), 6, "{points:?}");
        if !failing {
            let expected: Vec<(u64, f64)> = (1..).zip(losses.iter().copied()).collect();
            assert_eq!(points, expected);
        }
    }
}

/// [`tracked`] with a W&B run written offline under `root`; checks that `get_tracker` gives
/// the run where it was asked to be.
fn tracked_wandb(root: &Path, run_id: &str, fail: bool) -> anyhow::Result<Vec<f64>> {
    let settings = accel_core::tracking::WandbSettings {
        mode: accel_core::tracking::WandbMode::Offline,
        project: "attribute".into(),
        entity: String::new(),
        name: if fail { "failing".into() } else { "succeeding".into() },
        run_id: run_id.into(),
        tags: vec![],
        root: root.to_owned(),
    };
    let start = |main: bool| -> accel_core::Result<Box<dyn accel_core::tracking::Tracker>> {
        Ok(Box::new(accel_core::tracking::Wandb::start(&settings, main)?))
    };
    let started = |accelerator: &accel_core::Accelerator| -> anyhow::Result<()> {
        let run_dir = accelerator
            .get_tracker::<accel_core::tracking::Wandb>("wandb")?
            .map(|w| w.run_dir().to_owned())
            .unwrap();
        assert!(run_dir.starts_with(root.join("wandb")), "{}", run_dir.display());
        Ok(())
    };
    tracked("attribute", fail, &start, &started)
}

/// W&B's offline run files (`wandb/offline-run-*/run-*.wandb`), read back by the wandb
/// package's own reader: the main job on 2 processes with `--log-with wandb,jsonl` writes
/// one run (the main process's) whose configuration, history rows and summary equal what it
/// wrote to its JSONL file, with W&B's variables applied (project, name, id, tags), exit code
/// 0; the wandb client itself, offline, logging the same values writes the same rows,
/// configuration and summary; under the attribute, success gives exit code 0 and failure 1.
#[test]
fn the_wandb_tracker_writes_offline_runs_that_wandbs_own_reader_reads_as_the_clients() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("wandb");
    let _ = std::fs::remove_dir_all(&dir);
    let python = root().join(".venv/bin/python");
    let read = |run_dir: &Path| -> serde_json::Value {
        let output = std::process::Command::new(&python)
            .arg(root().join("python/reference/read_wandb.py"))
            .arg(run_dir)
            .output()
            .unwrap();
        assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
        serde_json::from_slice(&output.stdout).unwrap()
    };
    let only_run = |root: &Path| -> PathBuf {
        let runs: Vec<PathBuf> = std::fs::read_dir(root.join("wandb"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with("offline-run-"))
            .collect();
        assert_eq!(runs.len(), 1, "one run, written by the main process only: {runs:?}");
        runs[0].clone()
    };

    // The main job on 2 processes.
    let (ours_root, out) = (dir.join("accel"), dir.join("out"));
    let epochs = 3;
    let mut program = vec![example("train")];
    let args = ["--cpu", "--epochs", &epochs.to_string(), "--target", "0.5"];
    program.extend(args.iter().map(|s| s.to_string()));
    program.extend(["--out".into(), out.display().to_string()]);
    program.extend(["--log-with".into(), "wandb,jsonl".into()]);
    let vars = [
        ("WANDB_DIR", ours_root.clone()),
        ("WANDB_PROJECT", PathBuf::from("digits")),
        ("WANDB_NAME", PathBuf::from("two processes")),
        ("WANDB_RUN_ID", PathBuf::from("accel2p")),
        ("WANDB_TAGS", PathBuf::from("cpu,tiny mlp")),
    ];
    let env: Vec<(&str, &Path)> = vars.iter().map(|(k, v)| (*k, v.as_path())).collect();
    launch(2, program, &env);
    let run_dir = only_run(&ours_root);
    assert!(run_dir.to_string_lossy().ends_with("-accel2p"), "{}", run_dir.display());
    let latest = std::fs::read_link(ours_root.join("wandb/latest-run")).unwrap();
    assert_eq!(latest, PathBuf::from(run_dir.file_name().unwrap()));
    let ours = read(&run_dir);
    let kinds: Vec<&str> =
        ours["kinds"].as_array().unwrap().iter().map(|k| k.as_str().unwrap()).collect();
    assert_eq!(&kinds[..2], ["header", "run"], "{ours}");
    assert_eq!(&kinds[kinds.len() - 2..], ["exit", "final"], "{ours}");
    let nums: Vec<u64> =
        ours["nums"].as_array().unwrap().iter().map(|n| n.as_u64().unwrap()).collect();
    assert_eq!(nums, (1..=kinds.len() as u64).collect::<Vec<_>>());
    assert_eq!(ours["exit_code"], 0);
    let run = &ours["run"];
    assert_eq!(run["run_id"], "accel2p");
    assert_eq!(run["project"], "digits");
    assert_eq!(run["display_name"], "two processes");
    assert_eq!(run["tags"], serde_json::json!(["cpu", "tiny mlp"]));
    assert_eq!(run["config"]["lr"], 0.003, "{run}");
    assert_eq!(run["config"]["processes"], 2);
    assert_eq!(run["config"]["_wandb"], serde_json::json!({}));
    let jsonl = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let records: Vec<serde_json::Value> = jsonl
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|r| r.get("loss").is_some())
        .collect();
    let history = ours["history"].as_array().unwrap();
    assert_eq!(history.len(), epochs);
    for (row, record) in history.iter().zip(&records) {
        assert_eq!(row["_step"], record["step"], "{row}");
        assert_eq!(row["_history_step"], record["step"]);
        for key in ["loss", "test_accuracy", "lr"] {
            assert_eq!(row[key], record[key], "{key}: W&B's row against metrics.jsonl");
        }
        assert!(row["_runtime"].as_f64().is_some() && row["_timestamp"].as_f64().is_some());
    }
    let last = records.last().unwrap();
    for key in ["loss", "test_accuracy", "lr"] {
        assert_eq!(ours["summary"][key], last[key], "summary {key}");
    }
    assert_eq!(ours["summary"]["_step"], last["step"]);
    // The misclassified digits in the last row, as the client logs a wandb.Image and a
    // wandb.Table: files under files/media, named and checked by their SHA-256.
    let row = history.last().unwrap();
    let image = &row["misclassified"];
    assert_eq!(image["_type"], "image-file", "{row}");
    assert_eq!(image["format"], "png");
    let png = std::fs::read(run_dir.join("files").join(image["path"].as_str().unwrap())).unwrap();
    assert_eq!(image["size"].as_u64(), Some(png.len() as u64));
    assert_eq!(png, std::fs::read(out.join(format!("media/misclassified_{epochs}.png"))).unwrap());
    let sha = image["sha256"].as_str().unwrap();
    assert!(image["path"].as_str().unwrap().contains(&sha[..20]), "{image}");
    let table = &row["misclassified_digits"];
    assert_eq!(table["_type"], "table-file", "{row}");
    assert_eq!(table["ncols"], 2);
    let file = std::fs::read(run_dir.join("files").join(table["path"].as_str().unwrap())).unwrap();
    let file: serde_json::Value = serde_json::from_slice(&file).unwrap();
    assert_eq!(file["columns"], serde_json::json!(["label", "guess"]));
    assert_eq!(Some(file["data"].as_array().unwrap().len() as u64), table["nrows"].as_u64());
    assert!(kinds.contains(&"files"), "the media are listed for sync: {kinds:?}");

    // The wandb client itself, offline, logging the same configuration and rows.
    let client_root = dir.join("client");
    std::fs::create_dir_all(&client_root).unwrap();
    let config = dir.join("config.json");
    let mut written_config = run["config"].clone();
    written_config.as_object_mut().unwrap().remove("_wandb");
    std::fs::write(&config, written_config.to_string()).unwrap();
    let output = std::process::Command::new(&python)
        .arg(root().join("python/reference/wandb_offline.py"))
        .args(["digits".as_ref(), config.as_os_str(), out.join("metrics.jsonl").as_os_str()])
        .env("WANDB_MODE", "offline")
        .env("WANDB_DIR", &client_root)
        .env("WANDB_SILENT", "true")
        .current_dir(&client_root)
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let theirs = read(&only_run(&client_root));
    assert_eq!(theirs["exit_code"], 0);
    assert_eq!(
        theirs["run"]["config"], run["config"],
        "the configuration, as the client writes it"
    );
    let without_times = |rows: &serde_json::Value| -> Vec<serde_json::Value> {
        rows.as_array()
            .unwrap()
            .iter()
            .map(|r| {
                let mut r = r.clone();
                // Times, and the media the client was not given.
                r.as_object_mut().unwrap().retain(|k, v| {
                    !["_runtime", "_timestamp"].contains(&k.as_str()) && v.is_number()
                });
                // As numbers: the client keeps metrics.jsonl's `0` an integer, accel logs f64.
                for v in r.as_object_mut().unwrap().values_mut() {
                    *v = serde_json::json!(v.as_f64().unwrap());
                }
                r
            })
            .collect()
    };
    assert_eq!(without_times(&ours["history"]), without_times(&theirs["history"]));
    for key in ["loss", "test_accuracy", "lr", "_step"] {
        let (a, b) = (ours["summary"][key].as_f64(), theirs["summary"][key].as_f64());
        assert!(a.is_some() && a == b, "summary {key}: {a:?} against the client's {b:?}");
    }

    // Under the attribute: the run's end decides the exit code.
    let attribute_root = dir.join("attribute");
    let losses = tracked_wandb(&attribute_root.join("ok"), "ok", false).unwrap();
    let err = tracked_wandb(&attribute_root.join("failed"), "failed", true).unwrap_err();
    assert!(err.to_string().contains("injected failure"), "{err}");
    for (name, exit_code) in [("ok", 0), ("failed", 1)] {
        let run = read(&only_run(&attribute_root.join(name)));
        assert_eq!(run["exit_code"], exit_code, "{name}: {run}");
        assert_eq!(
            run["run"]["display_name"],
            if exit_code == 0 { "succeeding" } else { "failing" }
        );
        let logged: Vec<f64> = run["history"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["loss"].as_f64().unwrap())
            .collect();
        assert_eq!(logged.len(), 6, "{run}");
        if exit_code == 0 {
            assert_eq!(logged, losses);
        }
    }
}

/// The figure `key=` a benchmark printed.
fn figure(text: &str, key: &str) -> f64 {
    text.split_whitespace()
        .find_map(|w| w.strip_prefix(key))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {key} in {text}"))
}

/// Every configuration `cargo xtask bench` measures runs, tiny (speed printed, never
/// asserted); the limit (`--raw`), the explicit API and the attribute do the same ATen work:
/// their losses are equal, on 1 and 2 processes.
#[test]
fn every_benchmark_configuration_runs_and_the_raw_loop_does_the_same_work() {
    let run = |processes: usize, program: &str, args: &[&str], env: &[(&str, &str)]| -> String {
        let mut command = if processes == 1 {
            std::process::Command::new(example(program))
        } else {
            let accel =
                Path::new(&example(program)).parent().unwrap().parent().unwrap().join("accel");
            let mut c = std::process::Command::new(accel);
            c.args(["launch", "--num-processes", "2", "--main-process-port", "0", "--rank0-only"])
                .arg(example(program));
            c
        };
        let output = command.args(args).envs(env.iter().copied()).output().unwrap();
        let text = String::from_utf8_lossy(&output.stdout).into_owned();
        assert!(
            output.status.success(),
            "{program} {args:?} on {processes}: {text}{}",
            String::from_utf8_lossy(&output.stderr)
        );
        eprintln!("bench smoke: {program} {args:?} {env:?} on {processes}: {}", text.trim());
        text
    };
    for processes in [1, 2] {
        let tiny = ["--batches", "8"];
        let mut losses = Vec::new();
        for mode in [None, Some("--raw"), Some("--attribute")] {
            let args: Vec<&str> = tiny.iter().copied().chain(mode).collect();
            losses.push(figure(&run(processes, "mlp_bench", &args, &[]), "loss="));
        }
        assert!(losses.iter().all(|l| *l == losses[0]), "{processes}: {losses:?}");
        run(processes, "mlp_bench", &["--batches", "8", "--batch-norm"], &[]);
        run(
            processes,
            "mlp_bench",
            &["--batches", "8", "--batch-norm", "--no-broadcast-buffers"],
            &[],
        );
    }
    run(2, "mlp_bench", &["--batches", "8"], &[("ACCEL_CHECK_COLLECTIVES", "0")]);
    let tiny =
        ["--steps", "2", "--width", "32", "--blocks", "1", "--context", "16", "--batch", "4"];
    let mut losses = Vec::new();
    for mode in [None, Some("--raw"), Some("--attribute")] {
        let args: Vec<&str> = tiny.iter().copied().chain(mode).collect();
        losses.push(figure(&run(1, "lm_bench", &args, &[]), "loss="));
    }
    assert!(losses.iter().all(|l| *l == losses[0]), "transformer: {losses:?}");
    for precision in ["bf16", "fp8"] {
        let args: Vec<&str> = tiny.iter().copied().chain(["--precision", precision]).collect();
        run(1, "lm_bench", &args, &[]);
    }
}
