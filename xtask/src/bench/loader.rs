//! `cargo xtask bench loader`: the data loader's workers against a slow data set.

use std::process::Command;

use crate::{cargo, root, run};

/// The data loader's workers (`num_workers`) against a data set whose samples cost CPU time
/// to make: an epoch's time and the share of it the training loop waited for data.
pub(crate) fn loader_bench() -> Result<(), String> {
    cargo(&["build", "--release", "-p", "accel-examples", "--example", "loader_bench"], &[])?;
    run(&mut Command::new(root().join("target/release/examples/loader_bench")))
}
