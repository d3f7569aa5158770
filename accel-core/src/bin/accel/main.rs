//! `accel`: launch, configure and check distributed runs.

mod bench;
mod compare;
mod env;
mod estimate;
mod flags;
#[cfg(test)]
mod reference;
mod selftest;
mod setup;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use accel_core::launch::config::{LaunchConfig, default_config_path};
use accel_core::launch::{LaunchPlan, parse_seconds, run};
use clap::{Args, Parser, Subcommand};
use tch::Tensor;

/// Distributed training for tch: launch, configure and check runs.
#[derive(Debug, Parser)]
#[command(name = "accel", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Print versions, CUDA, NCCL, CPU and the distributed variables in effect: what to
    /// paste into a bug report.
    Env,
    /// Set up the crate in DIR to build against accel: find or install libtorch 2.11.0, write
    /// its .cargo/config.toml (LIBTORCH) and the one-line build.rs.
    Setup {
        /// The crate's folder.
        #[arg(long, default_value = ".")]
        dir: PathBuf,
        /// A Python whose torch to use (default: python3 on the PATH; without torch 2.11.0
        /// there, a .venv is made in the crate).
        #[arg(long)]
        python: Option<PathBuf>,
    },
    /// Start PROGRAM as the processes of a run (this machine's share).
    Launch(LaunchArgs),
    /// Write a launch config file (asks questions; `accel config default` does not), or
    /// `accel config check FILE` (what accel makes of each key of an Accelerate YAML or
    /// DeepSpeed JSON), or `accel config update FILE` (rewrite it with accel's current keys,
    /// the original kept as FILE.orig).
    Config {
        /// `default`, `check` or `update`; none: ask questions.
        mode: Option<String>,
        /// The file `check` and `update` read (default: --config-file, else the default
        /// config).
        file: Option<PathBuf>,
        /// Where to write (default: ~/.config/accel/default_config.yaml).
        #[arg(long)]
        config_file: Option<PathBuf>,
    },
    /// Launch a multi-process self-check: every collective, data sharding, RNG agreement,
    /// a short training parity. One line per check.
    Test(LaunchArgs),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Profiles written by `Accelerator::profile`.
    #[command(subcommand)]
    Profile(ProfileCommand),
    /// Put a checkpoint's sharded weights back together (zero2/zero3 runs save one shard
    /// per process) into one safetensors file of the whole model.
    MergeWeights {
        /// A folder written by `save_state`.
        dir: PathBuf,
        /// The safetensors file to write.
        out: PathBuf,
        /// Which prepared model (0 = the first).
        #[arg(long, default_value_t = 0)]
        model: usize,
    },
    /// Compare two safetensors files tensor by tensor: the largest difference of each, and
    /// failure when one exceeds the tolerance or the names, shapes or dtypes differ.
    CompareWeights {
        /// One file.
        a: PathBuf,
        /// The other.
        b: PathBuf,
        /// The largest absolute difference allowed.
        #[arg(long, default_value_t = 1e-6)]
        tolerance: f64,
    },
    /// Draw a run's metrics (a metrics.jsonl: one JSON record per line with `step`) as
    /// curves with axes, labels and legends: PNG and SVG.
    Plot {
        /// The metrics file.
        metrics: PathBuf,
        /// Files to write (`.svg` as SVG, others as PNG); default: METRICS with .png and .svg.
        #[arg(long)]
        out: Vec<PathBuf>,
        /// The title (default: the metrics file's folder).
        #[arg(long)]
        title: Option<String>,
    },
    /// Per-process memory of parameters, gradients and optimizer state under each strategy,
    /// for a safetensors model or a parameter count.
    EstimateMemory {
        /// A safetensors file (only its header is read).
        model: Option<PathBuf>,
        /// A parameter count instead of a file.
        #[arg(long)]
        params: Option<u64>,
        /// Process counts, comma separated.
        #[arg(long, default_value = "1,2,4,8")]
        num_processes: String,
        /// adamw, adam, sgd-momentum or sgd.
        #[arg(long, default_value = "adamw")]
        optimizer: String,
    },
    /// Internal: what `accel test` / `accel bench` run in each process.
    #[command(hide = true)]
    Worker {
        /// `test` or `allreduce`.
        what: String,
        /// Benchmark sizes.
        #[arg(long, default_value = "1MiB,4MiB,16MiB,64MiB")]
        sizes: String,
        /// Benchmark dtype.
        #[arg(long, default_value = "f32")]
        dtype: String,
        /// Benchmark backend.
        #[arg(long, default_value = "cpu")]
        backend: String,
    },
}

