//! Real launchers, as users run them: Open MPI's `mpirun`, MPICH's `mpiexec`, Kubernetes'
//! variables, and a real Slurm (Debian's slurmctld + one slurmd per host) across two hosts
//! that are network namespaces of this machine (scripts/cluster.sh). Each run trains the
//! parity example and must end with the weights of `accel launch` on one host (1e-6): a
//! group formed wrongly — N separate 1-process runs, ranks swapped, a host that waits for
//! nobody — gives other weights, another exit code, or a hang that the timeout ends.
//!
//! The launchers are Debian packages (openmpi-bin, mpich, slurmctld, slurmd, slurm-client,
//! munge); `.ci/run` installs them. Where one is missing, or the kernel refuses namespaces,
//! the test says so and skips that part.

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use super::{example, make_weights_and_data, max_diff, read_weights, root, scratch};

fn have(tool: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// The parity program's arguments, writing `out`.
fn parity_args(dir: &Path, strategy: &str, out: &Path) -> Vec<String> {
    let (w, d) = (dir.join("W.safetensors"), dir.join("D.safetensors"));
    [
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
        "--batch-size",
        "4",
        "--accumulate",
        "2",
        "--epochs",
        "2",
        "--strategy",
        strategy,
        "--out",
        out.to_str().unwrap(),
        "--losses",
        out.with_extension("jsonl").to_str().unwrap(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// Runs `cmd` with a deadline; its output. A hang is a failure, never a stuck suite.
fn run_for(mut cmd: Command, secs: u64, what: &str) -> Output {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    let deadline = std::time::Instant::now() + Duration::from_secs(secs);
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "{what} still ran after {secs} s:\n{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    child.wait_with_output().unwrap()
}

/// What a run printed: its standard output, then its standard error.
fn printed(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

fn succeeded(out: &Output, what: &str) {
    assert!(out.status.success(), "{what} failed ({}):\n{}", out.status, printed(out));
}

fn equal_to(reference: &std::collections::BTreeMap<String, Vec<f32>>, out: &Path, what: &str) {
    let diff = max_diff(reference, &read_weights(out));
    assert!(diff <= 1e-6, "{what} differs from accel launch on one host by {diff}");
    eprintln!("{what}: equal to accel launch (max difference {diff})");
}

#[test]
fn mpi_launchers_and_kubernetes_variables_form_one_group_as_accel_launch_does() {
    let dir = scratch("mpi");
    make_weights_and_data(&dir, 11);
    let launched = dir.join("launched.safetensors");
    let mut program = vec![example("parity")];
    program.extend(parity_args(&dir, "ddp", &launched));
    super::launch(2, program);
    let reference_weights = read_weights(&launched);
    let port = || accel_core::comm::free_port("127.0.0.1").unwrap().to_string();

    if have("mpirun.openmpi") {
        let out = dir.join("openmpi.safetensors");
        let mut cmd = Command::new("mpirun.openmpi");
        cmd.args(["--allow-run-as-root", "--oversubscribe", "-n", "2", "-x"])
            .arg(format!("MASTER_PORT={}", port()))
            .args(["-x", "ACCEL_TIMEOUT_SECS=60", &example("parity")])
            .args(parity_args(&dir, "ddp", &out));
        let output = run_for(cmd, 120, "mpirun (Open MPI) -n 2");
        succeeded(&output, "mpirun (Open MPI) -n 2");
        let said = printed(&output);
        assert!(said.contains("2 processes"), "{said}");
        equal_to(&reference_weights, &out, "mpirun (Open MPI) -n 2");
    } else {
        eprintln!(
            "skipped: Open MPI's mpirun.openmpi is not installed (apt-get install openmpi-bin)"
        );
    }
    if have("mpiexec.mpich") {
        let out = dir.join("mpich.safetensors");
        let mut cmd = Command::new("mpiexec.mpich");
        cmd.args(["-n", "2", "-genv", "MASTER_PORT", &port(), "-genv", "ACCEL_TIMEOUT_SECS", "60"])
            .arg(example("parity"))
            .args(parity_args(&dir, "ddp", &out));
        let output = run_for(cmd, 120, "mpiexec (MPICH) -n 2");
        succeeded(&output, "mpiexec (MPICH) -n 2");
        equal_to(&reference_weights, &out, "mpiexec (MPICH) -n 2");
    } else {
        eprintln!("skipped: MPICH's mpiexec.mpich is not installed (apt-get install mpich)");
    }

    // Kubernetes' PyTorchJob: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, nothing local.
    let out = dir.join("pods.safetensors");
    let port = port();
    let pods: Vec<_> = (0..2)
        .map(|rank| {
            let mut cmd = Command::new(example("parity"));
            cmd.args(parity_args(&dir, "ddp", &out))
                .env_remove("LOCAL_RANK")
                .env_remove("LOCAL_WORLD_SIZE")
                .envs([
                    ("RANK", rank.to_string()),
                    ("WORLD_SIZE", "2".into()),
                    ("MASTER_ADDR", "127.0.0.1".into()),
                    ("MASTER_PORT", port.clone()),
                    ("ACCEL_TIMEOUT_SECS", "60".into()),
                ]);
            std::thread::spawn(move || run_for(cmd, 120, &format!("pod {rank}")))
        })
        .collect();
    for (rank, pod) in pods.into_iter().enumerate() {
        let output = pod.join().unwrap();
        succeeded(&output, &format!("pod {rank}"));
        if rank == 0 {
            let said = printed(&output);
            assert!(said.contains("2 processes"), "{said}");
        }
    }
    equal_to(&reference_weights, &out, "2 pods with Kubernetes' variables");

    // A launcher's variables, incomplete: an error naming what is missing, never a 1-process
    // run.
    for (vars, missing) in [
        (&[("PMI_RANK", "0")][..], "PMI_SIZE is not set though PMI_RANK is"),
        (
            &[("OMPI_COMM_WORLD_RANK", "1"), ("OMPI_COMM_WORLD_SIZE", "2")][..],
            "OMPI_COMM_WORLD_LOCAL_RANK",
        ),
        (&[("PMIX_RANK", "1")][..], "PMIX_RANK is set"),
        (&[("RANK", "1"), ("WORLD_SIZE", "2")][..], "MASTER_ADDR is not set"),
    ] {
        let mut cmd = Command::new(example("parity"));
        cmd.args(parity_args(&dir, "ddp", &dir.join("never.safetensors")))
            .envs(vars.iter().copied());
        let output = run_for(cmd, 30, &format!("{vars:?}"));
        let said = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success() && said.contains(missing), "{vars:?}: {said}");
    }
    assert!(!dir.join("never.safetensors").exists());
}

/// scripts/cluster.sh's hosts, taken down when dropped.
struct Cluster {
    conf: String,
}

impl Cluster {
    fn up(dir: &Path) -> Option<Self> {
        let is_root = Command::new("id").arg("-u").output().is_ok_and(|o| o.stdout == b"0\n");
        if !is_root {
            eprintln!("skipped: the cluster test needs root (network namespaces, slurmd)");
            return None;
        }
        for tool in ["slurmctld", "slurmd", "srun", "munged"] {
            if !have(tool) {
                eprintln!(
                    "skipped: {tool} is not installed (apt-get install slurmctld slurmd \
                     slurm-client munge)"
                );
                return None;
            }
        }
        let out = Command::new(root().join("scripts/cluster.sh"))
            .arg("up")
            .arg(dir)
            .arg("2")
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&out.stderr);
        if !out.status.success() {
            if said.contains("the kernel refused") {
                eprintln!("skipped: {said}");
                return None;
            }
            panic!("scripts/cluster.sh up failed:\n{said}");
        }
        let conf = dir.join("slurm.conf").display().to_string();
        Some(Self { conf })
    }

    fn srun(&self, args: &[&str], program: Vec<String>, what: &str) -> Output {
        let mut cmd = Command::new("srun");
        cmd.env("SLURM_CONF", &self.conf)
            .env("ACCEL_TIMEOUT_SECS", "60")
            .args(["--time=5", "--kill-on-bad-exit=1"])
            .args(args)
            .args(program);
        run_for(cmd, 180, what)
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = Command::new(root().join("scripts/cluster.sh")).arg("down").status();
    }
}

#[test]
fn srun_across_two_hosts_trains_as_four_processes_on_one() {
    // Not under /tmp: each host has its own.
    let dir = scratch("slurm");
    make_weights_and_data(&dir, 12);
    let Some(cluster) = Cluster::up(&dir.join("cluster")) else { return };
    let one_host = dir.join("one-host.safetensors");
    {
        let mut program = vec![example("parity")];
        program.extend(parity_args(&dir, "ddp", &one_host));
        super::launch(4, program);
    }
    let reference = read_weights(&one_host);

    // docs/two-machines.md, run as written: one `accel launch` per host, by hand.
    two_machines_as_the_walkthrough_says(&cluster, &dir.join("walkthrough"));

    // srun PROGRAM: 2 hosts × 2 tasks, nothing set by hand.
    let out = dir.join("srun.safetensors");
    let mut program = vec![example("parity")];
    program.extend(parity_args(&dir, "ddp", &out));
    let what = "srun -N 2 -n 4 --ntasks-per-node 2";
    let output = cluster.srun(&["-N", "2", "-n", "4", "--ntasks-per-node", "2"], program, what);
    succeeded(&output, what);
    let said = printed(&output);
    assert!(said.contains("4 processes"), "{said}");
    // Within each host the two processes read each other's memory; TCP between the hosts.
    assert!(said.contains("direct copies within each machine"), "{said}");
    equal_to(&reference, &out, what);

    // srun accel launch: one launcher per host, each starting its host's 2 processes.
    let accel = super::build_dir().join("accel");
    if accel.exists() {
        let out = dir.join("srun-launch.safetensors");
        let mut program =
            vec![accel.display().to_string(), "launch".into(), "--num-processes".into()];
        program.extend(["2".into(), example("parity")]);
        program.extend(parity_args(&dir, "ddp", &out));
        let what = "srun -N 2 --ntasks-per-node 1 accel launch --num-processes 2";
        let output = cluster.srun(&["-N", "2", "--ntasks-per-node", "1"], program, what);
        succeeded(&output, what);
        equal_to(&reference, &out, what);
    } else {
        eprintln!("skipped: {} is not built", accel.display());
    }

    // HYBRID_SHARD across the two hosts: shards within a host, replicas across: equal to
    // its run on one host as two launchers.
    let hybrid_one_host = dir.join("hybrid-one-host.safetensors");
    let mut program = vec![example("parity")];
    program.extend(parity_args(&dir, "hybrid_shard", &hybrid_one_host));
    super::launch_machines(2, 2, program);
    let reference = read_weights(&hybrid_one_host);
    let out = dir.join("srun-hybrid.safetensors");
    let mut program = vec![example("parity")];
    program.extend(parity_args(&dir, "hybrid_shard", &out));
    let what = "srun hybrid_shard on 2 hosts × 2";
    let output = cluster.srun(&["-N", "2", "-n", "4", "--ntasks-per-node", "2"], program, what);
    succeeded(&output, what);
    equal_to(&reference, &out, what);

    // A host lost mid-run: every process of h2 killed after a few steps of char_lm under
    // zero2 (srun, one `accel launch --max-restarts 1` per host). The group stops naming
    // the host, both launchers restart, and the run resumes from its last complete
    // checkpoint to the weights of the run that was never interrupted.
    if accel.exists() {
        let straight = char_lm_on_two_hosts(&cluster, &dir.join("straight"), &accel, false);
        let restarted = char_lm_on_two_hosts(&cluster, &dir.join("h2-killed"), &accel, true);
        let diff = max_diff(&straight, &restarted);
        assert!(diff <= 1e-6, "the resumed run differs from the uninterrupted one by {diff}");
        eprintln!(
            "h2 killed mid-run: resumed to the uninterrupted weights (max difference {diff})"
        );
    }

    // Checkpoints on a disk local to each host (each host has its own /tmp): refused
    // before the first step, naming the host that does not see rank 0's files.
    let mut program = vec![example("train"), "--epochs".into(), "2".into(), "--out".into()];
    program.push("/tmp/accel-local-disk/out".into());
    let what = "train with its checkpoints in each host's own /tmp";
    let output = cluster.srun(&["-N", "2", "-n", "4", "--ntasks-per-node", "2"], program, what);
    let said = printed(&output);
    assert!(!output.status.success(), "{what} succeeded");
    assert!(
        said.contains("is not shared by the machines of this run: rank 2 on h2, rank 3 on h2"),
        "{said}"
    );
    assert!(!said.contains("epoch"), "{what}: training began before the refusal:\n{said}");

    // A batch script is one process, not task 0 of 4: refused, not left waiting.
    let script = dir.join("batch.sh");
    let mut program = vec![example("parity")];
    program.extend(parity_args(&dir, "ddp", &dir.join("never.safetensors")));
    std::fs::write(&script, format!("#!/bin/sh\nexec {}\n", program.join(" "))).unwrap();
    let log = dir.join("batch.log");
    let mut cmd = Command::new("sbatch");
    cmd.env("SLURM_CONF", &cluster.conf)
        .args(["--wait", "-N", "2", "-n", "4", "--ntasks-per-node", "2", "-o"])
        .arg(&log)
        .arg(&script);
    let output = run_for(cmd, 120, "sbatch without srun");
    assert!(!output.status.success(), "the batch script ran as task 0 of 4");
    let said = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(said.contains("the batch script of a job of 4 tasks"), "{said}");

    // A partition: h2's link goes down mid-run. h1's ranks stop within the timeout, naming
    // the ranks on h2 they wait for; nothing hangs.
    let program: Vec<String> = [example("train"), "--epochs".into(), "400".into(), "--out".into()]
        .into_iter()
        .chain([dir.join("partitioned").display().to_string()])
        .collect();
    // Cut once training has begun (rank 0 has written its first metrics).
    let metrics = dir.join("partitioned").join("metrics.jsonl");
    let cut = std::thread::spawn(move || {
        let deadline = std::time::Instant::now() + Duration::from_secs(90);
        while !metrics.exists() && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        std::thread::sleep(Duration::from_secs(1));
        let down = Command::new("ip").args(["link", "set", "veth-h2", "down"]).status();
        down.is_ok_and(|s| s.success())
    });
    let started = std::time::Instant::now();
    let mut cmd = Command::new("srun");
    cmd.env("SLURM_CONF", &cluster.conf)
        .env("ACCEL_TIMEOUT_SECS", "10")
        .env("RUST_BACKTRACE", "0")
        .args(["--time=5", "--kill-on-bad-exit=1", "-N", "2", "-n", "4", "--ntasks-per-node", "2"])
        .args(&program);
    let output = run_for(cmd, 150, "train across a partition");
    let took = started.elapsed();
    assert!(cut.join().unwrap(), "could not take h2's link down");
    let _ = Command::new("ip").args(["link", "set", "veth-h2", "up"]).status();
    let said = printed(&output);
    assert!(!output.status.success(), "a run across a partition succeeded:\n{said}");
    assert!(
        said.contains("timed out after 10 s waiting for rank") && said.contains("on h2"),
        "the partition was not reported naming h2:\n{said}"
    );
    eprintln!("partition: h1's ranks stopped naming h2; srun ended after {took:?}");
    drop(cluster);
}

/// char_lm on h1 and h2 (2 processes each, zero2, a checkpoint every 2 steps); with `kill`,
/// every process of h2 is killed once the run is past step 4. Its final weights.
fn char_lm_on_two_hosts(
    cluster: &Cluster,
    dir: &Path,
    accel: &Path,
    kill: bool,
) -> std::collections::BTreeMap<String, Vec<f32>> {
    std::fs::create_dir_all(dir).unwrap();
    let text = root().join("data/kjv-genesis-exodus.txt");
    let (weights, losses) = (dir.join("weights.safetensors"), dir.join("losses.jsonl"));
    let mut program: Vec<String> =
        [accel.to_str().unwrap(), "launch", "--num-processes", "2", "--max-restarts", "1"]
            .iter()
            .map(|s| s.to_string())
            .collect();
    program.extend(["--strategy".into(), "zero2".into(), example("char_lm")]);
    let small = "--steps 16 --width 32 --blocks 2 --heads 2 --context 16 --batch-size 8 \
                 --target 10 --checkpoint-every 2";
    program.extend(small.split_whitespace().map(String::from));
    for (flag, path) in [
        ("--text", text),
        ("--checkpoint-dir", dir.join("checkpoints")),
        ("--weights", weights.clone()),
        ("--losses", losses.clone()),
    ] {
        program.extend([flag.to_string(), path.display().to_string()]);
    }
    let killer = kill.then(|| {
        let losses = losses.clone();
        let pattern = format!("^{}", example("char_lm"));
        std::thread::spawn(move || {
            let deadline = std::time::Instant::now() + Duration::from_secs(120);
            while std::time::Instant::now() < deadline {
                let steps = std::fs::read_to_string(&losses).map_or(0, |s| s.lines().count());
                if steps >= 5 {
                    let out = Command::new(root().join("scripts/cluster.sh"))
                        .args(["kill", "2", &pattern])
                        .output()
                        .unwrap();
                    return String::from_utf8_lossy(&out.stdout).into_owned();
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            "never killed: the run did not reach step 5".into()
        })
    });
    let what = format!("char_lm on 2 hosts{}", if kill { ", h2 killed" } else { "" });
    let output = cluster.srun(&["-N", "2", "--ntasks-per-node", "1"], program, &what);
    succeeded(&output, &what);
    if let Some(killer) = killer {
        let killed = killer.join().unwrap();
        // (Its launcher may stop the second before the script reaches it.)
        let n: usize = killed.split(' ').nth(1).and_then(|n| n.parse().ok()).unwrap_or(0);
        assert!(n >= 1 && killed.contains("processes on h2"), "{killed}");
        let said = printed(&output);
        assert!(said.contains("on h2") && said.contains("resumed from"), "{said}");
    }
    read_weights(&weights)
}

/// The shell blocks of docs/two-machines.md, each with where it runs: the first line of each
/// (`# once`, `# on machine 0`, `# on machine 1`).
fn walkthrough_blocks() -> Vec<(String, String)> {
    let page = std::fs::read_to_string(root().join("docs/two-machines.md")).unwrap();
    let mut blocks = Vec::new();
    let mut lines = page.lines();
    while let Some(line) = lines.next() {
        if line.trim() != "```sh" {
            continue;
        }
        let body: Vec<&str> = lines.by_ref().take_while(|l| l.trim() != "```").collect();
        let (first, rest) = body.split_first().expect("an empty block");
        blocks.push((first.to_string(), rest.join("\n")));
    }
    blocks
}

/// docs/two-machines.md followed literally on h1 and h2, with a home folder both share (a
/// scratch folder holding `accel`, a link to this checkout): the run trains as `accel
/// launch --num-processes 2` on one machine does, epoch by epoch.
fn two_machines_as_the_walkthrough_says(_hosts_up: &Cluster, dir: &Path) {
    let home = dir.join("home");
    std::fs::create_dir_all(&home).unwrap();
    std::os::unix::fs::symlink(root(), home.join("accel")).unwrap();
    // The user's own cargo and rustup stay where they are, whatever HOME says.
    let real_home = std::env::var("HOME").unwrap_or_else(|_| "/root".into());
    let cargo_home = std::env::var("CARGO_HOME").unwrap_or(format!("{real_home}/.cargo"));
    let rustup_home = std::env::var("RUSTUP_HOME").unwrap_or(format!("{real_home}/.rustup"));
    let shell = |block: &str, host: Option<&str>| {
        let mut cmd = match host {
            Some(h) => {
                let mut c = Command::new(root().join("scripts/cluster.sh"));
                c.args(["run", h, "bash", "-euo", "pipefail", "-c", block]);
                c
            }
            None => {
                let mut c = Command::new("bash");
                c.args(["-euo", "pipefail", "-c", block]);
                c
            }
        };
        cmd.env("HOME", &home)
            .env("CARGO_HOME", &cargo_home)
            .env("RUSTUP_HOME", &rustup_home)
            .env_remove("ACCEL_TOKEN")
            .env_remove("ACCEL_TOKEN_FILE")
            .stdin(Stdio::null());
        cmd
    };
    let blocks = walkthrough_blocks();
    assert_eq!(blocks.len(), 3, "docs/two-machines.md: {blocks:?}");
    let machine = |n: &str| {
        let found =
            blocks.iter().find(|(place, _)| place.starts_with(&format!("# on machine {n}")));
        found.unwrap_or_else(|| panic!("no block for machine {n}")).1.clone()
    };
    let (once, zero, one) = (&blocks[0], machine("0"), machine("1"));
    assert!(once.0.starts_with("# once"), "{}", once.0);
    succeeded(&run_for(shell(&once.1, None), 600, "the build block"), "the build block");
    let token = std::fs::read_to_string(home.join(".accel-token")).unwrap();
    assert!(token.trim().len() >= 16, "the token: {token:?}");

    let zero = std::thread::spawn({
        let cmd = shell(&zero, Some("1"));
        move || run_for(cmd, 240, "machine 0 (h1)")
    });
    std::thread::sleep(Duration::from_millis(500));
    let one = run_for(shell(&one, Some("2")), 240, "machine 1 (h2)");
    let zero = zero.join().unwrap();
    succeeded(&zero, "machine 0 (h1)");
    succeeded(&one, "machine 1 (h2)");
    let said = printed(&zero);
    assert!(said.contains("epoch  10") && said.contains("test accuracy"), "{said}");
    assert!(!said.contains("not authenticated"), "the token was not used: {said}");

    // The same training on one machine, 2 processes.
    let accel = super::build_dir().join("accel");
    let mut cmd = Command::new(&accel);
    cmd.args(["launch", "--num-processes", "2", "--main-process-port", "0", "--cpu"])
        .arg(example("train"))
        .args(["--epochs", "10", "--out"])
        .arg(dir.join("one-machine"));
    succeeded(&run_for(cmd, 240, "train on one machine"), "train on one machine");
    let losses = |path: &Path| -> Vec<f64> {
        let text = std::fs::read_to_string(path).unwrap();
        let rows = text.lines().map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap());
        rows.filter_map(|row| row.get("loss").and_then(|l| l.as_f64())).collect()
    };
    let two = losses(&home.join("runs/digits/metrics.jsonl"));
    let reference = losses(&dir.join("one-machine/metrics.jsonl"));
    assert_eq!(two.len(), 10, "{two:?}");
    for (epoch, (a, b)) in two.iter().zip(&reference).enumerate() {
        assert!((a - b).abs() <= 1e-6, "epoch {}: loss {a} on 2 machines, {b} on one", epoch + 1);
    }
    eprintln!("docs/two-machines.md: trained as on one machine ({two:?})");
}
