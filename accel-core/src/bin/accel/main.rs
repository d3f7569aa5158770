//! `accel`: the command-line tool of accel-core.

mod env;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

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
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Env => {
            print!("{}", env::report());
            ExitCode::SUCCESS
        }
    }
}