#[derive(Debug, Subcommand)]
enum ProfileCommand {
    /// Where a step's time went in each trace (one per process), and how much of the
    /// communication overlapped forward and backward.
    Summary {
        /// Trace files (`trace_rank{r}.json`), or folders of them.
        traces: Vec<PathBuf>,
    },
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// All-reduce time and bandwidth per size, like nccl-tests' all_reduce_perf.
    Allreduce {
        #[command(flatten)]
        launch: LaunchArgs,
        /// Message sizes (KiB, MiB, GiB suffixes).
        #[arg(long, default_value = "1MiB,4MiB,16MiB,64MiB")]
        sizes: String,
        /// Element type: f32, f64, f16, bf16, i64.
        #[arg(long, default_value = "f32")]
        dtype: String,
        /// `cpu` (accel's transport) or `nccl` (one GPU per process).
        #[arg(long, default_value = "cpu")]
        backend: String,
        /// Also run torch.distributed on the same sizes and backend (gloo for cpu, NCCL for
        /// nccl) with torchrun, and print the ratios.
        #[arg(long, alias = "compare-gloo")]
        compare: bool,
    },
}

/// Flags of `accel launch` (and of the commands that launch something).
#[derive(Debug, Args, Clone)]
struct LaunchArgs {
    /// Processes on this machine.
    #[arg(long)]
    num_processes: Option<usize>,
    /// Machines in the run.
    #[arg(long)]
    num_machines: Option<usize>,
    /// This machine's index (0 hosts the rendezvous store).
    #[arg(long)]
    machine_rank: Option<usize>,
    /// Address of machine 0.
    #[arg(long)]
    main_process_ip: Option<String>,
    /// Port of the rendezvous store on machine 0 (0: a free port, one machine only).
    #[arg(long)]
    main_process_port: Option<u16>,
    /// Launch config file (default: ~/.config/accel/default_config.yaml when it exists).
    #[arg(long)]
    config_file: Option<PathBuf>,
    /// The run's settings (one flag per setting of the table).
    #[command(flatten)]
    settings: flags::SettingFlags,
    /// GPUs the processes may use (`0,1`), passed as CUDA_VISIBLE_DEVICES.
    #[arg(long)]
    gpu_ids: Option<String>,
    /// Threads of each process's CPU kernels, passed as OMP_NUM_THREADS (default: cores ÷
    /// processes).
    #[arg(long)]
    num_cpu_threads_per_process: Option<usize>,
    /// Write each rank's output to DIR/rank{N}.log as well (torchrun's --log-dir / --tee).
    #[arg(long)]
    log_dir: Option<PathBuf>,
    /// Timeout of rendezvous and collectives in seconds, passed as ACCEL_TIMEOUT_SECS (and
    /// as ACCEL_NCCL_TIMEOUT, the NCCL watchdog's; 10 min by default).
    #[arg(long, value_parser = |s: &str| parse_seconds(s, false))]
    timeout: Option<f64>,
    /// Show only rank 0's output.
    #[arg(long)]
    rank0_only: bool,
    /// Restart the whole group this many times after a failure.
    #[arg(long, default_value_t = 0)]
    max_restarts: usize,
    /// Seconds between SIGTERM and SIGKILL when stopping processes.
    #[arg(long, default_value_t = 5.0, value_parser = |s: &str| parse_seconds(s, true))]
    grace: f64,
    /// The program and its arguments.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    program: Vec<String>,
}

