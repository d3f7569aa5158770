//! The one error type of accel-core. Every message says what went wrong, where, and what
//! to do about it.

use std::path::PathBuf;

/// `Result` with accel's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything accel-core can fail with, grouped by area.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    // ---- libtorch -------------------------------------------------------------------
    /// A libtorch call made through tch failed.
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),

    /// A call into accel's libtorch shim (csrc/shim.cpp) failed.
    #[error("libtorch ({op}): {message}")]
    Libtorch {
        /// The shim operation, e.g. `add_post_accumulate_grad_hook`.
        op: &'static str,
        /// libtorch's message.
        message: String,
    },

    // ---- devices --------------------------------------------------------------------
    /// CUDA was asked for and cannot be used; `diagnosis` says which link is missing.
    #[error("CUDA was requested ({requested}) but is not available: {diagnosis}")]
    CudaUnavailable {
        /// What asked for it, e.g. `device cuda:1`.
        requested: String,
        /// The first missing piece and the way out.
        diagnosis: String,
    },

    // ---- files ----------------------------------------------------------------------
    /// Reading or writing a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
}
