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
    #[error("libtorch: {}", torch_text(.0))]
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

    // ---- configuration ---------------------------------------------------------------
    /// A configuration value (attribute, builder, environment or file) is invalid.
    #[error("invalid configuration: {0}")]
    Config(String),

    /// The request is valid but this build of accel cannot do it (yet).
    #[error("not supported: {0}")]
    Unsupported(String),

    // ---- training ------------------------------------------------------------------
    /// A training step went wrong in a way the user must fix (e.g. a loss that is not a
    /// scalar).
    #[error("{0}")]
    Training(String),

    /// An experiment tracker could not record (its server, its files).
    #[error("tracker: {0}")]
    Tracker(String),

    // ---- processes -----------------------------------------------------------------
    /// Finding the other processes failed (rank taken, timeout, bad message ...).
    #[error("rendezvous: {0}")]
    Rendezvous(String),

    /// The connection to the rendezvous store (on rank 0) broke: rank 0 has probably exited.
    #[error("rendezvous: lost the store at {addr} ({detail}); rank 0 may have exited")]
    StoreLost {
        /// The store's address.
        addr: String,
        /// What the connection said.
        detail: String,
    },

    /// The ranks issued different collectives between two optimizer steps (the sequence
    /// check of `comm::ledger`): names each side's diverging call and its source line.
    #[error("{0}")]
    Diverged(String),

    /// A collective operation failed: timed out, mismatched between ranks, or a peer left.
    #[error("collective #{seq} {op} of {what} on rank {rank}: {message}")]
    Collective {
        /// The operation.
        op: crate::collective::Op,
        /// Its sequence number in this process group (the same on every rank).
        seq: u64,
        /// Shape and dtype of the data.
        what: String,
        /// This process's rank.
        rank: usize,
        /// What went wrong and, for timeouts, the ranks that did not arrive.
        message: String,
    },

    /// An NCCL call failed.
    #[error("{call} failed on rank {rank}{during}: {message}")]
    Nccl {
        /// The NCCL function, e.g. `ncclCommInitRankConfig`.
        call: String,
        /// NCCL's result code.
        code: i32,
        /// This process's rank in the run.
        rank: usize,
        /// The operation it was part of (`" in collective #12 all_reduce(sum) of [4] Float"`),
        /// or empty.
        during: String,
        /// NCCL's text for the code, and `ncclGetLastError`'s where there is one.
        message: String,
    },

    // ---- checkpoints ---------------------------------------------------------------
    /// A checkpoint cannot be written or read back; says which file and which tensor.
    #[error("checkpoint{}: {message}", path.as_ref().map(|p| format!(" {}", p.display())).unwrap_or_default())]
    Checkpoint {
        /// The file or folder concerned, when known.
        path: Option<PathBuf>,
        /// What is wrong.
        message: String,
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

impl From<accel_choices::UnknownChoice> for Error {
    fn from(e: accel_choices::UnknownChoice) -> Self {
        Error::Config(e.to_string())
    }
}

/// So that `?` on accel calls works in functions returning tch's `Result`.
impl From<Error> for tch::TchError {
    fn from(e: Error) -> Self {
        match e {
            Error::Torch(inner) => inner,
            other => tch::TchError::Torch(other.to_string()),
        }
    }
}

/// libtorch's message without the C++ backtrace that follows it (~25 `frame #N` lines),
/// unless asked for as PyTorch does (`TORCH_SHOW_CPP_STACKTRACES=1`) or with
/// `RUST_BACKTRACE`.
pub(crate) fn torch_text(error: &tch::TchError) -> String {
    let text = match error {
        tch::TchError::Torch(message) => message.clone(),
        other => other.to_string(),
    };
    let wanted = |key: &str| std::env::var(key).is_ok_and(|v| !v.is_empty() && v != "0");
    if wanted("TORCH_SHOW_CPP_STACKTRACES") || wanted("RUST_BACKTRACE") {
        return text;
    }
    match text.find("\nException raised from ") {
        Some(end) => text[..end].to_owned(),
        None => text,
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn libtorch_errors_come_without_their_cpp_backtrace() {
        let a = tch::Tensor::zeros([2, 3], (tch::Kind::Float, tch::Device::Cpu));
        let text = super::Error::from(a.f_matmul(&a).unwrap_err()).to_string();
        assert!(text.contains("shapes cannot be multiplied (2x3 and 2x3)"), "{text}");
        if std::env::var_os("RUST_BACKTRACE").is_none()
            && std::env::var_os("TORCH_SHOW_CPP_STACKTRACES").is_none()
        {
            assert_eq!(text.lines().count(), 1, "{text}");
        }
    }
}