impl LaunchArgs {
    /// Flags over the config file over defaults.
    fn plan(&self, program: Vec<String>) -> accel_core::Result<LaunchPlan> {
        let file =
            match self.config_file.clone().or_else(|| default_config_path().filter(|p| p.exists()))
            {
                Some(path) => LaunchConfig::from_file(&path)?,
                None => LaunchConfig::default(),
            };
        let flags = LaunchConfig {
            num_processes: self.num_processes,
            num_machines: self.num_machines,
            machine_rank: self.machine_rank,
            main_process_ip: self.main_process_ip.clone(),
            main_process_port: self.main_process_port,
            training: self.settings.config()?,
            gpu_ids: self.gpu_ids.clone(),
            num_cpu_threads_per_process: self.num_cpu_threads_per_process,
            ..Default::default()
        };
        let config = file.overlay(&flags);
        for warning in &config.warnings {
            eprintln!("accel launch: {warning}");
        }
        config.training.build()?;
        let mut env: Vec<(String, String)> =
            config.training_env().into_iter().map(|(k, v)| (k.to_owned(), v)).collect();
        if let Some(t) = self.timeout {
            env.push((accel_core::config::env::TIMEOUT_SECS.into(), t.to_string()));
            env.push((accel_core::config::env::NCCL_TIMEOUT.into(), t.to_string()));
        }
        // `srun accel launch ...`, once per node: the machines are Slurm's unless named.
        let slurm = if config.num_machines.is_none() && config.machine_rank.is_none() {
            accel_core::topology::SlurmMachines::from_env_with(|k| std::env::var(k).ok())?
        } else {
            None
        };
        if let Some(m) = &slurm {
            eprintln!(
                "accel launch: Slurm step: machine {} of {}, store on {}:{}",
                m.machine_rank,
                m.num_machines,
                config.main_process_ip.as_deref().unwrap_or(&m.main_process_ip),
                config.main_process_port.unwrap_or(m.main_process_port)
            );
        }
        Ok(LaunchPlan {
            program,
            num_processes: config.num_processes.unwrap_or(1),
            num_machines: config
                .num_machines
                .or(slurm.as_ref().map(|m| m.num_machines))
                .unwrap_or(1),
            machine_rank: config
                .machine_rank
                .or(slurm.as_ref().map(|m| m.machine_rank))
                .unwrap_or(0),
            main_process_ip: config
                .main_process_ip
                .or(slurm.as_ref().map(|m| m.main_process_ip.clone()))
                .unwrap_or_else(|| "127.0.0.1".into()),
            main_process_port: config
                .main_process_port
                .or(slurm.as_ref().map(|m| m.main_process_port))
                .unwrap_or(29500),
            env,
            rank0_only: self.rank0_only,
            max_restarts: self.max_restarts,
            grace: Duration::from_secs_f64(self.grace),
            log_dir: self.log_dir.clone(),
        })
    }
}

fn launch(args: &LaunchArgs, program: Vec<String>) -> ExitCode {
    let result = args.plan(program).and_then(|plan| run(&plan));
    match result {
        Ok(code) => ExitCode::from(code.clamp(0, 255) as u8),
        Err(e) => {
            eprintln!("accel launch: {e}");
            ExitCode::FAILURE
        }
    }
}

fn this_binary() -> String {
    std::env::current_exe().map_or_else(|_| "accel".into(), |p| p.display().to_string())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Env => {
            print!("{}", env::report());
            ExitCode::SUCCESS
        }
        Command::Launch(args) => launch(&args, args.program.clone()),
        Command::Test(args) => {
            let mut args = args;
            args.num_processes = args.num_processes.or(Some(2));
            args.rank0_only = true;
            launch(&args, vec![this_binary(), "worker".into(), "test".into()])
        }
        Command::Bench(BenchCommand::Allreduce {
            launch: args,
            sizes,
            dtype,
            backend,
            compare,
        }) => bench::allreduce(&args, &sizes, &dtype, &backend, compare),
        Command::MergeWeights { dir, out, model } => {
            let result = accel_core::merge_weights(&dir, model).and_then(|weights| {
                Tensor::write_safetensors(&weights, &out).map_err(|e| accel_core::Error::Io {
                    path: out.clone(),
                    source: std::io::Error::other(e.to_string()),
                })?;
                Ok(weights)
            });
            match result {
                Ok(weights) => {
                    let elements: i64 = weights.iter().map(|(_, t)| t.numel() as i64).sum();
                    println!(
                        "wrote {} tensors ({elements} elements) to {}",
                        weights.len(),
                        out.display()
                    );
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("accel merge-weights: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::Profile(ProfileCommand::Summary { traces }) => {
            let mut files = Vec::new();
            for t in traces {
                match std::fs::read_dir(&t) {
                    Ok(dir) => {
                        let mut found: Vec<PathBuf> = dir
                            .filter_map(|e| e.ok().map(|e| e.path()))
                            .filter(|p| p.extension().is_some_and(|e| e == "json"))
                            .collect();
                        found.sort();
                        files.extend(found);
                    }
                    Err(_) => files.push(t),
                }
            }
            if files.is_empty() {
                eprintln!("accel profile summary: no trace given");
                return ExitCode::FAILURE;
            }
            for file in files {
                match accel_core::profile::summarize(&file) {
                    Ok(summary) => println!("{summary}\n"),
                    Err(e) => {
                        eprintln!("accel profile summary: {e}");
                        return ExitCode::FAILURE;
                    }
                }
            }
            ExitCode::SUCCESS
        }
        Command::Setup { dir, python } => match setup::run(&dir, python.as_deref()) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("accel setup: {e}");
                ExitCode::FAILURE
            }
        },
        Command::CompareWeights { a, b, tolerance } => match compare::weights(&a, &b, tolerance) {
            Ok(true) => ExitCode::SUCCESS,
            Ok(false) => ExitCode::FAILURE,
            Err(e) => {
                eprintln!("accel compare-weights: {e}");
                ExitCode::FAILURE
            }
        },
        Command::Plot { metrics, out, title } => {
            let outs = if out.is_empty() {
                vec![metrics.with_extension("png"), metrics.with_extension("svg")]
            } else {
                out
            };
            let title = title.unwrap_or_else(|| {
                let folder = metrics.parent().and_then(|p| p.file_name());
                folder.map_or_else(|| metrics.display().to_string(), |f| f.to_string_lossy().into())
            });
            let refs: Vec<&std::path::Path> = outs.iter().map(PathBuf::as_path).collect();
            match accel_core::tracking::plot::plot_jsonl(&metrics, &title, &refs) {
                Ok(()) => {
                    for o in &outs {
                        println!("wrote {}", o.display());
                    }
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("accel plot: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::EstimateMemory { model, params, num_processes, optimizer } => {
            let result = (|| -> accel_core::Result<String> {
                let params = match (model, params) {
                    (Some(path), None) => estimate::count_parameters(&path)?,
                    (None, Some(n)) => n,
                    _ => {
                        return Err(accel_core::Error::Config(
                            "give a safetensors file or --params N (one of the two)".into(),
                        ));
                    }
                };
                let processes = num_processes
                    .split(',')
                    .map(|n| n.trim().parse::<usize>().ok().filter(|&n| n > 0))
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(|| {
                        accel_core::Error::Config(format!(
                            "--num-processes {num_processes:?}: expected e.g. 1,2,4"
                        ))
                    })?;
                estimate::table(params, &processes, &optimizer)
            })();
            match result {
                Ok(text) => {
                    print!("{text}");
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("accel estimate-memory: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::Config { mode: Some(mode), file, config_file }
            if mode == "check" || mode == "update" =>
        {
            let Some(path) =
                file.or(config_file).or_else(|| default_config_path().filter(|p| p.exists()))
            else {
                eprintln!("accel config {mode}: give the file: accel config {mode} FILE");
                return ExitCode::FAILURE;
            };
            let result = if mode == "check" { config::check(&path) } else { config::update(&path) };
            match result {
                Ok(true) => ExitCode::SUCCESS,
                Ok(false) => ExitCode::FAILURE,
                Err(e) => {
                    eprintln!("accel config {mode}: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::Config { mode, file, config_file } => {
            match config::run(mode.as_deref(), config_file.or(file)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("accel config: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::Worker { what, sizes, dtype, backend } => {
            let result = match what.as_str() {
                "test" => selftest::run(),
                "allreduce" => bench::worker(&sizes, &dtype, &backend),
                "spin" => selftest::spin(false),
                "spin-nccl" => selftest::spin(true),
                "ddp" => selftest::ddp(),
                "nccl" => selftest::nccl(),
                other => Err(accel_core::Error::Config(format!("unknown worker `{other}`"))),
            };
            match result {
                Ok(true) => ExitCode::SUCCESS,
                Ok(false) => ExitCode::FAILURE,
                Err(e) => {
                    eprintln!("accel: {e}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}

mod config {
    //! `accel config`: a few questions, or the defaults, written as YAML.

    use std::io::{BufRead, Write};
    use std::path::PathBuf;

    use accel_core::launch::config::{LaunchConfig, choices, default_config_path};

    fn ask(question: &str, default: &str) -> String {
        print!("{question} [{default}]: ");
        let _ = std::io::stdout().flush();
        let mut line = String::new();
        let _ = std::io::stdin().lock().read_line(&mut line);
        let answer = line.trim();
        if answer.is_empty() { default.to_owned() } else { answer.to_owned() }
    }

    /// Prints what accel makes of each key of `path`; whether `accel launch` takes it.
    pub(crate) fn check(path: &std::path::Path) -> accel_core::Result<bool> {
        let config = LaunchConfig::check(path)?;
        println!("{}", config.report);
        let refused = config.report.counts()[3];
        if refused == 0 {
            println!("accel launch takes {}", path.display());
        } else {
            println!(
                "accel launch refuses {}: {refused} key(s) refused (see above)",
                path.display()
            );
        }
        Ok(refused == 0)
    }

    /// Rewrites `path` with accel's current keys (what `check` says it means), keeping the
    /// original beside it as `<name>.orig`.
    pub(crate) fn update(path: &std::path::Path) -> accel_core::Result<bool> {
        let config = LaunchConfig::from_file(path)?;
        let io = |p: &std::path::Path| {
            let p = p.to_path_buf();
            move |source| accel_core::Error::Io { path: p, source }
        };
        let mut original = path.as_os_str().to_owned();
        original.push(".orig");
        let original = PathBuf::from(original);
        std::fs::copy(path, &original).map_err(io(&original))?;
        let target = if path.extension().is_some_and(|e| e.eq_ignore_ascii_case("json")) {
            path.with_extension("yaml")
        } else {
            path.to_path_buf()
        };
        let yaml = config.to_yaml();
        // Written to a temporary file, then renamed: a failure leaves the old file whole.
        let tmp = target.with_extension("yaml.tmp");
        std::fs::write(&tmp, &yaml).map_err(io(&tmp))?;
        std::fs::rename(&tmp, &target).map_err(io(&target))?;
        println!(
            "accel config update: wrote {} (the original is {})",
            target.display(),
            original.display()
        );
        Ok(true)
    }

    pub(crate) fn run(mode: Option<&str>, path: Option<PathBuf>) -> accel_core::Result<()> {
        let path = path.or_else(default_config_path).ok_or_else(|| {
            accel_core::Error::Config("no HOME or XDG_CONFIG_HOME; pass --config-file".into())
        })?;
        let yaml = match mode {
            Some("default") => {
                "num_processes: 1\nnum_machines: 1\nstrategy: single\nprecision: no\n".to_owned()
            }
            None => {
                let (strategies, precisions) = choices();
                let gpu = tch::Cuda::is_available();
                let mut text = String::new();
                text.push_str(&format!("num_machines: {}\n", ask("How many machines?", "1")));
                let machines: usize =
                    text.trim().rsplit(' ').next().and_then(|n| n.parse().ok()).unwrap_or(1);
                if machines > 1 {
                    text.push_str(&format!(
                        "machine_rank: {}\n",
                        ask("Rank of this machine?", "0")
                    ));
                    text.push_str(&format!(
                        "main_process_ip: {}\n",
                        ask("IP address of machine 0?", "127.0.0.1")
                    ));
                    text.push_str(&format!(
                        "main_process_port: {}\n",
                        ask("Port on machine 0?", "29500")
                    ));
                }
                let default_procs =
                    if gpu { tch::Cuda::device_count().to_string() } else { "2".into() };
                text.push_str(&format!(
                    "num_processes: {}\n",
                    ask("How many processes on this machine?", &default_procs)
                ));
                text.push_str(&format!(
                    "strategy: {}\n",
                    ask(&format!("Strategy ({})?", strategies.join(", ")), "ddp")
                ));
                text.push_str(&format!(
                    "precision: {}\n",
                    ask(&format!("Mixed precision ({})?", precisions.join(", ")), "no")
                ));
                text.push_str(&format!(
                    "accumulate: {}\n",
                    ask("Gradient accumulation steps?", "1")
                ));
                text.push_str(&format!(
                    "cpu: {}\n",
                    ask("CPU only?", if gpu { "false" } else { "true" })
                ));
                text
            }
            Some(other) => {
                return Err(accel_core::Error::Config(format!(
                    "unknown mode `{other}`; use `accel config` (questions) or `accel config default`"
                )));
            }
        };
        // Check what we write by reading it back.
        let config = LaunchConfig::from_yaml(&yaml)?;
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)
                .map_err(|source| accel_core::Error::Io { path: dir.into(), source })?;
        }
        std::fs::write(&path, config.to_yaml())
            .map_err(|source| accel_core::Error::Io { path: path.clone(), source })?;
        println!("accel config: wrote {}", path.display());
        Ok(())
    }
}
